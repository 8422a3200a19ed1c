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
//!
//! Where things live: this file holds the actor, its lifecycle and the
//! checks on its output; beside it, in `job/`:
//! - `steering.rs`: messages to a job and, through it, to its children (I-20).
//! - `delegation.rs`: the delegate call, its checks and its admission.
//! - `settlement.rs`: stopping, collecting, retrying and settling children.
//! - `children.rs`: the children's table the other three read and write.

mod children;
mod delegation;
mod messages;
mod settlement;
mod steering;

pub use messages::{Brief, JobMsg, PeerSend, Peers};

use children::Children;

use crate::account::{Account, AccountArgs, AccountMsg, Grant, SpentMeter};
pub use crate::agent_loop::ChildHandle;
use crate::agent_loop::{self, LoopArgs, LoopEnd, LoopMsg, LoopOutcome};
use crate::context::{NodeContext, RunContext};
use crate::parent::{ChildReport, Parent};
use crate::policy::Policy;
use crate::sandbox::{Sandbox, SandboxArgs, SandboxMsg};
use arbor_protocol::{
    AgentDef, ErrorClass, EventKind, JobId, NodeKind, ParentRef, ResultEnvelope, RunId, Status,
    TaskStatus, ToolName,
};
use arbor_storage::{JobRecord, Record, SteerState};
use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::collections::{BTreeMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::AbortOnDropHandle;

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
    /// The labels from the root: its step's, then each delegated child's
    /// down to its own (what an approval card shows).
    pub path: Arc<[String]>,
    /// The labels with their attempts (`plan#1/worker-2#1`): what a
    /// recording names it by (`tape`).
    pub key: Arc<str>,
    /// The model's id of the delegate call that made it; none for a step.
    pub call: Option<Arc<str>>,
}

pub struct JobStart {
    pub ctx: Arc<NodeContext>,
    pub run_ctx: Arc<RunContext>,
    /// A step that may pause at its run's ceiling: its run (I-58).
    pub payer: Option<crate::parent::Payer>,
    pub lineage: Lineage,
    pub agent: Arc<AgentDef>,
    pub brief: Brief,
    pub policy: Policy,
    pub grant: Grant,
    pub workdir: PathBuf,
    /// What it reports its end to: its Run or its parent Job, the same way.
    pub parent: Parent,
    /// A child of the parent's token: a stop anywhere above cancels in-flight work here at once.
    pub cancel: CancellationToken,
    pub meter: SpentMeter,
    /// The journal seq of its durable admission record.
    pub record_seq: u64,
    /// Calls already counted against its limits (I-45): those of the
    /// attempt a restart interrupted, when this one takes over from it.
    pub tool_counts: crate::agent_loop::Made,
    /// Its first model call, reserved by its parent in its admission's commit.
    pub first_call: Option<crate::account::FirstCall>,
    /// Its model, made by its parent to plan that call: one model a job (a
    /// replaying job answers from its recording instead).
    pub model: Option<Arc<dyn crate::model::Model>>,
    /// A step of a `peers` group: its siblings, and the way to them.
    pub peers: Option<Arc<messages::Peers>>,
}

/// The job's model: its agent's, or the recording's in a replay (with its
/// agent's to go on with in a forked one), wrapped to record when its run
/// records.
fn job_model(
    ctx: &NodeContext,
    start: &JobStart,
) -> Result<(Arc<crate::model::ModelChain>, crate::tape::JobTapes), String> {
    use crate::tape::{JobTapes, RecordingModel, TapeModel, TapeWriter, Volatile, model_ref};
    let lineage = &start.lineage;
    let model_ref = model_ref(&start.agent);
    let mut tapes = JobTapes::default();
    // I-55: the models its calls move to when its model's supply is walled:
    // its agent's fallbacks, or, in a replay, those the recorded job moved to.
    let mut fallbacks: Vec<(String, Arc<dyn crate::model::Model>)> = vec![];
    let mut model: Arc<dyn crate::model::Model> = match &start.run_ctx.replay {
        None => {
            fallbacks = live_fallbacks(ctx, start);
            match &start.model {
                Some(model) => model.clone(),
                None => ctx.models.model_for(&start.agent)?,
            }
        }
        Some(replay) => {
            let live = match replay.spec.after_divergence {
                arbor_protocol::tape::AfterDivergence::Live => {
                    Some(ctx.models.model_for(&start.agent)?)
                }
                arbor_protocol::tape::AfterDivergence::Fail => None,
            };
            let job = replay.job(
                lineage.key.clone(),
                model_ref.clone(),
                Volatile::new(&ctx.work_root),
                live,
            );
            tapes.replay = Some(job.clone());
            for (name, fallback) in TapeModel::fallbacks(&job) {
                fallbacks.push((name, ctx.models.replaying(&start.agent, Arc::new(fallback))));
            }
            ctx.models
                .replaying(&start.agent, Arc::new(TapeModel::new(job)))
        }
    };
    if start.run_ctx.record {
        let writer = Arc::new(TapeWriter::new(
            ctx.journal.clone(),
            ctx.secrets.clone(),
            lineage.run,
            lineage.id,
            lineage.key.clone(),
            Volatile::new(&ctx.work_root),
        ));
        tapes.writer = Some(writer.clone());
        model = Arc::new(RecordingModel::new(model, writer.clone(), model_ref));
        for (name, fallback) in &mut fallbacks {
            *fallback = Arc::new(RecordingModel::fallback(
                fallback.clone(),
                writer.clone(),
                name.clone(),
            ));
        }
    }
    let named = (crate::tape::model_ref(&start.agent), model);
    Ok((
        Arc::new(crate::model::ModelChain::new(named, fallbacks)),
        tapes,
    ))
}

/// The built-in tools a job is offered, or why not: its policy's, and
/// `send_peer` for a step of a `peers` group, unless denied.
fn offered_to(
    start: &JobStart,
    limits: &arbor_protocol::Limits,
) -> BTreeMap<ToolName, Result<(), String>> {
    let lineage = &start.lineage;
    let mut offered = start
        .policy
        .offered(&start.agent, lineage.kind, lineage.depth, limits);
    if start.peers.is_some() && !start.policy.is_denied(ToolName::SendPeer.as_str()) {
        offered.insert(ToolName::SendPeer, Ok(()));
    }
    offered
}

/// The agent's fallbacks that can be made, each with its name (one that
/// cannot is passed over, and said so).
fn live_fallbacks(
    ctx: &NodeContext,
    start: &JobStart,
) -> Vec<(String, Arc<dyn crate::model::Model>)> {
    start
        .agent
        .fallback
        .iter()
        .filter(|next| **next != start.agent.model)
        .filter_map(|next| {
            let agent = arbor_protocol::AgentDef {
                model: next.clone(),
                ..(*start.agent).clone()
            };
            let model = ctx
                .models
                .model_for(&agent)
                .map_err(|e| tracing::warn!(job = %start.lineage.id, fallback = %next, error = %e, "a fallback model is not available"))
                .ok()?;
            Some((crate::tape::model_ref(&agent), model))
        })
        .collect()
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
        let (model, tapes) = job_model(&ctx, &start)?;
        // I-27: a secret without a value refuses the job before anything is made.
        let env = ctx.secrets.env_for(&start.policy.secrets)?;
        let offered = offered_to(&start, &ctx.limits);
        // A Sandbox only for a job that may use one: most jobs of a wide
        // fan-out only think and answer, and an actor each (its spawn, its
        // calls at the end, its stop) was a good part of their cost.
        let needs_sandbox = start.policy.may_use_mcp()
            || !start.policy.hooks.is_empty()
            || offered
                .iter()
                .any(|(tool, verdict)| tool.info().sandbox && verdict.is_ok());
        let setup = async {
            let (account, _) = Actor::spawn_linked(
                None,
                Account,
                AccountArgs {
                    ctx: ctx.clone(),
                    run: lineage.run,
                    owner: ParentRef::Job(lineage.id),
                    grant: start.grant.tokens,
                    grant_usd_micros: start.grant.usd_micros,
                    wind_down: ctx.limits.wind_down,
                    meter: start.meter.clone(),
                    resume_spent: None,
                    first_call: start.first_call,
                },
                cell.clone(),
            )
            .await?;
            if !needs_sandbox {
                return Ok((account, None));
            }
            let sandbox = Actor::spawn_linked(
                None,
                Sandbox,
                SandboxArgs {
                    record: Some(crate::sandbox::GroupRecorder {
                        journal: ctx.journal.clone(),
                        events: ctx.events.clone(),
                        run: lineage.run,
                        job: lineage.id,
                    }),
                    workdir: start.workdir.clone(),
                    cancel: start.cancel.clone(),
                    exec_timeout: DEFAULT_EXEC_TIMEOUT,
                    resources: start.agent.resources,
                    network: start.policy.network,
                    posture: ctx.sandbox.clone(),
                    runs_commands: start.policy.runs_commands(),
                    env,
                    secrets: ctx.secrets.clone(),
                    roots: Some(ctx.sandbox_roots.clone()),
                },
                cell.clone(),
            )
            .await;
            match sandbox {
                Ok((sandbox, _)) => Ok((account, Some(sandbox))),
                Err(e) => {
                    account.stop(None);
                    Err(e)
                }
            }
        };
        // I-06: a failed start has made no workdir (the sandbox makes it
        // at its first use, `sandbox.rs` invariant 4).
        let (account, sandbox) = setup.await?;
        ctx.events.emit(
            lineage.run,
            EventKind::JobSpawned {
                id: lineage.id,
                parent: lineage.parent,
                kind: lineage.kind,
                agent: start.agent.name.clone(),
                label: lineage.label.clone(),
                depth: lineage.depth,
                attempt: lineage.attempt,
                grant_tokens: start.grant.tokens,
                grant_usd_micros: start.grant.usd_micros,
                workdir: start.workdir.display().to_string(),
                record_seq: start.record_seq,
                request: start.brief.request.clone(),
                call: lineage.call.as_deref().map(str::to_string),
                model: start.agent.model.to_string(),
            },
        );
        Ok(JobState {
            ctx,
            run_ctx: start.run_ctx,
            payer: start.payer,
            lineage,
            agent: start.agent,
            brief: start.brief,
            policy: Arc::new(start.policy),
            offered: Arc::new(offered),
            tool_counts: start.tool_counts,
            grant: start.grant,
            workdir: start.workdir,
            parent: start.parent,
            _cancel_on_drop: start.cancel.clone().drop_guard(),
            cancel: start.cancel,
            meter: start.meter,
            account,
            sandbox,
            model: Some(model),
            tapes,
            loop_task: None,
            in_flight: Default::default(),
            children: Children::default(),
            steering: VecDeque::new(),
            steering_arrived: Default::default(),
            steering_queued: Default::default(),
            next_message_id: 1,
            peer_messages: Default::default(),
            peers: start.peers,
            turns: 0,
            finish: None,
            ended: Default::default(),
            wall: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Appended, not committed: nothing outside acts on "running". The
        // job's first act outside (a model call's reservation, a
        // delegation's admission) commits after it, and its parent commits
        // its terminal record, so it is durable before either.
        let running = state.record(Status::Running);
        state.ctx.events.emit_with(
            state.lineage.run,
            vec![running],
            [EventKind::JobRunning {
                id: state.lineage.id,
            }],
        )?;
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
            state.wall = Some(WallTimer {
                left: timeout,
                since: std::time::Instant::now(),
                paused: false,
                generation: 0,
                _timer: Some(crate::timer::after(&myself, timeout, || JobMsg::TimedOut {
                    generation: 0,
                })),
            });
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
        // The long handlers are boxed while they run. ractor keeps one box
        // per actor for its loop, sized by the largest handler it may await:
        // inline, these made every job hold 8.5 KB for its whole life
        // (docs/benchmarks.md, P4); boxed, it holds their pointers.
        match message {
            JobMsg::Loop(LoopMsg::Delegate {
                args,
                call_id,
                reply,
            }) => {
                let result = Box::pin(state.delegate(&myself, args, &call_id)).await;
                let _ = reply.send(result);
            }
            JobMsg::Loop(LoopMsg::Collect {
                children,
                timeout,
                stop_on_timeout,
                reply,
            }) => state.collect(&myself, children, timeout, stop_on_timeout, reply),
            JobMsg::Loop(LoopMsg::StopChild { child, reply }) => {
                let result = state.children.resolve(&child).and_then(|label| {
                    state.stop_child_label(&label, "stopped by its parent", false, None)
                });
                let _ = reply.send(result);
            }
            JobMsg::StopChildById { id, reason, audit } => {
                if let Some(label) = state.children.by_id.get(&id).map(|c| c.label.clone()) {
                    let _ = state.stop_child_label(&label, &reason, false, audit.map(|a| *a));
                }
            }
            JobMsg::Loop(LoopMsg::SendMessage { child, text, reply }) => {
                state.send_message(child, text, reply)
            }
            JobMsg::Loop(LoopMsg::SendPeer { to, text, reply }) => match &state.peers {
                Some(peers) => (peers.send)(messages::PeerSend {
                    from: state.lineage.label.clone().unwrap_or_default(),
                    to,
                    text,
                    reply,
                }),
                None => {
                    let _ = reply.send(Err(arbor_protocol::Refusal::Invalid {
                        message: "this job has no peers".into(),
                    }));
                }
            },
            JobMsg::Peer { from, text, reply } => state.queue_peer(from, text, reply),
            JobMsg::Loop(LoopMsg::TakeSteering { turn, reply }) => {
                let texts = state.deliver_steering(turn);
                let _ = reply.send(texts);
            }
            JobMsg::Steer {
                text,
                from_parent,
                reply,
                audit,
            } => state.queue_steering(text, from_parent, reply, audit.map(|a| *a)),
            JobMsg::LoopEnded { outcome } => {
                state.loop_task = None;
                if state.finish.is_none() {
                    let finish = Box::pin(state.finish_from_loop(outcome)).await;
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
            JobMsg::Loop(LoopMsg::Waiting(waiting)) => {
                if let Some(wall) = &mut state.wall {
                    wall.pause(&myself, waiting);
                }
            }
            JobMsg::TimedOut { generation } => {
                let current = state.wall.as_ref().map(|w| (w.generation, w.paused));
                if current == Some((generation, false)) && state.finish.is_none() {
                    state.abort_loop();
                    let timeout = state.brief.timeout.unwrap_or_default();
                    let reason = format!("timed out after {}", humantime::format_duration(timeout));
                    state.begin_finish(Finish::failed(ErrorClass::Timeout, reason, state.turns));
                    state.maybe_complete(&myself).await?;
                }
            }
            JobMsg::ChildEnded { report } => {
                Box::pin(state.child_ended(&myself, report)).await?;
                state.maybe_complete(&myself).await?;
            }
            JobMsg::ChildGone { actor, why } => {
                if let Some(report) = state.children.report_for_dead(actor, &why) {
                    Box::pin(state.child_ended(&myself, report)).await?;
                    state.maybe_complete(&myself).await?;
                }
            }
            JobMsg::WaitTimedOut { waiter } => state.wait_timed_out(waiter).await?,
            JobMsg::RetryDue { label } => {
                Box::pin(state.retry_due(&myself, &label)).await;
                state.maybe_complete(&myself).await?;
            }
            JobMsg::EndsDurable { result } => {
                state.ended.waited();
                result?;
                state.answer_waiters();
                state.release_ended(&myself);
                state.maybe_complete(&myself).await?;
            }
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
        let own_sandbox = state
            .sandbox
            .as_ref()
            .is_some_and(|s| s.get_id() == cell.get_id());
        if cell.get_id() == state.account.get_id() || own_sandbox {
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
    payer: Option<crate::parent::Payer>,
    lineage: Lineage,
    agent: Arc<AgentDef>,
    brief: Brief,
    policy: Arc<Policy>,
    /// Shared with its loop, which it starts once.
    offered: Arc<BTreeMap<ToolName, Result<(), String>>>,
    /// Handed to its loop when it starts.
    tool_counts: crate::agent_loop::Made,
    grant: Grant,
    workdir: PathBuf,
    parent: Parent,
    cancel: CancellationToken,
    /// Cancels the subtree's in-flight work even when ractor kills this actor
    /// and skips post_stop: the state is dropped either way.
    _cancel_on_drop: DropGuard,
    meter: SpentMeter,
    account: ActorRef<AccountMsg>,
    /// None for a job offered no tool that uses one (`ToolInfo::sandbox`).
    sandbox: Option<ActorRef<SandboxMsg>>,
    model: Option<Arc<crate::model::ModelChain>>,
    /// Its side of the run's recording or replay, handed to its loop.
    tapes: crate::tape::JobTapes,
    /// Aborted when dropped, so a killed job leaves no loop running.
    loop_task: Option<AbortOnDropHandle<()>>,
    /// The loop's model call in flight, settled here if an abort cuts it short.
    in_flight: agent_loop::InFlightSlot,
    children: Children,
    /// Queued messages: id, text, and whether the parent sent it.
    steering: VecDeque<(u64, String, bool)>,
    /// Woken when a message is queued (a replay's loop waits for one).
    steering_arrived: Arc<tokio::sync::Notify>,
    /// How many messages wait in `steering`, read by the loop at each turn
    /// boundary: it asks for them (`TakeSteering`) only when there are some,
    /// not once a turn.
    steering_queued: Arc<AtomicUsize>,
    next_message_id: u64,
    /// Queued messages a peer sent, by id: its label (events say so).
    peer_messages: std::collections::HashMap<u64, String>,
    /// A step of a `peers` group: its siblings and the way to them.
    peers: Option<Arc<messages::Peers>>,
    turns: u32,
    finish: Option<Finish>,
    /// Children's ends not yet durable, held back from everything outside.
    ended: crate::ends::Ends,
    /// Its wall timeout (I-19), if it has one.
    wall: Option<WallTimer>,
}

/// A job's wall timeout, paused while it waits for a person (I-46): the
/// card's deadline is its own. Each pause and resume starts a new
/// generation, so a timer armed before is ignored when it fires.
struct WallTimer {
    left: Duration,
    since: std::time::Instant,
    paused: bool,
    generation: u64,
    /// Armed while it runs; dropped on a pause, and with the job.
    _timer: Option<crate::timer::Timer>,
}

impl WallTimer {
    fn pause(&mut self, myself: &ActorRef<JobMsg>, pause: bool) {
        if pause == self.paused {
            return;
        }
        self.generation += 1;
        self.paused = pause;
        if pause {
            self.left = self.left.saturating_sub(self.since.elapsed());
            self._timer = None;
        } else {
            self.since = std::time::Instant::now();
            let generation = self.generation;
            self._timer = Some(crate::timer::after(myself, self.left, move || {
                JobMsg::TimedOut { generation }
            }));
        }
    }
}

impl JobState {
    fn start_loop(&mut self, myself: ActorRef<JobMsg>) {
        let Some(model) = self.model.take() else {
            return;
        };
        let args = LoopArgs {
            peers: self
                .peers
                .as_ref()
                .map(|p| Arc::from(p.siblings.as_slice()))
                .unwrap_or_else(|| Arc::from(Vec::new())),
            instructions: self.run_ctx.instructions.clone(),
            ctx: self.ctx.clone(),
            run: self.lineage.run,
            id: self.lineage.id,
            path: self.lineage.path.clone(),
            job: myself.get_derived(),
            account: self.account.clone(),
            sandbox: self.sandbox.clone(),
            model,
            agent: self.agent.clone(),
            offered: self.offered.clone(),
            policy: self.policy.clone(),
            tool_counts: std::mem::take(&mut self.tool_counts),
            request: self.brief.request.clone(),
            max_turns: self.brief.max_turns,
            cancel: self.cancel.clone(),
            in_flight: self.in_flight.clone(),
            steering_queued: self.steering_queued.clone(),
            steering_arrived: self.steering_arrived.clone(),
            tapes: self.tapes.clone(),
            held: self.ended.held(),
            payer: self.payer.clone(),
        };
        // Every log line of the loop carries the ids of the job's span in
        // the run's trace (docs/operations.md, "Traces").
        let span = tracing::info_span!(
            "job",
            trace_id = %self.lineage.run.trace_hex(),
            span_id = %self.lineage.id.span_hex(),
        );
        let handle = tokio::spawn(async move {
            let run = tracing::Instrument::instrument(agent_loop::run(args), span);
            let outcome = match AssertUnwindSafe(run).catch_unwind().await {
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
        self.loop_task = Some(AbortOnDropHandle::new(handle));
    }

    fn abort_loop(&mut self) {
        self.cancel.cancel();
        self.loop_task = None;
    }

    /// The terminal status the loop's outcome earns, after the machine checks (I-22).
    async fn finish_from_loop(&mut self, outcome: LoopOutcome) -> Finish {
        self.turns = outcome.turns;
        // Its token is cancelled only by a stop from above, whose message
        // may come after the loop saw it: the job ends stopped either way.
        if outcome.end == LoopEnd::Stopped {
            return Finish::stopped("its parent was stopped".into(), true, outcome.turns);
        }
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
        let artifacts = self.artifacts().await;
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
        self.steering_queued.store(0, Ordering::Release);
        for (id, text, _) in std::mem::take(&mut self.steering) {
            self.journal_steer(id, &text, SteerState::Discarded);
            self.ended.held().emit(
                &self.ctx,
                self.lineage.run,
                EventKind::SteerDiscarded {
                    id: self.lineage.id,
                    message_id: id,
                },
            );
        }
        for label in self.children.running_labels() {
            let _ = self.stop_child_label(&label, reason, true, None);
        }
        self.children.cancel_retries();
    }

    /// Once the job is finishing and every child has settled, `complete`.
    /// Called after nearly every message, so the check is cheap and the
    /// completion, a large future, is boxed only when it runs: inline, it
    /// sized every handler that awaits this (docs/ARCHITECTURE.md).
    async fn maybe_complete(
        &mut self,
        myself: &ActorRef<JobMsg>,
    ) -> Result<(), ActorProcessingErr> {
        // Every path into `finish` has already ended the loop.
        // And each child's end durable before this job's own is told (I-29).
        if self.finish.is_none() || !self.children.all_settled() || !self.ended.is_empty() {
            return Ok(());
        }
        Box::pin(self.complete(myself)).await
    }

    /// Kill the sandbox's processes, close the account, report to the
    /// parent and stop.
    async fn complete(&mut self, myself: &ActorRef<JobMsg>) -> Result<(), ActorProcessingErr> {
        let Some(finish) = self.finish.clone() else {
            return Ok(());
        };
        self.abort_loop();
        // A call the abort cut short is charged what it may have cost (I-16:
        // its answer is dropped, its spend is not).
        if let Some(call) = agent_loop::take_in_flight(&self.in_flight) {
            agent_loop::settle_cut(&self.account, self.lineage.id, call, "stopped").await;
        }
        // What the loop was handed and had not told yet (it was cut short)
        // is told before this job's own end.
        self.ended
            .held()
            .release(&self.ctx, self.lineage.run)
            .await?;
        let artifacts = self.artifacts().await;
        if let Some(sandbox) = &self.sandbox {
            let _ = ractor::call!(sandbox, |reply| SandboxMsg::KillAll { reply });
        }
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
        // A parent that is gone has nobody left to tell.
        let _ = self.parent.send_message(ChildReport {
            id: self.lineage.id,
            envelope,
        });
        myself.stop(None);
        Ok(())
    }

    /// The files the job was seen to write; none without a sandbox.
    async fn artifacts(&self) -> Vec<String> {
        match &self.sandbox {
            Some(sandbox) => {
                ractor::call!(sandbox, |reply| SandboxMsg::Artifacts { reply }).unwrap_or_default()
            }
            None => vec![],
        }
    }

    /// The job's own record at `status`, as it stands before its end.
    fn record(&self, status: Status) -> Record {
        Record::Job(JobRecord {
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
        })
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
