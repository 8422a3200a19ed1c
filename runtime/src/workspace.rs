//! The workspace a user writes, read and checked before anything runs:
//!
//! ```text
//! DIR/arbor.toml               optional: [limits], [budget], [providers.NAME],
//!                              [sandbox], [mcp.servers.NAME], [approvals],
//!                              [journal], [record], [telemetry], [notify.NAME],
//!                              [tenants.NAME]; [service] and [auth] are
//!                              arbord's, read by arbor-service
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

use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    AgentDef, BudgetArg, FlowSpec, ModelRef, RunSpec, SandboxMode, Settings, Skill,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod agent;
mod config;
mod flow;
pub mod input;
mod parse;
mod skill;
mod tenants;

pub use agent::parse_agent;
pub(crate) use agent::split_front_matter;
use config::parse_config;
pub use config::{
    Config, DEFAULT_LEASE, DEFAULT_SANDBOX, DEFAULT_UNSEALED, JournalConfig, parse_node_id,
};
use flow::parse_flow;
pub use parse::{DEFAULT_BUDGET_TOKENS, LoadError, check_name};
use parse::{budget_tokens, invalid, over};
pub use tenants::{OnQuota, Quota, Tenant};

/// Everything a node needs from a user's workspace, checked.
#[derive(Clone, Debug)]
pub struct Workspace {
    pub root: PathBuf,
    pub config: Config,
    pub agents: BTreeMap<String, AgentDef>,
    pub flows: BTreeMap<String, FlowSpec>,
    /// `skills/NAME/SKILL.md`, by name.
    pub skills: BTreeMap<String, Arc<Skill>>,
    /// Each definition's SHA-256 by its path: `arbor.toml` (of its text, or
    /// of nothing), `agents/NAME/agent.md`, `flows/NAME.toml`,
    /// `skills/NAME/SKILL.md`.
    pub digests: BTreeMap<String, String>,
    /// Every flow's `[[schedule]]` entries, by name (unique in the workspace).
    pub schedules: BTreeMap<String, crate::schedules::Schedule>,
    /// What a run pins (I-67): arbor.toml (empty when there is none), each
    /// `agents/NAME/agent.md` and `flows/NAME.toml`, by path.
    pub files: BTreeMap<String, String>,
    /// Those files' version: the first 16 hex digits of a SHA-256 over
    /// each path and its text's SHA-256, the same for the same content.
    pub version: String,
}

impl Workspace {
    /// Reads and checks everything; the first problem is returned, naming the file and the key.
    ///
    /// In `agents/`, every folder not starting with `.` must hold an `agent.md`;
    /// loose files are ignored. In `flows/`, every `*.toml` file is a flow. In
    /// `skills/`, every folder not starting with `.` must hold a `SKILL.md`.
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

        let mut skills = Vec::new();
        let skills_dir = dir.join("skills");
        if skills_dir.is_dir() {
            for (name, path) in list_dir(&skills_dir)? {
                if !path.is_dir() || name.starts_with('.') {
                    continue;
                }
                let file = path.join("SKILL.md");
                let at = PathBuf::from(format!("skills/{name}/SKILL.md"));
                if !file.is_file() {
                    return Err(invalid(&at, "no SKILL.md in this skill's folder"));
                }
                let text = read(&file)?;
                skills.push((sha256(&text), skill::parse_skill(&name, &text, path, &at)?));
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
        Self::from_parts(
            dir.to_path_buf(),
            config_text.as_deref(),
            &agents,
            &flows,
            skills,
        )
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
        Self::from_parts(root, arbor_toml, agents, flows, vec![])
    }

    /// The workspace an earlier version's files make (`files`, as
    /// `Workspace::files` holds them), here: its skills are this one's (a
    /// skill's folder is read where it is; skills are not pinned).
    pub fn from_snapshot(&self, files: &BTreeMap<String, String>) -> Result<Workspace, LoadError> {
        let arbor_toml = files
            .get("arbor.toml")
            .map(String::as_str)
            .filter(|t| !t.is_empty());
        let named = |prefix: &str, suffix: &str| -> Vec<(&str, &str)> {
            files
                .iter()
                .filter_map(|(path, text)| {
                    let name = path.strip_prefix(prefix)?.strip_suffix(suffix)?;
                    Some((name, text.as_str()))
                })
                .collect()
        };
        let skills = self
            .skills
            .iter()
            .map(|(name, skill)| {
                let digest = self
                    .digests
                    .get(&format!("skills/{name}/SKILL.md"))
                    .cloned()
                    .unwrap_or_default();
                (digest, (**skill).clone())
            })
            .collect();
        Self::from_parts(
            self.root.clone(),
            arbor_toml,
            &named("agents/", "/agent.md"),
            &named("flows/", ".toml"),
            skills,
        )
    }

    /// `from_texts` with the skills `load` parsed, each with its SKILL.md's
    /// SHA-256.
    fn from_parts(
        root: PathBuf,
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
        skills: Vec<(String, Skill)>,
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
        let mut digests = BTreeMap::new();
        let skills: BTreeMap<String, Arc<Skill>> = skills
            .into_iter()
            .map(|(digest, skill)| {
                digests.insert(format!("skills/{}/SKILL.md", skill.name), digest);
                (skill.name.clone(), Arc::new(skill))
            })
            .collect();
        check_skills(&agent_defs, &skills)?;
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

        let (flow_names, agent_names) = (
            flow_specs.keys().map(String::as_str).collect(),
            agent_defs.keys().map(String::as_str).collect(),
        );
        check_names(&config, &flow_names, &agent_names)?;
        let files = snapshot_files(arbor_toml, agents, flows);
        digests.extend(
            files
                .iter()
                .map(|(path, text)| (path.clone(), sha256(text))),
        );
        let workspace = Workspace {
            version: version_of(&digests, &files),
            files,
            schedules: schedules_of(&flow_specs, &config)?,
            root,
            config,
            agents: agent_defs,
            flows: flow_specs,
            skills,
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
            let usd = flow.budget.as_ref().is_some_and(|b| b.usd.is_some())
                || workspace.config.budget_usd_micros.is_some();
            let steps = flow.groups.iter().flat_map(|g| g.steps.iter());
            if let Some(label) = steps
                .filter(|s| s.until.as_ref().is_some_and(|u| u.max_usd.is_some()))
                .map(|s| s.label.as_deref().unwrap_or(&s.agent))
                .find(|_| !usd)
            {
                return Err(invalid(
                    &flow_path(name),
                    format!(
                        "step {label}: until.max_usd needs a usd ceiling (the flow's budget.usd \
                         or arbor.toml's [budget] usd) to be metered against"
                    ),
                ));
            }
            if flow.budget.as_ref().is_some_and(|b| b.usd.is_some()) {
                let steps: Vec<&str> = flow
                    .groups
                    .iter()
                    .flat_map(|g| g.steps.iter())
                    .flat_map(|s| {
                        std::iter::once(s.agent.as_str())
                            .chain(s.until.as_ref().and_then(|u| u.judge.as_deref()))
                    })
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
        self.flow_run_with(name, budget_override, None)
    }

    /// `flow_run` given `input`: checked against the flow's declaration
    /// (refused naming where it fails its schema) and filled into its
    /// step instructions.
    pub fn flow_run_with(
        &self,
        name: &str,
        budget_override: Option<u64>,
        input: Option<&serde_json::Value>,
    ) -> Result<RunSpec, LoadError> {
        self.flow_spec(name, budget_override, Some(input))
    }

    /// A flow's steps as its file writes them, its input not asked for nor
    /// filled in: what `arbor check` reads.
    pub fn flow_shape(&self, name: &str) -> Result<RunSpec, LoadError> {
        self.flow_spec(name, None, None)
    }

    /// `flow_run_with`; `input: None` skips the input altogether.
    fn flow_spec(
        &self,
        name: &str,
        budget_override: Option<u64>,
        input: Option<Option<&serde_json::Value>>,
    ) -> Result<RunSpec, LoadError> {
        let flow = self.flows.get(name).ok_or_else(|| LoadError::UnknownFlow {
            name: name.to_string(),
            known: known(self.flows.keys()),
        })?;
        let path = flow_path(name);
        let input = match input {
            Some(input) => input::check(name, flow, input).map_err(LoadError::Input)?,
            None => None,
        };
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
        let pause = flow::pause(flow).map_err(|m| invalid(&path, m))?;
        let mut groups = flow.groups.clone();
        if let Some(input) = &input {
            input::render(&mut groups, input).map_err(|m| invalid(&path, m))?;
        }
        // The flow's `rerun_interrupted` is each step's that says nothing.
        if flow.rerun_interrupted {
            for step in groups.iter_mut().flat_map(|g| g.steps.iter_mut()) {
                step.rerun_interrupted.get_or_insert(true);
            }
        }
        Ok(RunSpec {
            budget_usd_micros: flow_usd.or(self.config.budget_usd_micros),
            flow: name.to_string(),
            groups,
            budget_tokens,
            timeout,
            record: false,
            replay: None,
            digests: Default::default(),
            tenant: None,
            instructions: None,
            verify: flow.verify.clone(),
            pause,
            priority: None,
            input,
            schedule: None,
            version: Some(self.version.clone()),
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
        spec.version = Some(self.version.clone());
        Ok(self.recording(spec, self.config.record_models))
    }

    /// The tenants a run can belong to: those of `[tenants]`, else the one
    /// there is, `default` (I-63).
    pub fn tenant_names(&self) -> Vec<String> {
        if self.config.tenants.is_empty() {
            return vec![arbor_protocol::DEFAULT_TENANT.to_string()];
        }
        self.config.tenants.keys().cloned().collect()
    }

    /// Each tenant's quota and what a submission over it meets, for the
    /// tenants that have one.
    pub fn quotas(&self) -> std::collections::BTreeMap<String, (Quota, OnQuota)> {
        self.config
            .tenants
            .iter()
            .filter_map(|(name, t)| Some((name.clone(), (t.quota.clone()?, t.on_quota))))
            .collect()
    }

    /// Tenant `name` of `[tenants]`, if arbor.toml names it.
    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.config.tenants.get(name)
    }

    /// `spec` as a run of `tenant`'s: refused if the tenant is unknown, or
    /// may not run its flow or an agent it reaches; else it names the
    /// tenant and carries its instructions (fixed at admission, I-67).
    /// Without `[tenants]`, only `default`, and the spec is unchanged.
    pub fn for_tenant(&self, tenant: &str, mut spec: RunSpec) -> Result<RunSpec, LoadError> {
        let refused = |message: String| LoadError::Refused { message };
        if self.config.tenants.is_empty() {
            if tenant != arbor_protocol::DEFAULT_TENANT {
                return Err(refused(format!(
                    "tenant {tenant} is not configured: arbor.toml has no [tenants], so every \
                     run is the `default` tenant's"
                )));
            }
            return Ok(spec);
        }
        let Some(config) = self.config.tenants.get(tenant) else {
            return Err(refused(format!(
                "tenant {tenant} is not configured (arbor.toml's tenants: {})",
                self.tenant_names().join(", ")
            )));
        };
        let reached = spec.reachable_agents(|name| self.agents.get(name));
        let reached: Vec<&str> = reached.iter().map(|a| a.name.as_str()).collect();
        if let Some(why) = config.refuses(tenant, &spec.flow, &reached) {
            return Err(refused(why));
        }
        spec.tenant = Some(tenant.to_string());
        spec.instructions = config.instructions.clone();
        Ok(spec)
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
    /// it is a single agent's run), every agent it can reach and their skills.
    pub fn digests_for(&self, spec: &RunSpec) -> BTreeMap<String, String> {
        let mut paths = vec![
            "arbor.toml".to_string(),
            format!("flows/{}.toml", spec.flow),
        ];
        for agent in spec.reachable_agents(|name| self.agents.get(name)) {
            paths.push(format!("agents/{}/agent.md", agent.name));
            paths.extend(agent.skills.iter().map(|s| format!("skills/{s}/SKILL.md")));
        }
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

/// Every skill an agent names is in `skills/`.
fn check_skills(
    agents: &BTreeMap<String, AgentDef>,
    skills: &BTreeMap<String, Arc<Skill>>,
) -> Result<(), LoadError> {
    for (name, agent) in agents {
        if let Some(missing) = agent.skills.iter().find(|s| !skills.contains_key(*s)) {
            let have = match skills.is_empty() {
                true => "it has none".to_string(),
                false => format!(
                    "it has: {}",
                    skills.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            };
            return Err(invalid(
                &agent_path(name),
                format!("skills: `{missing}` is not a skill in skills/ ({have})"),
            ));
        }
    }
    Ok(())
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
        for allowed in agent.allowed_models() {
            check_model(agent, allowed, config).map_err(|why| invalid(&agent_path(name), why))?;
        }
    }
    Ok(())
}

/// One model an agent may run on (I-55): declared in arbor.toml, with
/// settings its provider takes.
fn check_model(agent: &AgentDef, model: &ModelRef, config: &Config) -> Result<(), String> {
    let ModelRef::Provider { provider, model } = model else {
        return Ok(());
    };
    let key = if agent.models.is_empty() {
        "model"
    } else {
        "models"
    };
    let Some(p) = config.providers.get(provider) else {
        return Err(format!(
            "{key}: `{provider}/{model}`: arbor.toml has no [providers.{provider}] (known: {})",
            known(config.providers.keys())
        ));
    };
    let Some(entry) = p.models.get(model) else {
        return Err(format!(
            "{key}: `{provider}/{model}`: arbor.toml has no [providers.{provider}.models.{model}] (known: {})",
            known(p.models.keys())
        ));
    };
    let settings = agent.settings.over(entry.settings);
    settings_refused(p.kind, settings, entry.thinking_tokens.is_some())
        .map_err(|why| format!("{why} (on `{provider}/{model}`)"))
}

/// Settings a provider of `kind` would refuse, as a line naming the key.
/// `thinks`: the model entry gives `thinking_tokens`.
fn settings_refused(
    kind: arbor_providers::ProviderKind,
    settings: Settings,
    thinks: bool,
) -> Result<(), String> {
    use arbor_providers::ProviderKind;
    if settings.effort.is_some() {
        if kind == ProviderKind::Anthropic && !thinks {
            return Err(
                "effort: on Anthropic it is extended thinking, and its model entry in arbor.toml \
                 gives no budget: add thinking_tokens = { low = 2048, medium = 8192, high = 16384 }"
                    .into(),
            );
        }
        for (key, set) in [
            ("temperature", settings.temperature_milli.is_some()),
            ("top_p", settings.top_p_milli.is_some()),
        ] {
            if set {
                return Err(format!(
                    "{key}: a reasoning model (effort) refuses sampling settings; set one or the other"
                ));
            }
        }
    }
    if kind == ProviderKind::Anthropic
        && settings.temperature_milli.is_some()
        && settings.top_p_milli.is_some()
    {
        return Err("top_p: Anthropic's models take temperature or top_p, not both".into());
    }
    Ok(())
}

/// A provider model `agent` may run on that has no price, as `provider/model`.
fn unpriced(agent: &AgentDef, config: &Config) -> Option<String> {
    // Any model a job of it may run on (I-55) must keep a usd ceiling.
    agent.allowed_models().iter().find_map(|allowed| {
        let ModelRef::Provider { provider, model } = allowed else {
            return None;
        };
        let priced = config
            .providers
            .get(provider)
            .and_then(|p| p.models.get(model))
            .is_some_and(|m| m.price.is_some());
        (!priced).then(|| format!("{provider}/{model}"))
    })
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

/// What arbor.toml names across files: each tenant's flows and agents, each
/// concurrency key's, each trigger's flow and tenant.
/// The files a run pins, by path (`Workspace::files`).
fn snapshot_files(
    arbor_toml: Option<&str>,
    agents: &[(&str, &str)],
    flows: &[(&str, &str)],
) -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    files.insert(
        "arbor.toml".to_string(),
        arbor_toml.unwrap_or("").to_string(),
    );
    for &(name, text) in agents {
        files.insert(format!("agents/{name}/agent.md"), text.to_string());
    }
    for &(name, text) in flows {
        files.insert(format!("flows/{name}.toml"), text.to_string());
    }
    files
}

/// `Workspace::version`: of the pinned files' digests, in path order.
fn version_of(digests: &BTreeMap<String, String>, files: &BTreeMap<String, String>) -> String {
    let listed: String = files
        .keys()
        .filter_map(|path| digests.get(path).map(|d| format!("{path}\0{d}\n")))
        .collect();
    sha256(&listed)[..16].to_string()
}

/// Every flow's schedules, checked: a unique name, a cron that fires, a
/// zone, an input the flow takes, a tenant arbor.toml names.
fn schedules_of(
    flows: &BTreeMap<String, FlowSpec>,
    config: &Config,
) -> Result<BTreeMap<String, crate::schedules::Schedule>, LoadError> {
    let mut schedules = BTreeMap::new();
    for (flow_name, flow) in flows {
        let path = flow_path(flow_name);
        for spec in &flow.schedules {
            let name = &spec.name;
            parse::check_name("schedule", name).map_err(|m| invalid(&path, m))?;
            let schedule = crate::schedules::Schedule::check(flow_name, spec)
                .map_err(|m| invalid(&path, m))?;
            input::check(flow_name, flow, spec.input.as_ref())
                .map_err(|m| invalid(&path, format!("schedule {name}: {m}")))?;
            if let Some(tenant) = &spec.tenant
                && !config.tenants.contains_key(tenant)
            {
                return Err(invalid(
                    &path,
                    format!("schedule {name}: tenant `{tenant}` is not one of [tenants]"),
                ));
            }
            if let Some(other) = schedules.insert(name.clone(), schedule) {
                return Err(invalid(
                    &path,
                    format!(
                        "schedule {name}: flow {} has a schedule of that name already (a schedule's name is unique in the workspace)",
                        other.flow
                    ),
                ));
            }
        }
    }
    Ok(schedules)
}

fn check_names(
    config: &Config,
    flow_names: &std::collections::BTreeSet<&str>,
    agent_names: &std::collections::BTreeSet<&str>,
) -> Result<(), LoadError> {
    for (name, tenant) in &config.tenants {
        tenant
            .check_names(name, flow_names, agent_names)
            .map_err(|m| invalid(Path::new("arbor.toml"), m))?;
    }
    for (name, trigger) in &config.triggers {
        if !flow_names.contains(trigger.flow.as_str()) {
            return Err(invalid(
                Path::new("arbor.toml"),
                format!(
                    "triggers.{name}.flow: `{}` is not one of the workspace's flows",
                    trigger.flow
                ),
            ));
        }
        if let Some(tenant) = &trigger.tenant
            && !config.tenants.contains_key(tenant)
        {
            return Err(invalid(
                Path::new("arbor.toml"),
                format!("triggers.{name}.tenant: `{tenant}` is not one of [tenants]"),
            ));
        }
    }
    let concurrency = &config.limits.concurrency;
    for (key, names, known) in [
        ("per_flow", &concurrency.per_flow, flow_names),
        ("per_agent", &concurrency.per_agent, agent_names),
    ] {
        if let Some(missing) = names.keys().find(|n| !known.contains(n.as_str())) {
            return Err(invalid(
                Path::new("arbor.toml"),
                format!("limits.concurrency.{key}: `{missing}` is not one of the workspace's"),
            ));
        }
    }
    Ok(())
}
