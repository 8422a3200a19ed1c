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
//! each run once per epoch), chosen under the queue's lock from what every
//! node queues and runs (`dispatch`), woken by the database's notification
//! of a submission, and by the clock (`SHARED_POLL`) should one be lost.
//! The in-memory queue is then unused.
//!
//! A tenant with a quota (`quota.rs`, I-65) has its run's ceiling reserved
//! at submission, in the same commit, and is refused with 429 when a window
//! has no room; a tenant with `on_quota = "queue"` waits in the queue
//! instead, reserved just before it starts, while other tenants' runs pass
//! it. A run's end settles its entry (`settle_ended`).
//!
//! Which queued run starts next (a local queue): tenants take turns by
//! start-time fair queuing, each start moving its tenant's turn on by
//! 1/`weight`, so a tenant that floods the queue delays only itself;
//! within a tenant, the lowest `priority`, then the oldest. A run whose
//! tenant or flow is at its `[limits.concurrency]` bound is passed over.

use crate::dispatch;
use crate::quota::{self, Demand, Ledger, Over, QuotaEntry};
use crate::submission::{self, SubmissionRecord, SubmissionState};
use arbor_protocol::{ErrorClass, EventKind, RunId, RunSpec, Status};
use arbor_runtime::EmbeddedNode;
use arbor_runtime::workspace::{OnQuota, Quota};
use arbor_storage::{Exclusive, Record};
use axum::http::StatusCode;
use std::collections::{BTreeMap, HashMap, VecDeque};
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
    #[error(
        "tenant {tenant}'s {} quota has no room for this run now; try again in {} s",
        over.window.name(),
        over.retry_after_s()
    )]
    Quota { tenant: String, over: Over },
    #[error("tenant {tenant}'s quota refuses this run: {why}")]
    QuotaNever { tenant: String, why: String },
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
    policy: Policy,
    state: Mutex<State>,
    /// Notified by a submission, a close, and every run's end.
    wake: Arc<Notify>,
    /// A shared queue's runs seen so far (queued or running on any node):
    /// their keys, priority and demand, read once from their submissions.
    seen: Mutex<HashMap<RunId, Queued>>,
}

struct State {
    queue: VecDeque<SubmissionRecord>,
    /// The runs started here (or resumed) and not yet seen to end, by key.
    running: HashMap<RunId, Slot>,
    /// Every idempotency key ever used: (digest, run).
    keys: HashMap<String, (String, RunId)>,
    next_order: u64,
    closed: bool,
    /// What every tenant's runs reserved from its quota windows.
    ledger: Ledger,
    /// Each queued run's keys, and what it has yet to reserve.
    queued: HashMap<RunId, Queued>,
    /// Each tenant's turn (its next run's virtual start), and the virtual
    /// time of the last start: a tenant back from idle starts there, not
    /// behind, so it cannot take a burst of turns it did not wait for.
    turns: HashMap<String, f64>,
    virtual_now: f64,
}

/// What admission is told by arbor.toml: quotas, weights, concurrency.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Each tenant's quota, for those that have one.
    pub quotas: BTreeMap<String, (Quota, OnQuota)>,
    /// Each tenant's weight (1 when not named).
    pub weights: BTreeMap<String, u32>,
    /// `[limits.concurrency]`.
    pub per_tenant: Option<u32>,
    pub per_flow: BTreeMap<String, u32>,
}

impl Policy {
    pub fn of(workspace: &arbor_runtime::Workspace) -> Self {
        let concurrency = &workspace.config.limits.concurrency;
        Policy {
            quotas: workspace.quotas(),
            weights: workspace
                .tenant_names()
                .into_iter()
                .filter_map(|name| Some((name.clone(), workspace.tenant(&name)?.weight)))
                .collect(),
            per_tenant: concurrency.per_tenant,
            per_flow: concurrency.per_flow.clone(),
        }
    }

    fn weight(&self, tenant: &str) -> f64 {
        f64::from(self.weights.get(tenant).copied().unwrap_or(1).max(1))
    }
}

/// A running run's keys.
#[derive(Clone, Debug)]
struct Slot {
    tenant: String,
    flow: String,
}

/// A queued run's keys and priority, and (a tenant that queues for its
/// quota) the demand it reserves when it starts.
#[derive(Clone, Debug)]
struct Queued {
    slot: Slot,
    priority: u8,
    demand: Option<Demand>,
}

/// A submission's keys; one whose spec does not decode (it will fail to
/// start) counts as the default tenant's.
fn slot_of_submission(sub: &SubmissionRecord) -> Slot {
    serde_json::from_str::<RunSpec>(&sub.spec_json)
        .map(|spec| slot_of(&spec))
        .unwrap_or_else(|_| Slot {
            tenant: arbor_protocol::DEFAULT_TENANT.into(),
            flow: String::new(),
        })
}

fn slot_of(spec: &RunSpec) -> Slot {
    Slot {
        tenant: tenant_of(spec).to_string(),
        flow: spec.flow.clone(),
    }
}

impl Policy {
    /// A run entering the queue: its keys, and what it has yet to reserve
    /// (a tenant that queues for its quota, unless it `reserved` already).
    fn queued(&self, spec: &RunSpec, reserved: bool) -> Queued {
        let slot = slot_of(spec);
        let demand = match self.quotas.get(&slot.tenant) {
            Some((_, OnQuota::Queue)) if !reserved => Some(demand_of(spec)),
            _ => None,
        };
        Queued {
            slot,
            priority: spec.priority.unwrap_or(RunSpec::PRIORITY),
            demand,
        }
    }
}

/// What a run asks of its tenant's windows.
fn demand_of(spec: &RunSpec) -> Demand {
    Demand {
        tokens: spec.budget_tokens,
        usd_micros: spec.budget_usd_micros.unwrap_or(0),
        run: true,
    }
}

fn tenant_of(spec: &RunSpec) -> &str {
    spec.tenant
        .as_deref()
        .unwrap_or(arbor_protocol::DEFAULT_TENANT)
}

/// One round of admission's outcome.
enum Round {
    Closed,
    /// Nothing more to start now; look again at the latest this much later
    /// (a queued run waiting for a quota window the clock will open).
    Idle(Option<std::time::Duration>),
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
        policy: Policy,
    ) -> Result<Arc<Self>, arbor_storage::Error> {
        let journal = node.journal();
        let shared = journal.woken();
        let ledger = Ledger::load(journal)?;
        let mut queued = HashMap::new();
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
                    if let Ok(spec) = serde_json::from_str::<RunSpec>(&sub.spec_json) {
                        // One that reserved at submission holds its entry already.
                        let reserved = ledger.entry(tenant_of(&spec), sub.run).is_some();
                        queued.insert(sub.run, policy.queued(&spec, reserved));
                    }
                    queue.push_back(sub);
                }
            }
        }
        journal.append(started_late)?;
        let running = node
            .resumed()
            .iter()
            .map(|(id, spec)| (*id, slot_of(spec)))
            .collect();
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
            policy,
            state: Mutex::new(State {
                queue,
                running,
                keys,
                next_order,
                closed: false,
                ledger,
                queued,
                turns: HashMap::new(),
                virtual_now: 0.0,
            }),
            wake,
            seen: Default::default(),
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
        self.submit_with(spec, key, digest, audit, |_| vec![]).await
    }

    /// `submit`, committing with the submission what `also` makes of its
    /// run's id (a schedule's tick, I-66): both, or neither.
    pub async fn submit_with(
        &self,
        spec: &RunSpec,
        key: Option<String>,
        digest: String,
        audit: Option<&crate::audit::Audit>,
        also: impl FnOnce(RunId) -> Vec<Record>,
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
        let run = RunId::new();
        self.settle_ended(&mut state);
        let reserved = self.reserve_at_submission(&mut state, spec, run)?;
        let sub = SubmissionRecord {
            run,
            order: state.next_order,
            spec_json: serde_json::to_string(spec).unwrap_or_default(),
            idempotency_key: key.clone(),
            digest: digest.clone(),
            submitted_ms: now_ms(),
            state: SubmissionState::Queued,
            epoch: journal.epoch(),
        };
        let mut records = vec![sub.record()?];
        if let Some((entry, _)) = &reserved {
            records.push(entry.record()?);
        }
        records.extend(audit.and_then(|a| a.take(Some(sub.run.to_string()), StatusCode::CREATED)));
        records.extend(also(run));
        journal.commit(records).await?;
        state.next_order += 1;
        let queued = self.policy.queued(spec, reserved.is_some());
        if let Some((entry, lock)) = reserved {
            state.ledger.committed(entry);
            // Committed: another node may read the windows now.
            drop(lock);
        }
        if self.shared.is_none() {
            state.queued.insert(run, queued);
        }
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

    /// A run of a tenant with a quota that refuses: its reservation, to be
    /// committed with its submission (under the lock it holds, on a shared
    /// journal), or why not. A tenant that queues reserves when its run
    /// starts (`None` here).
    fn reserve_at_submission(
        &self,
        state: &mut State,
        spec: &RunSpec,
        run: RunId,
    ) -> Result<Option<(QuotaEntry, Exclusive)>, SubmitError> {
        let tenant = tenant_of(spec);
        let Some((quota, on_quota)) = self.policy.quotas.get(tenant) else {
            return Ok(None);
        };
        let demand = demand_of(spec);
        if let Some(why) = quota::never(quota, demand, spec.budget_usd_micros.is_some()) {
            return Err(SubmitError::QuotaNever {
                tenant: tenant.to_string(),
                why,
            });
        }
        if *on_quota == OnQuota::Queue {
            return Ok(None);
        }
        let (lock, now) = self.room_for(state, tenant, quota, demand)?;
        let entry = Ledger::reservation(tenant, run, demand, now, self.node.journal().epoch());
        Ok(Some((entry, lock)))
    }

    /// Whether `tenant`'s windows have room for `demand` now: the lock to
    /// hold until the reservation is committed, and the instant checked.
    /// On a shared journal the lock is the tenant's across the nodes, and
    /// every node's entries are read under it (so no two nodes reserve the
    /// same room); on a journal of its own, the state's lock (held by the
    /// caller) suffices.
    fn room_for(
        &self,
        state: &mut State,
        tenant: &str,
        quota: &Quota,
        demand: Demand,
    ) -> Result<(Exclusive, u64), SubmitError> {
        let journal = self.node.journal();
        let lock = journal.exclusive(&format!("quota/{tenant}"))?;
        if self.shared.is_some() {
            state.ledger.reload(journal, tenant)?;
            self.settle_ended(state);
        }
        let now = now_ms();
        state
            .ledger
            .room(tenant, quota, demand, now)
            .map_err(|over| SubmitError::Quota {
                tenant: tenant.to_string(),
                over,
            })?;
        Ok((lock, now))
    }

    /// Reserves a top-up of `run` from its tenant's windows before it is
    /// granted (I-65): `Ok` when its tenant has no quota, or the windows
    /// have room and the larger entry is committed. Should the grant then
    /// fail, the entry stays larger until the run settles: never less than
    /// the run may spend.
    pub async fn reserve_top_up(
        &self,
        run: RunId,
        tenant: &str,
        amount: arbor_protocol::Amount,
    ) -> Result<(), SubmitError> {
        let Some((quota, _)) = self.policy.quotas.get(tenant) else {
            return Ok(());
        };
        let demand = Demand {
            tokens: amount.tokens,
            usd_micros: amount.usd_micros,
            run: false,
        };
        let mut state = self.state.lock().await;
        self.settle_ended(&mut state);
        let (_lock, now) = self.room_for(&mut state, tenant, quota, demand)?;
        let mut entry = match state.ledger.entry(tenant, run) {
            Some(entry) => entry.clone(),
            // A run admitted before its tenant had a quota: from now on,
            // what is added counts.
            None => Ledger::reservation(tenant, run, Demand::default(), now, 0),
        };
        entry.tokens += amount.tokens;
        entry.usd_micros += amount.usd_micros;
        entry.epoch = self.node.journal().epoch();
        self.node.journal().commit(vec![entry.record()?]).await?;
        state.ledger.committed(entry);
        Ok(())
    }

    /// Settles the entry of every run that has ended (a queued run taken
    /// out of the queue ends too) down to what it spent, and forgets the
    /// entries no window counts any more. An ended run whose spend cannot
    /// be read keeps its whole reservation: never less than it spent.
    /// Every reader of the windows settles first, so what a run's end gave
    /// back is there as soon as its end is seen. An append, not a commit:
    /// a settlement lost to a crash is made again at the next boot.
    fn settle_ended(&self, state: &mut State) {
        if self.policy.quotas.is_empty() {
            return;
        }
        let open = state.ledger.open_entries();
        let epoch = self.node.journal().epoch();
        let mut settled = vec![];
        for mut entry in open {
            // Still in this node's queue: not begun, let alone ended.
            if state.queued.contains_key(&entry.run) {
                continue;
            }
            let Some(spent) = self.spent_if_ended(entry.run) else {
                continue;
            };
            entry.ended_ms = Some(now_ms());
            if let Some((tokens, usd_micros)) = spent {
                entry.tokens = entry.tokens.min(tokens);
                entry.usd_micros = entry.usd_micros.min(usd_micros);
            }
            entry.epoch = epoch;
            settled.push(entry);
        }
        let gone = state.ledger.prune(now_ms());
        if settled.is_empty() && gone.is_empty() {
            return;
        }
        let journal = self.node.journal();
        let records: Result<Vec<_>, _> = settled.iter().map(QuotaEntry::record).collect();
        if let Err(error) = records.and_then(|records| journal.append(records)) {
            tracing::warn!(%error, "could not settle quota entries; the next round tries again");
            return;
        }
        for entry in settled {
            state.ledger.committed(entry);
        }
        if let Err(error) = journal.remove_keys(&quota::QUOTAS, gone) {
            tracing::warn!(%error, "could not forget spent quota entries");
        }
    }

    /// `Some` once `run` has ended, with what it spent (tokens,
    /// micro-dollars) when that can still be read.
    fn spent_if_ended(&self, run: RunId) -> Option<Option<(u64, u64)>> {
        let spent = |tree: &arbor_protocol::Tree| {
            let head = tree.head();
            (head.account.spent, head.usd.as_ref().map_or(0, |u| u.spent))
        };
        if let Some(seen) = self.node.events().with_tree(run, |tree| {
            let tree = tree?;
            Some(tree.run_status().is_terminal().then(|| spent(tree)))
        }) {
            return seen.map(Some);
        }
        let journal = self.node.journal();
        match journal.run(run) {
            Ok(Some(record)) if record.status.is_terminal() => {}
            // Neither its run nor a queued submission is left: retention
            // forgot it, ended; what it spent is gone with it.
            Ok(None) => {
                let waiting = submission::submission(journal, run)
                    .map(|sub| sub.is_some_and(|s| s.state == SubmissionState::Queued));
                return match waiting {
                    Ok(false) => Some(None),
                    _ => None,
                };
            }
            _ => return None,
        }
        let events = journal.events(run).unwrap_or_default();
        if events.is_empty() {
            return Some(None);
        }
        let mut tree = arbor_protocol::Tree::new(run);
        for event in &events {
            tree.apply(event);
        }
        Some(Some(spent(&tree)))
    }

    /// Each concurrency key, its bound, and the runs it has running here
    /// and queued: every tenant arbor.toml names (or that has a run) under
    /// `per_tenant`, and each flow of `per_flow`.
    pub async fn concurrency(&self) -> Vec<crate::api::ConcurrencyKey> {
        let state = self.state.lock().await;
        let count = |key: &dyn Fn(&Slot) -> bool| {
            (
                state.running.values().filter(|s| key(s)).count(),
                state.queued.values().filter(|q| key(&q.slot)).count(),
            )
        };
        let mut keys = vec![];
        if let Some(limit) = self.policy.per_tenant {
            let mut tenants: std::collections::BTreeSet<&str> =
                self.policy.weights.keys().map(String::as_str).collect();
            tenants.extend(state.running.values().map(|s| s.tenant.as_str()));
            tenants.extend(state.queued.values().map(|q| q.slot.tenant.as_str()));
            for tenant in tenants {
                let (running, queued) = count(&|s: &Slot| s.tenant == tenant);
                keys.push(crate::api::ConcurrencyKey {
                    key: format!("tenant:{tenant}"),
                    limit,
                    running,
                    queued,
                });
            }
        }
        for (flow, limit) in &self.policy.per_flow {
            let (running, queued) = count(&|s: &Slot| s.flow == *flow);
            keys.push(crate::api::ConcurrencyKey {
                key: format!("flow:{flow}"),
                limit: *limit,
                running,
                queued,
            });
        }
        // An agent's are its jobs', of every run: the node's slots.
        for (agent, limit, running, queued) in self.node.agent_slots() {
            keys.push(crate::api::ConcurrencyKey {
                key: format!("agent:{agent}"),
                limit,
                running,
                queued,
            });
        }
        keys
    }

    /// Each tenant's quota windows and what each holds now.
    pub async fn quotas(&self) -> Vec<crate::api::TenantQuota> {
        let mut state = self.state.lock().await;
        if self.shared.is_some() {
            // Every node's entries, as the journal has them now.
            for tenant in self.policy.quotas.keys() {
                if let Err(error) = state.ledger.reload(self.node.journal(), tenant) {
                    tracing::warn!(%error, "could not read a tenant's quota windows");
                }
            }
        }
        self.settle_ended(&mut state);
        let now = now_ms();
        self.policy
            .quotas
            .iter()
            .map(|(tenant, (quota, on_quota))| {
                let windows = quota::Window::ALL
                    .into_iter()
                    .filter_map(|w| Some((w, w.limit(quota)?)));
                crate::api::TenantQuota {
                    tenant: tenant.clone(),
                    quota: windows
                        .clone()
                        .map(|(w, limit)| (w.name().into(), limit))
                        .collect(),
                    used: windows
                        .map(|(w, _)| (w.name().into(), state.ledger.used(tenant, w, now)))
                        .collect(),
                    queued: state
                        .queued
                        .values()
                        .filter(|q| q.slot.tenant == *tenant)
                        .count(),
                    on_quota: match on_quota {
                        OnQuota::Refuse => "refuse",
                        OnQuota::Queue => "queue",
                    }
                    .into(),
                }
            })
            .collect()
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
        state.queued.remove(&run);
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
        self.state.lock().await.running.keys().copied().collect()
    }

    /// Starts queued runs while there is room, until closed. Wakes on a
    /// submission and on a run's end (a `Notify` keeps one wake-up that
    /// comes while it is busy, so none is lost).
    pub async fn pump(self: Arc<Self>) {
        let mut woken = self.shared.clone();
        if let Some(woken) = &mut woken {
            woken.mark_unchanged();
        }
        loop {
            let Round::Idle(retry) = self.admit_ready().await else {
                return;
            };
            // A queued run waiting for a quota window: the clock opens it.
            let clock = async {
                match retry {
                    Some(after) => tokio::time::sleep(after).await,
                    None => std::future::pending().await,
                }
            };
            match &mut woken {
                None => {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = clock => {}
                    }
                }
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

    /// One round of admission.
    async fn admit_ready(&self) -> Round {
        if self.shared.is_some() {
            return if self.admit_shared().await {
                Round::Idle(None)
            } else {
                Round::Closed
            };
        }
        loop {
            let (next, reserved) = {
                let mut state = self.state.lock().await;
                if state.closed {
                    return Round::Closed;
                }
                let events = self.node.events();
                state.running.retain(|run, _| {
                    !events.with_tree(*run, |t| t.is_some_and(|t| t.run_status().is_terminal()))
                });
                self.settle_ended(&mut state);
                if state.running.len() >= self.max_running {
                    return Round::Idle(None);
                }
                let (at, reserved) = match self.next_startable(&mut state) {
                    Ok(next) => next,
                    Err(retry) => return Round::Idle(retry),
                };
                let sub = state
                    .queue
                    .remove(at)
                    .expect("the position is in the queue");
                let slot = state.queued.remove(&sub.run).map(|q| q.slot);
                let slot = slot.unwrap_or_else(|| slot_of_submission(&sub));
                self.take_turn(&mut state, &slot.tenant);
                state.running.insert(sub.run, slot);
                (sub, reserved)
            };
            if let Some(entry) = reserved
                && let Err(error) = self.commit_reservation(entry).await
            {
                tracing::error!(%error, run = %next.run, "could not reserve a queued run's quota");
                self.fail_to_start(next, error.to_string()).await;
                continue;
            }
            self.start(next).await;
        }
    }

    /// The queued run to start now, and the reservation it takes from its
    /// tenant's windows (a tenant that queues for its quota). Each tenant's
    /// head is its first run by (priority, arrival) whose tenant and flow
    /// are under their concurrency bounds; the head of the tenant whose
    /// turn comes first starts. A head with no room in its windows holds
    /// its tenant back (its other runs wait behind it) while others go on.
    /// `Err`: none may start, and when the clock will open a window.
    fn next_startable(
        &self,
        state: &mut State,
    ) -> Result<(usize, Option<QuotaEntry>), Option<std::time::Duration>> {
        let now = now_ms();
        let State {
            queue,
            ledger,
            queued,
            running,
            turns,
            virtual_now,
            ..
        } = state;
        let mut by_tenant: HashMap<&str, u32> = HashMap::new();
        let mut by_flow: HashMap<&str, u32> = HashMap::new();
        for slot in running.values() {
            *by_tenant.entry(&slot.tenant).or_default() += 1;
            *by_flow.entry(&slot.flow).or_default() += 1;
        }
        let full = |count: &HashMap<&str, u32>, key: &str, limit: Option<u32>| {
            limit.is_some_and(|limit| count.get(key).copied().unwrap_or(0) >= limit)
        };
        // Each tenant's head: (priority, arrival, position).
        let mut heads: HashMap<&str, (u8, u64, usize)> = HashMap::new();
        for (at, sub) in queue.iter().enumerate() {
            let Some(q) = queued.get(&sub.run) else {
                return Ok((at, None));
            };
            let (tenant, flow) = (q.slot.tenant.as_str(), q.slot.flow.as_str());
            if full(&by_tenant, tenant, self.policy.per_tenant)
                || full(&by_flow, flow, self.policy.per_flow.get(flow).copied())
            {
                continue;
            }
            let key = (q.priority, sub.order, at);
            heads
                .entry(tenant)
                .and_modify(|head| *head = (*head).min(key))
                .or_insert(key);
        }
        let mut retry: Option<u64> = None;
        loop {
            let turn = |tenant: &str| turns.get(tenant).copied().unwrap_or(0.0).max(*virtual_now);
            let Some((tenant, (_, _, at))) = heads
                .iter()
                .map(|(tenant, head)| (*tenant, *head))
                .min_by(|a, b| turn(a.0).total_cmp(&turn(b.0)).then(a.1.1.cmp(&b.1.1)))
            else {
                return Err(retry.map(std::time::Duration::from_millis));
            };
            let run = queue[at].run;
            let Some(demand) = queued.get(&run).and_then(|q| q.demand) else {
                return Ok((at, None));
            };
            let Some((quota, _)) = self.policy.quotas.get(tenant) else {
                return Ok((at, None));
            };
            match ledger.room(tenant, quota, demand, now) {
                Ok(()) => {
                    let epoch = self.node.journal().epoch();
                    let entry = Ledger::reservation(tenant, run, demand, now, epoch);
                    // Held in memory from now, so the next check sees it.
                    ledger.committed(entry.clone());
                    return Ok((at, Some(entry)));
                }
                Err(over) => {
                    if let Some(after) = over.retry_after_ms {
                        retry = Some(retry.map_or(after, |r| r.min(after)));
                    }
                    heads.remove(tenant);
                }
            }
        }
    }

    /// `tenant` starts a run: its turn moves on by 1/weight.
    fn take_turn(&self, state: &mut State, tenant: &str) {
        let start = state
            .turns
            .get(tenant)
            .copied()
            .unwrap_or(0.0)
            .max(state.virtual_now);
        state.virtual_now = start;
        state
            .turns
            .insert(tenant.to_string(), start + 1.0 / self.policy.weight(tenant));
    }

    async fn commit_reservation(&self, entry: QuotaEntry) -> Result<(), arbor_storage::Error> {
        self.node.journal().commit(vec![entry.record()?]).await?;
        Ok(())
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
                state.running.retain(|run, _| {
                    !events.with_tree(*run, |t| t.is_some_and(|t| t.run_status().is_terminal()))
                });
                self.max_running.saturating_sub(state.running.len())
            };
            if room == 0 {
                return true;
            }
            let journal = self.node.journal();
            let claimed = match self.claim_fairly(room).await {
                Ok(claimed) => claimed,
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
                        let slot = slot_of_submission(&sub);
                        self.state.lock().await.running.insert(run, slot);
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

    /// Up to `room` of a shared queue's runs, claimed for this node in the
    /// order `dispatch::pick` gives, under the queue's lock across the
    /// nodes: what every node runs, read under it, is what the keys count.
    async fn claim_fairly(&self, room: usize) -> Result<Vec<(RunId, u64)>, arbor_storage::Error> {
        let journal = self.node.journal();
        let _lock = journal.exclusive("queue")?;
        let queued = journal.queued_runs()?.unwrap_or_default();
        if queued.is_empty() {
            return Ok(vec![]);
        }
        let running: Vec<RunId> = journal
            .nodes()?
            .unwrap_or_default()
            .iter()
            .flat_map(|node| node.runs.iter())
            .filter_map(|(key, _)| uuid::Uuid::from_slice(key).ok().map(RunId))
            .collect();
        let mut seen = self.seen.lock().await;
        let live: std::collections::HashSet<&RunId> = queued.iter().chain(&running).collect();
        seen.retain(|run, _| live.contains(run));
        for run in queued.iter().chain(&running) {
            if seen.contains_key(run) {
                continue;
            }
            // A run with no submission (an `arbor run` of its own) has no
            // keys to count.
            if let Some(sub) = submission::submission(journal, *run)? {
                let queued = match serde_json::from_str::<RunSpec>(&sub.spec_json) {
                    Ok(spec) => self.policy.queued(&spec, false),
                    Err(_) => Queued {
                        slot: slot_of_submission(&sub),
                        priority: RunSpec::PRIORITY,
                        demand: None,
                    },
                };
                seen.insert(*run, queued);
            }
        }
        let candidates: Vec<dispatch::Candidate> = queued
            .iter()
            .filter_map(|run| {
                let q = seen.get(run)?;
                Some(dispatch::Candidate {
                    run: *run,
                    tenant: q.slot.tenant.clone(),
                    flow: q.slot.flow.clone(),
                    priority: q.priority,
                })
            })
            .collect();
        let running: Vec<(String, String)> = running
            .iter()
            .filter_map(|run| seen.get(run))
            .map(|q| (q.slot.tenant.clone(), q.slot.flow.clone()))
            .collect();
        let demands: HashMap<RunId, (String, Demand)> = candidates
            .iter()
            .filter_map(|c| Some((c.run, (c.tenant.clone(), seen.get(&c.run)?.demand?))))
            .collect();
        drop(seen);
        let picks = {
            let weight = |tenant: &str| self.policy.weight(tenant);
            let bounds = dispatch::Bounds {
                weight: &weight,
                per_tenant: self.policy.per_tenant,
                per_flow: &self.policy.per_flow,
            };
            dispatch::pick(&candidates, &running, &bounds, room)
        };
        let mut claimed = vec![];
        // A tenant whose run found no room in its windows waits whole.
        let mut held_back: Vec<String> = vec![];
        for run in picks {
            if let Some((tenant, demand)) = demands.get(&run)
                && (held_back.contains(tenant)
                    || !self.reserve_shared(run, tenant, *demand).await?)
            {
                held_back.push(tenant.clone());
                continue;
            }
            claimed.extend(journal.claim_queued(1, Some(run))?.unwrap_or_default());
        }
        Ok(claimed)
    }

    /// A shared queue's run of a tenant that queues for its quota: its
    /// reservation, committed under the tenant's lock before the run is
    /// claimed (keyed by the run: a node that dies between leaves it to
    /// whichever node claims the run, which reserves it again in its
    /// place). False if the windows have no room yet.
    async fn reserve_shared(
        &self,
        run: RunId,
        tenant: &str,
        demand: Demand,
    ) -> Result<bool, arbor_storage::Error> {
        let Some((quota, _)) = self.policy.quotas.get(tenant) else {
            return Ok(true);
        };
        let mut state = self.state.lock().await;
        let (_lock, now) = match self.room_for(&mut state, tenant, quota, demand) {
            Ok(room) => room,
            Err(SubmitError::Journal(error)) => return Err(error),
            Err(_) => return Ok(false),
        };
        let entry = Ledger::reservation(tenant, run, demand, now, self.node.journal().epoch());
        self.node.journal().commit(vec![entry.record()?]).await?;
        state.ledger.committed(entry);
        Ok(true)
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
            Err(reason) => self.fail_to_start(sub, reason).await,
        }
    }

    /// Ends a queued run that could not start, failed, saying why.
    async fn fail_to_start(&self, mut sub: SubmissionRecord, reason: String) {
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
