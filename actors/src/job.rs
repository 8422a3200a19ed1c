//! Job: the actor of a step or a delegated job. One agent loop each; the
//! parent of its children, its Account and its Sandbox.
//!
//! Parent: the Run (for a step) or the Job that delegated it. A step is a job
//! whose parent is the run: one lifecycle, one set of rules.
//! Journals: as a parent, each delegation and each child's terminal record
//! (the parent is the only writer of a child's final status, which is what
//! makes I-16 hold: once the parent marked a child stopped, nothing the child
//! sends can become its result).
//!
//! Lifecycle: pending -> running -> done | failed | stopped. A job ends in two
//! phases: `Finishing` (loop over; children told to stop; waiting for each to
//! settle), then its report to the parent and its own stop.
//!
//! Invariants:
//! 1. A job reports to its parent only after every child settled (I-14: its
//!    spent includes theirs) and its processes were killed (I-17).
//! 2. A job that ends stops its running children first (I-18).
//! 3. A refused delegate call changes nothing (I-04, I-06).

use crate::account::{Account, AccountArgs, AccountMsg, Grant, GrantAsk, Share, SpentMeter};
use crate::agent_loop::{self, LoopArgs, LoopEnd, LoopOutcome};
use crate::context::{NodeContext, RunContext};
use crate::policy::Policy;
use crate::run::RunMsg;
use crate::sandbox::{Sandbox, SandboxArgs, SandboxMsg};
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    AgentDef, Amount, DelegateArgs, ErrorClass, EventKind, JobId, NodeKind, OnFailure, ParentRef,
    Refusal, ResultEnvelope, RunId, SandboxMode, Status, TaskStatus, ToolName,
};
use arbor_storage::{DelegationRecord, JobRecord, Record, SteerRecord, SteerState};
use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Turns a job may take when neither its request nor its agent says.
pub const DEFAULT_MAX_TURNS: u32 = 50;
/// How long one `exec` may run when the call does not say.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(120);
/// Delegation keys that start with this are the node's own (a continued job's).
pub const RESERVED_KEY_PREFIX: &str = "arbor:";
/// The most retries a job may ask for (I-23).
pub const MAX_RETRIES: u32 = 2;

pub struct Job;

/// Who a job answers to, and where its lineage comes from (I-02): all set by the spawner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lineage {
    pub id: JobId,
    pub run: RunId,
    pub parent: ParentRef,
    pub kind: NodeKind,
    pub depth: u32,
    pub attempt: u32,
    pub label: Option<String>,
}

/// What the job is asked to do, resolved from the request and the agent.
#[derive(Clone, Debug)]
pub struct Brief {
    pub request: String,
    pub max_turns: u32,
    pub timeout: Option<Duration>,
    pub output_schema: Option<serde_json::Value>,
    pub require_artifacts: Vec<String>,
}

#[derive(Clone)]
pub enum ParentHandle {
    Run(ActorRef<RunMsg>),
    Job(ActorRef<JobMsg>),
}

impl ParentHandle {
    fn report(&self, report: ChildReport) {
        // A parent that is gone has nobody left to tell.
        match self {
            ParentHandle::Run(run) => {
                let _ = run.cast(RunMsg::ChildEnded { report });
            }
            ParentHandle::Job(job) => {
                let _ = job.cast(JobMsg::ChildEnded { report });
            }
        }
    }
}

pub struct JobStart {
    pub ctx: Arc<NodeContext>,
    pub run_ctx: Arc<RunContext>,
    pub lineage: Lineage,
    pub agent: Arc<AgentDef>,
    pub brief: Brief,
    pub policy: Policy,
    pub grant: Grant,
    pub workdir: PathBuf,
    pub parent: ParentHandle,
    /// A child of the parent's token: a stop anywhere above cancels in-flight work here at once.
    pub cancel: CancellationToken,
    pub meter: SpentMeter,
    /// The journal seq of its durable admission record.
    pub record_seq: u64,
}

/// A child's final word to its parent.
#[derive(Clone, Debug)]
pub struct ChildReport {
    pub id: JobId,
    pub envelope: ResultEnvelope,
}

/// What `delegate` returns for each child it started.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChildHandle {
    pub label: String,
    pub id: JobId,
    pub agent: String,
    pub grant_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grant_usd_micros: Option<u64>,
}

pub enum JobMsg {
    // From its own loop.
    Delegate {
        args: DelegateArgs,
        call_id: String,
        reply: RpcReplyPort<Result<Vec<ChildHandle>, Refusal>>,
    },
    Collect {
        children: Vec<String>,
        timeout: Option<Duration>,
        /// A waiting delegate call: children still running at the timeout are stopped.
        stop_on_timeout: bool,
        reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    },
    StopChild {
        child: String,
        reply: RpcReplyPort<Result<String, Refusal>>,
    },
    SendMessage {
        child: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
    TakeSteering {
        turn: u32,
        reply: RpcReplyPort<Vec<String>>,
    },
    LoopEnded {
        outcome: LoopOutcome,
    },
    // From its parent or an operator.
    Steer {
        text: String,
        reply: Option<RpcReplyPort<Result<u64, Refusal>>>,
    },
    Stop {
        reason: String,
        propagated: bool,
    },
    /// An operator stops one of this job's children by id.
    StopChildById {
        id: JobId,
        reason: String,
    },
    // From its children and timers.
    ChildEnded {
        report: ChildReport,
    },
    /// A child's actor ended; if it never reported, it failed.
    ChildGone {
        actor: ractor::ActorId,
        why: String,
    },
    WaitTimedOut {
        waiter: u64,
    },
    TimedOut,
}

impl Actor for Job {
    type Msg = JobMsg;
    type State = JobState;
    type Arguments = JobStart;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        start: JobStart,
    ) -> Result<Self::State, ActorProcessingErr> {
        let cell = myself.get_cell();
        let lineage = start.lineage.clone();
        let ctx = start.ctx.clone();
        // Checked before anything is made, so a job that cannot get its model
        // leaves nothing behind (I-06).
        let model = ctx.models.model_for(&start.agent)?;
        // I-27: a secret without a value refuses the job before anything is made.
        let env = ctx.secrets.env_for(&start.policy.secrets)?;
        let workdir_existed = start.workdir.exists();
        let setup = async {
            let (account, _) = Actor::spawn_linked(
                None,
                Account,
                AccountArgs {
                    ctx: ctx.clone(),
                    run: lineage.run,
                    owner: ParentRef::Job(lineage.id),
                    grant: start.grant.tokens,
                    grant_usd: start.grant.usd,
                    wind_down: ctx.limits.wind_down,
                    meter: start.meter.clone(),
                    resume_spent: None,
                },
                cell.clone(),
            )
            .await?;
            let sandbox = Actor::spawn_linked(
                None,
                Sandbox,
                SandboxArgs {
                    record: Some(crate::sandbox::GroupRecorder {
                        journal: ctx.journal.clone(),
                        run: lineage.run,
                        job: lineage.id,
                    }),
                    workdir: start.workdir.clone(),
                    cancel: start.cancel.clone(),
                    exec_timeout: DEFAULT_EXEC_TIMEOUT,
                    resources: start.agent.resources,
                    network: start.policy.network,
                    posture: ctx.sandbox.clone(),
                    runs_commands: start.policy.allowed.contains(&ToolName::Exec)
                        && !start.policy.denied.contains(ToolName::Exec.as_str()),
                    env,
                    secrets: ctx.secrets.clone(),
                    roots: Some(ctx.sandbox_roots.clone()),
                },
                cell.clone(),
            )
            .await;
            match sandbox {
                Ok((sandbox, _)) => Ok((account, sandbox)),
                Err(e) => {
                    account.stop(None);
                    Err(e)
                }
            }
        };
        let (account, sandbox) = match setup.await {
            Ok(pair) => pair,
            Err(e) => {
                // I-06: a failed start leaves no workdir behind.
                if !workdir_existed {
                    let _ = std::fs::remove_dir_all(&start.workdir);
                    // The `jobs/` folder too, if this child was its first.
                    if let Some(parent) = start.workdir.parent() {
                        let _ = std::fs::remove_dir(parent);
                    }
                }
                return Err(e.into());
            }
        };
        ctx.events.emit(
            lineage.run,
            EventKind::NodeSpawned {
                id: lineage.id,
                parent: lineage.parent,
                kind: lineage.kind,
                agent: start.agent.name.clone(),
                label: lineage.label.clone(),
                depth: lineage.depth,
                attempt: lineage.attempt,
                grant_tokens: start.grant.tokens,
                grant_usd_micros: start.grant.usd,
                workdir: start.workdir.display().to_string(),
                record_seq: start.record_seq,
                request: start.brief.request.clone(),
            },
        );
        let offered = start
            .policy
            .offered(&start.agent, lineage.kind, lineage.depth, &ctx.limits);
        Ok(JobState {
            ctx,
            run_ctx: start.run_ctx,
            lineage,
            agent: start.agent,
            brief: start.brief,
            policy: start.policy,
            offered,
            grant: start.grant,
            workdir: start.workdir,
            parent: start.parent,
            _cancel_on_drop: start.cancel.clone().drop_guard(),
            cancel: start.cancel,
            meter: start.meter,
            account,
            sandbox,
            model: Some(model),
            loop_task: None,
            in_flight: Default::default(),
            children: Children::default(),
            steering: VecDeque::new(),
            next_message_id: 1,
            turns: 0,
            finish: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.journal_self(Status::Running)?;
        state.ctx.events.emit(
            state.lineage.run,
            EventKind::NodeRunning {
                id: state.lineage.id,
            },
        );
        tracing::info!(
            run = %state.lineage.run,
            job = %state.lineage.id,
            agent = %state.agent.name,
            depth = state.lineage.depth,
            attempt = state.lineage.attempt,
            grant = state.grant.tokens,
            "job started"
        );
        if let Some(timeout) = state.brief.timeout {
            myself.send_after(timeout, || JobMsg::TimedOut);
        }
        state.start_loop(myself);
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.cancel.cancel();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            JobMsg::Delegate {
                args,
                call_id,
                reply,
            } => {
                let result = state.delegate(&myself, args, &call_id).await;
                let _ = reply.send(result);
            }
            JobMsg::Collect {
                children,
                timeout,
                stop_on_timeout,
                reply,
            } => state.collect(&myself, children, timeout, stop_on_timeout, reply),
            JobMsg::StopChild { child, reply } => {
                let result = state.children.resolve(&child).and_then(|label| {
                    state.stop_child_label(&label, "stopped by its parent", false)
                });
                let _ = reply.send(result);
            }
            JobMsg::StopChildById { id, reason } => {
                if let Some(label) = state.children.by_id.get(&id).map(|c| c.label.clone()) {
                    let _ = state.stop_child_label(&label, &reason, false);
                }
            }
            JobMsg::SendMessage { child, text, reply } => state.send_message(child, text, reply),
            JobMsg::TakeSteering { turn, reply } => {
                let texts = state.deliver_steering(turn);
                let _ = reply.send(texts);
            }
            JobMsg::Steer { text, reply } => state.queue_steering(text, reply),
            JobMsg::LoopEnded { outcome } => {
                state.loop_task = None;
                if state.finish.is_none() {
                    let finish = state.finish_from_loop(outcome).await;
                    state.begin_finish(finish);
                }
                state.maybe_complete(&myself).await?;
            }
            JobMsg::Stop { reason, propagated } => {
                state.abort_loop();
                if state.finish.is_none() {
                    state.begin_finish(Finish::stopped(reason, propagated, state.turns));
                }
                state.maybe_complete(&myself).await?;
            }
            JobMsg::TimedOut => {
                if state.finish.is_none() {
                    state.abort_loop();
                    let timeout = state.brief.timeout.unwrap_or_default();
                    let reason = format!("timed out after {}", humantime::format_duration(timeout));
                    state.begin_finish(Finish::failed(ErrorClass::Timeout, reason, state.turns));
                    state.maybe_complete(&myself).await?;
                }
            }
            JobMsg::ChildEnded { report } => {
                state.child_ended(&myself, report).await?;
                state.maybe_complete(&myself).await?;
            }
            JobMsg::ChildGone { actor, why } => {
                if let Some(report) = state.children.report_for_dead(actor, &why) {
                    state.child_ended(&myself, report).await?;
                    state.maybe_complete(&myself).await?;
                }
            }
            JobMsg::WaitTimedOut { waiter } => state.wait_timed_out(waiter),
        }
        Ok(())
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
        if cell.get_id() == state.account.get_id() || cell.get_id() == state.sandbox.get_id() {
            if state.finish.is_none() {
                state.abort_loop();
                let reason = format!("its account or sandbox actor {why}");
                state.begin_finish(Finish::failed(ErrorClass::Panicked, reason, state.turns));
            }
            state.maybe_complete(&myself).await?;
            return Ok(());
        }
        // A child that died without reporting (a panic in its handler, I-38)
        // is settled at what its account had spent. Supervision events jump
        // the mailbox, so a report the child sent just before it stopped is
        // still queued: look again after it, as a message.
        if state.children.has_unsettled_actor(cell.get_id()) {
            let _ = myself.cast(JobMsg::ChildGone {
                actor: cell.get_id(),
                why,
            });
        }
        Ok(())
    }
}

/// How the job will end, decided once.
#[derive(Clone, Debug)]
struct Finish {
    status: Status,
    task_status: Option<TaskStatus>,
    error_class: Option<ErrorClass>,
    reason: Option<String>,
    output: serde_json::Value,
    error: Option<String>,
    limitations: Vec<String>,
    turns: u32,
}

impl Finish {
    fn stopped(reason: String, propagated: bool, turns: u32) -> Self {
        let reason = if propagated {
            format!("{reason} (propagated)")
        } else {
            reason
        };
        Self {
            status: Status::Stopped,
            task_status: None,
            error_class: None,
            reason: Some(reason),
            output: serde_json::Value::Null,
            error: None,
            limitations: vec![],
            turns,
        }
    }

    fn failed(class: ErrorClass, reason: String, turns: u32) -> Self {
        Self {
            status: Status::Failed,
            task_status: Some(TaskStatus::Failed),
            error_class: Some(class),
            reason: Some(reason.clone()),
            output: serde_json::Value::Null,
            error: Some(reason),
            limitations: vec![],
            turns,
        }
    }
}

pub struct JobState {
    ctx: Arc<NodeContext>,
    run_ctx: Arc<RunContext>,
    lineage: Lineage,
    agent: Arc<AgentDef>,
    brief: Brief,
    policy: Policy,
    offered: BTreeMap<ToolName, Result<(), String>>,
    grant: Grant,
    workdir: PathBuf,
    parent: ParentHandle,
    cancel: CancellationToken,
    /// Cancels the subtree's in-flight work even when ractor kills this actor
    /// and skips post_stop: the state is dropped either way.
    _cancel_on_drop: DropGuard,
    meter: SpentMeter,
    account: ActorRef<AccountMsg>,
    sandbox: ActorRef<SandboxMsg>,
    model: Option<Arc<dyn crate::model::Model>>,
    loop_task: Option<AbortOnDrop>,
    /// The loop's model call in flight, settled here if an abort cuts it short.
    in_flight: agent_loop::InFlightSlot,
    children: Children,
    steering: VecDeque<(u64, String)>,
    next_message_id: u64,
    turns: u32,
    finish: Option<Finish>,
}

/// Aborts the loop task when dropped, so a killed job leaves no loop running.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl JobState {
    fn start_loop(&mut self, myself: ActorRef<JobMsg>) {
        let Some(model) = self.model.take() else {
            return;
        };
        let args = LoopArgs {
            ctx: self.ctx.clone(),
            run: self.lineage.run,
            id: self.lineage.id,
            job: myself.clone(),
            account: self.account.clone(),
            sandbox: self.sandbox.clone(),
            model,
            agent: self.agent.clone(),
            offered: self.offered.clone(),
            request: self.brief.request.clone(),
            max_turns: self.brief.max_turns,
            cancel: self.cancel.clone(),
            in_flight: self.in_flight.clone(),
        };
        let handle = tokio::spawn(async move {
            let outcome = match AssertUnwindSafe(agent_loop::run(args)).catch_unwind().await {
                Ok(outcome) => outcome,
                Err(panic) => LoopOutcome::failed(
                    ErrorClass::Panicked,
                    format!(
                        "the agent loop panicked: {}",
                        agent_loop::panic_message(&panic)
                    ),
                    0,
                ),
            };
            let _ = myself.cast(JobMsg::LoopEnded { outcome });
        });
        self.loop_task = Some(AbortOnDrop(handle.abort_handle()));
    }

    fn abort_loop(&mut self) {
        self.cancel.cancel();
        self.loop_task = None;
    }

    /// The terminal status the loop's outcome earns, after the machine checks (I-22).
    async fn finish_from_loop(&mut self, outcome: LoopOutcome) -> Finish {
        self.turns = outcome.turns;
        if outcome.end == LoopEnd::Failed {
            let (class, message) = outcome
                .error
                .clone()
                .unwrap_or((ErrorClass::Model, "the loop failed".into()));
            let mut f = Finish::failed(class, message, outcome.turns);
            f.limitations = outcome.limitations;
            return f;
        }
        // I-13: a step that cannot pay for its next call failed the run's ceiling.
        if outcome.end == LoopEnd::BudgetExhausted && self.lineage.kind == NodeKind::Step {
            let why = outcome.error.clone().map(|e| e.1).unwrap_or_default();
            let mut f = Finish::failed(ErrorClass::BudgetExhausted, why, outcome.turns);
            f.output = outcome.output;
            f.limitations = outcome.limitations;
            return f;
        }
        let schema_error = self
            .brief
            .output_schema
            .as_ref()
            .and_then(|schema| check_schema(schema, &outcome.output).err());
        let artifacts = ractor::call!(self.sandbox, |reply| SandboxMsg::Artifacts { reply })
            .unwrap_or_default();
        let missing = missing_artifacts(&self.brief.require_artifacts, &artifacts);
        // I-13, I-22: files it wrote are work it produced, as text is.
        let mut outcome = outcome;
        outcome.produced |= !artifacts.is_empty();
        let (task_status, notes) = agent_loop::grade(&outcome, schema_error.as_deref(), &missing);
        let mut limitations = outcome.limitations.clone();
        limitations.extend(notes.iter().cloned());
        let failed = task_status == TaskStatus::Failed;
        let error_class = match outcome.end {
            LoopEnd::BudgetExhausted => Some(ErrorClass::BudgetExhausted),
            _ if failed => Some(ErrorClass::Task),
            _ => None,
        };
        Finish {
            status: if failed { Status::Failed } else { Status::Done },
            task_status: Some(task_status),
            error_class,
            reason: if failed {
                notes
                    .first()
                    .cloned()
                    .or_else(|| outcome.error.clone().map(|e| e.1))
            } else {
                None
            },
            output: outcome.output,
            error: if failed {
                Some(notes.join("; "))
                    .filter(|s| !s.is_empty())
                    .or(outcome.error.map(|e| e.1))
            } else {
                None
            },
            limitations,
            turns: outcome.turns,
        }
    }

    /// Enters the finishing phase: queued steering is discarded (I-20) and
    /// every running child is told to stop (I-18).
    fn begin_finish(&mut self, finish: Finish) {
        let reason = match finish.status {
            Status::Stopped => "its parent was stopped",
            _ => "its parent ended",
        };
        self.finish = Some(finish);
        for (id, text) in std::mem::take(&mut self.steering) {
            self.journal_steer(id, &text, SteerState::Discarded);
            self.ctx.events.emit(
                self.lineage.run,
                EventKind::SteerDiscarded {
                    id: self.lineage.id,
                    message_id: id,
                },
            );
        }
        for label in self.children.running_labels() {
            let _ = self.stop_child_label(&label, reason, true);
        }
        self.children.cancel_retries();
    }

    /// Once every child has settled: kill the sandbox's processes, close the
    /// account, report to the parent and stop.
    async fn maybe_complete(
        &mut self,
        myself: &ActorRef<JobMsg>,
    ) -> Result<(), ActorProcessingErr> {
        let Some(finish) = self.finish.clone() else {
            return Ok(());
        };
        // Every path into `finish` has already ended the loop.
        if !self.children.all_settled() {
            return Ok(());
        }
        self.abort_loop();
        // A call the abort cut short is charged what it may have cost (I-16:
        // its answer is dropped, its spend is not).
        if let Some(call) = agent_loop::take_in_flight(&self.in_flight) {
            agent_loop::settle_cut(&self.account, self.lineage.id, call, "stopped").await;
        }
        let artifacts = ractor::call!(self.sandbox, |reply| SandboxMsg::Artifacts { reply })
            .unwrap_or_default();
        let _ = ractor::call!(self.sandbox, |reply| SandboxMsg::KillAll { reply });
        let spent = match ractor::call!(self.account, |reply| AccountMsg::Close { reply }) {
            Ok(closed) => closed.spent(),
            Err(_) => self.meter.amount(),
        };
        let envelope = ResultEnvelope {
            job: self.lineage.id,
            label: self.lineage.label.clone(),
            attempt: self.lineage.attempt,
            agent: self.agent.name.clone(),
            status: finish.status,
            task_status: finish.task_status,
            output: finish.output.clone(),
            error: finish.error.clone().or(finish
                .reason
                .clone()
                .filter(|_| finish.status != Status::Done)),
            error_class: finish.error_class,
            limitations: finish.limitations.clone(),
            artifacts,
            tokens_spent: spent.tokens,
            usd_micros_spent: spent.usd_micros,
            turns: finish.turns.max(self.turns),
            workdir: self.workdir.display().to_string(),
        };
        tracing::info!(
            run = %self.lineage.run,
            job = %self.lineage.id,
            status = %envelope.status,
            spent = envelope.tokens_spent,
            reason = envelope.error.as_deref().unwrap_or(""),
            "job ended"
        );
        self.parent.report(ChildReport {
            id: self.lineage.id,
            envelope,
        });
        myself.stop(None);
        Ok(())
    }

    /// Appended, not committed: nothing outside acts on "running". The job's
    /// first act outside (a model call's reservation, a delegation's
    /// admission) commits after it, and its parent commits its terminal
    /// record, so it is durable before either.
    fn journal_self(&self, status: Status) -> Result<(), ActorProcessingErr> {
        let record = JobRecord {
            id: self.lineage.id,
            run: self.lineage.run,
            parent: self.lineage.parent,
            kind: self.lineage.kind,
            agent: self.agent.name.clone(),
            label: self.lineage.label.clone(),
            depth: self.lineage.depth,
            attempt: self.lineage.attempt,
            grant_tokens: self.grant.tokens,
            workdir: self.workdir.display().to_string(),
            status,
            task_status: None,
            error_class: None,
            reason: None,
            output_json: "null".into(),
            tokens_spent: 0,
            epoch: self.ctx.journal.epoch(),
        };
        self.ctx.journal.append(vec![Record::Job(record)])?;
        Ok(())
    }

    fn journal_steer(&self, message_id: u64, text: &str, state: SteerState) {
        let _ = self.ctx.journal.append(vec![Record::Steer(SteerRecord {
            job: self.lineage.id,
            message_id,
            text: text.to_string(),
            state,
            epoch: self.ctx.journal.epoch(),
        })]);
    }

    // ---- steering (I-20) ----

    /// Queues a message; it is durable before the sender hears "queued".
    ///
    /// The job does not wait for that itself: the record is appended, the
    /// message queued, and a task answers the sender once a flush covers it,
    /// so many messages arriving together share one flush. Nothing acts on a
    /// queued message before then: it reaches the model only in a turn, and
    /// a turn's request goes out after its reservation's commit, which covers
    /// this record too. If the journal fails instead, that commit fails as
    /// well and the message never reaches the model.
    fn queue_steering(&mut self, text: String, reply: Option<RpcReplyPort<Result<u64, Refusal>>>) {
        let answer = |result| {
            if let Some(reply) = reply {
                let _ = reply.send(result);
            }
        };
        if let Some(finish) = &self.finish {
            return answer(Err(Refusal::ChildEnded {
                child: self.lineage.id.to_string(),
                status: format!("ending as {}", finish.status),
            }));
        }
        let journaled = |e: arbor_storage::Error| Refusal::Invalid {
            message: format!("the message could not be journaled: {e}"),
        };
        let id = self.next_message_id;
        let record = Record::Steer(SteerRecord {
            job: self.lineage.id,
            message_id: id,
            text: text.clone(),
            state: SteerState::Queued,
            epoch: self.ctx.journal.epoch(),
        });
        let seq = match self.ctx.journal.append(vec![record]) {
            Ok(seq) => seq,
            Err(e) => return answer(Err(journaled(e))),
        };
        self.next_message_id += 1;
        self.steering.push_back((id, text));
        self.ctx.events.emit(
            self.lineage.run,
            EventKind::SteerQueued {
                id: self.lineage.id,
                message_id: id,
            },
        );
        let journal = self.ctx.journal.clone();
        tokio::spawn(async move {
            answer(
                journal
                    .wait_durable(seq)
                    .await
                    .map(|()| id)
                    .map_err(journaled),
            );
        });
    }

    fn deliver_steering(&mut self, turn: u32) -> Vec<String> {
        let mut texts = vec![];
        while let Some((id, text)) = self.steering.pop_front() {
            self.journal_steer(id, &text, SteerState::Delivered);
            self.ctx.events.emit(
                self.lineage.run,
                EventKind::SteerDelivered {
                    id: self.lineage.id,
                    message_id: id,
                    turn,
                },
            );
            texts.push(text);
        }
        texts
    }

    fn send_message(
        &mut self,
        child: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    ) {
        let entry = self.children.resolve(&child).and_then(|label| {
            self.children
                .latest(&label)
                .cloned()
                .ok_or(Refusal::UnknownChild {
                    child: child.clone(),
                    known: String::new(),
                })
        });
        match entry {
            Err(refusal) => {
                let _ = reply.send(Err(refusal));
            }
            Ok(entry) if entry.state != ChildState::Running => {
                let _ = reply.send(Err(Refusal::ChildEnded {
                    child,
                    status: entry.status_word(),
                }));
            }
            Ok(entry) => {
                // The child answers the loop itself: this mailbox never waits on a child.
                if entry
                    .actor
                    .cast(JobMsg::Steer {
                        text,
                        reply: Some(reply),
                    })
                    .is_err()
                {
                    // The port went with the failed message; the loop sees the call fail.
                }
            }
        }
    }

    // ---- delegation ----

    async fn delegate(
        &mut self,
        myself: &ActorRef<JobMsg>,
        args: DelegateArgs,
        call_id: &str,
    ) -> Result<Vec<ChildHandle>, Refusal> {
        if self.finish.is_some() {
            return Err(Refusal::Stopping);
        }
        let limits = &self.ctx.limits;
        if self.lineage.depth >= limits.depth {
            return Err(Refusal::DepthCap {
                depth: self.lineage.depth,
                cap: limits.depth,
            });
        }
        let asked = args.jobs.len() as u32;
        if asked == 0 {
            return Err(Refusal::BadArguments {
                tool: "delegate".into(),
                message: "jobs is empty".into(),
            });
        }
        if asked > limits.fan_out {
            return Err(Refusal::FanOutCap {
                asked,
                cap: limits.fan_out,
            });
        }
        let running = self.children.running_count();
        if running + asked > limits.running_children {
            return Err(Refusal::RunningChildrenCap {
                running,
                asked,
                cap: limits.running_children,
            });
        }
        // I-32: the same key and request again returns the jobs it started.
        let key = match &args.key {
            Some(k)
                if k.trim().is_empty() || k.len() > 200 || k.starts_with(RESERVED_KEY_PREFIX) =>
            {
                return Err(Refusal::BadArguments {
                    tool: "delegate".into(),
                    message: format!(
                        "key must be 1 to 200 characters and not start with {RESERVED_KEY_PREFIX:?}"
                    ),
                });
            }
            Some(k) => k.clone(),
            None => format!("{}:{call_id}", self.lineage.id),
        };
        let digest = delegation_digest(&args);
        if let Some(existing) = self.existing_delegation(&key, &digest)? {
            return Ok(existing);
        }
        let group = self.children.groups.len();
        let mut planned = Vec::with_capacity(args.jobs.len());
        for (i, job) in args.jobs.iter().enumerate() {
            let plan = self.plan_child(job, i, &planned, args.wait, group)?;
            planned.push(plan);
        }
        self.run_ctx.count_spawns(planned.len() as u64)?;
        tracing::debug!(run = %self.lineage.run, job = %self.lineage.id, children = planned.len(), "delegation admitted by the caps");
        let result = self.admit(myself, planned, &key, &digest).await;
        match result {
            Ok(handles) => {
                self.children.groups.push(FanOut {
                    on_failure: args.on_failure,
                });
                Ok(handles)
            }
            Err((refusal, unstarted)) => {
                self.run_ctx.uncount_spawns(unstarted);
                Err(refusal)
            }
        }
    }

    /// The handles of a delegation already made under `key`, if its request
    /// was the same; a conflict if it was not; None if the key is new.
    fn existing_delegation(
        &self,
        key: &str,
        digest: &str,
    ) -> Result<Option<Vec<ChildHandle>>, Refusal> {
        let records =
            self.ctx
                .journal
                .delegations(self.lineage.id)
                .map_err(|e| Refusal::Invalid {
                    message: format!("the journal could not be read: {e}"),
                })?;
        let Some(record) = records.into_iter().find(|d| d.key == key) else {
            return Ok(None);
        };
        if record.digest != digest {
            return Err(Refusal::KeyConflict {
                key: key.to_string(),
            });
        }
        let handles = record
            .children
            .iter()
            .filter_map(|id| self.children.by_id.get(id))
            .map(|c| ChildHandle {
                label: c.label.clone(),
                id: c.id,
                agent: c.agent.clone(),
                grant_tokens: c.grant.tokens,
                grant_usd_micros: c.grant.usd,
            })
            .collect();
        Ok(Some(handles))
    }

    /// Checks one job of a delegate call and resolves it; pure but for lookups.
    fn plan_child(
        &self,
        job: &arbor_protocol::JobArgs,
        index: usize,
        planned: &[PlannedChild],
        wait: bool,
        group: usize,
    ) -> Result<PlannedChild, Refusal> {
        let bad = |message: String| Refusal::BadArguments {
            tool: "delegate".into(),
            message: format!("jobs[{index}]: {message}"),
        };
        if !self.agent.subagents.iter().any(|s| s == &job.agent) {
            return Err(Refusal::NotASubagent {
                agent: job.agent.clone(),
                parent: self.agent.name.clone(),
                allowed: self.agent.subagents.join(", "),
            });
        }
        let Some(agent) = self.ctx.agent(&job.agent) else {
            return Err(bad(format!("no agent {:?} on this node", job.agent)));
        };
        if job.request.trim().is_empty() {
            return Err(bad("request is empty".into()));
        }
        let label = match &job.label {
            Some(l) => {
                if l.trim().is_empty() || l.len() > 64 || l.contains('/') {
                    return Err(bad(format!(
                        "label {l:?} must be 1 to 64 characters without `/`"
                    )));
                }
                l.clone()
            }
            None => self.children.auto_label(&job.agent, planned.len()),
        };
        if self.children.latest.contains_key(&label) || planned.iter().any(|p| p.label == label) {
            return Err(Refusal::DuplicateLabel { label });
        }
        let budget_refused = |message: String| Refusal::Budget {
            message: format!("jobs[{index}]: {message}"),
        };
        let (asked, asked_usd) = match &job.budget {
            Some(b) => (
                b.tokens().map_err(budget_refused)?,
                b.usd_micros().map_err(budget_refused)?,
            ),
            None => (None, None),
        };
        let max_turns = match job.max_turns {
            Some(n) if !(1..=10_000).contains(&n) => {
                return Err(bad(format!("max_turns must be 1 to 10000, got {n}")));
            }
            Some(n) => n as u32,
            None => agent.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        };
        let timeout = parse_duration_arg("timeout", job.timeout.as_deref())
            .map_err(bad)?
            .or(agent.timeout);
        let retries = match job.retries {
            None => 0,
            Some(n) if n < 0 => {
                return Err(bad(format!("retries must be 0 to {MAX_RETRIES}, got {n}")));
            }
            Some(n) => (n as u32).min(MAX_RETRIES),
        };
        if retries > 0 && !wait {
            return Err(bad(
                "retries need wait = true: a job is retried only while its caller waits".into(),
            ));
        }
        if let Some(schema) = &job.output_schema {
            jsonschema::validator_for(schema)
                .map_err(|e| bad(format!("output_schema is not a valid JSON Schema: {e}")))?;
        }
        for pattern in &job.require_artifacts {
            glob::Pattern::new(pattern)
                .map_err(|e| bad(format!("require_artifacts {pattern:?}: {e}")))?;
        }
        let policy = self.policy.narrow(&agent, &job.deny);
        Ok(PlannedChild {
            id: JobId::new(),
            label,
            asked,
            asked_usd,
            brief: Brief {
                request: job.request.clone(),
                max_turns,
                timeout,
                output_schema: job.output_schema.clone(),
                require_artifacts: job.require_artifacts.clone(),
            },
            policy,
            agent,
            retries,
            attempt: 1,
            group,
        })
    }

    /// Reserves every grant in one message, journals the delegation, starts
    /// the children. Returns the refusal and how many spawns never started.
    async fn admit(
        &mut self,
        myself: &ActorRef<JobMsg>,
        planned: Vec<PlannedChild>,
        key: &str,
        digest: &str,
    ) -> Result<Vec<ChildHandle>, (Refusal, u64)> {
        let total = planned.len() as u64;
        let asks: Vec<GrantAsk> = planned
            .iter()
            .map(|p| GrantAsk {
                child: p.id,
                agent: p.agent.name.clone(),
                asked: p.asked,
                agent_max: p.agent.budget_tokens,
                asked_usd: p.asked_usd,
                agent_max_usd: p.agent.budget_usd_micros,
            })
            .collect();
        let share = Share::Fraction(self.ctx.limits.grant_fraction);
        let grants = match ractor::call!(self.account, |reply| AccountMsg::Reserve {
            asks,
            share,
            reply
        }) {
            Ok(Ok(grants)) => grants,
            Ok(Err(refusal)) => return Err((refusal, total)),
            Err(e) => {
                return Err((
                    Refusal::Invalid {
                        message: format!("the account did not answer: {e}"),
                    },
                    total,
                ));
            }
        };
        // I-29: the delegation and its jobs are durable before any child starts.
        let epoch = self.ctx.journal.epoch();
        let mut records = vec![Record::Delegation(DelegationRecord {
            parent: self.lineage.id,
            key: key.to_string(),
            digest: digest.to_string(),
            children: planned.iter().map(|p| p.id).collect(),
            epoch,
        })];
        for (plan, grant) in planned.iter().zip(&grants) {
            records.push(Record::Job(self.child_record(
                plan,
                *grant,
                Status::Pending,
            )));
        }
        let record_seq = match self.ctx.journal.commit(records).await {
            Ok(seq) => seq,
            Err(e) => {
                for (plan, _) in planned.iter().zip(&grants) {
                    let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                        child: plan.id,
                        spent: Amount::ZERO,
                        reply
                    });
                }
                return Err((
                    Refusal::Invalid {
                        message: format!("the journal could not record the delegation: {e}"),
                    },
                    total,
                ));
            }
        };
        let mut handles = vec![];
        let mut unstarted = 0;
        let mut first_failure = None;
        for (plan, grant) in planned.into_iter().zip(grants) {
            match self.spawn_child(myself, &plan, grant, record_seq).await {
                Ok(handle) => handles.push(handle),
                Err(why) => {
                    unstarted += 1;
                    first_failure.get_or_insert(why);
                }
            }
        }
        if let Some(why) = first_failure {
            if handles.is_empty() {
                return Err((Refusal::Invalid { message: why }, unstarted));
            }
            self.run_ctx.uncount_spawns(unstarted);
        }
        Ok(handles)
    }

    fn child_record(&self, plan: &PlannedChild, grant: Grant, status: Status) -> JobRecord {
        JobRecord {
            id: plan.id,
            run: self.lineage.run,
            parent: ParentRef::Job(self.lineage.id),
            kind: NodeKind::Job,
            agent: plan.agent.name.clone(),
            label: Some(plan.label.clone()),
            depth: self.lineage.depth + 1,
            attempt: plan.attempt,
            grant_tokens: grant.tokens,
            workdir: self.child_workdir(plan).display().to_string(),
            status,
            task_status: None,
            error_class: None,
            reason: None,
            output_json: "null".into(),
            tokens_spent: 0,
            epoch: self.ctx.journal.epoch(),
        }
    }

    fn child_workdir(&self, plan: &PlannedChild) -> PathBuf {
        let leaf = format!("{}-{}", plan.label, plan.attempt);
        match plan.agent.sandbox {
            // I-28: a job's default workdir is its own: a fresh folder below the parent's.
            SandboxMode::Shared => self.workdir.join("jobs").join(leaf),
            SandboxMode::Own => self
                .ctx
                .work_root
                .join(self.lineage.run.to_string())
                .join("own")
                .join(plan.id.to_string()),
        }
    }

    /// Starts one admitted child. On failure its hold is released and its
    /// record marked failed, so nothing is left running or held (I-06).
    async fn spawn_child(
        &mut self,
        myself: &ActorRef<JobMsg>,
        plan: &PlannedChild,
        grant: Grant,
        record_seq: u64,
    ) -> Result<ChildHandle, String> {
        let meter = SpentMeter::default();
        let start = JobStart {
            ctx: self.ctx.clone(),
            run_ctx: self.run_ctx.clone(),
            lineage: Lineage {
                id: plan.id,
                run: self.lineage.run,
                parent: ParentRef::Job(self.lineage.id),
                kind: NodeKind::Job,
                depth: self.lineage.depth + 1,
                attempt: plan.attempt,
                label: Some(plan.label.clone()),
            },
            agent: plan.agent.clone(),
            brief: plan.brief.clone(),
            policy: plan.policy.clone(),
            grant,
            workdir: self.child_workdir(plan),
            parent: ParentHandle::Job(myself.clone()),
            cancel: self.cancel.child_token(),
            meter: meter.clone(),
            record_seq,
        };
        let name = format!("arbor-job-{}", plan.id);
        match Actor::spawn_linked(Some(name), Job, start, myself.get_cell()).await {
            Ok((actor, _)) => {
                self.children.insert(ChildEntry {
                    id: plan.id,
                    label: plan.label.clone(),
                    agent: plan.agent.name.clone(),
                    attempt: plan.attempt,
                    actor,
                    grant,
                    meter,
                    state: ChildState::Running,
                    stop_reason: None,
                    envelope: None,
                    plan: plan.clone(),
                    retries_left: plan.retries,
                    collected: false,
                });
                Ok(ChildHandle {
                    label: plan.label.clone(),
                    id: plan.id,
                    agent: plan.agent.name.clone(),
                    grant_tokens: grant.tokens,
                    grant_usd_micros: grant.usd,
                })
            }
            Err(e) => {
                let why = format!("{} could not start: {e}", plan.label);
                let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                    child: plan.id,
                    spent: Amount::ZERO,
                    reply
                });
                let mut record = self.child_record(plan, grant, Status::Failed);
                record.error_class = Some(ErrorClass::Start);
                record.reason = Some(why.clone());
                let _ = self.ctx.journal.commit(vec![Record::Job(record)]).await;
                self.ctx.events.emit(
                    self.lineage.run,
                    EventKind::Refused {
                        id: self.lineage.id,
                        tool: "delegate".into(),
                        refusal: Refusal::Invalid {
                            message: why.clone(),
                        },
                    },
                );
                Err(why)
            }
        }
    }

    // ---- stopping, collecting, settling ----

    fn stop_child_label(
        &mut self,
        label: &str,
        reason: &str,
        propagated: bool,
    ) -> Result<String, Refusal> {
        let Some(entry) = self.children.latest_mut(label) else {
            return Err(Refusal::UnknownChild {
                child: label.to_string(),
                known: self.children.known(),
            });
        };
        // Stopping any attempt cancels the chain (I-23).
        entry.retries_left = 0;
        match entry.state {
            ChildState::Running => {
                entry.state = ChildState::Stopping;
                entry.stop_reason = Some((reason.to_string(), propagated));
                let _ = entry.actor.cast(JobMsg::Stop {
                    reason: reason.to_string(),
                    propagated,
                });
                Ok(format!("{label} is stopping"))
            }
            ChildState::Stopping => Ok(format!("{label} is already stopping")),
            ChildState::Settled => Err(Refusal::ChildEnded {
                child: label.to_string(),
                status: entry.status_word(),
            }),
        }
    }

    fn collect(
        &mut self,
        myself: &ActorRef<JobMsg>,
        children: Vec<String>,
        timeout: Option<Duration>,
        stop_on_timeout: bool,
        reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    ) {
        let labels = if children.is_empty() {
            self.children.uncollected_labels()
        } else {
            match children
                .iter()
                .map(|c| self.children.resolve(c))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(labels) => labels,
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                    return;
                }
            }
        };
        let id = self.children.next_waiter;
        self.children.next_waiter += 1;
        self.children.waiters.insert(
            id,
            Waiter {
                labels,
                stop_on_timeout,
                timeout,
                reply,
            },
        );
        if !self.children.answer_waiters().contains(&id)
            && let Some(timeout) = timeout
        {
            myself.send_after(timeout, move || JobMsg::WaitTimedOut { waiter: id });
        }
    }

    fn wait_timed_out(&mut self, waiter: u64) {
        let Some(w) = self.children.waiters.remove(&waiter) else {
            return;
        };
        let timeout = humantime::format_duration(w.timeout.unwrap_or_default()).to_string();
        let mut results = vec![];
        for label in &w.labels {
            let entry = self.children.latest(label).cloned();
            let Some(entry) = entry else { continue };
            if entry.state == ChildState::Settled {
                if let Some(env) = &entry.envelope {
                    results.push(env.clone());
                }
                self.children.mark_collected(label);
                continue;
            }
            let (status, error) = if w.stop_on_timeout {
                // I-17: the parent stopped waiting, so the child is stopped.
                let reason = format!("its parent stopped waiting after {timeout}");
                let _ = self.stop_child_label(label, &reason, false);
                (Status::Stopped, reason)
            } else {
                (
                    Status::Running,
                    format!("still running when collect timed out after {timeout}"),
                )
            };
            results.push(ResultEnvelope {
                job: entry.id,
                label: Some(entry.label.clone()),
                attempt: entry.attempt,
                agent: entry.agent.clone(),
                status,
                task_status: None,
                output: serde_json::Value::Null,
                error: Some(error),
                error_class: w.stop_on_timeout.then_some(ErrorClass::Timeout),
                limitations: vec![],
                artifacts: vec![],
                tokens_spent: entry.meter.get(),
                usd_micros_spent: entry.meter.amount().usd_micros,
                turns: 0,
                workdir: String::new(),
            });
        }
        let _ = w.reply.send(Ok(results));
    }

    /// A child's final word: charge it (I-10), write its terminal record, drop
    /// its output if it was stopped (I-16), retry it (I-23) or stop its
    /// siblings (I-42) if that is the rule.
    async fn child_ended(
        &mut self,
        myself: &ActorRef<JobMsg>,
        report: ChildReport,
    ) -> Result<(), ActorProcessingErr> {
        let Some(entry) = self.children.by_id.get(&report.id) else {
            return Ok(());
        };
        if entry.state == ChildState::Settled {
            return Ok(());
        }
        let entry = entry.clone();
        let envelope = final_envelope(&entry.stop_reason, report.envelope);
        let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
            child: entry.id,
            spent: envelope.spent(),
            reply
        });
        settle_record(
            &self.ctx,
            self.lineage.run,
            ParentRef::Job(self.lineage.id),
            &entry.plan.agent.name,
            NodeKind::Job,
            self.lineage.depth + 1,
            &envelope,
            entry.grant.tokens,
            entry.stop_reason.as_ref().is_some_and(|r| r.1),
        )
        .await?;
        if let Some(e) = self.children.by_id.get_mut(&entry.id) {
            e.state = ChildState::Settled;
            e.envelope = Some(envelope.clone());
        }
        let class = envelope.error_class.unwrap_or(ErrorClass::Task);
        let retry = envelope.status == Status::Failed
            && entry.retries_left > 0
            && entry.stop_reason.is_none()
            && class.is_retryable()
            && self.finish.is_none();
        if retry {
            let mut plan = entry.plan.clone();
            plan.id = JobId::new();
            plan.attempt += 1;
            plan.retries = entry.retries_left - 1;
            plan.asked = None;
            plan.asked_usd = None;
            plan.brief.request = format!(
                "{}\n\nA previous attempt failed: {}{}",
                entry.plan.brief.request,
                envelope.error.clone().unwrap_or_default(),
                if envelope.limitations.is_empty() {
                    String::new()
                } else {
                    format!("\nIts limitations: {}", envelope.limitations.join("; "))
                }
            );
            match self.retry_child(myself, plan, entry.grant).await {
                Ok(()) => {
                    self.children.answer_waiters();
                    return Ok(());
                }
                Err(refusal) => {
                    if let Some(e) = self.children.by_id.get_mut(&entry.id)
                        && let Some(env) = e.envelope.as_mut()
                    {
                        env.limitations.push(format!("retry refused: {refusal}"));
                    }
                }
            }
        }
        if envelope.status == Status::Failed
            && self
                .children
                .groups
                .get(entry.plan.group)
                .map(|g| g.on_failure)
                == Some(OnFailure::CancelSiblings)
        {
            let reason = format!("sibling {} failed", entry.label);
            for label in self.children.running_in_group(entry.plan.group) {
                let _ = self.stop_child_label(&label, &reason, false);
            }
        }
        self.children.answer_waiters();
        Ok(())
    }

    /// A new attempt: new id, new reservation, counted by the spawn cap (I-23).
    async fn retry_child(
        &mut self,
        myself: &ActorRef<JobMsg>,
        plan: PlannedChild,
        previous_grant: Grant,
    ) -> Result<(), Refusal> {
        self.run_ctx.count_spawns(1)?;
        // A retry may be granted at most what the attempt before it was.
        let asks = vec![GrantAsk {
            child: plan.id,
            agent: plan.agent.name.clone(),
            asked: None,
            agent_max: Some(previous_grant.tokens),
            asked_usd: None,
            agent_max_usd: previous_grant.usd,
        }];
        let share = Share::Fraction(self.ctx.limits.grant_fraction);
        let grant = match ractor::call!(self.account, |reply| AccountMsg::Reserve {
            asks,
            share,
            reply
        }) {
            Ok(Ok(g)) => g[0],
            Ok(Err(r)) => {
                self.run_ctx.uncount_spawns(1);
                return Err(r);
            }
            Err(e) => {
                self.run_ctx.uncount_spawns(1);
                return Err(Refusal::Invalid {
                    message: e.to_string(),
                });
            }
        };
        let record = self.child_record(&plan, grant, Status::Pending);
        let record_seq = match self.ctx.journal.commit(vec![Record::Job(record)]).await {
            Ok(seq) => seq,
            Err(e) => {
                let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                    child: plan.id,
                    spent: Amount::ZERO,
                    reply
                });
                self.run_ctx.uncount_spawns(1);
                return Err(Refusal::Invalid {
                    message: e.to_string(),
                });
            }
        };
        self.spawn_child(myself, &plan, grant, record_seq)
            .await
            .map(|_| ())
            .map_err(|message| {
                self.run_ctx.uncount_spawns(1);
                Refusal::Invalid { message }
            })
    }
}

/// I-16: a child its parent stopped has no output, whatever it sent.
pub(crate) fn final_envelope(
    stop: &Option<(String, bool)>,
    mut envelope: ResultEnvelope,
) -> ResultEnvelope {
    if let Some((reason, propagated)) = stop {
        envelope.status = Status::Stopped;
        envelope.task_status = None;
        envelope.output = serde_json::Value::Null;
        envelope.error_class = None;
        envelope.error = Some(if *propagated {
            format!("{reason} (propagated)")
        } else {
            reason.clone()
        });
    }
    envelope
}

/// The envelope of a child whose actor died without reporting (I-38): failed,
/// class `panicked`, charged what its account had spent.
pub(crate) fn dead_envelope(
    id: JobId,
    label: &str,
    attempt: u32,
    agent: &str,
    error: &str,
    spent: Amount,
) -> ResultEnvelope {
    ResultEnvelope {
        job: id,
        label: Some(label.to_string()),
        attempt,
        agent: agent.to_string(),
        status: Status::Failed,
        task_status: Some(TaskStatus::Failed),
        output: serde_json::Value::Null,
        error: Some(error.to_string()),
        error_class: Some(ErrorClass::Panicked),
        limitations: vec![],
        artifacts: vec![],
        tokens_spent: spent.tokens,
        usd_micros_spent: spent.usd_micros,
        turns: 0,
        workdir: String::new(),
    }
}

/// Writes a child's terminal record (durable, I-29) and emits its end. Shared
/// by the Run (for steps) and Jobs (for their children): the parent is the
/// only writer of a child's final status.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn settle_record(
    ctx: &NodeContext,
    run: RunId,
    parent: ParentRef,
    agent: &str,
    kind: NodeKind,
    depth: u32,
    envelope: &ResultEnvelope,
    grant: u64,
    propagated: bool,
) -> Result<(), ActorProcessingErr> {
    let reason = match envelope.status {
        Status::Done => None,
        _ => envelope.error.clone(),
    };
    let record = JobRecord {
        id: envelope.job,
        run,
        parent,
        kind,
        agent: agent.to_string(),
        label: envelope.label.clone(),
        depth,
        attempt: envelope.attempt,
        grant_tokens: grant,
        workdir: envelope.workdir.clone(),
        status: envelope.status,
        task_status: envelope.task_status,
        error_class: envelope.error_class,
        reason: reason.clone(),
        output_json: envelope.output.to_string(),
        tokens_spent: envelope.tokens_spent,
        epoch: ctx.journal.epoch(),
    };
    ctx.journal.commit(vec![Record::Job(record)]).await?;
    ctx.events.emit(
        run,
        EventKind::NodeFinished {
            id: envelope.job,
            status: envelope.status,
            task_status: envelope.task_status,
            error_class: envelope.error_class,
            reason,
            propagated,
            output: envelope.output.clone(),
            error: envelope.error.clone(),
            limitations: envelope.limitations.clone(),
            artifacts: envelope.artifacts.clone(),
            turns: envelope.turns,
            tokens_spent: envelope.tokens_spent,
            usd_micros_spent: envelope.usd_micros_spent,
        },
    );
    Ok(())
}

/// The digest of a delegate call's canonical request (I-32): its JSON with
/// sorted keys, without the key itself, hashed with SHA-256.
pub fn delegation_digest(args: &DelegateArgs) -> String {
    use sha2::{Digest, Sha256};
    let mut canonical = serde_json::to_value(args).unwrap_or_default();
    if let Some(map) = canonical.as_object_mut() {
        map.remove("key");
    }
    let bytes = Sha256::digest(sorted(canonical).to_string().as_bytes());
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The value with every object's keys in sorted order, whatever order they
/// came in: equal requests serialize equally.
fn sorted(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(sorted).collect())
        }
        other => other,
    }
}

/// Checks an output against a JSON Schema; the error names the first violation.
pub fn check_schema(schema: &serde_json::Value, output: &serde_json::Value) -> Result<(), String> {
    let validator = jsonschema::validator_for(schema).map_err(|e| e.to_string())?;
    match validator.iter_errors(output).next() {
        None => Ok(()),
        Some(e) => Err(format!("{} at {}", e, e.instance_path())),
    }
}

/// The required globs no artifact matches (I-22, I-24).
pub fn missing_artifacts(required: &[String], artifacts: &[String]) -> Vec<String> {
    required
        .iter()
        .filter(|pattern| match glob::Pattern::new(pattern) {
            Ok(p) => !artifacts.iter().any(|a| p.matches(a)),
            Err(_) => true,
        })
        .cloned()
        .collect()
}

// ---- the children's bookkeeping ----

#[derive(Clone, Debug)]
struct PlannedChild {
    id: JobId,
    label: String,
    asked: Option<u64>,
    asked_usd: Option<u64>,
    brief: Brief,
    policy: Policy,
    agent: Arc<AgentDef>,
    retries: u32,
    attempt: u32,
    group: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChildState {
    Running,
    /// The parent decided it is stopped; its report is awaited for its spend only.
    Stopping,
    Settled,
}

#[derive(Clone)]
struct ChildEntry {
    id: JobId,
    label: String,
    agent: String,
    attempt: u32,
    actor: ActorRef<JobMsg>,
    grant: Grant,
    meter: SpentMeter,
    state: ChildState,
    stop_reason: Option<(String, bool)>,
    envelope: Option<ResultEnvelope>,
    plan: PlannedChild,
    retries_left: u32,
    collected: bool,
}

impl ChildEntry {
    fn status_word(&self) -> String {
        match (&self.state, &self.envelope) {
            (ChildState::Settled, Some(env)) => env.status.to_string(),
            (ChildState::Stopping, _) => "stopping".into(),
            _ => "running".into(),
        }
    }
}

struct FanOut {
    on_failure: OnFailure,
}

struct Waiter {
    labels: Vec<String>,
    stop_on_timeout: bool,
    timeout: Option<Duration>,
    reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
}

#[derive(Default)]
struct Children {
    by_id: BTreeMap<JobId, ChildEntry>,
    /// Label -> latest attempt.
    latest: HashMap<String, JobId>,
    order: Vec<String>,
    groups: Vec<FanOut>,
    waiters: BTreeMap<u64, Waiter>,
    next_waiter: u64,
}

impl Children {
    fn insert(&mut self, entry: ChildEntry) {
        if !self.latest.contains_key(&entry.label) {
            self.order.push(entry.label.clone());
        }
        self.latest.insert(entry.label.clone(), entry.id);
        self.by_id.insert(entry.id, entry);
    }

    fn latest(&self, label: &str) -> Option<&ChildEntry> {
        self.latest.get(label).and_then(|id| self.by_id.get(id))
    }

    fn latest_mut(&mut self, label: &str) -> Option<&mut ChildEntry> {
        let id = *self.latest.get(label)?;
        self.by_id.get_mut(&id)
    }

    fn known(&self) -> String {
        if self.order.is_empty() {
            "none".into()
        } else {
            self.order.join(", ")
        }
    }

    /// A label or any attempt's id, to the label.
    fn resolve(&self, name: &str) -> Result<String, Refusal> {
        if self.latest.contains_key(name) {
            return Ok(name.to_string());
        }
        if let Ok(id) = name.parse::<JobId>()
            && let Some(entry) = self.by_id.get(&id)
        {
            return Ok(entry.label.clone());
        }
        Err(Refusal::UnknownChild {
            child: name.to_string(),
            known: self.known(),
        })
    }

    fn auto_label(&self, agent: &str, already_planned: usize) -> String {
        let mut n = self.order.len() + already_planned + 1;
        loop {
            let label = format!("{agent}-{n}");
            if !self.latest.contains_key(&label) {
                return label;
            }
            n += 1;
        }
    }

    fn running_count(&self) -> u32 {
        self.by_id
            .values()
            .filter(|c| c.state != ChildState::Settled)
            .count() as u32
    }

    fn running_labels(&self) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| {
                self.latest(l)
                    .is_some_and(|c| c.state == ChildState::Running)
            })
            .cloned()
            .collect()
    }

    fn running_in_group(&self, group: usize) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| {
                self.latest(l)
                    .is_some_and(|c| c.state == ChildState::Running && c.plan.group == group)
            })
            .cloned()
            .collect()
    }

    fn all_settled(&self) -> bool {
        self.by_id.values().all(|c| c.state == ChildState::Settled)
    }

    fn cancel_retries(&mut self) {
        for c in self.by_id.values_mut() {
            c.retries_left = 0;
        }
    }

    fn uncollected_labels(&self) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| self.latest(l).is_some_and(|c| !c.collected))
            .cloned()
            .collect()
    }

    fn mark_collected(&mut self, label: &str) {
        if let Some(c) = self.latest_mut(label) {
            c.collected = true;
        }
    }

    /// Answers every waiter whose children have all settled; returns their ids.
    fn answer_waiters(&mut self) -> Vec<u64> {
        let ready: Vec<u64> = self
            .waiters
            .iter()
            .filter(|(_, w)| {
                w.labels.iter().all(|l| {
                    self.latest(l)
                        .is_none_or(|c| c.state == ChildState::Settled)
                })
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &ready {
            let w = self.waiters.remove(id).expect("listed above");
            let mut results = vec![];
            for label in &w.labels {
                if let Some(env) = self.latest(label).and_then(|c| c.envelope.clone()) {
                    results.push(env);
                }
                self.mark_collected(label);
            }
            let _ = w.reply.send(Ok(results));
        }
        ready
    }

    /// The report for a child actor that died without one, if `cell` is an unsettled child.
    fn has_unsettled_actor(&self, actor: ractor::ActorId) -> bool {
        self.by_id
            .values()
            .any(|c| c.actor.get_id() == actor && c.state != ChildState::Settled)
    }

    fn report_for_dead(&self, actor: ractor::ActorId, why: &str) -> Option<ChildReport> {
        let entry = self
            .by_id
            .values()
            .find(|c| c.actor.get_id() == actor && c.state != ChildState::Settled)?;
        Some(ChildReport {
            id: entry.id,
            envelope: dead_envelope(
                entry.id,
                &entry.label,
                entry.attempt,
                &entry.agent,
                &format!("the job's actor {why} before it reported"),
                entry.meter.amount(),
            ),
        })
    }
}
