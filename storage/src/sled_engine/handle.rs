//! The sled engine itself: its state, shared with its threads, its append
//! (invariant 1 of `sled_engine.rs`), and the `Engine` methods.

use super::work::Work;
use super::{fsync, wal};
use crate::Error;
use crate::engine::{Counters, Durable, Engine, OwnedRow, Span, Visit, WalkVisit};
use crate::faults::Faults;
use crate::overlay::Overlay;
use crate::table::{JOURNAL_TABLES, Row, TableDef};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::thread;
use tokio::sync::oneshot;

/// The journal's engine on sled and its write-ahead log.
pub struct SledEngine {
    pub(super) db: sled::Db,
    /// arbor's lock on the directory, held while the journal is open.
    pub(super) _dir_lock: std::fs::File,
    pub(super) trees: Trees,
    pub(super) epoch: u64,
    /// The last seq handed out, held for the whole of an append (invariant 1).
    pub(super) last_seq: Mutex<u64>,
    pub(super) progress: Arc<Progress>,
    pub(super) faults: Arc<Faults>,
    /// Opened with `open_read_only`: every write is refused.
    pub(super) read_only: bool,
    /// Frames appended and not yet handed to the flusher.
    pub(super) pending: Arc<Mutex<Pending>>,
    /// Appends not yet applied to sled, read over it.
    pub(super) overlay: Arc<Mutex<Overlay>>,
    /// The applier's queue; `None` only while dropping.
    pub(super) work: Option<mpsc::Sender<Work>>,
    /// `None` only while dropping.
    pub(super) waiters: Option<mpsc::Sender<Waiter>>,
    pub(super) flusher: Mutex<Option<thread::JoinHandle<()>>>,
    pub(super) applier: Mutex<Option<thread::JoinHandle<()>>>,
    /// Set by `leave_unapplied_at_close`; read by the applier as it ends.
    pub(super) leave_unapplied: Arc<AtomicBool>,
}

/// The sled tree of each table, in `JOURNAL_TABLES` order, and `meta`.
pub(super) struct Trees {
    pub(super) tables: Vec<sled::Tree>,
    pub(super) meta: sled::Tree,
}

/// The tree that holds the engine's own entries: bare big-endian integers
/// with no version byte, so `format` is readable whatever the record format.
pub(super) const META: &str = "meta";
pub(super) const META_FORMAT: &[u8] = b"format"; // u32
pub(super) const META_EPOCH: &[u8] = b"epoch"; // u64
pub(super) const META_SEQ: &[u8] = b"seq"; // u64

/// What the engine and its threads share: numbers, and the first failure.
pub(super) struct Progress {
    /// The last seq applied to sled (visible to reads).
    pub(super) applied: AtomicU64,
    /// The last seq covered by a completed flush.
    pub(super) durable: AtomicU64,
    /// Log writes completed, each with its `fdatasync`.
    pub(super) flushes: AtomicU64,
    /// `fdatasync`s of the log by the flusher (one per flush).
    pub(super) syncs: AtomicU64,
    /// Checkpoints completed: sled flushed and synced, old segments removed.
    pub(super) checkpoints: AtomicU64,
    /// The first write or flush that failed; set once, never cleared.
    pub(super) failure: OnceLock<String>,
}

/// Frames in memory past which an append asks for a flush itself.
const PENDING_FRAME_BYTES: usize = 4 * 1024 * 1024;

/// A commit waiting for a flush that covers `seq`.
pub(super) struct Waiter {
    pub(super) seq: u64,
    pub(super) reply: oneshot::Sender<Result<(), Error>>,
}

/// Appends waiting for the flusher, in seq order (`wal.rs`, invariant 1):
/// each one's first seq and entries, shared with the overlay. The flusher
/// frames them itself, off the appenders' threads and their lock.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) appends: Vec<(u64, Arc<[wal::Entry]>)>,
    /// About how many bytes their frames take.
    pub(super) bytes: usize,
    /// The last seq they carry; 0 while there are none.
    pub(super) last_seq: u64,
}

/// What the flusher and applier threads take over when they start.
pub(super) struct Unstarted {
    pub(super) queue: mpsc::Receiver<Waiter>,
    pub(super) work: mpsc::Receiver<Work>,
    pub(super) disk: fsync::DiskSync,
    /// `None` for a read-only journal, which never writes.
    pub(super) wal: Option<wal::Wal>,
}

impl SledEngine {
    /// Takes seqs for `entries`, puts them in the overlay (readable at once)
    /// and queues them for the log and the applier (invariant 1).
    pub(super) fn append_entries(
        &self,
        entries: impl ExactSizeIterator<Item = (&'static str, crate::table::Key, Arc<[u8]>)>,
    ) -> Result<u64, Error> {
        // A panic while holding the lock cannot leave the counter half-updated:
        // it is written only after the entries are queued.
        let mut last_seq = self.last_seq.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(refusal) = self.refusal() {
            return Err(refusal);
        }
        if entries.len() == 0 {
            return Ok(*last_seq);
        }
        if self.faults.writes_fail() {
            return Err(self.progress.fail("a write", Error::Injected("write")));
        }
        let first_seq = *last_seq + 1;
        let entries: Vec<wal::Entry> = entries
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
        crate::engine::refusal(self.read_only, self.progress.failure.get())
    }

    fn append(&self, rows: Vec<Row>) -> Result<u64, Error> {
        self.append_entries(
            rows.into_iter()
                .map(|row| (row.table.name, row.key, row.value)),
        )
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
            .map(|(table, prefix)| (table.name, crate::table::Key::Whole(prefix), wal::removal()));
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
    pub(super) fn open(db: &sled::Db) -> Result<Trees, Error> {
        Ok(Trees {
            tables: JOURNAL_TABLES
                .iter()
                .map(|table| db.open_tree(table.def().name))
                .collect::<Result<_, _>>()?,
            meta: db.open_tree(META)?,
        })
    }

    pub(super) fn get(&self, name: &str) -> &sled::Tree {
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
    pub(super) fn fail(&self, what: &str, error: Error) -> Error {
        tracing::error!(error = %error, "journal: {what} failed; the journal takes no more writes");
        let _ = self.failure.set(format!("{what} failed: {error}"));
        error
    }
}
