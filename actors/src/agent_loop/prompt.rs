//! What a job's model is shown besides its history, made once per job: the
//! system prompt (the agent's own, then its tenant's shared instructions
//! (I-63), then a generated roster of the
//! sub-agents it may delegate to, then the skills it may read) and its
//! tools (the built-in ones offered to it, `delegate`'s `agent` narrowed to
//! the roster's names, then its MCP tools).
//!
//! Invariants:
//! 1. I-54: the roster names exactly the sub-agents `delegate` accepts (the
//!    agent's `subagents`, when delegation is offered), each with its
//!    description, whether it works in a sandbox of its own and the models
//!    a job of it may be put on (I-55); nothing else of a sub-agent is shown. `delegate`'s `agent` is an enum of the
//!    same names.
//! 2. The same agent, offer and MCP tools give the same prompt, byte for
//!    byte: a parent planning its child's first call (`first_call`) plans
//!    what the child's loop will send, and a replay compares it (I-49).

use crate::model::ToolSpec;
use arbor_protocol::{AgentDef, SandboxMode, Skill, ToolName};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;

/// The heading of a tenant's shared instructions, after the agent's own
/// prompt and before the roster.
pub const TENANT_HEADING: &str = "## Your team's instructions";

/// The heading of the generated roster, after the agent's own prompt.
pub const ROSTER_HEADING: &str = "## Sub-agents you may delegate to";

/// The heading of the skills a job may read, after the roster.
pub const SKILLS_HEADING: &str = "## Skills you may read";

/// A job's system prompt and tools, as every request of it carries them.
#[derive(Clone, Debug)]
pub struct Prompt {
    pub system: Arc<str>,
    pub tools: Arc<[ToolSpec]>,
}

/// One sub-agent as its parent's model is told of it.
#[derive(Clone, Debug, PartialEq)]
pub struct RosterEntry {
    pub name: String,
    pub description: String,
    pub own_sandbox: bool,
    /// The models a job of it may be put on, its default first, when it
    /// allows more than one (I-55).
    pub models: Vec<String>,
}

impl Prompt {
    /// `agent`'s prompt for a job offered `offered`, its sub-agents looked
    /// up in `agents`, the `skills` it may read (`skills::listed`), with
    /// `mcp` (its MCP tools, listed before its first turn; none when a
    /// parent plans the first call) and its run's tenant's `shared`
    /// instructions.
    pub fn for_job(
        agent: &AgentDef,
        offered: &BTreeMap<ToolName, Result<(), String>>,
        agents: &BTreeMap<String, Arc<AgentDef>>,
        skills: &[Arc<Skill>],
        mcp: &[ToolSpec],
        shared: Option<&str>,
    ) -> Prompt {
        let delegates = offered.get(&ToolName::Delegate).is_some_and(Result::is_ok);
        let roster = if delegates {
            roster(agent, agents)
        } else {
            vec![]
        };
        let tools = offered
            .iter()
            .filter(|(_, offer)| offer.is_ok())
            .map(|(&tool, _)| match tool {
                ToolName::Delegate => delegate_spec(&roster),
                tool => ToolSpec::builtin(tool),
            })
            .chain(mcp.iter().cloned())
            .collect();
        let skills = match offered.get(&ToolName::ReadSkill) {
            Some(Ok(())) => skills,
            _ => &[],
        };
        Prompt {
            system: system_prompt(&agent.prompt, shared, &roster, skills).into(),
            tools,
        }
    }
}

/// The heading of a `peers` step's list of siblings.
pub const PEERS_HEADING: &str = "## Peers you may message";

impl Prompt {
    /// A step of a `peers` group is told its siblings (label, agent,
    /// description) after the rest of its prompt, and how to reach them.
    pub fn with_peers(mut self, peers: &[(String, String, String)]) -> Prompt {
        if peers.is_empty() {
            return self;
        }
        let mut text = format!(
            "{}\n\n{PEERS_HEADING}\n\nThese steps run beside you. Send one a message with \
             `send_peer` (its label as `to`) when it needs something you found; it reads it at \
             its next turn, and messages from them reach you the same way.\n\n",
            self.system
        );
        for (label, agent, description) in peers {
            text.push_str(&format!("- `{label}` ({agent}): {description}\n"));
        }
        self.system = text.into();
        self
    }
}

/// The sub-agents `agent` may delegate to, in its `subagents` order.
pub fn roster(agent: &AgentDef, agents: &BTreeMap<String, Arc<AgentDef>>) -> Vec<RosterEntry> {
    agent
        .subagents
        .iter()
        .map(|name| {
            let sub = agents.get(name);
            RosterEntry {
                name: name.clone(),
                // A loaded workspace gives every sub-agent a description
                // (workspace invariant 2); a hand-built spec may not.
                description: sub.and_then(|s| s.description.clone()).unwrap_or_default(),
                own_sandbox: sub.is_some_and(|s| s.sandbox == SandboxMode::Own),
                models: sub.map(|s| choosable_models(s)).unwrap_or_default(),
            }
        })
        .collect()
}

/// The models a parent may name for a job of `sub`, its default first;
/// none when it runs on one model only.
fn choosable_models(sub: &AgentDef) -> Vec<String> {
    let allowed = sub.allowed_models();
    if allowed.len() < 2 {
        return vec![];
    }
    std::iter::once(&sub.model)
        .chain(allowed.iter().filter(|m| **m != sub.model))
        .map(ToString::to_string)
        .collect()
}

/// The agent's own prompt, then the roster and the skills when it has them.
fn system_prompt(
    own: &str,
    shared: Option<&str>,
    roster: &[RosterEntry],
    skills: &[Arc<Skill>],
) -> String {
    if shared.is_none() && roster.is_empty() && skills.is_empty() {
        return own.to_string();
    }
    let mut text = own.trim_end().to_string();
    if let Some(shared) = shared {
        let _ = write!(text, "\n\n{TENANT_HEADING}\n\n{}\n", shared.trim());
    }
    if !roster.is_empty() {
        write_roster(&mut text, roster);
    }
    if !skills.is_empty() {
        let _ = write!(
            text,
            "\n\n{SKILLS_HEADING}\n\nBefore you do work one of these covers, read it with the `read_skill` tool (its `name`); a skill may name files of its own, read with `file`.\n"
        );
        for skill in skills {
            let _ = write!(
                text,
                "\n- `{}`: {}",
                skill.name,
                one_line(&skill.description)
            );
        }
        text.push('\n');
    }
    text
}

/// A description on one line, as a list item needs it.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn write_roster(text: &mut String, roster: &[RosterEntry]) {
    let _ = write!(
        text,
        "\n\n{ROSTER_HEADING}\n\nHand work to one of these with the `delegate` tool, naming it as a job's `agent`; give each job a request it can do alone, since it sees nothing of your conversation.\n"
    );
    for entry in roster {
        let _ = write!(text, "\n- `{}`: {}", entry.name, entry.description.trim());
        if entry.own_sandbox {
            text.push_str(
                " (Works in a sandbox of its own: it does not see your files, nor you its.)",
            );
        }
        if let Some((default, others)) = entry.models.split_first() {
            let others: Vec<String> = others.iter().map(|m| format!("`{m}`")).collect();
            let _ = write!(
                text,
                " (Runs on `{default}` unless a job names another `model`: {}.)",
                others.join(", ")
            );
        }
    }
    text.push('\n');
}

/// `delegate` with its jobs' `agent` an enum of the roster's names.
fn delegate_spec(roster: &[RosterEntry]) -> ToolSpec {
    let mut spec = ToolSpec::builtin(ToolName::Delegate);
    let mut parameters = (*spec.parameters).clone();
    let agent = parameters
        .pointer_mut("/properties/jobs/items/properties/agent")
        .and_then(serde_json::Value::as_object_mut);
    debug_assert!(agent.is_some(), "delegate's schema has jobs[].agent");
    if let Some(agent) = agent {
        let names = roster.iter().map(|e| e.name.clone()).collect::<Vec<_>>();
        agent.insert("enum".into(), names.into());
    }
    spec.parameters = Arc::new(parameters);
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, own_sandbox: bool) -> RosterEntry {
        RosterEntry {
            name: name.into(),
            description: format!("does {name} things"),
            own_sandbox,
            models: vec![],
        }
    }

    #[test]
    fn the_roster_follows_the_agents_own_prompt_and_names_each_sub_agent_once() {
        let text = system_prompt(
            "You plan.\n",
            None,
            &[entry("a", false), entry("b", true)],
            &[],
        );
        assert!(text.starts_with("You plan.\n\n## Sub-agents"), "{text}");
        assert!(text.contains("\n- `a`: does a things\n"), "{text}");
        assert!(
            text.contains("- `b`: does b things (Works in a sandbox of its own"),
            "{text}"
        );
        assert_eq!(system_prompt("You plan.\n", None, &[], &[]), "You plan.\n");
        let mut choosy = entry("c", false);
        choosy.models = vec!["p/small".into(), "p/large".into()];
        let text = system_prompt("You plan.", None, &[choosy], &[]);
        assert!(
            text.contains("- `c`: does c things (Runs on `p/small` unless a job names another `model`: `p/large`.)"),
            "{text}"
        );
    }

    #[test]
    fn a_tenants_instructions_come_after_the_agents_own_and_before_the_roster() {
        let text = system_prompt(
            "You plan.\n",
            Some("Cite sources.\n"),
            &[entry("a", false)],
            &[],
        );
        let own = text.find("You plan.").unwrap();
        let shared = text.find("Cite sources.").unwrap();
        let roster = text.find(ROSTER_HEADING).unwrap();
        assert!(own < shared && shared < roster, "{text}");
        assert!(
            text.contains(&format!("{TENANT_HEADING}\n\nCite sources.\n")),
            "{text}"
        );
        let alone = system_prompt("You plan.", Some("Cite sources."), &[], &[]);
        assert_eq!(
            alone,
            format!("You plan.\n\n{TENANT_HEADING}\n\nCite sources.\n")
        );
    }

    #[test]
    fn delegate_s_agent_is_an_enum_of_the_roster() {
        let spec = delegate_spec(&[entry("a", false), entry("b", false)]);
        let agent = spec
            .parameters
            .pointer("/properties/jobs/items/properties/agent")
            .unwrap();
        assert_eq!(agent["enum"], serde_json::json!(["a", "b"]));
        assert_eq!(agent["type"], "string");
    }
}
