//! Where a node's secret values come from (I-27): `[sandbox] secrets_file`,
//! then the node's environment. Only the names agents and MCP servers
//! declare are read.
//!
//! Invariant: no error here shows a value; each names the file, the line or
//! the secret.

use crate::workspace::Workspace;
use arbor_actors::secrets::Secrets;
use arbor_protocol::AgentDef;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// The values of every secret the workspace's agents and MCP servers
/// declare, and of each notification endpoint's and trigger's signing
/// secret. A name with no value is no error here: the run that needs it
/// is refused (`missing`), and a server that needs it does not start.
pub fn load(workspace: &Workspace) -> Result<Secrets, String> {
    let names: BTreeSet<&String> = workspace
        .agents
        .values()
        .flat_map(|a| &a.secrets)
        .chain(workspace.config.mcp.values().flat_map(|s| &s.secrets))
        .chain(workspace.config.notify.values().map(|e| &e.secret))
        .chain(workspace.config.triggers.values().map(|t| &t.secret))
        .collect();
    let from_file = match &workspace.config.secrets_file {
        Some(path) => read_file(path)?,
        None => BTreeMap::new(),
    };
    let mut values = BTreeMap::new();
    for name in names {
        let value = from_file
            .get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok());
        if let Some(value) = value {
            values.insert(name.clone(), value);
        }
    }
    Ok(Secrets::new(values))
}

/// `NAME=value` lines; blank lines and `#` comments are skipped. Refused if
/// group or others may read it.
fn read_file(path: &Path) -> Result<BTreeMap<String, String>, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{shown}: the secrets file is readable by group or others (mode {mode:03o}); \
             `chmod 600 {shown}` first"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
    let mut values = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once('=') else {
            return Err(format!(
                "{shown}:{}: not `NAME=value` (the line is not shown)",
                n + 1
            ));
        };
        values.insert(name.trim().to_string(), value.to_string());
    }
    Ok(values)
}

/// The first secret that an agent of this run (its steps and every
/// sub-agent below them), or an MCP server one of them names, declares and
/// that has no value, as an error.
pub fn missing<'a>(
    agents: &'a BTreeMap<String, std::sync::Arc<AgentDef>>,
    steps: impl IntoIterator<Item = &'a str>,
    servers: &arbor_actors::mcp::McpCatalog,
    secrets: &Secrets,
) -> Option<String> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<&str> = steps.into_iter().collect();
    while let Some(name) = todo.pop() {
        if !seen.insert(name) {
            continue;
        }
        let Some(agent) = agents.get(name) else {
            continue;
        };
        if let Some(secret) = agent.secrets.iter().find(|s| !secrets.has(s)) {
            return Some(format!(
                "agents/{name}/agent.md: the secret {secret} has no value: set {secret} in the \
                 node's environment or in [sandbox] secrets_file"
            ));
        }
        for server in agent.mcp.iter().filter_map(|p| servers.server(&p.server)) {
            if let Some(secret) = server.secrets.iter().find(|s| !secrets.has(s)) {
                return Some(format!(
                    "arbor.toml: mcp.servers.{}: the secret {secret} has no value (agents/{name} \
                     uses the server): set {secret} in the node's environment or in [sandbox] \
                     secrets_file",
                    server.name
                ));
            }
        }
        todo.extend(agent.subagents.iter().map(String::as_str));
    }
    None
}
