//! What the journal promises when things go wrong: writes from an earlier
//! boot are refused (I-41), commits are synced to disk, a journal that cannot
//! write stops and says why, nothing acknowledged is lost (I-35), leftover
//! sandboxes are named precisely enough to kill (I-30), and `verify` finds
//! accounts that do not balance.

mod common;
use arbor_protocol::{JobId, ParentRef, RunId};
use arbor_sandbox::{process_start, same_process};
use arbor_storage::{
    Error, Journal, LedgerOp, LedgerRecord, Record, SandboxRecord, SandboxState, SteerRecord,
    SteerState,
};
use common::{Store, message_ids, steer};
use std::future::Future;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// Long enough never to be hit by a test that is right.
const LIMIT: Duration = Duration::from_secs(30);

fn ledger(owner: ParentRef, op: LedgerOp, epoch: u64) -> Record {
    Record::Ledger(LedgerRecord {
        owner,
        unit: arbor_storage::Unit::Tokens,
        op,
        epoch,
    })
}

/// Polls a future once, without a runtime: a commit appends and queues its
/// waiter on the first poll.
fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Writes `entry` into the ledger straight through sled, behind the journal's
/// back, under the next seq: what a hand edit of the files would do.
fn write_ledger_behind_the_journals_back(dir: &Path, entry: &LedgerRecord) {
    let db = arbor_storage::open_db(dir).unwrap();
    let meta = db.open_tree("meta").unwrap();
    let seq = u64::from_be_bytes(
        meta.get("seq")
            .unwrap()
            .unwrap()
            .as_ref()
            .try_into()
            .unwrap(),
    ) + 1;
    let (tag, uuid) = match entry.owner {
        ParentRef::Run(id) => (0u8, id.0),
        ParentRef::Job(id) => (1u8, id.0),
    };
    let key = [&[tag][..], uuid.as_bytes(), &seq.to_be_bytes()].concat();
    let mut value = vec![3u8]; // format version
    value.extend(bincode::serde::encode_to_vec(entry, bincode::config::standard()).unwrap());
    db.open_tree("ledger").unwrap().insert(key, value).unwrap();
    meta.insert("seq", &seq.to_be_bytes()).unwrap();
    db.flush().unwrap();
}

on_both!(inv_41_a_write_from_an_earlier_boot_is_refused_and_writes_nothing);
async fn inv_41_a_write_from_an_earlier_boot_is_refused_and_writes_nothing(store: Store) {
    let job = JobId::new();
    let journal = store.open();
    assert_eq!(journal.epoch(), 1);
    journal.commit(vec![steer(job, 1, 1)]).await.unwrap();
    drop(journal);

    let journal = store.open();
    assert_eq!(journal.epoch(), 2);
    let before = journal.applied_seq();

    // A good record and a late one from boot 1: the whole batch is refused.
    let refused = journal
        .commit(vec![steer(job, 2, 2), steer(job, 3, 1)])
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            Error::StaleEpoch {
                record_epoch: 1,
                current: 2
            }
        ),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("earlier boot of the node"),
        "{refused}"
    );
    assert_eq!(journal.applied_seq(), before);
    assert_eq!(message_ids(&journal, job), vec![1]);

    // Nothing comes from a boot that has not happened yet either.
    let future = journal.append(vec![steer(job, 4, 3)]).unwrap_err();
    assert!(
        matches!(
            future,
            Error::FutureEpoch {
                record_epoch: 3,
                current: 2
            }
        ),
        "{future:?}"
    );
    assert_eq!(journal.applied_seq(), before);

    // A refusal is not a failure: the journal goes on taking this boot's writes.
    assert_eq!(journal.failed(), None);
    let seq = journal.commit(vec![steer(job, 2, 2)]).await.unwrap();
    assert_eq!(seq, before + 1);
    assert_eq!(message_ids(&journal, job), vec![1, 2]);
}

#[tokio::test]
async fn every_commit_fdatasyncs_the_log_once() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let job = JobId::new();
    assert_eq!(journal.sync_count(), 0);
    for n in 1..=3 {
        journal.commit(vec![steer(job, n, 1)]).await.unwrap();
        assert_eq!(journal.sync_count(), n);
    }
    assert_eq!(journal.sync_count(), journal.flush_count());
}

#[tokio::test]
async fn with_syncs_skipped_a_commit_writes_the_log_and_syncs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    journal.commit(vec![steer(job, 1, 1)]).await.unwrap();
    let (flushes, syncs) = (journal.flush_count(), journal.sync_count());
    journal.faults().skip_syncs(true);
    journal.commit(vec![steer(job, 2, 1)]).await.unwrap();
    assert_eq!(
        (journal.flush_count(), journal.sync_count()),
        (flushes + 1, syncs)
    );
    // Written all the same: a crash image of the process holds it.
    let image = tempfile::tempdir().unwrap();
    crash_image(dir.path(), image.path());
    drop(journal);
    assert_eq!(
        message_ids(&Journal::open(image.path()).unwrap(), job),
        vec![1, 2]
    );
}

on_both!(a_failed_write_writes_nothing_and_stops_the_journal);
async fn a_failed_write_writes_nothing_and_stops_the_journal(store: Store) {
    let job = JobId::new();
    let journal = store.open();
    let acknowledged = journal.commit(vec![steer(job, 1, 1)]).await.unwrap();

    journal.faults().fail_writes(true);
    let error = journal.commit(vec![steer(job, 2, 1)]).await.unwrap_err();
    assert!(matches!(error, Error::Injected("write")), "{error:?}");
    assert_eq!(journal.applied_seq(), acknowledged);
    assert_eq!(message_ids(&journal, job), vec![1]);

    // The disk is back, but the journal does not trust it: it says why it stopped.
    journal.faults().fail_writes(false);
    let first = journal.failed().expect("the failure is remembered");
    assert!(first.contains("injected fault"), "{first}");
    for error in [
        journal.append(vec![steer(job, 3, 1)]).unwrap_err(),
        journal.append(vec![]).unwrap_err(),
        journal.commit(vec![steer(job, 3, 1)]).await.unwrap_err(),
    ] {
        match &error {
            Error::Failed(why) => assert_eq!(why, &first),
            other => panic!("expected Failed, got {other:?}"),
        }
        assert!(
            error.to_string().contains("stopped taking writes"),
            "{error}"
        );
    }
    drop(journal);

    // A reopen starts clean, with everything acknowledged.
    let journal = store.open();
    assert_eq!(journal.failed(), None);
    assert_eq!(message_ids(&journal, job), vec![1]);
    assert_eq!(journal.durable_seq(), acknowledged);
}

on_both!(a_failed_flush_acknowledges_nothing_and_stops_the_journal);
async fn a_failed_flush_acknowledges_nothing_and_stops_the_journal(store: Store) {
    let job = JobId::new();
    let journal = store.open();
    let acknowledged = journal.commit(vec![steer(job, 1, 1)]).await.unwrap();
    let (flushes, syncs) = (journal.flush_count(), journal.sync_count());

    journal.faults().fail_flushes(true);
    let error = journal.commit(vec![steer(job, 2, 1)]).await.unwrap_err();
    assert!(matches!(error, Error::Injected("flush")), "{error:?}");
    // Applied and readable, but never acknowledged as durable.
    assert_eq!(journal.applied_seq(), acknowledged + 1);
    assert_eq!(journal.durable_seq(), acknowledged);
    assert_eq!(message_ids(&journal, job), vec![1, 2]);
    assert_eq!(
        (journal.flush_count(), journal.sync_count()),
        (flushes, syncs)
    );

    // Even with the fault gone, no later flush acknowledges anything: after a
    // failed sync the kernel may have dropped what it held.
    journal.faults().fail_flushes(false);
    assert!(journal.failed().unwrap().contains("a flush failed"));
    // (The PostgreSQL engine tells a wait for the failed transaction's own
    // seqs its error; the sled engine, that the journal has failed.)
    assert!(matches!(
        journal.flush().await.unwrap_err(),
        Error::Failed(_) | Error::Injected("flush")
    ));
    assert!(matches!(
        journal.commit(vec![steer(job, 3, 1)]).await.unwrap_err(),
        Error::Failed(_)
    ));
    assert_eq!(journal.durable_seq(), acknowledged);
    drop(journal);

    let journal = store.open();
    assert!(message_ids(&journal, job).starts_with(&[1]));
}

on_both!(a_held_flush_keeps_commits_waiting_until_it_is_released);
async fn a_held_flush_keeps_commits_waiting_until_it_is_released(store: Store) {
    let job = JobId::new();
    let journal = store.open();
    let acknowledged = journal.commit(vec![steer(job, 1, 1)]).await.unwrap();
    let flushes = journal.flush_count();

    journal.faults().hold_flushes(true);
    let mut second = Box::pin(journal.commit(vec![steer(job, 2, 1)]));
    assert!(poll_once(second.as_mut()).is_pending());
    assert!(journal.faults().wait_until_flush_held(LIMIT));
    // Queued while the flusher is parked: served by the same flush.
    let mut third = Box::pin(journal.commit(vec![steer(job, 3, 1)]));
    assert!(poll_once(third.as_mut()).is_pending());

    // Applied and readable; not durable, not acknowledged.
    assert_eq!(journal.applied_seq(), acknowledged + 2);
    assert_eq!(journal.durable_seq(), acknowledged);
    assert_eq!(message_ids(&journal, job), vec![1, 2, 3]);
    assert!(poll_once(second.as_mut()).is_pending());
    assert_eq!(journal.flush_count(), flushes);

    journal.faults().hold_flushes(false);
    assert_eq!(second.await.unwrap(), acknowledged + 1);
    assert_eq!(third.await.unwrap(), acknowledged + 2);
    assert_eq!(journal.durable_seq(), acknowledged + 2);
    assert_eq!(journal.flush_count(), flushes + 1);
    assert_eq!(journal.failed(), None);
}

on_both!(a_crash_between_write_and_flush_loses_nothing_acknowledged);
async fn a_crash_between_write_and_flush_loses_nothing_acknowledged(store: Store) {
    let job = JobId::new();
    let journal = store.open();
    let acknowledged = journal.commit(vec![steer(job, 1, 1)]).await.unwrap();

    journal.faults().hold_flushes(true);
    let mut unacknowledged = Box::pin(journal.commit(vec![steer(job, 2, 1)]));
    assert!(poll_once(unacknowledged.as_mut()).is_pending());
    assert!(journal.faults().wait_until_flush_held(LIMIT));

    // The crash: the caller never hears back, and the journal goes away with
    // its flusher parked (dropping must not wait for the hold).
    drop(unacknowledged);
    drop(journal);

    let journal = store.open();
    assert_eq!(journal.epoch(), 2);
    assert!(journal.durable_seq() >= acknowledged);
    // The unacknowledged record may or may not have made it; the acknowledged one did.
    assert_eq!(message_ids(&journal, job)[0], 1);
    assert!(journal.scan().unwrap().undecodable.is_empty());
}

#[tokio::test]
async fn inv_30_a_live_sandbox_read_back_matches_its_process_until_it_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let run = RunId::new();
    let (job, other_job) = (JobId::new(), JobId::new());

    let mut child = Command::new("sleep")
        .arg("1000")
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("sleep starts");
    let pgid = child.id() as i32;
    let (start_ticks, boot_id) = process_start(pgid).expect("the child is in /proc");
    let sandbox = |job, pgid, state| SandboxRecord {
        run,
        job,
        pgid,
        start_ticks,
        boot_id: boot_id.clone(),
        state,
        epoch: journal.epoch(),
    };
    journal
        .commit(vec![
            Record::Sandbox(sandbox(job, pgid, SandboxState::Live)),
            Record::Sandbox(sandbox(job, 7, SandboxState::Ended)),
            Record::Sandbox(sandbox(other_job, 9, SandboxState::Live)),
        ])
        .await
        .unwrap();

    let pgids = |records: Vec<SandboxRecord>| records.iter().map(|s| s.pgid).collect::<Vec<_>>();
    assert_eq!(pgids(journal.sandboxes(job).unwrap()), {
        let mut both = vec![7, pgid];
        both.sort();
        both
    });
    let mut live = pgids(journal.live_sandboxes().unwrap());
    live.sort();
    let mut expected = vec![pgid, 9];
    expected.sort();
    assert_eq!(live, expected);

    // What recovery does with it: kill the group only while it is still ours.
    let recorded = journal
        .live_sandboxes()
        .unwrap()
        .into_iter()
        .find(|s| s.pgid == pgid)
        .unwrap();
    assert!(same_process(
        recorded.pgid,
        recorded.start_ticks,
        &recorded.boot_id
    ));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!same_process(
        recorded.pgid,
        recorded.start_ticks,
        &recorded.boot_id
    ));
}

on_both!(a_balanced_journal_verifies_clean);
async fn a_balanced_journal_verifies_clean(store: Store) {
    let journal = store.open();
    let run = ParentRef::Run(RunId::new());
    let child = JobId::new();
    let ops = |owner, ops: Vec<LedgerOp>| {
        ops.into_iter()
            .map(move |op| ledger(owner, op, 1))
            .collect::<Vec<_>>()
    };
    let mut records = ops(
        run,
        vec![
            LedgerOp::Open { grant: 1_000 },
            LedgerOp::Hold { child, amount: 400 },
        ],
    );
    records.extend(ops(
        ParentRef::Job(child),
        vec![
            LedgerOp::Open { grant: 400 },
            LedgerOp::CallReserve { amount: 300 },
            LedgerOp::CallSettle {
                reserved: 300,
                spent: 120,
            },
            LedgerOp::Close { spent: 120 },
        ],
    ));
    records.extend(ops(
        run,
        vec![
            LedgerOp::Release {
                child,
                granted: 400,
                spent: 120,
            },
            LedgerOp::Close { spent: 120 },
        ],
    ));
    records.push(steer(child, 1, 1));
    journal.commit(records).await.unwrap();

    let report = journal.verify().unwrap();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!((report.records, report.accounts), (9, 2));
}

#[tokio::test]
async fn a_journal_edited_to_break_conservation_names_the_account() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let owner = ParentRef::Job(job);
    let journal = Journal::open(dir.path()).unwrap();
    journal
        .commit(vec![
            ledger(owner, LedgerOp::Open { grant: 100 }, 1),
            ledger(
                owner,
                LedgerOp::CallSettle {
                    reserved: 0,
                    spent: 60,
                },
                1,
            ),
        ])
        .await
        .unwrap();
    assert!(journal.verify().unwrap().is_clean());
    drop(journal);

    // Someone charges 70 more than the account was ever given.
    let overcharge = LedgerRecord {
        owner,
        unit: arbor_storage::Unit::Tokens,
        op: LedgerOp::CallSettle {
            reserved: 0,
            spent: 110,
        },
        epoch: 1,
    };
    write_ledger_behind_the_journals_back(dir.path(), &overcharge);

    let journal = Journal::open(dir.path()).unwrap();
    let report = journal.verify().unwrap();
    assert!(!report.is_clean());
    assert!(report.undecodable.is_empty(), "the edit decodes fine");
    assert_eq!(
        report.breaches,
        vec![format!(
            "job {}: spent 170 + held 0 = 170 exceeds its grant 100",
            job.0
        )]
    );

    // A Close that claims the wrong spent is a breach too.
    journal
        .commit(vec![ledger(owner, LedgerOp::Close { spent: 60 }, 2)])
        .await
        .unwrap();
    let breaches = journal.verify().unwrap().breaches;
    assert_eq!(breaches.len(), 2, "{breaches:#?}");
    assert_eq!(
        breaches[1],
        format!(
            "job {}: Close says spent 60, its ledger adds up to 170",
            job.0
        )
    );
}

#[tokio::test]
async fn an_undecodable_record_makes_verify_unclean() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    journal.commit(vec![steer(job, 1, 1)]).await.unwrap();
    drop(journal);
    {
        let db = arbor_storage::open_db(dir.path()).unwrap();
        let steering = db.open_tree("steering").unwrap();
        let key = [job.0.as_bytes().as_slice(), &1u64.to_be_bytes()].concat();
        steering.insert(key, vec![9u8, 0, 0]).unwrap();
        db.flush().unwrap();
    }
    let journal = Journal::open(dir.path()).unwrap();
    let report = journal.verify().unwrap();
    assert!(!report.is_clean());
    assert_eq!(report.undecodable.len(), 1);
    assert_eq!(report.undecodable[0].tree, "steering");
    assert!(report.breaches.is_empty());
}

on_both!(a_read_only_open_changes_nothing_not_even_the_epoch);
async fn a_read_only_open_changes_nothing_not_even_the_epoch(store: Store) {
    let journal = store.open();
    let epoch = journal.epoch();
    let seq = journal.applied_seq();
    drop(journal);
    let reader = store.open_read_only().unwrap();
    assert_eq!((reader.epoch(), reader.applied_seq()), (epoch, seq));
    assert!(matches!(
        reader.append(vec![]),
        Err(arbor_storage::Error::ReadOnly)
    ));
    drop(reader);
    assert_eq!(store.open().epoch(), epoch + 1);
    assert!(
        store.elsewhere().open_read_only().is_err(),
        "no journal there"
    );
}

#[tokio::test]
async fn a_snapshot_a_crash_left_half_written_does_not_stop_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let run = RunId::new();
    {
        let journal = arbor_storage::Journal::open(dir.path()).unwrap();
        let epoch = journal.epoch();
        journal
            .commit(vec![arbor_storage::Record::Ledger(
                arbor_storage::LedgerRecord {
                    owner: ParentRef::Run(run),
                    unit: arbor_storage::Unit::Tokens,
                    op: arbor_storage::LedgerOp::Open { grant: 7 },
                    epoch,
                },
            )])
            .await
            .unwrap();
    }
    // What a SIGKILL during sled's snapshot write leaves: sled 0.34 would pick
    // it as the newest snapshot and refuse to open ("Read corrupted data").
    std::fs::write(dir.path().join("snap.FFFFFFFFFFFFFFFF.generating"), b"torn").unwrap();
    let journal = arbor_storage::Journal::open(dir.path()).unwrap();
    assert_eq!(
        journal.ledger(ParentRef::Run(run)).unwrap().len(),
        1,
        "nothing acknowledged was lost"
    );
    assert!(!dir.path().join("snap.FFFFFFFFFFFFFFFF.generating").exists());
}

/// Copies a journal's directory while it is open: what the disk holds at
/// that instant is what a SIGKILL (or, for what was synced, a power cut)
/// leaves behind.
fn crash_image(dir: &Path, into: &Path) {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }
    copy(dir, into);
}

#[tokio::test]
async fn a_crash_image_holds_every_acknowledged_commit_through_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    // Some one at a time, some concurrent (sharing flushes).
    for n in 1..=20 {
        journal.commit(vec![steer(job, n, 1)]).await.unwrap();
    }
    let commits = (21..=60).map(|n| journal.commit(vec![steer(job, n, 1)]));
    for result in futures_join_all(commits).await {
        result.unwrap();
    }
    let acknowledged = journal.durable_seq();

    let image = tempfile::tempdir().unwrap();
    crash_image(dir.path(), image.path());
    drop(journal);

    let reopened = Journal::open(image.path()).unwrap();
    assert_eq!(message_ids(&reopened, job), (1..=60).collect::<Vec<_>>());
    assert!(reopened.applied_seq() >= acknowledged);
    assert!(reopened.scan().unwrap().undecodable.is_empty());
    // The log was replayed into sled and started afresh: a second crash
    // image, of the reopened journal, reads back the same.
    let again = tempfile::tempdir().unwrap();
    crash_image(image.path(), again.path());
    drop(reopened);
    let twice = Journal::open(again.path()).unwrap();
    assert_eq!(message_ids(&twice, job), (1..=60).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_torn_frame_at_the_logs_end_is_dropped_and_the_rest_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    for n in 1..=5 {
        journal.commit(vec![steer(job, n, 1)]).await.unwrap();
    }
    let image = tempfile::tempdir().unwrap();
    crash_image(dir.path(), image.path());
    drop(journal);
    // The write a crash cut short: half a frame header after the last frame.
    let wal = image.path().join("wal");
    let segment = std::fs::read_dir(&wal)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes.extend_from_slice(&[9, 0, 0]);
    std::fs::write(&segment, bytes).unwrap();

    let reopened = Journal::open(image.path()).unwrap();
    assert_eq!(message_ids(&reopened, job), vec![1, 2, 3, 4, 5]);
    assert_eq!(reopened.failed(), None);
    reopened.commit(vec![steer(job, 6, 2)]).await.unwrap();
    assert_eq!(message_ids(&reopened, job), vec![1, 2, 3, 4, 5, 6]);
}

/// Awaits every future, polling each once first: a commit appends and
/// queues its waiter on its first poll, so they all share the flushes.
async fn futures_join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut started = Vec::new();
    for future in futures {
        let mut future = Box::pin(future);
        match poll_once(future.as_mut()) {
            Poll::Ready(output) => started.push(Err(output)),
            Poll::Pending => started.push(Ok(future)),
        }
    }
    let mut out = Vec::new();
    for future in started {
        out.push(match future {
            Ok(future) => future.await,
            Err(output) => output,
        });
    }
    out
}

#[tokio::test]
async fn appends_nobody_commits_are_written_to_the_log_once_they_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    // 5 MiB of steering text, appended and never committed.
    let big = "x".repeat(64 * 1024);
    for n in 1..=80 {
        journal
            .append(vec![Record::Steer(SteerRecord {
                job,
                message_id: n,
                text: big.clone(),
                state: SteerState::Queued,
                epoch: 1,
            })])
            .unwrap();
    }
    // The flusher was asked as the backlog passed its 4 MiB mark (the 64th
    // append); nothing signals a flush nobody waits for, so a bounded wait.
    let deadline = std::time::Instant::now() + LIMIT;
    while journal.durable_seq() < 64 {
        assert!(std::time::Instant::now() < deadline, "never written");
        std::thread::yield_now();
    }
    assert!(journal.flush_count() >= 1);
}

/// A node's clean close may leave to the log what sled has not taken yet
/// (`leave_unapplied_at_close`): its process ends without waiting for sled,
/// and the next open applies it. Nothing is lost that way, committed or
/// only appended: the close writes and syncs every frame first.
#[tokio::test]
async fn a_close_that_leaves_sled_behind_the_log_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let job = JobId::new();
    let journal = Journal::open(dir.path()).unwrap();
    journal.leave_unapplied_at_close();
    for n in 1..=5 {
        journal.commit(vec![steer(job, n, 1)]).await.unwrap();
    }
    // Appended, never committed: written at the close all the same.
    let last = journal.append(vec![steer(job, 6, 1)]).unwrap();
    drop(journal);

    // sled was left behind: it holds less than was appended.
    let in_sled = {
        let db = arbor_storage::open_db(dir.path()).unwrap();
        let meta = db.open_tree("meta").unwrap();
        meta.get("seq")
            .unwrap()
            .map(|v| u64::from_be_bytes(v.as_ref().try_into().unwrap()))
            .unwrap_or(0)
    };
    assert!(
        in_sled < last,
        "sled holds up to {in_sled}, the log up to {last}"
    );

    let reopened = Journal::open(dir.path()).unwrap();
    assert_eq!(message_ids(&reopened, job), (1..=6).collect::<Vec<_>>());
    assert!(reopened.applied_seq() >= last);
    let report = reopened.verify().unwrap();
    assert!(report.is_clean(), "{report:?}");
}
