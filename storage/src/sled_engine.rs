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
mod fsync;
mod handle;
mod open;
mod reads;
mod wal;
mod work;

pub use handle::SledEngine;
pub use open::open_db;

#[cfg(test)]
mod tests {
    use super::handle::{SledEngine, Unstarted};
    use super::wal;
    use crate::Journal;
    use crate::Record;
    use crate::record::{LedgerOp, LedgerRecord, SteerRecord, SteerState};
    use arbor_protocol::{Event, JobId, ParentRef, RunId};
    use std::future::Future;
    use std::sync::Arc;
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
                unit: crate::Unit::Tokens,
                op: LedgerOp::CallReserve { amount: n },
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
                LedgerOp::CallReserve { amount: tokens } => tokens,
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
                unit: crate::Unit::Tokens,
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
