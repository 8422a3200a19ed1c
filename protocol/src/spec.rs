//! What a run is asked to do: a flow of groups of steps, with a budget and a timeout.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A run: a flow plus its budget, all resolved (defaults applied).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RunSpec {
    /// The flow's name, or `agent:NAME` for a single-agent run.
    pub flow: String,
    pub groups: Vec<FlowGroup>,
    /// The run's root grant in tokens (I-09: never 0, never "unlimited" by accident).
    pub budget_tokens: u64,
    /// Its ceiling in micro-dollars, if it has one: every account below then
    /// has a usd grant too, and every call reserves its worst-case cost.
    #[serde(default)]
    pub budget_usd_micros: Option<u64>,
    pub timeout: Option<Duration>,
    /// Journal each model exchange and tool result, so the run can be
    /// replayed (`crate::tape`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub record: bool,
    /// This run replays a recording instead of asking its models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<crate::tape::ReplaySpec>,
    /// A recorded run's definitions, each file's SHA-256 by its path in the
    /// workspace (`arbor.toml`, `agents/NAME/agent.md`, `flows/NAME.toml`,
    /// `skills/NAME/SKILL.md`):
    /// what a replay and a rerun check they run with.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub digests: std::collections::BTreeMap<String, String>,
    /// The tenant whose run it is (I-63); none: `default`, the one tenant
    /// there is while arbor.toml names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its tenant's shared `instructions` as they were at its admission:
    /// in every prompt of the run, after the agent's own, before its roster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// A reviewer agent that reads the run's request and result after its
    /// last group (`verify`): what it finds missing sends that group round
    /// once more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<String>,
    /// `on_ceiling = "pause"`: at its ceiling the run pauses for a top-up
    /// (I-58) instead of ending, for at most this long; none: it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<Duration>,
    /// Its place among its tenant's queued runs: 1 starts first, 5 last;
    /// none: 3 (`RunSpec::PRIORITY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// What a flow's run was given (its `input`), as checked against the
    /// flow's schema; its step instructions have it filled in already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// The schedule tick that started it, if a schedule did (I-66).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleTick>,
    /// The workspace version it was admitted with (arbor.toml, agents and
    /// flows, as the journal keeps them): what it runs with to its end,
    /// through recovery, continue, failover, retries and replay (I-67).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// A schedule's tick: the schedule's name and the tick's time (RFC 3339,
/// UTC), the identity the tick's one run is committed under (I-66).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ScheduleTick {
    pub name: String,
    pub tick: String,
}

impl RunSpec {
    /// How long a budget pause waits for a top-up unless told otherwise.
    pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

    /// A submission's priority when it names none (1 first, 5 last).
    pub const PRIORITY: u8 = 3;

    /// The label of a run's reviewer job (`verify`), beside its steps'.
    pub const REVIEW_LABEL: &str = "review";

    /// What the run was asked, step by step: what its reviewer reads.
    pub fn request(&self) -> String {
        self.step_labels()
            .iter()
            .flatten()
            .zip(self.groups.iter().flat_map(|g| g.steps.iter()))
            .map(|(label, step)| format!("- {label}: {}", step.instruction))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The tenant whose run it is.
    pub fn tenant(&self) -> &str {
        self.tenant.as_deref().unwrap_or(crate::DEFAULT_TENANT)
    }

    /// The agents of its steps and every sub-agent below them, each once,
    /// in the order found: every agent a run of it can reach. `agent` looks
    /// a name up; a name it does not know is passed over.
    pub fn reachable_agents<'a>(
        &self,
        agent: impl Fn(&str) -> Option<&'a crate::AgentDef>,
    ) -> Vec<&'a crate::AgentDef> {
        let mut seen = std::collections::BTreeSet::new();
        let mut queue: Vec<&str> = self
            .groups
            .iter()
            .flat_map(|g| g.steps.iter())
            .flat_map(|s| {
                std::iter::once(s.agent.as_str())
                    .chain(s.on_fail.as_deref())
                    .chain(s.until.as_ref().and_then(|u| u.judge.as_deref()))
            })
            .chain(self.verify.as_deref())
            .collect();
        let mut found = vec![];
        while let Some(name) = queue.pop() {
            if !seen.insert(name.to_string()) {
                continue;
            }
            if let Some(def) = agent(name) {
                queue.extend(def.subagents.iter().map(String::as_str));
                found.push(def);
            }
        }
        found
    }

    /// Every step's label, group by group: the step's `label`, else its agent's
    /// name, made unique across the whole run with `-2`, `-3`... Labels name
    /// workdirs and let a resumed run find its steps again, so this is the
    /// one place they are made.
    pub fn step_labels(&self) -> Vec<Vec<String>> {
        let mut taken: Vec<String> = vec![];
        self.groups
            .iter()
            .map(|group| {
                group
                    .steps
                    .iter()
                    .map(|step| {
                        let base = step.label.clone().unwrap_or_else(|| step.agent.clone());
                        let mut label = base.clone();
                        let mut n = 2;
                        while taken.contains(&label) {
                            label = format!("{base}-{n}");
                            n += 1;
                        }
                        taken.push(label.clone());
                        label
                    })
                    .collect()
            })
            .collect()
    }

    /// The step labelled `label` (`step_labels`).
    pub fn step(&self, label: &str) -> Option<&StepSpec> {
        let labels = self.step_labels();
        self.groups
            .iter()
            .zip(&labels)
            .flat_map(|(g, l)| g.steps.iter().zip(l))
            .find(|(_, l)| *l == label)
            .map(|(s, _)| s)
    }

    /// A run of one agent on one input.
    pub fn single(agent: &str, input: &str, budget_tokens: u64) -> Self {
        Self {
            flow: format!("agent:{agent}"),
            groups: vec![FlowGroup {
                peers: false,
                steps: vec![StepSpec {
                    agent: agent.to_string(),
                    instruction: input.to_string(),
                    label: None,
                    retries: None,
                    optional: false,
                    retry: None,
                    rerun_interrupted: None,
                    on_fail: None,
                    approve: false,
                    until: None,
                }],
            }],
            budget_tokens,
            budget_usd_micros: None,
            timeout: None,
            record: false,
            replay: None,
            digests: Default::default(),
            tenant: None,
            instructions: None,
            verify: None,
            pause: None,
            priority: None,
            input: None,
            schedule: None,
            version: None,
        }
    }
}

/// A flow file as written (`flows/NAME.toml`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    /// What a run of it is given: `"text"`, or a JSON Schema (a TOML table)
    /// the input must meet. Step instructions use it as `{{ input }}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<FlowInput>,
    pub budget: Option<crate::BudgetArg>,
    pub timeout: Option<String>,
    /// Every step's `rerun_interrupted` unless the step says otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rerun_interrupted: bool,
    #[serde(default, rename = "group")]
    pub groups: Vec<FlowGroup>,
    /// A reviewer agent: after the last group it reads the run's request
    /// and result and answers `{accept, missing}`; what is missing sends
    /// the last group round once more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<String>,
    /// At the run's ceiling: `end` (the default) ends the run, `pause` waits
    /// for a top-up (`POST /v1/runs/{id}/budget`) until `pause_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_ceiling: Option<OnCeiling>,
    /// How long a pause waits for a top-up (humantime); 24 h if not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_timeout: Option<String>,
    /// `[[schedule]]`: times at which arbord starts a run of the flow.
    #[serde(default, rename = "schedule", skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<ScheduleSpec>,
}

/// A flow's `[[schedule]]` entry as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// Unique in the workspace: the schedule's name in the API and the CLI.
    pub name: String,
    /// Five fields (minute hour day-of-month month day-of-week), or six
    /// with seconds first.
    pub cron: String,
    /// The IANA time zone the cron's wall-clock times are read in; UTC if
    /// not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// The input each run is given (the flow's `input` checks it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// What a tick does while the schedule's last run still runs; `skip`
    /// if not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<Overlap>,
    /// How late a tick may still start, after a time no node ran
    /// (humantime); `60s` if not said. Later ones are recorded as missed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catchup_window: Option<String>,
    /// Up to this long after its tick, the same for every node, a run
    /// starts (humantime): spreads schedules that share a minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<String>,
    /// Starts nothing until unpaused (the API's pause and unpause win
    /// over this once used).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Each run's budget; the flow's if not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::BudgetArg>,
    /// The tenant its runs are charged to; `default` if not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// What a schedule's tick does while an earlier run of it has not ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Starts nothing: the tick is recorded as skipped.
    Skip,
    /// Starts once the earlier run ends; a further tick meanwhile is skipped.
    BufferOne,
    /// Starts once every earlier run has ended, in order.
    BufferAll,
    /// Stops the earlier runs, then starts.
    CancelOther,
    /// Starts at once, beside them.
    AllowAll,
}

/// A flow's `input`: `"text"`, or a JSON Schema its input must meet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum FlowInput {
    Text(String),
    Schema(serde_json::Map<String, serde_json::Value>),
}

/// What a run does at its ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnCeiling {
    /// It ends, failed `budget_exhausted` (I-13).
    End,
    /// The step at it waits for a top-up, holding nothing (I-58).
    Pause,
}

impl OnCeiling {
    /// The run's `pause`: how long it may wait, or none when it ends.
    pub fn pause(
        on_ceiling: Option<OnCeiling>,
        pause_timeout: Option<Duration>,
    ) -> Result<Option<Duration>, String> {
        match (on_ceiling, pause_timeout) {
            (Some(OnCeiling::Pause), timeout) => {
                Ok(Some(timeout.unwrap_or(RunSpec::PAUSE_TIMEOUT)))
            }
            (_, Some(_)) => Err("pause_timeout is for on_ceiling = \"pause\"".into()),
            _ => Ok(None),
        }
    }
}

impl FlowSpec {
    /// The flow file's JSON Schema, its TOML read as JSON
    /// (docs/contract/flow.schema.json).
    pub fn schema() -> serde_json::Value {
        let mut schema = serde_json::to_value(schemars::schema_for!(FlowSpec)).unwrap_or_default();
        if let Some(object) = schema.as_object_mut() {
            object.insert("$id".into(), "arbor/flow".into());
        }
        schema
    }
}

/// Groups run in order; the steps of a group run in parallel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FlowGroup {
    pub steps: Vec<StepSpec>,
    /// Each step is told its siblings and may message them (`send_peer`),
    /// delivered at the recipient's next turn.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peers: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub agent: String,
    pub instruction: String,
    pub label: Option<String>,
    /// How many new attempts the step may get when a restart interrupted it
    /// (I-34). Default 1; 0 makes an interruption fail the run.
    pub retries: Option<u32>,
    /// Its failure or stop does not fail the run: the run completes
    /// `partial`, the step named in its limitations.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
    /// How a failed attempt is tried again; none: a failure is the step's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<crate::RetryPolicy>,
    /// Re-run it after a restart interrupted it even if it may have acted
    /// outside its workdir (I-57); none: its flow's `rerun_interrupted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerun_interrupted: Option<bool>,
    /// An agent that takes over once it has failed (after its retries):
    /// its answer stands in for the step's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_fail: Option<String>,
    /// It does not start until a person approves its card (kind `step`);
    /// a rejection, or no decision by the deadline, ends it failed (I-60).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approve: bool,
    /// It runs again until a check passes, within bounds (docs/flows.md#loops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Until>,
}

/// A step's loop: after each iteration that ends done, a check decides; on
/// `revise` the step runs again, told its previous output and the issues.
/// Exactly one of `command`, `pattern` and `judge`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Until {
    /// Run in the step's sandbox and workdir once an iteration ends: exit 0 passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// A regular expression: passes when it matches the iteration's output
    /// (a string as it is, anything else as JSON text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// An agent whose job answers `{verdict: pass | revise, issues: [...]}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge: Option<String>,
    /// Iterations in all, the first included (1 to 100; default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u32>,
    /// Tokens every iteration and judge of the loop may spend together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Dollars every iteration and judge may spend together (the run needs a usd ceiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_usd: Option<f64>,
    /// Wall-clock time from the first iteration's start (humantime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_time: Option<String>,
}

/// What a run's reviewer (`verify`) answers, through its output schema.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReviewVerdict {
    pub accept: bool,
    #[serde(default)]
    pub missing: Vec<String>,
}

impl ReviewVerdict {
    /// The output schema a reviewer's job answers through.
    pub fn schema() -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "required": ["accept", "missing"],
            "additionalProperties": false,
            "properties": {
                "accept": {"type": "boolean"},
                "missing": {"type": "array", "items": {"type": "string"}},
            },
        })
    }
}

/// What a judge's job answers, through its output schema.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeVerdict {
    pub verdict: VerdictKind,
    #[serde(default)]
    pub issues: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VerdictKind {
    Pass,
    Revise,
}

impl JudgeVerdict {
    /// The output schema a judge's job answers through.
    pub fn schema() -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "required": ["verdict", "issues"],
            "additionalProperties": false,
            "properties": {
                "verdict": {"enum": ["pass", "revise"]},
                "issues": {"type": "array", "items": {"type": "string"}},
            },
        })
    }
}

impl Until {
    pub const DEFAULT_MAX_ITERATIONS: u32 = 5;
    pub const MOST_ITERATIONS: u32 = 100;

    pub fn max_iterations(&self) -> u32 {
        self.max_iterations.unwrap_or(Self::DEFAULT_MAX_ITERATIONS)
    }

    /// Its wall-clock bound, if it has one (checked at load).
    pub fn max_time(&self) -> Option<Duration> {
        self.max_time
            .as_deref()
            .and_then(|t| humantime::parse_duration(t).ok())
    }

    /// Its dollar bound in micro-dollars, if it has one (checked at load).
    pub fn max_usd_micros(&self) -> Option<u64> {
        crate::BudgetArg {
            tokens: None,
            usd: self.max_usd,
        }
        .usd_micros()
        .ok()
        .flatten()
    }

    /// Why a loop that ended at `iteration` without passing failed its
    /// step: `ended` (the bound, or why the check could not be made), and
    /// what its last check found.
    pub fn failure(
        iteration: u32,
        ended: &str,
        verdict: Option<VerdictKind>,
        issues: &[String],
    ) -> String {
        let last = match verdict {
            Some(verdict) => {
                let verdict = serde_json::to_value(verdict).unwrap_or_default();
                format!("; the last verdict: {verdict} ({})", issues.join("; "))
            }
            None if !issues.is_empty() => format!("; the last check found: {}", issues.join("; ")),
            None => String::new(),
        };
        format!("its check did not pass in {iteration} iterations: {ended}{last}")
    }

    /// Every way it is wrong, in words, or Ok: exactly one check, bounds
    /// that are bounds (0 never means unlimited).
    pub fn check(&self) -> Result<(), String> {
        let kinds = [
            self.command.is_some(),
            self.pattern.is_some(),
            self.judge.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err("until needs exactly one of command, pattern and judge".into());
        }
        if self.command.as_deref().is_some_and(|c| c.trim().is_empty()) {
            return Err("until.command is empty".into());
        }
        let most = self.max_iterations();
        if most == 0 || most > Self::MOST_ITERATIONS {
            return Err(format!(
                "until.max_iterations must be 1 to {}, got {most}",
                Self::MOST_ITERATIONS
            ));
        }
        if self.max_tokens == Some(0) {
            return Err("until.max_tokens must be at least 1 (0 never means unlimited)".into());
        }
        if self.max_usd.is_some() {
            crate::BudgetArg {
                tokens: None,
                usd: self.max_usd,
            }
            .usd_micros()
            .map_err(|e| e.replace("budget.usd", "until.max_usd"))?;
        }
        if let Some(time) = &self.max_time {
            match humantime::parse_duration(time) {
                Ok(d) if !d.is_zero() => {}
                Ok(_) => return Err("until.max_time must be more than 0s".into()),
                Err(e) => return Err(format!("until.max_time {time:?} is not a duration: {e}")),
            }
        }
        Ok(())
    }
}

impl StepSpec {
    pub const DEFAULT_RETRIES: u32 = 1;

    /// What a run's limitations say of an optional step that ended `status`
    /// (not done) for `reason`.
    pub fn optional_limitation(label: &str, status: crate::Status, reason: &str) -> String {
        format!("optional step {label} {status}: {reason}")
    }

    pub fn retries(&self) -> u32 {
        self.retries.unwrap_or(Self::DEFAULT_RETRIES)
    }

    /// The label of the jobs that judge the loop of the step `label`
    /// (`until.judge`): run-level jobs, a node each beside the step's.
    pub fn judge_label(label: &str) -> String {
        format!("{label}.judge")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(agent: &str, label: Option<&str>) -> StepSpec {
        StepSpec {
            agent: agent.into(),
            instruction: "x".into(),
            label: label.map(String::from),
            retries: None,
            optional: false,
            retry: None,
            rerun_interrupted: None,
            on_fail: None,
            approve: false,
            until: None,
        }
    }

    #[test]
    fn step_labels_are_unique_across_the_whole_run() {
        let spec = RunSpec {
            flow: "f".into(),
            groups: vec![
                FlowGroup {
                    peers: false,
                    steps: vec![step("a", None), step("a", None), step("b", Some("x"))],
                },
                FlowGroup {
                    peers: false,
                    steps: vec![step("a", None), step("c", Some("x"))],
                },
            ],
            budget_tokens: 1,
            budget_usd_micros: None,
            timeout: None,
            record: false,
            replay: None,
            digests: Default::default(),
            tenant: None,
            instructions: None,
            verify: None,
            pause: None,
            priority: None,
            input: None,
            schedule: None,
            version: None,
        };
        assert_eq!(
            spec.step_labels(),
            vec![vec!["a", "a-2", "x"], vec!["a-3", "x-2"]]
        );
    }
}
