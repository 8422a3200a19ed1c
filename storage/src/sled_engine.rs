//! The sled engine: the journal's rows in sled, made durable by a
//! write-ahead log of its own, appended in seq order.
//!
//! Behind a `SledEngine`, two dedicated threads: the flusher
//! (`sled_engine/flusher.rs`) owns the write-ahead log (`wal.rs`) and every
//! sync of it, and the applier (`applier.rs`) applies appends to sled in
//! batches (`overlay.rs`) and owns every `db.flush()` and every sync of
//! sled's files (`fsync.rs`). Callers never flush themselves. `open.rs`
//! opens sled and replays the log; `reads.rs` reads sled with the overlay
//! laid over it; `chunk.rs` packs a history table's rows.
//!
//! Invariants:
//! 1. Seq order is apply order: one mutex covers handing out seqs *and*
//!    applying them (to the overlay, which reads merge over sled), so a reader
//!    who sees seq N applied sees everything below N.
//! 2. sled takes appends whole, in seq order, each batch in one transaction
//!    with the `meta` seq, so after a crash sled holds a prefix of the appends
//!    and says where it ends; the log holds the rest (`wal.rs`).
//! 3. `durable_seq` only rises, and only to a seq that was applied before a
//!    flush began: everything at or below it survives a crash (I-29).
//! 4. After the first failed write or flush (real or injected), every append
//!    and every flush not already covered fails with `Error::Failed`, naming
//!    that first failure, until the journal is reopened: a journal that cannot
//!    write stops the node from taking new work, and nothing is acknowledged
//!    that a failed sync may have lost.
//!
//! What a completed flush promises: every frame queued up to its seq was
//! written to the log's open segment and `fdatasync`ed. Everything at or
//! below `durable_seq` is then on the device past its cache, so it survives a
//! crash of the process, of the kernel and a power cut, on a filesystem and
//! device that honour `fdatasync` (not over a disk that lies about its write
//! cache). An open replays what sled lost from the log (`wal.rs`, invariant 4).
//!
//! Group commit: `wait_durable` sends a waiter to the flusher and awaits a
//! oneshot. The flusher takes every waiter queued so far and every frame
//! queued so far, writes the frames with one `write` and one `fdatasync`,
//! publishes the last seq they carry as durable and wakes them all. Commits
//! that arrive during a flush are served together by the next one, so under
//! load the number of flushes stays far below the number of commits.
//!
//! Checkpoints: once `CHECKPOINT_BYTES` of frames have been written, the
//! flusher starts a new segment and asks the applier, behind every append
//! the old segments carry, to flush sled, sync its files and only then
//! remove them. Commits never wait for sled.
//!
//! Deadlock safety: the append mutex is never held across an await or while
//! talking to the flusher, and the flusher takes no lock of ours; it shares
//! only atomics and a set-once cell (`Progress`) with the engine, and the
//! hold of `Faults`, which `append` never touches. It does not hold the
//! `SledEngine` either, so dropping the engine closes its channel, the thread
//! ends, and the drop joins it (which also releases sled's lock on the dir).

mod applier;
mod chunk;
mod flusher;
pub(crate) mod fsync;
mod open;
pub(crate) mod overlay;
mod reads;
pub(crate) mod wal;

pub use open::open_db;

use crate::Error;
use crate::engine::{Counters, Durable, Engine, OwnedRow, Span, Visit, WalkVisit};
use crate::faults::Faults;
use crate::table::{JOURNAL_TABLES, Row, TableDef};
use overlay::{Overlay, Work};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::thread;
use tokio::sync::oneshot;

/// The journal's engine on sled and its write-ahead log.
pub struct SledEngine {
    db: sled::Db,
    /// arbor's lock on the directory, held while the journal is open.
    _dir_lock: std::fs::File,
    trees: Trees,
    epoch: u64,
    /// The last seq handed out, held for the whole of an append (invariant 1).
    last_seq: Mutex<u64>,
    progress: Arc<Progress>,
    faults: Arc<Faults>,
    /// Opened with `open_read_only`: every write is refused.
    read_only: bool,
    /// Frames appended and not yet handed to the flusher.
    pending: Arc<Mutex<Pending>>,
    /// Appends not yet applied to sled, read over it.
    overlay: Arc<Mutex<Overlay>>,
    /// The applier's queue; `None` only while dropping.
    work: Option<mpsc::Sender<Work>>,
    /// `None` only while dropping.
    waiters: Option<mpsc::Sender<Waiter>>,
    flusher: Mutex<Option<thread::JoinHandle<()>>>,
    applier: Mutex<Option<thread::JoinHandle<()>>>,
    /// Set by `leave_unapplied_at_close`; read by the applier as it ends.
    leave_unapplied: Arc<AtomicBool>,
}

/// The sled tree of each table, in `JOURNAL_TABLES` order, and `meta`.
struct Trees {
    tables: Vec<sled::Tree>,
    meta: sled::Tree,
}

/// The tree that holds the engine's own entries: bare big-endian integers
/// with no version byte, so `format` is readable whatever the record format.
const META: &str = "meta";
const META_FORMAT: &[u8] = b"format"; // u32
const META_EPOCH: &[u8] = b"epoch"; // u64
const META_SEQ: &[u8] = b"seq"; // u64

/// What the engine and its threads share: numbers, and the first failure.
struct Progress {
    /// The last seq applied to sled (visible to reads).
    applied: AtomicU64,
    /// The last seq covered by a completed flush.
    durable: AtomicU64,
    /// Log writes completed, each with its `fdatasync`.
    flushes: AtomicU64,
    /// `fdatasync`s of the log by the flusher (one per flush).
    syncs: AtomicU64,
    /// Checkpoints completed: sled flushed and synced, old segments removed.
    checkpoints: AtomicU64,
    /// The first write or flush that failed; set once, never cleared.
    failure: OnceLock<String>,
}

/// Frames in memory past which an append asks for a flush itself.
const PENDING_FRAME_BYTES: usize = 4 * 1024 * 1024;

/// A commit waiting for a flush that covers `seq`.
struct Waiter {
    seq: u64,
    reply: oneshot::Sender<Result<(), Error>>,
}

/// Appends waiting for the flusher, in seq order (`wal.rs`, invariant 1):
/// each one's first seq and entries, shared with the overlay. The flusher
/// frames them itself, off the appenders' threads and their lock.
#[derive(Default)]
struct Pending {
    appends: Vec<(u64, Arc<[wal::Entry]>)>,
    /// About how many bytes their frames take.
    bytes: usize,
    /// The last seq they carry; 0 while there are none.
    last_seq: u64,
}

/// What the flusher and applier threads take over when they start.
struct Unstarted {
    queue: mpsc::Receiver<Waiter>,
    work: mpsc::Receiver<Work>,
    disk: fsync::DiskSync,
    /// `None` for a read-only journal, which never writes.
    wal: Option<wal::Wal>,
}

impl SledEngine {
    /// Takes seqs for `entries`, puts them in the overlay (readable at once)
    /// and queues them for the log and the applier (invariant 1).
    fn append_entries(
        &self,
        entries: Vec<(&'static str, crate::table::Key, Arc<[u8]>)>,
    ) -> Result<u64, Error> {
        // A panic while holding the lock cannot leave the counter half-updated:
        // it is written only after the entries are queued.
        let mut last_seq = self.last_seq.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(refusal) = self.refusal() {
            return Err(refusal);
        }
        if entries.is_empty() {
            return Ok(*last_seq);
        }
        if self.faults.writes_fail() {
            return Err(self.progress.fail("a write", Error::Injected("write")));
        }
        let first_seq = *last_seq + 1;
        let entries: Vec<wal::Entry> = entries
            .into_iter()
            .zip(first_seq..)
            .map(|((tree, key, value), seq)| (tree, key.at(seq), value))
            .collect();
        let seq = first_seq + entries.len() as u64 - 1;
        let bytes = wal::frame_bytes(&entries);
        let entries: Arc<[wal::Entry]> = entries.into();

        // Both under the seq lock, so each queues in seq order: the overlay
        // (readable at once, and the applier's queue), the log's appends.
        let wake = self
            .overlay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(first_seq, Arc::clone(&entries));
        if wake {
            let work = self.work.as_ref().ok_or(Error::Closed)?;
            work.send(Work::Wake)
                .map_err(|_| self.progress.fail("a write", Error::Closed))?;
        }
        let (before, backlog) = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            let before = pending.bytes;
            pending.appends.push((first_seq, entries));
            pending.bytes += bytes;
            pending.last_seq = seq;
            (before, pending.bytes)
        };
        // Appends nobody commits (recovery's, a bulk load's) are written out
        // all the same once they add up, so the frames waiting in memory stay
        // bounded and checkpoints keep coming. Asked once as the backlog
        // crosses the mark (the flush takes all of it); nobody waits for it.
        if before < PENDING_FRAME_BYTES
            && backlog >= PENDING_FRAME_BYTES
            && let Some(waiters) = &self.waiters
        {
            let (reply, _) = oneshot::channel();
            let _ = waiters.send(Waiter { seq, reply });
        }

        *last_seq = seq;
        // Published under the lock so `applied` never goes backwards.
        self.progress.applied.store(seq, Ordering::Release);
        Ok(seq)
    }

    async fn wait_for(&self, seq: u64) -> Result<(), Error> {
        if self.durable_seq() >= seq {
            return Ok(());
        }
        let (reply, done) = oneshot::channel();
        let waiters = self.waiters.as_ref().ok_or(Error::Closed)?;
        waiters
            .send(Waiter { seq, reply })
            .map_err(|_| Error::Closed)?;
        match done.await {
            Ok(result) => result,
            // The flusher died with our waiter in hand.
            Err(_) => Err(Error::Closed),
        }
    }
}

impl Engine for SledEngine {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn refusal(&self) -> Option<Error> {
        if self.read_only {
            return Some(Error::ReadOnly);
        }
        self.progress
            .failure
            .get()
            .map(|first| Error::Failed(first.clone()))
    }

    fn append(&self, rows: Vec<Row>) -> Result<u64, Error> {
        let entries = rows
            .into_iter()
            .map(|row| (row.table.name, row.key, row.value))
            .collect();
        self.append_entries(entries)
    }

    fn wait_durable(&self, seq: u64) -> Durable<'_> {
        Box::pin(self.wait_for(seq))
    }

    fn applied_seq(&self) -> u64 {
        self.progress.applied.load(Ordering::Acquire)
    }

    fn durable_seq(&self) -> u64 {
        self.progress.durable.load(Ordering::Acquire)
    }

    fn failed(&self) -> Option<String> {
        self.progress.failure.get().cloned()
    }

    fn get(&self, table: &'static TableDef, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.read_one(table, key)
    }

    fn scan(
        &self,
        table: &'static TableDef,
        span: Span<'_>,
        visit: &mut Visit<'_>,
    ) -> Result<(), Error> {
        match span {
            Span::Prefix(prefix) => self.read_prefix(table, prefix, visit),
            Span::Below(bound) => self.read_below(table, bound, visit),
        }
    }

    fn last(&self, table: &'static TableDef, prefix: &[u8]) -> Result<Option<OwnedRow>, Error> {
        self.read_last(table, prefix)
    }

    fn remove(&self, prefixes: Vec<(&'static TableDef, Vec<u8>)>) -> Result<u64, Error> {
        // A removal takes the keys sled holds when it is applied: everything
        // appended before it goes into sled first.
        self.drain();
        let entries = prefixes
            .into_iter()
            .map(|(table, prefix)| (table.name, crate::table::Key::Whole(prefix), wal::removal()))
            .collect();
        let seq = self.append_entries(entries)?;
        // Reads answer from sled until the applier takes the removals: once
        // this returns, none finds the rows any more.
        self.drain();
        Ok(seq)
    }

    fn walk(&self, table: &'static TableDef, visit: &mut WalkVisit<'_>) -> Result<(), Error> {
        self.walk_table(table, visit)
    }

    fn check_own(&self) -> Result<Vec<(String, String, String)>, Error> {
        self.check_meta()
    }

    fn counters(&self) -> Counters {
        Counters {
            flushes: self.progress.flushes.load(Ordering::Acquire),
            syncs: self.progress.syncs.load(Ordering::Acquire),
            checkpoints: self.progress.checkpoints.load(Ordering::Acquire),
        }
    }

    fn faults(&self) -> &Faults {
        &self.faults
    }

    /// At its close, leave to the log what sled has not taken, instead of
    /// applying it then: the close writes and syncs every frame first, so
    /// nothing is lost, and the next open applies it (`wal.rs`, invariant
    /// 4), in one batch, which costs sled less than the several it would
    /// have taken here. A journal whose files are read straight through
    /// sled after it closes (tests, tools) keeps the default, and sled then
    /// holds everything.
    fn leave_unapplied_at_close(&self) {
        self.leave_unapplied.store(true, Ordering::Release);
    }

    /// Writes sled's own buffers to its files: not a checkpoint (the log
    /// keeps what sled has not taken), but what a process that ends without
    /// dropping the journal owes sled, whose next open otherwise finds its
    /// files cut short, says so, and drops what its own log lacks (which
    /// the journal's log replays: nothing is lost either way).
    fn flush_store(&self) -> Result<(), Error> {
        self.db.flush()?;
        Ok(())
    }
}

impl Drop for SledEngine {
    fn drop(&mut self) {
        // Closing the channel ends the flusher's loop. No waiter can be queued:
        // each one is sent through a handle that keeps this engine alive. A
        // flusher parked on a held flush is woken for good first, or the join
        // would wait forever.
        self.faults.close();
        drop(self.waiters.take());
        drop(self.work.take());
        // The flusher ends first; its end closes the applier's queue, which
        // applies what is left in it and ends.
        for (thread, name) in [
            (&mut self.flusher, "flusher"),
            (&mut self.applier, "applier"),
        ] {
            let handle = thread
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(handle) = handle
                && handle.join().is_err()
            {
                tracing::error!("the journal {name} panicked");
            }
        }
    }
}

impl Trees {
    fn open(db: &sled::Db) -> Result<Trees, Error> {
        Ok(Trees {
            tables: JOURNAL_TABLES
                .iter()
                .map(|table| db.open_tree(table.name))
                .collect::<Result<_, _>>()?,
            meta: db.open_tree(META)?,
        })
    }

    fn get(&self, name: &str) -> &sled::Tree {
        match crate::table::table_index(name) {
            Some(at) => &self.tables[at],
            None if name == META => &self.meta,
            None => unreachable!("no journal tree {name:?}"),
        }
    }
}

impl Progress {
    /// Remembers `error` as the journal's failure if it is the first, and
    /// hands it back for the caller to return.
    fn fail(&self, what: &str, error: Error) -> Error {
        tracing::error!(error = %error, "journal: {what} failed; the journal takes no more writes");
        let _ = self.failure.set(format!("{what} failed: {error}"));
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Journal;
    use crate::record::{LedgerOp, LedgerRecord, Record, SteerRecord, SteerState};
    use arbor_protocol::{Event, JobId, ParentRef, RunId};
    use std::future::Future;
    use std::task::{Context, Waker};

    fn unstarted(dir: &std::path::Path) -> (Arc<SledEngine>, Unstarted) {
        let (engine, unstarted) = SledEngine::open_without_flusher(dir).unwrap();
        (Arc::new(engine), unstarted)
    }

    fn steer(job: JobId, message_id: u64) -> Record {
        Record::Steer(SteerRecord {
            job,
            message_id,
            text: format!("message {message_id}"),
            state: SteerState::Queued,
            epoch: 1,
        })
    }

    #[tokio::test]
    async fn commits_queued_before_the_flusher_starts_share_one_flush() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, unstarted) = unstarted(dir.path());
        let journal = Journal::new(engine.clone());
        let job = JobId::new();

        // First poll of each commit appends and queues its waiter, then parks.
        let mut commits: Vec<_> = (1..=50)
            .map(|n| Box::pin(journal.commit(vec![steer(job, n)])))
            .collect();
        let mut cx = Context::from_waker(Waker::noop());
        for commit in &mut commits {
            assert!(commit.as_mut().poll(&mut cx).is_pending());
        }
        assert_eq!(journal.durable_seq(), 0);

        engine.start_flusher(unstarted).unwrap();
        for (n, commit) in commits.into_iter().enumerate() {
            assert_eq!(commit.await.unwrap(), n as u64 + 1);
        }
        assert_eq!(journal.flush_count(), 1);
        assert_eq!(journal.durable_seq(), 50);
    }

    #[tokio::test]
    async fn a_checkpoint_flushes_sled_and_removes_the_segments_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, mut unstarted) = unstarted(dir.path());
        let journal = Journal::new(engine.clone());
        // Every flush asks for a checkpoint.
        unstarted.wal.as_mut().unwrap().checkpoint_bytes = 1;
        engine.start_flusher(unstarted).unwrap();
        let job = JobId::new();
        let segments = || {
            std::fs::read_dir(dir.path().join(wal::WAL_DIR))
                .unwrap()
                .count()
        };
        for n in 1..=5 {
            journal.commit(vec![steer(job, n)]).await.unwrap();
        }
        // The checkpointer runs on its own thread and signals nothing a test
        // can await; a bounded wait for its count.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while segments() > 1 {
            assert!(std::time::Instant::now() < deadline, "segments left behind");
            std::thread::yield_now();
        }
        // Only the open segment is left; sled itself holds all five.
        assert!(journal.checkpoint_count() >= 1);
        let db_only = tempfile::tempdir().unwrap();
        for name in ["db", "conf"] {
            std::fs::copy(dir.path().join(name), db_only.path().join(name)).unwrap();
        }
        drop((journal, engine));
        let reopened = Journal::open(db_only.path()).unwrap();
        assert_eq!(reopened.steering(job).unwrap().len(), 5);
    }

    #[tokio::test]
    async fn an_append_reads_back_at_once_and_reaches_sled_behind_it() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, unstarted) = unstarted(dir.path());
        let journal = Journal::new(engine.clone());
        let job = JobId::new();
        journal.append(vec![steer(job, 1), steer(job, 2)]).unwrap();
        // No applier yet: sled has nothing, the reads have both.
        assert_eq!(engine.trees.get("steering").len(), 0);
        assert_eq!(journal.steering(job).unwrap().len(), 2);
        engine.start_flusher(unstarted).unwrap();
        engine.drain();
        assert_eq!(engine.trees.get("steering").len(), 2);
        assert!(engine.overlay.lock().unwrap().is_empty());
        assert_eq!(journal.steering(job).unwrap().len(), 2);
    }

    fn event(run: RunId, seq: u64) -> Record {
        Record::Event(Event {
            seq,
            run,
            at_ms: seq,
            kind: arbor_protocol::EventKind::RunResumed {
                epoch: seq,
                group: 0,
            },
        })
    }

    /// sled takes a run's events in chunks (`chunk.rs`),
    /// and every read, scan and reopen sees each event once, in seq order,
    /// before the applier has them, after, and across runs that interleave.
    #[tokio::test]
    async fn events_reach_sled_in_chunks_and_read_back_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, unstarted) = unstarted(dir.path());
        let journal = Journal::new(engine.clone());
        let (a, b) = (RunId::new(), RunId::new());
        let total = 200;
        for seq in 1..=total {
            let run = if seq % 3 == 0 { b } else { a };
            journal.append(vec![event(run, seq)]).unwrap();
        }
        let seqs =
            |run| -> Vec<u64> { journal.events(run).unwrap().iter().map(|e| e.seq).collect() };
        let expect_a: Vec<u64> = (1..=total).filter(|s| s % 3 != 0).collect();
        let expect_b: Vec<u64> = (1..=total).filter(|s| s % 3 == 0).collect();
        assert_eq!(seqs(a), expect_a, "from the overlay");
        engine.start_flusher(unstarted).unwrap();
        engine.drain();
        assert!(engine.overlay.lock().unwrap().is_empty());
        assert_eq!(seqs(a), expect_a, "from sled");
        assert_eq!(seqs(b), expect_b);
        let stored = engine.trees.get("events").len();
        // One batch (the applier started after every append): 134 events of
        // `a` and 66 of `b`, in chunks of at most 64.
        assert_eq!(stored, 3 + 2, "{total} events in {stored} sled entries");
        // A scan counts events, not chunks.
        let report = journal.scan().unwrap();
        assert_eq!(report.records, total, "{:?}", report.undecodable);
        journal.flush().await.unwrap();
        drop((journal, engine));
        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.events(a).unwrap().len(), expect_a.len());
        assert_eq!(reopened.scan().unwrap().records, total);
    }

    /// The ledger goes to sled in chunks too, one per account and batch,
    /// and reads back entry by entry in the order written; a scan counts
    /// entries and hands every one to `verify`.
    #[tokio::test]
    async fn ledger_entries_reach_sled_in_chunks_and_read_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, unstarted) = unstarted(dir.path());
        let journal = Journal::new(engine.clone());
        let owners = [ParentRef::Run(RunId::new()), ParentRef::Job(JobId::new())];
        let entry = |owner, n| {
            Record::Ledger(LedgerRecord {
                owner,
                op: LedgerOp::CallReserve { tokens: n },
                epoch: 1,
            })
        };
        for n in 1..=100 {
            journal
                .append(vec![entry(owners[(n % 2) as usize], n)])
                .unwrap();
        }
        let tokens = |owner| -> Vec<u64> {
            let ops = journal.ledger(owner).unwrap().into_iter().map(|e| e.op);
            ops.map(|op| match op {
                LedgerOp::CallReserve { tokens } => tokens,
                other => panic!("{other:?}"),
            })
            .collect()
        };
        let evens: Vec<u64> = (1..=100).filter(|n| n % 2 == 0).collect();
        assert_eq!(tokens(owners[0]), evens, "from the overlay");
        engine.start_flusher(unstarted).unwrap();
        engine.drain();
        assert_eq!(tokens(owners[0]), evens, "from sled");
        // 50 entries of each account: one chunk each.
        assert_eq!(engine.trees.get("ledger").len(), 2);
        let report = journal.verify().unwrap();
        assert_eq!(report.records, 100, "{:?}", report.undecodable);
        assert_eq!(report.accounts, 2);
        // A later append of the same account lands in a chunk of its own,
        // after the first.
        journal.append(vec![entry(owners[0], 102)]).unwrap();
        engine.drain();
        assert_eq!(engine.trees.get("ledger").len(), 3);
        assert_eq!(tokens(owners[0]).last(), Some(&102));
        assert_eq!(tokens(owners[0]).len(), 51);
    }

    #[tokio::test]
    async fn an_append_takes_one_seq_per_record_and_empty_appends_take_none() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let owner = ParentRef::Run(RunId::new());
        let open = |grant| {
            Record::Ledger(LedgerRecord {
                owner,
                op: LedgerOp::Open { grant },
                epoch: 1,
            })
        };
        assert_eq!(journal.append(vec![open(1), open(2), open(3)]).unwrap(), 3);
        assert_eq!(journal.append(vec![]).unwrap(), 3);
        assert_eq!(journal.commit(vec![]).await.unwrap(), 3);
        assert!(journal.durable_seq() >= 3);
        // Ledger keys carry the seq, so the three entries are distinct and in order.
        let grants: Vec<_> = journal
            .ledger(owner)
            .unwrap()
            .into_iter()
            .map(|e| e.op)
            .collect();
        assert_eq!(
            grants,
            vec![
                LedgerOp::Open { grant: 1 },
                LedgerOp::Open { grant: 2 },
                LedgerOp::Open { grant: 3 }
            ]
        );
    }

    #[tokio::test]
    async fn flush_waits_for_everything_appended_and_a_second_flush_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let seq = journal.append(vec![steer(JobId::new(), 1)]).unwrap();
        journal.flush().await.unwrap();
        assert!(journal.durable_seq() >= seq);
        let flushes = journal.flush_count();
        journal.flush().await.unwrap();
        assert_eq!(journal.flush_count(), flushes);
    }
}
