//! `arbor.toml`: the node's limits, providers, sandbox, MCP servers,
//! approvals, journal, recording and telemetry, with defaults applied.

use super::parse::{
    DEFAULT_BUDGET_TOKENS, LoadError, invalid, is_secret_name, over, resources, toml_error,
};
use arbor_protocol::mcp::{
    DEFAULT_CALL_TIMEOUT, DEFAULT_START_TIMEOUT, HttpServer, McpTransport, Piece, RESERVED_HEADERS,
    StdioServer, check_server_name, placeholders,
};
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    ApprovalSettings, BudgetArg, Limits, McpServerSpec, Network, Resources, ResourcesSpec,
};
use arbor_providers::{Provider, ProviderFile, check_provider};
use arbor_sandbox::seal::SandboxIsolation;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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
    /// `[auth]`, as written: arbord's identities (`[auth.oidc]`), which
    /// arbord checks.
    pub auth: toml::Table,
    /// `[retention]`, as written: how long arbord keeps its audit log
    /// (`keep_audit`), which arbord checks.
    pub retention: toml::Table,
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
    /// `[notify.NAME]`: where notifications of events go (docs/operations.md,
    /// "Notifications").
    pub notify: BTreeMap<String, crate::notify::Endpoint>,
    /// `[tenants.NAME]`: the teams sharing the node (I-63); none: one
    /// tenant, `default`.
    pub tenants: BTreeMap<String, super::tenants::Tenant>,
    /// `[triggers.NAME]`: flows started by a signed call (docs/flows.md).
    pub triggers: BTreeMap<String, crate::triggers::Trigger>,
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

impl Default for Config {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            budget_tokens: DEFAULT_BUDGET_TOKENS,
            budget_usd_micros: None,
            providers: BTreeMap::new(),
            service: toml::Table::new(),
            auth: toml::Table::new(),
            retention: toml::Table::new(),
            sandbox: DEFAULT_SANDBOX,
            isolation: SandboxIsolation::Sealed,
            secrets_file: None,
            mcp: BTreeMap::new(),
            approvals: ApprovalSettings::default(),
            journal: JournalConfig::Sled,
            record_models: false,
            telemetry: Default::default(),
            notify: BTreeMap::new(),
            triggers: BTreeMap::new(),
            tenants: BTreeMap::new(),
        }
    }
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
    auth: toml::Table,
    #[serde(default)]
    retention: toml::Table,
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
    #[serde(default)]
    notify: BTreeMap<String, crate::notify::EndpointFile>,
    #[serde(default)]
    tenants: BTreeMap<String, super::tenants::TenantFile>,
    #[serde(default)]
    triggers: BTreeMap<String, crate::triggers::TriggerFile>,
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

pub(super) fn parse_config(text: &str, root: &Path) -> Result<Config, LoadError> {
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
    let mut notify = BTreeMap::new();
    for (name, block) in file.notify {
        let endpoint = block.check(&name).map_err(|m| invalid(path, m))?;
        notify.insert(name, endpoint);
    }
    let mut tenants = BTreeMap::new();
    for (name, block) in file.tenants {
        let tenant = block.check(&name).map_err(|m| invalid(path, m))?;
        tenants.insert(name, tenant);
    }
    let mut triggers = BTreeMap::new();
    for (name, block) in file.triggers {
        super::parse::check_name("trigger", &name).map_err(|m| invalid(path, m))?;
        let trigger = block
            .check(&name, super::parse::is_secret_name)
            .map_err(|m| invalid(path, m))?;
        triggers.insert(name, trigger);
    }
    Ok(Config {
        telemetry,
        notify,
        tenants,
        triggers,
        approvals,
        journal,
        record_models: file.record.models,
        limits: file.limits,
        budget_tokens,
        budget_usd_micros,
        providers,
        service: file.service,
        auth: file.auth,
        retention: file.retention,
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
