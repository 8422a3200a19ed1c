//! Privilege down the chain (I-25, I-26): what tools an agent is offered, and
//! how a child's privileges are cut from its parent's.
//!
//! Invariant: `narrow` never returns a policy that allows a tool its input
//! policy denied, whatever the child's definition or the job's arguments say.

use arbor_protocol::{AgentDef, Limits, NodeKind, SandboxMode, ToolName};
use std::collections::{BTreeMap, BTreeSet};

/// The tools an agent may use: an allowlist of sandbox tools and a deny list
/// of any tool names (sandbox or delegation tools alike).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub allowed: BTreeSet<ToolName>,
    pub denied: BTreeSet<String>,
}

impl Policy {
    /// A step's policy: its agent's own tools and denies.
    pub fn root(agent: &AgentDef) -> Self {
        Self {
            allowed: agent.tools.iter().copied().collect(),
            denied: agent.deny.iter().cloned().collect(),
        }
    }

    /// The policy of a child running `child` for this policy's holder, with the
    /// job's own `deny`. Denies are unioned; allowlists intersected, except for
    /// a `sandbox: own` agent, which keeps its own declared tools (I-26) but
    /// still inherits every deny.
    pub fn narrow(&self, child: &AgentDef, job_deny: &[String]) -> Self {
        let declared: BTreeSet<ToolName> = child.tools.iter().copied().collect();
        let allowed = match child.sandbox {
            SandboxMode::Own => declared,
            SandboxMode::Shared => declared.intersection(&self.allowed).copied().collect(),
        };
        let mut denied = self.denied.clone();
        denied.extend(child.deny.iter().cloned());
        denied.extend(job_deny.iter().cloned());
        Self { allowed, denied }
    }

    /// Every tool, offered (`Ok`) or not with the reason. `submit_output` is
    /// always offered: an agent must always be able to answer.
    pub fn offered(
        &self,
        agent: &AgentDef,
        kind: NodeKind,
        depth: u32,
        limits: &Limits,
    ) -> BTreeMap<ToolName, Result<(), String>> {
        let mut out = BTreeMap::new();
        for tool in ToolName::ALL {
            let verdict = if tool == ToolName::SubmitOutput {
                Ok(())
            } else if self.denied.contains(tool.as_str()) {
                Err(format!("{tool} is denied to this agent"))
            } else if ToolName::DELEGATION.contains(&tool) {
                if agent.subagents.is_empty() {
                    Err(format!("{} has no subagents", agent.name))
                } else if kind == NodeKind::Job && agent.sandbox == SandboxMode::Own {
                    Err("a sub-agent with its own sandbox cannot delegate further".into())
                } else if depth >= limits.depth {
                    Err(format!(
                        "the depth cap {} is reached at depth {depth}",
                        limits.depth
                    ))
                } else {
                    Ok(())
                }
            } else if self.allowed.contains(&tool) {
                Ok(())
            } else {
                Err(format!("{tool} is not among this agent's tools"))
            };
            out.insert(tool, verdict);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::{ModelRef, Network};

    fn agent(tools: &[ToolName], deny: &[&str], sandbox: SandboxMode) -> AgentDef {
        AgentDef {
            name: "a".into(),
            description: Some("d".into()),
            model: ModelRef::Scripted,
            tools: tools.to_vec(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            subagents: vec!["b".into()],
            sandbox,
            network: Network::None,
            secrets: vec![],
            budget_tokens: None,
            budget_usd_micros: None,
            max_turns: None,
            timeout: None,
            script: vec![],
            prompt: String::new(),
        }
    }

    #[test]
    fn inv_25_a_child_can_narrow_but_never_widen() {
        use ToolName::*;
        let parent = Policy::root(&agent(&[ReadFile], &["exec"], SandboxMode::Shared));
        // The child names exec and write_file; neither is the parent's to give.
        let child = parent.narrow(
            &agent(
                &[Exec, ReadFile, WriteFile],
                &["collect"],
                SandboxMode::Shared,
            ),
            &["read_file".to_string()],
        );
        assert_eq!(child.allowed, BTreeSet::from([ReadFile]));
        assert!(child.denied.contains("exec"));
        assert!(child.denied.contains("collect"));
        assert!(child.denied.contains("read_file"));
        let offered = child.offered(
            &agent(&[Exec], &[], SandboxMode::Shared),
            NodeKind::Job,
            1,
            &Limits::default(),
        );
        assert!(offered[&Exec].is_err());
        assert!(offered[&ReadFile].is_err(), "denied by the job's own deny");
        assert!(offered[&WriteFile].is_err());
        assert!(offered[&SubmitOutput].is_ok());
    }

    #[test]
    fn own_sandbox_keeps_its_tools_but_inherits_denies_and_cannot_delegate() {
        use ToolName::*;
        let parent = Policy::root(&agent(&[], &["write_file"], SandboxMode::Shared));
        let own = agent(&[Exec, WriteFile], &[], SandboxMode::Own);
        let child = parent.narrow(&own, &[]);
        let offered = child.offered(&own, NodeKind::Job, 1, &Limits::default());
        assert!(offered[&Exec].is_ok());
        assert!(offered[&WriteFile].is_err());
        assert!(offered[&Delegate].is_err());
    }

    #[test]
    fn inv_03_no_delegation_at_the_depth_cap() {
        let a = agent(&[], &[], SandboxMode::Shared);
        let p = Policy::root(&a);
        let limits = Limits::default();
        assert!(p.offered(&a, NodeKind::Job, 1, &limits)[&ToolName::Delegate].is_ok());
        assert!(p.offered(&a, NodeKind::Job, 2, &limits)[&ToolName::Delegate].is_err());
    }
}
