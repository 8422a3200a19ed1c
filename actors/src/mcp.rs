//! MCP tools for a job: what each declared server offers (listed once per
//! node and kept), which of those tools a job may use (its `Policy`, I-44),
//! the names its model sees, and each call's arguments checked against the
//! tool's input schema before anything is sent.
//!
//! Invariants:
//! 1. A tool a policy does not allow is never offered, and a call of it is
//!    refused with the reason, at every depth below a deny (I-44).
//! 2. Within one job, a model name stands for exactly one tool: a second
//!    tool that would take a name already given is left out, with a warning.
//! 3. A listing reaches the server as a job's call would: a stdio server
//!    runs sealed, with its declared secrets only, in a folder of the
//!    node's own, and is killed once it has answered; a node that cannot
//!    seal lists no stdio server (none ever runs unsealed but under
//!    `[sandbox] mode = "none"`).

use crate::mcp_server::{LiveServer, ServerLaunch};
use crate::model::ToolSpec;
use crate::policy::Policy;
use crate::secrets::Secrets;
use arbor_mcp::McpTool;
use arbor_protocol::mcp::{canonical_name, model_name};
use arbor_protocol::{McpServerSpec, McpTransport, Resources, StdioServer};
use arbor_sandbox::seal::{Posture, SandboxIsolation, SandboxUser};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::OnceCell;

/// The node's MCP servers (arbor.toml `[mcp.servers]`) and the tools each
/// lists, asked once per server and kept for the node's life.
pub struct McpCatalog {
    servers: BTreeMap<String, Arc<McpServerSpec>>,
    /// Where listing processes run: `<scratch>/<server>`.
    scratch: PathBuf,
    posture: Arc<Posture>,
    /// The node's `[sandbox]` limits, which a listing runs under.
    resources: Resources,
    roots: Option<PathBuf>,
    secrets: Arc<Secrets>,
    lists: Mutex<HashMap<String, Listing>>,
}

/// One server's tools, once listed.
type Listing = Arc<OnceCell<Arc<[McpTool]>>>;

impl McpCatalog {
    pub fn new(
        servers: BTreeMap<String, Arc<McpServerSpec>>,
        scratch: PathBuf,
        posture: Arc<Posture>,
        resources: Resources,
        roots: Option<PathBuf>,
        secrets: Arc<Secrets>,
    ) -> Self {
        Self {
            servers,
            scratch,
            posture,
            resources,
            roots,
            secrets,
            lists: Mutex::new(HashMap::new()),
        }
    }

    /// A catalogue of no servers.
    pub fn empty() -> Self {
        Self::new(
            BTreeMap::new(),
            PathBuf::new(),
            Arc::new(Posture::assumed(SandboxIsolation::None)),
            Resources::default(),
            None,
            Arc::new(Secrets::default()),
        )
    }

    pub fn server(&self, name: &str) -> Option<&Arc<McpServerSpec>> {
        self.servers.get(name)
    }

    /// The tools `server` lists. The first ask starts the server to list
    /// them; a failure is not kept, so the next ask tries again.
    pub async fn tools(&self, server: &str) -> Result<Arc<[McpTool]>, String> {
        let spec = self
            .servers
            .get(server)
            .ok_or_else(|| format!("arbor.toml declares no [mcp.servers.{server}]"))?
            .clone();
        let cell = self
            .lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(server.to_string())
            .or_default()
            .clone();
        cell.get_or_try_init(|| self.list(spec))
            .await
            .map(Arc::clone)
    }

    async fn list(&self, spec: Arc<McpServerSpec>) -> Result<Arc<[McpTool]>, String> {
        // Dropped at the end of this function: the listing server is
        // killed, or its session ended.
        let server = match &spec.transport {
            McpTransport::Stdio(stdio) => self.start(&spec, stdio).await?,
            McpTransport::Http(http) => {
                LiveServer::connect_http(http, &spec, &self.secrets).await?
            }
        };
        let tools = server
            .client
            .list_tools(spec.start_timeout)
            .await
            .map_err(|e| e.to_string())?;
        server.kill();
        Ok(tools.into())
    }

    /// Starts a stdio server to list its tools, as a job would.
    async fn start(&self, spec: &McpServerSpec, stdio: &StdioServer) -> Result<LiveServer, String> {
        let sealed = match self.posture.mode {
            SandboxIsolation::None => false,
            SandboxIsolation::Sealed if self.posture.sealed => true,
            SandboxIsolation::Sealed => {
                return Err(format!(
                    "it would run unsealed, and this node {}",
                    self.posture.detail
                ));
            }
        };
        let workdir = self.scratch.join(&spec.name);
        let at = |e: std::io::Error| format!("{}: {e}", workdir.display());
        std::fs::create_dir_all(&workdir).map_err(at)?;
        let workdir = std::fs::canonicalize(&workdir).map_err(at)?;
        let user = if sealed {
            SandboxUser::for_new_sandbox()
        } else {
            None
        };
        if let Some(user) = user {
            user.own(&workdir).map_err(at)?;
        }
        let launch = ServerLaunch {
            workdir,
            sealed,
            user,
            resources: self.resources,
            roots: self.roots.clone(),
        };
        let child = launch.spawn(spec, stdio, &self.secrets).await?;
        LiveServer::connect(child, spec, &self.secrets).await
    }
}

/// One MCP tool as a job sees it.
#[derive(Clone)]
pub struct McpToolEntry {
    pub server: Arc<McpServerSpec>,
    /// The server's own name for it, which `tools/call` takes.
    pub own: String,
    /// `mcp__SERVER__TOOL`: what policies, limits and events say.
    pub canonical: String,
    /// Its arguments' schema, compiled.
    validator: Arc<jsonschema::Validator>,
}

impl McpToolEntry {
    /// The arguments as an object that matches the tool's input schema, or
    /// what is wrong with them, said as the model can mend it.
    pub fn check(
        &self,
        args: &serde_json::Value,
    ) -> Result<serde_json::Map<String, serde_json::Value>, String> {
        let object = match args {
            serde_json::Value::Null => serde_json::Map::new(),
            serde_json::Value::Object(map) => map.clone(),
            other => {
                return Err(format!(
                    "bad arguments for {}: an object is expected, not {other}",
                    self.canonical
                ));
            }
        };
        let value = serde_json::Value::Object(object);
        let problems: Vec<String> = self
            .validator
            .iter_errors(&value)
            .take(5)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() {
                    e.to_string()
                } else {
                    format!("{at}: {e}")
                }
            })
            .collect();
        if !problems.is_empty() {
            return Err(format!(
                "bad arguments for {}: {}; nothing was sent",
                self.canonical,
                problems.join("; ")
            ));
        }
        match value {
            serde_json::Value::Object(map) => Ok(map),
            _ => unreachable!("built as an object above"),
        }
    }
}

/// The MCP tools one job is offered, by the name its model sees.
#[derive(Clone, Default)]
pub struct McpToolbox {
    tools: BTreeMap<String, McpToolEntry>,
    /// Tools of its servers it may not use, by model name: their canonical
    /// name and why, so a call of one is refused with the reason.
    refused: BTreeMap<String, (String, String)>,
    specs: Vec<ToolSpec>,
}

impl McpToolbox {
    /// Lists each server `policy` names (through the catalogue) and keeps
    /// the tools it allows. A server that cannot list its tools fails the
    /// whole: a job whose tools are missing would work blind.
    pub async fn for_job(catalog: &McpCatalog, policy: &Policy) -> Result<Self, String> {
        let servers: BTreeSet<&str> = policy.mcp.iter().map(|p| p.server.as_str()).collect();
        let mut toolbox = McpToolbox::default();
        for server in servers {
            let listed = catalog
                .tools(server)
                .await
                .map_err(|e| format!("the MCP server {server} could not list its tools: {e}"))?;
            let Some(spec) = catalog.server(server) else {
                continue;
            };
            for tool in listed.iter() {
                toolbox.add(spec, tool, policy);
            }
        }
        Ok(toolbox)
    }

    fn add(&mut self, spec: &Arc<McpServerSpec>, tool: &McpTool, policy: &Policy) {
        let canonical = canonical_name(&spec.name, &tool.name);
        let short = &canonical[arbor_protocol::mcp::MCP_PREFIX.len() + spec.name.len() + 2..];
        let name = model_name(&canonical);
        if let Err(why) = policy.mcp_verdict(&spec.name, short, &canonical) {
            self.refused.insert(name, (canonical, why));
            return;
        }
        if let Some(taken) = self.tools.get(&name) {
            tracing::warn!(
                server = %spec.name,
                tool = %tool.name,
                taken_by = %taken.own,
                "an MCP tool's name is taken by another of the server's tools; it is not offered"
            );
            return;
        }
        let validator = match jsonschema::validator_for(&tool.input_schema) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(
                    server = %spec.name,
                    tool = %tool.name,
                    error = %e,
                    "an MCP tool's input schema is not a JSON Schema; it is not offered"
                );
                return;
            }
        };
        let description = format!("[MCP server {}] {}", spec.name, tool.description);
        self.specs.push(ToolSpec {
            name: name.clone().into(),
            description: description.into(),
            parameters: Arc::new(tool.input_schema.clone()),
        });
        self.tools.insert(
            name,
            McpToolEntry {
                server: spec.clone(),
                own: tool.name.clone(),
                canonical,
                validator: Arc::new(validator),
            },
        );
    }

    /// The tool the model calls by `name`, if it is one of these.
    pub fn get(&self, name: &str) -> Option<&McpToolEntry> {
        self.tools.get(name)
    }

    /// A tool of its servers it may not use: its canonical name and why.
    pub fn refusal(&self, name: &str) -> Option<(&str, &str)> {
        self.refused
            .get(name)
            .map(|(canonical, why)| (canonical.as_str(), why.as_str()))
    }

    /// What the model is shown of them.
    pub fn specs(&self) -> &[ToolSpec] {
        &self.specs
    }
}

/// A call's result as the model reads it: its text, or, when it has none,
/// its structured part (a server that gives both repeats the one in the
/// other, as the protocol asks); secrets cut out (I-27) and the whole
/// clipped to `limit` bytes, saying so.
pub fn result_text(outcome: &arbor_mcp::McpOutcome, secrets: &Secrets, limit: usize) -> String {
    let mut text = outcome.text.clone();
    if text.trim().is_empty()
        && let Some(structured) = &outcome.structured
    {
        text = structured.to_string();
    }
    if text.len() <= limit {
        return secrets.redact(&text);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let total = text.len();
    text.truncate(end);
    format!(
        "{}\n[cut: the result was {total} bytes, {limit} are shown]",
        secrets.redact_cut(&text)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_mcp::McpOutcome;

    fn outcome(text: &str, structured: Option<serde_json::Value>) -> McpOutcome {
        McpOutcome {
            is_error: false,
            text: text.into(),
            structured,
        }
    }

    #[test]
    fn inv_27_a_result_is_redacted_clipped_and_says_it_was_cut() {
        let secrets = Secrets::new(BTreeMap::from([(
            "TOKEN".to_string(),
            "s3cr3t-value".to_string(),
        )]));
        let said = result_text(&outcome("token is s3cr3t-value", None), &secrets, 100);
        assert_eq!(said, "token is [secret TOKEN]");
        // Cut in the middle of the value: neither it nor its start is left.
        let long = format!("{}s3cr3t-value and more", "x".repeat(90));
        let said = result_text(&outcome(&long, None), &secrets, 95);
        assert!(!said.contains("s3cr3"), "{said}");
        assert!(
            said.ends_with("[cut: the result was 111 bytes, 95 are shown]"),
            "{said}"
        );
    }

    #[test]
    fn structured_content_stands_in_only_for_missing_text() {
        let secrets = Secrets::default();
        let both = outcome("7", Some(serde_json::json!({"sum": 7})));
        assert_eq!(result_text(&both, &secrets, 100), "7");
        let only = outcome("", Some(serde_json::json!({"sum": 7})));
        assert_eq!(result_text(&only, &secrets, 100), r#"{"sum":7}"#);
    }
}
