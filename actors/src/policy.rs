//! Privilege down the chain (I-25, I-26): what tools an agent is offered, and
//! how a child's privileges are cut from its parent's.
//!
//! Invariant: `narrow` never returns a policy that allows a tool its input
//! policy denied, whatever the child's definition or the job's arguments say;
//! and, below a shared sandbox, never a network or a secret its input lacked.

use arbor_protocol::mcp::name_matches;
use arbor_protocol::{
    AgentDef, Limits, McpPattern, Network, NodeKind, Offer, SandboxMode, ToolLimits, ToolName,
};
use std::collections::{BTreeMap, BTreeSet};

/// How `approve:` gates a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gating {
    /// It waits for a person; `timeout`: its own wait, else the node's.
    Ask {
        timeout: Option<std::time::Duration>,
    },
    /// It runs at once; a card decided `ran` records it.
    Notify { undo: Option<String> },
}

/// The tools an agent may use: an allowlist of sandbox tools, MCP tool
/// patterns, and a deny list of names and patterns (any tool alike).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub allowed: BTreeSet<ToolName>,
    /// The MCP tools it may use: `mcp__SERVER__TOOL` or all of a server's.
    pub mcp: BTreeSet<McpPattern>,
    /// Tool names, or prefixes ending in `*` (`mcp__fs__*`).
    pub denied: BTreeSet<String>,
    /// Tools whose calls wait for a person (I-46), names or patterns as
    /// `denied`. A tool both asked and denied is denied: down a chain a tool
    /// moves allow -> ask -> deny, never back.
    pub ask: BTreeSet<String>,
    /// An ask entry's own wait, by its pattern (the shortest, where two
    /// entries name the same pattern).
    pub waits: BTreeMap<String, std::time::Duration>,
    /// Tools whose calls run at once and are recorded on a card decided
    /// `ran` (I-60), by pattern, with the entry's undo hint. A tool both
    /// asked and notified is asked: a child cannot loosen an ask.
    pub notify: BTreeMap<String, Option<String>>,
    /// Whether its commands may reach the network (I-28).
    pub network: Network,
    /// The secrets its sandbox holds, by name (I-27).
    pub secrets: BTreeSet<String>,
    /// The most calls one job attempt may make (I-45); never above any
    /// ancestor's.
    pub limits: ToolLimits,
    /// The skills it may read: its agent's, cut to every ancestor's
    /// (I-25), own sandbox or not.
    pub skills: BTreeSet<String>,
    /// `hooks.before_call` commands asked before each tool call, the
    /// topmost ancestor's first: a child adds its own, never drops one (I-62).
    pub hooks: Vec<String>,
}

impl Policy {
    /// A step's policy: its agent's own tools, denies and asks (with the
    /// node's `[approvals] tools`), its limits within the node's
    /// `[limits.tools]`.
    pub fn root(agent: &AgentDef, limits: &Limits, node_ask: &[String]) -> Self {
        let mut policy = Self {
            allowed: agent.tools.iter().copied().collect(),
            mcp: agent.mcp.iter().cloned().collect(),
            denied: agent.deny.iter().cloned().collect(),
            ask: node_ask.iter().cloned().collect(),
            waits: BTreeMap::new(),
            notify: BTreeMap::new(),
            network: agent.network,
            secrets: agent.secrets.iter().cloned().collect(),
            limits: agent.limits.tighter(&limits.tools),
            skills: agent.skills.iter().cloned().collect(),
            hooks: agent.hooks.before_call.iter().cloned().collect(),
        };
        policy.add_approvals(&agent.approve);
        policy
    }

    /// Adds `approve:` entries: asks (with their waits) and notifies.
    fn add_approvals(&mut self, entries: &[arbor_protocol::ApproveEntry]) {
        use arbor_protocol::ApproveMode;
        for entry in entries {
            match entry.mode {
                ApproveMode::Ask => {
                    self.ask.insert(entry.tool.clone());
                    if let Some(wait) = entry.timeout {
                        let kept = self.waits.entry(entry.tool.clone()).or_insert(wait);
                        *kept = (*kept).min(wait);
                    }
                }
                ApproveMode::Notify => {
                    self.notify
                        .entry(entry.tool.clone())
                        .or_insert_with(|| entry.undo.clone());
                }
            }
        }
    }

    /// How a call of the tool of this (canonical) name is gated by
    /// `approve:`, if it is: an ask (with the shortest wait an entry
    /// that covers it sets) wins over a notify.
    pub fn gating(&self, tool: &str) -> Option<Gating> {
        if self.asks(tool) {
            let timeout = self
                .waits
                .iter()
                .filter(|(p, _)| name_matches(p, tool))
                .map(|(_, wait)| *wait)
                .min();
            return Some(Gating::Ask { timeout });
        }
        self.notify
            .iter()
            .find(|(p, _)| name_matches(p, tool))
            .map(|(_, undo)| Gating::Notify { undo: undo.clone() })
    }

    /// The policy of a child running `child` for this policy's holder, with the
    /// job's own `deny`. Denies are unioned; allowlists intersected, except for
    /// a `sandbox: own` agent, which keeps its own declared tools (I-26) but
    /// still inherits every deny. Network and secrets follow the tools: a
    /// shared sandbox gets what both it and its parent have, an own sandbox
    /// what it declares. Limits are the tighter of the child's and the
    /// parent's, own sandbox or not.
    pub fn narrow(&self, child: &AgentDef, job_deny: &[String]) -> Self {
        let declared: BTreeSet<ToolName> = child.tools.iter().copied().collect();
        let secrets: BTreeSet<String> = child.secrets.iter().cloned().collect();
        let (allowed, mcp, network, secrets) = match child.sandbox {
            SandboxMode::Own => (
                declared,
                child.mcp.iter().cloned().collect(),
                child.network,
                secrets,
            ),
            SandboxMode::Shared => (
                declared.intersection(&self.allowed).copied().collect(),
                child
                    .mcp
                    .iter()
                    .flat_map(|c| self.mcp.iter().filter_map(|p| c.intersect(p)))
                    .collect(),
                if self.network == Network::Open && child.network == Network::Open {
                    Network::Open
                } else {
                    Network::None
                },
                secrets.intersection(&self.secrets).cloned().collect(),
            ),
        };
        let mut denied = self.denied.clone();
        denied.extend(child.deny.iter().cloned());
        denied.extend(job_deny.iter().cloned());
        // Asks union like denies, own sandbox or not: what a parent gates
        // stays gated below it.
        // Hooks too: what a parent asks of its calls it asks below it.
        let mut hooks = self.hooks.clone();
        hooks.extend(child.hooks.before_call.iter().cloned());
        let mut narrowed = Self {
            allowed,
            mcp,
            denied,
            ask: self.ask.clone(),
            waits: self.waits.clone(),
            notify: self.notify.clone(),
            network,
            secrets,
            limits: self.limits.tighter(&child.limits),
            skills: child
                .skills
                .iter()
                .filter(|s| self.skills.contains(*s))
                .cloned()
                .collect(),
            hooks,
        };
        narrowed.add_approvals(&child.approve);
        narrowed
    }

    /// Whether a deny covers the tool of this (canonical) name.
    pub fn is_denied(&self, tool: &str) -> bool {
        self.denied.iter().any(|d| name_matches(d, tool))
    }

    /// Whether a call of the tool of this (canonical) name waits for a
    /// person first. Asked only of a tool that may be used at all: a denied
    /// one is refused before it could be asked about.
    pub fn asks(&self, tool: &str) -> bool {
        self.ask.iter().any(|a| name_matches(a, tool))
    }

    /// Whether it may use the server's tool of this canonical name (without
    /// the `mcp__SERVER__` prefix), or why not.
    pub fn mcp_verdict(&self, server: &str, tool: &str, canonical: &str) -> Result<(), String> {
        if self.is_denied(canonical) {
            Err("it is denied to this agent".into())
        } else if self.mcp.iter().any(|p| p.covers(server, tool)) {
            Ok(())
        } else {
            Err("it is not among this agent's tools".into())
        }
    }

    /// Whether any MCP tool may be offered at all (a job then needs a sandbox).
    pub fn may_use_mcp(&self) -> bool {
        !self.mcp.is_empty()
    }

    /// The skills a job of `agent` under this policy may read, in the
    /// order its agent lists them.
    pub fn readable_skills<'a>(&self, agent: &'a AgentDef) -> Vec<&'a str> {
        agent
            .skills
            .iter()
            .filter(|s| self.skills.contains(*s))
            .map(String::as_str)
            .collect()
    }

    /// Whether it may run commands: `exec`, not denied.
    pub fn runs_commands(&self) -> bool {
        (self.allowed.contains(&ToolName::Exec) && !self.is_denied(ToolName::Exec.as_str()))
            || !self.hooks.is_empty()
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
        for &tool in ToolName::ALL {
            let offer = tool.info().offer;
            let verdict = if offer == Offer::Always {
                Ok(())
            } else if self.is_denied(tool.as_str()) {
                Err("it is denied to this agent".into())
            } else if offer == Offer::Delegation {
                if agent.subagents.is_empty() {
                    Err("this agent has no sub-agents".into())
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
            } else if offer == Offer::Peers {
                // Offered by its job when it is a step of a `peers` group.
                Err("it is offered only to the steps of a flow group with peers = true".into())
            } else if offer == Offer::Skills {
                if self.skills.is_empty() {
                    Err("this agent has no skills it may read".into())
                } else {
                    Ok(())
                }
            } else if self.allowed.contains(&tool) {
                Ok(())
            } else {
                Err("it is not among this agent's tools".into())
            };
            out.insert(tool, verdict);
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arbor_protocol::ModelRef;

    pub(crate) fn agent(tools: &[ToolName], deny: &[&str], sandbox: SandboxMode) -> AgentDef {
        AgentDef {
            name: "a".into(),
            description: Some("d".into()),
            model: ModelRef::Scripted,
            tools: tools.to_vec(),
            mcp: vec![],
            limits: Default::default(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            approve: vec![],
            hooks: Default::default(),
            subagents: vec!["b".into()],
            sandbox,
            network: Network::None,
            secrets: vec![],
            budget_tokens: None,
            budget_usd_micros: None,
            per_run: None,
            max_turns: None,
            max_repeats: None,
            skills: vec![],
            settings: Default::default(),
            models: vec![],
            fallback: vec![],
            timeout: None,
            script: Default::default(),
            prompt: String::new(),
            resources: Default::default(),
        }
    }

    #[test]
    fn inv_25_a_child_can_narrow_but_never_widen() {
        use ToolName::*;
        let parent = Policy::root(
            &agent(&[ReadFile], &["exec"], SandboxMode::Shared),
            &Limits::default(),
            &[],
        );
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
    fn inv_46_a_deny_below_an_ask_is_never_widened_back() {
        use ToolName::*;
        let mut asking = agent(&[Exec, WriteFile], &[], SandboxMode::Shared);
        asking.approve = vec!["exec".into()];
        let parent = Policy::root(&asking, &Limits::default(), &["mcp__pay__*".into()]);
        assert!(parent.asks("exec") && parent.asks("mcp__pay__send"));
        assert!(!parent.asks("write_file"));
        // The child denies what its parent asked about; its own child, with
        // a sandbox of its own, names it again and asks nothing.
        let child = parent.narrow(&agent(&[Exec], &["exec"], SandboxMode::Shared), &[]);
        let own = agent(&[Exec, WriteFile], &[], SandboxMode::Own);
        let grandchild = child.narrow(&own, &[]);
        assert!(grandchild.is_denied("exec"));
        let offered = grandchild.offered(&own, NodeKind::Job, 2, &Limits::default());
        assert!(offered[&Exec].is_err(), "a deny below an ask came back");
        // What was asked about above is still asked about below an own sandbox.
        assert!(grandchild.asks("mcp__pay__send"));
        assert!(offered[&WriteFile].is_ok() && !grandchild.asks("write_file"));
    }

    #[test]
    fn own_sandbox_keeps_its_tools_but_inherits_denies_and_cannot_delegate() {
        use ToolName::*;
        let parent = Policy::root(
            &agent(&[], &["write_file"], SandboxMode::Shared),
            &Limits::default(),
            &[],
        );
        let own = agent(&[Exec, WriteFile], &[], SandboxMode::Own);
        let child = parent.narrow(&own, &[]);
        let offered = child.offered(&own, NodeKind::Job, 1, &Limits::default());
        assert!(offered[&Exec].is_ok());
        assert!(offered[&WriteFile].is_err());
        assert!(offered[&Delegate].is_err());
    }

    mod chains {
        use super::*;
        use proptest::prelude::*;

        /// One link of a delegation chain: the child's definition and the
        /// job's own `deny`.
        #[derive(Clone, Debug)]
        struct Link {
            tools: Vec<ToolName>,
            /// MCP tools it names: `mcp__SERVER__TOOL` and `mcp__SERVER__*`.
            mcp: Vec<String>,
            deny: Vec<String>,
            own: bool,
            job_deny: Vec<String>,
            network: bool,
            secrets: Vec<String>,
            approve: Vec<String>,
        }

        /// The MCP tools a chain may meet: two servers of two tools each.
        const MCP_TOOLS: [&str; 4] = [
            "mcp__fs__read",
            "mcp__fs__write",
            "mcp__gh__read",
            "mcp__gh__write",
        ];

        /// Names and patterns a `tools:` may hold for MCP.
        fn mcp_names() -> impl Strategy<Value = Vec<String>> {
            let mut all: Vec<String> = MCP_TOOLS.iter().map(|t| t.to_string()).collect();
            all.extend(["mcp__fs__*".to_string(), "mcp__gh__*".to_string()]);
            proptest::sample::subsequence(all, 0..=3)
        }

        /// Names and patterns a deny may hold: built-in tools, MCP tools,
        /// a server's pattern, every MCP tool.
        fn tool_names() -> impl Strategy<Value = Vec<String>> {
            let mut all: Vec<String> = ToolName::ALL
                .iter()
                .map(|t| t.as_str().to_string())
                .collect();
            all.extend(MCP_TOOLS.iter().map(|t| t.to_string()));
            all.extend(["mcp__fs__*".to_string(), "mcp__*".to_string()]);
            proptest::sample::subsequence(all, 0..=4)
        }

        fn sandbox_tools() -> impl Strategy<Value = Vec<ToolName>> {
            proptest::sample::subsequence(ToolName::nameable().collect::<Vec<_>>(), 0..=3)
        }

        fn link() -> impl Strategy<Value = Link> {
            (
                sandbox_tools(),
                mcp_names(),
                tool_names(),
                proptest::bool::weighted(0.2),
                tool_names(),
                proptest::bool::ANY,
                proptest::sample::subsequence(
                    vec!["A".to_string(), "B".into(), "C".into(), "D".into()],
                    0..=4,
                ),
                tool_names(),
            )
                .prop_map(
                    |(tools, mcp, deny, own, job_deny, network, secrets, approve)| Link {
                        tools,
                        mcp,
                        deny,
                        own,
                        job_deny,
                        network,
                        secrets,
                        approve,
                    },
                )
        }

        fn def(link: &Link) -> AgentDef {
            let deny: Vec<&str> = link.deny.iter().map(String::as_str).collect();
            let mode = if link.own {
                SandboxMode::Own
            } else {
                SandboxMode::Shared
            };
            AgentDef {
                network: if link.network {
                    Network::Open
                } else {
                    Network::None
                },
                secrets: link.secrets.clone(),
                approve: link.approve.iter().map(|t| t.as_str().into()).collect(),
                hooks: Default::default(),
                mcp: link
                    .mcp
                    .iter()
                    .map(|m| McpPattern::parse(m).unwrap().unwrap())
                    .collect(),
                ..agent(&link.tools, &deny, mode)
            }
        }

        /// What a holder of `policy` may use, by name: built-in and MCP tools.
        fn usable(policy: &Policy) -> BTreeSet<String> {
            let builtin = policy
                .allowed
                .iter()
                .map(|t| t.as_str().to_string())
                .filter(|t| !policy.is_denied(t));
            let mcp = MCP_TOOLS.iter().filter_map(|name| {
                let p = McpPattern::parse(name).unwrap().unwrap();
                let tool = p.tool.as_deref().unwrap();
                policy
                    .mcp_verdict(&p.server, tool, name)
                    .is_ok()
                    .then(|| name.to_string())
            });
            builtin.chain(mcp).collect()
        }

        proptest! {
            /// I-25 over random chains: from a root, each link narrows by a
            /// child definition and the job's own deny. Every descendant's
            /// denies include every ancestor's; no descendant may use a tool an
            /// ancestor denied, `sandbox: own` or not; and below a shared link
            /// a descendant may use only what each ancestor above it (up to
            /// the nearest `sandbox: own`) may, reach the network only if each
            /// of them may, and hold only secrets each of them holds. `offered`
            /// never offers a denied tool. I-46: a tool an ancestor asks about
            /// is asked about below, `sandbox: own` or not (allow -> ask ->
            /// deny, never back), and a deny below an ask wins.
            #[test]
            fn inv_25_no_chain_widens_a_descendant(root in link(), links in proptest::collection::vec(link(), 1..6)) {
                let mut chain = vec![Policy::root(&def(&root), &Limits::default(), &[])];
                for l in &links {
                    let next = chain.last().unwrap().narrow(&def(l), &l.job_deny);
                    // The override and the definition's own denies both hold.
                    for d in l.job_deny.iter().chain(&l.deny) {
                        prop_assert!(next.denied.contains(d), "{d} dropped");
                    }
                    chain.push(next);
                }
                for (n, policy) in chain.iter().enumerate() {
                    for (a, ancestor) in chain[..n].iter().enumerate() {
                        prop_assert!(ancestor.denied.is_subset(&policy.denied));
                        prop_assert!(ancestor.ask.is_subset(&policy.ask));
                        for name in usable(policy) {
                            prop_assert!(!ancestor.is_denied(&name), "{name} usable below a deny");
                            if ancestor.asks(&name) {
                                prop_assert!(policy.asks(&name), "{name} asked above, not below");
                            }
                        }
                        // links[k] made chain[k + 1]: an own link between a and n resets the allowlist.
                        let own_between = links[a..n].iter().any(|l| l.own);
                        if !own_between {
                            prop_assert!(
                                usable(policy).is_subset(&usable(ancestor)),
                                "{:?} widens {:?}", policy, ancestor
                            );
                            prop_assert!(policy.secrets.is_subset(&ancestor.secrets));
                            prop_assert!(
                                policy.network == Network::None || ancestor.network == Network::Open,
                                "network opened below {:?}", ancestor
                            );
                        }
                    }
                    let holder = if n == 0 { def(&root) } else { def(&links[n - 1]) };
                    let kind = if n == 0 { NodeKind::Step } else { NodeKind::Job };
                    for (tool, verdict) in policy.offered(&holder, kind, n as u32, &Limits::default()) {
                        if tool != ToolName::SubmitOutput && policy.denied.contains(tool.as_str()) {
                            prop_assert!(verdict.is_err(), "{tool} offered though denied");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn inv_03_no_delegation_at_the_depth_cap() {
        let a = agent(&[], &[], SandboxMode::Shared);
        let p = Policy::root(&a, &Limits::default(), &[]);
        let limits = Limits::default();
        assert!(p.offered(&a, NodeKind::Job, 1, &limits)[&ToolName::Delegate].is_ok());
        assert!(p.offered(&a, NodeKind::Job, 2, &limits)[&ToolName::Delegate].is_err());
    }
}
