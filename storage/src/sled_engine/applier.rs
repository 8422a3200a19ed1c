//! The applier thread: takes the appends queued in the overlay and applies
//! them to sled in batches, each one transaction with `meta/seq`; flushes
//! and syncs sled at checkpoints (`overlay.rs` has the invariants).

use super::handle::{META, META_SEQ, Progress, Trees};
use super::work::Work;
use super::{chunk, fsync::DiskSync, wal};
use crate::Error;
use crate::faults::Faults;
use crate::overlay::Overlay;
use crate::table::{JOURNAL_TABLES, Shape};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};

/// How many applied entries leave the overlay in one hold of its lock.
const APPLIED_AT_ONCE: usize = 256;

/// At most this many entries go into one sled transaction, so a backlog is
/// applied in steps rather than held in memory as one huge transaction, and
/// a close that leaves the rest to the log waits for one step at most.
pub(super) const APPLY_STEP: usize = 4096;

/// How long the applier gathers appends before it applies them. Nothing
/// waits for the applier (reads see the overlay, commits wait for the log),
/// so this costs only memory: it is what turns a trickle of appends into
/// few transactions, each of which costs sled two IO buffer writes, and
/// into fewer sled entries. A job's record, written three times in its life
/// (pending, running, its end), reaches sled once if that life falls in one
/// batch, and each account's ledger entries and each run's events go in
/// fewer, fuller chunks: a 1,088-job fan-out (about 19,000 records) took
/// 3,800 to 5,600 sled entries at 20 ms, and about 2,700 at this (counted).
const APPLY_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// The applier thread's state (`overlay.rs`).
pub(super) struct Applier {
    pub(super) db: sled::Db,
    pub(super) trees: Trees,
    pub(super) disk: DiskSync,
    pub(super) overlay: Arc<Mutex<Overlay>>,
    pub(super) progress: Arc<Progress>,
    /// Leave what is queued at the close to the log (`leave_unapplied_at_close`).
    pub(super) leave_unapplied: Arc<AtomicBool>,
    /// A power cut armed (`Faults::crash_at`): sled stays at its last sync.
    pub(super) faults: Arc<Faults>,
}

impl Applier {
    /// Until the queue closes: woken by an append, wait `APPLY_EVERY` for
    /// more (or less, if a request or a second wake comes), then take and
    /// apply everything queued, then do what was asked (a checkpoint, or an
    /// answer to a drain). What is queued when the journal closes is applied
    /// as the loop ends, unless it is left to the log
    /// (`leave_unapplied_at_close`).
    pub(super) fn run(mut self, queue: mpsc::Receiver<Work>) {
        while let Ok(first) = queue.recv() {
            let then = match first {
                // A closed queue ends the wait at once, and the loop.
                Work::Wake => match queue.recv_timeout(APPLY_EVERY) {
                    Ok(Work::Wake) | Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    Ok(request) => Some(request),
                },
                request => Some(request),
            };
            // A checkpoint and a drain need everything queued in sled; a
            // wake only asks, and gives way to a close that leaves the rest
            // to the log, or to an armed power cut, which keeps sled at its
            // last sync.
            let asked = then.is_none() || matches!(then, Some(Work::Wake));
            if asked && self.faults.holds_sled() {
                continue;
            }
            self.apply_queued(asked);
            match then {
                Some(Work::Checkpoint(segments)) => self.checkpoint(&segments),
                Some(Work::Drain(done)) => {
                    if self.faults.holds_sled() {
                        // What a drain put into sled is synced at once, so
                        // that a power cut keeps it as sled's last sync.
                        self.sync_sled();
                    }
                    let _ = done.send(());
                }
                Some(Work::Wake) | None => {}
            }
        }
        self.apply_queued(true);
    }

    /// Takes what is queued and applies it, `APPLY_STEP` entries to a
    /// transaction. If `yielding`, it stops between steps once the journal
    /// is to leave the rest to the log (`leave_unapplied_at_close`): a close
    /// then waits for one step at most, not for a whole backlog.
    fn apply_queued(&self, yielding: bool) {
        loop {
            if yielding && self.leave_unapplied.load(Ordering::Acquire) {
                return;
            }
            let (first_seq, appends) = self
                .overlay
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take_queued(APPLY_STEP);
            let batch: Vec<&wal::Entry> = appends.iter().flat_map(|a| a.iter()).collect();
            if batch.is_empty() {
                return;
            }
            self.apply(&batch, first_seq + batch.len() as u64 - 1);
        }
    }

    fn apply(&self, batch: &[&wal::Entry], last_seq: u64) {
        if self.progress.failure.get().is_some() {
            return; // nothing more goes to sled; the log has what was acknowledged
        }
        match self.trees.apply(batch, last_seq) {
            // A few hundred at a time under the overlay's lock, which every
            // append takes too: sled holds them all already, so a read in
            // between finds each one in one or the other.
            Ok(()) => {
                for some in batch.chunks(APPLIED_AT_ONCE) {
                    self.overlay
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .applied(some, last_seq);
                }
            }
            Err(e) => {
                self.progress.fail("applying appends to sled", e);
            }
        }
    }

    /// Flush sled and sync its files (fault injection's drain).
    fn sync_sled(&mut self) {
        let synced = self
            .db
            .flush()
            .map_err(Error::Sled)
            .and_then(|_| self.disk.after_flush());
        if let Err(e) = synced {
            self.progress.fail("syncing sled", e);
        }
    }

    /// Flush sled and sync its files, then remove the segments (`wal.rs`,
    /// invariant 3). Every append they carry was applied before this.
    fn checkpoint(&mut self, segments: &[std::path::PathBuf]) {
        if self.progress.failure.get().is_some() {
            return; // keep every segment: the next open replays them
        }
        let checkpointed = self
            .db
            .flush()
            .map_err(Error::Sled)
            .and_then(|_| self.disk.after_flush())
            .and_then(|()| wal::remove_segments(segments));
        match checkpointed {
            Ok(()) => {
                self.progress.checkpoints.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) => {
                self.progress.fail("a checkpoint", e);
            }
        }
    }
}

impl Trees {
    /// Writes `entries` and `meta/seq = last_seq` in one sled transaction, so
    /// after a crash sled holds all of them or none, and its stored seq says
    /// which (`wal.rs`, invariant 4). A history table's rows go in chunks,
    /// an owner's together (`chunk.rs`).
    pub(super) fn apply(&self, entries: &[&wal::Entry], last_seq: u64) -> Result<(), Error> {
        let mut batches: Vec<(&'static str, sled::Batch)> = Vec::new();
        fn batch_of<'b>(
            batches: &'b mut Vec<(&'static str, sled::Batch)>,
            tree: &'static str,
        ) -> &'b mut sled::Batch {
            let at = match batches.iter().position(|(name, _)| *name == tree) {
                Some(at) => at,
                None => {
                    batches.push((tree, sled::Batch::default()));
                    batches.len() - 1
                }
            };
            &mut batches[at].1
        }
        // A history table's rows by owner (events by run, ledger entries by
        // account), each owner's in key order (appends come in seq order,
        // and an owner's keys rise with them), go in chunks.
        let mut owned: Vec<(&'static str, &[u8], Vec<&wal::Entry>)> = Vec::new();
        let mut index: HashMap<(&str, &[u8]), usize> = HashMap::new();
        for entry in entries {
            let (tree, key, value) = entry;
            if wal::is_removal(value) {
                // Every key under the prefix that sled holds now: `forget`
                // drained the applier first, so these are all of them.
                let batch = batch_of(&mut batches, tree);
                for stored in self.get(tree).scan_prefix(key).keys() {
                    batch.remove(stored?);
                }
                continue;
            }
            let Some(Shape::History { owner_bytes }) =
                crate::table::table_index(tree).map(|at| JOURNAL_TABLES[at].def().shape)
            else {
                batch_of(&mut batches, tree).insert(&key[..], &value[..]);
                continue;
            };
            let owner = &key[..key.len().min(owner_bytes)];
            match index.get(&(*tree, owner)) {
                Some(&at) => owned[at].2.push(entry),
                None => {
                    index.insert((tree, owner), owned.len());
                    owned.push((tree, owner, vec![entry]));
                }
            }
        }
        for (tree, _, of_owner) in &owned {
            for rows in of_owner.chunks(chunk::MOST_ROWS) {
                let value = chunk::encode(rows.iter().map(|(_, k, v)| (k.as_slice(), &v[..])));
                batch_of(&mut batches, tree).insert(&rows[0].1[..], value);
            }
        }
        let mut meta = sled::Batch::default();
        meta.insert(META_SEQ, &last_seq.to_be_bytes());
        batches.push((META, meta));

        let trees: Vec<&sled::Tree> = batches.iter().map(|(name, _)| self.get(name)).collect();
        trees
            .as_slice()
            .transaction(|views| {
                for (view, (_, batch)) in views.iter().zip(&batches) {
                    view.apply_batch(batch)?;
                }
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                TransactionError::Storage(e) => Error::Sled(e),
                // The closure never aborts.
                TransactionError::Abort(()) => unreachable!("journal append aborted"),
            })
    }
}
