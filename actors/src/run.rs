//! Run: one per run. Owns the run's root Account and its steps, group by group.
//!
//! Parent: the Node. Children: its Account and the steps of the current group
//! (Job actors of kind step). Journals the run record at start and end, and
//! each step's terminal record (it is the steps' parent).
//!
//! Invariants:
//! 1. The steps of a group share what the run has available evenly (I-08).
//! 2. The run ends only after every step settled; its spent is theirs (I-14).
//! 3. A stopped or timed-out run stops every step first (I-15, I-18).

use crate::account::{Account, AccountArgs, AccountMsg, Grant, GrantAsk, Share, SpentMeter};
use crate::context::{NodeContext, RunContext};
use crate::ends::Ends;
use crate::job::{self, Brief, Job, JobMsg, JobStart, Lineage};
use crate::parent::{BudgetWait, ChildEnd, ChildReport, StopReason, record_child_end};
use crate::policy::Policy;
use arbor_protocol::{
    AgentDef, ErrorClass, EventKind, JobId, NodeKind, ParentRef, ResultEnvelope, RunId, RunSpec,
    Status,
};
use arbor_storage::{JobRecord, Record, RunRecord};
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio_util::sync::{CancellationToken, DropGuard};

mod checks;
mod looping;
mod pause;

pub use checks::{CheckNow, Found, LoopState, Review, Role, verdict_of};

pub struct Run;

pub struct RunArgs {
    pub ctx: Arc<NodeContext>,
    pub id: RunId,
    pub spec: RunSpec,
    /// Set when a restart resumes an interrupted run (I-34).
    pub resume: Option<Resume>,
    /// What a new run that continues an interrupted job takes over from it (I-33).
    pub carried: Carried,
}

/// What a new run carries over from the interrupted job it continues
/// (I-33): its step is the job's next attempt, and starts from the calls
/// the job's limits had counted (I-45).
#[derive(Clone, Debug, Default)]
pub struct Carried {
    /// Attempts already made, by step label.
    pub attempts: std::collections::HashMap<String, u32>,
    /// Calls counted by limits, by step label.
    pub tool_counts: std::collections::HashMap<String, crate::agent_loop::Made>,
    /// The recording a replay replays, when the caller has it (a fixture);
    /// else it is read from the journal, under the replayed run.
    pub tape: Option<Arc<arbor_protocol::tape::Tape>>,
}

/// Where an interrupted run picks up, as recovery read it from the journal.
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// The first group that had not finished.
    pub group: usize,
    /// (label, output) of every step of the groups before it.
    pub previous: Vec<(String, serde_json::Value)>,
    /// Steps of `group` that finished before the crash: they keep their results.
    pub kept: Vec<ResultEnvelope>,
    /// Attempts so far, by step label: a step run again gets the next one.
    pub attempts: std::collections::HashMap<String, u32>,
    /// What the run's account had spent, settled by recovery.
    pub spent: arbor_protocol::Amount,
    /// Spawns the run had counted (I-05: never reset by a restart).
    pub spawned: u64,
    /// By step label: the calls its interrupted attempts made that limits
    /// count (I-45), so the attempt that takes over starts from them.
    pub tool_counts: std::collections::HashMap<String, crate::agent_loop::Made>,
    /// What the run's optional steps that did not complete left undone.
    pub limitations: Vec<String>,
    /// Steps of `group` whose latest attempt failed and that their retry
    /// policy tries again: the waits to resume (I-56).
    pub retry_waits: Vec<RetryWait>,
    /// Steps of `group` whose latest attempt a restart interrupted: label
    /// -> that attempt. One that may have acted outside its workdir waits
    /// for a person (I-57); the rest run again.
    pub interrupted: std::collections::HashMap<String, JobId>,
    /// The interrupted attempts whose `NeedsDecision` is journaled already.
    pub asked: std::collections::HashSet<JobId>,
    /// By label: an interrupted rescue, run again as one (its rescuer, its
    /// request, the failed attempt's workdir).
    pub rescues: std::collections::HashMap<String, (String, String, String)>,
    /// Steps whose latest attempt failed and whose rescuer has not started.
    pub rescue_now: Vec<Failed>,
    /// By label: the loops (`until`) of `group`'s steps, where they were.
    pub loops: std::collections::HashMap<String, LoopState>,
    /// Loop iterations that ended done and whose check was not made.
    pub check_now: Vec<CheckNow>,
    /// Where its review (`verify`) was, if it had begun.
    pub review: Option<Review>,
    /// Its reviewer's answer, journaled as a job's end but not yet as a review.
    pub reviewed_now: Option<ResultEnvelope>,
    /// What the last group was given of the groups before it.
    pub before_last: Vec<(String, serde_json::Value)>,
    /// The deadline of a budget pause it was in (I-58): kept by the next.
    pub pause_deadline_ms: Option<u64>,
    /// A pause of its expired: it pauses no more.
    pub pause_expired: bool,
}

/// A step's failed attempt, as its rescuer is told of it.
#[derive(Clone, Debug)]
pub struct Failed {
    pub label: String,
    pub attempt: u32,
    pub class: ErrorClass,
    pub error: String,
    pub output: serde_json::Value,
    pub workdir: String,
}

/// A failed step waiting to be tried again, as recovery found it.
#[derive(Clone, Debug)]
pub struct RetryWait {
    /// The attempt that failed.
    pub failed: JobId,
    pub label: String,
    /// The attempt that will run.
    pub attempt: u32,
    pub class: ErrorClass,
    pub error: String,
    /// When it starts, if its `RetryWaiting` was journaled; else the wait
    /// starts over at the restart (never skipped).
    pub until_ms: Option<u64>,
}

/// A step's report arrives as `RunMsg::ChildEnded` (`parent::Parent`).
impl From<ChildReport> for RunMsg {
    fn from(report: ChildReport) -> Self {
        RunMsg::ChildEnded { report }
    }
}

impl TryFrom<RunMsg> for ChildReport {
    type Error = ();
    fn try_from(message: RunMsg) -> Result<Self, ()> {
        match message {
            RunMsg::ChildEnded { report } => Ok(report),
            _ => Err(()),
        }
    }
}

pub enum RunMsg {
    Stop {
        reason: String,
        /// The audit entry of the operator's call (I-64), committed with
        /// the run's end (boxed: a run's every message is as large as its
        /// largest).
        audit: Option<Box<Record>>,
    },
    /// An operator stops one step.
    StopStep {
        id: JobId,
        reason: String,
        /// Committed with the step's end.
        audit: Option<Box<Record>>,
    },
    ChildEnded {
        report: ChildReport,
    },
    /// A step's actor ended; if it never reported, it failed (I-38).
    StepGone {
        actor: ractor::ActorId,
        why: String,
    },
    /// The steps' ends appended so far are durable (or the journal failed).
    EndsDurable {
        result: Result<(), String>,
    },
    TimedOut,
    /// A failed step's retry wait is over: its next attempt starts.
    RetryDue {
        label: String,
    },
    /// A person continues the interrupted step `job`, which waits for that
    /// decision (I-57).
    Continue {
        job: JobId,
        reply: ractor::RpcReplyPort<Result<(), String>>,
        /// Committed with the next attempt's record.
        audit: Option<Box<Record>>,
    },
    /// A replay's request differed from its recording's (I-49).
    Diverged {
        why: String,
    },
    /// A step of a `peers` group messages a sibling (`send_peer`).
    Peer(crate::job::PeerSend),
    /// A gated step's card (`approve = true`) has its one outcome.
    GateDecided {
        label: String,
        answer: crate::approvals::Answer,
    },
    /// A loop's command check (`until.command`) on iteration `job` has found.
    Checked {
        label: String,
        job: JobId,
        found: Found,
    },
    /// An operator raises the run's root grant (a top-up, I-58): committed
    /// with its audit entry before it is told.
    TopUp {
        amount: arbor_protocol::Amount,
        audit: Option<Box<Record>>,
        reply: ractor::RpcReplyPort<Result<arbor_protocol::AccountView, String>>,
    },
    /// A loop's bounds were spent before its next iteration could start.
    LoopSpent {
        label: String,
        attempt: u32,
        why: String,
    },
    /// A step's call was refused at the ceiling of a run that pauses (I-58).
    BudgetWait(BudgetWait),
    /// The deadline of the budget pause that opened with it has passed.
    PauseExpired {
        deadline_ms: u64,
    },
}

/// A step's wait for a top-up arrives as `RunMsg::BudgetWait` (`parent::Payer`).
impl From<BudgetWait> for RunMsg {
    fn from(wait: BudgetWait) -> Self {
        RunMsg::BudgetWait(wait)
    }
}

impl TryFrom<RunMsg> for BudgetWait {
    type Error = ();
    fn try_from(message: RunMsg) -> Result<Self, ()> {
        match message {
            RunMsg::BudgetWait(wait) => Ok(wait),
            _ => Err(()),
        }
    }
}

impl Actor for Run {
    type Msg = RunMsg;
    type State = RunState;
    type Arguments = RunArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: RunArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let ctx = args.ctx;
        // Read before anything is written: a replay without its recording
        // leaves nothing behind.
        let replay = replay_of(&ctx, &args.spec, &args.carried)?;
        let record = RunRecord {
            id: args.id,
            flow: args.spec.flow.clone(),
            budget_tokens: args.spec.budget_tokens,
            status: Status::Running,
            error_class: None,
            reason: None,
            output_json: "null".into(),
            epoch: ctx.journal.epoch(),
        };
        let resume_given = args.resume.is_some();
        let resume = args.resume.unwrap_or_default();
        // Durable with the run's record, in one append, before anything of
        // the run acts: a resume is counted by the next recovery (I-48); the
        // spec, which a resume needs, travels in `RunStarted` (a crash
        // between the two would leave a running run that cannot resume).
        let started = if resume_given {
            EventKind::RunResumed {
                epoch: ctx.journal.epoch(),
                group: resume.group as u32,
            }
        } else {
            EventKind::RunStarted {
                flow: args.spec.flow.clone(),
                budget_tokens: args.spec.budget_tokens,
                budget_usd_micros: args.spec.budget_usd_micros,
                spec: Box::new(args.spec.clone()),
            }
        };
        ctx.events
            .emit_with(args.id, vec![Record::Run(record)], [started])?;
        ctx.journal.flush().await?;
        let meter = SpentMeter::default();
        let (grant, grant_usd_micros) = root_grant(&ctx, args.id, &args.spec, resume_given)?;
        let (account, _) = Actor::spawn_linked(
            None,
            Account,
            AccountArgs {
                ctx: ctx.clone(),
                run: args.id,
                owner: ParentRef::Run(args.id),
                grant,
                grant_usd_micros,
                wind_down: ctx.limits.wind_down,
                meter: meter.clone(),
                resume_spent: resume_given.then_some(resume.spent),
                first_call: None,
            },
            myself.get_cell(),
        )
        .await?;
        let cancel = CancellationToken::new();
        let steps = kept_steps(&resume.kept);
        Ok(RunState {
            run_ctx: Arc::new(
                RunContext::resumed(args.id, ctx.limits.spawn_cap, resume.spawned)
                    .with_tape(args.spec.record, replay)
                    .with_instructions(args.spec.instructions.as_deref()),
            ),
            labels: args.spec.step_labels(),
            spec: RunSpec {
                pause: args.spec.pause.filter(|_| !resume.pause_expired),
                ..args.spec
            },
            attempts: if resume_given {
                resume.attempts
            } else {
                args.carried.attempts
            },
            tool_counts: if resume_given {
                resume.tool_counts
            } else {
                args.carried.tool_counts
            },
            ctx,
            id: args.id,
            account,
            meter,
            group: resume.group,
            steps,
            previous: resume.previous,
            limitations: resume.limitations,
            finish: None,
            ended: Ends::default(),
            _cancel_on_drop: cancel.clone().drop_guard(),
            _wall: None,
            retrying: BTreeMap::new(),
            deciding: BTreeMap::new(),
            interrupted: resume.interrupted,
            asked: resume.asked,
            rescues: resume.rescues,
            resumed_rescues: resume.rescue_now,
            failures: std::collections::HashMap::new(),
            resumed_waits: resume.retry_waits,
            gating: BTreeMap::new(),
            approved: std::collections::HashSet::new(),
            peer_sent: std::collections::HashMap::new(),
            loops: resume.loops,
            checking: BTreeMap::new(),
            resumed_checks: resume.check_now,
            review: resume.review,
            reviewed_now: resume.reviewed_now,
            before_last: resume.before_last,
            pause: checks::Pause {
                kept_deadline: resume.pause_deadline_ms,
                ..Default::default()
            },
            audit: vec![],
            end_audit: vec![],
            cancel,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // I-59: a run's cap is its own, or the node's `[limits] run_timeout`.
        state.start_wall(&myself);
        if let Some(replay) = &state.run_ctx.replay {
            let diverged = replay.diverged();
            let run = myself.clone();
            tokio::spawn(async move {
                if let Some(why) = diverged.await {
                    let _ = run.cast(RunMsg::Diverged { why });
                }
            });
        }
        if state.group >= state.spec.groups.len() {
            // A resumed run whose every group had finished: its review, or its end, was lost.
            match state.reviewed_now.take() {
                Some(answer) => state.reviewed(&myself, answer).await?,
                None => state.after_last_group(&myself).await,
            }
        } else {
            for wait in std::mem::take(&mut state.resumed_waits) {
                state.wait_to_retry(&myself, wait).await?;
            }
            for failed in std::mem::take(&mut state.resumed_rescues) {
                state.rescue_or_fail(&myself, failed).await;
            }
            // Held before the group starts, so that it is not over while they decide.
            let checks = std::mem::take(&mut state.resumed_checks);
            for check in &checks {
                let label = check.envelope.label.clone().unwrap_or_default();
                state.checking.insert(label, check.envelope.job);
            }
            state.start_group(&myself).await;
            state.resumed_pause_over();
            for check in checks {
                let label = check.envelope.label.clone().unwrap_or_default();
                match check.judged {
                    // Its judge had answered: the verdict stands, not asked again.
                    Some(judged) => {
                        let found = checks::verdict_of(&judged);
                        let job = check.envelope.job;
                        state.iteration_checked(&myself, label, job, found).await?;
                    }
                    None => {
                        state
                            .check_iteration(&myself, label, check.envelope)
                            .await?
                    }
                }
            }
        }
        state.maybe_complete(&myself).await
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.cancel.cancel();
        state.ctx.pools.forget(state.id);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            RunMsg::Stop { reason, audit } => {
                state.end_audit.extend(audit.map(|a| *a));
                state.begin_finish(Status::Stopped, None, reason);
            }
            RunMsg::StopStep { id, reason, audit } => {
                state.stop_step(id, &reason, false, audit.map(|a| *a));
            }
            RunMsg::Diverged { why } => {
                state.begin_finish(Status::Failed, Some(ErrorClass::Diverged), why);
            }
            // A pause is not working time (I-59): the cap counts again after it.
            RunMsg::TimedOut if state.paused() => {}
            RunMsg::TimedOut => {
                let timeout = humantime::format_duration(state.wall_cap());
                state.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::Timeout),
                    format!("the run timed out after {timeout}"),
                );
            }
            RunMsg::RetryDue { label } => state.retry_due(&myself, label).await,
            RunMsg::Peer(send) => state.pass_peer(send),
            RunMsg::GateDecided { label, answer } => {
                state.gate_decided(&myself, label, answer).await?;
            }
            RunMsg::TopUp {
                amount,
                audit,
                reply,
            } => {
                let grown = if state.finish.is_some() {
                    Err(format!("run {} is ending", state.id))
                } else {
                    let with: Vec<Record> = audit.map(|a| *a).into_iter().collect();
                    ractor::call!(state.account, |reply| AccountMsg::Grow {
                        amount,
                        with,
                        reply
                    })
                    .map_err(|e| format!("the run's account is gone: {e}"))
                    .and_then(|grown| grown)
                };
                let topped = grown.is_ok();
                if let Ok(view) = &grown {
                    tracing::info!(run = %state.id, tokens = amount.tokens, usd_micros = amount.usd_micros, grant = view.grant, "the run's ceiling was topped up");
                }
                let _ = reply.send(grown);
                if topped {
                    state.topped_up(&myself).await?;
                }
            }
            RunMsg::BudgetWait(wait) => state.budget_wait(&myself, wait).await?,
            RunMsg::PauseExpired { deadline_ms } => state.pause_expired(&myself, deadline_ms),
            RunMsg::Checked { label, job, found } => {
                state.iteration_checked(&myself, label, job, found).await?;
            }
            RunMsg::LoopSpent {
                label,
                attempt,
                why,
            } => {
                if state.finish.is_none() {
                    let output = state
                        .loops
                        .get(&label)
                        .and_then(|l| l.previous.as_ref())
                        .map(|p| p.0.clone())
                        .unwrap_or_default();
                    let why = format!("its check did not pass: {why}");
                    state
                        .loop_failed(&myself, label, attempt, output, why)
                        .await?;
                }
            }
            RunMsg::Continue { job, reply, audit } => {
                let continued = state.continue_step(&myself, job, audit.map(|a| *a)).await;
                let _ = reply.send(continued);
            }
            RunMsg::ChildEnded { report } => {
                state.step_ended(&myself, report).await?;
                // What it gave back may let a waiter go on.
                if state.paused() && state.finish.is_none() {
                    state.serve(&myself).await?;
                }
            }
            RunMsg::StepGone { actor, why } => {
                if let Some(report) = state.report_for_dead(actor, &why) {
                    state.step_ended(&myself, report).await?;
                }
            }
            RunMsg::EndsDurable { result } => {
                state.ended.waited();
                result?;
                state.release_ended(&myself);
            }
        }
        state.maybe_complete(&myself).await
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "ended".into()))
            }
            SupervisionEvent::ActorFailed(cell, error) => (cell, format!("panicked: {error}")),
            _ => return Ok(()),
        };
        if cell.get_id() == state.account.get_id() {
            state.begin_finish(
                Status::Failed,
                Some(ErrorClass::Panicked),
                format!("the run's account {why}"),
            );
        } else if state.steps.values().any(|s| {
            s.actor
                .as_ref()
                .is_some_and(|a| a.get_id() == cell.get_id())
                && s.envelope.is_none()
        }) {
            // As in Job: a report sent just before the stop is still queued.
            let _ = myself.cast(RunMsg::StepGone {
                actor: cell.get_id(),
                why,
            });
        }
        state.maybe_complete(&myself).await
    }
}

struct StepEntry {
    id: JobId,
    label: String,
    attempt: u32,
    agent: String,
    /// None for a step a resumed run kept from before the restart.
    actor: Option<ActorRef<JobMsg>>,
    grant: Grant,
    meter: SpentMeter,
    stop_reason: Option<StopReason>,
    envelope: Option<ResultEnvelope>,
    /// A step's attempt, a loop's judge or the run's reviewer.
    role: Role,
}

struct RunFinish {
    status: Status,
    class: Option<ErrorClass>,
    reason: Option<String>,
    output: serde_json::Value,
}

pub struct RunState {
    ctx: Arc<NodeContext>,
    run_ctx: Arc<RunContext>,
    id: RunId,
    spec: RunSpec,
    /// `spec.step_labels()`: the label of every step, group by group.
    labels: Vec<Vec<String>>,
    /// Attempts so far by label, from before a restart.
    attempts: std::collections::HashMap<String, u32>,
    /// Counted calls by label, from before a restart; taken by the step's
    /// next attempt.
    tool_counts: std::collections::HashMap<String, crate::agent_loop::Made>,
    account: ActorRef<AccountMsg>,
    meter: SpentMeter,
    group: usize,
    steps: BTreeMap<JobId, StepEntry>,
    /// (label, output) of the previous group's steps, handed to the next group.
    previous: Vec<(String, serde_json::Value)>,
    /// Its optional steps that did not complete (the run is then `partial`).
    limitations: Vec<String>,
    finish: Option<RunFinish>,
    /// Steps' ends appended and not yet durable, held back from watchers.
    ended: Ends,
    /// Audit entries of operators' calls (I-64) that go into the commit
    /// of what they asked: a continued step's records (`audit`), the run's
    /// end after a stop (`end_audit`).
    audit: Vec<Record>,
    end_audit: Vec<Record>,
    cancel: CancellationToken,
    _cancel_on_drop: DropGuard,
    /// Its wall cap's timer (I-59), armed once it has started.
    _wall: Option<crate::timer::Timer>,
    /// By label: failed steps of the current group waiting to be tried
    /// again. The group is not over while one waits; a stop or the run's
    /// end drops them, timers and all.
    retrying: BTreeMap<String, Retrying>,
    /// Waits a restart found, armed once the run has started.
    resumed_waits: Vec<RetryWait>,
    /// Failures a restart found that their rescuer has yet to take over.
    resumed_rescues: Vec<Failed>,
    /// By label: why the attempt before the one about to start failed.
    failures: std::collections::HashMap<String, String>,
    /// By label: interrupted steps that wait for a person (I-57): the
    /// attempt a restart cut. The group is not over while one waits.
    deciding: BTreeMap<String, JobId>,
    /// From a restart: label -> its interrupted attempt, until planned.
    interrupted: std::collections::HashMap<String, JobId>,
    /// Interrupted attempts whose `NeedsDecision` is journaled already.
    asked: std::collections::HashSet<JobId>,
    /// By label: the rescue (`on_fail`) its next attempt is: the
    /// rescuer's name, its request, and the failed attempt's workdir.
    rescues: std::collections::HashMap<String, (String, String, String)>,
    /// By label: steps waiting for a person's go-ahead (`approve = true`),
    /// with the token that cancels the card. The group is not over while
    /// one waits.
    gating: BTreeMap<String, CancellationToken>,
    /// Labels a person let start (their go-ahead covers every attempt).
    approved: std::collections::HashSet<String>,
    /// Messages each step of a `peers` group has sent, by label.
    peer_sent: std::collections::HashMap<String, u32>,
    /// By label: the loops (`until`) of the current group's steps.
    loops: std::collections::HashMap<String, LoopState>,
    /// By label: loops whose iteration (this attempt) is being checked.
    /// The group is not over while one is.
    checking: BTreeMap<String, JobId>,
    /// Checks a restart found unmade, made once the run has started.
    resumed_checks: Vec<CheckNow>,
    /// Its review (`verify`), once begun.
    review: Option<Review>,
    /// A reviewer's answer a restart found unrecorded.
    reviewed_now: Option<ResultEnvelope>,
    /// What the last group was given of the groups before it: given again
    /// when a review sends it round once more.
    before_last: Vec<(String, serde_json::Value)>,
    /// Its budget pause (`on_ceiling = "pause"`), its waiters and deadline.
    pause: checks::Pause<PlannedStep>,
}

/// A failed step's wait for its next attempt.
struct Retrying {
    /// The attempt that failed, and why: the next is told.
    failed_attempt: u32,
    error: String,
    _timer: crate::timer::Timer,
}

/// A step of the group about to start, or a loop's judge.
struct PlannedStep {
    id: JobId,
    label: String,
    agent: Arc<AgentDef>,
    instruction: String,
    attempt: u32,
    workdir: std::path::PathBuf,
    /// What its answer must be (a judge's verdict).
    output_schema: Option<serde_json::Value>,
    /// What its loop's bounds leave it: its grant and time are within.
    left: checks::Left,
    role: Role,
}

impl RunState {
    /// The step of this label in the current group.
    fn step_spec(&self, label: &str) -> Option<&arbor_protocol::StepSpec> {
        let steps = self.spec.groups.get(self.group)?.steps.iter();
        let labels = self.labels.get(self.group)?;
        steps.zip(labels).find(|(_, l)| *l == label).map(|(s, _)| s)
    }

    /// Whether the step of this label (in the current group) is optional.
    fn is_optional(&self, label: &str) -> bool {
        self.step_spec(label).is_some_and(|s| s.optional)
    }

    /// A failed step waits for its next attempt (its retry policy). The
    /// wait is journaled (`RetryWaiting`, with when it ends) and durable
    /// before it begins, so a restart resumes it where it was (I-56).
    async fn wait_to_retry(
        &mut self,
        myself: &ActorRef<RunMsg>,
        wait: RetryWait,
    ) -> Result<(), ActorProcessingErr> {
        let until_ms = match wait.until_ms {
            Some(until) => until,
            None => {
                // Its end is told first: a watcher sees the failure, then the wait.
                self.ended.settle(&self.ctx, self.id).await?;
                let policy = self.step_spec(&wait.label).and_then(|s| s.retry.as_ref());
                let delay = policy
                    .map(|p| p.wait_before(wait.attempt))
                    .unwrap_or_default();
                let until = crate::events::now_ms().saturating_add(delay.as_millis() as u64);
                self.ctx.events.emit(
                    self.id,
                    EventKind::RetryWaiting {
                        id: wait.failed,
                        label: wait.label.clone(),
                        attempt: wait.attempt,
                        class: wait.class,
                        until_ms: until,
                    },
                );
                self.ctx.journal.flush().await?;
                until
            }
        };
        tracing::info!(run = %self.id, step = %wait.label, attempt = wait.attempt, class = %wait.class, until_ms, "step waits to be tried again");
        let label = wait.label.clone();
        let left = until_ms.saturating_sub(crate::events::now_ms());
        let timer =
            crate::timer::after(myself, std::time::Duration::from_millis(left), move || {
                RunMsg::RetryDue { label }
            });
        self.retrying.insert(
            wait.label,
            Retrying {
                failed_attempt: wait.attempt - 1,
                error: wait.error,
                _timer: timer,
            },
        );
        Ok(())
    }

    /// Journals that each of `asks` (an interrupted attempt, its label, why
    /// it may have acted outside its workdir) waits for a person, once per
    /// attempt across restarts, durable before the run waits on it (I-57).
    async fn ask_decisions(&mut self, asks: Vec<(JobId, String, String)>) {
        let mut told = false;
        for (job, label, why) in asks {
            tracing::warn!(run = %self.id, step = %label, %job, why, "interrupted step waits for a person");
            if self.asked.insert(job) {
                self.ctx.events.emit(
                    self.id,
                    EventKind::NeedsDecision {
                        id: job,
                        label,
                        why,
                    },
                );
                told = true;
            }
        }
        if told && let Err(e) = self.ctx.journal.flush().await {
            self.begin_finish(
                Status::Failed,
                Some(ErrorClass::Internal),
                format!("the journal could not record a step that waits for a person: {e}"),
            );
        }
    }

    /// A person continues an interrupted step that waited for them (I-57):
    /// its next attempt is admitted as any step is.
    async fn continue_step(
        &mut self,
        myself: &ActorRef<RunMsg>,
        job: JobId,
        audit: Option<Record>,
    ) -> Result<(), String> {
        if self.finish.is_some() {
            return Err(format!("run {} is ending", self.id));
        }
        let Some(label) = self
            .deciding
            .iter()
            .find(|(_, waiting)| **waiting == job)
            .map(|(label, _)| label.clone())
        else {
            return Err(format!(
                "run {} does not wait for a decision on {job}",
                self.id
            ));
        };
        self.deciding.remove(&label);
        self.audit.extend(audit);
        tracing::info!(run = %self.id, step = %label, %job, "a person continued an interrupted step");
        self.failures.insert(
            label,
            "it was interrupted by a restart; a person chose to run it again".into(),
        );
        self.start_group(myself).await;
        Ok(())
    }

    /// A step failed for good: its rescuer (`on_fail`) takes over as its next
    /// attempt, told what failed, with a copy of the failed workdir below
    /// `failed/` in its own; its answer stands in for the step's. Not when
    /// the failure walls a supply the rescuer's model draws on too: the
    /// run fails, and its limitations say the rescuer was skipped and why.
    async fn rescue_or_fail(&mut self, myself: &ActorRef<RunMsg>, failed: Failed) {
        let Some(step) = self.step_spec(&failed.label).cloned() else {
            return;
        };
        let Some(rescuer) = step.on_fail.clone() else {
            return;
        };
        let supply = |name: &str| {
            let agent = self.ctx.agent(name)?;
            Some(self.ctx.models.model_for(&agent).ok()?.info().supply)
        };
        let walled = failed
            .class
            .walls_supply()
            .then(|| supply(&step.agent))
            .flatten();
        if let Some(walled) = walled.filter(|w| supply(&rescuer).as_ref() == Some(w)) {
            let skipped = format!(
                "rescuer {rescuer} skipped: step {} failed with {}, which walls supply {walled}, \
                 and {rescuer}'s model draws on it too",
                failed.label, failed.class
            );
            tracing::warn!(run = %self.id, step = %failed.label, rescuer, "{skipped}");
            self.limitations.push(skipped);
            self.begin_finish(
                Status::Failed,
                Some(failed.class),
                format!("step {} failed: {}", failed.label, failed.error),
            );
            return;
        }
        let next = failed.attempt + 1;
        let request = format!(
            "The step {label} failed ({class}): {error}\n\nIts request was:\n{request}\n\n\
             What it had produced: {output}\n\nIts workdir as it was left is copied below \
             `failed/` in yours.\n\nDo what it was asked; your answer stands in for its.",
            label = failed.label,
            class = failed.class,
            error = failed.error,
            request = step.instruction,
            output = failed.output,
        );
        tracing::info!(run = %self.id, step = %failed.label, rescuer, attempt = next, "a rescuer takes over a failed step");
        self.rescues
            .insert(failed.label.clone(), (rescuer, request, failed.workdir));
        self.next_attempt(myself, failed.label, failed.attempt)
            .await;
    }

    /// Starts `label`'s attempt after `failed`, in place of the failed one
    /// (a retry's or a rescue's; what it is told is set before).
    async fn next_attempt(&mut self, myself: &ActorRef<RunMsg>, label: String, failed: u32) {
        self.steps.retain(|_, s| s.label != label);
        self.attempts.insert(label, failed);
        self.start_group(myself).await;
    }

    /// A retry's wait is over: the step's next attempt is admitted as any
    /// step is (its grant reserved, its record durable), in a clean workdir.
    async fn retry_due(&mut self, myself: &ActorRef<RunMsg>, label: String) {
        let Some(retrying) = self.retrying.remove(&label) else {
            return;
        };
        if self.finish.is_some() {
            return;
        }
        self.failures.insert(label.clone(), retrying.error);
        self.next_attempt(myself, label, retrying.failed_attempt)
            .await;
    }

    /// A step of a `peers` group: its siblings, and a way to them through
    /// this run; None for a step of another group.
    fn peers_of(&self, myself: &ActorRef<RunMsg>, label: &str) -> Option<Arc<crate::job::Peers>> {
        let group = self.spec.groups.get(self.group).filter(|g| g.peers)?;
        let labels = self.labels.get(self.group)?;
        let siblings = group
            .steps
            .iter()
            .zip(labels)
            .filter(|(_, l)| *l != label)
            .map(|(step, l)| {
                let description = self
                    .ctx
                    .agents
                    .get(&step.agent)
                    .and_then(|a| a.description.clone())
                    .unwrap_or_default();
                (l.clone(), step.agent.clone(), description)
            })
            .collect();
        let run = myself.clone();
        Some(Arc::new(crate::job::Peers {
            siblings,
            send: Box::new(move |send| {
                let _ = run.cast(RunMsg::Peer(send));
            }),
        }))
    }

    /// A peer's message goes to its sibling's running attempt, which answers
    /// the sender once it is durable there (I-20); to one that has ended,
    /// is unknown, or past the sender's `max_peer_messages`, it is refused.
    fn pass_peer(&mut self, send: crate::job::PeerSend) {
        let crate::job::PeerSend {
            from,
            to,
            text,
            reply,
        } = send;
        match self.peer_of(&from, &to) {
            Ok(actor) => {
                *self.peer_sent.entry(from.clone()).or_default() += 1;
                let _ = actor.cast(crate::job::JobMsg::Peer { from, text, reply });
            }
            Err(message) => {
                let _ = reply.send(Err(arbor_protocol::Refusal::Invalid { message }));
            }
        }
    }

    /// The running attempt of `to` that `from` may message, or why not.
    fn peer_of(&self, from: &str, to: &str) -> Result<ActorRef<crate::job::JobMsg>, String> {
        let peers = self.labels.get(self.group).cloned().unwrap_or_default();
        if to == from || !peers.iter().any(|l| l == to) {
            let others: Vec<&str> = peers
                .iter()
                .map(String::as_str)
                .filter(|l| *l != from)
                .collect();
            return Err(format!(
                "{to:?} is not one of your peers; send to one of: {}",
                others.join(", ")
            ));
        }
        let most = self.ctx.limits.max_peer_messages;
        if self.peer_sent.get(from).copied().unwrap_or(0) >= most {
            return Err(format!(
                "you have sent your peers {most} messages, the most a step may \
                 ([limits] max_peer_messages); go on without sending more"
            ));
        }
        self.steps
            .values()
            .filter(|s| s.label == to)
            .max_by_key(|s| s.attempt)
            .filter(|s| s.envelope.is_none())
            .and_then(|s| s.actor.clone())
            .ok_or_else(|| {
                format!(
                    "peer {to} has ended (or has not started): it reads no more messages, so \
                     this one was not sent"
                )
            })
    }

    /// A step with `approve = true` waits for a person's go-ahead: a card of
    /// kind `step` (its label, agent and instruction), durable before it is
    /// listed and kept across a restart (I-60); its outcome comes back as
    /// `GateDecided`. A stop of the run cancels it.
    fn ask_go_ahead(
        &mut self,
        myself: &ActorRef<RunMsg>,
        step: &arbor_protocol::StepSpec,
        label: String,
    ) {
        use crate::approvals::{Answer, Ask, GateMsg};
        let cancel = self.cancel.child_token();
        self.gating.insert(label.clone(), cancel.clone());
        let ask = Ask {
            run: self.id,
            job: JobId::new(),
            lineage: vec![label.clone()],
            agent: step.agent.clone(),
            tool: arbor_protocol::approval::STEP_TOOL.into(),
            call: format!("step:{label}"),
            args: serde_json::json!({
                "label": label,
                "agent": step.agent,
                "instruction": step.instruction,
            }),
            cancel,
            check: Arc::new(|_| Ok(())),
            timeout: None,
        };
        tracing::info!(run = %self.id, step = %label, "step waits for a person's go-ahead");
        let gate = self.ctx.gate.get().cloned();
        let myself = myself.clone();
        tokio::spawn(async move {
            let answer = match gate {
                None => Answer::Failed("this node has no approval gate".into()),
                Some(gate) => match gate
                    .call(
                        |reply| GateMsg::Ask {
                            ask: Box::new(ask),
                            reply,
                        },
                        None,
                    )
                    .await
                {
                    Ok(ractor::rpc::CallResult::Success(answer)) => answer,
                    _ => Answer::Failed("the approval gate is gone".into()),
                },
            };
            let _ = myself.cast(RunMsg::GateDecided { label, answer });
        });
    }

    /// A gated step's card has its outcome: approved, it starts as any step
    /// does; otherwise it ends failed with why, which fails the run unless
    /// the step is optional.
    async fn gate_decided(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        answer: crate::approvals::Answer,
    ) -> Result<(), ActorProcessingErr> {
        use crate::approvals::Answer;
        if self.gating.remove(&label).is_none() || self.finish.is_some() {
            return Ok(());
        }
        let why = match answer {
            Answer::Approved { .. } => {
                tracing::info!(run = %self.id, step = %label, "a person let the step start");
                self.approved.insert(label);
                self.start_group(myself).await;
                return Ok(());
            }
            Answer::Rejected { by, reason } => {
                format!("a person ({by}) did not let it start: {reason}")
            }
            Answer::Expired => "nobody let it start before its card's deadline".into(),
            Answer::Failed(why) => format!("its go-ahead could not be asked: {why}"),
            Answer::Cancelled | Answer::Answered { .. } => return Ok(()),
        };
        if self.is_optional(&label) {
            self.limitations
                .push(arbor_protocol::StepSpec::optional_limitation(
                    &label,
                    Status::Failed,
                    &why,
                ));
            return self.next_group_if_done(myself).await;
        }
        self.begin_finish(
            Status::Failed,
            Some(ErrorClass::Task),
            format!("step {label} failed: {why}"),
        );
        Ok(())
    }

    /// Its wall-clock cap (I-59): its own, or the node's `[limits] run_timeout`.
    fn wall_cap(&self) -> std::time::Duration {
        self.spec.timeout.unwrap_or(self.ctx.limits.run_timeout)
    }

    async fn start_group(&mut self, myself: &ActorRef<RunMsg>) {
        let Some(group) = self.spec.groups.get(self.group).cloned() else {
            return;
        };
        let labels = self.labels.get(self.group).cloned().unwrap_or_default();
        let mut planned = vec![];
        let mut asks = vec![];
        for (step, label) in group.steps.iter().zip(labels) {
            // A step a resumed run kept needs no new attempt, nor one that
            // waits to be tried again.
            if self.steps.values().any(|s| s.label == label)
                || self.retrying.contains_key(&label)
                || self.deciding.contains_key(&label)
                || self.gating.contains_key(&label)
                || self.checking.contains_key(&label)
            {
                continue;
            }
            if step.approve && !self.approved.contains(&label) {
                self.ask_go_ahead(myself, step, label);
                continue;
            }
            // A rescue (`on_fail`) runs its own agent on its own request.
            let rescue = self.rescues.get(&label).cloned();
            let step = &arbor_protocol::StepSpec {
                agent: rescue.as_ref().map_or(step.agent.clone(), |r| r.0.clone()),
                ..step.clone()
            };
            let Some(agent) = self.ctx.agent(&step.agent) else {
                self.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::Start),
                    format!("unknown agent {:?}", step.agent),
                );
                return;
            };
            if let Some(job) = self.interrupted.remove(&label)
                && let Some(why) = arbor_protocol::needs_decision(
                    step,
                    |name| self.ctx.agents.get(name).map(|a| a.as_ref()),
                    |name| self.ctx.mcp.server(name).map(|s| s.as_ref()),
                )
            {
                asks.push((job, label.clone(), why));
                self.deciding.insert(label, job);
                continue;
            }
            let attempt = self.attempts.get(&label).copied().unwrap_or(0) + 1;
            // A loop's iterations (not its rescue) share one workdir, each
            // building on the last, and stay within the loop's bounds.
            let looping = step.until.is_some() && rescue.is_none();
            let left = match looping.then(|| self.loop_left(&label)) {
                None => checks::Left::default(),
                Some(Ok(left)) => left,
                Some(Err(why)) => {
                    // Held until its message ends the step (`loop_failed`).
                    self.checking.insert(label.clone(), JobId::new());
                    let _ = myself.cast(RunMsg::LoopSpent {
                        label,
                        attempt: attempt - 1,
                        why,
                    });
                    continue;
                }
            };
            let workdir = self.step_workdir(&label, if looping { 1 } else { attempt });
            let instruction = match (self.rescues.remove(&label), self.failures.remove(&label)) {
                (Some((rescuer, request, failed)), _) => {
                    // The failed attempt's files, for its rescuer to read.
                    let to = self.step_workdir(&label, attempt).join("failed");
                    if let Err(e) = copy_tree(std::path::Path::new(&failed), &to) {
                        tracing::warn!(run = %self.id, step = %label, rescuer, error = %e, "the failed workdir could not be copied");
                    }
                    request
                }
                (None, Some(error)) => {
                    let request = self.loop_request(&label, &step.instruction);
                    format!("{request}\n\nA previous attempt failed: {error}")
                }
                (None, None) => self.loop_request(&label, &step.instruction),
            };
            let instruction = self.review_request(&label, instruction);
            planned.push(PlannedStep {
                id: JobId::new(),
                label,
                agent,
                instruction,
                attempt,
                workdir,
                output_schema: None,
                left,
                role: Role::Step,
            });
        }
        self.ask_decisions(asks).await;
        self.admit(myself, planned).await;
    }

    /// Admits steps (or a judge): their grants reserved, their records
    /// durable (I-29), then each started.
    async fn admit(&mut self, myself: &ActorRef<RunMsg>, planned: Vec<PlannedStep>) {
        if planned.is_empty() {
            return;
        }
        let grants = match self.reserve_steps(&planned).await {
            Ok(grants) => grants,
            Err(true) => return self.wait_to_start(myself, planned).await,
            Err(false) => return,
        };
        // I-29: the steps' records are durable before any of them starts.
        let mut records = self.step_records(&planned, &grants);
        records.append(&mut self.audit);
        let record_seq = match self.ctx.journal.commit(records).await {
            Ok(seq) => seq,
            Err(e) => {
                for step in &planned {
                    self.release_step(step.id).await;
                }
                self.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::Start),
                    format!("the journal could not record the steps: {e}"),
                );
                return;
            }
        };
        let context = self.previous_results();
        for (step, grant) in planned.into_iter().zip(grants) {
            self.spawn_step(myself, step, grant, record_seq, &context)
                .await;
        }
    }

    /// The group's grants, shared evenly. Else true if they wait for a
    /// top-up (the run pauses at its ceiling), false if the run ends.
    async fn reserve_steps(&mut self, planned: &[PlannedStep]) -> Result<Vec<Grant>, bool> {
        let asks = planned
            .iter()
            .map(|step| GrantAsk {
                child: step.id,
                agent: step.agent.name.clone(),
                asked: None,
                agent_max: least(step.agent.budget_tokens, step.left.tokens),
                asked_usd_micros: None,
                agent_max_usd_micros: least(step.agent.budget_usd_micros, step.left.usd_micros),
            })
            .collect();
        match ractor::call!(self.account, |reply| AccountMsg::Reserve {
            asks,
            share: Share::Even {
                held_back: self.retrying.len()
                    + self.deciding.len()
                    + self.gating.len()
                    + self.checking.len()
            },
            reply
        }) {
            Ok(Ok(grants)) => Ok(grants),
            Ok(Err(_)) if self.spec.pause.is_some() => Err(true),
            Ok(Err(refusal)) => {
                self.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::BudgetExhausted),
                    format!("group {} could not start: {refusal}", self.group + 1),
                );
                Err(false)
            }
            Err(e) => {
                self.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::Internal),
                    format!("the run's account is gone: {e}"),
                );
                Err(false)
            }
        }
    }

    /// The steps' pending records, committed before any of them starts.
    fn step_records(&self, planned: &[PlannedStep], grants: &[Grant]) -> Vec<Record> {
        let epoch = self.ctx.journal.epoch();
        planned
            .iter()
            .zip(grants)
            .map(|(step, grant)| {
                Record::Job(JobRecord {
                    id: step.id,
                    run: self.id,
                    parent: ParentRef::Run(self.id),
                    kind: NodeKind::Step,
                    agent: step.agent.name.clone(),
                    label: Some(step.label.clone()),
                    depth: 0,
                    attempt: step.attempt,
                    grant_tokens: grant.tokens,
                    workdir: step.workdir.display().to_string(),
                    status: Status::Pending,
                    task_status: None,
                    error_class: None,
                    reason: None,
                    output_json: "null".into(),
                    tokens_spent: 0,
                    epoch,
                })
            })
            .collect()
    }

    /// A step's grant given back unspent: it never started.
    async fn release_step(&self, id: JobId) {
        let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
            child: id,
            spent: arbor_protocol::Amount::ZERO,
            reply
        });
    }

    /// Starts one step whose record is durable; if it cannot, its grant is
    /// released and the run ends failed.
    async fn spawn_step(
        &mut self,
        myself: &ActorRef<RunMsg>,
        step: PlannedStep,
        grant: Grant,
        record_seq: u64,
        context: &str,
    ) {
        let PlannedStep {
            id,
            label,
            agent,
            instruction,
            attempt,
            workdir,
            output_schema,
            left,
            role,
        } = step;
        // I-59: every step has a cap; a loop's time bounds it too.
        let timeout = agent.timeout.unwrap_or(self.ctx.limits.job_timeout);
        let timeout = left.time.map_or(timeout, |t| t.min(timeout));
        // A judge sees its verdict, not the results of the group before.
        let context = if role == Role::Step { context } else { "" };
        let meter = SpentMeter::default();
        let start = JobStart {
            payer: self.payer(myself, &agent, &left),
            ctx: self.ctx.clone(),
            run_ctx: self.run_ctx.clone(),
            lineage: Lineage {
                id,
                run: self.id,
                parent: ParentRef::Run(self.id),
                kind: NodeKind::Step,
                depth: 0,
                attempt,
                label: Some(label.clone()),
                path: Arc::from([label.clone()]),
                key: crate::tape::lineage_key(None, &label, attempt),
                call: None,
            },
            brief: Brief {
                request: format!("{instruction}{context}"),
                max_turns: agent.max_turns.unwrap_or(job::DEFAULT_MAX_TURNS),
                timeout: Some(timeout),
                output_schema,
                require_artifacts: vec![],
            },
            policy: Policy::root(&agent, &self.ctx.limits, &self.ctx.approvals.tools),
            grant,
            workdir,
            parent: myself.get_derived(),
            cancel: self.cancel.child_token(),
            meter: meter.clone(),
            agent: agent.clone(),
            record_seq,
            tool_counts: self.tool_counts.remove(&label).unwrap_or_default(),
            first_call: None,
            model: None,
            peers: self.peers_of(myself, &label),
        };
        let name = format!("arbor-job-{id}");
        match Actor::spawn_linked(Some(name), Job, start, myself.get_cell()).await {
            Ok((actor, _)) => {
                self.steps.insert(
                    id,
                    StepEntry {
                        id,
                        label,
                        attempt,
                        agent: agent.name.clone(),
                        actor: Some(actor),
                        grant,
                        meter,
                        stop_reason: None,
                        envelope: None,
                        role,
                    },
                );
            }
            Err(e) => {
                self.release_step(id).await;
                self.begin_finish(
                    Status::Failed,
                    Some(ErrorClass::Start),
                    format!("step {label} could not start: {e}"),
                );
            }
        }
    }

    fn report_for_dead(&self, actor: ractor::ActorId, why: &str) -> Option<ChildReport> {
        let step = self.steps.values().find(|s| {
            s.actor.as_ref().is_some_and(|a| a.get_id() == actor) && s.envelope.is_none()
        })?;
        Some(ChildReport {
            id: step.id,
            envelope: crate::parent::dead_envelope(
                step.id,
                &step.label,
                step.attempt,
                &step.agent,
                &format!("the step's actor {why} before it reported"),
                step.meter.amount(),
            ),
        })
    }

    /// A step's workdir: its label, and the attempt after the first, so a
    /// step run again after a restart starts clean.
    fn step_workdir(&self, label: &str, attempt: u32) -> std::path::PathBuf {
        let leaf = match attempt {
            1 => label.to_string(),
            n => format!("{label}-{n}"),
        };
        self.ctx.work_root.join(self.id.to_string()).join(leaf)
    }

    fn previous_results(&self) -> String {
        if self.previous.is_empty() {
            return String::new();
        }
        let mut text = String::from("\n\nResults of the previous group:");
        for (label, output) in &self.previous {
            text.push_str(&format!("\n- {label}: {output}"));
        }
        text
    }

    fn stop_step(&mut self, id: JobId, reason: &str, propagated: bool, audit: Option<Record>) {
        if let Some(step) = self.steps.get_mut(&id)
            && step.envelope.is_none()
            && step.stop_reason.is_none()
        {
            step.stop_reason = Some(StopReason::new(reason, propagated).with_audit(audit));
            let Some(actor) = &step.actor else { return };
            let _ = actor.cast(JobMsg::Stop {
                reason: reason.to_string(),
                propagated,
            });
        }
    }

    fn begin_finish(&mut self, status: Status, class: Option<ErrorClass>, reason: String) {
        if self.finish.is_some() {
            return;
        }
        let why = match status {
            Status::Stopped => "its run was stopped",
            _ => "its run ended",
        };
        let running: Vec<JobId> = self
            .steps
            .values()
            .filter(|s| s.envelope.is_none())
            .map(|s| s.id)
            .collect();
        for id in running {
            self.stop_step(id, why, true, None);
        }
        // A wait for a retry or a person ends at once: no attempt starts after this.
        self.retrying.clear();
        self.deciding.clear();
        self.checking.clear();
        for (_, card) in std::mem::take(&mut self.gating) {
            card.cancel();
        }
        self.finish = Some(RunFinish {
            status,
            class,
            reason: Some(reason),
            output: serde_json::Value::Null,
        });
    }

    async fn step_ended(
        &mut self,
        myself: &ActorRef<RunMsg>,
        report: ChildReport,
    ) -> Result<(), ActorProcessingErr> {
        let Some(step) = self.steps.get(&report.id) else {
            return Ok(());
        };
        if step.envelope.is_some() {
            return Ok(());
        }
        // Appended, not committed (I-29): steps that end together share one
        // sync. Their `JobFinished` waits in `ended` until a flush covers
        // it; the next group's admission and the run's own end are commits,
        // which cover every end appended before them.
        let envelope = record_child_end(
            &self.ctx,
            &self.account,
            &mut self.ended,
            ChildEnd {
                id: step.id,
                run: self.id,
                parent: ParentRef::Run(self.id),
                agent: &step.agent,
                kind: NodeKind::Step,
                depth: 0,
                grant_tokens: step.grant.tokens,
                stop: step.stop_reason.as_ref(),
            },
            report.envelope,
        )
        .await?;
        let label = step.label.clone();
        let attempt = step.attempt;
        let stopped = step.stop_reason.is_some();
        let ran = step.agent.clone();
        let role = step.role.clone();
        if let Some(step) = self.steps.get_mut(&report.id) {
            step.envelope = Some(envelope.clone());
        }
        self.release_ended(myself);
        if self.finish.is_some() {
            return Ok(());
        }
        match role {
            Role::Judge(of) => return self.judged(myself, of, envelope).await,
            Role::Review => return self.reviewed(myself, envelope).await,
            Role::Step => {}
        }
        let own = self.step_spec(&label).is_some_and(|s| s.agent == ran);
        if own {
            self.loop_spent(&label, &envelope);
        }
        // A loop's iteration that ended done is checked before the step is.
        if own && envelope.status == Status::Done && self.until(&label).is_some() {
            return self.check_iteration(myself, label, envelope).await;
        }
        let class = envelope.error_class.unwrap_or(ErrorClass::Task);
        if envelope.status == Status::Failed
            && !stopped
            && self.step_spec(&label).is_some_and(|s| {
                // A rescue is not retried as the step's own agent.
                s.agent == ran && s.retry.as_ref().is_some_and(|p| p.retries(attempt, class))
            })
        {
            let wait = RetryWait {
                failed: report.id,
                label,
                attempt: attempt + 1,
                class,
                error: envelope.error.clone().unwrap_or_default(),
                until_ms: None,
            };
            return self.wait_to_retry(myself, wait).await;
        }
        // Its rescuer takes over, once per failure: not a rescue's own.
        if envelope.status == Status::Failed
            && !stopped
            && self
                .step_spec(&label)
                .is_some_and(|s| s.on_fail.is_some() && s.agent == ran)
        {
            let failed = Failed {
                label,
                attempt,
                class,
                error: envelope.error.clone().unwrap_or_default(),
                output: envelope.output.clone(),
                workdir: envelope.workdir.clone(),
            };
            self.rescue_or_fail(myself, failed).await;
            return Ok(());
        }
        if envelope.status != Status::Done && self.is_optional(&label) {
            // Its end does not fail the run; the run says what it lacks.
            let why = envelope.error.clone().unwrap_or_default();
            self.limitations
                .push(arbor_protocol::StepSpec::optional_limitation(
                    &label,
                    envelope.status,
                    &why,
                ));
        } else if envelope.status != Status::Done {
            let why = envelope.error.clone().unwrap_or_default();
            // A stopped step is not a failure of its own: no class is invented for it.
            let class = match envelope.status {
                Status::Stopped => None,
                _ => envelope.error_class.or(Some(ErrorClass::Task)),
            };
            self.begin_finish(
                Status::Failed,
                class,
                format!("step {label} {}: {why}", envelope.status),
            );
            return Ok(());
        }
        self.next_group_if_done(myself).await
    }

    /// Once every step of the group has ended, with no retry, decision or
    /// go-ahead to come, the next group starts (or the run is done).
    async fn next_group_if_done(
        &mut self,
        myself: &ActorRef<RunMsg>,
    ) -> Result<(), ActorProcessingErr> {
        if self.finish.is_none()
            && self.retrying.is_empty()
            && self.deciding.is_empty()
            && self.gating.is_empty()
            && self.checking.is_empty()
            && !self.waiting_to_start()
            && self.steps.values().all(|s| s.envelope.is_some())
        {
            // A review may send this group round again: its next attempts follow these.
            for step in self.steps.values() {
                let latest = self.attempts.entry(step.label.clone()).or_insert(0);
                *latest = (*latest).max(step.attempt);
            }
            let input = std::mem::take(&mut self.previous);
            if self.group + 1 == self.spec.groups.len() {
                self.before_last = input;
            }
            self.previous = self
                .steps
                .values()
                .filter(|s| s.role == Role::Step)
                .filter_map(|s| {
                    s.envelope
                        .as_ref()
                        .map(|e| (s.label.clone(), e.output.clone()))
                })
                .collect();
            self.steps.clear();
            self.group += 1;
            if self.group < self.spec.groups.len() {
                // A group's ends are told before the next group starts.
                self.ended.settle(&self.ctx, self.id).await?;
                self.start_group(myself).await;
            } else {
                self.after_last_group(myself).await;
            }
        }
        Ok(())
    }

    /// The last group has ended: its reviewer (`verify`) reads the result,
    /// unless its review was made; else the run is done.
    async fn after_last_group(&mut self, myself: &ActorRef<RunMsg>) {
        let Some(reviewer) = self.spec.verify.clone().filter(|_| self.review.is_none()) else {
            self.finish_done();
            return;
        };
        let Some(agent) = self.ctx.agent(&reviewer) else {
            self.begin_finish(
                Status::Failed,
                Some(ErrorClass::Start),
                format!("unknown reviewer agent {reviewer:?}"),
            );
            return;
        };
        let label = RunSpec::REVIEW_LABEL.to_string();
        let attempt = self.attempts.get(&label).copied().unwrap_or(0) + 1;
        self.attempts.insert(label.clone(), attempt);
        let instruction = format!(
            "You review the result of a run. It was asked, step by step:\n{request}\n\n\
             Its result:\n{output}\n\nAnswer through your output schema: `accept` true if \
             the result does all that was asked; else false, with each thing that is missing \
             or wrong in `missing`, specific enough to act on.",
            request = self.spec.request(),
            output = self.output(),
        );
        tracing::info!(run = %self.id, reviewer, "the run's reviewer reads its result");
        self.review = Some(Review::Asked);
        let planned = PlannedStep {
            id: JobId::new(),
            workdir: self.step_workdir(&label, attempt),
            label,
            agent,
            instruction,
            attempt,
            output_schema: Some(arbor_protocol::ReviewVerdict::schema()),
            left: checks::Left::default(),
            role: Role::Review,
        };
        self.admit(myself, vec![planned]).await;
    }

    /// The reviewer has answered (or failed): journaled and durable first;
    /// then the run is done, or, with something missing, its last group
    /// runs once more (once). A review that could not be made leaves the
    /// result standing, not reviewed, in the run's limitations.
    async fn reviewed(
        &mut self,
        myself: &ActorRef<RunMsg>,
        answer: ResultEnvelope,
    ) -> Result<(), ActorProcessingErr> {
        let (accept, missing, failed) = match answer.status {
            Status::Done => {
                match serde_json::from_value::<arbor_protocol::ReviewVerdict>(answer.output.clone())
                {
                    Ok(v) => (v.accept, v.missing, None),
                    Err(e) => (
                        false,
                        vec![],
                        Some(format!("its answer is not a review: {e}")),
                    ),
                }
            }
            status => (
                false,
                vec![],
                Some(format!(
                    "reviewer {} {status}: {}",
                    answer.agent,
                    answer.error.clone().unwrap_or_default()
                )),
            ),
        };
        self.ended.settle(&self.ctx, self.id).await?;
        self.ctx.events.emit(
            self.id,
            EventKind::Reviewed {
                id: answer.job,
                accept,
                missing: missing.clone(),
                failed: failed.clone(),
            },
        );
        self.ctx.journal.flush().await?;
        tracing::info!(run = %self.id, accept, missing = missing.len(), failed = failed.as_deref().unwrap_or(""), "the run was reviewed");
        if let Some(why) = failed {
            self.review = Some(Review::Made);
            self.limitations.push(format!("not reviewed: {why}"));
            self.finish_done();
            return Ok(());
        }
        if accept {
            self.review = Some(Review::Made);
            self.finish_done();
            return Ok(());
        }
        let answers = std::mem::take(&mut self.previous);
        self.review = Some(Review::Rerun { missing, answers });
        self.previous = self.before_last.clone();
        self.group = self.spec.groups.len().saturating_sub(1);
        self.steps.clear();
        self.start_group(myself).await;
        Ok(())
    }

    /// A step's request when a review sent its group round once more:
    /// what was missing, and its answer before.
    fn review_request(&self, label: &str, instruction: String) -> String {
        let Some(Review::Rerun { missing, answers }) = &self.review else {
            return instruction;
        };
        let mut text = format!(
            "{instruction}\n\nA reviewer read the run's result and found this missing or wrong:"
        );
        for item in missing {
            text.push_str(&format!("\n- {item}"));
        }
        if let Some((_, answer)) = answers.iter().find(|(l, _)| l == label) {
            text.push_str(&format!("\n\nYour answer before was: {answer}"));
        }
        text
    }

    /// Tells the steps' ends that are durable; asks to be told when the rest are.
    fn release_ended(&mut self, myself: &ActorRef<RunMsg>) {
        let myself = myself.clone();
        self.ended.release(&self.ctx, self.id, move |result| {
            let _ = myself.cast(RunMsg::EndsDurable { result });
        });
    }

    /// The run's output: the last group's answers (one answer, or by label).
    fn output(&self) -> serde_json::Value {
        match self.previous.as_slice() {
            [(_, only)] => only.clone(),
            many => serde_json::Value::Object(
                many.iter().map(|(l, o)| (l.clone(), o.clone())).collect(),
            ),
        }
    }

    /// Every group finished: the run is done, its output the last group's.
    fn finish_done(&mut self) {
        let output = self.output();
        self.finish = Some(RunFinish {
            status: Status::Done,
            class: None,
            reason: None,
            output,
        });
    }

    async fn maybe_complete(
        &mut self,
        myself: &ActorRef<RunMsg>,
    ) -> Result<(), ActorProcessingErr> {
        if self.finish.is_none() || self.steps.values().any(|s| s.envelope.is_none()) {
            return Ok(());
        }
        let finish = self.finish.take().expect("checked above");
        // No card of an ended run stays pending: closed before its end is told.
        if let Some(gate) = self.ctx.gate.get() {
            let _ = ractor::call!(gate, |reply| crate::approvals::GateMsg::RunEnded {
                run: self.id,
                reply
            });
        }
        let view = ractor::call!(self.account, |reply| AccountMsg::Close { reply }).ok();
        let _ = view.map(|v| v.spent()).unwrap_or(self.meter.amount());
        let record = RunRecord {
            id: self.id,
            flow: self.spec.flow.clone(),
            budget_tokens: self.spec.budget_tokens,
            status: finish.status,
            error_class: finish.class,
            reason: finish.reason.clone(),
            output_json: finish.output.to_string(),
            epoch: self.ctx.journal.epoch(),
        };
        let mut records = vec![Record::Run(record)];
        records.append(&mut self.end_audit);
        self.ctx.journal.commit(records).await?;
        // That commit covered every step's end: they are told, before the run's.
        self.ended.settle(&self.ctx, self.id).await?;
        tracing::info!(run = %self.id, status = %finish.status, reason = finish.reason.as_deref().unwrap_or(""), "run ended");
        self.ctx.events.emit(
            self.id,
            EventKind::RunFinished {
                limitations: std::mem::take(&mut self.limitations),
                status: finish.status,
                error_class: finish.class,
                reason: finish.reason,
                output: finish.output,
            },
        );
        myself.stop(None);
        Ok(())
    }
}

/// The recording a replay replays: the caller's, else its run's in the journal.
fn replay_of(
    ctx: &NodeContext,
    spec: &RunSpec,
    carried: &Carried,
) -> Result<Option<Arc<crate::tape::Replay>>, ActorProcessingErr> {
    let Some(spec) = &spec.replay else {
        return Ok(None);
    };
    let tape = match carried.tape.clone() {
        Some(tape) => tape,
        None => Arc::new(crate::tape::tape_of(ctx.journal.tape(spec.of)?)?),
    };
    if tape.is_empty() {
        return Err(format!(
            "run {} has no recording: it was not run with record on",
            spec.of
        )
        .into());
    }
    Ok(Some(crate::tape::Replay::new(spec.clone(), tape)))
}

/// A run's root grant in tokens and micro-dollars: its spec's, or for a
/// resumed run what its ledger adds up to, its opening and every top-up
/// since (I-58) (its spec's if it never opened).
fn root_grant(
    ctx: &NodeContext,
    run: RunId,
    spec: &RunSpec,
    resumed: bool,
) -> Result<(u64, Option<u64>), arbor_storage::Error> {
    use arbor_storage::{LedgerOp, Unit, ledger_totals};
    if !resumed {
        return Ok((spec.budget_tokens, spec.budget_usd_micros));
    }
    let entries = ctx.journal.ledger(ParentRef::Run(run))?;
    let opened = |unit: Unit| {
        entries
            .iter()
            .any(|e| e.unit == unit && matches!(e.op, LedgerOp::Open { .. }))
    };
    let tokens = match opened(Unit::Tokens) {
        true => ledger_totals(&entries, Unit::Tokens).grant,
        false => spec.budget_tokens,
    };
    let usd = match opened(Unit::UsdMicros) {
        true => Some(ledger_totals(&entries, Unit::UsdMicros).grant),
        false => spec.budget_usd_micros,
    };
    Ok((tokens, usd))
}

/// The steps a resumed run keeps: their results, and no actor.
fn kept_steps(kept: &[ResultEnvelope]) -> BTreeMap<JobId, StepEntry> {
    kept.iter()
        .map(|kept| {
            let entry = StepEntry {
                id: kept.job,
                label: kept.label.clone().unwrap_or_default(),
                attempt: kept.attempt,
                agent: kept.agent.clone(),
                actor: None,
                grant: Grant {
                    tokens: 0,
                    usd_micros: None,
                },
                meter: SpentMeter::default(),
                stop_reason: None,
                envelope: Some(kept.clone()),
                role: Role::Step,
            };
            (kept.job, entry)
        })
        .collect()
}

/// Copies the regular files and folders below `from` into `to` (symlinks
/// and the rest passed over); how many files. A failed step's workdir, for
/// its rescuer to read.
fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<u64> {
    if !from.is_dir() {
        return Ok(0);
    }
    std::fs::create_dir_all(to)?;
    let mut files = 0;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            files += copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
            files += 1;
        }
    }
    Ok(files)
}

/// The lower of two caps, either of which may be absent.
fn least(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
