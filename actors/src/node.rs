//! Node: the root of the actor tree. Starts runs and routes operator commands.
//!
//! Children: one Run per run. A run that dies does not take the node with it
//! (I-38): the node writes the run's failure itself.

use crate::context::NodeContext;
use crate::job::JobMsg;
use crate::run::{Run, RunArgs, RunMsg};
use arbor_protocol::{ErrorClass, EventKind, JobId, Refusal, RunId, RunSpec, Status};
use arbor_storage::{Record, RunRecord};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::collections::HashMap;
use std::sync::Arc;

pub struct Node;

pub struct NodeArgs {
    pub ctx: Arc<NodeContext>,
    /// Each workspace version's context, for the runs admitted with it.
    pub versions: Arc<crate::context::Versions>,
}

pub enum NodeMsg {
    StartRun {
        spec: RunSpec,
        /// The run's id when the caller must journal it first (a continuation).
        id: Option<RunId>,
        /// What a continued job's run takes over from it (attempts, counts).
        carried: crate::run::Carried,
        reply: RpcReplyPort<Result<RunId, String>>,
    },
    /// Resumes a run recovery found interrupted (I-34).
    ResumeRun {
        id: RunId,
        spec: RunSpec,
        resume: Box<crate::run::Resume>,
        reply: RpcReplyPort<Result<RunId, String>>,
    },
    /// `audit`, here and below: the audit entry of the operator's call
    /// (I-64), committed with the change it asked for.
    StopRun {
        run: RunId,
        reason: String,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// Stops one step or job: its parent decides, so that I-16 holds.
    StopJob {
        run: RunId,
        job: JobId,
        reason: String,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// A person continues step `job` of `run`, which waits for that decision
    /// (I-57): its next attempt starts in the same run.
    ContinueStep {
        run: RunId,
        job: JobId,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<(), String>>,
    },
    /// Stops every run (each stops its subtree and kills its processes) and
    /// replies when the last one has ended. New runs are refused from now on.
    StopAll {
        reason: String,
        reply: RpcReplyPort<()>,
    },
    /// An operator raises a run's root grant (a top-up, I-58).
    TopUp {
        run: RunId,
        amount: arbor_protocol::Amount,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<arbor_protocol::AccountView, String>>,
    },
    /// An operator's message to a running step or job (I-20).
    Steer {
        job: JobId,
        text: String,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
}

impl Actor for Node {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: NodeArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(NodeState {
            ctx: args.ctx,
            versions: args.versions,
            runs: HashMap::new(),
            closing: false,
            stopped_waiters: vec![],
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            NodeMsg::StartRun {
                spec,
                id,
                carried,
                reply,
            } => {
                let result = state.start_run(&myself, spec, id, carried).await;
                let _ = reply.send(result);
            }
            NodeMsg::ResumeRun {
                id,
                spec,
                resume,
                reply,
            } => {
                let result = state
                    .spawn_run(&myself, id, spec, Some(*resume), Default::default())
                    .await;
                let _ = reply.send(result);
            }
            NodeMsg::StopRun {
                run,
                reason,
                audit,
                reply,
            } => {
                let result = match state.runs.get(&run) {
                    Some((actor, _)) => actor
                        .cast(RunMsg::Stop {
                            reason,
                            audit: audit.map(Box::new),
                        })
                        .map_err(|e| e.to_string()),
                    None => Err(format!("no running run {run}")),
                };
                let _ = reply.send(result);
            }
            NodeMsg::ContinueStep {
                run,
                job,
                reply,
                audit,
            } => match state.runs.get(&run) {
                Some((actor, _)) => {
                    if let Err(e) = actor.cast(RunMsg::Continue {
                        job,
                        reply,
                        audit: audit.map(Box::new),
                    }) {
                        tracing::warn!(%run, %job, error = %e, "a continue did not reach its run");
                    }
                }
                None => {
                    let _ = reply.send(Err(format!("run {run} is not running on this node")));
                }
            },
            NodeMsg::TopUp {
                run,
                amount,
                audit,
                reply,
            } => state.top_up(run, amount, audit, reply),
            NodeMsg::StopJob {
                run,
                job,
                reason,
                audit,
                reply,
            } => {
                let _ = reply.send(state.stop_job(run, job, reason, audit));
            }
            NodeMsg::StopAll { reason, reply } => {
                state.closing = true;
                for (actor, _) in state.runs.values() {
                    let _ = actor.cast(RunMsg::Stop {
                        reason: reason.clone(),
                        audit: None,
                    });
                }
                state.stopped_waiters.push(reply);
                state.answer_stopped_waiters();
            }
            NodeMsg::Steer {
                job,
                text,
                audit,
                reply,
            } => {
                match ractor::registry::where_is(job_name(job)) {
                    Some(cell) => {
                        let actor: ActorRef<JobMsg> = cell.into();
                        let _ = actor.cast(JobMsg::Steer {
                            text,
                            from_parent: false,
                            reply: Some(reply),
                            audit: audit.map(Box::new),
                        });
                    }
                    None => {
                        // Not running: say what it is, if the node knows it.
                        let refusal = match state.ctx.events.find_job(job) {
                            Some((_, status)) => Refusal::ChildEnded {
                                child: job.to_string(),
                                status: status.to_string(),
                            },
                            None => Refusal::UnknownChild {
                                child: job.to_string(),
                                known: "no step or job has that id".into(),
                            },
                        };
                        let _ = reply.send(Err(refusal));
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, failure) = match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => (cell, None),
            SupervisionEvent::ActorFailed(cell, error) => (cell, Some(error.to_string())),
            _ => return Ok(()),
        };
        let Some(run) = state
            .runs
            .iter()
            .find(|(_, (actor, _))| actor.get_id() == cell.get_id())
            .map(|(id, _)| *id)
        else {
            return Ok(());
        };
        let (_, spec) = state.runs.remove(&run).expect("found above");
        state.answer_stopped_waiters();
        if let Some(error) = failure {
            let reason = format!("the run's actor panicked: {error}");
            let record = RunRecord {
                id: run,
                flow: spec.flow,
                budget_tokens: spec.budget_tokens,
                status: Status::Failed,
                error_class: Some(ErrorClass::Panicked),
                reason: Some(reason.clone()),
                output_json: "null".into(),
                epoch: state.ctx.journal.epoch(),
            };
            let _ = state.ctx.journal.commit(vec![Record::Run(record)]).await;
            state.ctx.events.emit(
                run,
                EventKind::RunFinished {
                    limitations: Vec::new(),
                    status: Status::Failed,
                    error_class: Some(ErrorClass::Panicked),
                    reason: Some(reason),
                    output: serde_json::Value::Null,
                },
            );
        }
        Ok(())
    }
}

pub struct NodeState {
    ctx: Arc<NodeContext>,
    versions: Arc<crate::context::Versions>,
    runs: HashMap<RunId, (ActorRef<RunMsg>, RunSpec)>,
    /// Set by StopAll: no new run starts.
    closing: bool,
    stopped_waiters: Vec<RpcReplyPort<()>>,
}

/// The registry name of a step's or job's actor.
pub fn job_name(id: JobId) -> String {
    format!("arbor-job-{id}")
}

impl NodeState {
    /// A top-up goes to its run, which answers; a run not running here is refused.
    fn top_up(
        &self,
        run: RunId,
        amount: arbor_protocol::Amount,
        audit: Option<Record>,
        reply: RpcReplyPort<Result<arbor_protocol::AccountView, String>>,
    ) {
        let Some((actor, _)) = self.runs.get(&run) else {
            let _ = reply.send(Err(format!("run {run} is not running on this node")));
            return;
        };
        let audit = audit.map(Box::new);
        if let Err(e) = actor.cast(RunMsg::TopUp {
            amount,
            audit,
            reply,
        }) {
            tracing::warn!(%run, error = %e, "a top-up did not reach its run");
        }
    }
    fn answer_stopped_waiters(&mut self) {
        if self.runs.is_empty() {
            for reply in self.stopped_waiters.drain(..) {
                let _ = reply.send(());
            }
        }
    }

    /// The context a run of `spec` runs with: its version's (I-67).
    fn ctx_for(&self, spec: &RunSpec) -> Arc<NodeContext> {
        spec.version
            .as_deref()
            .and_then(|v| self.versions.get(v))
            .unwrap_or_else(|| self.ctx.clone())
    }

    async fn start_run(
        &mut self,
        myself: &ActorRef<NodeMsg>,
        spec: RunSpec,
        id: Option<RunId>,
        carried: crate::run::Carried,
    ) -> Result<RunId, String> {
        if self.closing {
            return Err("the node is shutting down; no new run starts".into());
        }
        // A journal that cannot write takes no new work: nothing could be made durable.
        if let Some(failure) = self.ctx.journal.failed() {
            return Err(format!(
                "the journal has failed ({failure}); no new run starts"
            ));
        }
        if spec.budget_tokens == 0 {
            return Err(
                "the run's budget must be at least 1 token (0 never means unlimited)".into(),
            );
        }
        if spec.groups.is_empty() || spec.groups.iter().any(|g| g.steps.is_empty()) {
            return Err("a run needs at least one group with at least one step".into());
        }
        let ctx = self.ctx_for(&spec);
        for step in spec.groups.iter().flat_map(|g| &g.steps) {
            if ctx.agent(&step.agent).is_none() {
                return Err(format!("unknown agent {:?}", step.agent));
            }
        }
        // Every model the run can reach must be usable now (a provider's key
        // set, say), so a run is refused whole rather than failing half-way.
        // A strict replay asks no model.
        let asks_models = spec
            .replay
            .as_ref()
            .is_none_or(|r| r.after_divergence == arbor_protocol::tape::AfterDivergence::Live);
        let reachable = spec.reachable_agents(|name| ctx.agents.get(name).map(|a| &**a));
        for agent in reachable {
            if asks_models {
                ctx.models.preflight(agent)?;
            }
        }
        // An id chosen (and journaled) by the caller starts at most once.
        if let Some(id) = id
            && (self.runs.contains_key(&id) || matches!(self.ctx.journal.run(id), Ok(Some(_))))
        {
            return Err(format!("run {id} was already started"));
        }
        self.spawn_run(myself, id.unwrap_or_default(), spec, None, carried)
            .await
    }

    async fn spawn_run(
        &mut self,
        myself: &ActorRef<NodeMsg>,
        id: RunId,
        spec: RunSpec,
        resume: Option<crate::run::Resume>,
        carried: crate::run::Carried,
    ) -> Result<RunId, String> {
        let args = RunArgs {
            ctx: self.ctx_for(&spec),
            id,
            spec: spec.clone(),
            resume,
            carried,
        };
        let (actor, _) = Actor::spawn_linked(
            Some(format!("arbor-run-{id}")),
            Run,
            args,
            myself.get_cell(),
        )
        .await
        .map_err(|e| format!("the run could not start: {e}"))?;
        self.runs.insert(id, (actor, spec));
        Ok(id)
    }

    fn stop_job(
        &self,
        run: RunId,
        job: JobId,
        reason: String,
        audit: Option<Record>,
    ) -> Result<(), String> {
        let Some((run_actor, _)) = self.runs.get(&run) else {
            return Err(format!("no running run {run}"));
        };
        let parent = self.ctx.events.with_tree(run, |t| {
            t.and_then(|t| t.node(job).map(|_| t.parent_of(job)))
        });
        match parent {
            None => Err(format!("run {run} has no job {job}")),
            Some(None) => run_actor
                .cast(RunMsg::StopStep {
                    id: job,
                    reason,
                    audit: audit.map(Box::new),
                })
                .map_err(|e| e.to_string()),
            Some(Some(parent)) => match ractor::registry::where_is(job_name(parent)) {
                Some(cell) => {
                    let actor: ActorRef<JobMsg> = cell.into();
                    actor
                        .cast(JobMsg::StopChildById {
                            id: job,
                            reason,
                            audit: audit.map(Box::new),
                        })
                        .map_err(|e| e.to_string())
                }
                None => Err(format!("job {job} has already ended")),
            },
        }
    }
}
