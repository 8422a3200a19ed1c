//! A journal that looks like a crashed node's, written straight into
//! `Journal::append`, and the two ways to read one back: the boot path
//! (`Journal::open` and `recovery::recover`) and a bare sled scan.
//!
//! The journal holds many finished runs and some interrupted ones, the
//! newest, as a crash leaves them. A finished run has one step that
//! delegates `CHILDREN_PER_RUN` children in one call; the step takes three
//! model turns and each child one. A run carries its run, job and
//! delegation records (running, then done), every ledger entry (`Open`,
//! `Hold`, `CallReserve`, `CallSettle`, `Release`, `Close`) and its events.
//! An interrupted run stops partway: the run and its step running; of the
//! step's children one done, half running with a model call reserved and
//! not settled, the rest pending; and one hold for a child that never got a
//! record. So each interrupted run leaves `OPEN_JOBS_PER_INTERRUPTED_RUN`
//! steps and jobs for recovery to fail.
//!
//! ```no_run
//! # async fn demo() {
//! use arbor_tests::synthetic;
//! let built = synthetic::build_journal(100_000, 256).await;
//! let copy = tempfile::tempdir().unwrap();
//! synthetic::copy_dir(&built.journal(), copy.path());
//! let boot = synthetic::boot(copy.path()).await;
//! assert_eq!(boot.report.jobs_failed.len(), 256);
//! # }
//! ```
//!
//! Invariants:
//! 1. Every record is stamped with the epoch of the journal it is written
//!    into, and every event seq stays below the journal's seq, as the event
//!    bus's does.
//! 2. `Built::records` is what `Journal::scan` counts, checked at build.
//! 3. The interrupted runs are the newest, and recovery of a built journal
//!    is clean: no breach, nothing undecodable.

use arbor_actors::EventBus;
use arbor_protocol::{
    Event, EventKind, JobId, NodeKind, ParentRef, ResultEnvelope, RunId, RunSpec, Status,
    TaskStatus,
};
use arbor_runtime::{RecoveryReport, recovery};
use arbor_storage::{
    DelegationRecord, JobRecord, Journal, LedgerOp, LedgerRecord, Record, RunRecord, open_db,
};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Records handed to one `Journal::append` while a journal is built.
const BUILD_BATCH: usize = 20_000;

/// The agent every synthetic run's one step runs.
const STEP_AGENT: &str = "planner";

/// A synthetic run's grant, the step's (all of it) and each child's.
const RUN_GRANT: u64 = 1_000_000;
const CHILD_GRANT: u64 = 50_000;

/// What one synthetic model call holds, and what it then spends.
const CALL_RESERVED: u64 = 4_096;
const CALL_SPENT: u64 = 300;

/// Children a synthetic run's step delegates, in one call.
pub const CHILDREN_PER_RUN: usize = 8;

/// Steps and jobs an interrupted run leaves open (pending or running): its
/// step and every child but the one that finished.
pub const OPEN_JOBS_PER_INTERRUPTED_RUN: usize = CHILDREN_PER_RUN;

/// A journal built to look like a crashed node's, closed.
pub struct Built {
    pub dir: tempfile::TempDir,
    /// Records asked for, and found by `Journal::scan`.
    pub target: u64,
    pub records: u64,
    /// Records appended, states rewritten (running, then done) included.
    pub written: u64,
    pub runs_finished: usize,
    pub runs_interrupted: usize,
    /// Steps and jobs left pending or running: what recovery must fail.
    pub open_jobs: usize,
    /// Steps and jobs.
    pub jobs: usize,
    pub bytes: u64,
    pub build: Duration,
}

impl Built {
    /// The journal's directory (sled's).
    pub fn journal(&self) -> PathBuf {
        self.dir.path().join("journal")
    }
}

/// The baseline: sled opens the directory, and every entry of every tree
/// (sled's default tree included) is read, key and value; nothing decoded.
/// Then sled is closed and opened again, with the snapshot its first open
/// wrote. sled holds events and ledger entries in chunks (`docs/journal.md`,
/// "Chunks"), so it has fewer entries than the journal has records; `Scan`
/// says how many it read.
pub fn plain_scan(dir: &Path) -> Scan {
    let start = Instant::now();
    let db = open_db(dir).expect("sled opens the copy");
    let opened = start.elapsed();
    let start = Instant::now();
    let (mut entries, mut bytes) = (0u64, 0u64);
    for name in db.tree_names() {
        let tree = db.open_tree(&name).expect("a tree sled listed");
        for entry in tree.iter() {
            let (key, value) = entry.expect("sled reads its own entry");
            entries += 1;
            bytes += (key.len() + value.len()) as u64;
        }
    }
    let walked = start.elapsed();
    std::hint::black_box(bytes);
    drop(db);
    wait_until_released(dir);
    let start = Instant::now();
    let db = open_db(dir).expect("sled opens the copy again");
    let reopened = start.elapsed();
    drop(db);
    Scan {
        entries,
        open: opened,
        walk: walked,
        reopen: reopened,
    }
}

/// One timed plain scan.
#[derive(Clone, Copy, Debug)]
pub struct Scan {
    /// sled entries read, in every tree.
    pub entries: u64,
    /// `open_db` on the directory.
    pub open: Duration,
    /// Every entry of every tree read.
    pub walk: Duration,
    /// sled opened again after the walk closed it.
    pub reopen: Duration,
}

impl Scan {
    /// What the baseline is: the open and the walk.
    pub fn total(&self) -> Duration {
        self.open + self.walk
    }
}

/// The boot path of `EmbeddedNode::start_resuming`, up to where actors
/// would spawn: `Journal::open`, then `recovery::recover`, each timed.
pub async fn boot(dir: &Path) -> Boot {
    let start = Instant::now();
    let journal = Journal::open(dir).expect("the journal opens the copy");
    let open = start.elapsed();
    let start = Instant::now();
    let events = EventBus::new(journal.clone());
    let report = recovery::recover(
        &journal,
        &events,
        arbor_protocol::Limits::default().max_recoveries,
    )
    .await
    .expect("recovery runs");
    let recover = start.elapsed();
    assert!(
        report.breaches.is_empty() && report.undecodable.is_empty(),
        "recovery of the synthetic journal was not clean: {:?} {:?}",
        report.breaches,
        report.undecodable
    );
    Boot {
        open,
        recover,
        report,
        journal,
    }
}

/// One timed boot, and the journal it left open.
pub struct Boot {
    pub open: Duration,
    pub recover: Duration,
    pub report: RecoveryReport,
    /// Still open: drop it and `wait_until_released` before the directory goes.
    pub journal: Journal,
}

impl Boot {
    /// What a node waits for before it can take work: the open and the recovery.
    pub fn total(&self) -> Duration {
        self.open + self.recover
    }
}

/// Builds a journal of about `target` records: finished runs, then
/// interrupted runs cut short by a crash (the newest, as in a real crash),
/// enough of them to leave at least `open_jobs` steps and jobs open
/// (`OPEN_JOBS_PER_INTERRUPTED_RUN` a run). Its directory is on the
/// temporary filesystem (`TMPDIR`).
pub async fn build_journal(target: u64, open_jobs: usize) -> Built {
    let interrupted = open_jobs.div_ceil(OPEN_JOBS_PER_INTERRUPTED_RUN);
    let start = Instant::now();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    let mut writer = Writer::new(&journal);
    let interrupted_records = interrupted as u64 * Mix::interrupted_run_records();
    let mut runs_finished = 0;
    while writer.stored + interrupted_records < target {
        writer.run(RunEnd::Finished);
        runs_finished += 1;
    }
    for _ in 0..interrupted {
        writer.run(RunEnd::Crashed);
    }
    writer.append_batch();
    journal.flush().await.expect("the built journal flushes");
    let records = journal.scan().expect("the built journal scans").records;
    assert_eq!(
        records, writer.stored,
        "the template's count of stored records"
    );
    let (written, jobs) = (writer.written, writer.jobs);
    drop(journal);
    let path = dir.path().join("journal");
    wait_until_released(&path);
    Built {
        target,
        records,
        written,
        runs_finished,
        runs_interrupted: interrupted,
        open_jobs: interrupted * OPEN_JOBS_PER_INTERRUPTED_RUN,
        jobs,
        bytes: dir_bytes(&path),
        build: start.elapsed(),
        dir,
    }
}

/// How a synthetic run ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RunEnd {
    Finished,
    /// Cut short by a crash: the run and its step running; of its children,
    /// one done, half running with a model call reserved and not settled,
    /// the rest pending; and one hold for a child that never got a record.
    Crashed,
}

/// Writes synthetic runs in big appends, all stamped with this boot's epoch.
struct Writer<'a> {
    journal: &'a Journal,
    epoch: u64,
    batch: Vec<Record>,
    /// Node-wide event seq; it stays below the journal seq, as the event
    /// bus's does (it starts each boot at the journal's applied seq).
    event_seq: u64,
    written: u64,
    /// Distinct keys written: what `scan` will count.
    stored: u64,
    jobs: usize,
}

impl<'a> Writer<'a> {
    fn new(journal: &'a Journal) -> Self {
        Self {
            journal,
            epoch: journal.epoch(),
            batch: Vec::with_capacity(BUILD_BATCH),
            event_seq: journal.applied_seq(),
            written: 0,
            stored: 0,
            jobs: 0,
        }
    }

    /// A record under a key not written before.
    fn push(&mut self, record: Record) {
        self.stored += 1;
        self.rewrite(record);
    }

    /// A record that replaces one already written (a state's next value).
    fn rewrite(&mut self, record: Record) {
        self.written += 1;
        self.batch.push(record);
        if self.batch.len() >= BUILD_BATCH {
            self.append_batch();
        }
    }

    fn append_batch(&mut self) {
        let batch = std::mem::take(&mut self.batch);
        self.journal.append(batch).expect("the build appends");
    }

    fn event(&mut self, run: RunId, kind: EventKind) {
        self.event_seq += 1;
        self.push(Record::Event(Event {
            seq: self.event_seq,
            run,
            at_ms: 1_750_000_000_000 + self.event_seq,
            kind,
        }));
    }

    fn ledger(&mut self, owner: ParentRef, op: LedgerOp) {
        self.push(Record::Ledger(LedgerRecord {
            owner,
            unit: arbor_storage::Unit::Tokens,
            op,
            epoch: self.epoch,
        }));
    }

    fn run_record(&self, id: RunId, status: Status) -> Record {
        Record::Run(RunRecord {
            id,
            flow: format!("agent:{STEP_AGENT}"),
            budget_tokens: RUN_GRANT,
            status,
            error_class: None,
            reason: None,
            output_json: if status == Status::Done {
                r#""done""#.into()
            } else {
                "null".into()
            },
            epoch: self.epoch,
        })
    }

    fn job_record(
        &self,
        run: RunId,
        id: JobId,
        parent: ParentRef,
        status: Status,
        tokens_spent: u64,
    ) -> Record {
        let who = Who::of(run, id, parent);
        Record::Job(JobRecord {
            id,
            run,
            parent,
            kind: who.kind,
            agent: who.agent.into(),
            label: who.label,
            depth: who.depth,
            attempt: 1,
            grant_tokens: who.grant,
            workdir: who.workdir,
            status,
            task_status: (status == Status::Done).then_some(TaskStatus::Completed),
            error_class: None,
            reason: None,
            output_json: if status == Status::Done {
                r#""ok""#.into()
            } else {
                "null".into()
            },
            tokens_spent,
            epoch: self.epoch,
        })
    }

    /// One model call of `id`: its hold, its charge, and their events.
    fn model_call(&mut self, run: RunId, id: JobId, turn: u32) {
        let owner = ParentRef::Job(id);
        self.ledger(
            owner,
            LedgerOp::CallReserve {
                amount: CALL_RESERVED,
            },
        );
        self.ledger(
            owner,
            LedgerOp::CallSettle {
                reserved: CALL_RESERVED,
                spent: CALL_SPENT,
            },
        );
        self.event(
            run,
            EventKind::ModelCalled {
                id,
                turn,
                reserved: CALL_RESERVED,
                input_tokens: CALL_SPENT - 40,
                output_tokens: 40,
                truncated: false,
                wind_down: false,
                call: Default::default(),
            },
        );
    }

    fn tool_called(&mut self, run: RunId, id: JobId, turn: u32, tool: &str) {
        self.event(
            run,
            EventKind::ToolCalled {
                id,
                turn,
                tool: tool.into(),
                call: String::new(),
                ok: true,
                detail: format!("{tool}: ok"),
                latency_ms: 0,
                repeat: 1,
                digest: String::new(),
            },
        );
    }

    fn account_changed(&mut self, run: RunId, owner: ParentRef, grant: u64, spent: u64) {
        self.event(
            run,
            EventKind::AccountChanged {
                usd: None,
                owner,
                grant,
                spent,
                held: 0,
            },
        );
    }

    fn spawned(&mut self, run: RunId, id: JobId, parent: ParentRef) {
        let who = Who::of(run, id, parent);
        self.event(
            run,
            EventKind::JobSpawned {
                grant_usd_micros: None,
                id,
                parent,
                kind: who.kind,
                agent: who.agent.into(),
                label: who.label,
                depth: who.depth,
                attempt: 1,
                grant_tokens: who.grant,
                workdir: who.workdir,
                record_seq: self.written,
                request: "go".into(),
                call: None,
                model: "scripted".into(),
            },
        );
    }

    fn finished(&mut self, run: RunId, id: JobId, turns: u32, spent: u64) {
        self.event(
            run,
            EventKind::job_finished(
                ResultEnvelope {
                    task_status: Some(TaskStatus::Completed),
                    output: serde_json::json!("ok"),
                    turns,
                    tokens_spent: spent,
                    ..ResultEnvelope::bare(id, "leaf", Status::Done)
                },
                None,
                false,
            ),
        );
    }

    /// One run in the order a node writes it: the run and its step start,
    /// the step delegates `CHILDREN_PER_RUN` children in one call, each child
    /// takes one model turn and submits, the step collects and submits.
    fn run(&mut self, end: RunEnd) {
        let (run, step) = (RunId::new(), JobId::new());
        let (run_account, step_account) = (ParentRef::Run(run), ParentRef::Job(step));
        let spec = RunSpec::single(STEP_AGENT, "go", RUN_GRANT);
        self.event(
            run,
            EventKind::RunStarted {
                budget_usd_micros: None,
                flow: spec.flow.clone(),
                budget_tokens: RUN_GRANT,
                spec: Box::new(spec),
            },
        );
        self.push(self.run_record(run, Status::Running));
        self.ledger(run_account, LedgerOp::Open { grant: RUN_GRANT });
        self.ledger(
            run_account,
            LedgerOp::Hold {
                child: step,
                amount: RUN_GRANT,
            },
        );
        self.push(self.job_record(run, step, run_account, Status::Running, 0));
        self.jobs += 1;
        self.spawned(run, step, run_account);
        self.ledger(step_account, LedgerOp::Open { grant: RUN_GRANT });
        self.event(run, EventKind::JobRunning { id: step });

        // Turn 1: the delegate call. Holds first, then the records, durable
        // before any child starts (I-29).
        self.model_call(run, step, 1);
        let children: Vec<JobId> = (0..CHILDREN_PER_RUN).map(|_| JobId::new()).collect();
        for &child in &children {
            self.ledger(
                step_account,
                LedgerOp::Hold {
                    child,
                    amount: CHILD_GRANT,
                },
            );
            self.push(self.job_record(run, child, step_account, Status::Pending, 0));
            self.jobs += 1;
        }
        self.push(Record::Delegation(DelegationRecord {
            parent: step,
            key: format!("{step}:call-1"),
            digest: format!("{:064x}", self.written),
            children: children.clone(),
            epoch: self.epoch,
        }));
        let mut step_spent = CALL_SPENT;
        for (n, &child) in children.iter().enumerate() {
            self.spawned(run, child, step_account);
            let crashed = end == RunEnd::Crashed;
            // A crash leaves the first child done, half of them running and
            // the rest pending.
            if crashed && n > CHILDREN_PER_RUN / 2 {
                continue;
            }
            let child_account = ParentRef::Job(child);
            self.ledger(child_account, LedgerOp::Open { grant: CHILD_GRANT });
            self.rewrite(self.job_record(run, child, step_account, Status::Running, 0));
            self.event(run, EventKind::JobRunning { id: child });
            if crashed && n > 0 {
                self.ledger(
                    child_account,
                    LedgerOp::CallReserve {
                        amount: CALL_RESERVED,
                    },
                );
                continue;
            }
            self.model_call(run, child, 1);
            self.account_changed(run, child_account, CHILD_GRANT, CALL_SPENT);
            self.tool_called(run, child, 1, "submit_output");
            self.ledger(child_account, LedgerOp::Close { spent: CALL_SPENT });
            self.rewrite(self.job_record(run, child, step_account, Status::Done, CALL_SPENT));
            self.ledger(
                step_account,
                LedgerOp::Release {
                    child,
                    granted: CHILD_GRANT,
                    spent: CALL_SPENT,
                },
            );
            step_spent += CALL_SPENT;
            self.finished(run, child, 1, CALL_SPENT);
            self.account_changed(run, step_account, RUN_GRANT, step_spent);
        }
        self.tool_called(run, step, 1, "delegate");
        if end == RunEnd::Crashed {
            // A grant for a second delegation, held just before the crash:
            // its child never got a record.
            self.ledger(
                step_account,
                LedgerOp::Hold {
                    child: JobId::new(),
                    amount: CHILD_GRANT,
                },
            );
            return;
        }

        // Turns 2 and 3: collect, then submit.
        for (turn, tool) in [(2, "collect"), (3, "submit_output")] {
            self.model_call(run, step, turn);
            step_spent += CALL_SPENT;
            self.account_changed(run, step_account, RUN_GRANT, step_spent);
            self.tool_called(run, step, turn, tool);
        }
        self.ledger(step_account, LedgerOp::Close { spent: step_spent });
        self.rewrite(self.job_record(run, step, run_account, Status::Done, step_spent));
        self.ledger(
            run_account,
            LedgerOp::Release {
                child: step,
                granted: RUN_GRANT,
                spent: step_spent,
            },
        );
        self.ledger(run_account, LedgerOp::Close { spent: step_spent });
        self.finished(run, step, 3, step_spent);
        self.account_changed(run, run_account, RUN_GRANT, step_spent);
        self.rewrite(self.run_record(run, Status::Done));
        self.event(
            run,
            EventKind::RunFinished {
                limitations: Vec::new(),
                status: Status::Done,
                error_class: None,
                reason: None,
                output: serde_json::json!("done"),
            },
        );
    }
}

/// Records per tree, to set the synthetic runs beside a real node's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mix {
    pub records: u64,
    pub events: u64,
    /// Delegated jobs (steps not counted).
    pub jobs: u64,
}

impl Mix {
    pub fn per_job(&self) -> f64 {
        self.records as f64 / self.jobs as f64
    }

    pub fn events_share(&self) -> f64 {
        self.events as f64 / self.records as f64
    }

    /// What one finished synthetic run stores, counted by writing one into
    /// a throwaway journal.
    pub fn of_template() -> Mix {
        let (records, events) = Self::count(RunEnd::Finished);
        Mix {
            records,
            events,
            jobs: CHILDREN_PER_RUN as u64,
        }
    }

    fn interrupted_run_records() -> u64 {
        Self::count(RunEnd::Crashed).0
    }

    /// (stored records, events) of one synthetic run.
    fn count(end: RunEnd) -> (u64, u64) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let journal = Journal::open(dir.path()).expect("the journal opens");
        // Written into the batch only: nothing is appended.
        let mut writer = Writer::new(&journal);
        writer.run(end);
        let events = writer
            .batch
            .iter()
            .filter(|r| matches!(r, Record::Event(_)))
            .count() as u64;
        let stored = writer.stored;
        drop(journal);
        wait_until_released(dir.path());
        (stored, events)
    }
}

// ---- files -------------------------------------------------------------------

/// Waits until no sled instance in this process holds `dir` any more. sled
/// locks its `db` file (`flock`) while any of its threads has it open, and
/// its threads outlive the last handle for a moment; a copy or a delete
/// before then could see a half-written file.
pub fn wait_until_released(dir: &Path) {
    use nix::fcntl::{Flock, FlockArg};
    let file = File::open(dir.join("db")).expect("sled's db file");
    let locked = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| errno);
    locked.expect("flock");
    // Dropping the lock (and the file) releases it.
}

/// Copies a directory tree (a journal) file by file.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("a directory to copy into");
    for entry in std::fs::read_dir(from).expect("the directory to copy") {
        let entry = entry.expect("a directory entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("a file copy");
        }
    }
}

/// Bytes of every file below `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("a directory")
        .map(|entry| {
            let entry = entry.expect("a directory entry");
            let meta = entry.metadata().expect("its metadata");
            if meta.is_dir() {
                dir_bytes(&entry.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// What a synthetic step or job is, from who its parent is: a step under
/// the run, a leaf job under a step. Its record and its spawn event agree.
struct Who {
    kind: NodeKind,
    agent: &'static str,
    label: Option<String>,
    depth: u32,
    grant: u64,
    workdir: String,
}

impl Who {
    fn of(run: RunId, id: JobId, parent: ParentRef) -> Who {
        let step = matches!(parent, ParentRef::Run(_));
        let agent = if step { STEP_AGENT } else { "leaf" };
        Who {
            kind: if step { NodeKind::Step } else { NodeKind::Job },
            agent,
            label: step.then(|| STEP_AGENT.to_string()),
            depth: if step { 0 } else { 1 },
            grant: if step { RUN_GRANT } else { CHILD_GRANT },
            workdir: format!("work/{run}/{agent}/{id}"),
        }
    }
}
