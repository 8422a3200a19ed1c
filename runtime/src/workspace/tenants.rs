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
    /// What its runs may take over time (I-65): none, no bound.
    pub quota: Option<Quota>,
    /// What a submission over its quota meets.
    pub on_quota: OnQuota,
    /// Its share of the admission queue against other tenants' (weighted
    /// round robin): at least 1; 1 when left out.
    pub weight: u32,
}

/// `[tenants.NAME.quota]`: sliding windows a tenant's runs are reserved
/// from at admission (I-65). Each left out is no bound; none is 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    pub tokens_per_hour: Option<u64>,
    pub usd_micros_per_day: Option<u64>,
    pub usd_micros_per_month: Option<u64>,
    pub runs_per_minute: Option<u64>,
    pub concurrent_runs: Option<u64>,
}

/// What a submission over its tenant's quota meets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnQuota {
    /// 429, with when to try again.
    #[default]
    Refuse,
    /// Queued until its windows have room; other tenants pass it.
    Queue,
}

/// `[tenants.NAME.quota]` as written: dollars as numbers.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaFile {
    tokens_per_hour: Option<u64>,
    usd_per_day: Option<f64>,
    usd_per_month: Option<f64>,
    runs_per_minute: Option<u64>,
    concurrent_runs: Option<u64>,
}

impl QuotaFile {
    fn check(self) -> Result<Quota, String> {
        let count = |key: &str, n: Option<u64>| match n {
            Some(0) => Err(format!(
                "quota.{key} = 0 would admit nothing (0 never means unlimited); leave it out for no bound"
            )),
            n => Ok(n),
        };
        let usd = |key: &str, usd: Option<f64>| {
            usd.map(|usd| arbor_protocol::tools::usd_to_micros(&format!("quota.{key}"), usd))
                .transpose()
        };
        let quota = Quota {
            tokens_per_hour: count("tokens_per_hour", self.tokens_per_hour)?,
            usd_micros_per_day: usd("usd_per_day", self.usd_per_day)?,
            usd_micros_per_month: usd("usd_per_month", self.usd_per_month)?,
            runs_per_minute: count("runs_per_minute", self.runs_per_minute)?,
            concurrent_runs: count("concurrent_runs", self.concurrent_runs)?,
        };
        if quota == Quota::default() {
            return Err(
                "quota: empty; name at least one of tokens_per_hour, usd_per_day, \
                        usd_per_month, runs_per_minute, concurrent_runs, or leave it out"
                    .into(),
            );
        }
        Ok(quota)
    }
}

/// `[tenants.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TenantFile {
    flows: Option<Vec<String>>,
    agents: Option<Vec<String>>,
    instructions: Option<String>,
    quota: Option<QuotaFile>,
    #[serde(default)]
    on_quota: OnQuota,
    weight: Option<u32>,
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
        let quota = self.quota.map(QuotaFile::check).transpose().map_err(at)?;
        if self.on_quota == OnQuota::Queue && quota.is_none() {
            return Err(at(
                "on_quota = \"queue\" without a [quota] has nothing to wait for".into(),
            ));
        }
        if self.weight == Some(0) {
            return Err(at(
                "weight = 0 would never start its runs; the least is 1 (the default)".into(),
            ));
        }
        Ok(Tenant {
            weight: self.weight.unwrap_or(1),
            flows: list("flows", self.flows)?,
            agents: list("agents", self.agents)?,
            instructions,
            quota,
            on_quota: self.on_quota,
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
