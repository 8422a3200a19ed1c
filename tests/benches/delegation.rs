//! Delegation cost, side by side with a bare ractor round trip, in one run.
//!
//! 1. Baseline: spawn a trivial ractor actor, one `call` to it, stop it and
//!    wait for its exit. Measured in the same process as the rest, so the
//!    ratio of arbor's figures to it carries across machines better than
//!    either figure alone.
//! 2. Journal commit: one small ledger record appended and flushed, on its
//!    own. A delegation pays this several times over (I-29).
//! 3. Delegate round trip: a parent step delegates (wait = true) K times in a
//!    row to a scripted child that submits at once. Timed per call by an
//!    event observer, which runs synchronously at emission.
//! 4. Fan-out throughput: a parent delegates batches of children with
//!    wait = false and collects each batch; jobs per second of run wall time,
//!    at the default caps (batches of 16) and with the caps raised (64).
//!
//! Beside the times: journal flushes and process CPU (user and system, all
//! threads) per operation, to say where the time goes.
//!
//! Every arbor figure comes from a `TestNode`: a real sled journal in a
//! temporary directory (`TMPDIR` moves it), real actors, the scripted model.
//!
//! ```text
//! cargo bench -p arbor-tests --bench delegation             # ~10 s on 2 cores
//! cargo bench -p arbor-tests --bench delegation -- --quick  # a smoke run, ~1 s
//! ```
//!
//! Without `--bench` on its command line (`cargo test --all-targets`) it
//! does the smoke run.
//!
//! The last line printed is `summary {json}` for machines.

use arbor_protocol::{EventKind, JobId, NodeKind, ParentRef, RunId, Status};
use arbor_storage::{Journal, LedgerOp, LedgerRecord, Record};
use arbor_testkit::TestNode;
use arbor_tests::agents::{fan_out_parent, leaf_at_once, serial_parent};
use arbor_tests::bare;
use arbor_tests::measure::{self, Cpu, Latency, round};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one measured run may take before the benchmark gives up.
const RUN_LIMIT: Duration = Duration::from_secs(300);

/// A budget no run here comes near: the parent's context grows each turn, and
/// the budget is not what is measured.
const BUDGET_TOKENS: u64 = 1_000_000_000;

/// The default `limits.fan_out`: children in one delegate call.
const FAN_OUT: usize = 16;

/// How many of everything to do.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    /// Bare actor round trips.
    baseline_trips: usize,
    /// Lone journal commits.
    journal_commits: usize,
    /// Delegate calls (wait = true) in the measured run.
    delegate_calls: usize,
    /// Delegate calls in the warm-up run before it, on the same node.
    delegate_warmup_calls: usize,
    /// Fan-out at the default caps: batches of `FAN_OUT`.
    fan_out: FanOutShape,
    /// Fan-out with the caps raised to a bigger batch, the same jobs per run.
    fan_out_raised: FanOutShape,
}

impl Sizes {
    const DEFAULT: Sizes = Sizes {
        baseline_trips: 5_000,
        journal_commits: 500,
        delegate_calls: 500,
        delegate_warmup_calls: 10,
        fan_out: FanOutShape {
            batch: FAN_OUT,
            batches: 16,
            runs: 4,
        },
        fan_out_raised: FanOutShape {
            batch: 64,
            batches: 4,
            runs: 4,
        },
    };

    const QUICK: Sizes = Sizes {
        baseline_trips: 200,
        journal_commits: 50,
        delegate_calls: 20,
        delegate_warmup_calls: 2,
        fan_out: FanOutShape {
            batch: FAN_OUT,
            batches: 2,
            runs: 1,
        },
        fan_out_raised: FanOutShape {
            batch: 32,
            batches: 1,
            runs: 1,
        },
    };
}

/// What the delegate run measured.
struct DelegateReport {
    /// From the parent's model reply to its delegate tool result.
    call: Latency,
    /// From one delegate tool result to the next: the call plus one parent model turn.
    turn: Latency,
    /// The first and last tenth of the calls, to show whether a growing context costs.
    call_first_tenth: Latency,
    call_last_tenth: Latency,
    /// Run wall time (start to RunFinished) over the number of calls.
    wall_per_call_us: f64,
    /// Process CPU time of the whole run.
    cpu: Cpu,
    /// Journal flushes in the whole run, over the number of calls.
    run_flushes_per_call: f64,
    /// Journal flushes completed inside the delegate calls themselves.
    call_flushes_per_call: f64,
    events_per_call: f64,
}

/// What the fan-out runs measured.
struct FanOutReport {
    shape: FanOutShape,
    /// Over all runs.
    jobs: usize,
    wall: Duration,
    /// Each run's own figure, in run order.
    runs_jobs_per_second: Vec<f64>,
    flushes: u64,
    /// Process CPU time over all runs.
    cpu: Cpu,
}

impl FanOutReport {
    fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / self.wall.as_secs_f64()
    }

    fn slowest_and_fastest_run(&self) -> (f64, f64) {
        let rates = &self.runs_jobs_per_second;
        let slowest = rates.iter().copied().fold(f64::INFINITY, f64::min);
        let fastest = rates.iter().copied().fold(0.0, f64::max);
        (slowest, fastest)
    }

    fn print(&self, name: &str) {
        let (slowest, fastest) = self.slowest_and_fastest_run();
        println!(
            "{name:<48} {:>6} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.2}",
            self.jobs,
            self.wall.as_secs_f64() * 1e3,
            self.jobs_per_second(),
            slowest,
            fastest,
            self.flushes as f64 / self.jobs as f64,
        );
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "batch": self.shape.batch,
            "batches": self.shape.batches,
            "runs": self.shape.runs,
            "jobs": self.jobs,
            "wall_ms": round(self.wall.as_secs_f64() * 1e3),
            "jobs_per_s": round(self.jobs_per_second()),
            "flushes_per_job": round(self.flushes as f64 / self.jobs as f64),
            "cpu_per_job": self.cpu.json(self.jobs),
        })
    }
}

fn main() {
    let quick = measure::quick();
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let (runtime, workers) = measure::runtime();
    runtime.block_on(run(sizes, quick, workers));
}

async fn run(sizes: Sizes, quick: bool, workers: usize) {
    println!(
        "arbor delegation benchmark ({}, tokio multi-thread, {workers} workers)",
        if quick { "--quick" } else { "default sizes" }
    );
    let started = Instant::now();

    let (baseline, baseline_cpu) = bare_actor_round_trips(sizes.baseline_trips).await;
    let baseline = Latency::of(&baseline);
    let (commit, commit_cpu) = journal_commits(sizes.journal_commits).await;
    let commit = Latency::of(&commit);
    let delegate = delegate_round_trips(sizes.delegate_calls, sizes.delegate_warmup_calls).await;
    let fan_out_default = fan_out(sizes.fan_out).await;
    let fan_out_raised = fan_out(sizes.fan_out_raised).await;

    let mean_ratio = delegate.call.mean_us / baseline.mean_us;
    let p50_ratio = delegate.call.p50_us / baseline.p50_us;

    println!();
    Latency::print_header(48);
    let row = |name: &str, l: &Latency| l.print_row(name, 48);
    row("ractor: spawn, call, stop, wait (baseline)", &baseline);
    row("journal: commit one ledger record", &commit);
    row("arbor: delegate call, wait = true", &delegate.call);
    row("arbor: parent turn (model turn + delegate)", &delegate.turn);
    row(
        "arbor: delegate call, first tenth",
        &delegate.call_first_tenth,
    );
    row(
        "arbor: delegate call, last tenth",
        &delegate.call_last_tenth,
    );
    println!();
    println!("delegate call / baseline: mean {mean_ratio:.1}x, p50 {p50_ratio:.1}x");
    println!(
        "delegate run wall time over the number of calls: {:.1} µs",
        delegate.wall_per_call_us
    );
    println!(
        "journal flushes per delegate call: {:.2} inside the call, {:.2} with the whole run counted; events per call: {:.1}",
        delegate.call_flushes_per_call, delegate.run_flushes_per_call, delegate.events_per_call
    );
    println!();
    println!(
        "{:<48} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "fan-out throughput", "jobs", "wall ms", "jobs/s", "slowest", "fastest", "flush/job"
    );
    for report in [&fan_out_default, &fan_out_raised] {
        let FanOutShape {
            batch,
            batches,
            runs,
        } = report.shape;
        let caps = if batch <= FAN_OUT {
            "default caps"
        } else {
            "caps raised"
        };
        report.print(&format!(
            "{runs} runs x {batches} batches x {batch} ({caps})"
        ));
    }
    println!("(slowest, fastest: jobs/s of one run)");
    println!();
    println!(
        "{:<48} {:>6} {:>11} {:>11}",
        "process CPU per operation, all threads", "n", "user µs", "system µs"
    );
    let cpu_row = |name: &str, cpu: Cpu, ops: usize| {
        let (user, system) = cpu.per_op_us(ops);
        println!("{name:<48} {ops:>6} {user:>11.1} {system:>11.1}");
    };
    cpu_row(
        "ractor round trip (baseline)",
        baseline_cpu,
        baseline.samples,
    );
    cpu_row("journal commit", commit_cpu, commit.samples);
    cpu_row(
        "delegate call (whole run / calls)",
        delegate.cpu,
        delegate.call.samples,
    );
    for report in [&fan_out_default, &fan_out_raised] {
        cpu_row(
            &format!("fan-out job, batches of {}", report.shape.batch),
            report.cpu,
            report.jobs,
        );
    }
    println!(
        "total benchmark time: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let summary = serde_json::json!({
        "quick": quick,
        "workers": workers,
        "baseline": baseline.json(),
        "journal_commit": commit.json(),
        "delegate_call": delegate.call.json(),
        "delegate_turn": delegate.turn.json(),
        "delegate_wall_per_call_us": round(delegate.wall_per_call_us),
        "baseline_cpu": baseline_cpu.json(baseline.samples),
        "journal_commit_cpu": commit_cpu.json(commit.samples),
        "delegate_cpu_per_call": delegate.cpu.json(delegate.call.samples),
        "delegate_call_flushes": round(delegate.call_flushes_per_call),
        "delegate_run_flushes_per_call": round(delegate.run_flushes_per_call),
        "ratio_mean": round(mean_ratio),
        "ratio_p50": round(p50_ratio),
        "fan_out": fan_out_default.json(),
        "fan_out_raised_caps": fan_out_raised.json(),
    });
    println!("summary {summary}");
}

// ---- 1. the baseline -------------------------------------------------------

async fn bare_actor_round_trips(trips: usize) -> (Vec<Duration>, Cpu) {
    let warmup = (trips / 10).max(10);
    let mut samples = Vec::with_capacity(trips);
    let mut cpu_before = Cpu::now();
    for i in 0..warmup + trips {
        if i == warmup {
            cpu_before = Cpu::now();
        }
        let start = Instant::now();
        bare::round_trip().await;
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
    (samples, Cpu::now().since(cpu_before))
}

// ---- 2. one journal commit -------------------------------------------------

async fn journal_commits(commits: usize) -> (Vec<Duration>, Cpu) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    let owner = ParentRef::Job(JobId::new());
    let mut samples = Vec::with_capacity(commits);
    let cpu_before = Cpu::now();
    for _ in 0..commits {
        let record = Record::Ledger(LedgerRecord {
            owner,
            unit: arbor_storage::Unit::Tokens,
            op: LedgerOp::CallReserve { amount: 4_096 },
            epoch: journal.epoch(),
        });
        let start = Instant::now();
        journal.commit(vec![record]).await.expect("the commit");
        samples.push(start.elapsed());
    }
    (samples, Cpu::now().since(cpu_before))
}

// ---- 3. delegate round trips -----------------------------------------------

/// One event as the observer saw it: when, and how many journal flushes had
/// completed by then.
#[derive(Clone, Copy, Debug)]
struct Mark {
    run: RunId,
    at: Instant,
    flushes: u64,
}

/// What an observer saw on one node, by kind.
#[derive(Default)]
struct Seen {
    /// Each `ModelCalled` of a step: the agents that delegate (leaves are jobs).
    parent_model_calls: Vec<Mark>,
    /// Each `ToolCalled` of `delegate`, and whether it succeeded.
    delegates: Vec<(Mark, bool)>,
    finished: Vec<Mark>,
}

impl Seen {
    fn parent_model_calls(&self, run: RunId) -> Vec<Mark> {
        let of_run = |m: &&Mark| m.run == run;
        self.parent_model_calls
            .iter()
            .filter(of_run)
            .copied()
            .collect()
    }

    /// The run's delegate results; panics if any failed.
    fn delegates(&self, run: RunId) -> Vec<Mark> {
        self.delegates
            .iter()
            .filter(|(m, _)| m.run == run)
            .map(|(m, ok)| {
                assert!(ok, "a delegate call failed");
                *m
            })
            .collect()
    }
}

/// Installs an observer that marks the events that matter here, and a bell
/// rung at each RunFinished.
fn observe(node: &TestNode) -> (Arc<Mutex<Seen>>, Arc<tokio::sync::Notify>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let finished = Arc::new(tokio::sync::Notify::new());
    let (sink, bell) = (seen.clone(), finished.clone());
    let journal = node.journal().clone();
    let steps = Arc::new(Mutex::new(Vec::<JobId>::new()));
    node.observe(move |event| {
        let mark = Mark {
            run: event.run,
            at: Instant::now(),
            flushes: journal.flush_count(),
        };
        match &event.kind {
            EventKind::JobSpawned {
                id,
                kind: NodeKind::Step,
                ..
            } => steps.lock().unwrap().push(*id),
            EventKind::ModelCalled { id, .. } if steps.lock().unwrap().contains(id) => {
                sink.lock().unwrap().parent_model_calls.push(mark);
            }
            EventKind::ToolCalled { tool, ok, .. } if tool == "delegate" => {
                sink.lock().unwrap().delegates.push((mark, *ok));
            }
            EventKind::RunFinished { .. } => {
                sink.lock().unwrap().finished.push(mark);
                bell.notify_one();
            }
            _ => {}
        }
    });
    (seen, finished)
}

/// Starts `agent` and waits for its RunFinished; returns the run and its wall time.
async fn run_to_end(
    node: &TestNode,
    seen: &Mutex<Seen>,
    finished: &tokio::sync::Notify,
    agent: &str,
) -> (RunId, Duration) {
    let start = Instant::now();
    let run = node
        .run_agent_with_budget(agent, "go", Some(BUDGET_TOKENS))
        .await;
    let end = tokio::time::timeout(RUN_LIMIT, async {
        loop {
            if let Some(end) = seen
                .lock()
                .unwrap()
                .finished
                .iter()
                .find(|m| m.run == run)
                .map(|m| m.at)
            {
                return end;
            }
            finished.notified().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("run of {agent} did not finish within {RUN_LIMIT:?}"));
    let tree = node.tree(run);
    assert_eq!(
        tree.run_status(),
        Status::Done,
        "run of {agent} did not succeed"
    );
    (run, end - start)
}

async fn delegate_round_trips(calls: usize, warmup_calls: usize) -> DelegateReport {
    let (parent, warmup, leaf) = (
        serial_parent(calls),
        serial_parent(warmup_calls),
        leaf_at_once(),
    );
    let node = TestNode::start(&[("parent", &parent), ("warmup", &warmup), ("leaf", &leaf)]).await;
    let (seen, finished) = observe(&node);

    run_to_end(&node, &seen, &finished, "warmup").await;

    let (flushes_before, cpu_before) = (node.journal().flush_count(), Cpu::now());
    let (run, wall) = run_to_end(&node, &seen, &finished, "parent").await;
    let (flushes, cpu) = (
        node.journal().flush_count() - flushes_before,
        Cpu::now().since(cpu_before),
    );
    let events = node.events(run).len();

    let (model_calls, delegates) = {
        let seen = seen.lock().unwrap();
        (seen.parent_model_calls(run), seen.delegates(run))
    };
    node.shutdown().await;
    assert_eq!(delegates.len(), calls, "every delegate call was seen");
    assert_eq!(
        model_calls.len(),
        calls + 1,
        "one model turn for each delegate call and one to submit"
    );

    // Call i: from the parent's model turn i (its reply, which asked for the
    // delegation) to the delegate's tool result.
    let call: Vec<Duration> = (0..calls)
        .map(|i| delegates[i].at - model_calls[i].at)
        .collect();
    let call_flushes: u64 = (0..calls)
        .map(|i| delegates[i].flushes - model_calls[i].flushes)
        .sum();
    // Turn i: from the previous delegate's result (or the first model reply) to this one's.
    let turn: Vec<Duration> = (0..calls)
        .map(|i| {
            let previous = if i == 0 {
                model_calls[0]
            } else {
                delegates[i - 1]
            };
            delegates[i].at - previous.at
        })
        .collect();
    let tenth = (calls / 10).max(1);
    DelegateReport {
        call: Latency::of(&call),
        turn: Latency::of(&turn),
        call_first_tenth: Latency::of(&call[..tenth]),
        call_last_tenth: Latency::of(&call[calls - tenth..]),
        wall_per_call_us: wall.as_secs_f64() * 1e6 / calls as f64,
        cpu,
        run_flushes_per_call: flushes as f64 / calls as f64,
        call_flushes_per_call: call_flushes as f64 / calls as f64,
        events_per_call: events as f64 / calls as f64,
    }
}

// ---- 4. fan-out throughput -------------------------------------------------

/// One fan-out shape: `runs` runs, each of `batches` batches of `batch` children.
#[derive(Clone, Copy, Debug)]
struct FanOutShape {
    batch: usize,
    batches: usize,
    runs: usize,
}

async fn fan_out(shape: FanOutShape) -> FanOutReport {
    let (parent, warmup) = (
        fan_out_parent(shape.batch, shape.batches),
        fan_out_parent(shape.batch, 1),
    );
    let leaf = leaf_at_once();
    let agents = [
        ("parent", &parent[..]),
        ("warmup", &warmup),
        ("leaf", &leaf),
    ];
    // The default caps are the default batch; a bigger batch needs them raised.
    let node = if shape.batch <= FAN_OUT {
        TestNode::start(&agents).await
    } else {
        let limits = format!(
            "[limits]\nfan_out = {0}\nrunning_children = {0}",
            shape.batch
        );
        TestNode::start_with_config(&limits, &agents).await
    };
    let (seen, finished) = observe(&node);

    run_to_end(&node, &seen, &finished, "warmup").await;

    let jobs_per_run = shape.batch * shape.batches;
    let (flushes_before, cpu_before) = (node.journal().flush_count(), Cpu::now());
    let mut walls = Vec::with_capacity(shape.runs);
    for _ in 0..shape.runs {
        let (run, wall) = run_to_end(&node, &seen, &finished, "parent").await;
        assert_eq!(
            node.jobs_done(run, "leaf"),
            jobs_per_run,
            "every child finished done"
        );
        walls.push(wall);
    }
    let (flushes, cpu) = (
        node.journal().flush_count() - flushes_before,
        Cpu::now().since(cpu_before),
    );
    node.shutdown().await;
    FanOutReport {
        cpu,
        shape,
        jobs: jobs_per_run * shape.runs,
        wall: walls.iter().sum(),
        runs_jobs_per_second: walls
            .iter()
            .map(|w| jobs_per_run as f64 / w.as_secs_f64())
            .collect(),
        flushes,
    }
}

/// Per-operation figures of the shared process CPU clock.
trait PerOp {
    fn per_op_us(self, ops: usize) -> (f64, f64);
    fn json(self, ops: usize) -> serde_json::Value;
}

impl PerOp for Cpu {
    /// Microseconds per operation: (user, system).
    fn per_op_us(self, ops: usize) -> (f64, f64) {
        let per = |d: Duration| d.as_secs_f64() * 1e6 / ops as f64;
        (per(self.user), per(self.system))
    }

    fn json(self, ops: usize) -> serde_json::Value {
        let (user, system) = self.per_op_us(ops);
        serde_json::json!({ "user_us": round(user), "system_us": round(system) })
    }
}
