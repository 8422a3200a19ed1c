//! Recovery time by journal size beside a plain sled scan, and durable
//! commits per second beside the machine's raw fsync rate, in one run.
//!
//! 1. Recovery by journal size. A journal that looks like a crashed node's
//!    (many finished runs, and some interrupted ones with steps and jobs still
//!    pending or running, open holds and call reservations, and one hold for a
//!    child that never got a record) is built with `Journal::append` in big
//!    batches, at each size, by the testkit (`arbor_tests::synthetic`,
//!    which `arbor-bench`'s P5 builds its journal with too); the
//!    interrupted runs are as many at every size,
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

use arbor_protocol::{JobId, ParentRef, Status};
use arbor_storage::{Journal, LedgerOp, LedgerRecord, Record, open_db};
use arbor_testkit::TestNode;
use arbor_tests::agents::{fan_out_parent, leaf_at_once};
use arbor_tests::measure::{self, Cpu, RawLog, RawWrite, median, round};
use arbor_tests::synthetic::{
    self, Built, Mix, OPEN_JOBS_PER_INTERRUPTED_RUN, copy_dir, wait_until_released,
};
use std::path::Path;
use std::time::{Duration, Instant};

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
    let quick = measure::quick();
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let (runtime, workers) = measure::runtime();
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
    let open_jobs = interrupted_runs * OPEN_JOBS_PER_INTERRUPTED_RUN;
    let built = synthetic::build_journal(target, open_jobs).await;
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
            let scan = synthetic::plain_scan(&for_scan);
            (scan, boot_and_recover(&for_boot).await)
        } else {
            let boot = boot_and_recover(&for_boot).await;
            (synthetic::plain_scan(&for_scan), boot)
        };
        wait_until_released(&for_scan);
        wait_until_released(&for_boot);
        let report = &boot.report;
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
            sled_open: scan.open,
            sled_walk: scan.walk,
            sled_reopen: scan.reopen,
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

/// The boot (`synthetic::boot`), then two passes recovery makes, timed again
/// on their own on the same open journal: sled's cache now holds what the
/// first pass had to load.
async fn boot_and_recover(dir: &Path) -> Boot {
    let boot = synthetic::boot(dir).await;
    let start = Instant::now();
    std::hint::black_box(boot.journal.scan().expect("the journal scans"));
    let scan_again = start.elapsed();
    let start = Instant::now();
    std::hint::black_box(boot.journal.verify().expect("the journal verifies"));
    let verify_again = start.elapsed();
    let synthetic::Boot {
        open,
        recover,
        report,
        journal,
    } = boot;
    drop(journal);
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

/// `fsyncs` small writes, each followed by `fdatasync`, to a file in a fresh
/// temporary directory (the filesystem every journal here lives on).
fn raw_fsyncs(fsyncs: usize, how: RawWrite) -> Durable {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut log = RawLog::create(dir.path());
    let record = [0x5a_u8; FSYNC_WRITE];
    for _ in 0..(fsyncs / 10).max(10) {
        log.write_synced(&record, how);
    }
    let (start, cpu) = (Instant::now(), cpu_now());
    for _ in 0..fsyncs {
        log.write_synced(&record, how);
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
        unit: arbor_storage::Unit::Tokens,
        op: LedgerOp::CallReserve { amount: 4_096 },
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
        let (parent, warmup) = (fan_out_parent(FAN_OUT, batches), fan_out_parent(FAN_OUT, 1));
        let leaf = leaf_at_once();
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
        let done = self.node.jobs_done(run, "leaf");
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

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
