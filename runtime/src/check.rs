//! `arbor check DIR`: a workspace's problems, all of them, before anything runs.
//!
//! `Workspace::load` stops at the first problem, because a node must not
//! start on a broken workspace. This reads every agent on its own and then
//! looks across them, so one pass reports everything:
//!
//! - errors (a run would be refused, or would not do what the files say):
//!   an agent file that does not parse (an unknown tool or key among them),
//!   a sub-agent that is not an agent, a sub-agent without a description, a
//!   cycle in `subagents`, a `sandbox: own` sub-agent that has sub-agents of
//!   its own (it may not delegate, I-26), and anything else `Workspace::load`
//!   refuses (arbor.toml, flows);
//! - warnings: a shared-sandbox sub-agent that declares tools, network or
//!   secrets its parent lacks or denies (they are dropped: allowlists
//!   intersect, I-25); an agent that reads untrusted input, holds secrets
//!   and can send outward, all three at once (it can be talked into sending
//!   its secrets away);
//! - info: a `sandbox: own` sub-agent holding tools, network or secrets its
//!   parent lacks (it keeps them, by I-26); a flow step that may act outside
//!   its workdir, and why (after a crash it waits for a person, I-57).
//!
//! `check_servers` adds what only the MCP servers can tell: a server whose
//! command is not on the sandbox's PATH, one that does not start and list
//! its tools, and an agent naming a tool its server does not list. It runs
//! each server an agent names, sealed, as a job would.

use crate::workspace::{Workspace, parse_agent, subagent_problems};
use arbor_protocol::{AgentDef, Network, SandboxMode};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Error,
    Warning,
    Info,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warning => "warning",
            Level::Info => "info",
        }
    }
}

/// One problem, in the file it is about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub level: Level,
    /// Relative to the workspace (`agents/NAME/agent.md`, `arbor.toml`, ...).
    pub file: String,
    pub message: String,
}

fn agent_file(name: &str) -> String {
    format!("agents/{name}/agent.md")
}

/// Every finding of the workspace at `dir`, errors first, then by file.
pub fn check(dir: &Path) -> Vec<Finding> {
    let mut findings = vec![];
    let mut agents = BTreeMap::new();
    let mut unreadable = BTreeSet::new();
    let agents_dir = dir.join("agents");
    let mut folders: Vec<(String, PathBuf)> = std::fs::read_dir(&agents_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(name, _)| !name.starts_with('.'))
        .collect();
    folders.sort();
    for (name, path) in folders {
        let file = path.join("agent.md");
        let parsed = std::fs::read_to_string(&file)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                parse_agent(&name, &text, Path::new(&agent_file(&name))).map_err(|e| e.to_string())
            });
        match parsed {
            Ok(agent) => {
                agents.insert(name, agent);
            }
            Err(message) => {
                findings.push(Finding {
                    level: Level::Error,
                    file: agent_file(&name),
                    message: message
                        .strip_prefix(&format!("{}: ", agent_file(&name)))
                        .unwrap_or(&message)
                        .to_string(),
                });
                unreadable.insert(name);
            }
        }
    }
    across(&agents, &unreadable, &mut findings);
    // What only the whole load sees (arbor.toml, flows, models), if the
    // agents themselves were sound.
    let loaded = findings
        .iter()
        .all(|f| f.level != Level::Error)
        .then(|| Workspace::load(dir));
    if let Some(Ok(workspace)) = &loaded {
        findings.extend(outward_steps(workspace));
    }
    if let Some(Err(e)) = loaded {
        let text = e.to_string();
        let (file, message) = match text.split_once(": ") {
            Some((file, message)) if !file.contains(' ') => (file.to_string(), message.to_string()),
            _ => (String::new(), text),
        };
        findings.push(Finding {
            level: Level::Error,
            file,
            message,
        });
    }
    findings.sort_by(|a, b| (a.level, &a.file).cmp(&(b.level, &b.file)));
    findings
}

/// I-57: each flow step that may act outside its workdir, and why: after a
/// crash it waits for a person, unless its flow re-runs it regardless.
fn outward_steps(workspace: &Workspace) -> Vec<Finding> {
    let mut findings = vec![];
    for name in workspace.flows.keys() {
        let Ok(spec) = workspace.flow_shape(name) else {
            continue;
        };
        for (group, labels) in spec.groups.iter().zip(spec.step_labels()) {
            for (step, label) in group.steps.iter().zip(labels) {
                let Some(root) = workspace.agents.get(&step.agent) else {
                    continue;
                };
                let reasons = arbor_protocol::outward_reasons(
                    root,
                    |n| workspace.agents.get(n),
                    |n| workspace.config.mcp.get(n).map(|s| s.as_ref()),
                );
                if reasons.is_empty() {
                    continue;
                }
                let then = if step.rerun_interrupted == Some(true) {
                    "interrupted by a crash, it is run again all the same (rerun_interrupted)"
                } else {
                    "interrupted by a crash, it waits for a person to continue it or stop the run"
                };
                findings.push(Finding {
                    level: Level::Info,
                    file: format!("flows/{name}.toml"),
                    message: format!("step {label} is outward ({}): {then}", reasons.join("; ")),
                });
            }
        }
    }
    findings
}

/// `check`, and then, for a workspace that loads, its MCP servers: each
/// one an agent names is started (sealed, in a folder of its own below
/// the temporary directory) and asked for its tools.
pub async fn check_servers(dir: &Path) -> Vec<Finding> {
    let mut findings = check(dir);
    if findings.iter().any(|f| f.level == Level::Error) {
        return findings;
    }
    let Ok(workspace) = Workspace::load(dir) else {
        return findings;
    };
    findings.extend(server_findings(&workspace).await);
    findings.sort_by(|a, b| (a.level, &a.file).cmp(&(b.level, &b.file)));
    findings
}

async fn server_findings(workspace: &Workspace) -> Vec<Finding> {
    let mut findings = vec![];
    let named: BTreeSet<&str> = workspace
        .agents
        .values()
        .flat_map(|a| a.mcp.iter().map(|p| p.server.as_str()))
        .collect();
    if named.is_empty() {
        return findings;
    }
    let error = |file: String, message: String| Finding {
        level: Level::Error,
        file,
        message,
    };
    let (catalog, _scratch) = match listing_catalog(workspace).await {
        Ok(listing) => listing,
        Err((file, message)) => return vec![error(file, message)],
    };
    for server in named {
        let Some(spec) = workspace.config.mcp.get(server) else {
            continue;
        };
        if let arbor_protocol::McpTransport::Stdio(stdio) = &spec.transport
            && let Err(message) = command_found(&stdio.command)
        {
            findings.push(error(
                "arbor.toml".into(),
                format!("mcp.servers.{server}: {message}"),
            ));
            continue;
        }
        let listed = match catalog.tools(server).await {
            Ok(listed) => listed,
            Err(message) => {
                findings.push(error(
                    "arbor.toml".into(),
                    format!("mcp.servers.{server}: it did not start and list its tools: {message}"),
                ));
                continue;
            }
        };
        let names: BTreeSet<String> = listed
            .iter()
            .map(|t| arbor_protocol::mcp::canonical_name(server, &t.name))
            .collect();
        for (agent, def) in &workspace.agents {
            for pattern in def.mcp.iter().filter(|p| p.server == server) {
                if pattern.tool.is_some() && !names.contains(&pattern.to_string()) {
                    findings.push(error(
                        agent_file(agent),
                        format!(
                            "tools: {pattern}: the server {server} lists no such tool (it lists: {})",
                            names.iter().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
            }
        }
    }
    findings
}

/// A catalogue of the workspace's MCP servers that lists each as a job
/// would see it (sealed, with its declared secrets), in a temporary folder
/// that lives as long as the returned guard. An error names the file at
/// fault (empty for the machine's) and why.
pub(crate) async fn listing_catalog(
    workspace: &Workspace,
) -> Result<(arbor_actors::mcp::McpCatalog, tempfile::TempDir), (String, String)> {
    let secrets = crate::secrets::load(workspace)
        .map(std::sync::Arc::new)
        .map_err(|message| ("arbor.toml".to_string(), message))?;
    let scratch =
        tempfile::tempdir().map_err(|e| (String::new(), format!("a temporary folder: {e}")))?;
    let posture = arbor_sandbox::seal::Posture::probe(workspace.config.isolation).await;
    let catalog = arbor_actors::mcp::McpCatalog::new(
        workspace.config.mcp.clone(),
        scratch.path().join("mcp"),
        std::sync::Arc::new(posture),
        workspace.config.sandbox,
        Some(scratch.path().join("roots")),
        secrets,
    );
    Ok((catalog, scratch))
}

/// The sandbox's PATH: where a server's command is looked up.
const SANDBOX_PATH: [&str; 3] = ["/usr/local/bin", "/usr/bin", "/bin"];

/// Whether a server's command names a program a sandbox can run.
fn command_found(command: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if command.contains('/') {
        return if runnable(Path::new(command)) {
            Ok(())
        } else {
            Err(format!("command `{command}` is not a program that can run"))
        };
    }
    if SANDBOX_PATH
        .iter()
        .any(|dir| runnable(&Path::new(dir).join(command)))
    {
        Ok(())
    } else {
        Err(format!(
            "command `{command}` is not found on the sandbox's PATH ({})",
            SANDBOX_PATH.join(":")
        ))
    }
}

/// The checks that look from one agent to another.
fn across(
    agents: &BTreeMap<String, AgentDef>,
    unreadable: &BTreeSet<String>,
    findings: &mut Vec<Finding>,
) {
    let mut push = |level, name: &str, message: String| {
        findings.push(Finding {
            level,
            file: agent_file(name),
            message,
        })
    };
    for (file_of, message) in subagent_problems(agents, unreadable) {
        push(Level::Error, &file_of, message);
    }
    for (name, agent) in agents {
        for sub in &agent.subagents {
            let Some(child) = agents.get(sub) else {
                continue;
            };
            if let Some(message) = unasked_own(name, agent, child) {
                push(Level::Warning, sub, message);
            }
            // Skills are cut to the parent's in either sandbox (I-25).
            let unread: Vec<&str> = child
                .skills
                .iter()
                .filter(|s| !agent.skills.contains(s))
                .map(String::as_str)
                .collect();
            if !unread.is_empty() {
                push(
                    Level::Warning,
                    sub,
                    format!(
                        "names skills {} but its parent {name} may not read them: below {name} they are not offered",
                        unread.join(", ")
                    ),
                );
            }
            let parent_tools: BTreeSet<&str> = agent
                .tools
                .iter()
                .map(|t| t.as_str())
                .filter(|t| !agent.deny.iter().any(|d| d == t))
                .collect();
            let mut beyond: Vec<String> = child
                .tools
                .iter()
                .map(|t| t.as_str())
                .filter(|t| !parent_tools.contains(t))
                .map(String::from)
                .collect();
            if child.network == Network::Open && agent.network != Network::Open {
                beyond.push("network: open".into());
            }
            beyond.extend(
                child
                    .secrets
                    .iter()
                    .filter(|s| !agent.secrets.contains(s))
                    .map(|s| format!("secret {s}")),
            );
            if beyond.is_empty() {
                continue;
            }
            match child.sandbox {
                SandboxMode::Shared => push(
                    Level::Warning,
                    sub,
                    format!(
                        "declares {} but its parent {name} does not have {}: in {name}'s sandbox {} dropped",
                        beyond.join(", "),
                        if beyond.len() == 1 { "it" } else { "them" },
                        if beyond.len() == 1 {
                            "it is"
                        } else {
                            "they are"
                        },
                    ),
                ),
                SandboxMode::Own => push(
                    Level::Info,
                    sub,
                    format!(
                        "has {} that its parent {name} has not: it keeps them in its own sandbox (`sandbox: own`)",
                        beyond.join(", ")
                    ),
                ),
            }
        }
    }
    for (name, agent) in agents {
        if let Some(message) = trifecta(agent) {
            push(Level::Warning, name, message);
        }
    }
    for cycle in cycles(agents) {
        push(
            Level::Error,
            &cycle[0],
            format!(
                "subagents form a cycle: {}; a job could delegate to itself until the depth cap",
                cycle.join(" -> ")
            ),
        );
    }
}

/// An ask of `parent` on a tool its `sandbox: own` sub-agent keeps: under
/// that parent the child asks too (asks are inherited), but it asks about
/// nothing itself, so wherever it runs otherwise (as a step, or below
/// another parent) its calls of the tool run without a person.
fn unasked_own(name: &str, parent: &AgentDef, child: &AgentDef) -> Option<String> {
    use arbor_protocol::mcp::name_matches;
    if child.sandbox != SandboxMode::Own {
        return None;
    }
    let reaches = |ask: &str| {
        child.tools.iter().any(|t| name_matches(ask, t.as_str()))
            || child.mcp.iter().any(|p| {
                let p = p.to_string();
                name_matches(ask, &p) || name_matches(&p, ask)
            })
    };
    let asks = |a: &&arbor_protocol::ApproveEntry| a.mode == arbor_protocol::ApproveMode::Ask;
    let asked_by_child = |ask: &str| {
        child
            .approve
            .iter()
            .filter(asks)
            .any(|a| name_matches(&a.tool, ask))
    };
    let unasked: Vec<&str> = parent
        .approve
        .iter()
        .filter(asks)
        .map(|a| a.tool.as_str())
        .filter(|ask| reaches(ask) && !asked_by_child(ask))
        .collect();
    if unasked.is_empty() {
        return None;
    }
    Some(format!(
        "keeps its own tools (`sandbox: own`) and can reach {}, which its parent {name} asks a \
         person about: below {name} it asks too, but it does not ask itself, so as a step or \
         below another parent those calls run unapproved; add {} to its `approve`",
        unasked.join(", "),
        if unasked.len() == 1 { "it" } else { "them" }
    ))
}

/// Whether `agent` holds all three of: untrusted input, secrets and a way
/// out. Today the network is both the way in and the way out: an agent's
/// only way to send is its commands' network, and what they fetch is
/// untrusted; so an agent with secrets and `network: open` has all three.
fn trifecta(agent: &AgentDef) -> Option<String> {
    if agent.secrets.is_empty() || agent.network != Network::Open {
        return None;
    }
    Some(format!(
        "reads untrusted input (its commands fetch from the network), holds secrets ({}) and \
         can send outward (network: open): text it fetched can talk it into sending a secret \
         away. Break the triangle: move the secret to a `sandbox: own` sub-agent with network: \
         none that does the one thing the secret is for; or fetch in a sub-agent that holds no \
         secrets and run this agent with network: none; or drop the secret",
        agent.secrets.join(", ")
    ))
}

/// Each cycle of the `subagents` graph once, from its smallest name.
fn cycles(agents: &BTreeMap<String, AgentDef>) -> Vec<Vec<String>> {
    let mut found: BTreeSet<Vec<String>> = BTreeSet::new();
    for start in agents.keys() {
        // Depth-first from `start`, looking only for paths back to it
        // through names larger than it, so each cycle is found once.
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            let Some(agent) = agents.get(&at) else {
                continue;
            };
            for next in &agent.subagents {
                if next == start {
                    let mut cycle = path.clone();
                    cycle.push(start.clone());
                    found.insert(cycle);
                } else if next > start && !path.contains(next) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    found.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace(agents: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, front) in agents {
            let folder = dir.path().join("agents").join(name);
            std::fs::create_dir_all(&folder).unwrap();
            std::fs::write(
                folder.join("agent.md"),
                format!("---\n{front}\n---\nYou work.\n"),
            )
            .unwrap();
        }
        dir
    }

    fn said(findings: &[Finding]) -> Vec<(Level, String, String)> {
        findings
            .iter()
            .map(|f| (f.level, f.file.clone(), f.message.clone()))
            .collect()
    }

    #[test]
    fn each_problem_is_reported_in_one_pass() {
        let dir = workspace(&[
            (
                "boss",
                "tools: [exec]\nsubagents: [helper, ghost, mute, loner, hand, fetcher]",
            ),
            ("helper", "description: helps\ntools: [exec, write_file]"),
            (
                "fetcher",
                "description: fetches\ntools: [exec]\nnetwork: open\nsecrets: [KEY]",
            ),
            ("mute", "tools: [exec]"),
            (
                "loner",
                "description: alone\nsandbox: own\ntools: [read_file]\nsubagents: [helper]",
            ),
            ("hand", "description: a hand\ntools: [teleport]"),
            ("ping", "description: ping\nsubagents: [pong]"),
            ("pong", "description: pong\nsubagents: [ping]"),
        ]);
        let findings = check(dir.path());
        let all = said(&findings);
        let has = |level: Level, file: &str, words: &str| {
            assert!(
                all.iter()
                    .any(|(l, f, m)| *l == level && f == file && m.contains(words)),
                "{level:?} {file} {words:?} in {all:#?}"
            )
        };
        has(
            Level::Error,
            "agents/boss/agent.md",
            "subagent `ghost` is not an agent",
        );
        has(
            Level::Error,
            "agents/mute/agent.md",
            "`description` is required",
        );
        has(Level::Error, "agents/hand/agent.md", "teleport");
        has(Level::Error, "agents/loner/agent.md", "may not delegate");
        has(
            Level::Error,
            "agents/ping/agent.md",
            "cycle: ping -> pong -> ping",
        );
        has(Level::Warning, "agents/helper/agent.md", "write_file");
        has(
            Level::Warning,
            "agents/fetcher/agent.md",
            "network: open, secret KEY",
        );
        has(
            Level::Warning,
            "agents/fetcher/agent.md",
            "reads untrusted input (its commands fetch from the network), holds secrets (KEY)",
        );
        has(Level::Info, "agents/loner/agent.md", "read_file");
        assert_eq!(
            all.iter().filter(|(_, _, m)| m.contains("cycle")).count(),
            1,
            "a cycle is said once"
        );
        assert_eq!(findings[0].level, Level::Error, "errors first");
    }

    #[test]
    fn the_examples_are_clean() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        for example in ["research", "local-model", "approvals", "recovery"] {
            let findings = check(&examples.join(example));
            assert!(findings.is_empty(), "{example}: {findings:#?}");
        }
    }

    #[test]
    fn an_outward_step_is_named_with_why_and_what_a_crash_does_to_it() {
        let dir = workspace(&[
            ("lead", "subagents: [payer]"),
            (
                "payer",
                "description: pays\ntools: [exec]\nnetwork: open\nsandbox: own",
            ),
            ("reader", "description: reads"),
        ]);
        std::fs::create_dir_all(dir.path().join("flows")).unwrap();
        let flow = |rerun: &str| {
            format!(
                "[[group]]\nsteps = [{{ agent = \"lead\", instruction = \"go\"{rerun} }}, {{ agent = \"reader\", instruction = \"read\" }}]\n"
            )
        };
        std::fs::write(dir.path().join("flows/asks.toml"), flow("")).unwrap();
        let reruns = flow(", rerun_interrupted = true");
        std::fs::write(dir.path().join("flows/reruns.toml"), reruns).unwrap();
        let flows: Vec<_> = said(&check(dir.path()))
            .into_iter()
            .filter(|(_, file, _)| file.starts_with("flows/"))
            .collect();
        assert_eq!(
            flows,
            [
                (
                    Level::Info,
                    "flows/asks.toml".to_string(),
                    "step lead is outward (payer: its commands have the network (network: open)): \
                     interrupted by a crash, it waits for a person to continue it or stop the run"
                        .to_string()
                ),
                (
                    Level::Info,
                    "flows/reruns.toml".to_string(),
                    "step lead is outward (payer: its commands have the network (network: open)): \
                     interrupted by a crash, it is run again all the same (rerun_interrupted)"
                        .to_string()
                ),
            ]
        );
    }

    #[test]
    fn what_only_the_whole_load_sees_is_reported_too() {
        let dir = workspace(&[("solo", "description: one")]);
        std::fs::write(dir.path().join("arbor.toml"), "[limts]\n").unwrap();
        let findings = check(dir.path());
        assert_eq!(findings.len(), 1, "{findings:#?}");
        assert_eq!(findings[0].file, "arbor.toml");
        assert!(findings[0].message.contains("limts"), "{findings:#?}");
    }

    #[test]
    fn an_ask_an_own_sandbox_child_does_not_make_itself_is_warned_about() {
        let dir = workspace(&[
            (
                "boss",
                "tools: [write_file]\napprove: [exec, write_file]\nsubagents: [own, asks, shared]",
            ),
            ("own", "description: own\nsandbox: own\ntools: [exec]"),
            (
                "asks",
                "description: asks\nsandbox: own\ntools: [exec]\napprove: [exec]",
            ),
            ("shared", "description: shared\ntools: [write_file]"),
        ]);
        let all = said(&check(dir.path()));
        let about = |file: &str| {
            all.iter()
                .filter(|(l, f, m)| *l == Level::Warning && f == file && m.contains("unapproved"))
                .map(|(_, _, m)| m.clone())
                .collect::<Vec<_>>()
        };
        let own = about("agents/own/agent.md");
        assert_eq!(own.len(), 1, "{all:#?}");
        assert!(
            own[0].contains("exec") && own[0].contains("boss"),
            "{own:?}"
        );
        assert!(about("agents/asks/agent.md").is_empty(), "it asks itself");
        assert!(
            about("agents/shared/agent.md").is_empty(),
            "a shared child inherits"
        );
    }
}
