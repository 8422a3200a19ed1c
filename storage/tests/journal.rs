//! The journal from the outside: round trips, reopen, durability, group
//! commit, corruption and the ledger arithmetic, on real sled directories
//! and, where `on_both!` says, in PostgreSQL (`common/mod.rs`).

use arbor_protocol::{
    ErrorClass, Event, EventKind, JobId, NodeKind, ParentRef, RunId, Status, TaskStatus,
};
use arbor_storage::{
    DelegationRecord, Error, JobRecord, Journal, LedgerOp, LedgerRecord, LedgerTotals, Record,
    RunRecord, SandboxRecord, SandboxState, SteerRecord, SteerState, ledger_totals,
};
use std::sync::Arc;

mod common;
use common::Store;

fn run_record(id: RunId, status: Status) -> RunRecord {
    RunRecord {
        id,
        flow: "review".into(),
        budget_tokens: 10_000,
        status,
        error_class: None,
        reason: None,
        output_json: "null".into(),
        epoch: 1,
    }
}

fn job_record(run: RunId, id: JobId) -> JobRecord {
    JobRecord {
        id,
        run,
        parent: ParentRef::Run(run),
        kind: NodeKind::Step,
        agent: "planner".into(),
        label: Some("plan".into()),
        depth: 0,
        attempt: 1,
        grant_tokens: 4_000,
        workdir: "/tmp/work/plan".into(),
        status: Status::Failed,
        task_status: Some(TaskStatus::Partial),
        error_class: Some(ErrorClass::Timeout),
        reason: Some("timed out after 5m".into()),
        output_json: r#"{"done":false}"#.into(),
        tokens_spent: 1_234,
        epoch: 1,
    }
}

fn ledger(owner: ParentRef, op: LedgerOp) -> LedgerRecord {
    LedgerRecord {
        owner,
        unit: arbor_storage::Unit::Tokens,
        op,
        epoch: 1,
    }
}

fn event(run: RunId, seq: u64, kind: EventKind) -> Event {
    Event {
        seq,
        run,
        at_ms: 1_700_000_000_000 + seq,
        kind,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

on_both!(every_record_kind_round_trips);
async fn every_record_kind_round_trips(store: Store) {
    let journal = store.open();
    let run = RunId::new();
    let (step, child) = (JobId::new(), JobId::new());
    let run_account = ParentRef::Run(run);

    let job = job_record(run, step);
    let entries = vec![
        ledger(run_account, LedgerOp::Open { grant: 10_000 }),
        ledger(
            run_account,
            LedgerOp::Hold {
                child: step,
                amount: 4_000,
            },
        ),
        ledger(run_account, LedgerOp::CallReserve { amount: 500 }),
        ledger(
            run_account,
            LedgerOp::CallSettle {
                reserved: 500,
                spent: 120,
            },
        ),
        ledger(
            run_account,
            LedgerOp::Release {
                child: step,
                granted: 4_000,
                spent: 1_234,
            },
        ),
        ledger(run_account, LedgerOp::Close { spent: 1_354 }),
    ];
    let delegation = DelegationRecord {
        parent: step,
        key: "call-1".into(),
        digest: "sha256:abc".into(),
        children: vec![child],
        epoch: 1,
    };
    let steer = SteerRecord {
        job: step,
        message_id: 1,
        text: "look at the tests first".into(),
        state: SteerState::Queued,
        epoch: 1,
    };
    let events = vec![
        event(
            run,
            1,
            EventKind::RunStarted {
                budget_usd_micros: None,
                flow: "review".into(),
                budget_tokens: 10_000,
                spec: Box::new(arbor_protocol::RunSpec::single("review", "x", 10_000)),
            },
        ),
        event(
            run,
            2,
            EventKind::job_finished(
                arbor_protocol::ResultEnvelope {
                    task_status: Some(TaskStatus::Completed),
                    output: serde_json::json!({"files": ["a.rs"], "n": 2}),
                    artifacts: vec!["report.md".into()],
                    turns: 3,
                    tokens_spent: 1_234,
                    ..arbor_protocol::ResultEnvelope::bare(step, "reviewer", Status::Done)
                },
                None,
                false,
            ),
        ),
    ];

    let sandbox = SandboxRecord {
        run,
        job: step,
        pgid: 31_337,
        start_ticks: 8_675_309,
        boot_id: "0b5e5f1e-1d2c-4d8e-9f00-5a5a5a5a5a5a".into(),
        state: SandboxState::Live,
        epoch: 1,
    };
    let mut records = vec![
        Record::Run(run_record(run, Status::Running)),
        Record::Job(job.clone()),
        Record::Delegation(delegation.clone()),
        Record::Steer(steer.clone()),
        Record::Sandbox(sandbox.clone()),
    ];
    records.extend(entries.iter().cloned().map(Record::Ledger));
    records.extend(events.iter().cloned().map(Record::Event));
    journal.commit(records).await.unwrap();

    assert_eq!(
        journal.run(run).unwrap(),
        Some(run_record(run, Status::Running))
    );
    assert_eq!(
        journal.runs().unwrap(),
        vec![run_record(run, Status::Running)]
    );
    assert_eq!(journal.job(run, step).unwrap(), Some(job.clone()));
    assert_eq!(journal.jobs(run).unwrap(), vec![job.clone()]);
    assert_eq!(journal.all_jobs().unwrap(), vec![job]);
    assert_eq!(journal.sandboxes(step).unwrap(), vec![sandbox.clone()]);
    assert_eq!(journal.live_sandboxes().unwrap(), vec![sandbox.clone()]);
    assert_eq!(journal.ledger(run_account).unwrap(), entries);
    assert_eq!(
        journal.delegation(step, &delegation.key).unwrap(),
        Some(delegation.clone())
    );
    assert_eq!(journal.delegation(step, "another key").unwrap(), None);
    assert_eq!(journal.delegation(child, &delegation.key).unwrap(), None);
    assert_eq!(journal.delegations(step).unwrap(), vec![delegation]);
    assert_eq!(journal.steering(step).unwrap(), vec![steer.clone()]);
    assert_eq!(journal.events(run).unwrap(), events);
    assert_eq!(journal.job(run, child).unwrap(), None);
    assert_eq!(journal.run(RunId::new()).unwrap(), None);
    assert_eq!(journal.scan().unwrap().records, 5 + 6 + 2);

    // States are replaced under their key; history only grows.
    let delivered = SteerRecord {
        state: SteerState::Delivered,
        ..steer
    };
    let ended = SandboxRecord {
        state: SandboxState::Ended,
        ..sandbox
    };
    journal
        .commit(vec![
            Record::Run(run_record(run, Status::Done)),
            Record::Steer(delivered.clone()),
            Record::Ledger(ledger(run_account, LedgerOp::Close { spent: 1_354 })),
            Record::Sandbox(ended.clone()),
        ])
        .await
        .unwrap();
    assert_eq!(journal.run(run).unwrap().unwrap().status, Status::Done);
    assert_eq!(journal.steering(step).unwrap(), vec![delivered]);
    assert_eq!(journal.sandboxes(step).unwrap(), vec![ended]);
    assert!(journal.live_sandboxes().unwrap().is_empty());
    assert_eq!(journal.ledger(run_account).unwrap().len(), 7);
}

on_both!(a_jobs_run_is_found_by_key_among_the_runs_started_before_it);
/// `run_of_job`: the run of a job, asked of the runs that started no later
/// than the job, each by the job's key; a job of no run is None.
async fn a_jobs_run_is_found_by_key_among_the_runs_started_before_it(store: Store) {
    let journal = store.open();
    let (first, second) = (RunId::new(), RunId::new());
    let (early, late) = (JobId::new(), JobId::new());
    let later_run = RunId::new();
    journal
        .commit(vec![
            Record::Run(run_record(first, Status::Running)),
            Record::Run(run_record(second, Status::Running)),
            Record::Run(run_record(later_run, Status::Running)),
            Record::Job(job_record(first, early)),
            Record::Job(job_record(second, late)),
        ])
        .await
        .unwrap();
    assert_eq!(journal.run_of_job(early).unwrap(), Some(first));
    assert_eq!(journal.run_of_job(late).unwrap(), Some(second));
    assert_eq!(journal.run_of_job(JobId::new()).unwrap(), None);
}

on_both!(reads_are_scoped_to_their_owner);
async fn reads_are_scoped_to_their_owner(store: Store) {
    let journal = store.open();
    let (a, b) = (RunId::new(), RunId::new());
    let (job_a, job_b) = (JobId::new(), JobId::new());
    journal
        .commit(vec![
            Record::Job(job_record(a, job_a)),
            Record::Job(job_record(b, job_b)),
            Record::Ledger(ledger(ParentRef::Run(a), LedgerOp::Open { grant: 1 })),
            // Same uuid as run `a`, but a job account: the tag byte keeps them apart.
            Record::Ledger(ledger(
                ParentRef::Job(JobId(a.0)),
                LedgerOp::Open { grant: 2 },
            )),
            Record::Event(event(a, 1, EventKind::JobRunning { id: job_a })),
            Record::Event(event(b, 2, EventKind::JobRunning { id: job_b })),
        ])
        .await
        .unwrap();
    assert_eq!(journal.jobs(a).unwrap(), vec![job_record(a, job_a)]);
    assert_eq!(journal.ledger(ParentRef::Run(a)).unwrap().len(), 1);
    assert_eq!(journal.ledger(ParentRef::Job(JobId(a.0))).unwrap().len(), 1);
    assert_eq!(journal.events(b).unwrap().len(), 1);
    assert!(journal.steering(job_a).unwrap().is_empty());
}

on_both!(reopening_keeps_records_bumps_the_epoch_and_continues_the_seq);
async fn reopening_keeps_records_bumps_the_epoch_and_continues_the_seq(store: Store) {
    let run = RunId::new();
    let owner = ParentRef::Run(run);

    let journal = store.open();
    assert_eq!(journal.epoch(), 1);
    let first = journal
        .commit(vec![
            Record::Run(run_record(run, Status::Running)),
            Record::Ledger(ledger(owner, LedgerOp::Open { grant: 100 })),
        ])
        .await
        .unwrap();
    assert_eq!(first, 2);
    drop(journal);

    let journal = store.open();
    assert_eq!(journal.epoch(), 2);
    assert_eq!(journal.durable_seq(), first);
    assert_eq!(
        journal.run(run).unwrap(),
        Some(run_record(run, Status::Running))
    );
    // Records of this boot carry its epoch (an epoch-1 record is refused now).
    let close = LedgerRecord {
        epoch: journal.epoch(),
        ..ledger(owner, LedgerOp::Close { spent: 0 })
    };
    let next = journal.commit(vec![Record::Ledger(close)]).await.unwrap();
    assert_eq!(next, first + 1);
    // Had the seq restarted, this entry would have overwritten the Open.
    assert_eq!(
        journal
            .ledger(owner)
            .unwrap()
            .into_iter()
            .map(|e| e.op)
            .collect::<Vec<_>>(),
        vec![LedgerOp::Open { grant: 100 }, LedgerOp::Close { spent: 0 }]
    );
    drop(journal);

    assert_eq!(store.open().epoch(), 3);
}

on_both!(commit_returns_only_once_its_records_are_durable);
async fn commit_returns_only_once_its_records_are_durable(store: Store) {
    let journal = store.open();
    let run = RunId::new();

    let appended = journal
        .append(vec![Record::Run(run_record(run, Status::Pending))])
        .unwrap();
    // Visible at once, durable later.
    assert!(journal.run(run).unwrap().is_some());

    let committed = journal
        .commit(vec![Record::Run(run_record(run, Status::Running))])
        .await
        .unwrap();
    assert!(committed > appended);
    assert!(journal.durable_seq() >= committed);
}

on_both!(
    concurrent_commits_share_flushes,
    flavor = "multi_thread",
    worker_threads = 4
);
async fn concurrent_commits_share_flushes(store: Store) {
    const COMMITS: u64 = 50;
    let journal = store.open();
    let owner = ParentRef::Run(RunId::new());
    // Released together so the commits really overlap.
    let start = Arc::new(tokio::sync::Barrier::new(COMMITS as usize));

    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..COMMITS {
        let (journal, start) = (journal.clone(), Arc::clone(&start));
        tasks.spawn(async move {
            start.wait().await;
            let op = LedgerOp::CallReserve { amount: n };
            let seq = journal
                .commit(vec![Record::Ledger(ledger(owner, op))])
                .await
                .unwrap();
            assert!(journal.durable_seq() >= seq);
            seq
        });
    }
    let mut seqs = tasks.join_all().await;
    seqs.sort();

    assert_eq!(seqs, (1..=COMMITS).collect::<Vec<_>>());
    assert_eq!(journal.durable_seq(), COMMITS);
    assert_eq!(journal.ledger(owner).unwrap().len() as u64, COMMITS);
    let flushes = journal.flush_count();
    assert!(
        flushes < COMMITS,
        "group commit: {COMMITS} commits took {flushes} flushes"
    );
}

#[tokio::test]
async fn a_value_with_an_unknown_version_byte_is_reported_never_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let (run, job) = (RunId::new(), JobId::new());
    let journal = Journal::open(dir.path()).unwrap();
    journal
        .commit(vec![
            Record::Run(run_record(run, Status::Running)),
            Record::Job(job_record(run, job)),
        ])
        .await
        .unwrap();
    drop(journal);

    // Corrupt the job's version byte behind the journal's back.
    let key = [run.0.as_bytes().as_slice(), job.0.as_bytes()].concat();
    {
        let db = arbor_storage::open_db(dir.path()).unwrap();
        let jobs = db.open_tree("jobs").unwrap();
        let mut value = jobs.get(&key).unwrap().unwrap().to_vec();
        value[0] = 9;
        jobs.insert(&key, value).unwrap();
        db.flush().unwrap();
    }

    let journal = Journal::open(dir.path()).unwrap();
    let report = journal.scan().unwrap();
    assert_eq!(report.records, 1, "the run still decodes");
    assert_eq!(report.undecodable.len(), 1);
    let bad = &report.undecodable[0];
    assert_eq!(
        (bad.tree.as_str(), bad.key_hex.as_str()),
        ("jobs", hex(&key).as_str())
    );
    assert!(bad.error.contains("version 9"), "{}", bad.error);

    match journal.jobs(run) {
        Err(Error::Undecodable { tree, key_hex, .. }) => {
            assert_eq!((tree, key_hex), ("jobs".to_string(), hex(&key)));
        }
        other => panic!("expected the read to fail on the bad value, got {other:?}"),
    }
    assert!(journal.run(run).unwrap().is_some());
}

/// Writes `format` into a journal's meta behind its back.
fn set_format(dir: &std::path::Path, format: u32) {
    let db = arbor_storage::open_db(dir).unwrap();
    db.open_tree("meta")
        .unwrap()
        .insert("format", &format.to_be_bytes())
        .unwrap();
    db.flush().unwrap();
}

#[test]
fn a_journal_of_a_newer_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(Journal::open(dir.path()).unwrap());
    set_format(dir.path(), 4);
    match Journal::open(dir.path()) {
        Err(Error::FormatVersion {
            found: 4,
            supported: 3,
            ..
        }) => {}
        other => panic!("expected a format version error, got {:?}", other.err()),
    }
}

/// Format 1 packed a history table's chunks without each row's key, and
/// format 2 wrote a micro-dollar ledger entry as an operation wrapped in
/// another: a journal of either is refused, saying where it is, what to do,
/// and that nothing changed (its epoch is not bumped).
#[test]
fn a_journal_of_an_older_format_is_refused_with_what_to_do_and_left_as_it_was() {
    for old in [1, 2] {
        refused_as_older(old);
    }
}

fn refused_as_older(old: u32) {
    let dir = tempfile::tempdir().unwrap();
    drop(Journal::open(dir.path()).unwrap());
    set_format(dir.path(), old);
    let epoch = || {
        let db = arbor_storage::open_db(dir.path()).unwrap();
        let meta = db.open_tree("meta").unwrap();
        meta.get("epoch").unwrap().map(|v| v.to_vec())
    };
    let epoch_before = epoch();
    let error = Journal::open(dir.path()).unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(
            error,
            Error::FormatVersion {
                found,
                supported: 3,
                ..
            } if found == old
        ),
        "{message}"
    );
    for words in [
        dir.path().display().to_string().as_str(),
        &format!("format {old}"),
        "reads format 3",
        "earlier arbor",
        "nothing was changed",
    ] {
        assert!(message.contains(words), "{message:?} lacks {words:?}");
    }
    // Refused again, the same way: the first refusal changed nothing.
    assert!(matches!(
        Journal::open_read_only(dir.path()),
        Err(Error::FormatVersion { found, .. }) if found == old
    ));
    assert_eq!(epoch(), epoch_before, "the refused opens began no epoch");
}

on_both!(ledger_totals_balance_an_account_read_back_from_the_journal);
async fn ledger_totals_balance_an_account_read_back_from_the_journal(store: Store) {
    let journal = store.open();
    let step = JobId::new();
    let owner = ParentRef::Job(step);
    let (a, b) = (JobId::new(), JobId::new());
    let ops = [
        LedgerOp::Open { grant: 4_000 },
        LedgerOp::CallReserve { amount: 600 },
        LedgerOp::CallSettle {
            reserved: 600,
            spent: 250,
        },
        LedgerOp::Hold {
            child: a,
            amount: 1_000,
        },
        LedgerOp::Hold {
            child: b,
            amount: 800,
        },
        LedgerOp::CallReserve { amount: 600 },
        LedgerOp::Release {
            child: a,
            granted: 1_000,
            spent: 700,
        },
    ];
    journal
        .commit(
            ops.into_iter()
                .map(|op| Record::Ledger(ledger(owner, op)))
                .collect(),
        )
        .await
        .unwrap();

    let totals = ledger_totals(&journal.ledger(owner).unwrap(), arbor_storage::Unit::Tokens);
    // spent: 250 own + 700 from a; held: b's 800 + the open call's 600.
    assert_eq!(
        totals,
        LedgerTotals {
            grant: 4_000,
            spent: 950,
            held: 1_400
        }
    );
}

/// A record of a table another crate defines, as the service defines its
/// admission queue's.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Queued {
    run: RunId,
    order: u64,
    epoch: u64,
}

static QUEUE: arbor_storage::Table<Queued> = arbor_storage::Table::bincode(
    arbor_storage::SUBMISSIONS_TABLE,
    |q| q.run.0.as_bytes().to_vec(),
    |q| q.epoch,
);

/// Every record a run leaves, of every kind: its submission, a step and a
/// job under it, their accounts, a delegation, a steering message, a sandbox
/// and events.
fn whole_run(run: RunId, first_seq: u64) -> Vec<Record> {
    let (step, child) = (JobId::new(), JobId::new());
    let child_record = JobRecord {
        parent: ParentRef::Job(step),
        kind: NodeKind::Job,
        depth: 1,
        ..job_record(run, child)
    };
    let mut records = vec![
        Record::Row(
            QUEUE
                .row(&Queued {
                    run,
                    order: first_seq,
                    epoch: 1,
                })
                .unwrap(),
        ),
        Record::Run(run_record(run, Status::Done)),
        Record::Job(job_record(run, step)),
        Record::Job(child_record),
        Record::Delegation(DelegationRecord {
            parent: step,
            key: "call-1".into(),
            digest: "sha256:abc".into(),
            children: vec![child],
            epoch: 1,
        }),
        Record::Steer(SteerRecord {
            job: child,
            message_id: 1,
            text: "hurry".into(),
            state: SteerState::Delivered,
            epoch: 1,
        }),
        Record::Sandbox(SandboxRecord {
            run,
            job: child,
            pgid: 4_242,
            start_ticks: 1,
            boot_id: "boot".into(),
            state: SandboxState::Ended,
            epoch: 1,
        }),
    ];
    for owner in [
        ParentRef::Run(run),
        ParentRef::Job(step),
        ParentRef::Job(child),
    ] {
        records.push(Record::Ledger(ledger(owner, LedgerOp::Open { grant: 100 })));
        records.push(Record::Ledger(ledger(owner, LedgerOp::Close { spent: 0 })));
    }
    for seq in first_seq..first_seq + 3 {
        records.push(Record::Event(event(
            run,
            seq,
            EventKind::RunResumed { epoch: 1, group: 0 },
        )));
    }
    records
}

/// What `forget` must leave of `run`: nothing, by any read.
fn assert_forgotten(journal: &Journal, run: RunId, jobs: &[JobId]) {
    assert_eq!(journal.run(run).unwrap(), None);
    assert_eq!(journal.read_one(&QUEUE, run.0.as_bytes()).unwrap(), None);
    assert!(journal.jobs(run).unwrap().is_empty());
    assert!(journal.events(run).unwrap().is_empty());
    assert!(journal.ledger(ParentRef::Run(run)).unwrap().is_empty());
    for &job in jobs {
        assert!(journal.ledger(ParentRef::Job(job)).unwrap().is_empty());
        assert!(journal.delegations(job).unwrap().is_empty());
        assert!(journal.steering(job).unwrap().is_empty());
        assert!(journal.sandboxes(job).unwrap().is_empty());
    }
}

on_both!(forgetting_a_run_removes_every_record_of_it_and_nothing_else);
/// Retention's removal: one run's records go, every one of them, and no
/// other run's; a removal left to the log at a close is replayed by the next
/// open, after the writes it removes.
async fn forgetting_a_run_removes_every_record_of_it_and_nothing_else(store: Store) {
    let journal = store.open();
    // sled takes appends only when drained: `forget` drains, then its
    // removal is left to the log at the close.
    journal.leave_unapplied_at_close();
    let (gone, kept) = (RunId::new(), RunId::new());
    journal.commit(whole_run(gone, 1)).await.unwrap();
    journal.commit(whole_run(kept, 10)).await.unwrap();
    let per_run = whole_run(kept, 10).len() as u64;
    assert_eq!(journal.scan().unwrap().records, 2 * per_run);
    let gone_jobs: Vec<JobId> = journal.jobs(gone).unwrap().iter().map(|j| j.id).collect();
    let kept_before = (
        journal.run(kept).unwrap(),
        journal.jobs(kept).unwrap(),
        journal.events(kept).unwrap(),
        journal.read_one(&QUEUE, kept.0.as_bytes()).unwrap(),
    );

    let seq = journal.forget(&[gone]).unwrap();
    journal.flush().await.unwrap();
    assert!(journal.durable_seq() >= seq);
    drop(journal);

    let reopened = store.open();
    assert_forgotten(&reopened, gone, &gone_jobs);
    let kept_after = (
        reopened.run(kept).unwrap(),
        reopened.jobs(kept).unwrap(),
        reopened.events(kept).unwrap(),
        reopened.read_one(&QUEUE, kept.0.as_bytes()).unwrap(),
    );
    assert_eq!(kept_after, kept_before);
    // Nothing of `gone` is left anywhere, and `kept` still balances.
    assert_eq!(reopened.scan().unwrap().records, per_run);
    let report = reopened.verify().unwrap();
    assert!(report.is_clean(), "{report:?}");

    // Forgetting again, or a run never seen, removes nothing more.
    reopened.forget(&[gone, RunId::new()]).unwrap();
    assert_eq!(reopened.scan().unwrap().records, per_run);
}
