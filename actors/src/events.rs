//! The event bus: every state change is emitted here once (I-39), journaled,
//! folded into the run's live `Tree`, and broadcast to watchers.
//!
//! Invariants: emission never blocks and never fails the emitter; a watcher that
//! lags loses broadcast events, never the tree (which is folded under the lock).
//! Journal order, fold order and broadcast order are all seq order.
//! What costs an emitter per event is only what someone asked for: `changes`
//! wakes its waiters at every event while one waits (a tool for tests and
//! predicates); a watcher that only draws polls `version`, and one that waits
//! for a run's end waits on `ends`, which moves once per run.

use arbor_protocol::{Event, EventKind, JobId, RunId, Tree};
use arbor_storage::{EncodedEvent, EventTail, Journal, Record};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, watch};

const BROADCAST_CAPACITY: usize = 65_536;
/// A run's own channel (`subscribe_run`): its events in flight to a slow
/// reader, who reads the rest from the journal on `Lagged`.
const RUN_CHANNEL_CAPACITY: usize = 1024;
/// Trees of finished runs kept in memory; past this, one is dropped and
/// folded again from the journal if it is asked for.
const FINISHED_TREES_KEPT: usize = 1024;

/// A cheap, cloneable handle to the node's event bus.
#[derive(Clone)]
pub struct EventBus {
    inner: Arc<Inner>,
}

/// Called synchronously inside `emit`, after the event is journaled and
/// folded. The event is shared: an observer that keeps it keeps a count,
/// not a copy.
pub type Observer = Arc<dyn Fn(&Arc<Event>) + Send + Sync>;

/// What leaves the node because of an event (notifications, I-61): its
/// records are journaled in the same append as the event, so the two are
/// durable together or not at all. Both calls come under the bus's lock,
/// in emission order, and must be quick.
pub trait Outbox: Send + Sync {
    /// The records to append with `event` (none, for most events).
    fn entries(&self, event: &Event) -> Vec<Record>;
    /// The append that held the entries `entries` gave since the last call
    /// returned `appended` (its last seq, durable once a flush covers it).
    fn appended(&self, appended: &Result<u64, arbor_storage::Error>);
}

struct Inner {
    journal: Journal,
    observers: Mutex<Vec<Observer>>,
    /// Set once, before the first event (`set_outbox`).
    outbox: OnceLock<Arc<dyn Outbox>>,
    state: Mutex<BusState>,
    /// Made by the first `subscribe`: until a watcher exists there is nobody
    /// to send to, and the channel makes all of its 65,536 slots at once,
    /// 2.6 MB touched at every start (a millisecond of `arbor run`). Events
    /// are shared, not copied, into its slots (slots of a whole `Event` were
    /// 15 MB).
    live: OnceLock<broadcast::Sender<Arc<Event>>>,
    /// Bumped after every event, for watchers that poll.
    version: AtomicU64,
    /// Bumped after every event while a receiver exists, for waiters that
    /// re-check a predicate of the tree at every change.
    changes: watch::Sender<u64>,
    /// Bumped after every run's end.
    ends: watch::Sender<u64>,
}

struct BusState {
    seq: u64,
    trees: HashMap<RunId, Tree>,
    /// The run of every step and job of the trees held: `find_job` looks
    /// one up without a walk over every tree. Kept in step with `trees`
    /// (`keep_tree`, `drop_tree`, and each `JobSpawned` folded).
    job_runs: HashMap<JobId, RunId>,
    /// Channels of single runs, made by `subscribe_run`: a reader of one
    /// run is woken by that run's events only, not by every event of the
    /// node (50 streams each woken by all 50 runs' events were an eighth of
    /// arbord's CPU under load). Dropped at the run's end.
    runs_live: HashMap<RunId, broadcast::Sender<Arc<Event>>>,
}

impl BusState {
    /// Holds a run's tree, its jobs indexed.
    fn keep_tree(&mut self, run: RunId, tree: Tree) {
        self.job_runs
            .extend(tree.nodes().map(|(job, _)| (job, run)));
        self.trees.insert(run, tree);
    }

    /// Lets a run's tree go, and its jobs' index with it.
    fn drop_tree(&mut self, run: RunId) {
        if let Some(tree) = self.trees.remove(&run) {
            for (job, _) in tree.nodes() {
                self.job_runs.remove(&job);
            }
        }
    }
}

/// Milliseconds since the Unix epoch: an event's `at_ms`, a card's times.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl EventBus {
    pub fn new(journal: Journal) -> Self {
        let (changes, _) = watch::channel(0);
        let (ends, _) = watch::channel(0);
        // Event seqs key events in the journal: starting above every seq the
        // journal ever handed out keeps them unique across restarts.
        let first_seq = journal.applied_seq();
        Self {
            inner: Arc::new(Inner {
                journal,
                observers: Mutex::new(vec![]),
                outbox: OnceLock::new(),
                state: Mutex::new(BusState {
                    seq: first_seq,
                    trees: HashMap::new(),
                    job_runs: HashMap::new(),
                    runs_live: HashMap::new(),
                }),
                live: OnceLock::new(),
                version: AtomicU64::new(0),
                changes,
                ends,
            }),
        }
    }

    /// Emits one event of `run`: journals it, folds it into the run's tree, broadcasts it.
    pub fn emit(&self, run: RunId, kind: EventKind) {
        if let Err(error) = self.emit_with(run, vec![], [kind]) {
            tracing::error!(%error, "could not journal an event");
        }
    }

    /// Emits `kinds`, in order, and journals them in one append with
    /// `records` before them: what one handler decided at once (a call's
    /// settlement: its ledger entries, `ModelCalled`, `AccountChanged`)
    /// costs one append, not one each. The events are folded and broadcast
    /// even if the append fails, as `emit`'s are; the error is the
    /// append's, for the caller whose records it held.
    pub fn emit_with(
        &self,
        run: RunId,
        records: Vec<Record>,
        kinds: impl IntoIterator<Item = EventKind>,
    ) -> Result<(), arbor_storage::Error> {
        let at_ms = now_ms();
        // The records' values, and each event's JSON but its seq, are the
        // costly part of what is journaled, and need no seq: made here,
        // before the lock that every emitter waits on.
        let mut prepared = self.inner.journal.prepare(records);
        let kinds: Vec<(EventKind, Result<EventTail, arbor_storage::Error>)> = kinds
            .into_iter()
            .map(|kind| {
                let tail = EventTail::new(run, at_ms, &kind);
                (kind, tail)
            })
            .collect();
        let mut ended = false;
        let mut unencoded = None;
        let (events, appended) = {
            let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
            let mut events = Vec::with_capacity(kinds.len());
            let mut records = Vec::with_capacity(kinds.len());
            for (kind, json) in kinds {
                ended |= matches!(kind, EventKind::RunFinished { .. });
                state.seq += 1;
                let event = Event {
                    seq: state.seq,
                    run,
                    at_ms,
                    kind,
                };
                match json {
                    Ok(tail) => records.push(Record::EncodedEvent(EncodedEvent::new(
                        event.seq, run, &tail,
                    ))),
                    Err(e) => unencoded = Some(e),
                }
                if let EventKind::JobSpawned { id, .. } = &event.kind {
                    state.job_runs.insert(*id, run);
                }
                state
                    .trees
                    .entry(run)
                    .or_insert_with(|| Tree::new(run))
                    .apply(&event);
                events.push(Arc::new(event));
            }
            if state.trees.len() > FINISHED_TREES_KEPT
                && let Some(finished) = state
                    .trees
                    .iter()
                    .find(|(id, t)| **id != run && t.run_status().is_terminal())
                    .map(|(id, _)| *id)
            {
                state.drop_tree(finished);
            }
            let outbox = self.inner.outbox.get();
            let mut outgoing = false;
            if let Some(outbox) = outbox {
                for event in &events {
                    let entries = outbox.entries(event);
                    outgoing |= !entries.is_empty();
                    records.extend(entries);
                }
            }
            // Journaled under the lock so the journal's order is the emission order.
            prepared.extend(self.inner.journal.prepare(records));
            let appended = self.inner.journal.append_prepared(prepared);
            if let Some(outbox) = outbox.filter(|_| outgoing) {
                outbox.appended(&appended);
            }
            // Broadcast under the lock too, so watchers receive events in seq
            // order: one that skips what it has seen by seq loses nothing.
            for event in &events {
                if let Some(live) = self.inner.live.get() {
                    let _ = live.send(Arc::clone(event));
                }
            }
            if !state.runs_live.is_empty()
                && let Some(run_live) = state.runs_live.get(&run)
            {
                for event in &events {
                    let _ = run_live.send(Arc::clone(event));
                }
                // Its receivers still hold what was sent; a later reader of
                // the run finds the end in the journal.
                if ended {
                    state.runs_live.remove(&run);
                }
            }
            (events, appended)
        };
        let observers = self
            .inner
            .observers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for event in &events {
            for observer in &observers {
                observer(event);
            }
        }
        self.inner
            .version
            .fetch_add(events.len() as u64, Ordering::AcqRel);
        // A receiver made before the tree was read is counted here (the
        // state lock orders the two), so a waiter misses no change; with
        // none, the bump and its wake-ups are skipped.
        if self.inner.changes.receiver_count() > 0 {
            self.inner.changes.send_modify(|v| *v += 1);
        }
        if ended {
            self.inner.ends.send_modify(|v| *v += 1);
        }
        match unencoded {
            Some(e) => Err(e),
            None => appended.map(|_| ()),
        }
    }

    /// Journals `outbox`'s entries with every later event. Set before the
    /// first event (a node's start): false if one was set already.
    pub fn set_outbox(&self, outbox: Arc<dyn Outbox>) -> bool {
        self.inner.outbox.set(outbox).is_ok()
    }

    /// Runs `observer` on every later event, synchronously, in the emitter's
    /// task: what it sees is the state at the moment of emission. For tests
    /// and tracing; it must be quick and must not emit.
    pub fn observe(&self, observer: Observer) {
        self.inner
            .observers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(observer);
    }

    /// Folds a run's journaled history into its tree (after a restart), so the
    /// tree shows what happened before; nothing is journaled again.
    pub fn load_run(&self, run: RunId, history: &[Event]) {
        let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut tree = Tree::new(run);
        for event in history {
            tree.apply(event);
            state.seq = state.seq.max(event.seq);
        }
        state.keep_tree(run, tree);
    }

    /// Every event emitted from now on (a slow reader may see `Lagged`).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        // Made under the state lock, which every emitter holds while it
        // broadcasts: no event falls between the channel's making and an
        // emitter's look at it.
        let _state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        self.inner
            .live
            .get_or_init(|| broadcast::channel(BROADCAST_CAPACITY).0)
            .subscribe()
    }

    /// Every event of `run` emitted from now on, and no other run's (a
    /// slow reader may see `Lagged`, and reads the rest from the journal).
    /// Nothing more comes after the run's `RunFinished`: a reader that
    /// subscribes after the run ended finds its end in the journal, which
    /// holds every event before it is sent.
    pub fn subscribe_run(&self, run: RunId) -> broadcast::Receiver<Arc<Event>> {
        let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(live) = state.runs_live.get(&run) {
            return live.subscribe();
        }
        // Channels of runs whose readers all left, and of runs that ended
        // before their first reader came, go when a new channel is made:
        // the map stays as large as the runs being read.
        if state.runs_live.len() >= 64 {
            state.runs_live.retain(|_, live| live.receiver_count() > 0);
        }
        let (live, receiver) = broadcast::channel(RUN_CHANNEL_CAPACITY);
        state.runs_live.insert(run, live);
        receiver
    }

    /// Changes whenever any event is emitted, from now on. Each receiver
    /// costs every emitter a wake-up: for waiting on a predicate of a tree,
    /// not for drawing one (poll `version`).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// Changes whenever a run ends (its `RunFinished` is folded).
    pub fn ends(&self) -> watch::Receiver<u64> {
        self.inner.ends.subscribe()
    }

    /// How many events have been emitted: a drawer that polls it redraws
    /// only what changed, at its own pace.
    pub fn version(&self) -> u64 {
        self.inner.version.load(Ordering::Acquire)
    }

    /// A copy of the run's tree as of the last event.
    pub fn tree(&self, run: RunId) -> Option<Tree> {
        self.with_tree(run, |t| t.cloned())
    }

    /// The run a step or job belongs to, and its status now, if any tree has it.
    pub fn find_job(&self, job: JobId) -> Option<(RunId, arbor_protocol::Status)> {
        let state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let run = *state.job_runs.get(&job)?;
        let status = state.trees.get(&run)?.node(job)?.status;
        Some((run, status))
    }

    /// Drops the trees of runs the journal has forgotten (retention), so that
    /// nothing answers for them any more.
    pub fn forget(&self, runs: &[RunId]) {
        let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        for run in runs {
            state.drop_tree(*run);
        }
    }

    /// Reads the run's tree under the lock without copying it.
    /// A run this node has not seen since it started (one that ended before
    /// a restart) is folded from the journal the first time it is asked for.
    /// On a shared journal, a run not ended that this node does not run is
    /// another node's, and goes on changing there: it is folded at each
    /// ask, never kept.
    pub fn with_tree<T>(&self, run: RunId, f: impl FnOnce(Option<&Tree>) -> T) -> T {
        let mut state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if !state.trees.contains_key(&run)
            && let Ok(history) = self.inner.journal.events(run)
            && !history.is_empty()
        {
            let mut tree = Tree::new(run);
            for event in &history {
                tree.apply(event);
            }
            if self.inner.journal.is_shared() && !tree.run_status().is_terminal() {
                return f(Some(&tree));
            }
            state.keep_tree(run, tree);
        }
        f(state.trees.get(&run))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `version` counts every event; `ends` moves only at a run's end; a
    /// `changes` receiver sees a change made after it subscribed.
    #[tokio::test]
    async fn version_counts_events_and_ends_moves_only_at_a_runs_end() {
        let dir = tempfile::tempdir().unwrap();
        let bus = EventBus::new(Journal::open(dir.path()).unwrap());
        let run = RunId::new();
        let mut ends = bus.ends();
        let running = || EventKind::JobRunning {
            id: arbor_protocol::JobId::new(),
        };
        bus.emit(run, running());
        let changes = bus.changes();
        bus.emit(run, running());
        assert_eq!(bus.version(), 2);
        assert!(!ends.has_changed().unwrap(), "no run has ended");
        assert!(changes.has_changed().unwrap(), "a change after subscribing");
        bus.emit(
            run,
            EventKind::RunFinished {
                limitations: Vec::new(),
                status: arbor_protocol::Status::Done,
                error_class: None,
                reason: None,
                output: serde_json::Value::Null,
            },
        );
        assert!(ends.has_changed().unwrap());
        ends.changed().await.unwrap();
        assert_eq!(bus.version(), 3);
        assert!(bus.with_tree(run, |t| t.unwrap().run_status().is_terminal()));
    }

    /// A run's reader gets that run's events only, in seq order, and its
    /// channel closes after the run's end; a reader that comes after the
    /// end gets nothing live (the journal has the end).
    #[tokio::test]
    async fn a_runs_reader_sees_only_its_run_and_its_channel_closes_at_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let bus = EventBus::new(Journal::open(dir.path()).unwrap());
        let (mine, other) = (RunId::new(), RunId::new());
        let mut reader = bus.subscribe_run(mine);
        let mut others = bus.subscribe_run(other);
        let running = || EventKind::JobRunning {
            id: arbor_protocol::JobId::new(),
        };
        let finished = || EventKind::RunFinished {
            limitations: Vec::new(),
            status: arbor_protocol::Status::Done,
            error_class: None,
            reason: None,
            output: serde_json::Value::Null,
        };
        bus.emit(mine, running());
        bus.emit(other, running());
        bus.emit(mine, running());
        bus.emit(mine, finished());
        let mut seen = vec![];
        loop {
            match reader.recv().await {
                Ok(event) => {
                    assert_eq!(event.run, mine, "another run's event reached this reader");
                    seen.push(event.seq);
                }
                Err(broadcast::error::RecvError::Closed) => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(
            seen,
            vec![1, 3, 4],
            "this run's events, in order, then closed"
        );
        assert_eq!(others.recv().await.unwrap().seq, 2);
        assert!(matches!(
            others.try_recv(),
            Err(broadcast::error::TryRecvError::Empty)
        ));
        let mut late = bus.subscribe_run(mine);
        assert!(matches!(
            late.try_recv(),
            Err(broadcast::error::TryRecvError::Empty)
        ));
    }

    /// Emitters on several threads at once: a watcher still receives every
    /// event in seq order (the event stream skips by seq, so an event
    /// broadcast out of order would be lost to it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn watchers_receive_events_in_seq_order_from_concurrent_emitters() {
        let dir = tempfile::tempdir().unwrap();
        let bus = EventBus::new(Journal::open(dir.path()).unwrap());
        let mut watcher = bus.subscribe();
        let run = RunId::new();
        let emitters: Vec<_> = (0..4)
            .map(|_| {
                let bus = bus.clone();
                tokio::spawn(async move {
                    for _ in 0..500 {
                        bus.emit(
                            run,
                            EventKind::JobRunning {
                                id: arbor_protocol::JobId::new(),
                            },
                        );
                    }
                })
            })
            .collect();
        for emitter in emitters {
            emitter.await.unwrap();
        }
        let mut last = 0;
        for _ in 0..2000 {
            let event = watcher.recv().await.unwrap();
            assert!(event.seq > last, "{} after {last}", event.seq);
            last = event.seq;
        }
    }
}
