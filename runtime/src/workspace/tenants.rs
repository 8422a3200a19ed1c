//! `[tenants.NAME]` in arbor.toml (I-63): the teams that share one node.
//! Each may run the flows and agents it lists (every one, when it lists
//! none), and its `instructions` go into every prompt of its runs. Without
//! `[tenants]` there is one tenant, `default`, and every run is its.

use arbor_protocol::tenant::check_tenant_name;
use serde::Deserialize;
use std::collections::BTreeSet;

/// One tenant, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tenant {
    /// The flows its runs may be of; none: every flow.
    pub flows: Option<BTreeSet<String>>,
    /// The agents its runs may reach (steps, rescuers and every sub-agent
    /// below them); none: every agent.
    pub agents: Option<BTreeSet<String>>,
    /// Said to every agent of its runs, after the agent's own prompt.
    pub instructions: Option<String>,
}

/// `[tenants.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TenantFile {
    flows: Option<Vec<String>>,
    agents: Option<Vec<String>>,
    instructions: Option<String>,
}

impl TenantFile {
    /// Checked on its own; the names it lists are checked against the
    /// workspace once its flows and agents are read (`Tenant::check_names`).
    pub(super) fn check(self, name: &str) -> Result<Tenant, String> {
        let at = |m: String| format!("tenants.{name}: {m}");
        check_tenant_name(name).map_err(at)?;
        let list = |key: &str, names: Option<Vec<String>>| match names {
            Some(names) if names.is_empty() => Err(at(format!(
                "{key} = [] would let it run nothing; leave {key} out to allow every one"
            ))),
            names => Ok(names.map(|n| n.into_iter().collect::<BTreeSet<_>>())),
        };
        let instructions = match self.instructions {
            Some(text) if text.trim().is_empty() => {
                return Err(at("instructions: empty; leave it out to add none".into()));
            }
            text => text,
        };
        Ok(Tenant {
            flows: list("flows", self.flows)?,
            agents: list("agents", self.agents)?,
            instructions,
        })
    }
}

impl Tenant {
    /// Every flow and agent it names is the workspace's.
    pub(super) fn check_names(
        &self,
        name: &str,
        flows: &BTreeSet<&str>,
        agents: &BTreeSet<&str>,
    ) -> Result<(), String> {
        let lists = [
            ("flows", &self.flows, flows),
            ("agents", &self.agents, agents),
        ];
        for (key, listed, known) in lists {
            if let Some(missing) = listed
                .iter()
                .flatten()
                .find(|n| !known.contains(n.as_str()))
            {
                return Err(format!(
                    "tenants.{name}.{key}: `{missing}` is not one of the workspace's {key}"
                ));
            }
        }
        Ok(())
    }

    /// Why a run of `flow` reaching `agents` is not this tenant's to start.
    pub fn refuses(&self, name: &str, flow: &str, agents: &[&str]) -> Option<String> {
        if let Some(flows) = &self.flows
            && !flow.starts_with("agent:")
            && !flows.contains(flow)
        {
            return Some(format!(
                "tenant {name} may not run flow {flow}: [tenants.{name}] flows lists {}",
                flows.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        let allowed = self.agents.as_ref()?;
        let missing = agents.iter().find(|a| !allowed.contains(**a))?;
        Some(format!(
            "tenant {name} may not run agent {missing} ({flow} reaches it): [tenants.{name}] \
             agents lists {}",
            allowed.iter().cloned().collect::<Vec<_>>().join(", ")
        ))
    }
}
