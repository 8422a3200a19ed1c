//! The embedded node: a journal on disk, the actor tree, and a handle to drive
//! it. `arbor run` and the test harness both start one of these.
//!
//! Layout of a data dir: `journal/` (sled), `work/<run>/...` (workdirs, gone
//! with their run when it is forgotten, and swept at every start if the
//! journal no longer knows their run) and `roots/` (sealed commands' root
//! folders, swept at every start).

use crate::models::Models;
use crate::recovery::{self, RecoveryReport, RunOutcome};
use crate::workspace::{JournalConfig, Workspace};
use arbor_actors::approvals::{Decide, DecideError};
use arbor_actors::mcp::McpCatalog;
use arbor_actors::{
    EventBus, Gate, GateArgs, GateMsg, ModelFactory, Node, NodeArgs, NodeContext, NodeMsg,
};
use arbor_protocol::{
    ActorView, Card, CardId, CardState, ErrorClass, EventKind, JobId, Refusal, RunId, RunSpec,
    SandboxPosture, Status, ToolName, Tree,
};
use arbor_sandbox::seal::{Posture, SandboxIsolation};
use arbor_storage::{Journal, PgOptions, Record, RunRecord};
use ractor::ActorRef;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("journal: {0}")]
    Journal(#[from] arbor_storage::Error),
    #[error("{0}")]
    Start(String),
    #[error("{0}")]
    Refused(String),
}

/// The delegation key under which a job's continuation is recorded (I-33).
pub const CONTINUE_KEY: &str = "arbor:continue";

/// How long `shutdown` waits for runs to stop by themselves.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A running node. Dropping it without `shutdown` leaves the journal as a crash would.
pub struct EmbeddedNode {
    ctx: Arc<NodeContext>,
    /// Each workspace version's context (I-67).
    versions: Arc<arbor_actors::Versions>,
    node: ActorRef<NodeMsg>,
    /// The Node actor's task, taken by whoever ends the node first.
    join: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    data_dir: PathBuf,
    recovery: RecoveryReport,
    resumed: Vec<(RunId, RunSpec)>,
    /// A shared journal's: says why once this node has lost its lease.
    lease_lost: Option<tokio::sync::watch::Receiver<Option<String>>>,
    /// Traces, when configured (`[telemetry]`, `OTEL_*`).
    telemetry: Option<Arc<crate::telemetry::Telemetry>>,
    /// Notifications, when `[notify]` has endpoints.
    notifications: Option<Arc<crate::notify::Notifications>>,
}

/// The context every actor of the node shares, of `workspace`.
fn node_context(
    workspace: &Workspace,
    data_dir: &Path,
    journal: Journal,
    events: arbor_actors::events::EventBus,
    models: Arc<dyn ModelFactory>,
    sandbox: Arc<Posture>,
    secrets: Arc<arbor_actors::secrets::Secrets>,
) -> NodeContext {
    let mcp = Arc::new(McpCatalog::new(
        workspace.config.mcp.clone(),
        data_dir.join("mcp"),
        sandbox.clone(),
        workspace.config.sandbox,
        Some(data_dir.join("roots")),
        secrets.clone(),
    ));
    NodeContext {
        journal,
        events,
        limits: workspace.config.limits.clone(),
        agents: agents_of(workspace),
        models,
        work_root: data_dir.join("work"),
        sandbox_roots: data_dir.join("roots"),
        sandbox,
        secrets,
        skills: workspace.skills.clone(),
        mcp,
        approvals: workspace.config.approvals.clone(),
        gate: Default::default(),
        slots: Arc::new(arbor_actors::slots::AgentSlots::new(
            &workspace.config.limits.concurrency.per_agent,
        )),
        pools: Default::default(),
    }
}

/// A workspace's agents as a node's context holds them.
fn agents_of(
    workspace: &Workspace,
) -> std::collections::BTreeMap<String, Arc<arbor_protocol::AgentDef>> {
    workspace
        .agents
        .iter()
        .map(|(k, v)| (k.clone(), Arc::new(v.clone())))
        .collect()
}

/// The node's versions (I-67): the workspace it starts with, kept in the
/// journal (once per content) before any run is admitted with it, and a
/// loader that makes an earlier version's context from the journal when
/// a run admitted with it resumes, here or after a failover.
async fn pin_versions(
    ctx: &Arc<NodeContext>,
    workspace: &Workspace,
) -> Result<Arc<arbor_actors::Versions>, Error> {
    if let Some(row) = crate::versions::snapshot(&ctx.journal, workspace)? {
        ctx.journal.commit(vec![row]).await?;
    }
    let versions = Arc::new(arbor_actors::Versions::default());
    versions.insert(&workspace.version, ctx.clone());
    let here = workspace.clone();
    let node = Arc::downgrade(ctx);
    versions.set_loader(Box::new(move |id| {
        let ctx = node.upgrade()?;
        let files = match crate::versions::files(&ctx.journal, id) {
            Ok(Some(files)) => files,
            Ok(None) => {
                tracing::warn!(
                    version = id,
                    "the journal keeps no such workspace version: its run takes the node's"
                );
                return None;
            }
            Err(e) => {
                tracing::error!(version = id, error = %e, "a workspace version could not be read");
                return None;
            }
        };
        match here.from_snapshot(&files) {
            Ok(pinned) => Some(Arc::new(ctx.with_agents(agents_of(&pinned)))),
            Err(e) => {
                tracing::error!(version = id, error = %e, "a workspace version no longer loads");
                None
            }
        }
    }));
    Ok(versions)
}

/// Opens the journal `[journal]` names: sled in `data_dir/journal`, or the
/// PostgreSQL schema (whose open may wait for the server, off this thread).
async fn open_journal(config: &JournalConfig, data_dir: &Path) -> Result<Journal, Error> {
    let JournalConfig::Postgres {
        url,
        schema,
        connect_for,
        node,
        lease,
    } = config
    else {
        return Ok(Journal::open(&data_dir.join("journal"))?);
    };
    let url = std::env::var("ARBOR_DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty())
        .or_else(|| url.clone())
        .ok_or_else(|| {
            Error::Start(
                "journal.backend = \"postgres\" needs a database: set ARBOR_DATABASE_URL \
                 (or journal.url in arbor.toml)"
                    .into(),
            )
        })?;
    let node = match node {
        Some(node) => node.clone(),
        None => node_id(),
    };
    let mut options = PgOptions::new(url, node);
    options.schema = schema.clone();
    options.connect_for = *connect_for;
    options.lease = *lease;
    tokio::task::spawn_blocking(move || Journal::open_postgres(&options))
        .await
        .map_err(|e| Error::Start(format!("opening the journal failed: {e}")))?
        .map_err(Error::from)
}

/// Resumes what `recovery` says to (and `resume` picks), carrying its
/// cards to the gate first: a resumed job may ask at once.
async fn resume_runs(
    node: &ActorRef<NodeMsg>,
    recovery: &RecoveryReport,
    resume: &impl Fn(&RunSpec, &arbor_actors::run::Resume) -> bool,
) -> Result<Vec<(RunId, RunSpec)>, String> {
    let mut resumed = vec![];
    for run in &recovery.runs {
        if let RunOutcome::Resume { spec, resume: plan } = &run.outcome
            && resume(spec, plan)
        {
            let (id, spec, resume) = (run.run, (**spec).clone(), plan.clone());
            let again = spec.clone();
            ractor::call!(node, |reply| NodeMsg::ResumeRun {
                id,
                spec,
                resume,
                reply
            })
            .map_err(|e| e.to_string())??;
            resumed.push((id, again));
        }
    }
    Ok(resumed)
}

/// A node on a shared journal, every third of its lease: takes the runs of
/// nodes whose lease has run out, recovers them as a restart would (I-51)
/// and goes on with them here. Ends with the lease.
async fn take_over(
    ctx: std::sync::Weak<NodeContext>,
    node: ActorRef<NodeMsg>,
    mut lost: tokio::sync::watch::Receiver<Option<String>>,
    every: std::time::Duration,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = lost.wait_for(|why| why.is_some()) => return,
        }
        // Ends with the node: it holds nothing of it between looks, so a
        // node that stops (or crashes) lets its journal close.
        let stopped = matches!(
            node.get_status(),
            ractor::ActorStatus::Stopping | ractor::ActorStatus::Stopped
        );
        let Some(ctx) = ctx.upgrade().filter(|_| !stopped) else {
            return;
        };
        let journal = ctx.journal.clone();
        let claimed = tokio::task::spawn_blocking(move || journal.claim_orphans(false)).await;
        let runs: Vec<RunId> = match claimed {
            Ok(Ok(Some(runs))) => runs.into_iter().map(|(run, _)| run).collect(),
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not look for runs to take over");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the look for runs to take over panicked");
                continue;
            }
        };
        if runs.is_empty() {
            continue;
        }
        tracing::info!(
            runs = runs.len(),
            "taking over the runs of a node whose lease ran out"
        );
        let recovery = match recovery::recover_runs(
            &ctx.journal,
            &ctx.events,
            ctx.limits.max_recoveries,
            Some(&runs),
        )
        .await
        {
            Ok(report) => report,
            Err(e) => {
                tracing::error!(error = %e, "recovering the runs taken over failed");
                continue;
            }
        };
        for breach in &recovery.breaches {
            tracing::error!(%breach, "a run taken over does not balance");
        }
        if let Some(gate) = ctx.gate.get() {
            let _ = gate.cast(arbor_actors::approvals::GateMsg::Carry {
                cards: recovery.carried_cards.clone(),
            });
        }
        if let Err(e) = resume_runs(&node, &recovery, &|_, _| true).await {
            tracing::error!(error = %e, "resuming a run taken over failed");
        }
    }
}

/// Recovery at a start. A shared journal: only the runs this node takes
/// over are its to recover (its own previous life's among them); sled's
/// are all its.
async fn recover_at_start(
    journal: &Journal,
    events: &EventBus,
    max_recoveries: u32,
) -> Result<RecoveryReport, Error> {
    let claimed: Option<Vec<RunId>> = journal
        .claim_orphans(true)?
        .map(|runs| runs.into_iter().map(|(run, _)| run).collect());
    Ok(recovery::recover_runs(journal, events, max_recoveries, claimed.as_deref()).await?)
}

/// Once the lease is lost, the node stops every run here: its commits are
/// refused already (I-50), and this ends its processes and late work.
async fn stop_when_lost(
    node: ActorRef<NodeMsg>,
    mut lost: tokio::sync::watch::Receiver<Option<String>>,
) {
    let why = match lost.wait_for(|why| why.is_some()).await {
        Ok(why) => why.clone().unwrap_or_default(),
        Err(_) => return,
    };
    tracing::error!(%why, "this node lost its lease: stopping its runs here");
    let _ = node
        .call(
            |reply| NodeMsg::StopAll {
                reason: format!("the node lost its lease: {why}"),
                reply,
            },
            Some(SHUTDOWN_GRACE),
        )
        .await;
}

/// This node's id when `--node-id` does not give one: `ARBOR_NODE_ID`, else
/// the host's name.
pub fn node_id() -> String {
    std::env::var("ARBOR_NODE_ID")
        .ok()
        .filter(|id| !id.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|name| name.into_string().ok())
        })
        .unwrap_or_else(|| "arbor".into())
}

impl EmbeddedNode {
    /// Opens the journal in `data_dir` and starts the actor tree with the
    /// workspace's models: the scripted one, and its providers'.
    pub async fn start(workspace: &Workspace, data_dir: &Path) -> Result<Self, Error> {
        let models = Arc::new(Models::new(&workspace.config.providers));
        Self::start_with(workspace, data_dir, models).await
    }

    /// As `start`, with the models an embedder (or a test) chooses.
    pub async fn start_with(
        workspace: &Workspace,
        data_dir: &Path,
        models: Arc<dyn ModelFactory>,
    ) -> Result<Self, Error> {
        Self::start_resuming(workspace, data_dir, models, |_, _| true).await
    }

    /// As `start_with`, resuming only the interrupted runs `resume` picks; the
    /// others stay interrupted (recovered, not resumed) for a later start.
    pub async fn start_resuming(
        workspace: &Workspace,
        data_dir: &Path,
        models: Arc<dyn ModelFactory>,
        resume: impl Fn(&RunSpec, &arbor_actors::run::Resume) -> bool,
    ) -> Result<Self, Error> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| Error::Start(format!("{}: {e}", data_dir.display())))?;
        let secrets = Arc::new(crate::secrets::load(workspace).map_err(Error::Start)?);
        let probe = start_probe(workspace);
        let journal = open_journal(&workspace.config.journal, data_dir).await?;
        let events = EventBus::new(journal.clone());
        // Before recovery: the ends it tells again are notified too.
        let notifications = crate::notify::Notifications::install(
            &workspace.config.notify,
            &secrets,
            &journal,
            &events,
        )
        .map_err(Error::Start)?;
        // Before recovery: the spans it closes are exported too.
        let telemetry = crate::telemetry::Telemetry::from_config(
            &workspace.config.telemetry,
            &events,
            journal.clone(),
            secrets.clone(),
        )
        .map_err(Error::Start)?
        .map(Arc::new);
        // Recovery before anything new starts (I-30 to I-35).
        let recovery =
            recover_at_start(&journal, &events, workspace.config.limits.max_recoveries).await?;
        let sandbox = Arc::new(
            probe
                .await
                .map_err(|e| Error::Start(format!("the sandbox probe failed: {e}")))?,
        );
        // Before any run: on a shared journal, a request of this node's
        // counts in every node's rate windows.
        models.share_rates(&journal);
        let ctx = Arc::new(node_context(
            workspace, data_dir, journal, events, models, sandbox, secrets,
        ));
        sweep_data_dir(&ctx);
        let versions = pin_versions(&ctx, workspace).await?;
        let args = NodeArgs {
            ctx: ctx.clone(),
            versions: versions.clone(),
        };
        let (node, join) = ractor::Actor::spawn(None, Node, args)
            .await
            .map_err(|e| Error::Start(format!("the node could not start: {e}")))?;
        // The gate before any run: a resumed job may ask at once.
        let (gate, _) = ractor::Actor::spawn_linked(
            None,
            Gate,
            GateArgs {
                journal: ctx.journal.clone(),
                events: ctx.events.clone(),
                settings: ctx.approvals.clone(),
                carried: recovery
                    .carried_cards
                    .iter()
                    .filter(|card| {
                        recovery.runs.iter().any(|r| {
                            r.run == card.run
                                && matches!(&r.outcome, RunOutcome::Resume { spec, resume: plan } if resume(spec, plan))
                        })
                    })
                    .cloned()
                    .collect(),
            },
            node.get_cell(),
        )
        .await
        .map_err(|e| Error::Start(format!("the approval gate could not start: {e}")))?;
        let _ = ctx.gate.set(gate);
        let resumed = resume_runs(&node, &recovery, &resume)
            .await
            .map_err(Error::Start)?;
        let lease_lost = match (ctx.journal.lease_lost(), &workspace.config.journal) {
            (Some(lost), JournalConfig::Postgres { lease, .. }) => {
                tokio::spawn(take_over(
                    Arc::downgrade(&ctx),
                    node.clone(),
                    lost.clone(),
                    *lease / 3,
                ));
                tokio::spawn(stop_when_lost(node.clone(), lost.clone()));
                Some(lost)
            }
            _ => None,
        };
        if let Some(notifications) = &notifications {
            notifications.deliver();
        }
        Ok(Self {
            ctx,
            versions,
            node,
            join: std::sync::Mutex::new(Some(join)),
            data_dir: data_dir.to_path_buf(),
            recovery,
            resumed,
            lease_lost,
            telemetry,
            notifications,
        })
    }

    /// Makes `workspace` a version this node runs (a reload, a rollback):
    /// kept in the journal first, then the runs admitted with it take its
    /// definitions (I-67). Runs of other versions keep theirs.
    pub async fn deploy(&self, workspace: &Workspace) -> Result<(), Error> {
        if let Some(row) = crate::versions::snapshot(&self.ctx.journal, workspace)? {
            self.ctx.journal.commit(vec![row]).await?;
        }
        if self.versions.get(&workspace.version).is_none() {
            let ctx = self.ctx.with_agents(agents_of(workspace));
            self.versions.insert(&workspace.version, Arc::new(ctx));
        }
        Ok(())
    }

    /// A run this node resumed reaches its wait for a person on its own
    /// time (its start runs beside a continue): until it waits on the
    /// interrupted step `record`, or has gone on without it, a continue
    /// would miss it. Waited for on its events; the bound is a safety net,
    /// not a clock.
    async fn settled_on(&self, record: &arbor_storage::JobRecord) {
        let job = record.id;
        let settled = |t: &Tree| {
            t.run_status().is_terminal()
                || matches!(&t.head().waiting,
                    Some(arbor_protocol::WaitingView::NeedsDecision { job: j, .. }) if *j == job)
                || t.nodes()
                    .any(|(_, n)| n.label == record.label && n.attempt > record.attempt)
        };
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            self.wait_tree(record.run, settled),
        )
        .await;
    }

    /// Continues a job a restart interrupted (I-33). A step its run waits on
    /// for a person (I-57) goes on in that run: its next attempt starts
    /// there, and the run's id comes back. Else a new run whose one step is
    /// the job's next attempt, on the job's request and grant. Explicit
    /// and idempotent: a second call returns the run the first one started.
    pub async fn continue_job(&self, job: JobId) -> Result<RunId, Error> {
        self.continue_job_with(job, None).await
    }

    /// `continue_job`, `audit` committed with the next attempt's record or
    /// the continuation's (I-64); a call that starts nothing commits none.
    pub async fn continue_job_with(
        &self,
        job: JobId,
        audit: Option<Record>,
    ) -> Result<RunId, Error> {
        let journal = &self.ctx.journal;
        let record = journal
            .all_jobs()?
            .into_iter()
            .find(|j| j.id == job)
            .ok_or_else(|| Error::Refused(format!("no step or job {job} in this journal")))?;
        if record.error_class != Some(arbor_protocol::ErrorClass::Interrupted) {
            return Err(Error::Refused(format!(
                "{job} is {}{}; only a job a restart interrupted can be continued",
                record.status,
                record
                    .error_class
                    .map(|c| format!(" ({c})"))
                    .unwrap_or_default()
            )));
        }
        // A step its own run, still going, has run again since (resumed, or
        // continued there by a person): that run took it over. Once that
        // run has ended, the step is continued by a run of its own (I-33).
        let live = journal
            .run(record.run)?
            .is_some_and(|r| !r.status.is_terminal());
        if live && self.resumed().iter().any(|(id, _)| *id == record.run) {
            self.settled_on(&record).await;
        }
        let taken_over = live
            && record.kind == arbor_protocol::NodeKind::Step
            && journal.jobs(record.run)?.iter().any(|j| {
                j.kind == arbor_protocol::NodeKind::Step
                    && j.label == record.label
                    && j.attempt > record.attempt
            });
        if taken_over {
            return Ok(record.run);
        }
        // I-57: its run waits for a person on this step: it goes on in place.
        if let Ok(Ok(())) = ractor::call!(self.node, |reply| NodeMsg::ContinueStep {
            run: record.run,
            job,
            audit: audit.clone(),
            reply
        }) {
            return Ok(record.run);
        }
        // A continuation already started is returned, not started again. One
        // recorded whose run never started (its start failed, or a crash came
        // between the record and the run) may be started afresh.
        let recorded = journal
            .delegations(job)?
            .into_iter()
            .find(|d| d.key == CONTINUE_KEY)
            .and_then(|d| d.digest.parse::<RunId>().ok());
        if let Some(run) = recorded
            && journal.run(run)?.is_some()
        {
            return Ok(run);
        }
        let history = journal.events(record.run)?;
        let origin = crate::recovery::started_spec(&history);
        let request = history
            .iter()
            .find_map(|e| match &e.kind {
                arbor_protocol::EventKind::JobSpawned { id, request, .. } if *id == job => {
                    Some(request.clone())
                }
                _ => None,
            })
            .filter(|r| !r.is_empty())
            // A kill can take a step's spawn event while its record, made
            // durable first (I-29), survives: its step's instruction is
            // in the run's spec.
            .or_else(|| step_instruction(&record, origin?))
            .ok_or_else(|| Error::Refused(format!("{job}: its request was not journaled")))?;
        let label = record.label.clone().unwrap_or_else(|| record.agent.clone());
        let spec = continuation(&record, &label, &request, origin);
        // The counts its limits made, from its journaled calls (I-45).
        let made = crate::recovery::tool_counts(&history)
            .remove(&job)
            .unwrap_or_default();
        let carried = arbor_actors::run::Carried {
            attempts: std::collections::HashMap::from([(label.clone(), record.attempt)]),
            tool_counts: std::collections::HashMap::from([(label, made)]),
            tape: None,
        };
        // Recorded before the run starts (I-29): a crash in between leaves a
        // record naming a run that never started, never two runs.
        let run = RunId::new();
        let record = |digest: String| {
            arbor_storage::Record::Delegation(arbor_storage::DelegationRecord {
                parent: job,
                key: CONTINUE_KEY.into(),
                digest,
                children: vec![],
                epoch: journal.epoch(),
            })
        };
        let mut records = vec![record(run.to_string())];
        records.extend(audit);
        journal.commit(records).await?;
        let started = ractor::call!(self.node, |reply| NodeMsg::StartRun {
            spec,
            id: Some(run),
            carried,
            reply
        })
        .map_err(|e| Error::Start(e.to_string()))
        .and_then(|r| r.map_err(Error::Refused));
        if let Err(e) = started {
            journal.commit(vec![record(String::new())]).await?;
            return Err(e);
        }
        Ok(run)
    }

    /// Approval cards, oldest first: of one run or all, in one state or any.
    /// Read from the journal, where a card is before anyone can see it.
    pub fn approvals(
        &self,
        run: Option<RunId>,
        state: Option<CardState>,
    ) -> Result<Vec<Card>, arbor_storage::Error> {
        let records = match run {
            Some(run) => self.ctx.journal.approvals(run)?,
            None => self.ctx.journal.all_approvals()?,
        };
        let mut cards: Vec<Card> = records
            .iter()
            .filter(|r| state.is_none_or(|s| r.state == s))
            .map(|r| r.card())
            .collect();
        cards.sort_by_key(|c| c.id);
        Ok(cards)
    }

    /// One card, by id.
    pub fn approval(&self, id: CardId) -> Result<Option<Card>, arbor_storage::Error> {
        Ok(self
            .ctx
            .journal
            .all_approvals()?
            .into_iter()
            .find(|r| r.id == id)
            .map(|r| r.card()))
    }

    /// A person's decision on a pending card (I-46): committed before the
    /// call it approves may run, refused whole if the card is closed, not
    /// known, or the decision is not whole.
    pub async fn decide(&self, id: CardId, decide: Decide) -> Result<Card, DecideError> {
        let known = self
            .approval(id)
            .map_err(|e| DecideError::Journal(e.to_string()))?
            .ok_or(DecideError::Unknown(id))?;
        if !known.state.is_pending() {
            return Err(DecideError::Closed {
                id,
                state: known.state,
            });
        }
        let Some(gate) = self.ctx.gate.get() else {
            return Err(DecideError::Invalid(
                "this node has no approval gate".into(),
            ));
        };
        match ractor::call!(gate, |reply| GateMsg::Decide {
            card: id,
            decide: Box::new(decide),
            reply
        }) {
            // Closed between the read above and the gate's turn, or pending
            // in a run this node does not run (not resumed by this start).
            Ok(Err(DecideError::Unknown(_))) => match self.approval(id) {
                Ok(Some(card)) if !card.state.is_pending() => Err(DecideError::Closed {
                    id,
                    state: card.state,
                }),
                _ => Err(DecideError::Idle(id)),
            },
            Ok(result) => result,
            Err(e) => Err(DecideError::Journal(format!(
                "the approval gate did not answer: {e}"
            ))),
        }
    }

    /// What recovery found and did when this node started.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// A node on a shared journal: resolves to why once it has lost its
    /// lease (its runs are stopped here then, and it commits nothing more);
    /// never, on a journal that is its alone.
    pub fn lease_lost(&self) -> impl Future<Output = String> + Send + 'static {
        let lost = self.lease_lost.clone();
        async move {
            let Some(mut lost) = lost else {
                return std::future::pending().await;
            };
            let why = match lost.wait_for(|why| why.is_some()).await {
                Ok(why) => why.clone(),
                Err(_) => None,
            };
            match why {
                Some(why) => why,
                None => std::future::pending().await,
            }
        }
    }

    /// Runs this start resumed, with their specs (I-34).
    pub fn resumed(&self) -> &[(RunId, RunSpec)] {
        &self.resumed
    }

    /// Stops the node the way a crash would: every actor killed at once, no
    /// stop handlers, nothing journaled on the way out. Processes the
    /// sandboxes started are killed as their state is dropped.
    pub async fn crash(self) {
        self.node.kill();
        if let Some(join) = self.take_join() {
            let _ = join.await;
        }
    }

    fn take_join(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.join.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The supervision tree, from the Node actor down, as it stands.
    pub fn actors(&self) -> ActorView {
        fn view(cell: &ractor::ActorCell) -> ActorView {
            ActorView {
                name: cell.get_name(),
                status: format!("{:?}", cell.get_status()),
                children: cell.get_children().iter().map(view).collect(),
            }
        }
        view(&self.node.get_cell())
    }

    /// The Node actor's cell, for a harness that awaits actors' exits (the
    /// benches); everything else reads `actors`.
    pub fn root_actor(&self) -> ractor::ActorCell {
        self.node.get_cell()
    }

    /// What this node's sandboxes are: sealed, or not and why.
    /// The node's rate windows (a provider's `rpm` and `tpm`, I-65): what
    /// each may hold and holds now.
    pub fn limits(&self) -> Vec<arbor_protocol::RateView> {
        self.ctx.models.limits()
    }

    /// Each bounded agent's job slots: (agent, limit, running, waiting).
    pub fn agent_slots(&self) -> Vec<arbor_actors::slots::SlotView> {
        self.ctx.slots.view()
    }

    pub fn sandbox(&self) -> SandboxPosture {
        let posture = &self.ctx.sandbox;
        SandboxPosture {
            mode: match posture.mode {
                SandboxIsolation::Sealed => "sealed",
                SandboxIsolation::None => "none",
            }
            .into(),
            sealed: posture.sealed,
            detail: posture.detail.clone(),
        }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn events(&self) -> &EventBus {
        &self.ctx.events
    }

    /// Forgets finished runs whole (retention, `keep_finished`): their
    /// records in one append, their trees, and their workdirs on this
    /// node's disk. Blocking; a workdir that cannot be removed is reported
    /// and left for the next start's sweep.
    pub fn forget_runs(&self, runs: &[RunId]) -> Result<(), arbor_storage::Error> {
        self.ctx.journal.forget(runs)?;
        self.ctx.events.forget(runs);
        for run in runs {
            remove_workdir(&self.ctx.work_root, *run);
        }
        Ok(())
    }

    pub fn journal(&self) -> &Journal {
        &self.ctx.journal
    }

    pub fn context(&self) -> &Arc<NodeContext> {
        &self.ctx
    }

    pub async fn start_run(&self, spec: RunSpec) -> Result<RunId, Error> {
        self.start_run_as(None, spec).await
    }

    /// As `start_run`, under an id the caller chose and journaled first (a
    /// queued submission): a second start of the same id is refused.
    pub async fn start_run_as(&self, id: Option<RunId>, spec: RunSpec) -> Result<RunId, Error> {
        self.start_carrying(id, spec, Default::default()).await
    }

    /// Starts a replay (`spec.replay` set) of the recording `tape`
    /// (what `arbor_runtime::replay` checked first).
    pub async fn start_replay(
        &self,
        spec: RunSpec,
        tape: Arc<arbor_protocol::tape::Tape>,
    ) -> Result<RunId, Error> {
        let carried = arbor_actors::run::Carried {
            tape: Some(tape),
            ..Default::default()
        };
        self.start_carrying(None, spec, carried).await
    }

    async fn start_carrying(
        &self,
        id: Option<RunId>,
        spec: RunSpec,
        carried: arbor_actors::run::Carried,
    ) -> Result<RunId, Error> {
        // I-27: a run needing a secret the node has no value for never starts.
        let steps = spec
            .groups
            .iter()
            .flat_map(|g| &g.steps)
            .map(|s| s.agent.as_str());
        if let Some(why) =
            crate::secrets::missing(&self.ctx.agents, steps, &self.ctx.mcp, &self.ctx.secrets)
        {
            return Err(Error::Refused(why));
        }
        ractor::call!(self.node, |reply| NodeMsg::StartRun {
            spec,
            id,
            carried,
            reply
        })
        .map_err(|e| Error::Start(e.to_string()))?
        .map_err(Error::Refused)
    }

    /// Ends a run that never started (stopped in a queue, or refused at its
    /// start): its `RunRecord` is committed together with `with` (the
    /// caller's own rows, say the queue's), then a `RunFinished` is emitted,
    /// so that every reader sees it end. `spec` is None when the caller could
    /// not read it back.
    pub async fn end_unstarted(
        &self,
        run: RunId,
        spec: Option<&RunSpec>,
        (status, error_class, reason): (Status, Option<ErrorClass>, &str),
        with: Vec<Record>,
    ) -> Result<(), arbor_storage::Error> {
        let journal = &self.ctx.journal;
        let record = RunRecord {
            id: run,
            flow: spec.map(|s| s.flow.clone()).unwrap_or_default(),
            budget_tokens: spec.map(|s| s.budget_tokens).unwrap_or_default(),
            status,
            error_class,
            reason: Some(reason.to_string()),
            output_json: "null".into(),
            epoch: journal.epoch(),
        };
        let mut records = with;
        records.push(Record::Run(record));
        journal.commit(records).await?;
        self.ctx.events.emit(
            run,
            EventKind::RunFinished {
                limitations: Vec::new(),
                status,
                error_class,
                reason: Some(reason.to_string()),
                output: serde_json::Value::Null,
            },
        );
        Ok(())
    }

    pub async fn stop_run(&self, run: RunId, reason: &str) -> Result<(), Error> {
        self.stop_run_with(run, reason, None).await
    }

    /// `stop_run`, `audit` (an entry of the service's audit log, I-64)
    /// committed with the run's end. The same for the `_with`s below: the
    /// entry goes into the append of the change it asks for.
    pub async fn stop_run_with(
        &self,
        run: RunId,
        reason: &str,
        audit: Option<Record>,
    ) -> Result<(), Error> {
        let reason = reason.to_string();
        ractor::call!(self.node, |reply| NodeMsg::StopRun {
            run,
            reason,
            audit,
            reply
        })
        .map_err(|e| Error::Start(e.to_string()))?
        .map_err(Error::Refused)
    }

    /// Raises a running run's root grant by `amount` (a top-up, I-58),
    /// journaled (with `audit`, I-64) before it is told: the run's new
    /// figures in tokens.
    pub async fn top_up(
        &self,
        run: RunId,
        amount: arbor_protocol::Amount,
        audit: Option<Record>,
    ) -> Result<arbor_protocol::AccountView, Error> {
        ractor::call!(self.node, |reply| NodeMsg::TopUp {
            run,
            amount,
            audit,
            reply
        })
        .map_err(|e| Error::Start(e.to_string()))?
        .map_err(Error::Refused)
    }

    pub async fn stop_job(&self, run: RunId, job: JobId, reason: &str) -> Result<(), Error> {
        self.stop_job_with(run, job, reason, None).await
    }

    pub async fn stop_job_with(
        &self,
        run: RunId,
        job: JobId,
        reason: &str,
        audit: Option<Record>,
    ) -> Result<(), Error> {
        let reason = reason.to_string();
        ractor::call!(self.node, |reply| NodeMsg::StopJob {
            run,
            job,
            reason,
            audit,
            reply
        })
        .map_err(|e| Error::Start(e.to_string()))?
        .map_err(Error::Refused)
    }

    pub async fn steer(&self, job: JobId, text: &str) -> Result<u64, Refusal> {
        self.steer_with(job, text, None).await
    }

    pub async fn steer_with(
        &self,
        job: JobId,
        text: &str,
        audit: Option<Record>,
    ) -> Result<u64, Refusal> {
        let text = text.to_string();
        match ractor::call!(self.node, |reply| NodeMsg::Steer {
            job,
            text,
            audit,
            reply
        }) {
            Ok(result) => result,
            Err(e) => Err(Refusal::Invalid {
                message: e.to_string(),
            }),
        }
    }

    /// The run's tree now (empty if nothing of it was seen yet).
    pub fn tree(&self, run: RunId) -> Tree {
        self.ctx.events.tree(run).unwrap_or_else(|| Tree::new(run))
    }

    /// Waits until `done` holds of the run's tree, re-checking after every event.
    pub async fn wait_tree(&self, run: RunId, mut done: impl FnMut(&Tree) -> bool) -> Tree {
        let mut changes = self.ctx.events.changes();
        loop {
            let tree = self.tree(run);
            if done(&tree) {
                return tree;
            }
            if changes.changed().await.is_err() {
                return tree;
            }
        }
    }

    /// Waits for the run to end and returns its final tree. Woken only by
    /// runs' ends, not by every event.
    pub async fn wait_run(&self, run: RunId) -> Tree {
        let mut ends = self.ctx.events.ends();
        loop {
            let ended = self.ctx.events.with_tree(run, |tree| {
                tree.is_some_and(|tree| tree.run_status().is_terminal())
            });
            if ended || ends.changed().await.is_err() {
                return self.tree(run);
            }
        }
    }

    /// Stops every run as an operator's stop would (each subtree stopped,
    /// every process killed, every account settled and journaled), then the
    /// node, and flushes the journal. A run that does not end within
    /// `SHUTDOWN_GRACE` is killed: what it did not journal, recovery will.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.close().await
    }

    /// `shutdown`, for a process that exits right after: once the node is
    /// stopped and its journal synced, what it built in memory (a wide
    /// run's tree, the journal's queues, every record not yet in sled) is
    /// left for the exit to reclaim instead of being freed piece by piece,
    /// which took a 1,088-job run 5 ms. Nothing durable depends on it: the
    /// log holds every append, and the next open applies what sled lacks.
    pub async fn shutdown_for_exit(self) -> Result<(), Error> {
        self.close().await?;
        self.ctx.journal.flush_store()?;
        std::mem::forget(self);
        Ok(())
    }

    /// On a shared journal, in place of `close`: the node's runs are
    /// stopped here without a word to the journal (it refuses every write
    /// from now on), so they stand as a crash leaves them, and the lease
    /// ends: another node takes them at its next look and resumes them
    /// (I-51).
    /// `false`: the journal is the node's alone; nothing was done.
    pub async fn hand_over(&self) -> bool {
        if !self.ctx.journal.hand_over() {
            return false;
        }
        tracing::info!("handing this node's runs to the other nodes");
        // The journal refuses the stop's records: that is the point.
        let _ = self.close().await;
        if let Err(error) = self.ctx.journal.flush_store() {
            tracing::warn!(%error, "ending the lease");
        }
        true
    }

    /// `shutdown` through a shared handle (the service holds the node in an
    /// `Arc`). Afterwards the node takes no more runs; a second call only
    /// flushes the journal again.
    pub async fn close(&self) -> Result<(), Error> {
        let Some(join) = self.take_join() else {
            self.ctx.journal.flush().await?;
            return Ok(());
        };
        let stopped = self.node.call(
            |reply| NodeMsg::StopAll {
                reason: "the node is shutting down".into(),
                reply,
            },
            Some(SHUTDOWN_GRACE),
        );
        if !matches!(stopped.await, Ok(ractor::rpc::CallResult::Success(()))) {
            tracing::warn!("runs did not stop within the shutdown grace; killing them");
        }
        self.node.stop_children(Some("node shutdown".into()));
        self.node.stop(Some("node shutdown".into()));
        let _ = join.await;
        if let Some(notifications) = &self.notifications {
            notifications.stop().await;
        }
        // The process ends without waiting for sled to take the last
        // appends: the log holds them, synced, and the next open applies
        // them (docs/journal.md, "Closing").
        self.ctx.journal.leave_unapplied_at_close();
        self.ctx.journal.flush().await?;
        if let Some(telemetry) = &self.telemetry {
            telemetry.shutdown().await;
        }
        Ok(())
    }

    /// What telemetry exported and lost; `None` when it is off.
    pub fn telemetry(&self) -> Option<crate::telemetry::TelemetryStats> {
        self.telemetry.as_ref().map(|t| t.stats())
    }

    /// The node's notifications (`[notify]`); `None` without endpoints.
    pub fn notifications(&self) -> Option<&crate::notify::Notifications> {
        self.notifications.as_deref()
    }
}

/// The sandbox probe (one sealed `true`), started: it runs its process while
/// the journal opens and recovery runs, since nothing of those needs its
/// answer, and it was the larger part of a start. Only where a command could
/// run: the probe's fork and exec were a sixth of a one-job `arbor run`
/// (docs/benchmarks.md, S), and a workspace whose agents have no `exec`, no
/// MCP server and no hook has nothing to seal (its agents are fixed for the node's
/// life).
fn start_probe(workspace: &Workspace) -> tokio::task::JoinHandle<Posture> {
    let mode = workspace.config.isolation;
    let seals = workspace.agents.values().any(|agent| {
        agent.tools.contains(&ToolName::Exec)
            || !agent.mcp.is_empty()
            || agent.hooks.before_call.is_some()
    });
    tokio::spawn(async move {
        match mode {
            SandboxIsolation::Sealed if !seals => Posture::not_probed(),
            _ => Posture::probe(mode).await,
        }
    })
}

/// After recovery, before anything new starts: the root folders a crash
/// left (their commands died with the node, or recovery just killed them),
/// and the workdirs of runs the journal no longer knows.
fn sweep_data_dir(ctx: &NodeContext) {
    if let Err(e) = std::fs::remove_dir_all(&ctx.sandbox_roots)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, "could not sweep the sandboxes' root folders");
    }
    sweep_forgotten_workdirs(&ctx.journal, &ctx.work_root);
}

/// Removes a forgotten run's workdirs (`work/<run>/`, every job's below it).
fn remove_workdir(work_root: &Path, run: RunId) {
    let dir = work_root.join(run.to_string());
    if let Err(e) = std::fs::remove_dir_all(&dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, dir = %dir.display(), "could not remove a forgotten run's workdir");
    }
}

/// At start, before any run: removes the workdirs of runs the journal no
/// longer knows (a crash between a forget and its removal, another node's
/// forget on a shared journal). A folder that is not a run's is left alone.
fn sweep_forgotten_workdirs(journal: &Journal, work_root: &Path) {
    let Ok(entries) = std::fs::read_dir(work_root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(run) = name.to_str().and_then(|n| n.parse::<RunId>().ok()) else {
            continue;
        };
        if name.to_str() != Some(run.to_string().as_str()) {
            continue;
        }
        match journal.run(run) {
            Ok(None) => remove_workdir(work_root, run),
            Ok(Some(_)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "could not sweep forgotten workdirs");
                return;
            }
        }
    }
}

/// The instruction of step `record` in its run's spec.
fn step_instruction(record: &arbor_storage::JobRecord, spec: &RunSpec) -> Option<String> {
    if record.kind != arbor_protocol::NodeKind::Step {
        return None;
    }
    let label = record.label.as_deref()?;
    spec.step(label).map(|step| step.instruction.clone())
}

/// The one-step run that continues `record` (a job a restart interrupted)
/// on its `request` and grant, in its run's tenant with its instructions
/// (I-63): those of `origin`, the spec its run started with.
fn continuation(
    record: &arbor_storage::JobRecord,
    label: &str,
    request: &str,
    origin: Option<&RunSpec>,
) -> RunSpec {
    RunSpec {
        budget_usd_micros: None,
        flow: format!("continue:{}", record.id),
        groups: vec![arbor_protocol::FlowGroup {
            peers: false,
            steps: vec![arbor_protocol::StepSpec {
                agent: record.agent.clone(),
                instruction: format!(
                    "{request}\n\n(An earlier attempt was interrupted when the node restarted.)"
                ),
                label: Some(label.to_string()),
                retries: Some(0),
                optional: false,
                retry: None,
                rerun_interrupted: None,
                on_fail: None,
                approve: false,
                until: None,
            }],
        }],
        budget_tokens: record.grant_tokens,
        timeout: None,
        record: false,
        replay: None,
        digests: Default::default(),
        tenant: origin.and_then(|s| s.tenant.clone()),
        instructions: origin.and_then(|s| s.instructions.clone()),
        verify: None,
        pause: origin.and_then(|s| s.pause),
        priority: origin.and_then(|s| s.priority),
        input: origin.and_then(|s| s.input.clone()),
        schedule: origin.and_then(|s| s.schedule.clone()),
        version: origin.and_then(|s| s.version.clone()),
    }
}
