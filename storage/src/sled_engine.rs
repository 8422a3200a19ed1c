//! The journal handle: opening the sled db, appending records in seq order,
//! group commit, and reads.
//!
//! A `Journal` is a cheap clone of an `Arc`. Behind it, two dedicated threads:
//! the flusher owns the write-ahead log (`wal.rs`) and every sync of it, and
//! the applier applies appends to sled in batches (`overlay.rs`) and owns
//! every `db.flush()` and every sync of sled's files (`fsync.rs`). Callers
//! never flush themselves.
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
//! 4. A `commit` returns only once `durable_seq >= ` its seq.
//! 5. An append whose records carry any epoch but this boot's is refused
//!    whole, before anything is written (I-41).
//! 6. After the first failed write or flush (real or injected), every append
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
//! Group commit: `commit` sends a waiter to the flusher and awaits a oneshot.
//! The flusher takes every waiter queued so far and every frame queued so far,
//! writes the frames with one `write` and one `fdatasync`, publishes the last
//! seq they carry as durable and wakes them all. Commits that arrive during a
//! flush are served together by the next one, so under load the number of
//! flushes stays far below the number of commits.
//!
//! Checkpoints: once `CHECKPOINT_BYTES` of frames have been written, the
//! flusher starts a new segment and asks the applier, behind every append
//! the old segments carry, to flush sled, sync its files and only then
//! remove them. Commits never wait for sled.
//!
//! Deadlock safety: the append mutex is never held across an await or while
//! talking to the flusher, and the flusher takes no lock of ours; it shares
//! only atomics and a set-once cell (`Progress`) with the handles, and the
//! hold of `Faults`, which `append` never touches. It does not hold the handle's
//! `Inner` either, so dropping the last handle closes its channel, the thread
//! ends, and the drop joins it (which also releases sled's lock on the dir).

use crate::Error;
use crate::codec::{
    self, DELEGATIONS, EVENTS, JOBS, LEDGER, META, META_EPOCH, META_FORMAT, META_SEQ, RECORD_TREES,
    RUNS, SANDBOXES, STEERING, SUBMISSIONS,
};
use crate::faults::{CrashKind, CrashPoint, Faults};
use crate::fsync::DiskSync;
use crate::overlay::{Overlay, Work};
use crate::record::{
    DelegationRecord, JobRecord, LedgerRecord, Record, RunRecord, SandboxRecord, SandboxState,
    SteerRecord, SubmissionRecord,
};
use crate::verify::{self, VerifyReport};
use crate::wal::{self, Wal};
use arbor_protocol::{Event, JobId, ParentRef, RunId};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::thread;
use tokio::sync::oneshot;

/// A handle on the journal; clone it freely.
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Inner>,
}

/// What `Journal::scan` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Records that decoded and sit under the key their content implies.
    pub records: u64,
    /// Everything else, `meta` entries included.
    pub undecodable: Vec<Undecodable>,
}

/// One stored entry that does not decode, named by tree and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undecodable {
    pub tree: String,
    pub key_hex: String,
    pub error: String,
}

struct Inner {
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
    commit_observer: OnceLock<CommitObserver>,
    /// Set by `leave_unapplied_at_close`; read by the applier as it ends.
    leave_unapplied: Arc<AtomicBool>,
}

type CommitObserver = Box<dyn Fn(std::time::Duration) + Send + Sync>;

struct Trees {
    runs: sled::Tree,
    jobs: sled::Tree,
    ledger: sled::Tree,
    delegations: sled::Tree,
    steering: sled::Tree,
    events: sled::Tree,
    sandboxes: sled::Tree,
    submissions: sled::Tree,
    meta: sled::Tree,
}

/// What the handles and the flusher share: numbers, and the first failure.
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
    disk: DiskSync,
    /// `None` for a read-only journal, which never writes.
    wal: Option<Wal>,
}

impl Journal {
    /// Opens (creating) the sled db at `dir`, checks or writes the format
    /// version, bumps the boot epoch and starts the flusher.
    pub fn open(dir: &Path) -> Result<Journal, Error> {
        let (journal, unstarted) = Self::open_without_flusher(dir)?;
        journal.start_flusher(unstarted)?;
        Ok(journal)
    }

    /// This boot's epoch: 1 on the first open of a directory, +1 on each reopen.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Applies `records` now, atomically and in order, and returns the seq of
    /// the last one (each record takes one seq). Reads see them at once; they
    /// are not durable until a flush covers them (see `commit`). An empty
    /// list applies nothing and returns the last seq handed out.
    ///
    /// Refused whole, with nothing written: a record of another boot's epoch
    /// (`StaleEpoch`, `FutureEpoch`), and every append once the journal has
    /// failed (`Failed`). A write that fails marks the journal failed.
    pub fn append(&self, records: Vec<Record>) -> Result<u64, Error> {
        self.append_prepared(self.prepare(records))
    }

    /// Encodes `records` for an append, outside the journal's lock: their
    /// values (the costly part), and every key but a ledger entry's, which
    /// takes its seq. An event bus that must append under its own lock, so
    /// that journal order is emission order, prepares its records first.
    /// What would refuse the append is kept for `append_prepared` to tell.
    pub fn prepare(&self, records: Vec<Record>) -> Prepared {
        let epochs = check_epochs(&records, self.inner.epoch).err();
        let mut entries = Vec::with_capacity(records.len());
        let mut unencoded = None;
        for record in records {
            match encode(record) {
                Ok(entry) => entries.push(entry),
                Err(e) => {
                    unencoded.get_or_insert(e);
                }
            }
        }
        Prepared {
            entries,
            epochs,
            unencoded,
        }
    }

    /// `append`, of records `prepare` encoded.
    pub fn append_prepared(&self, prepared: Prepared) -> Result<u64, Error> {
        let inner = &*self.inner;
        // A panic while holding the lock cannot leave the counter half-updated:
        // it is written only after the transaction succeeds.
        let mut last_seq = inner
            .last_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if inner.read_only {
            return Err(Error::ReadOnly);
        }
        if let Some(first) = inner.progress.failure.get() {
            return Err(Error::Failed(first.clone()));
        }
        if prepared.entries.is_empty() && prepared.unencoded.is_none() {
            return Ok(*last_seq);
        }
        if let Some(e) = prepared.epochs {
            return Err(e);
        }
        if inner.faults.writes_fail() {
            return Err(inner.progress.fail("a write", Error::Injected("write")));
        }
        // A record that could not be encoded fails the whole append with
        // nothing written.
        if let Some(e) = prepared.unencoded {
            return Err(e);
        }
        let first_seq = *last_seq + 1;
        let entries: Vec<wal::Entry> = prepared
            .entries
            .into_iter()
            .zip(first_seq..)
            .map(|((tree, key, value), seq)| (tree, key.at(seq), value))
            .collect();
        let seq = first_seq + entries.len() as u64 - 1;
        let bytes = wal::frame_bytes(&entries);
        let entries: Arc<[wal::Entry]> = entries.into();

        // Both under the seq lock, so each queues in seq order: the overlay
        // (readable at once, and the applier's queue), the log's appends.
        let wake = inner
            .overlay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(first_seq, Arc::clone(&entries));
        if wake {
            let work = inner.work.as_ref().ok_or(Error::Closed)?;
            work.send(Work::Wake)
                .map_err(|_| inner.progress.fail("a write", Error::Closed))?;
        }
        let (before, backlog) = {
            let mut pending = inner.pending.lock().unwrap_or_else(PoisonError::into_inner);
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
            && let Some(waiters) = &inner.waiters
        {
            let (reply, _) = oneshot::channel();
            let _ = waiters.send(Waiter { seq, reply });
        }

        *last_seq = seq;
        // Published under the lock so `applied` never goes backwards.
        inner.progress.applied.store(seq, Ordering::Release);
        Ok(seq)
    }

    /// `append`, then wait until a flush covers the records (I-29: the journal
    /// is written before anything acts on it). Concurrent commits share flushes.
    pub async fn commit(&self, records: Vec<Record>) -> Result<u64, Error> {
        let began = std::time::Instant::now();
        let seq = self.append(records)?;
        self.wait_durable(seq).await?;
        if let Some(observe) = self.inner.commit_observer.get() {
            observe(began.elapsed());
        }
        Ok(seq)
    }

    /// Calls `observe` with the latency of every successful commit from now
    /// on (append to durable), for the service's metrics. Set once; a second
    /// observer is refused (`false`).
    pub fn on_commit(&self, observe: impl Fn(std::time::Duration) + Send + Sync + 'static) -> bool {
        self.inner.commit_observer.set(Box::new(observe)).is_ok()
    }

    /// Highest seq applied (readable, not necessarily durable). It never goes
    /// back, not even across a reopen: the next boot continues from it.
    pub fn applied_seq(&self) -> u64 {
        self.inner.progress.applied.load(Ordering::Acquire)
    }

    /// Highest seq covered by a completed flush.
    pub fn durable_seq(&self) -> u64 {
        self.inner.progress.durable.load(Ordering::Acquire)
    }

    /// Waits for a flush covering everything appended so far.
    pub async fn flush(&self) -> Result<(), Error> {
        let seq = self.inner.progress.applied.load(Ordering::Acquire);
        self.wait_durable(seq).await
    }

    /// How many flushes the flusher has done: log writes, each with its
    /// `fdatasync`, that made something durable.
    pub fn flush_count(&self) -> u64 {
        self.inner.progress.flushes.load(Ordering::Acquire)
    }

    /// How many times the flusher has `fdatasync`ed the log: once per flush
    /// that succeeded (the syncs at open and at checkpoints not counted).
    pub fn sync_count(&self) -> u64 {
        self.inner.progress.syncs.load(Ordering::Acquire)
    }

    /// How many checkpoints have completed: sled flushed and its files
    /// synced, so the log segments before them could be removed.
    pub fn checkpoint_count(&self) -> u64 {
        self.inner.progress.checkpoints.load(Ordering::Acquire)
    }

    /// The faults a test can inject into this journal; all off unless a test
    /// switches them on.
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// The first write or flush that failed, if one has: from then on the
    /// journal refuses every append with `Error::Failed` carrying this.
    pub fn failed(&self) -> Option<String> {
        self.inner.progress.failure.get().cloned()
    }

    /// Every run, in key order.
    pub fn runs(&self) -> Result<Vec<RunRecord>, Error> {
        self.inner
            .read_prefix(&self.inner.trees.runs, RUNS, &[], codec::decode_bincode)
    }

    pub fn run(&self, id: RunId) -> Result<Option<RunRecord>, Error> {
        self.inner.read_one(
            &self.inner.trees.runs,
            RUNS,
            &codec::run_key(id),
            codec::decode_bincode,
        )
    }

    /// The runs whose ids were made before `ms` (milliseconds since the Unix
    /// epoch), oldest first: a run id is a uuid v7, whose first six bytes
    /// are the millisecond it was made, so this reads only that part of the
    /// tree, from sled, once the applier has taken every earlier append.
    pub fn runs_started_before(&self, ms: u64) -> Result<Vec<RunRecord>, Error> {
        self.inner.drain();
        let mut bound = ms.min(0xFFFF_FFFF_FFFF).to_be_bytes()[2..].to_vec();
        bound.resize(16, 0);
        let mut runs = Vec::new();
        for stored in self.inner.trees.runs.range(..bound) {
            let (key, value) = stored?;
            runs.push(
                codec::decode_bincode(&value).map_err(|e| codec::undecodable(RUNS, &key, e))?,
            );
        }
        Ok(runs)
    }

    /// Every step and job of every run, by run and then by id.
    pub fn all_jobs(&self) -> Result<Vec<JobRecord>, Error> {
        self.inner
            .read_prefix(&self.inner.trees.jobs, JOBS, &[], codec::decode_bincode)
    }

    /// The run's steps and jobs, in id (that is, creation) order.
    pub fn jobs(&self, run: RunId) -> Result<Vec<JobRecord>, Error> {
        let prefix = codec::run_key(run);
        self.inner
            .read_prefix(&self.inner.trees.jobs, JOBS, &prefix, codec::decode_bincode)
    }

    pub fn job(&self, run: RunId, id: JobId) -> Result<Option<JobRecord>, Error> {
        self.inner.read_one(
            &self.inner.trees.jobs,
            JOBS,
            &codec::job_key(run, id),
            codec::decode_bincode,
        )
    }

    /// One account's entries, in the order they were written.
    pub fn ledger(&self, owner: ParentRef) -> Result<Vec<LedgerRecord>, Error> {
        let prefix = codec::ledger_prefix(owner);
        self.inner.read_chunked(
            &self.inner.trees.ledger,
            LEDGER,
            &prefix,
            codec::decode_ledger,
        )
    }

    /// The parent's delegate calls, in key order.
    pub fn delegations(&self, parent: JobId) -> Result<Vec<DelegationRecord>, Error> {
        let prefix = parent.0.as_bytes();
        self.inner.read_prefix(
            &self.inner.trees.delegations,
            DELEGATIONS,
            prefix,
            codec::decode_bincode,
        )
    }

    /// The parent's delegate call under `key`, if there is one: a point read,
    /// so a parent's thousandth call does not read the 999 before it.
    pub fn delegation(&self, parent: JobId, key: &str) -> Result<Option<DelegationRecord>, Error> {
        self.inner.read_one(
            &self.inner.trees.delegations,
            DELEGATIONS,
            &codec::delegation_key(parent, key),
            codec::decode_bincode,
        )
    }

    /// The job's steering messages, by message id.
    pub fn steering(&self, job: JobId) -> Result<Vec<SteerRecord>, Error> {
        let prefix = job.0.as_bytes();
        self.inner.read_prefix(
            &self.inner.trees.steering,
            STEERING,
            prefix,
            codec::decode_bincode,
        )
    }

    /// The run's events, by event seq.
    pub fn events(&self, run: RunId) -> Result<Vec<Event>, Error> {
        let prefix = codec::run_key(run);
        self.inner
            .read_chunked(&self.inner.trees.events, EVENTS, &prefix, |_, value| {
                let events = codec::decode_events(value)?;
                Ok(events.into_iter().map(|e| (e.seq, e)).collect())
            })
    }

    /// The run's newest event, reading one chunk of sled's and what the
    /// applier has not taken, not the whole history.
    pub fn last_event(&self, run: RunId) -> Result<Option<Event>, Error> {
        let prefix = codec::run_key(run);
        let inner = &*self.inner;
        let overlay = inner.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = inner
            .trees
            .events
            .scan_prefix(&prefix)
            .next_back()
            .transpose()?;
        let pending = overlay.merge_prefix(EVENTS, &prefix, vec![]);
        drop(overlay);
        let mut last: Option<Event> = None;
        let chunks = stored
            .iter()
            .map(|(key, value)| (key.as_ref(), value.as_ref()))
            .chain(pending.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        for (key, value) in chunks {
            let events = codec::decode_events(value)
                .map_err(|error| codec::undecodable(EVENTS, key, error))?;
            for event in events {
                if last.as_ref().is_none_or(|l| l.seq < event.seq) {
                    last = Some(event);
                }
            }
        }
        Ok(last)
    }

    /// The job's sandbox process groups, by pgid, whatever their state.
    pub fn sandboxes(&self, job: JobId) -> Result<Vec<SandboxRecord>, Error> {
        self.inner.read_prefix(
            &self.inner.trees.sandboxes,
            SANDBOXES,
            job.0.as_bytes(),
            codec::decode_bincode,
        )
    }

    /// Every sandbox process group still `Live`, of every job: what recovery
    /// must kill (I-30), if `same_process` says it is still the one recorded.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, Error> {
        let all = self.inner.read_prefix(
            &self.inner.trees.sandboxes,
            SANDBOXES,
            &[],
            codec::decode_bincode::<SandboxRecord>,
        )?;
        Ok(all
            .into_iter()
            .filter(|sandbox| sandbox.state == SandboxState::Live)
            .collect())
    }

    /// Every run submitted to the service, in arrival order.
    pub fn submissions(&self) -> Result<Vec<SubmissionRecord>, Error> {
        let mut all = self.inner.read_prefix(
            &self.inner.trees.submissions,
            SUBMISSIONS,
            &[],
            codec::decode_bincode::<SubmissionRecord>,
        )?;
        all.sort_by_key(|s| s.order);
        Ok(all)
    }

    /// The submission of `run`, if the service queued it.
    pub fn submission(&self, run: RunId) -> Result<Option<SubmissionRecord>, Error> {
        self.inner.read_one(
            &self.inner.trees.submissions,
            SUBMISSIONS,
            &codec::run_key(run),
            codec::decode_bincode,
        )
    }

    /// Removes every record of each run in `runs`: the run, its submission,
    /// its steps and jobs, their ledgers, delegations, steering and sandbox
    /// records, and its events. One append, so after a crash a run is either
    /// all there or all gone (its removals are in the log like any record,
    /// and replayed in order after the writes they remove). Returns the
    /// append's seq.
    ///
    /// For runs that are over (the service's retention, `keep_finished`):
    /// it first waits until the applier has put every earlier append into
    /// sled, since a removal takes the keys sled holds when it is applied.
    /// A record appended for a run after its removal would stay. Returns
    /// once sled has applied the removals, so no read finds the runs.
    pub fn forget(&self, runs: &[RunId]) -> Result<u64, Error> {
        self.inner.drain();
        let removal =
            |tree: &'static str, prefix: &[u8]| (tree, Key::Whole(prefix.to_vec()), wal::removal());
        let mut entries = Vec::new();
        for &run in runs {
            let key = codec::run_key(run);
            for tree in [RUNS, SUBMISSIONS, JOBS, EVENTS] {
                entries.push(removal(tree, &key));
            }
            entries.push(removal(LEDGER, &codec::ledger_prefix(ParentRef::Run(run))));
            for job in self.jobs(run)? {
                let id = job.id.0.as_bytes();
                entries.push(removal(
                    LEDGER,
                    &codec::ledger_prefix(ParentRef::Job(job.id)),
                ));
                for tree in [DELEGATIONS, STEERING, SANDBOXES] {
                    entries.push(removal(tree, id));
                }
            }
        }
        let seq = self.append_prepared(Prepared {
            entries,
            epochs: None,
            unencoded: None,
        })?;
        // Reads answer from sled until the applier takes the removals: once
        // this returns, none finds the runs any more.
        self.inner.drain();
        Ok(seq)
    }

    /// Decodes every record of every tree (and checks each `meta` entry),
    /// listing what does not decode instead of skipping it. Fails only if sled
    /// cannot be read at all.
    pub fn scan(&self) -> Result<ScanReport, Error> {
        Ok(self.walk()?.0)
    }

    /// `scan`, and then the accounts: each one's ledger must balance (see
    /// `verify.rs` for the rules). Ledger entries that do not decode are in
    /// `undecodable` and left out of their account's totals. Fails only if
    /// sled cannot be read at all.
    pub fn verify(&self) -> Result<VerifyReport, Error> {
        let (scan, ledger) = self.walk()?;
        // Valid ledger keys start with their owner, so an account's entries
        // are contiguous and in journal order.
        let mut accounts: Vec<(ParentRef, Vec<LedgerRecord>)> = Vec::new();
        for record in ledger {
            match accounts.last_mut() {
                Some((owner, entries)) if *owner == record.owner => entries.push(record),
                _ => accounts.push((record.owner, vec![record])),
            }
        }
        Ok(VerifyReport {
            records: scan.records,
            undecodable: scan.undecodable,
            accounts: accounts.len() as u64,
            breaches: verify::account_breaches(&accounts),
        })
    }

    /// One pass over every tree: each entry decoded and its key checked,
    /// the ledger's entries kept for `verify`. The events tree (about half
    /// of a journal, and JSON) is walked on a thread of its own beside the
    /// rest, so a boot's pass takes the longer of the two, not their sum.
    fn walk(&self) -> Result<(ScanReport, Vec<LedgerRecord>), Error> {
        self.inner.drain();
        let trees = &self.inner.trees;
        let (events, rest) = thread::scope(|scope| {
            let events = scope.spawn(|| walk_trees(trees, &[EVENTS]));
            let others: Vec<&str> = RECORD_TREES
                .into_iter()
                .filter(|name| *name != EVENTS)
                .collect();
            let rest = walk_trees(trees, &others);
            (events.join(), rest)
        });
        let events = events.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let rest = rest?;
        let mut undecodable = rest.undecodable;
        undecodable.extend(events.undecodable);
        // In tree order, as one walk would have listed them (the sort is stable).
        undecodable.sort_by_key(|u| RECORD_TREES.iter().position(|name| *name == u.tree));
        let mut report = ScanReport {
            records: rest.records + events.records,
            undecodable,
        };
        for entry in trees.meta.iter() {
            let (key, value) = entry?;
            if let Err(error) = codec::check_meta(&key, &value) {
                report.undecodable.push(Undecodable {
                    tree: META.to_string(),
                    key_hex: codec::hex(&key),
                    error,
                });
            }
        }
        Ok((report, rest.ledger))
    }

    /// Everything `open` does except starting the flusher, so a test can queue
    /// commits first and watch one flush serve them all.
    fn open_without_flusher(dir: &Path) -> Result<(Journal, Unstarted), Error> {
        Self::open_inner(dir, false)
    }

    /// Opens the journal to read it: no new epoch, no flusher, and every
    /// write refused (`Error::ReadOnly`). For `arbor journal verify` and
    /// `inspect`, which must change nothing the journal says. What the log
    /// holds past sled is applied to sled all the same (as any open does), so
    /// that they read what the node acknowledged; the log is left in place.
    pub fn open_read_only(dir: &Path) -> Result<Journal, Error> {
        if !dir.join("db").is_file() {
            return Err(Error::Sled(sled::Error::Io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no journal in {}", dir.display()),
            ))));
        }
        Ok(Self::open_inner(dir, true)?.0)
    }

    fn open_inner(dir: &Path, read_only: bool) -> Result<(Journal, Unstarted), Error> {
        let (dir_lock, db) = open_locked(dir)?;
        // sled has opened the dir: its files exist and any snapshot is written.
        let mut disk = DiskSync::open(dir)?;
        let trees = Trees::open(&db)?;
        let meta = &trees.meta;

        let supported = u32::from(codec::FORMAT_VERSION);
        match meta.get(META_FORMAT)? {
            Some(found) => {
                let found = codec::meta_u32(META_FORMAT, &found)?;
                if found != supported {
                    return Err(Error::FormatVersion { found, supported });
                }
            }
            None if !read_only => {
                meta.insert(META_FORMAT, &supported.to_be_bytes())?;
            }
            None => {}
        }
        let stored_epoch = match meta.get(META_EPOCH)? {
            Some(previous) => codec::meta_u64(META_EPOCH, &previous)?,
            None => 0,
        };
        let epoch = if read_only {
            stored_epoch
        } else {
            stored_epoch + 1
        };
        if !read_only {
            meta.insert(META_EPOCH, &epoch.to_be_bytes())?;
        }
        let stored_seq = match meta.get(META_SEQ)? {
            Some(seq) => codec::meta_u64(META_SEQ, &seq)?,
            None => 0,
        };
        // What sled lost in a crash and the log kept (`wal.rs`, invariant 4).
        let mut seq = stored_seq;
        let replay = wal::read(dir)?;
        // Applied in batches of whole frames, each one transaction with its
        // last seq, as the applier does.
        let mut batch: Vec<wal::Entry> = Vec::new();
        for frame in replay.frames {
            if frame.last_seq() <= seq {
                continue;
            }
            if frame.first_seq != seq + 1 {
                return Err(Error::Wal(format!(
                    "sled holds the journal up to seq {seq}, but the log goes on from seq {}",
                    frame.first_seq
                )));
            }
            seq = frame.last_seq();
            batch.extend(frame.entries);
            if batch.len() >= APPLY_STEP {
                trees.apply(&batch.iter().collect::<Vec<_>>(), seq)?;
                batch.clear();
            }
        }
        if !batch.is_empty() {
            trees.apply(&batch.iter().collect::<Vec<_>>(), seq)?;
        }
        if seq > stored_seq {
            tracing::info!(
                dir = %dir.display(),
                from = stored_seq + 1,
                to = seq,
                "journal: applied records from the write-ahead log that sled had not kept"
            );
        }
        // Durable before any record is stamped with it: two boots must never
        // share an epoch, or recovery could not tell their records apart. The
        // same flush makes what was replayed durable in sled, so the log can
        // start afresh.
        let wal = if read_only {
            None
        } else {
            db.flush()?;
            disk.after_flush()?;
            Some(Wal::restart(dir, seq + 1)?)
        };
        tracing::debug!(dir = %dir.display(), epoch, seq, "journal opened");

        // Whatever was on disk at open is durable by definition.
        let progress = Arc::new(Progress {
            applied: AtomicU64::new(seq),
            durable: AtomicU64::new(seq),
            flushes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            failure: OnceLock::new(),
        });
        let (waiters, queue) = mpsc::channel();
        let (work, work_queue) = mpsc::channel();
        let inner = Inner {
            db,
            _dir_lock: dir_lock,
            trees,
            epoch,
            last_seq: Mutex::new(seq),
            progress,
            faults: Arc::new(Faults::default()),
            read_only,
            pending: Arc::new(Mutex::new(Pending::default())),
            overlay: Arc::new(Mutex::new(Overlay::new())),
            work: (!read_only).then_some(work),
            waiters: Some(waiters),
            flusher: Mutex::new(None),
            applier: Mutex::new(None),
            commit_observer: OnceLock::new(),
            leave_unapplied: Arc::new(AtomicBool::new(false)),
        };
        Ok((
            Journal {
                inner: Arc::new(inner),
            },
            Unstarted {
                queue,
                work: work_queue,
                disk,
                wal,
            },
        ))
    }

    fn start_flusher(&self, unstarted: Unstarted) -> Result<(), Error> {
        let Unstarted {
            queue,
            work,
            disk,
            wal,
        } = unstarted;
        let (Some(wal), Some(checkpoints)) = (wal, self.inner.work.clone()) else {
            return Ok(()); // read-only: nothing is ever written
        };
        let applier = Applier {
            db: self.inner.db.clone(),
            trees: Trees::open(&self.inner.db)?,
            disk,
            overlay: Arc::clone(&self.inner.overlay),
            progress: Arc::clone(&self.inner.progress),
            leave_unapplied: Arc::clone(&self.inner.leave_unapplied),
            faults: Arc::clone(&self.inner.faults),
        };
        start_thread(&self.inner.applier, "arbor-journal-applier", move || {
            applier.run(work)
        })?;

        let flusher = Flusher {
            wal,
            frames: Vec::new(),
            progress: Arc::clone(&self.inner.progress),
            faults: Arc::clone(&self.inner.faults),
            pending: Arc::clone(&self.inner.pending),
            checkpoints,
        };
        start_thread(&self.inner.flusher, "arbor-journal-flusher", move || {
            flusher.run(queue)
        })
    }

    /// At its close (the last handle dropped), leave to the log what sled
    /// has not taken, instead of applying it then: the close writes and
    /// syncs every frame first, so nothing is lost, and the next open
    /// applies it (`wal.rs`, invariant 4), in one batch, which costs sled
    /// less than the several it would have taken here. For a node's
    /// shutdown, so that its process ends without waiting for sled; a
    /// journal whose files are read straight through sled after it closes
    /// (tests, tools) keeps the default, and sled then holds everything.
    pub fn leave_unapplied_at_close(&self) {
        self.inner.leave_unapplied.store(true, Ordering::Release);
    }

    /// Writes sled's own buffers to its files: not a checkpoint (the log
    /// keeps what sled has not taken), but what a process that ends without
    /// dropping the journal owes sled, whose next open otherwise finds its
    /// files cut short, says so, and drops what its own log lacks (which
    /// the journal's log replays: nothing is lost either way).
    pub fn flush_store(&self) -> Result<(), Error> {
        self.inner.db.flush()?;
        Ok(())
    }

    /// Waits until a flush covers `seq` (a seq `append` returned): what
    /// `commit` does after its append, for a caller that must answer later
    /// without holding up its own work meanwhile.
    pub async fn wait_durable(&self, seq: u64) -> Result<(), Error> {
        if self.durable_seq() >= seq {
            return Ok(());
        }
        let (reply, done) = oneshot::channel();
        let waiters = self.inner.waiters.as_ref().ok_or(Error::Closed)?;
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

// By hand: sled's handles print their whole cache state.
impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("epoch", &self.inner.epoch)
            .field(
                "applied_seq",
                &self.inner.progress.applied.load(Ordering::Acquire),
            )
            .field("durable_seq", &self.durable_seq())
            .field("flush_count", &self.flush_count())
            .field("sync_count", &self.sync_count())
            .field("failed", &self.failed())
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the flusher's loop. No waiter can be queued:
        // each one is sent by a handle that keeps this `Inner` alive. A
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
            let t = std::time::Instant::now();
            if let Some(handle) = handle
                && handle.join().is_err()
            {
                tracing::error!("the journal {name} panicked");
            }
            if std::env::var_os("ARBOR_PHASES").is_some() {
                eprintln!("drop: {name} joined in {:?}", t.elapsed());
            }
        }
        let t = std::time::Instant::now();
        let trees = std::mem::replace(&mut self.trees, Trees::open(&self.db).unwrap());
        drop(trees);
        if std::env::var_os("ARBOR_PHASES").is_some() {
            eprintln!("drop: trees dropped in {:?}", t.elapsed());
        }
    }
}

impl Trees {
    fn open(db: &sled::Db) -> Result<Trees, Error> {
        Ok(Trees {
            runs: db.open_tree(RUNS)?,
            jobs: db.open_tree(JOBS)?,
            ledger: db.open_tree(LEDGER)?,
            delegations: db.open_tree(DELEGATIONS)?,
            steering: db.open_tree(STEERING)?,
            events: db.open_tree(EVENTS)?,
            sandboxes: db.open_tree(SANDBOXES)?,
            submissions: db.open_tree(SUBMISSIONS)?,
            meta: db.open_tree(META)?,
        })
    }

    /// Writes `entries` and `meta/seq = last_seq` in one sled transaction, so
    /// after a crash sled holds all of them or none, and its stored seq says
    /// which (`wal.rs`, invariant 4). Each run's events go in chunks
    /// (`codec::encode_event_chunk`).
    fn apply(&self, entries: &[&wal::Entry], last_seq: u64) -> Result<(), Error> {
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
        // Events by run, ledger entries by account, each in seq order
        // (appends come in seq order, and a run's event seqs rise with
        // them), go in chunks: the owner is the key's first 16 or 17 bytes.
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
            let owner_bytes = match *tree {
                EVENTS => codec::EVENT_OWNER_BYTES,
                LEDGER => codec::LEDGER_OWNER_BYTES,
                _ => {
                    batch_of(&mut batches, tree).insert(&key[..], &value[..]);
                    continue;
                }
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
            for chunk in of_owner.chunks(codec::CHUNK_MAX) {
                let value = match *tree {
                    EVENTS => codec::encode_event_chunk(chunk.iter().map(|(_, _, v)| &v[..])),
                    _ => codec::encode_ledger_chunk(
                        chunk.iter().map(|(_, k, v)| (k.as_slice(), &v[..])),
                    ),
                };
                batch_of(&mut batches, tree).insert(&chunk[0].1[..], value);
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

    fn get(&self, name: &str) -> &sled::Tree {
        match name {
            RUNS => &self.runs,
            JOBS => &self.jobs,
            LEDGER => &self.ledger,
            DELEGATIONS => &self.delegations,
            STEERING => &self.steering,
            EVENTS => &self.events,
            SANDBOXES => &self.sandboxes,
            SUBMISSIONS => &self.submissions,
            META => &self.meta,
            other => unreachable!("no journal tree {other:?}"),
        }
    }
}

/// Records encoded for an append (`Journal::prepare`), and why the append
/// must be refused, if something found that.
pub struct Prepared {
    entries: Vec<(&'static str, Key, Arc<[u8]>)>,
    epochs: Option<Error>,
    unencoded: Option<Error>,
}

impl Prepared {
    /// `more` after these, in one append.
    pub fn extend(&mut self, more: Prepared) {
        self.entries.extend(more.entries);
        if self.epochs.is_none() {
            self.epochs = more.epochs;
        }
        if self.unencoded.is_none() {
            self.unencoded = more.unencoded;
        }
    }
}

/// A record's key, or what it is made of once the record's seq is known.
enum Key {
    Whole(Vec<u8>),
    /// A ledger entry's: its owner and the seq it takes.
    Ledger(ParentRef),
}

impl Key {
    fn at(self, seq: u64) -> Vec<u8> {
        match self {
            Key::Whole(key) => key,
            Key::Ledger(owner) => codec::ledger_key(owner, seq),
        }
    }
}

/// Which tree a record goes to, under what key, as what bytes.
fn encode(record: Record) -> Result<(&'static str, Key, Arc<[u8]>), Error> {
    use Key::Whole;
    Ok(match record {
        Record::Run(run) => (
            RUNS,
            Whole(codec::run_key(run.id)),
            codec::encode_bincode(&run)?,
        ),
        Record::Job(job) => (
            JOBS,
            Whole(codec::job_key(job.run, job.id)),
            codec::encode_bincode(&job)?,
        ),
        Record::Ledger(entry) => (
            LEDGER,
            Key::Ledger(entry.owner),
            codec::encode_bincode(&entry)?,
        ),
        Record::Delegation(delegation) => (
            DELEGATIONS,
            Whole(codec::delegation_key(delegation.parent, &delegation.key)),
            codec::encode_bincode(&delegation)?,
        ),
        Record::Steer(steer) => (
            STEERING,
            Whole(codec::steer_key(steer.job, steer.message_id)),
            codec::encode_bincode(&steer)?,
        ),
        Record::Event(event) => (
            EVENTS,
            Whole(codec::event_key(event.run, event.seq)),
            codec::encode_event(&event)?,
        ),
        Record::EncodedEvent(event) => (
            EVENTS,
            Whole(codec::event_key(event.run, event.seq)),
            event.value,
        ),
        Record::Sandbox(sandbox) => (
            SANDBOXES,
            Whole(codec::sandbox_key(sandbox.job, sandbox.pgid)),
            codec::encode_bincode(&sandbox)?,
        ),
        Record::Submission(submission) => (
            SUBMISSIONS,
            Whole(codec::run_key(submission.run)),
            codec::encode_bincode(&submission)?,
        ),
    })
}

/// I-41: every record must carry this boot's epoch. The first one that does
/// not fails the whole append.
fn check_epochs(records: &[Record], current: u64) -> Result<(), Error> {
    for record_epoch in records.iter().filter_map(Record::epoch) {
        if record_epoch < current {
            return Err(Error::StaleEpoch {
                record_epoch,
                current,
            });
        }
        if record_epoch > current {
            return Err(Error::FutureEpoch {
                record_epoch,
                current,
            });
        }
    }
    Ok(())
}

/// What walking some trees found.
#[derive(Default)]
struct Walked {
    records: u64,
    undecodable: Vec<Undecodable>,
    /// The ledger's entries that decoded, in key order.
    ledger: Vec<LedgerRecord>,
}

fn walk_trees(trees: &Trees, names: &[&str]) -> Result<Walked, Error> {
    let mut walked = Walked::default();
    for name in names {
        for entry in trees.get(name).iter() {
            let (key, value) = entry?;
            let checked = if *name == LEDGER {
                codec::check_ledger_entry(&key, &value).map(|records| {
                    let count = records.len() as u64;
                    walked.ledger.extend(records);
                    count
                })
            } else {
                codec::check_entry(name, &key, &value)
            };
            match checked {
                Ok(records) => walked.records += records,
                Err(error) => walked.undecodable.push(Undecodable {
                    tree: name.to_string(),
                    key_hex: codec::hex(&key),
                    error,
                }),
            }
        }
    }
    Ok(walked)
}

/// Decodes one stored value of a chunked tree, given its key: its records,
/// each with the seq that orders it.
type DecodeChunk<T> = fn(&[u8], &[u8]) -> Result<Vec<(u64, T)>, String>;

impl Inner {
    /// Every record under `prefix`, the overlay's laid over sled's, holding
    /// the overlay's lock throughout (`overlay.rs`, invariant 1).
    fn read_prefix<T>(
        &self,
        tree: &sled::Tree,
        name: &str,
        prefix: &[u8],
        decode: fn(&[u8]) -> Result<T, String>,
    ) -> Result<Vec<T>, Error> {
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = tree.scan_prefix(prefix).collect::<Result<Vec<_>, _>>()?;
        let entries = if overlay.is_empty() {
            return stored
                .into_iter()
                .map(|(key, value)| {
                    decode(&value).map_err(|error| codec::undecodable(name, &key, error))
                })
                .collect();
        } else {
            overlay.merge_prefix(name, prefix, stored)
        };
        drop(overlay);
        entries
            .into_iter()
            .map(|(key, value)| {
                decode(&value).map_err(|error| codec::undecodable(name, &key, error))
            })
            .collect()
    }

    /// Every record under `prefix` of a tree sled holds in chunks (events,
    /// the ledger), in the order of the seq `decode` gives each: sled's
    /// chunks, then the overlay's records one by one, under the overlay's
    /// lock (`overlay.rs`, invariant 1). Keyed by that seq, because while a
    /// chunk is being applied its records are in both.
    fn read_chunked<T>(
        &self,
        tree: &sled::Tree,
        name: &str,
        prefix: &[u8],
        decode: DecodeChunk<T>,
    ) -> Result<Vec<T>, Error> {
        // The bytes are copied under the lock and decoded after it, so a
        // long read (a run's whole history) holds up no append.
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = tree.scan_prefix(prefix).collect::<Result<Vec<_>, _>>()?;
        let pending = overlay.merge_prefix(name, prefix, vec![]);
        drop(overlay);
        let values = stored
            .iter()
            .map(|(key, value)| (key.as_ref(), value.as_ref()))
            .chain(
                pending
                    .iter()
                    .map(|(key, value)| (key.as_slice(), value.as_slice())),
            );
        let mut by_seq = BTreeMap::new();
        for (key, value) in values {
            let records =
                decode(key, value).map_err(|error| codec::undecodable(name, key, error))?;
            by_seq.extend(records);
        }
        Ok(by_seq.into_values().collect())
    }

    fn read_one<T>(
        &self,
        tree: &sled::Tree,
        name: &str,
        key: &[u8],
        decode: fn(&[u8]) -> Result<T, String>,
    ) -> Result<Option<T>, Error> {
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let value = match overlay.get(name, key) {
            Some(value) => Some(value.to_vec()),
            None => tree.get(key)?.map(|v| v.to_vec()),
        };
        drop(overlay);
        value
            .map(|value| decode(&value).map_err(|error| codec::undecodable(name, key, error)))
            .transpose()
    }

    /// Waits until the applier has put every append so far into sled, for
    /// the passes that walk sled's trees whole (`scan`, `verify`). A journal
    /// without an applier (read-only, or one whose applier is gone) has
    /// nothing more to wait for.
    fn drain(&self) {
        let Some(work) = &self.work else { return };
        let (done, wait) = mpsc::channel();
        if work.send(Work::Drain(done)).is_ok() {
            let _ = wait.recv();
        }
    }
}

/// The flusher thread's state: the log, and what it shares with the handles.
struct Flusher {
    wal: Wal,
    /// The frames of the flush under way, kept to be written into again.
    frames: Vec<u8>,
    progress: Arc<Progress>,
    faults: Arc<Faults>,
    pending: Arc<Mutex<Pending>>,
    /// The applier's queue, for checkpoints.
    checkpoints: mpsc::Sender<Work>,
}

impl Flusher {
    /// One flush per batch of queued waiters, until every handle is gone.
    fn run(mut self, queue: mpsc::Receiver<Waiter>) {
        while let Ok(first) = queue.recv() {
            let mut waiters = vec![first];
            waiters.extend(queue.try_iter());

            // A waiter already covered (the flush that served its neighbours
            // carried its frame) needs no new flush.
            let durable = self.progress.durable.load(Ordering::Acquire);
            let (covered, mut pending): (Vec<_>, Vec<_>) =
                waiters.into_iter().partition(|w| w.seq <= durable);
            for waiter in covered {
                let _ = waiter.reply.send(Ok(()));
            }
            if pending.is_empty() {
                continue;
            }

            if !self.faults.wait_while_held() {
                // The journal is being dropped: nobody awaits these any more.
                continue;
            }
            // Commits queued while the flush was held ride on this one.
            pending.extend(queue.try_iter());

            match self.flush() {
                Ok(target) => {
                    // Each waiter was sent after its own append queued its
                    // frame, so the frames just synced cover every one.
                    debug_assert!(pending.iter().all(|w| w.seq <= target));
                    for waiter in pending {
                        // A commit whose caller went away needs no answer.
                        let _ = waiter.reply.send(Ok(()));
                    }
                }
                Err(e) => {
                    for waiter in pending {
                        let _ = waiter.reply.send(Err(e.clone()));
                    }
                }
            }
        }
        // The journal is closing. Frames appended since the last flush (no
        // commit waited for them) go to the log now, so that the log holds
        // every append, whether or not the applier takes the rest into sled
        // (`leave_unapplied_at_close`). A test holding flushes stands for a
        // crash: then, as in a crash, they are not written.
        if !self.faults.flushes_held() {
            let _ = self.flush();
        }
    }

    /// Writes and syncs every frame queued so far and publishes the last seq
    /// they carry as durable. Any failure marks the journal failed; once
    /// failed, nothing more is written or acknowledged.
    fn flush(&mut self) -> Result<u64, Error> {
        let progress = Arc::clone(&self.progress);
        let progress = &*progress;
        if let Some(first) = progress.failure.get() {
            return Err(Error::Failed(first.clone()));
        }
        if self.faults.flushes_fail() {
            return Err(progress.fail("a flush", Error::Injected("flush")));
        }
        let (appends, target) = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            pending.bytes = 0;
            (std::mem::take(&mut pending.appends), pending.last_seq)
        };
        if !appends.is_empty() {
            self.frames.clear();
            for (first_seq, entries) in &appends {
                wal::encode_frame(&mut self.frames, *first_seq, entries);
            }
            drop(appends);
            let number = progress.flushes.load(Ordering::Acquire) + 1;
            self.crash_if_due(number, CrashPoint::BeforeFlush);
            let sync = !self.faults.syncs_skipped();
            let written = self.wal.write_and_sync(&self.frames, sync);
            progress.flushes.fetch_add(1, Ordering::AcqRel);
            if sync {
                progress.syncs.fetch_add(1, Ordering::AcqRel);
            }
            written.map_err(|e| progress.fail("a flush", e))?;
            self.crash_if_due(number, CrashPoint::AfterFlush);
        }
        let before = progress.durable.fetch_max(target, Ordering::AcqRel);
        if target > before {
            self.faults.durable(target);
        }
        if self.wal.wants_checkpoint() {
            let old = self
                .wal
                .rotate(target + 1)
                .map_err(|e| progress.fail("starting a new log segment", e))?;
            // The checkpointer is gone only if it panicked; the log then
            // just keeps its old segments until the next open.
            let _ = self.checkpoints.send(Work::Checkpoint(old));
        }
        Ok(target)
    }
}

impl Flusher {
    /// Fault injection (`Faults::crash_at`): if a crash is armed for this
    /// point of this flush, the process dies here, as a power cut first
    /// losing every log write past the last sync.
    fn crash_if_due(&mut self, flush: u64, point: CrashPoint) {
        let Some(kind) = self.faults.crash_due(flush, point) else {
            return;
        };
        if kind == CrashKind::PowerLoss {
            let _ = self.wal.truncate_to_synced();
        }
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        // SIGKILL cannot be caught; nothing runs past it.
        loop {
            std::thread::park();
        }
    }
}

/// Starts one of the journal's threads and keeps its handle in `slot`, for
/// the drop to join.
fn start_thread(
    slot: &Mutex<Option<thread::JoinHandle<()>>>,
    name: &str,
    body: impl FnOnce() + Send + 'static,
) -> Result<(), Error> {
    let handle = thread::Builder::new()
        .name(name.into())
        .spawn(body)
        // Failing to spawn a thread is an OS resource fault; sled's Io
        // variant is the closest home for it.
        .map_err(|e| Error::Sled(sled::Error::Io(e)))?;
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
    Ok(())
}

/// How many applied entries leave the overlay in one hold of its lock.
const APPLIED_AT_ONCE: usize = 256;

/// At most this many entries go into one sled transaction, so a backlog is
/// applied in steps rather than held in memory as one huge transaction, and
/// a close that leaves the rest to the log waits for one step at most.
const APPLY_STEP: usize = 4096;

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
struct Applier {
    db: sled::Db,
    trees: Trees,
    disk: DiskSync,
    overlay: Arc<Mutex<Overlay>>,
    progress: Arc<Progress>,
    /// Leave what is queued at the close to the log (`leave_unapplied_at_close`).
    leave_unapplied: Arc<AtomicBool>,
    /// A power cut armed (`Faults::crash_at`): sled stays at its last sync.
    faults: Arc<Faults>,
}

impl Applier {
    /// Until the queue closes: woken by an append, wait `APPLY_EVERY` for
    /// more (or less, if a request or a second wake comes), then take and
    /// apply everything queued, then do what was asked (a checkpoint, or an
    /// answer to a drain). What is queued when the journal closes is applied
    /// as the loop ends, unless it is left to the log
    /// (`leave_unapplied_at_close`).
    fn run(mut self, queue: mpsc::Receiver<Work>) {
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

impl Progress {
    /// Remembers `error` as the journal's failure if it is the first, and
    /// hands it back for the caller to return.
    fn fail(&self, what: &str, error: Error) -> Error {
        tracing::error!(error = %error, "journal: {what} failed; the journal takes no more writes");
        let _ = self.failure.set(format!("{what} failed: {error}"));
        error
    }
}

/// sled's page cache. Its default, 1 GiB, is a node's memory growing with
/// its journal for as long as it runs: arbord under a steady load of small
/// runs went from 570 to 950 MiB of RSS in two minutes. Reads of recent
/// state hit the overlay, and the rest is in the kernel's page cache; at
/// 64 MiB the same load held at 117-128 MiB, and served more runs a second
/// (324 against 271). `soak` checks it (docs/reliability.md).
const SLED_CACHE_BYTES: u64 = 64 << 20;

/// How often, and how long apart, an open tries a lock another handle holds.
/// sled's own background threads hold the database for a moment after the
/// last handle is dropped, so a reopen in the same process (a restart in a
/// test, a node restarted in place) can find a lock still held.
const LOCK_ATTEMPTS: u32 = 100;
const LOCK_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// Opens the sled database. See `open_locked`; the directory lock is
/// released on return (sled's own lock on its `db` file remains).
pub fn open_db(dir: &Path) -> Result<sled::Db, Error> {
    open_locked(dir).map(|(_lock, db)| db)
}

/// Takes arbor's lock on the directory, clears what a crash left half
/// written, and opens sled, waiting a little for either lock.
///
/// sled 0.34 writes a snapshot at every open as `snap.<lsn>.generating`,
/// then renames it; a process killed in between leaves the `.generating`
/// file, and the next open reads it as the newest snapshot and fails with
/// "Read corrupted data" (sled issue 1527). A finished snapshot is always
/// renamed, so a `.generating` file is never one: with the directory locked
/// (no other arbor process is writing it), it is removed before sled looks.
pub(crate) fn open_locked(dir: &Path) -> Result<(std::fs::File, sled::Db), Error> {
    let io = |e: std::io::Error| Error::Sled(sled::Error::Io(e));
    std::fs::create_dir_all(dir).map_err(io)?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(DIR_LOCK))
        .map_err(io)?;
    let mut attempt = 0;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if attempt + 1 < LOCK_ATTEMPTS => {
                attempt += 1;
                std::thread::sleep(LOCK_PAUSE);
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!("{} is in use by another process", dir.display()),
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
    }
    for entry in std::fs::read_dir(dir).map_err(io)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(file = %name, "removing a snapshot a crash left half written");
            std::fs::remove_file(entry.path()).map_err(io)?;
        }
    }
    let mut attempt = 0;
    loop {
        // No background flush: the log makes commits durable, and sled is
        // flushed at checkpoints (`wal.rs`), so its own timer would only add
        // syncs that compete with the log's.
        match sled::Config::new()
            .path(dir)
            .flush_every_ms(None)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()
        {
            Err(sled::Error::Io(e))
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.to_string().contains("could not acquire lock") =>
            {
                attempt += 1;
                if attempt >= LOCK_ATTEMPTS {
                    return Err(sled::Error::Io(e).into());
                }
                std::thread::sleep(LOCK_PAUSE);
            }
            other => return Ok((lock, other?)),
        }
    }
}

/// The file arbor locks for as long as a journal is open on the directory.
const DIR_LOCK: &str = "arbor.lock";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{LedgerOp, SteerState};
    use std::future::Future;
    use std::task::{Context, Waker};

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
        let (journal, unstarted) = Journal::open_without_flusher(dir.path()).unwrap();
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

        journal.start_flusher(unstarted).unwrap();
        for (n, commit) in commits.into_iter().enumerate() {
            assert_eq!(commit.await.unwrap(), n as u64 + 1);
        }
        assert_eq!(journal.flush_count(), 1);
        assert_eq!(journal.durable_seq(), 50);
    }

    #[tokio::test]
    async fn a_checkpoint_flushes_sled_and_removes_the_segments_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, mut unstarted) = Journal::open_without_flusher(dir.path()).unwrap();
        // Every flush asks for a checkpoint.
        unstarted.wal.as_mut().unwrap().checkpoint_bytes = 1;
        journal.start_flusher(unstarted).unwrap();
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
        drop(journal);
        let reopened = Journal::open(db_only.path()).unwrap();
        assert_eq!(reopened.steering(job).unwrap().len(), 5);
    }

    #[tokio::test]
    async fn an_append_reads_back_at_once_and_reaches_sled_behind_it() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, unstarted) = Journal::open_without_flusher(dir.path()).unwrap();
        let job = JobId::new();
        journal.append(vec![steer(job, 1), steer(job, 2)]).unwrap();
        // No applier yet: sled has nothing, the reads have both.
        assert_eq!(journal.inner.trees.steering.len(), 0);
        assert_eq!(journal.steering(job).unwrap().len(), 2);
        journal.start_flusher(unstarted).unwrap();
        journal.inner.drain();
        assert_eq!(journal.inner.trees.steering.len(), 2);
        assert!(journal.inner.overlay.lock().unwrap().is_empty());
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

    /// sled takes a run's events in chunks (`codec::encode_event_chunk`),
    /// and every read, scan and reopen sees each event once, in seq order,
    /// before the applier has them, after, and across runs that interleave.
    #[tokio::test]
    async fn events_reach_sled_in_chunks_and_read_back_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, unstarted) = Journal::open_without_flusher(dir.path()).unwrap();
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
        journal.start_flusher(unstarted).unwrap();
        journal.inner.drain();
        assert!(journal.inner.overlay.lock().unwrap().is_empty());
        assert_eq!(seqs(a), expect_a, "from sled");
        assert_eq!(seqs(b), expect_b);
        let stored = journal.inner.trees.events.len();
        // One batch (the applier started after every append): 134 events of
        // `a` and 66 of `b`, in chunks of at most 64.
        assert_eq!(stored, 3 + 2, "{total} events in {stored} sled entries");
        // A scan counts events, not chunks.
        let report = journal.scan().unwrap();
        assert_eq!(report.records, total, "{:?}", report.undecodable);
        journal.flush().await.unwrap();
        drop(journal);
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
        let (journal, unstarted) = Journal::open_without_flusher(dir.path()).unwrap();
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
        journal.start_flusher(unstarted).unwrap();
        journal.inner.drain();
        assert_eq!(tokens(owners[0]), evens, "from sled");
        // 50 entries of each account: one chunk each.
        assert_eq!(journal.inner.trees.ledger.len(), 2);
        let (scan, ledger) = journal.walk().unwrap();
        assert_eq!(scan.records, 100, "{:?}", scan.undecodable);
        assert_eq!(ledger.len(), 100);
        // A later append of the same account lands in a chunk of its own,
        // after the first.
        journal.append(vec![entry(owners[0], 102)]).unwrap();
        journal.inner.drain();
        assert_eq!(journal.inner.trees.ledger.len(), 3);
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
