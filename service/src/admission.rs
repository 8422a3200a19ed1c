//! The admission queue: at most `max_running_runs` runs at once; the rest
//! wait, in arrival order, as `SubmissionRecord`s in the journal, so a
//! restart finds them again. Idempotency keys live in the same records.
//!
//! Invariants:
//! 1. A submission is committed before it is acknowledged: a 201 means the
//!    run will start, after any restart.
//! 2. A run gets its id at submission, and the node refuses to start an id
//!    twice, so a crash between starting a run and marking its submission
//!    `Started` never starts it again: at boot, a queued submission whose
//!    run has a `RunRecord` is marked started.
//! 3. One lock covers checking a key and committing its submission, so two
//!    requests with the same key make one run.
//!
//! On a shared journal (PostgreSQL) the queue is the database's, shared by
//! every node: a submission through any node queues the run there, and
//! each node takes queued runs as it has room (`Journal::claim_queued`,
//! each run once per epoch), woken by the database's notification of a
//! submission, and by the clock (`SHARED_POLL`) should one be lost. The
//! in-memory queue is then unused.

use crate::submission::{self, SubmissionRecord, SubmissionState};
use arbor_protocol::{ErrorClass, EventKind, RunId, RunSpec, Status};
use arbor_runtime::EmbeddedNode;
use axum::http::StatusCode;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::{Mutex, Notify};

/// How often a node looks at a shared queue without being told of a
/// submission: the fallback for a notification lost with a connection.
const SHARED_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// What a submission came to.
pub enum Submitted {
    /// A new run, queued.
    New(RunId),
    /// The same key and body as an earlier request: its run.
    Replayed(RunId),
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("idempotency key {0:?} was used for another request body; nothing changed")]
    KeyConflict(String),
    #[error("the queue is full ({0} runs waiting); try again later")]
    QueueFull(usize),
    #[error("the node is shutting down and takes no new runs")]
    Closed,
    #[error(transparent)]
    Journal(#[from] arbor_storage::Error),
}

/// Where a submitted run is, for the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Waiting; `position` 0 starts next.
    Queued { position: usize },
    /// Handed to the node (running or ended): the tree is the truth.
    Started,
    /// Stopped before it started.
    Cancelled,
}

pub struct Admission {
    node: Arc<EmbeddedNode>,
    /// Moves on at a submission through any node: the queue is the shared
    /// journal's. `None`: the queue is this node's own.
    shared: Option<tokio::sync::watch::Receiver<u64>>,
    max_running: usize,
    max_queued: usize,
    state: Mutex<State>,
    /// Notified by a submission, a close, and every run's end.
    wake: Arc<Notify>,
}

struct State {
    queue: VecDeque<SubmissionRecord>,
    running: HashSet<RunId>,
    /// Every idempotency key ever used: (digest, run).
    keys: HashMap<String, (String, RunId)>,
    next_order: u64,
    closed: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Admission {
    /// Reads the journal's submissions (invariant 2) and counts the runs the
    /// node resumed as running.
    pub fn open(
        node: Arc<EmbeddedNode>,
        max_running: usize,
        max_queued: usize,
    ) -> Result<Arc<Self>, arbor_storage::Error> {
        let journal = node.journal();
        let shared = journal.woken();
        let mut queue = VecDeque::new();
        let mut keys = HashMap::new();
        let mut next_order = 0;
        let mut started_late = vec![];
        for mut sub in submission::submissions(journal)? {
            next_order = next_order.max(sub.order + 1);
            if let Some(key) = &sub.idempotency_key {
                keys.insert(key.clone(), (sub.digest.clone(), sub.run));
            }
            if sub.state == SubmissionState::Queued && shared.is_none() {
                if journal.run(sub.run)?.is_some() {
                    sub.state = SubmissionState::Started;
                    sub.epoch = journal.epoch();
                    started_late.push(sub.record()?);
                } else {
                    queue.push_back(sub);
                }
            }
        }
        journal.append(started_late)?;
        let running = node.resumed().iter().map(|(id, _)| *id).collect();
        // A run that ends frees a slot: the pump looks again only then, not
        // at every event.
        let wake = Arc::new(Notify::new());
        {
            let wake = wake.clone();
            node.events().observe(Arc::new(move |event| {
                if matches!(event.kind, EventKind::RunFinished { .. }) {
                    wake.notify_one();
                }
            }));
        }
        Ok(Arc::new(Self {
            node,
            shared,
            max_running,
            max_queued,
            state: Mutex::new(State {
                queue,
                running,
                keys,
                next_order,
                closed: false,
            }),
            wake,
        }))
    }

    /// Queues a run (invariants 1 and 3), the call's audit entry committed
    /// with it (I-64).
    pub async fn submit(
        &self,
        spec: &RunSpec,
        key: Option<String>,
        digest: String,
        audit: Option<&crate::audit::Audit>,
    ) -> Result<Submitted, SubmitError> {
        let mut state = self.state.lock().await;
        if let Some(key) = &key
            && let Some((seen, run)) = state.keys.get(key)
        {
            return if *seen == digest {
                Ok(Submitted::Replayed(*run))
            } else {
                Err(SubmitError::KeyConflict(key.clone()))
            };
        }
        if state.closed {
            return Err(SubmitError::Closed);
        }
        let journal = self.node.journal();
        let waiting = match journal.queued_runs()? {
            Some(shared) => shared.len(),
            None => state.queue.len(),
        };
        if waiting >= self.max_queued {
            return Err(SubmitError::QueueFull(waiting));
        }
        let sub = SubmissionRecord {
            run: RunId::new(),
            order: state.next_order,
            spec_json: serde_json::to_string(spec).unwrap_or_default(),
            idempotency_key: key.clone(),
            digest: digest.clone(),
            submitted_ms: now_ms(),
            state: SubmissionState::Queued,
            epoch: journal.epoch(),
        };
        let mut records = vec![sub.record()?];
        records.extend(audit.and_then(|a| a.take(Some(sub.run.to_string()), StatusCode::CREATED)));
        journal.commit(records).await?;
        state.next_order += 1;
        let run = sub.run;
        if let Some(key) = key {
            state.keys.insert(key, (digest, run));
        }
        if self.shared.is_none() {
            state.queue.push_back(sub);
        }
        drop(state);
        self.wake.notify_one();
        Ok(Submitted::New(run))
    }

    /// Frees the idempotency keys of runs the journal has forgotten
    /// (retention): a request that carries one again is a new run.
    pub async fn forget_keys(&self, keys: &[String]) {
        let mut state = self.state.lock().await;
        for key in keys {
            state.keys.remove(key);
        }
    }

    /// Where `run` is, if the service knows it as a submission.
    pub async fn place(&self, run: RunId) -> Option<Place> {
        let state = self.state.lock().await;
        if let Some(position) = state.queue.iter().position(|s| s.run == run) {
            return Some(Place::Queued { position });
        }
        drop(state);
        if let Ok(Some(shared)) = self.node.journal().queued_runs()
            && let Some(position) = shared.iter().position(|queued| *queued == run)
        {
            return Some(Place::Queued { position });
        }
        match submission::submission(self.node.journal(), run)
            .ok()
            .flatten()?
            .state
        {
            SubmissionState::Queued | SubmissionState::Started => Some(Place::Started),
            SubmissionState::Cancelled { .. } => Some(Place::Cancelled),
        }
    }

    /// The runs waiting, in order.
    pub async fn queued(&self) -> Result<Vec<SubmissionRecord>, arbor_storage::Error> {
        let journal = self.node.journal();
        match journal.queued_runs()? {
            Some(shared) => Ok(shared
                .into_iter()
                .filter_map(|run| submission::submission(journal, run).ok().flatten())
                .collect()),
            None => Ok(self.state.lock().await.queue.iter().cloned().collect()),
        }
    }

    /// (queued, running here).
    pub async fn counts(&self) -> Result<(usize, usize), arbor_storage::Error> {
        let shared = self.node.journal().queued_runs()?;
        let state = self.state.lock().await;
        let queued = shared.map_or(state.queue.len(), |queued| queued.len());
        Ok((queued, state.running.len()))
    }

    /// Takes a queued run out of the queue: it ends stopped, never started,
    /// the call's audit entry committed with its end. `false` if it was not
    /// queued (it started meanwhile, or never was).
    pub async fn cancel(
        &self,
        run: RunId,
        reason: &str,
        audit: Option<&crate::audit::Audit>,
    ) -> Result<bool, arbor_storage::Error> {
        if self.shared.is_some() {
            return self.cancel_shared(run, reason, audit).await;
        }
        let mut state = self.state.lock().await;
        let Some(at) = state.queue.iter().position(|s| s.run == run) else {
            return Ok(false);
        };
        let mut sub = state.queue.remove(at).expect("position is in the queue");
        drop(state);
        sub.state = SubmissionState::Cancelled {
            reason: reason.to_string(),
        };
        let audit = audit.and_then(|a| a.take(None, StatusCode::ACCEPTED));
        self.end_unstarted(sub, Status::Stopped, None, reason, audit)
            .await?;
        Ok(true)
    }

    /// A shared queue's run is this node's to end once it has claimed it:
    /// then no other node can start it.
    async fn cancel_shared(
        &self,
        run: RunId,
        reason: &str,
        audit: Option<&crate::audit::Audit>,
    ) -> Result<bool, arbor_storage::Error> {
        let journal = self.node.journal();
        if journal
            .claim_queued(1, Some(run))?
            .unwrap_or_default()
            .is_empty()
        {
            return Ok(false);
        }
        let Some(mut sub) = submission::submission(journal, run)? else {
            self.end_lost(run).await;
            return Ok(true);
        };
        sub.state = SubmissionState::Cancelled {
            reason: reason.to_string(),
        };
        let audit = audit.and_then(|a| a.take(None, StatusCode::ACCEPTED));
        self.end_unstarted(sub, Status::Stopped, None, reason, audit)
            .await?;
        Ok(true)
    }

    /// Ends a run claimed from a shared queue whose submission is not in
    /// the journal (retention took it): there is nothing to start.
    async fn end_lost(&self, run: RunId) {
        let reason = "its submission is no longer in the journal";
        tracing::warn!(%run, reason, "a queued run cannot start");
        if let Err(error) = self
            .node
            .end_unstarted(
                run,
                None,
                (Status::Failed, Some(ErrorClass::Start), reason),
                vec![],
            )
            .await
        {
            tracing::error!(%error, "could not journal a run that failed to start");
        }
    }

    /// Takes no more submissions and starts nothing more; what is queued
    /// stays queued in the journal for the next start.
    pub async fn close(&self) {
        self.state.lock().await.closed = true;
        self.wake.notify_one();
    }

    pub async fn is_closed(&self) -> bool {
        self.state.lock().await.closed
    }

    /// The runs started by the queue (or resumed at boot) and not yet ended.
    pub async fn running(&self) -> Vec<RunId> {
        self.state.lock().await.running.iter().copied().collect()
    }

    /// Starts queued runs while there is room, until closed. Wakes on a
    /// submission and on a run's end (a `Notify` keeps one wake-up that
    /// comes while it is busy, so none is lost).
    pub async fn pump(self: Arc<Self>) {
        let mut woken = self.shared.clone();
        if let Some(woken) = &mut woken {
            woken.mark_unchanged();
        }
        while self.admit_ready().await {
            match &mut woken {
                None => self.wake.notified().await,
                Some(woken) => {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        changed = woken.changed() => {
                            if changed.is_err() {
                                tokio::time::sleep(SHARED_POLL).await;
                            }
                        }
                        _ = tokio::time::sleep(SHARED_POLL) => {}
                    }
                }
            }
        }
    }

    /// One round of admission; `false` once closed.
    async fn admit_ready(&self) -> bool {
        if self.shared.is_some() {
            return self.admit_shared().await;
        }
        loop {
            let next = {
                let mut state = self.state.lock().await;
                if state.closed {
                    return false;
                }
                let events = self.node.events();
                state.running.retain(|run| {
                    !events.with_tree(*run, |t| t.is_some_and(|t| t.run_status().is_terminal()))
                });
                if state.running.len() >= self.max_running {
                    return true;
                }
                let Some(sub) = state.queue.pop_front() else {
                    return true;
                };
                state.running.insert(sub.run);
                sub
            };
            self.start(next).await;
        }
    }

    /// One round of a shared queue's admission: claims as many runs as
    /// there is room for, and starts them.
    async fn admit_shared(&self) -> bool {
        loop {
            let room = {
                let mut state = self.state.lock().await;
                if state.closed {
                    return false;
                }
                let events = self.node.events();
                state.running.retain(|run| {
                    !events.with_tree(*run, |t| t.is_some_and(|t| t.run_status().is_terminal()))
                });
                self.max_running.saturating_sub(state.running.len())
            };
            if room == 0 {
                return true;
            }
            let journal = self.node.journal();
            let claimed = match journal.claim_queued(room, None) {
                Ok(claimed) => claimed.unwrap_or_default(),
                Err(error) => {
                    tracing::warn!(%error, "could not take queued runs");
                    return true;
                }
            };
            if claimed.is_empty() {
                return true;
            }
            for (run, _) in claimed {
                match submission::submission(journal, run) {
                    Ok(Some(sub)) => {
                        self.state.lock().await.running.insert(run);
                        self.start(sub).await;
                    }
                    Ok(None) => self.end_lost(run).await,
                    Err(error) => {
                        // It stays this node's, not begun: should the node
                        // die, the run goes back to the queue.
                        tracing::error!(%error, %run, "could not read a claimed submission");
                        return true;
                    }
                }
            }
        }
    }

    async fn start(&self, mut sub: SubmissionRecord) {
        let journal = self.node.journal();
        let spec: Result<RunSpec, _> = serde_json::from_str(&sub.spec_json);
        let started = match spec {
            Ok(spec) => self
                .node
                .start_run_as(Some(sub.run), spec)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(format!("its journaled spec does not decode: {e}")),
        };
        match started {
            Ok(_) => {
                sub.state = SubmissionState::Started;
                sub.epoch = journal.epoch();
                if let Err(error) = sub.record().and_then(|r| journal.append(vec![r])) {
                    // The RunRecord exists: the next boot marks it started (invariant 2).
                    tracing::warn!(%error, "could not mark a submission started");
                }
            }
            // Refused because it has a record: it did start (invariant 2);
            // its record, not this refusal, is the truth.
            Err(_) if matches!(journal.run(sub.run), Ok(Some(_))) => {
                sub.state = SubmissionState::Started;
                sub.epoch = journal.epoch();
                let _ = sub.record().and_then(|r| journal.append(vec![r]));
            }
            Err(reason) => {
                self.state.lock().await.running.remove(&sub.run);
                tracing::warn!(run = %sub.run, %reason, "a queued run could not start");
                sub.state = SubmissionState::Cancelled {
                    reason: reason.clone(),
                };
                let reason = format!("it could not start: {reason}");
                if let Err(error) = self
                    .end_unstarted(sub, Status::Failed, Some(ErrorClass::Start), &reason, None)
                    .await
                {
                    tracing::error!(%error, "could not journal a run that failed to start");
                }
            }
        }
    }

    /// Ends a run that never started: its submission, a terminal
    /// `RunRecord`, and a `RunFinished` event, so that every reader (the
    /// run document, the list, the event stream) sees it end.
    async fn end_unstarted(
        &self,
        mut sub: SubmissionRecord,
        status: Status,
        error_class: Option<ErrorClass>,
        reason: &str,
        audit: Option<arbor_storage::Record>,
    ) -> Result<(), arbor_storage::Error> {
        let spec: Option<RunSpec> = serde_json::from_str(&sub.spec_json).ok();
        sub.epoch = self.node.journal().epoch();
        let mut records = vec![sub.record()?];
        records.extend(audit);
        self.node
            .end_unstarted(
                sub.run,
                spec.as_ref(),
                (status, error_class, reason),
                records,
            )
            .await?;
        Ok(())
    }
}
