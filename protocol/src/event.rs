//! Events: every state change of a run emits one (I-39). They are journaled,
//! streamed to watchers, and folded into a `Tree` by whoever wants the picture.

use crate::{ErrorClass, JobId, Refusal, RunId, Status};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Event {
    /// Node-wide order of emission.
    pub seq: u64,
    pub run: RunId,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub kind: EventKind,
}

/// Who an account or a child belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ParentRef {
    Run(RunId),
    Job(JobId),
}

/// What a `ModelCalled` event says of the call beyond its tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default)]
pub struct CallFacts {
    /// The provider's name in arbor.toml, or `scripted`.
    pub provider: String,
    /// The model as the provider calls it.
    pub model: String,
    /// The charge in micro-dollars (0 for an unpriced model).
    pub usd_micros: u64,
    pub latency_ms: u64,
    /// Attempts of this call before this one (they failed transiently).
    pub retries: u32,
    /// `ok`, `stopped`, or the error class of a failed attempt.
    pub outcome: String,
    /// The provider reported no usage: the call was charged its reservation.
    pub usage_estimated: bool,
}

/// An MCP server of a job's sandbox: started at the job's first call of
/// one of its tools, started again at the next call after it ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpServerState {
    Running,
    /// It exited or broke the protocol by itself.
    Died,
    /// arbor killed it: it did not answer after a call timed out, failed
    /// to start, or its job was stopped during a call.
    Killed,
    /// It ended with its job, as every server of a job does.
    Stopped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    Run,
    Step,
    Job,
}

impl NodeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeKind::Run => "run",
            NodeKind::Step => "step",
            NodeKind::Job => "job",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    RunStarted {
        flow: String,
        budget_tokens: u64,
        #[serde(default)]
        budget_usd_micros: Option<u64>,
        /// The whole spec, so a restart can resume the run (I-34).
        spec: Box<crate::RunSpec>,
    },
    /// A restart found the run interrupted and resumed it at `group`.
    RunResumed {
        epoch: u64,
        group: u32,
    },
    /// What recovery did to this run when the node restarted (I-30, I-31).
    Recovered {
        epoch: u64,
        jobs_failed: u32,
        processes_killed: u32,
        grants_released: u32,
    },
    RunFinished {
        status: Status,
        error_class: Option<ErrorClass>,
        reason: Option<String>,
        output: serde_json::Value,
        /// What a done run left undone: its optional steps that did not
        /// complete (it is then `partial`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        limitations: Vec<String>,
    },
    /// A step or job was admitted: its grant is held and its record is durable.
    JobSpawned {
        id: JobId,
        parent: ParentRef,
        kind: NodeKind,
        agent: String,
        label: Option<String>,
        depth: u32,
        attempt: u32,
        grant_tokens: u64,
        #[serde(default)]
        grant_usd_micros: Option<u64>,
        workdir: String,
        /// The journal seq of its admission record (job record and delegation),
        /// committed before it started (I-29).
        record_seq: u64,
        /// What it was asked, so that an interrupted job can be continued (I-33).
        #[serde(default)]
        request: String,
        /// The model's id of the delegate call that made it (a retry keeps
        /// its first attempt's); none for a step. A trace hangs the job
        /// under that call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call: Option<String>,
        /// The model it runs on, as `provider/model` (or `scripted`).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        model: String,
    },
    JobRunning {
        id: JobId,
    },
    /// A step or job ended: its result whole (flattened: its fields are the
    /// event's), and how it came to end. Made by `EventKind::job_finished`,
    /// so `id` (which every job's event carries) is the result's `job`.
    #[serde(deserialize_with = "job_finished_flat")]
    JobFinished {
        id: JobId,
        /// Why it failed or was stopped, in words.
        reason: Option<String>,
        /// A stop that came from above (the parent ended or was stopped).
        propagated: bool,
        #[serde(flatten)]
        result: Box<crate::ResultEnvelope>,
    },
    /// An account's figures after a change; `available = grant - spent - held`.
    AccountChanged {
        owner: ParentRef,
        grant: u64,
        spent: u64,
        held: u64,
        /// The same figures in micro-dollars, for an account with a usd grant.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usd: Option<crate::AccountView>,
    },
    /// I-12: spend crossed the wind-down share of the grant; emitted once.
    WindDown {
        owner: ParentRef,
        spent: u64,
        grant: u64,
    },
    /// One request to a model (every attempt of a retried call is one),
    /// with what it was charged: `input_tokens + output_tokens` is the charge.
    ModelCalled {
        id: JobId,
        turn: u32,
        reserved: u64,
        input_tokens: u64,
        output_tokens: u64,
        truncated: bool,
        wind_down: bool,
        /// Who answered, at what cost, how (a flat part of the event's JSON).
        #[serde(flatten)]
        call: CallFacts,
    },
    /// The history was compacted to fit the model's context window.
    ContextCompacted {
        id: JobId,
        turn: u32,
        /// Tool results replaced by a line that says how long they were.
        tool_results_elided: u32,
        /// Messages replaced by a summary the model wrote (0: none).
        messages_summarized: u32,
        /// The prompt's estimate in tokens, before and after.
        estimate_before: u64,
        estimate_after: u64,
    },
    /// A request reached `[limits] context_warn` of its model's window: the
    /// model was told, once a job.
    ContextPressure {
        id: JobId,
        turn: u32,
        /// The prompt's estimate in tokens, and the model's window.
        estimate: u64,
        window: u64,
    },
    /// The provider reported more than the call had reserved; it was charged
    /// what it reported (I-11 is then breached by `reported - reserved`).
    BudgetOverrun {
        id: JobId,
        turn: u32,
        reserved: u64,
        reported: u64,
    },
    /// A call that must be on record before it runs (an MCP call, or one
    /// a limit counts) is durable: a restart reads the counts back from these.
    ToolStarted {
        id: JobId,
        turn: u32,
        /// The canonical name (`exec`, `mcp__fs__read_file`).
        tool: String,
        /// The model's id for the call.
        call: String,
    },
    ToolCalled {
        id: JobId,
        turn: u32,
        tool: String,
        /// The model's id for the call.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        call: String,
        ok: bool,
        detail: String,
        /// How long the call took, from its checks to its result.
        #[serde(default)]
        latency_ms: u64,
        /// How many times in a row this same call (name and arguments) was
        /// made, this one included (`max_repeats`).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        repeat: u32,
        /// The call's digest (tool and arguments), so that a restart goes on
        /// counting its repeats.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        digest: String,
    },
    /// One of a job's MCP servers changed state.
    McpServer {
        id: JobId,
        server: String,
        state: McpServerState,
        /// How many times it was started again after it died or was killed.
        restarts: u32,
        /// Why it ended, when it did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    Refused {
        id: JobId,
        tool: String,
        refusal: Refusal,
    },
    /// I-20: a message for a job was queued; delivered or discarded later.
    SteerQueued {
        id: JobId,
        message_id: u64,
    },
    SteerDelivered {
        id: JobId,
        message_id: u64,
        turn: u32,
    },
    SteerDiscarded {
        id: JobId,
        message_id: u64,
    },
    /// Step `from` of a `peers` group sent step `to` (job `id`) a message:
    /// journaled and queued, read at `to`'s next turn.
    PeerQueued {
        id: JobId,
        from: String,
        to: String,
        message_id: u64,
    },
    /// Job `id` read peer `from`'s message in turn `turn`.
    PeerDelivered {
        id: JobId,
        from: String,
        message_id: u64,
        turn: u32,
    },
    /// I-46: a gated call's card is durable and waits for a person; the
    /// job spends nothing meanwhile and its wall timeout is paused.
    ApprovalRequested {
        id: JobId,
        card: crate::CardId,
        tool: String,
        deadline_ms: u64,
    },
    /// The card has passed `[approvals] warn_at` of its wait.
    ApprovalExpiring {
        id: JobId,
        card: crate::CardId,
        deadline_ms: u64,
    },
    /// The card's one outcome, durable before anyone acts on it.
    ApprovalDecided {
        id: JobId,
        card: crate::CardId,
        state: crate::CardState,
        by: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// From the card's asking to this outcome.
        waited_ms: u64,
    },
    /// The failed step or job `id` is tried again under its retry policy:
    /// attempt `attempt` of `label` starts at `until_ms`. Durable before
    /// the wait begins, so a restart resumes the wait where it was (I-56).
    RetryWaiting {
        id: JobId,
        label: String,
        attempt: u32,
        class: ErrorClass,
        until_ms: u64,
    },
    /// Job `id`'s call of `turn` failed on `from` (`provider/model`) in a
    /// way that walls its supply (`class`), so it goes to `to`, the next of
    /// its agent's `fallback` on another supply (I-55); its next
    /// `model_called` names the model that answered.
    ModelFallback {
        id: JobId,
        turn: u32,
        from: String,
        to: String,
        class: ErrorClass,
    },
    /// Iteration `iteration` of step `label`'s loop (`until`), its attempt
    /// `id`, was checked: passed, or not with its `issues` (a judge's, or
    /// what a command printed), a judge's `verdict`. `ended`: the loop ends
    /// here without passing, and why (a bound reached, a check that could
    /// not be made); else a check that did not pass runs the step again.
    /// Durable before the step's next iteration or end (I-56).
    IterationChecked {
        id: JobId,
        label: String,
        iteration: u32,
        passed: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        verdict: Option<crate::spec::VerdictKind>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        issues: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ended: Option<String>,
    },
    /// The run's reviewer (`verify`), its job `id`, read the run's request
    /// and result: accepted it, or found `missing` what the last group is
    /// sent round once more to do; `failed`: the review could not be made,
    /// and why (the result stands, not reviewed). Durable before the last
    /// group runs again or the run ends.
    Reviewed {
        id: JobId,
        accept: bool,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        missing: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<String>,
    },
    /// A restart interrupted step `id`, which may have acted outside its
    /// workdir (`why`): it is not run again until a person continues it or
    /// stops the run (I-57). Journaled once per interrupted attempt.
    NeedsDecision {
        id: JobId,
        label: String,
        why: String,
    },
    /// The run reached its ceiling and pauses (`on_ceiling = "pause"`,
    /// I-58): step `id` (none: the run, to start its next steps) waits for
    /// a top-up of at least `needs` (what its next call or its steps asked
    /// for beyond what is left), until `deadline_ms`, when it ends as it
    /// would have without the pause. Durable before the run shows it; one
    /// per waiter, each with the pause's one deadline.
    BudgetReached {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<JobId>,
        needs: crate::Amount,
        deadline_ms: u64,
    },
    /// The run's budget pause is over: a top-up let every waiter go on, or
    /// its deadline passed (`expired`) and they ended as without it.
    BudgetPauseEnded {
        expired: bool,
    },
}

impl EventKind {
    /// A step's or job's end, named by its result.
    pub fn job_finished(
        result: crate::ResultEnvelope,
        reason: Option<String>,
        propagated: bool,
    ) -> Self {
        EventKind::JobFinished {
            id: result.job,
            reason,
            propagated,
            result: Box::new(result),
        }
    }

    /// The step or job an event is about, if any.
    pub fn job(&self) -> Option<JobId> {
        use EventKind::*;
        match self {
            JobSpawned { id, .. }
            | JobRunning { id }
            | JobFinished { id, .. }
            | ModelCalled { id, .. }
            | BudgetOverrun { id, .. }
            | ContextCompacted { id, .. }
            | ContextPressure { id, .. }
            | ToolStarted { id, .. }
            | ToolCalled { id, .. }
            | McpServer { id, .. }
            | Refused { id, .. }
            | SteerQueued { id, .. }
            | SteerDelivered { id, .. }
            | SteerDiscarded { id, .. }
            | PeerQueued { id, .. }
            | PeerDelivered { id, .. }
            | ApprovalRequested { id, .. }
            | ApprovalExpiring { id, .. }
            | ApprovalDecided { id, .. }
            | RetryWaiting { id, .. }
            | ModelFallback { id, .. }
            | NeedsDecision { id, .. }
            | IterationChecked { id, .. }
            | Reviewed { id, .. } => Some(*id),
            AccountChanged { owner, .. } | WindDown { owner, .. } => match owner {
                ParentRef::Job(id) => Some(*id),
                ParentRef::Run(_) => None,
            },
            BudgetReached { id, .. } => *id,
            RunStarted { .. }
            | RunFinished { .. }
            | RunResumed { .. }
            | Recovered { .. }
            | BudgetPauseEnded { .. } => None,
        }
    }
}

/// `JobFinished`'s fields in order: id, reason, propagated, result.
type JobFinishedFields = (JobId, Option<String>, bool, Box<crate::ResultEnvelope>);

/// `JobFinished` read back without serde's `flatten`, which matches each of
/// the envelope's fields against every key of the event in turn and made a
/// journal's events half as slow again to decode (a boot's `verify` decodes
/// all of them). The fields are the envelope's, in its order, and the two
/// of the event; a test holds the two ways equal. An `id` that is not the
/// result's `job` is refused: the event would name two jobs.
fn job_finished_flat<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<JobFinishedFields, D::Error> {
    #[derive(Deserialize)]
    struct Flat {
        id: JobId,
        reason: Option<String>,
        propagated: bool,
        job: JobId,
        label: Option<String>,
        attempt: u32,
        agent: String,
        status: Status,
        task_status: Option<crate::TaskStatus>,
        output: serde_json::Value,
        error: Option<String>,
        error_class: Option<ErrorClass>,
        limitations: Vec<String>,
        artifacts: Vec<String>,
        tokens_spent: u64,
        usd_micros_spent: u64,
        turns: u32,
        workdir: String,
    }
    let f = Flat::deserialize(d)?;
    if f.id != f.job {
        return Err(serde::de::Error::custom(format!(
            "a job_finished event names job {} as its id and {} as its result's job",
            f.id, f.job
        )));
    }
    let result = crate::ResultEnvelope {
        job: f.job,
        label: f.label,
        attempt: f.attempt,
        agent: f.agent,
        status: f.status,
        task_status: f.task_status,
        output: f.output,
        error: f.error,
        error_class: f.error_class,
        limitations: f.limitations,
        artifacts: f.artifacts,
        tokens_spent: f.tokens_spent,
        usd_micros_spent: f.usd_micros_spent,
        turns: f.turns,
        workdir: f.workdir,
    };
    Ok((f.id, f.reason, f.propagated, Box::new(result)))
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ResultEnvelope, TaskStatus};

    /// Written with the envelope flattened, read back field by field: the
    /// same event, and its JSON has the envelope's fields at the top.
    #[test]
    fn a_job_finished_event_reads_back_as_it_was_written() {
        let job = JobId::new();
        let kind = EventKind::job_finished(
            ResultEnvelope {
                label: Some("scout".into()),
                attempt: 2,
                task_status: Some(TaskStatus::Partial),
                output: serde_json::json!({"n": 1}),
                error: Some("it was stopped".into()),
                error_class: Some(ErrorClass::BudgetExhausted),
                limitations: vec!["half".into()],
                artifacts: vec!["a.csv".into()],
                tokens_spent: 7,
                usd_micros_spent: 9,
                turns: 3,
                workdir: "/w/scout".into(),
                ..ResultEnvelope::bare(job, "scout", Status::Stopped)
            },
            Some("it was stopped".into()),
            true,
        );
        let json = serde_json::to_value(&kind).unwrap();
        assert_eq!(json["type"], "job_finished");
        assert_eq!(json["id"], job.to_string());
        assert_eq!(json["job"], job.to_string());
        assert_eq!(json["workdir"], "/w/scout");
        assert_eq!(json["propagated"], true);
        assert_eq!(
            serde_json::from_value::<EventKind>(json.clone()).unwrap(),
            kind
        );
        let mut missing = json.clone();
        missing.as_object_mut().unwrap().remove("turns");
        assert!(serde_json::from_value::<EventKind>(missing).is_err());
        let mut two_jobs = json;
        two_jobs["id"] = serde_json::json!(JobId::new().to_string());
        let refused = serde_json::from_value::<EventKind>(two_jobs).unwrap_err();
        assert!(refused.to_string().contains("names job"), "{refused}");
    }
}
