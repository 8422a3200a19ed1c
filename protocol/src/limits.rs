//! The caps of I-03 to I-12, with their defaults. `arbor.toml [limits]` overrides them.

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// I-03: how deep jobs may go below a step (a step is depth 0).
    pub depth: u32,
    /// I-04: children in one delegate call.
    pub fan_out: u32,
    /// I-04: children running at once under one parent.
    pub running_children: u32,
    /// I-05: spawns per run, retries included, never refunded.
    pub spawn_cap: u64,
    /// I-08: the share of its available budget one delegate call may grant.
    pub grant_fraction: f64,
    /// I-12: the share of a grant after which model requests carry a wind-down notice.
    pub wind_down: f64,
    /// The most output tokens one model call may ask for; the account may allow fewer.
    pub max_output_tokens: u64,
    /// `[limits.tools]`: the most calls a job may make, per tool and in all
    /// (`calls`), unless its agent says fewer. None by default.
    pub tools: crate::mcp::ToolLimits,
    /// I-48: how many times a run may be resumed after the node died under
    /// it; the next recovery parks it instead (failed, class `parked`), so
    /// one poison run cannot crash-loop the node.
    pub max_recoveries: u32,
    /// The same tool call (name and arguments) this many times in a row
    /// gets a notice in its result; twice as many ends the job with class
    /// `no_progress`. An agent's `max_repeats` overrides it.
    pub max_repeats: u32,
    /// The most messages one step of a `peers` group may send its siblings.
    pub max_peer_messages: u32,
    /// The share of a model's context window at which a job's model is
    /// told, once, that its context is filling (`context_pressure`).
    pub context_warn: f64,
    /// I-59: the wall-clock cap of a run whose flow (or submission) gives
    /// none. Never zero: there is no unlimited.
    #[serde(with = "crate::duration_str::serde_humantime")]
    pub run_timeout: Duration,
    /// I-59: the wall-clock cap of a step or delegated job whose agent (or
    /// delegate call) gives none.
    #[serde(with = "crate::duration_str::serde_humantime")]
    pub job_timeout: Duration,
    /// `[limits.concurrency]`: how many runs (or jobs, for an agent) run at
    /// once per key; the rest wait in the admission queue.
    pub concurrency: Concurrency,
}

/// `[limits.concurrency]`: running runs per tenant and per flow, running
/// jobs (steps and sub-agents) per agent. A key left out has no bound of
/// its own (the node's `max_running_runs` still holds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Concurrency {
    pub per_tenant: Option<u32>,
    pub per_flow: std::collections::BTreeMap<String, u32>,
    pub per_agent: std::collections::BTreeMap<String, u32>,
}

impl Concurrency {
    fn check(&self) -> Result<(), String> {
        if self.per_tenant == Some(0) {
            return Err("limits.concurrency.per_tenant = 0 would run nothing (0 never means unlimited); leave it out for no bound".into());
        }
        for (key, map) in [("per_flow", &self.per_flow), ("per_agent", &self.per_agent)] {
            if let Some((name, _)) = map.iter().find(|(_, n)| **n == 0) {
                return Err(format!(
                    "limits.concurrency.{key}.{name} = 0 would run nothing (0 never means unlimited); leave it out for no bound"
                ));
            }
        }
        Ok(())
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            depth: 2,
            fan_out: 16,
            running_children: 16,
            spawn_cap: 1000,
            grant_fraction: 0.5,
            wind_down: 0.8,
            max_output_tokens: 4096,
            tools: Default::default(),
            max_recoveries: 3,
            max_repeats: 3,
            max_peer_messages: 20,
            context_warn: 0.75,
            run_timeout: Duration::from_secs(4 * 3600),
            job_timeout: Duration::from_secs(3600),
            concurrency: Concurrency::default(),
        }
    }
}

impl Limits {
    /// Checks every limit is usable; a zero cap would silently forbid all work
    /// and a fraction outside (0, 1] would over- or never grant.
    pub fn validate(&self) -> Result<(), String> {
        let fraction_ok = |f: f64| f.is_finite() && f > 0.0 && f <= 1.0;
        if self.fan_out == 0 {
            return Err("limits.fan_out must be at least 1".into());
        }
        if self.running_children == 0 {
            return Err("limits.running_children must be at least 1".into());
        }
        if self.spawn_cap == 0 {
            return Err("limits.spawn_cap must be at least 1".into());
        }
        for (key, d) in [
            ("run_timeout", self.run_timeout),
            ("job_timeout", self.job_timeout),
        ] {
            if d.is_zero() {
                return Err(format!(
                    "limits.{key} must be more than 0 (there is no unlimited: raise it instead)"
                ));
            }
        }
        if !fraction_ok(self.grant_fraction) {
            return Err(format!(
                "limits.grant_fraction must be in (0, 1], got {}",
                self.grant_fraction
            ));
        }
        if !fraction_ok(self.wind_down) {
            return Err(format!(
                "limits.wind_down must be in (0, 1], got {}",
                self.wind_down
            ));
        }
        if self.max_recoveries == 0 {
            return Err(
                "limits.max_recoveries must be at least 1 (0 would park every interrupted run)"
                    .into(),
            );
        }
        if !fraction_ok(self.context_warn) {
            return Err(format!(
                "limits.context_warn must be in (0, 1], got {}",
                self.context_warn
            ));
        }
        if self.max_repeats == 0 {
            return Err("limits.max_repeats must be at least 1".into());
        }
        if self.max_output_tokens == 0 {
            return Err("limits.max_output_tokens must be at least 1".into());
        }
        self.concurrency.check()?;
        self.tools.check("limits.tools.")
    }
}
