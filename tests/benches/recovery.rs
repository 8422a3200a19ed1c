//! Recovery time by journal size beside a plain sled scan, and durable
//! commits per second beside the machine's raw fsync rate, in one run.
//!
//! 1. Recovery by journal size. A journal that looks like a crashed node's
//!    (many finished runs, and some interrupted ones with steps and jobs still
//!    pending or running, open holds and call reservations, and one hold for a
//!    child that never got a record) is built with `Journal::append` in big
//!    batches, at each size; the interrupted runs are as many at every size,
//!    since what a crash leaves depends on what was in flight, not on how
//!    long the node had run. Each repetition then copies it twice (not timed)
//!    and times, each on its own copy, the two ways to read it back:
//!    - the boot path: `Journal::open` and `recovery::recover`, as
//!      `EmbeddedNode::start_resuming` does before anything spawns;
//!    - the baseline: `open_db` on the directory and a walk of every tree
//!      reading every key and value, and nothing else; then sled is closed
//!      and opened once more, to show what replaying its log costs.
//!
//!    Two copies, because sled writes a snapshot while it opens a db: whoever
//!    opened a copy first would leave the other an up-to-date snapshot and
//!    less log to replay. A node that crashed after a long life has its whole
//!    life in the log since its last boot, and so does a fresh copy.
//! 2. Durable commit rate, each beside the machine's raw fsync rate: a loop of
//!    a 64-byte write and `fdatasync` to a file in a temporary directory, on
//!    the filesystem every journal here uses. Beside it: one journal commit
//!    at a time; one append at a time with no flush (what a commit pays
//!    before its flush); K concurrent committers sharing flushes (group
//!    commit); and delegated jobs per second through a real node (a parent
//!    fans out batches of 16 children with wait = false and collects each;
//!    the children submit at once). The series run in rounds, one of each
//!    per round, and each ratio is taken within a round: a flush's cost
//!    follows whatever else the machine is writing, and figures taken
//!    moments apart share it.
//!
//! Every journal lives in a fresh temporary directory (`TMPDIR` moves it).
//! The page cache is warm throughout: nothing here drops it, so the recovery
//! figures are CPU and sled, not the device's read speed.
//!
//! ```text
//! cargo bench -p arbor-tests --bench recovery             # ~1 min on 2 cores
//! cargo bench -p arbor-tests --bench recovery -- --quick  # a smoke run, a few s
//! ```
//!
//! Without `--bench` on its command line (`cargo test --all-targets`) it
//! does the smoke run.
//!
//! The last line printed is `summary {json}` for machines.

use arbor_actors::EventBus;
use arbor_protocol::{
    Event, EventKind, JobId, NodeKind, ParentRef, RunId, RunSpec, Status, TaskStatus,
};
use arbor_runtime::recovery;
use arbor_storage::{
    DelegationRecord, JobRecord, Journal, LedgerOp, LedgerRecord, Record, RunRecord, open_db,
};
use arbor_testkit::{TestNode, agent_md};
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

// Each bench binary uses part of it.
#[allow(dead_code)]
#[path = "support/shared.rs"]
mod shared;
use shared::Cpu;

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
const CHILDREN_PER_RUN: usize = 8;

/// The default `limits.fan_out`: children in one delegate call.
const FAN_OUT: usize = 16;

/// A budget no fan-out run comes near; budgets are not what is measured.
const BUDGET_TOKENS: u64 = 1_000_000_000;

/// The small write of the raw fsync loop, in bytes.
const FSYNC_WRITE: usize = 64;

/// How many of everything to do.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    /// Records in each journal built (about: whole runs are written).
    journals: &'static [u64],
    /// Interrupted runs in each journal, whatever its size: what a crash
    /// leaves depends on how much was in flight, not on history.
    interrupted_runs: usize,
    /// Timed boots (and scans) of each journal, each on a fresh copy.
    repeats: usize,
    /// Rounds of part 2: each round measures every series once.
    rounds: usize,
    /// Per round: raw write + fdatasync iterations, per variant.
    fsyncs: usize,
    /// Per round: one-at-a-time journal commits.
    sequential_commits: usize,
    /// Per round and per committer count: commits, split evenly between
    /// the committers.
    group_commits: usize,
    committers: &'static [usize],
    /// Per round: one fan-out run of this many batches of `FAN_OUT`.
    fan_out_batches: usize,
}

impl Sizes {
    const DEFAULT: Sizes = Sizes {
        journals: &[10_000, 100_000, 1_000_000],
        interrupted_runs: 32,
        repeats: 3,
        rounds: 5,
        fsyncs: 400,
        sequential_commits: 400,
        group_commits: 1_024,
        committers: &[4, 16, 64, 256],
        fan_out_batches: 16,
    };

    const QUICK: Sizes = Sizes {
        journals: &[1_000, 10_000],
        interrupted_runs: 4,
        repeats: 1,
        rounds: 1,
        fsyncs: 50,
        sequential_commits: 50,
        group_commits: 256,
        committers: &[64],
        fan_out_batches: 2,
    };
}

fn main() {
    let quick = shared::quick();
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let (runtime, workers) = shared::runtime();
    runtime.block_on(run(sizes, quick, workers));
}

async fn run(sizes: Sizes, quick: bool, workers: usize) {
    println!(
        "arbor recovery and durability benchmark ({}, tokio multi-thread, {workers} workers)",
        if quick { "--quick" } else { "default sizes" }
    );
    let started = Instant::now();

    let mut boots = Vec::new();
    for &records in sizes.journals {
        boots.push(recovery_by_size(records, sizes.interrupted_runs, sizes.repeats).await);
    }
    let durable = durable_rounds(&sizes).await;

    println!();
    println!(
        "{:<8} {:>9} {:>9} {:>6} {:>6} {:>8} {:>8} {:>8}",
        "journal", "records", "written", "runs", "intr.", "jobs", "MiB", "build s"
    );
    for boot in &boots {
        let built = &boot.built;
        println!(
            "{:<8} {:>9} {:>9} {:>6} {:>6} {:>8} {:>8.1} {:>8.2}",
            size_name(built.target),
            built.records,
            built.written,
            built.runs_finished + built.runs_interrupted,
            built.runs_interrupted,
            built.jobs,
            built.bytes as f64 / (1024.0 * 1024.0),
            built.build.as_secs_f64(),
        );
    }
    println!(
        "(records: Journal::scan().records; written: records appended, states rewritten included; jobs: steps and jobs)"
    );
    println!();
    println!(
        "{:<8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "ms", "sled open", "walk", "scan", "reopen", "J::open", "recover", "boot", "boot/scan"
    );
    for boot in &boots {
        let m = boot.medians();
        println!(
            "{:<8} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2}x",
            size_name(boot.built.target),
            ms(m.sled_open),
            ms(m.sled_walk),
            ms(m.sled_open + m.sled_walk),
            ms(m.sled_reopen),
            ms(m.journal_open),
            ms(m.recover),
            ms(m.journal_open + m.recover),
            m.boot_over_scan(),
        );
    }
    println!(
        "(median of {} per size, each column on its own; scan = sled open + walk; boot = Journal::open + recover, each on its own fresh copy; reopen: sled opened again after the scan)",
        sizes.repeats
    );
    println!();
    println!(
        "{:<8} {:>9} {:>9} {:>9}",
        "ms", "recover", "J::scan", "J::verify"
    );
    for boot in &boots {
        let m = boot.medians();
        println!(
            "{:<8} {:>9.1} {:>9.1} {:>9.1}",
            size_name(boot.built.target),
            ms(m.recover),
            ms(m.scan_again),
            ms(m.verify_again),
        );
    }
    println!(
        "(recover makes both passes, scan first, verify last; here each is timed again after it, on the same open journal)"
    );
    for boot in &boots {
        let r = &boot.recovered;
        println!(
            "{}: recovery failed {} steps and jobs, released {} grants, left {} runs to resume; boot/scan each time: {}",
            size_name(boot.built.target),
            r.jobs_failed,
            r.grants_released,
            r.runs_to_resume,
            boot.ratios()
                .iter()
                .map(|x| format!("{x:.2}x"))
                .collect::<Vec<_>>()
                .join(" "),
        );
    }

    let DurableReport { series, mix } = &durable;
    let reference = &series[0];
    println!();
    println!(
        "{:<44} {:>7} {:>9} {:>13} {:>8} {:>8} {:>9} {:>8}",
        format!("durable operations ({} rounds)", sizes.rounds),
        "n/round",
        "median/s",
        "range/s",
        "flush/op",
        "sync/op",
        "cpu µs/op",
        "x fsync"
    );
    for s in series {
        let per_op = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
        let rates = s.rates();
        let (low, high) = (
            rates.iter().copied().fold(f64::INFINITY, f64::min),
            rates.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "{:<44} {:>7} {:>9.0} {:>13} {:>8} {:>8} {:>9.1} {:>7.2}x",
            s.name,
            s.rounds[0].ops,
            median(&rates),
            format!("{low:.0}-{high:.0}"),
            per_op(s.per_op(|d| d.flushes)),
            per_op(s.per_op(|d| d.syncs)),
            s.cpu_per_op_us(),
            median(&s.ratios(reference)),
        );
    }
    println!(
        "(x fsync: the median over rounds of the series' rate over the raw append + fdatasync rate of the same round)"
    );
    let delegated = series.last().expect("the delegation series");
    let syncs_per_job = delegated
        .per_op(|d| d.syncs)
        .expect("a node's journal counts its syncs");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fsync_ceiling = median(&reference.rates()) / syncs_per_job;
    let cpu_ceiling = cores as f64 * 1e6 / delegated.cpu_per_op_us();
    println!(
        "delegated jobs: {:.0}/s measured; {syncs_per_job:.2} journal fdatasyncs a job, so the raw fsync rate alone would allow {fsync_ceiling:.0}/s; {:.0} µs of CPU a job on {cores} cores would allow {cpu_ceiling:.0}/s",
        median(&delegated.rates()),
        delegated.cpu_per_op_us(),
    );
    let synthetic = Mix::of_template();
    println!(
        "records per delegated job: the real fan-out journal {:.1} ({:.0}% events), the synthetic runs {:.1} ({:.0}% events)",
        mix.per_job(),
        mix.events_share() * 100.0,
        synthetic.per_job(),
        synthetic.events_share() * 100.0,
    );
    println!(
        "total benchmark time: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let summary = serde_json::json!({
        "quick": quick,
        "workers": workers,
        "recovery": boots.iter().map(BootReport::json).collect::<Vec<_>>(),
        "durable_rounds": sizes.rounds,
        "durable": series.iter().map(|s| s.json(reference)).collect::<Vec<_>>(),
        "delegated_syncs_per_job": round3(syncs_per_job),
        "delegated_ceiling_fsync_per_s": round(fsync_ceiling),
        "delegated_ceiling_cpu_per_s": round(cpu_ceiling),
        "cores": cores,
        "records_per_job": {
            "real": round(mix.per_job()),
            "synthetic": round(synthetic.per_job()),
        },
    });
    println!("summary {summary}");
}

// ---- 1. recovery by journal size ---------------------------------------------

/// A journal built to look like a crashed node's, closed.
struct Built {
    dir: tempfile::TempDir,
    /// Records asked for, and found by `Journal::scan`.
    target: u64,
    records: u64,
    /// Records appended, states rewritten (running, then done) included.
    written: u64,
    runs_finished: usize,
    runs_interrupted: usize,
    /// Steps and jobs.
    jobs: usize,
    bytes: u64,
    build: Duration,
}

impl Built {
    fn journal(&self) -> std::path::PathBuf {
        self.dir.path().join("journal")
    }
}

/// One repetition's times.
#[derive(Clone, Copy, Debug, Default)]
struct BootTimes {
    sled_open: Duration,
    sled_walk: Duration,
    sled_reopen: Duration,
    journal_open: Duration,
    recover: Duration,
    scan_again: Duration,
    verify_again: Duration,
}

impl BootTimes {
    fn boot_over_scan(&self) -> f64 {
        (self.journal_open + self.recover).as_secs_f64()
            / (self.sled_open + self.sled_walk).as_secs_f64()
    }
}

/// What the first recovery of a size found and did (every copy is the same).
#[derive(Clone, Copy, Debug, Default)]
struct Recovered {
    jobs_failed: usize,
    grants_released: u32,
    runs_to_resume: usize,
}

struct BootReport {
    built: Built,
    times: Vec<BootTimes>,
    recovered: Recovered,
}

impl BootReport {
    /// Each column's own median.
    fn medians(&self) -> BootTimes {
        let median = |pick: fn(&BootTimes) -> Duration| {
            let mut all: Vec<Duration> = self.times.iter().map(pick).collect();
            all.sort();
            all[all.len() / 2]
        };
        BootTimes {
            sled_open: median(|t| t.sled_open),
            sled_walk: median(|t| t.sled_walk),
            sled_reopen: median(|t| t.sled_reopen),
            journal_open: median(|t| t.journal_open),
            recover: median(|t| t.recover),
            scan_again: median(|t| t.scan_again),
            verify_again: median(|t| t.verify_again),
        }
    }

    fn ratios(&self) -> Vec<f64> {
        self.times.iter().map(BootTimes::boot_over_scan).collect()
    }

    fn json(&self) -> serde_json::Value {
        let m = self.medians();
        let all = |pick: fn(&BootTimes) -> Duration| -> Vec<f64> {
            self.times.iter().map(|t| round(ms(pick(t)))).collect()
        };
        serde_json::json!({
            "target": self.built.target,
            "records": self.built.records,
            "written": self.built.written,
            "runs_finished": self.built.runs_finished,
            "runs_interrupted": self.built.runs_interrupted,
            "jobs": self.built.jobs,
            "mib": round(self.built.bytes as f64 / (1024.0 * 1024.0)),
            "build_s": round(self.built.build.as_secs_f64()),
            "median_ms": {
                "sled_open": round(ms(m.sled_open)),
                "sled_walk": round(ms(m.sled_walk)),
                "sled_reopen": round(ms(m.sled_reopen)),
                "journal_open": round(ms(m.journal_open)),
                "recover": round(ms(m.recover)),
                "journal_scan_again": round(ms(m.scan_again)),
                "journal_verify_again": round(ms(m.verify_again)),
            },
            "scan_ms": self.times.iter().map(|t| round(ms(t.sled_open + t.sled_walk))).collect::<Vec<_>>(),
            "boot_ms": self.times.iter().map(|t| round(ms(t.journal_open + t.recover))).collect::<Vec<_>>(),
            "journal_open_ms": all(|t| t.journal_open),
            "recover_ms": all(|t| t.recover),
            "boot_over_scan": round(m.boot_over_scan()),
            "jobs_failed": self.recovered.jobs_failed,
            "grants_released": self.recovered.grants_released,
            "runs_to_resume": self.recovered.runs_to_resume,
        })
    }
}

async fn recovery_by_size(target: u64, interrupted_runs: usize, repeats: usize) -> BootReport {
    let built = build_journal(target, interrupted_runs).await;
    let mut times = Vec::with_capacity(repeats);
    let mut recovered = None;
    for repeat in 0..repeats {
        let scratch = tempfile::tempdir().expect("a temporary directory");
        let (for_scan, for_boot) = (scratch.path().join("scan"), scratch.path().join("boot"));
        copy_dir(&built.journal(), &for_scan);
        copy_dir(&built.journal(), &for_boot);
        // Alternate which goes first, so neither always runs straight after
        // the copies (or the other) and pays for what they left behind.
        let (scan, boot) = if repeat % 2 == 0 {
            let scan = plain_scan(&for_scan, built.records);
            (scan, boot_and_recover(&for_boot).await)
        } else {
            let boot = boot_and_recover(&for_boot).await;
            (plain_scan(&for_scan, built.records), boot)
        };
        wait_until_released(&for_scan);
        wait_until_released(&for_boot);
        let report = &boot.report;
        assert!(
            report.breaches.is_empty() && report.undecodable.is_empty(),
            "recovery of the synthetic journal was not clean: {:?} {:?}",
            report.breaches,
            report.undecodable
        );
        assert_eq!(
            report.runs.len(),
            built.runs_interrupted,
            "every interrupted run recovered"
        );
        recovered.get_or_insert(Recovered {
            jobs_failed: report.jobs_failed.len(),
            grants_released: report.grants_released,
            runs_to_resume: report
                .runs
                .iter()
                .filter(|r| matches!(r.outcome, arbor_runtime::RunOutcome::Resume { .. }))
                .count(),
        });
        times.push(BootTimes {
            sled_open: scan.0,
            sled_walk: scan.1,
            sled_reopen: scan.2,
            journal_open: boot.open,
            recover: boot.recover,
            scan_again: boot.scan_again,
            verify_again: boot.verify_again,
        });
    }
    BootReport {
        built,
        times,
        recovered: recovered.expect("at least one repetition"),
    }
}

/// The baseline: sled opens the directory, and every entry of every tree
/// (sled's default tree included) is read, key and value; nothing decoded.
/// Then sled is closed and opened again, with the snapshot its first open
/// wrote. Returns (open, walk, reopen).
fn plain_scan(dir: &Path, records: u64) -> (Duration, Duration, Duration) {
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
    // Every record, and the three meta entries (format, epoch, seq).
    assert_eq!(entries, records + 3, "the walk read every entry");
    drop(db);
    wait_until_released(dir);
    let start = Instant::now();
    let db = open_db(dir).expect("sled opens the copy again");
    let reopened = start.elapsed();
    drop(db);
    (opened, walked, reopened)
}

/// The boot path of `EmbeddedNode::start_resuming`, up to where actors
/// would spawn. Returns ((open, recover), what recovery reported).
async fn boot_and_recover(dir: &Path) -> Boot {
    let start = Instant::now();
    let journal = Journal::open(dir).expect("the journal opens the copy");
    let open = start.elapsed();
    let start = Instant::now();
    let events = EventBus::new(journal.clone());
    let report = recovery::recover(&journal, &events)
        .await
        .expect("recovery runs");
    let recover = start.elapsed();
    // Two passes recovery makes, timed again on their own: sled's cache
    // now holds what the first pass had to load.
    let start = Instant::now();
    std::hint::black_box(journal.scan().expect("the journal scans"));
    let scan_again = start.elapsed();
    let start = Instant::now();
    std::hint::black_box(journal.verify().expect("the journal verifies"));
    let verify_again = start.elapsed();
    Boot {
        open,
        recover,
        scan_again,
        verify_again,
        report,
    }
}

/// One timed boot.
struct Boot {
    open: Duration,
    recover: Duration,
    /// `Journal::scan` and `Journal::verify` after recovery, on the same handle.
    scan_again: Duration,
    verify_again: Duration,
    report: arbor_runtime::RecoveryReport,
}

/// Builds a journal of about `target` records: finished runs, then
/// `interrupted` runs cut short by a crash (the newest, as in a real crash).
async fn build_journal(target: u64, interrupted: usize) -> Built {
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
                tokens: CALL_RESERVED,
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
                ok: true,
                detail: format!("{tool}: ok"),
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
            EventKind::NodeSpawned {
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
            },
        );
    }

    fn finished(&mut self, run: RunId, id: JobId, turns: u32, spent: u64) {
        self.event(
            run,
            EventKind::NodeFinished {
                usd_micros_spent: 0,
                id,
                status: Status::Done,
                task_status: Some(TaskStatus::Completed),
                error_class: None,
                reason: None,
                propagated: false,
                output: serde_json::json!("ok"),
                error: None,
                limitations: vec![],
                artifacts: vec![],
                turns,
                tokens_spent: spent,
            },
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
                spec,
            },
        );
        self.push(self.run_record(run, Status::Running));
        self.ledger(run_account, LedgerOp::Open { grant: RUN_GRANT });
        self.ledger(
            run_account,
            LedgerOp::Hold {
                child: step,
                tokens: RUN_GRANT,
            },
        );
        self.push(self.job_record(run, step, run_account, Status::Running, 0));
        self.jobs += 1;
        self.spawned(run, step, run_account);
        self.ledger(step_account, LedgerOp::Open { grant: RUN_GRANT });
        self.event(run, EventKind::NodeRunning { id: step });

        // Turn 1: the delegate call. Holds first, then the records, durable
        // before any child starts (I-29).
        self.model_call(run, step, 1);
        let children: Vec<JobId> = (0..CHILDREN_PER_RUN).map(|_| JobId::new()).collect();
        for &child in &children {
            self.ledger(
                step_account,
                LedgerOp::Hold {
                    child,
                    tokens: CHILD_GRANT,
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
            self.event(run, EventKind::NodeRunning { id: child });
            if crashed && n > 0 {
                self.ledger(
                    child_account,
                    LedgerOp::CallReserve {
                        tokens: CALL_RESERVED,
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
                    tokens: CHILD_GRANT,
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
struct Mix {
    records: u64,
    events: u64,
    /// Delegated jobs (steps not counted).
    jobs: u64,
}

impl Mix {
    fn per_job(&self) -> f64 {
        self.records as f64 / self.jobs as f64
    }

    fn events_share(&self) -> f64 {
        self.events as f64 / self.records as f64
    }

    /// What one finished synthetic run stores, counted by writing one into
    /// a throwaway journal.
    fn of_template() -> Mix {
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

// ---- 2. durable commit rate --------------------------------------------------

/// A count of durable operations and how long they took.
struct Durable {
    ops: usize,
    wall: Duration,
    /// Process CPU time (user + system, every thread) over the operations.
    cpu: Duration,
    /// Journal flushes and fdatasyncs over the operations, where there is a journal.
    flushes: Option<u64>,
    syncs: Option<u64>,
}

impl Durable {
    fn per_second(&self) -> f64 {
        self.ops as f64 / self.wall.as_secs_f64()
    }
}

/// One series of part 2: one measurement a round.
struct Series {
    /// Its key in the summary.
    key: &'static str,
    name: String,
    rounds: Vec<Durable>,
}

impl Series {
    fn new(key: &'static str, name: String) -> Self {
        Self {
            key,
            name,
            rounds: vec![],
        }
    }

    fn rates(&self) -> Vec<f64> {
        self.rounds.iter().map(Durable::per_second).collect()
    }

    /// This series' rate over `reference`'s, round by round.
    fn ratios(&self, reference: &Series) -> Vec<f64> {
        self.rounds
            .iter()
            .zip(&reference.rounds)
            .map(|(d, r)| d.per_second() / r.per_second())
            .collect()
    }

    /// CPU per operation over every round, in microseconds.
    fn cpu_per_op_us(&self) -> f64 {
        let cpu: Duration = self.rounds.iter().map(|d| d.cpu).sum();
        let ops: usize = self.rounds.iter().map(|d| d.ops).sum();
        cpu.as_secs_f64() * 1e6 / ops as f64
    }

    /// Flushes (or syncs) per operation over every round.
    fn per_op(&self, pick: fn(&Durable) -> Option<u64>) -> Option<f64> {
        let counted: Option<u64> = self.rounds.iter().map(pick).sum();
        let ops: usize = self.rounds.iter().map(|d| d.ops).sum();
        counted.map(|n| n as f64 / ops as f64)
    }

    fn json(&self, reference: &Series) -> serde_json::Value {
        let rounded = |xs: Vec<f64>| xs.into_iter().map(round).collect::<Vec<_>>();
        serde_json::json!({
            "series": self.key,
            "n_per_round": self.rounds[0].ops,
            "per_s": rounded(self.rates()),
            "median_per_s": round(median(&self.rates())),
            "flushes_per_op": self.per_op(|d| d.flushes).map(round3),
            "syncs_per_op": self.per_op(|d| d.syncs).map(round3),
            "cpu_us_per_op": round(self.cpu_per_op_us()),
            "x_fsync": rounded(self.ratios(reference)),
            "median_x_fsync": round3(median(&self.ratios(reference))),
        })
    }
}

struct DurableReport {
    /// The raw append + fdatasync loop first: every ratio's reference.
    series: Vec<Series>,
    /// The fan-out node's journal afterwards, by tree.
    mix: Mix,
}

/// Every series of part 2, `rounds` times over, in the same order each round.
async fn durable_rounds(sizes: &Sizes) -> DurableReport {
    let mut fan_out = FanOutNode::start(sizes.fan_out_batches).await;
    let mut series = vec![
        Series::new(
            "raw_append_fdatasync",
            format!("raw: {FSYNC_WRITE} B append + fdatasync (reference)"),
        ),
        Series::new(
            "raw_overwrite_fdatasync",
            format!("raw: {FSYNC_WRITE} B overwrite + fdatasync"),
        ),
        Series::new(
            "journal_commit_sequential",
            "journal: one commit at a time".into(),
        ),
        Series::new(
            "journal_append_sequential",
            "journal: one append at a time, no flush".into(),
        ),
    ];
    for &committers in sizes.committers {
        series.push(Series::new(
            "journal_group_commit",
            format!("journal: {committers} concurrent committers"),
        ));
    }
    series.push(Series::new(
        "delegated_jobs",
        format!(
            "arbor: delegated jobs ({} x {FAN_OUT} a run)",
            sizes.fan_out_batches
        ),
    ));
    for _ in 0..sizes.rounds {
        let mut measured = vec![
            raw_fsyncs(sizes.fsyncs, RawWrite::Append),
            raw_fsyncs(sizes.fsyncs, RawWrite::Overwrite),
            sequential_commits(sizes.sequential_commits).await,
            sequential_appends(4 * sizes.sequential_commits),
        ];
        for &committers in sizes.committers {
            measured.push(group_commits(committers, sizes.group_commits / committers).await);
        }
        measured.push(fan_out.run().await);
        for (series, durable) in series.iter_mut().zip(measured) {
            series.rounds.push(durable);
        }
    }
    let mix = fan_out.crash_and_count().await;
    DurableReport { series, mix }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RawWrite {
    /// Each write at the end of the file: its size changes, as a log's does.
    Append,
    /// Each write over the first bytes: data only.
    Overwrite,
}

/// `fsyncs` small writes, each followed by `fdatasync`, to a file in a fresh
/// temporary directory (the filesystem every journal here lives on).
fn raw_fsyncs(fsyncs: usize, how: RawWrite) -> Durable {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut file = File::create(dir.path().join("raw")).expect("a file");
    let record = [0x5a_u8; FSYNC_WRITE];
    let once = |file: &mut File| {
        match how {
            RawWrite::Append => file.write_all(&record),
            RawWrite::Overwrite => file.write_all_at(&record, 0),
        }
        .expect("the write");
        file.sync_data().expect("fdatasync");
    };
    for _ in 0..(fsyncs / 10).max(10) {
        once(&mut file);
    }
    let (start, cpu) = (Instant::now(), cpu_now());
    for _ in 0..fsyncs {
        once(&mut file);
    }
    Durable {
        ops: fsyncs,
        wall: start.elapsed(),
        cpu: cpu_now() - cpu,
        flushes: None,
        syncs: None,
    }
}

fn ledger_record(journal: &Journal, owner: ParentRef) -> Record {
    Record::Ledger(LedgerRecord {
        owner,
        op: LedgerOp::CallReserve { tokens: 4_096 },
        epoch: journal.epoch(),
    })
}

/// One `Journal::commit` of one ledger record at a time, on a fresh journal
/// that does nothing else.
async fn sequential_commits(commits: usize) -> Durable {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    let owner = ParentRef::Job(JobId::new());
    for _ in 0..(commits / 10).max(10) {
        journal
            .commit(vec![ledger_record(&journal, owner)])
            .await
            .expect("the commit");
    }
    let (flushes, syncs) = (journal.flush_count(), journal.sync_count());
    let (start, cpu) = (Instant::now(), cpu_now());
    for _ in 0..commits {
        journal
            .commit(vec![ledger_record(&journal, owner)])
            .await
            .expect("the commit");
    }
    let wall = start.elapsed();
    let durable = Durable {
        ops: commits,
        wall,
        cpu: cpu_now() - cpu,
        flushes: Some(journal.flush_count() - flushes),
        syncs: Some(journal.sync_count() - syncs),
    };
    close(journal, &dir.path().join("journal"));
    durable
}

/// One `Journal::append` of one ledger record at a time, on a fresh journal,
/// waiting for no flush: not durable, but what every commit pays before its
/// flush, under the one lock that orders appends.
fn sequential_appends(appends: usize) -> Durable {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    let owner = ParentRef::Job(JobId::new());
    for _ in 0..(appends / 10).max(10) {
        journal
            .append(vec![ledger_record(&journal, owner)])
            .expect("the append");
    }
    let (flushes, syncs) = (journal.flush_count(), journal.sync_count());
    let (start, cpu) = (Instant::now(), cpu_now());
    for _ in 0..appends {
        journal
            .append(vec![ledger_record(&journal, owner)])
            .expect("the append");
    }
    let durable = Durable {
        ops: appends,
        wall: start.elapsed(),
        cpu: cpu_now() - cpu,
        flushes: Some(journal.flush_count() - flushes),
        syncs: Some(journal.sync_count() - syncs),
    };
    close(journal, &dir.path().join("journal"));
    durable
}

/// `committers` tokio tasks on one fresh journal, each committing one ledger
/// record at a time, `commits` times: commits in flight together share a
/// flush.
async fn group_commits(committers: usize, commits: usize) -> Durable {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    journal
        .commit(vec![ledger_record(&journal, ParentRef::Job(JobId::new()))])
        .await
        .expect("a warm-up commit");
    let (flushes, syncs) = (journal.flush_count(), journal.sync_count());
    let (start, cpu) = (Instant::now(), cpu_now());
    let tasks: Vec<_> = (0..committers)
        .map(|_| {
            let journal = journal.clone();
            let owner = ParentRef::Job(JobId::new());
            tokio::spawn(async move {
                for _ in 0..commits {
                    journal
                        .commit(vec![ledger_record(&journal, owner)])
                        .await
                        .expect("the commit");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a committer");
    }
    let wall = start.elapsed();
    let durable = Durable {
        ops: committers * commits,
        wall,
        cpu: cpu_now() - cpu,
        flushes: Some(journal.flush_count() - flushes),
        syncs: Some(journal.sync_count() - syncs),
    };
    close(journal, &dir.path().join("journal"));
    durable
}

/// Drops the last handle and waits until sled has let go of `dir`, so no
/// thread of it is still writing when the directory is deleted.
fn close(journal: Journal, dir: &Path) {
    drop(journal);
    wait_until_released(dir);
}

/// A real node (the harness: a sled journal in a temporary directory, real
/// actors, the scripted model) with a fan-out parent, warmed up.
struct FanOutNode {
    node: TestNode,
    batches: usize,
    /// Runs started, the warm-up's included, and the jobs they delegated.
    runs: u64,
    jobs: u64,
}

impl FanOutNode {
    async fn start(batches: usize) -> Self {
        let (parent, warmup) = (fan_out_parent(batches), fan_out_parent(1));
        let leaf = agent_md(
            "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
        );
        let node =
            TestNode::start(&[("parent", &parent), ("warmup", &warmup), ("leaf", &leaf)]).await;
        let mut node = Self {
            node,
            batches,
            runs: 0,
            jobs: 0,
        };
        node.run_to_end("warmup", 1).await;
        node
    }

    /// One measured run: delegated jobs over the run's wall time, from
    /// `start_run` to the tree showing the run finished.
    async fn run(&mut self) -> Durable {
        let journal = self.node.journal();
        let (flushes, syncs) = (journal.flush_count(), journal.sync_count());
        let cpu = cpu_now();
        let wall = self.run_to_end("parent", self.batches).await;
        let cpu = cpu_now() - cpu;
        let journal = self.node.journal();
        Durable {
            ops: self.batches * FAN_OUT,
            wall,
            cpu,
            flushes: Some(journal.flush_count() - flushes),
            syncs: Some(journal.sync_count() - syncs),
        }
    }

    async fn run_to_end(&mut self, agent: &str, batches: usize) -> Duration {
        let start = Instant::now();
        let run = self
            .node
            .run_agent_with_budget(agent, "go", Some(BUDGET_TOKENS))
            .await;
        let tree = self.node.wait_run(run).await;
        let wall = start.elapsed();
        assert_eq!(tree.run_status(), Status::Done, "run of {agent} succeeded");
        let done = self
            .node
            .jobs(run)
            .iter()
            .filter(|j| j.agent.as_deref() == Some("leaf") && j.status == Status::Done)
            .count();
        assert_eq!(done, batches * FAN_OUT, "every child finished done");
        self.runs += 1;
        self.jobs += done as u64;
        wall
    }

    /// Stops the node as a crash would and counts its journal's records by
    /// tree, through sled alone.
    async fn crash_and_count(self) -> Mix {
        let (runs, jobs) = (self.runs, self.jobs);
        let kept = self.node.crash().await;
        let dir = kept.path().join("data").join("journal");
        let db = open_db(&dir).expect("sled opens the node's journal");
        let count = |name: &str| db.open_tree(name).expect("a journal tree").len() as u64;
        let records = [
            "runs",
            "jobs",
            "ledger",
            "delegations",
            "steering",
            "events",
            "sandboxes",
        ]
        .iter()
        .map(|name| count(name))
        .sum();
        assert_eq!(count("jobs"), jobs + runs, "one step a run, and its jobs");
        let mix = Mix {
            records,
            events: count("events"),
            jobs,
        };
        drop(db);
        wait_until_released(&dir);
        mix
    }
}

/// A parent that delegates `batches` batches of `FAN_OUT` children (wait =
/// false) and collects each before the next, then submits.
fn fan_out_parent(batches: usize) -> String {
    let jobs = vec!["{agent: leaf, request: go}"; FAN_OUT].join(", ");
    let mut front = format!(
        "subagents: [leaf]\nmax_turns: {}\nscript:\n",
        2 * batches + 1
    );
    for _ in 0..batches {
        front.push_str(&format!(
            "  - call: {{tool: delegate, args: {{wait: false, jobs: [{jobs}]}}}}\n"
        ));
        front.push_str("  - call: {tool: collect, args: {}}\n");
    }
    front.push_str("  - call: {tool: submit_output, args: {output: done}}");
    agent_md(&front)
}

// ---- files -------------------------------------------------------------------

/// Waits until no sled instance in this process holds `dir` any more. sled
/// locks its `db` file (`flock`) while any of its threads has it open, and
/// its threads outlive the last handle for a moment; a copy or a delete
/// before then could see a half-written file.
fn wait_until_released(dir: &Path) {
    use std::os::fd::AsRawFd;
    let file = File::open(dir.join("db")).expect("sled's db file");
    // SAFETY: flock takes an open fd, which `file` owns for the whole call.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(locked, 0, "flock: {}", std::io::Error::last_os_error());
    // Closing the file releases the lock.
}

fn copy_dir(from: &Path, to: &Path) {
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

fn dir_bytes(dir: &Path) -> u64 {
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

// ---- figures -----------------------------------------------------------------

/// CPU time this process has used, user and system together.
fn cpu_now() -> Duration {
    Cpu::now().total()
}

fn size_name(records: u64) -> String {
    match records {
        r if r >= 1_000_000 && r % 1_000_000 == 0 => format!("{}M", r / 1_000_000),
        r if r >= 1_000 && r % 1_000 == 0 => format!("{}k", r / 1_000),
        r => r.to_string(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The middle value (the upper middle of an even count).
fn median(xs: &[f64]) -> f64 {
    assert!(!xs.is_empty(), "a median of nothing");
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}
