//! The workspace a user writes, read and checked before anything runs:
//!
//! ```text
//! DIR/arbor.toml               optional: [limits], [budget], [providers.NAME],
//!                              [sandbox], [mcp.servers.NAME], [approvals],
//!                              [journal], [record], [telemetry]; [service]
//!                              is arbord's, read by arbor-service
//! DIR/agents/NAME/agent.md     YAML front matter between `---` lines, then the system prompt
//! DIR/flows/NAME.toml          optional: groups of steps, a budget, a timeout
//! ```
//!
//! Loading reads every file and checks what the protocol types cannot, so a run
//! never starts on a workspace with a typo in it. The first problem found is
//! returned as one line that names the file (relative to the workspace) and the
//! key, e.g. `agents/planner/agent.md: subagent `ghost` is not an agent in agents/`.
//!
//! Invariants, true of every `Workspace` that `load` or `from_texts` returns:
//! 1. Every agent named anywhere (a `subagents` entry, a flow step) exists.
//! 2. Every agent offered as a sub-agent has a non-empty description: the model
//!    picks sub-agents by it.
//! 3. Every budget is a positive whole number of tokens, or of micro-dollars
//!    (I-09), and a usd ceiling covers only models with a price.
//! 4. Agent and flow names are `[a-z0-9_-]+`, and an agent's `name:` equals its folder.
//! 5. Loading is deterministic: files are checked in name order, so the same
//!    broken workspace always reports the same problem.

use arbor_protocol::agent::{FrontMatter, ScriptCallSpec, ScriptTurnSpec};
use arbor_protocol::mcp::{
    DEFAULT_CALL_TIMEOUT, DEFAULT_START_TIMEOUT, HttpServer, McpTransport, Piece, RESERVED_HEADERS,
    StdioServer, check_server_name, placeholders,
};
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    AgentDef, ApprovalSettings, BudgetArg, FlowSpec, Limits, McpPattern, McpServerSpec, ModelRef,
    Network, Offer, Resources, ResourcesSpec, RunSpec, SandboxMode, ScriptCall, ScriptTurn,
    ToolName, ToolRef,
};
use arbor_providers::{Provider, ProviderFile, check_provider};
use arbor_sandbox::seal::SandboxIsolation;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A run's root grant when neither the flow, arbor.toml nor the caller gives one.
pub const DEFAULT_BUDGET_TOKENS: u64 = 1_000_000;

/// Everything a node needs from a user's workspace, checked.
#[derive(Clone, Debug)]
pub struct Workspace {
    pub root: PathBuf,
    pub config: Config,
    pub agents: BTreeMap<String, AgentDef>,
    pub flows: BTreeMap<String, FlowSpec>,
    /// Each definition's SHA-256 by its path: `arbor.toml` (of its text, or
    /// of nothing), `agents/NAME/agent.md`, `flows/NAME.toml`.
    pub digests: BTreeMap<String, String>,
}

/// `arbor.toml`, with defaults applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub limits: Limits,
    /// A run's budget when neither its flow nor the caller gives one.
    pub budget_tokens: u64,
    /// A run's usd ceiling, in micro-dollars, when neither its flow nor the caller gives one.
    pub budget_usd_micros: Option<u64>,
    /// `[providers.NAME]`: where agents that name `NAME/MODEL` get their model.
    pub providers: BTreeMap<String, Provider>,
    /// `[service]`, as written: arbord's settings, which arbord checks
    /// (an embedded node has no use for them).
    pub service: toml::Table,
    /// `[sandbox]`: the rlimits of every command, and the most an agent's
    /// `resources:` may ask.
    pub sandbox: Resources,
    /// `[sandbox] mode`: sealed (the default) or none (development only).
    pub isolation: SandboxIsolation,
    /// `[sandbox] secrets_file`, relative to the workspace: `NAME=value`
    /// lines, readable by its owner only. Values not in it come from the
    /// node's environment.
    pub secrets_file: Option<PathBuf>,
    /// `[mcp.servers.NAME]`: the MCP servers agents may name.
    pub mcp: BTreeMap<String, Arc<McpServerSpec>>,
    /// `[approvals]`: tools every agent asks about, a card's wait, its warning.
    pub approvals: ApprovalSettings,
    /// `[journal]`: where the node keeps its journal.
    pub journal: JournalConfig,
    /// `[record] models`: every run records its model exchanges and tool
    /// results, so it can be replayed (docs/replay.md).
    pub record_models: bool,
    /// `[telemetry]`: where traces go, if anywhere (docs/operations.md, "Traces").
    pub telemetry: crate::telemetry::TelemetryConfig,
}

/// `[journal]`: the node's journal in sled under its data dir (the
/// default), or in a PostgreSQL schema (docs/cluster.md).
#[derive(Clone, Debug, PartialEq)]
pub enum JournalConfig {
    Sled,
    Postgres {
        /// `url`; `ARBOR_DATABASE_URL` wins over it (a URL may carry a
        /// password, which belongs in the environment, not in a file).
        url: Option<String>,
        /// `schema` (`arbor`).
        schema: String,
        /// `lease` (10 s): how long a node owns a run without renewing.
        lease: Duration,
        /// `connect_timeout` (60 s): how long a start waits for the server.
        connect_for: Duration,
        /// This node's id: `--node-id`, else `ARBOR_NODE_ID`, else the
        /// host's name (`node_id`).
        node: Option<String>,
    },
}

impl JournalConfig {
    /// Names this node (`--node-id`); the sled journal has no use for it.
    pub fn name_node(&mut self, id: Option<String>) {
        if let (JournalConfig::Postgres { node, .. }, Some(id)) = (self, id) {
            *node = Some(id);
        }
    }
}

/// A node's id as `--node-id` takes it: 1 to 64 letters, digits, `.`, `_`
/// or `-` (a host's name fits).
pub fn parse_node_id(id: &str) -> Result<String, String> {
    let plain = !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if plain {
        Ok(id.to_string())
    } else {
        Err(format!(
            "{id:?} is not a node id: use 1 to 64 letters, digits, '.', '_' or '-'"
        ))
    }
}

/// A run's lease when `[journal] lease` does not say.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// The node's sandbox limits when arbor.toml's `[sandbox]` does not say.
/// A sealed command's processes are counted apart from everyone else's (a
/// uid of its sandbox's own, or a user namespace), so 512 stops a fork bomb
/// and nothing else.
pub const DEFAULT_SANDBOX: Resources = Resources {
    memory_bytes: Some(4 << 30),
    cpu_secs: Some(600),
    file_size_bytes: Some(1 << 30),
    open_files: Some(1024),
    processes: Some(512),
};

/// The defaults under `[sandbox] mode = "none"`: processes are not limited,
/// because on the host the kernel counts every process of the node's user
/// against RLIMIT_NPROC.
pub const DEFAULT_UNSEALED: Resources = Resources {
    processes: None,
    ..DEFAULT_SANDBOX
};

/// Why a workspace can't be used. Each message is one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: not a directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error("{}: no agents found", path.display())]
    NoAgents { path: PathBuf },
    /// The file could not be read (the io error is part of the message, not a source,
    /// so that printing the chain does not say it twice).
    #[error("{}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The file was read, but what it says is wrong: bad syntax, an unknown key, a
    /// value out of range, a name that does not resolve.
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("flows/{name}.toml: no such flow (known: {known})")]
    UnknownFlow { name: String, known: String },
    #[error("agents/{name}/agent.md: no such agent (known: {known})")]
    UnknownAgent { name: String, known: String },
    #[error("budget override: must be more than 0 (0 never means unlimited)")]
    ZeroBudgetOverride,
    /// A run this workspace cannot keep its promises on.
    #[error("{message}")]
    Refused { message: String },
}

impl Default for Config {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            budget_tokens: DEFAULT_BUDGET_TOKENS,
            budget_usd_micros: None,
            providers: BTreeMap::new(),
            service: toml::Table::new(),
            sandbox: DEFAULT_SANDBOX,
            isolation: SandboxIsolation::Sealed,
            secrets_file: None,
            mcp: BTreeMap::new(),
            approvals: ApprovalSettings::default(),
            journal: JournalConfig::Sled,
            record_models: false,
            telemetry: Default::default(),
        }
    }
}

impl Workspace {
    /// Reads and checks everything; the first problem is returned, naming the file and the key.
    ///
    /// In `agents/`, every folder not starting with `.` must hold an `agent.md`;
    /// loose files are ignored. In `flows/`, every `*.toml` file is a flow.
    pub fn load(dir: &Path) -> Result<Workspace, LoadError> {
        if !dir.is_dir() {
            return Err(LoadError::NotADirectory {
                path: dir.to_path_buf(),
            });
        }
        let config_path = dir.join("arbor.toml");
        let config_text = if config_path.exists() {
            Some(read(&config_path)?)
        } else {
            None
        };

        let agents_dir = dir.join("agents");
        if !agents_dir.is_dir() {
            return Err(LoadError::NoAgents { path: agents_dir });
        }
        let mut agent_texts = Vec::new();
        for (name, path) in list_dir(&agents_dir)? {
            if !path.is_dir() || name.starts_with('.') {
                continue;
            }
            let file = path.join("agent.md");
            if !file.is_file() {
                return Err(LoadError::Invalid {
                    path: PathBuf::from(format!("agents/{name}")),
                    message: "no agent.md in this folder".into(),
                });
            }
            agent_texts.push((name, read(&file)?));
        }

        let mut flow_texts = Vec::new();
        let flows_dir = dir.join("flows");
        if flows_dir.is_dir() {
            for (file_name, path) in list_dir(&flows_dir)? {
                let Some(name) = file_name.strip_suffix(".toml") else {
                    continue;
                };
                if path.is_file() {
                    flow_texts.push((name.to_string(), read(&path)?));
                }
            }
        }

        let agents: Vec<(&str, &str)> = agent_texts
            .iter()
            .map(|(name, text)| (name.as_str(), text.as_str()))
            .collect();
        let flows: Vec<(&str, &str)> = flow_texts
            .iter()
            .map(|(name, text)| (name.as_str(), text.as_str()))
            .collect();
        Self::from_texts(dir.to_path_buf(), config_text.as_deref(), &agents, &flows)
    }

    /// Builds a Workspace from in-memory texts (for the test harness): agents as
    /// (name, agent.md text), flows as (name, flow TOML text). Checks exactly what
    /// `load` checks.
    pub fn from_texts(
        root: PathBuf,
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
    ) -> Result<Workspace, LoadError> {
        let mut config = match arbor_toml {
            Some(text) => parse_config(text, &root)?,
            None => Config::default(),
        };
        config.secrets_file = config.secrets_file.map(|f| root.join(f));

        if agents.is_empty() {
            return Err(LoadError::NoAgents {
                path: root.join("agents"),
            });
        }
        let mut agent_defs = BTreeMap::new();
        for &(name, text) in sorted(agents) {
            let path = agent_path(name);
            let agent = parse_agent(name, text, &path)?;
            if agent_defs.insert(name.to_string(), agent).is_some() {
                return Err(invalid(&path, "defined twice"));
            }
        }
        check_subagents(&agent_defs)?;
        check_mcp_servers(&agent_defs, &config)?;
        check_resources(&mut agent_defs, &config)?;
        check_models(&agent_defs, &config)?;
        check_agent_prices(&agent_defs, &config)?;

        let mut flow_specs = BTreeMap::new();
        for &(name, text) in sorted(flows) {
            let path = flow_path(name);
            let flow = parse_flow(name, text, &path, &agent_defs)?;
            if flow_specs.insert(name.to_string(), flow).is_some() {
                return Err(invalid(&path, "defined twice"));
            }
        }

        let mut digests = BTreeMap::new();
        digests.insert("arbor.toml".to_string(), sha256(arbor_toml.unwrap_or("")));
        for &(name, text) in agents {
            digests.insert(format!("agents/{name}/agent.md"), sha256(text));
        }
        for &(name, text) in flows {
            digests.insert(format!("flows/{name}.toml"), sha256(text));
        }
        let workspace = Workspace {
            root,
            config,
            agents: agent_defs,
            flows: flow_specs,
            digests,
        };
        // A usd ceiling written in a file is checked now, against every model it covers.
        if workspace.config.budget_usd_micros.is_some() {
            let all: Vec<&str> = workspace.agents.keys().map(String::as_str).collect();
            workspace
                .check_prices(&all)
                .map_err(|m| invalid(Path::new("arbor.toml"), format!("budget.usd: {m}")))?;
        }
        for (name, flow) in &workspace.flows {
            if flow.budget.as_ref().is_some_and(|b| b.usd.is_some()) {
                let steps: Vec<&str> = flow
                    .groups
                    .iter()
                    .flat_map(|g| g.steps.iter().map(|s| s.agent.as_str()))
                    .collect();
                workspace
                    .check_prices(&steps)
                    .map_err(|m| invalid(&flow_path(name), format!("budget.usd: {m}")))?;
            }
        }
        Ok(workspace)
    }

    /// A usd ceiling over these agents can be kept: every model they and
    /// their sub-agents (transitively) use has a price. The scripted model
    /// costs nothing.
    pub fn check_prices(&self, agents: &[&str]) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        let mut queue: Vec<String> = agents.iter().map(|a| a.to_string()).collect();
        while let Some(name) = queue.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let Some(agent) = self.agents.get(&name) else {
                continue;
            };
            if let Some(model) = unpriced(agent, &self.config) {
                return Err(format!(
                    "agent {name} uses {model}, which has no price in arbor.toml \
                     (usd_per_mtok_input, usd_per_mtok_output), so a usd ceiling could not be kept"
                ));
            }
            queue.extend(agent.subagents.iter().cloned());
        }
        Ok(())
    }

    /// Puts a usd ceiling (micro-dollars, from `--budget-usd`) on a run,
    /// checked: every model it can reach has a price.
    pub fn with_usd_ceiling(
        &self,
        mut spec: RunSpec,
        usd_micros: u64,
    ) -> Result<RunSpec, LoadError> {
        if usd_micros == 0 {
            return Err(LoadError::ZeroBudgetOverride);
        }
        let steps: Vec<&str> = spec
            .groups
            .iter()
            .flat_map(|g| g.steps.iter().map(|s| s.agent.as_str()))
            .collect();
        self.check_prices(&steps)
            .map_err(|message| LoadError::Refused { message })?;
        spec.budget_usd_micros = Some(usd_micros);
        Ok(spec)
    }

    /// The RunSpec of flow NAME. Budget: `budget_override` (from --budget-tokens)
    /// when Some, else the flow's budget, else arbor.toml's default. Timeout parsed
    /// (humantime).
    pub fn flow_run(&self, name: &str, budget_override: Option<u64>) -> Result<RunSpec, LoadError> {
        let flow = self.flows.get(name).ok_or_else(|| LoadError::UnknownFlow {
            name: name.to_string(),
            known: known(self.flows.keys()),
        })?;
        let path = flow_path(name);
        let flow_tokens = budget_tokens(flow.budget.as_ref()).map_err(|m| invalid(&path, m))?;
        let budget_tokens = self.run_budget(budget_override, flow_tokens)?;
        let flow_usd = flow
            .budget
            .as_ref()
            .map(BudgetArg::usd_micros)
            .transpose()
            .map_err(|m| invalid(&path, m))?
            .flatten();
        let timeout = parse_duration_arg("timeout", flow.timeout.as_deref())
            .map_err(|m| invalid(&path, m))?;
        Ok(RunSpec {
            budget_usd_micros: flow_usd.or(self.config.budget_usd_micros),
            flow: name.to_string(),
            groups: flow.groups.clone(),
            budget_tokens,
            timeout,
            record: false,
            replay: None,
            digests: Default::default(),
        })
        .map(|spec| self.recording(spec, self.config.record_models))
    }

    /// A single-agent run (RunSpec::single) checked: the agent exists. Budget:
    /// `budget_override` when Some, else arbor.toml's default.
    pub fn agent_run(
        &self,
        agent: &str,
        input: &str,
        budget_override: Option<u64>,
    ) -> Result<RunSpec, LoadError> {
        if !self.agents.contains_key(agent) {
            return Err(LoadError::UnknownAgent {
                name: agent.to_string(),
                known: known(self.agents.keys()),
            });
        }
        let budget_tokens = self.run_budget(budget_override, None)?;
        let mut spec = RunSpec::single(agent, input, budget_tokens);
        spec.budget_usd_micros = self.config.budget_usd_micros;
        Ok(self.recording(spec, self.config.record_models))
    }

    /// `spec` recording (`record`) or not; a recording spec carries the
    /// digests of the definitions it can reach.
    pub fn recording(&self, mut spec: RunSpec, record: bool) -> RunSpec {
        spec.record = record;
        spec.digests = if record {
            self.digests_for(&spec)
        } else {
            BTreeMap::new()
        };
        spec
    }

    /// The digests of what `spec` runs with: arbor.toml, its flow (unless
    /// it is a single agent's run) and every agent it can reach.
    pub fn digests_for(&self, spec: &RunSpec) -> BTreeMap<String, String> {
        let mut paths = vec![
            "arbor.toml".to_string(),
            format!("flows/{}.toml", spec.flow),
        ];
        paths.extend(
            spec.reachable_agents(|name| self.agents.get(name))
                .into_iter()
                .map(|a| format!("agents/{}/agent.md", a.name)),
        );
        paths
            .into_iter()
            .filter_map(|path| Some((path.clone(), self.digests.get(&path)?.clone())))
            .collect()
    }

    fn run_budget(
        &self,
        budget_override: Option<u64>,
        flow_tokens: Option<u64>,
    ) -> Result<u64, LoadError> {
        match budget_override {
            Some(0) => Err(LoadError::ZeroBudgetOverride),
            Some(tokens) => Ok(tokens),
            None => Ok(flow_tokens.unwrap_or(self.config.budget_tokens)),
        }
    }
}

/// Parses one `agent.md`: front matter between `---` lines, then the system prompt.
/// `path` only names the file in errors. Checks everything about this agent alone;
/// what needs the other agents (sub-agents exist, have descriptions) is checked by
/// `Workspace::load` and `Workspace::from_texts`.
pub fn parse_agent(folder_name: &str, text: &str, path: &Path) -> Result<AgentDef, LoadError> {
    check_name("agent", folder_name).map_err(|m| invalid(path, m))?;
    let (yaml, prompt) = split_front_matter(text).map_err(|m| invalid(path, m))?;
    let front_matter: FrontMatter = serde_saphyr::from_str(yaml)
        .map_err(|error| invalid(path, front_matter_error(yaml, &error)))?;
    agent_from_front_matter(folder_name, front_matter, prompt).map_err(|m| invalid(path, m))
}

/// The file `arbor.toml` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    budget: BudgetArg,
    #[serde(default)]
    providers: BTreeMap<String, ProviderFile>,
    #[serde(default)]
    service: toml::Table,
    #[serde(default)]
    sandbox: SandboxFile,
    #[serde(default)]
    mcp: McpFile,
    #[serde(default)]
    approvals: ApprovalsFile,
    #[serde(default)]
    journal: JournalFile,
    #[serde(default)]
    record: RecordFile,
    #[serde(default)]
    telemetry: TelemetryFile,
}

/// `[telemetry]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TelemetryFile {
    otlp_endpoint: Option<String>,
    service_name: Option<String>,
    #[serde(default)]
    capture_content: bool,
}

impl TelemetryFile {
    fn check(self) -> Result<crate::telemetry::TelemetryConfig, String> {
        if let Some(endpoint) = &self.otlp_endpoint {
            crate::telemetry::check_endpoint(endpoint)
                .map_err(|why| format!("telemetry.otlp_endpoint: {why}"))?;
        }
        if let Some(name) = &self.service_name
            && name.trim().is_empty()
        {
            return Err("telemetry.service_name: must not be empty".into());
        }
        Ok(crate::telemetry::TelemetryConfig {
            otlp_endpoint: self.otlp_endpoint,
            service_name: self.service_name,
            capture_content: self.capture_content,
        })
    }
}

/// `[record]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    #[serde(default)]
    models: bool,
}

/// `[journal]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct JournalFile {
    backend: Option<String>,
    url: Option<String>,
    schema: Option<String>,
    lease: Option<String>,
    connect_timeout: Option<String>,
}

impl JournalFile {
    fn check(self) -> Result<JournalConfig, String> {
        let postgres = match self.backend.as_deref() {
            None | Some("sled") => false,
            Some("postgres") => true,
            Some(other) => {
                return Err(format!(
                    "journal.backend: {other:?} is not a journal backend (sled or postgres)"
                ));
            }
        };
        if !postgres {
            let given: Vec<&str> = [
                ("url", self.url.is_some()),
                ("schema", self.schema.is_some()),
                ("lease", self.lease.is_some()),
                ("connect_timeout", self.connect_timeout.is_some()),
            ]
            .into_iter()
            .filter_map(|(key, set)| set.then_some(key))
            .collect();
            if let Some(key) = given.first() {
                return Err(format!(
                    "journal.{key} is for the postgres backend; add backend = \"postgres\" \
                     (the sled journal lives in the data dir)"
                ));
            }
            return Ok(JournalConfig::Sled);
        }
        let schema = self.schema.unwrap_or_else(|| "arbor".into());
        arbor_storage::check_schema_name(&schema)
            .map_err(|why| format!("journal.schema: {why}"))?;
        let lease =
            parse_duration_arg("journal.lease", self.lease.as_deref())?.unwrap_or(DEFAULT_LEASE);
        if lease < Duration::from_secs(1) {
            return Err(format!(
                "journal.lease: {} is too short to renew a third of the way through; \
                 give 1s or more (10s by default)",
                humantime::format_duration(lease)
            ));
        }
        let connect_for =
            parse_duration_arg("journal.connect_timeout", self.connect_timeout.as_deref())?
                .unwrap_or(Duration::from_secs(60));
        Ok(JournalConfig::Postgres {
            url: self.url,
            schema,
            lease,
            connect_for,
            node: None,
        })
    }
}

/// `[approvals]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalsFile {
    #[serde(default)]
    tools: Vec<String>,
    timeout: Option<String>,
    warn_at: Option<f64>,
}

impl ApprovalsFile {
    fn check(self) -> Result<ApprovalSettings, String> {
        for entry in &self.tools {
            arbor_protocol::approval::check_approve_entry(entry)
                .map_err(|m| format!("approvals.tools: {m}"))?;
        }
        let mut settings = ApprovalSettings {
            tools: self.tools,
            ..Default::default()
        };
        if let Some(timeout) = parse_duration_arg("approvals.timeout", self.timeout.as_deref())? {
            settings.timeout = timeout;
        }
        if let Some(warn_at) = self.warn_at {
            if !(warn_at > 0.0 && warn_at < 1.0) {
                return Err(format!(
                    "approvals.warn_at must be a share of the wait between 0 and 1, not {warn_at} \
                     (0.8 warns when 80% of it has passed)"
                ));
            }
            settings.warn_at = warn_at;
        }
        Ok(settings)
    }
}

/// `[mcp]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct McpFile {
    #[serde(default)]
    servers: BTreeMap<String, McpServerFile>,
}

/// `[mcp.servers.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct McpServerFile {
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    secrets: Vec<String>,
    network: Option<Network>,
    #[serde(default)]
    read_only: Vec<PathBuf>,
    call_timeout: Option<String>,
    start_timeout: Option<String>,
    /// A streamable HTTP server's endpoint, in place of `command`.
    url: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// `[sandbox]` as written: the mode, the secrets file and the node's limits
/// (the keys of `ResourcesSpec`, spelled out: serde's flatten would let an
/// unknown key through).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SandboxFile {
    mode: Option<SandboxIsolation>,
    secrets_file: Option<PathBuf>,
    memory: Option<String>,
    cpu: Option<String>,
    file_size: Option<String>,
    open_files: Option<u64>,
    processes: Option<u64>,
}

impl SandboxFile {
    fn limits(&self) -> ResourcesSpec {
        ResourcesSpec {
            memory: self.memory.clone(),
            cpu: self.cpu.clone(),
            file_size: self.file_size.clone(),
            open_files: self.open_files,
            processes: self.processes,
        }
    }
}

fn parse_config(text: &str, root: &Path) -> Result<Config, LoadError> {
    let path = Path::new("arbor.toml");
    let file: ConfigFile = toml::from_str(text).map_err(|e| invalid(path, toml_error(text, &e)))?;
    file.limits.validate().map_err(|m| invalid(path, m))?;
    let budget_tokens = file
        .budget
        .tokens()
        .map_err(|m| invalid(path, m))?
        .unwrap_or(DEFAULT_BUDGET_TOKENS);
    let budget_usd_micros = file.budget.usd_micros().map_err(|m| invalid(path, m))?;
    let mut providers = BTreeMap::new();
    for (name, block) in file.providers {
        let provider = check_provider(&name, block).map_err(|m| invalid(path, m))?;
        providers.insert(name, provider);
    }
    let isolation = file.sandbox.mode.unwrap_or_default();
    let mut mcp = BTreeMap::new();
    for (name, block) in file.mcp.servers {
        let server = mcp_server(&name, block, root)
            .map_err(|m| invalid(path, format!("mcp.servers.{name}: {m}")))?;
        mcp.insert(name, Arc::new(server));
    }
    let approvals = file.approvals.check().map_err(|m| invalid(path, m))?;
    let journal = file.journal.check().map_err(|m| invalid(path, m))?;
    let telemetry = file.telemetry.check().map_err(|m| invalid(path, m))?;
    Ok(Config {
        telemetry,
        approvals,
        journal,
        record_models: file.record.models,
        limits: file.limits,
        budget_tokens,
        budget_usd_micros,
        providers,
        service: file.service,
        sandbox: resources(&file.sandbox.limits(), "sandbox.")
            .map(|r| {
                over(
                    r,
                    match isolation {
                        SandboxIsolation::Sealed => DEFAULT_SANDBOX,
                        SandboxIsolation::None => DEFAULT_UNSEALED,
                    },
                )
            })
            .map_err(|m| invalid(path, m))?,
        isolation,
        secrets_file: file.sandbox.secrets_file,
        mcp,
    })
}

/// One `[mcp.servers.NAME]`, checked: a name that splits one way in
/// `mcp__NAME__TOOL`, a command, variables and secrets with names a
/// process can have, timeouts that are durations above zero, and
/// read-only folders that exist.
fn mcp_server(name: &str, file: McpServerFile, root: &Path) -> Result<McpServerSpec, String> {
    check_server_name(name)?;
    if let Some(bad) = file.secrets.iter().find(|n| !is_secret_name(n)) {
        return Err(format!(
            "secrets: `{bad}` is not a secret name (an environment variable's name)"
        ));
    }
    let timeout = |key: &str, text: &Option<String>, default| -> Result<_, String> {
        Ok(parse_duration_arg(key, text.as_deref())?.unwrap_or(default))
    };
    let call_timeout = timeout("call_timeout", &file.call_timeout, DEFAULT_CALL_TIMEOUT)?;
    let start_timeout = timeout("start_timeout", &file.start_timeout, DEFAULT_START_TIMEOUT)?;
    let transport = match file.url.clone() {
        Some(url) => McpTransport::Http(http_server(url, &file)?),
        None => McpTransport::Stdio(stdio_server(&file, root)?),
    };
    Ok(McpServerSpec {
        name: name.to_string(),
        transport,
        secrets: file.secrets,
        call_timeout,
        start_timeout,
    })
}

/// A `url` server's keys: an http(s) URL, headers a request can carry,
/// and each declared secret used in a header (the only way it reaches
/// the server), none of a process's keys.
fn http_server(url: String, file: &McpServerFile) -> Result<HttpServer, String> {
    let process_keys = [
        ("command", file.command.is_some()),
        ("args", !file.args.is_empty()),
        ("env", !file.env.is_empty()),
        ("network", file.network.is_some()),
        ("read_only", !file.read_only.is_empty()),
    ];
    if let Some((key, _)) = process_keys.iter().find(|(_, set)| *set) {
        return Err(format!(
            "`{key}` belongs to a server arbor starts, and a `url` server runs elsewhere: declare `command` or `url`, not both kinds of key"
        ));
    }
    let parsed = url::Url::parse(&url).map_err(|e| format!("url: {url:?}: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
        return Err(format!(
            "url: {url:?}: a streamable HTTP endpoint is http:// or https:// with a host"
        ));
    }
    let mut used = BTreeSet::new();
    for (header, value) in &file.headers {
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if header.is_empty() || !header.bytes().all(token) {
            return Err(format!("headers: `{header}` is not a header's name"));
        }
        if RESERVED_HEADERS.contains(&header.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "headers: `{header}` is set by the transport itself and cannot be declared"
            ));
        }
        if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(format!("headers.{header}: holds a control character"));
        }
        for piece in placeholders(value).map_err(|e| format!("headers.{header}: {e}"))? {
            if let Piece::Secret(secret) = piece {
                if !file.secrets.iter().any(|s| s == secret) {
                    return Err(format!(
                        "headers.{header}: `${{{secret}}}` is not in this server's secrets: declare it there"
                    ));
                }
                used.insert(secret.to_string());
            }
        }
    }
    if let Some(unused) = file.secrets.iter().find(|s| !used.contains(*s)) {
        return Err(format!(
            "secrets: `{unused}` is in no header; a `url` server gets a secret only as `${{{unused}}}` in `headers`"
        ));
    }
    Ok(HttpServer {
        url,
        headers: file.headers.clone(),
    })
}

/// A `command` server's keys: a program, variables and secrets with
/// names a process can have, and read-only folders that exist.
fn stdio_server(file: &McpServerFile, root: &Path) -> Result<StdioServer, String> {
    if !file.headers.is_empty() {
        return Err("`headers` are for a `url` server; a `command` server takes `env`".into());
    }
    let command = match file.command.as_deref().map(str::trim) {
        Some(c) if !c.is_empty() => c.to_string(),
        _ => {
            return Err(
                "`command` (a program that serves over stdio) or `url` (a streamable HTTP endpoint) is required"
                    .into(),
            );
        }
    };
    // A relative path is the workspace's (the server runs in a job's
    // workdir, where it would mean nothing); a bare name is looked up on
    // the sandbox's PATH.
    let command = if command.contains('/') && !Path::new(&command).is_absolute() {
        workspace_path(root, &command)?.display().to_string()
    } else {
        command
    };
    for (key, value) in &file.env {
        if !is_secret_name(key) {
            return Err(format!(
                "env: `{key}` is not a variable's name (letters, digits and `_`, none of PATH, HOME, LANG, TMPDIR)"
            ));
        }
        if value.contains('\0') {
            return Err(format!("env.{key}: holds a NUL byte"));
        }
    }
    if let Some(both) = file.secrets.iter().find(|n| file.env.contains_key(*n)) {
        return Err(format!("`{both}` is both in env and in secrets: keep one"));
    }
    let mut read_only = vec![];
    for dir in &file.read_only {
        let full = root.join(dir);
        let found = std::fs::canonicalize(&full)
            .map_err(|e| format!("read_only: {}: {e}", full.display()))?;
        if !found.is_dir() {
            return Err(format!("read_only: {} is not a folder", found.display()));
        }
        read_only.push(found);
    }
    Ok(StdioServer {
        command,
        args: file.args.clone(),
        env: file.env.clone(),
        network: file.network.unwrap_or_default(),
        read_only,
    })
}

/// `path` of the workspace as a sandbox can reach it: absolute, through no
/// `..` (a sandbox sees only the folders bound into it, not their
/// parents). Its folder is resolved if it exists; a missing program is
/// `arbor check`'s to report.
fn workspace_path(root: &Path, path: &str) -> Result<PathBuf, String> {
    let joined = std::path::absolute(root.join(path)).map_err(|e| format!("{path}: {e}"))?;
    match (joined.parent(), joined.file_name()) {
        (Some(folder), Some(name)) => match std::fs::canonicalize(folder) {
            Ok(folder) => Ok(folder.join(name)),
            Err(_) => Ok(joined),
        },
        _ => Ok(joined),
    }
}

/// Every MCP server an agent names is declared in arbor.toml.
fn check_mcp_servers(
    agents: &BTreeMap<String, AgentDef>,
    config: &Config,
) -> Result<(), LoadError> {
    for (name, agent) in agents {
        if let Some(missing) = agent
            .mcp
            .iter()
            .find(|p| !config.mcp.contains_key(&p.server))
        {
            return Err(invalid(
                &agent_path(name),
                format!(
                    "{missing}: arbor.toml declares no [mcp.servers.{}] (declared: {})",
                    missing.server,
                    known(config.mcp.keys())
                ),
            ));
        }
    }
    Ok(())
}

fn parse_flow(
    name: &str,
    text: &str,
    path: &Path,
    agents: &BTreeMap<String, AgentDef>,
) -> Result<FlowSpec, LoadError> {
    check_name("flow", name).map_err(|m| invalid(path, m))?;
    let flow: FlowSpec = toml::from_str(text).map_err(|e| invalid(path, toml_error(text, &e)))?;
    budget_tokens(flow.budget.as_ref()).map_err(|m| invalid(path, m))?;
    if let Some(budget) = &flow.budget {
        budget.usd_micros().map_err(|m| invalid(path, m))?;
    }
    parse_duration_arg("timeout", flow.timeout.as_deref()).map_err(|m| invalid(path, m))?;
    if flow.groups.is_empty() {
        return Err(invalid(
            path,
            "no `[[group]]`: a flow needs at least one group of steps",
        ));
    }
    for (g, group) in flow.groups.iter().enumerate() {
        if group.steps.is_empty() {
            return Err(invalid(path, format!("group {} has no steps", g + 1)));
        }
        for (s, step) in group.steps.iter().enumerate() {
            if !agents.contains_key(&step.agent) {
                return Err(invalid(
                    path,
                    format!(
                        "step {} of group {} names unknown agent `{}`",
                        s + 1,
                        g + 1,
                        step.agent
                    ),
                ));
            }
        }
    }
    Ok(flow)
}

/// Invariants 1 and 2: every sub-agent exists and can be chosen by its description.
fn check_subagents(agents: &BTreeMap<String, AgentDef>) -> Result<(), LoadError> {
    match subagent_problems(agents, &BTreeSet::new())
        .into_iter()
        .next()
    {
        Some((file_of, message)) => Err(invalid(&agent_path(&file_of), message)),
        None => Ok(()),
    }
}

/// Every problem of a sub-agent link, in name order: (the agent whose file
/// it is in, what is wrong). A sub-agent must exist, have a description,
/// and, in a sandbox of its own, have no sub-agents. Links to the agents in
/// `skip` (their files did not parse) are not looked at.
pub(crate) fn subagent_problems(
    agents: &BTreeMap<String, AgentDef>,
    skip: &BTreeSet<String>,
) -> Vec<(String, String)> {
    let mut problems = vec![];
    for (name, agent) in agents {
        for sub in agent.subagents.iter().filter(|s| !skip.contains(*s)) {
            let Some(sub_agent) = agents.get(sub) else {
                problems.push((
                    name.clone(),
                    format!("subagent `{sub}` is not an agent in agents/"),
                ));
                continue;
            };
            let described = sub_agent
                .description
                .as_deref()
                .is_some_and(|d| !d.trim().is_empty());
            if !described {
                problems.push((
                    sub.clone(),
                    format!("`description` is required: {name} offers it as a sub-agent"),
                ));
            }
            if let Some(message) = own_sandbox_delegates(name, sub_agent) {
                problems.push((sub.clone(), message));
            }
        }
    }
    problems
}

/// I-26: a sub-agent in a sandbox of its own cannot delegate, so sub-agents
/// of its own could never be reached: refused, not ignored.
fn own_sandbox_delegates(parent: &str, sub: &AgentDef) -> Option<String> {
    (sub.sandbox == SandboxMode::Own && !sub.subagents.is_empty()).then(|| {
        format!(
            "`sandbox: own` with `subagents`: as {parent}'s sub-agent it may not delegate (I-26); drop one"
        )
    })
}

/// Every agent that names `provider/model` names one arbor.toml configures.
fn check_models(agents: &BTreeMap<String, AgentDef>, config: &Config) -> Result<(), LoadError> {
    for (name, agent) in agents {
        let ModelRef::Provider { provider, model } = &agent.model else {
            continue;
        };
        let Some(p) = config.providers.get(provider) else {
            return Err(invalid(
                &agent_path(name),
                format!(
                    "model: `{provider}/{model}`: arbor.toml has no [providers.{provider}] (known: {})",
                    known(config.providers.keys())
                ),
            ));
        };
        if !p.models.contains_key(model) {
            return Err(invalid(
                &agent_path(name),
                format!(
                    "model: `{provider}/{model}`: arbor.toml has no [providers.{provider}.models.{model}] (known: {})",
                    known(p.models.keys())
                ),
            ));
        }
    }
    Ok(())
}

/// The provider model `agent` uses when it has no price, as `provider/model`.
fn unpriced(agent: &AgentDef, config: &Config) -> Option<String> {
    let ModelRef::Provider { provider, model } = &agent.model else {
        return None;
    };
    let priced = config
        .providers
        .get(provider)
        .and_then(|p| p.models.get(model))
        .is_some_and(|m| m.price.is_some());
    (!priced).then(|| format!("{provider}/{model}"))
}

/// An agent's own `budget.usd` needs a price on its model.
fn check_agent_prices(
    agents: &BTreeMap<String, AgentDef>,
    config: &Config,
) -> Result<(), LoadError> {
    for (name, agent) in agents {
        if agent.budget_usd_micros.is_some()
            && let Some(model) = unpriced(agent, config)
        {
            return Err(invalid(
                &agent_path(name),
                format!(
                    "budget.usd: model {model} has no price in arbor.toml (usd_per_mtok_input, usd_per_mtok_output), so a usd ceiling could not be kept"
                ),
            ));
        }
    }
    Ok(())
}

/// The front matter's YAML and the body after it.
pub(crate) fn split_front_matter(text: &str) -> Result<(&str, &str), String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (first, mut rest) = split_line(text);
    if first.trim_end() != "---" {
        return Err("no front matter: the file must start with a `---` line".into());
    }
    let yaml_start = rest;
    loop {
        if rest.is_empty() {
            return Err(
                "the front matter is not closed: no second `---` line after the first".into(),
            );
        }
        let (line, after) = split_line(rest);
        if line.trim_end() == "---" {
            let yaml = &yaml_start[..yaml_start.len() - rest.len()];
            return Ok((yaml, after.trim()));
        }
        rest = after;
    }
}

/// The first line (without its `\n`) and everything after it.
fn split_line(text: &str) -> (&str, &str) {
    match text.split_once('\n') {
        Some((line, rest)) => (line, rest),
        None => (text, ""),
    }
}

fn agent_from_front_matter(
    folder_name: &str,
    front_matter: FrontMatter,
    prompt: &str,
) -> Result<AgentDef, String> {
    let FrontMatter {
        name,
        description,
        model,
        tools: named_tools,
        mcp: servers,
        approve,
        limits,
        deny,
        subagents,
        sandbox,
        network,
        secrets,
        budget,
        max_turns,
        timeout,
        script,
        resources: resources_spec,
    } = front_matter;

    // A secret reaches its sandbox as an environment variable (I-27).
    if let Some(bad) = secrets.iter().find(|n| !is_secret_name(n)) {
        return Err(format!(
            "secrets: `{bad}` is not a secret name: use letters, digits and `_` (an environment \
             variable's name, not starting with a digit), and none of PATH, HOME, LANG, TMPDIR"
        ));
    }

    if let Some(name) = name
        && name != folder_name
    {
        return Err(format!(
            "name `{name}` differs from the folder name `{folder_name}`: rename one, or leave `name` out"
        ));
    }
    let mut tools = vec![];
    let mut mcp = vec![];
    for tool in named_tools {
        match tool {
            ToolRef::Builtin(t) if t.info().offer == Offer::Named => tools.push(t),
            ToolRef::Builtin(t) => {
                let nameable: Vec<&str> = ToolName::nameable().map(ToolName::as_str).collect();
                return Err(format!(
                    "tools: `{t}` cannot be named (tools may name {} and mcp__SERVER__TOOL; \
                     delegation tools are offered to agents with subagents)",
                    nameable.join(", ")
                ));
            }
            ToolRef::Mcp(pattern) => mcp.push(pattern),
        }
    }
    for server in &servers {
        check_server_name(server).map_err(|m| format!("mcp: {m}"))?;
        mcp.push(McpPattern::all(server));
    }
    for entry in &approve {
        arbor_protocol::approval::check_approve_entry(entry)
            .map_err(|m| format!("approve: {m}"))?;
    }
    let limits = limits.unwrap_or_default();
    limits.check("limits.")?;
    if max_turns == Some(0) {
        return Err("max_turns must be at least 1".into());
    }
    let script = script
        .into_iter()
        .enumerate()
        .map(|(i, turn)| script_turn(i + 1, turn))
        .collect::<Result<Vec<_>, _>>()?;

    Ok(AgentDef {
        name: folder_name.to_string(),
        description,
        model: model_ref(model.as_deref())?,
        tools,
        mcp,
        limits,
        deny,
        approve,
        subagents,
        sandbox: sandbox.unwrap_or_default(),
        network: network.unwrap_or_default(),
        secrets,
        budget_tokens: budget_tokens(budget.as_ref())?,
        budget_usd_micros: budget
            .as_ref()
            .map(BudgetArg::usd_micros)
            .transpose()?
            .flatten(),
        max_turns,
        timeout: parse_duration_arg("timeout", timeout.as_deref())?,
        script: script.into(),
        prompt: prompt.to_string(),
        resources: resources_spec
            .as_ref()
            .map(|spec| resources(spec, "resources."))
            .transpose()?
            .unwrap_or_default(),
    })
}

/// A name a secret can have: an environment variable's, not one the sandbox sets.
fn is_secret_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !["PATH", "HOME", "LANG", "TMPDIR"].contains(&name)
}

/// `resources:` or `[sandbox]` as numbers, each checked: sizes like
/// "512MiB", a cpu time of at least a second, counts of at least 1.
fn resources(spec: &ResourcesSpec, prefix: &str) -> Result<Resources, String> {
    let size = |key: &str, text: &Option<String>| -> Result<Option<u64>, String> {
        let Some(text) = text else { return Ok(None) };
        let bytes = text
            .trim()
            .parse::<bytesize::ByteSize>()
            .map_err(|_| format!("{prefix}{key}: {text:?} is not a size such as \"512MiB\""))?
            .as_u64();
        if bytes == 0 {
            return Err(format!(
                "{prefix}{key}: must be more than 0 (0 never means unlimited)"
            ));
        }
        Ok(Some(bytes))
    };
    let count = |key: &str, n: Option<u64>| match n {
        Some(0) => Err(format!(
            "{prefix}{key}: must be at least 1 (0 never means unlimited)"
        )),
        other => Ok(other),
    };
    let cpu_secs = match &spec.cpu {
        None => None,
        Some(text) => {
            let d = humantime::parse_duration(text.trim())
                .map_err(|_| format!("{prefix}cpu: {text:?} is not a duration such as \"60s\""))?;
            if d < std::time::Duration::from_secs(1) {
                return Err(format!(
                    "{prefix}cpu: at least 1s (the kernel counts whole seconds)"
                ));
            }
            Some(d.as_secs() + u64::from(d.subsec_nanos() > 0))
        }
    };
    Ok(Resources {
        memory_bytes: size("memory", &spec.memory)?,
        cpu_secs,
        file_size_bytes: size("file_size", &spec.file_size)?,
        open_files: count("open_files", spec.open_files)?,
        processes: count("processes", spec.processes)?,
    })
}

/// Each limit of `mine`, else the one of `defaults`.
fn over(mine: Resources, defaults: Resources) -> Resources {
    Resources {
        memory_bytes: mine.memory_bytes.or(defaults.memory_bytes),
        cpu_secs: mine.cpu_secs.or(defaults.cpu_secs),
        file_size_bytes: mine.file_size_bytes.or(defaults.file_size_bytes),
        open_files: mine.open_files.or(defaults.open_files),
        processes: mine.processes.or(defaults.processes),
    }
}

/// Every agent's `resources:` within the node's `[sandbox]`, then resolved
/// (what it does not say, the node's limit).
fn check_resources(
    agents: &mut BTreeMap<String, AgentDef>,
    config: &Config,
) -> Result<(), LoadError> {
    let node = config.sandbox;
    for (name, agent) in agents.iter_mut() {
        let mine = agent.resources;
        let checks = [
            ("memory", mine.memory_bytes, node.memory_bytes),
            ("cpu", mine.cpu_secs, node.cpu_secs),
            ("file_size", mine.file_size_bytes, node.file_size_bytes),
            ("open_files", mine.open_files, node.open_files),
            ("processes", mine.processes, node.processes),
        ];
        for (key, asked, most) in checks {
            if let (Some(asked), Some(most)) = (asked, most)
                && asked > most
            {
                return Err(invalid(
                    &agent_path(name),
                    format!(
                        "resources.{key}: {asked} is above the node's [sandbox] {key} ({most}); an agent may only narrow it"
                    ),
                ));
            }
        }
        agent.resources = over(mine, node);
    }
    Ok(())
}

/// `scripted`, or `provider/model` (checked against arbor.toml by `check_models`).
fn model_ref(model: Option<&str>) -> Result<ModelRef, String> {
    match model.map(str::trim) {
        None | Some("scripted") => Ok(ModelRef::Scripted),
        Some(m) => match m.split_once('/') {
            Some((provider, model))
                if !provider.is_empty() && !model.is_empty() && !model.contains('/') =>
            {
                Ok(ModelRef::Provider {
                    provider: provider.to_string(),
                    model: model.to_string(),
                })
            }
            _ => Err(format!(
                "model: `{m}` is not known: use `scripted`, or `provider/model` with a provider of arbor.toml"
            )),
        },
    }
}

/// `number` counts from 1, as a user counts the turns in the file.
fn script_turn(number: usize, spec: ScriptTurnSpec) -> Result<ScriptTurn, String> {
    let calls = match spec.call {
        None => Vec::new(),
        Some(call) => {
            let specs = call.into_vec();
            if specs.is_empty() {
                return Err(format!(
                    "script turn {number}: `call` is an empty list (leave it out for a final answer)"
                ));
            }
            specs
                .into_iter()
                .enumerate()
                .map(|(i, call)| script_call(number, i + 1, call))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let delay = spec
        .delay
        .map(|text| {
            humantime::parse_duration(text.trim())
                .map_err(|e| format!("script turn {number}: delay: bad duration {text:?}: {e}"))
        })
        .transpose()?;
    Ok(ScriptTurn {
        say: spec.say,
        calls,
        usage: spec.usage,
        delay,
    })
}

/// Only the shape is checked here: the arguments are checked when the call is made,
/// since scripts call tools wrongly on purpose to test that.
fn script_call(turn: usize, number: usize, spec: ScriptCallSpec) -> Result<ScriptCall, String> {
    let args = match spec.args {
        None => serde_json::Value::Object(serde_json::Map::new()),
        Some(args @ serde_json::Value::Object(_)) => args,
        Some(other) => {
            return Err(format!(
                "script turn {turn}, call {number}: args must be a mapping, got {}",
                json_kind(&other)
            ));
        }
    };
    Ok(ScriptCall {
        tool: spec.tool,
        args,
    })
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "a mapping",
    }
}

/// I-09 for a budget as written: `Ok(None)` when it gives no tokens.
fn budget_tokens(budget: Option<&BudgetArg>) -> Result<Option<u64>, String> {
    Ok(budget.map(BudgetArg::tokens).transpose()?.flatten())
}

fn check_name(kind: &str, name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{kind} name {name:?} must be lowercase letters, digits, `_` and `-`"
        ))
    }
}

/// One line for a YAML error in the front matter, with line numbers counted in the
/// whole file (the opening `---` is line 1).
fn front_matter_error(yaml: &str, error: &serde_saphyr::Error) -> String {
    const LINES_BEFORE_YAML: u64 = 1;
    let formatter = serde_saphyr::UserMessageFormatter;
    let options = serde_saphyr::render_options! {
        formatter: &formatter,
        snippets: serde_saphyr::SnippetMode::Off,
        line_offset: LINES_BEFORE_YAML,
    };
    let mut message = one_line(&error.render_with_options(options));
    // A type error ("invalid u32") names no key: name the one it sits under.
    if let Some(key) = error.location().and_then(|at| key_before(yaml, at))
        && !message.contains(&format!("`{key}`"))
    {
        message = format!("{key}: {message}");
    }
    // `call:` is one call or a list of them; serde can only say that neither
    // matched, so look again for what is wrong inside.
    if message.contains("untagged enum OneOrMany")
        && let Some(detail) = explain_script_calls(yaml)
    {
        message = match error.location() {
            Some(at) => format!(
                "{detail} at line {}, column {}",
                at.line() + LINES_BEFORE_YAML,
                at.column()
            ),
            None => detail,
        };
    }
    format!("front matter: {}", plain_words(&message))
}

/// The key whose value holds `at`: the last `key:` before it on its line.
fn key_before(yaml: &str, at: serde_saphyr::Location) -> Option<&str> {
    let line = yaml
        .lines()
        .nth(usize::try_from(at.line()).ok()?.checked_sub(1)?)?;
    let column = usize::try_from(at.column()).ok()?.checked_sub(1)?;
    let end = line
        .char_indices()
        .nth(column)
        .map_or(line.len(), |(i, _)| i);
    let before = &line[..end];
    let colon = before.rfind(':')?;
    // Past the last character that cannot be in a key, which may be wider
    // than a byte.
    let key_start = before[..colon]
        .char_indices()
        .rev()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let key = &before[key_start..colon];
    (!key.is_empty()).then_some(key)
}

/// What is wrong with the first bad `call:` in the front matter, if one is.
fn explain_script_calls(yaml: &str) -> Option<String> {
    let front_matter: serde_json::Value = serde_saphyr::from_str(yaml).ok()?;
    let turns = front_matter.get("script")?.as_array()?;
    for (t, turn) in turns.iter().enumerate() {
        let Some(call) = turn.get("call") else {
            continue;
        };
        let calls = match call {
            serde_json::Value::Array(calls) => calls.clone(),
            serde_json::Value::Object(_) => vec![call.clone()],
            other => {
                return Some(format!(
                    "script turn {}: call must be a mapping {{tool, args}} or a list of them, got {}",
                    t + 1,
                    json_kind(other)
                ));
            }
        };
        for (c, call) in calls.into_iter().enumerate() {
            if let Err(e) = serde_json::from_value::<ScriptCallSpec>(call) {
                return Some(format!("script turn {}, call {}: {e}", t + 1, c + 1));
            }
        }
    }
    None
}

/// One line for a TOML error: its message and where it is.
fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = plain_words(&one_line(error.message()));
    match error.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before[line_start..].chars().count() + 1;
            format!("{message} at line {line}, column {column}")
        }
        None => message,
    }
}

/// Users write keys, not fields.
fn plain_words(message: &str) -> String {
    message.replace("unknown field", "unknown key")
}

fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn invalid(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn agent_path(name: &str) -> PathBuf {
    PathBuf::from(format!("agents/{name}/agent.md"))
}

fn flow_path(name: &str) -> PathBuf {
    PathBuf::from(format!("flows/{name}.toml"))
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

fn sorted<'a>(texts: &'a [(&'a str, &'a str)]) -> Vec<&'a (&'a str, &'a str)> {
    let mut texts: Vec<_> = texts.iter().collect();
    texts.sort_by_key(|(name, _)| *name);
    texts
}

/// SHA-256 of `text`, in lower-case hex.
fn sha256(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|error| LoadError::Read {
        path: path.to_path_buf(),
        error,
    })
}

/// The entries of a directory as (file name, path), in name order.
fn list_dir(dir: &Path) -> Result<Vec<(String, PathBuf)>, LoadError> {
    let read_error = |error| LoadError::Read {
        path: dir.to_path_buf(),
        error,
    };
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_error)? {
        let entry = entry.map_err(read_error)?;
        entries.push((
            entry.file_name().to_string_lossy().into_owned(),
            entry.path(),
        ));
    }
    entries.sort();
    Ok(entries)
}
