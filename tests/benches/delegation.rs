//! Delegation cost, side by side with a bare ractor round trip, in one run.
//!
//! 1. Baseline: spawn a trivial ractor actor, one `call` to it, stop it and
//!    wait for its exit. Whatever machine this runs on, the ratio of arbor's
//!    figures to this one says how much work arbor adds over the actors alone.
//! 2. Journal commit: one small ledger record appended and flushed, alone. It
//!    is the unit most of a delegation's time is made of (I-29).
//! 3. Delegate round trip: a parent step delegates (wait = true) K times in a
//!    row to a scripted child that submits at once. Timed per call from an
//!    event observer, which runs synchronously at emission.
//! 4. Fan-out throughput: a parent delegates batches of 16 children with
//!    wait = false and collects each batch; jobs per second of run wall time.
//!
//! Every arbor figure comes from a `TestNode`: a real sled journal on a
//! temporary directory, real actors, the scripted model.
//!
//! ```text
//! cargo bench -p arbor-tests --bench delegation            # default sizes
//! cargo bench -p arbor-tests --bench delegation -- --quick # a smoke run
//! ```
//!
//! The last line printed is `summary {json}` for machines.

use arbor_protocol::{EventKind, JobId, ParentRef, RunId, Status};
use arbor_storage::{Journal, LedgerOp, LedgerRecord, Record};
use arbor_testkit::{TestNode, agent_md};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
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
    /// Batches of `FAN_OUT` children in the fan-out run.
    fan_out_batches: usize,
}

impl Sizes {
    const DEFAULT: Sizes = Sizes {
        baseline_trips: 5_000,
        journal_commits: 500,
        delegate_calls: 200,
        delegate_warmup_calls: 10,
        fan_out_batches: 16,
    };

    const QUICK: Sizes = Sizes {
        baseline_trips: 200,
        journal_commits: 50,
        delegate_calls: 20,
        delegate_warmup_calls: 2,
        fan_out_batches: 2,
    };
}

/// Latency figures of one series, in microseconds.
#[derive(Clone, Copy, Debug)]
struct Latency {
    samples: usize,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
}

impl Latency {
    fn of(samples: &[Duration]) -> Latency {
        assert!(!samples.is_empty(), "a series with no samples");
        let mut sorted = samples.to_vec();
        sorted.sort();
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        // Nearest rank: the smallest sample with at least p% of them at or below it.
        let rank = |p: f64| {
            let index = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
            micros(sorted[index.clamp(1, sorted.len()) - 1])
        };
        Latency {
            samples: sorted.len(),
            mean_us: sorted.iter().map(|d| micros(*d)).sum::<f64>() / sorted.len() as f64,
            p50_us: rank(50.0),
            p99_us: rank(99.0),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "n": self.samples,
            "mean_us": round(self.mean_us),
            "p50_us": round(self.p50_us),
            "p99_us": round(self.p99_us),
        })
    }
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
    flushes_per_call: f64,
    events_per_call: f64,
}

/// What the fan-out run measured.
struct FanOutReport {
    jobs: usize,
    wall: Duration,
    flushes: u64,
}

impl FanOutReport {
    fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / self.wall.as_secs_f64()
    }
}

fn main() {
    // Cargo passes `--bench` (and a filter, if given) to a harness = false bench.
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let workers = runtime.metrics().num_workers();
    runtime.block_on(run(sizes, quick, workers));
}

async fn run(sizes: Sizes, quick: bool, workers: usize) {
    println!(
        "arbor delegation benchmark ({}, tokio multi-thread, {workers} workers)",
        if quick { "--quick" } else { "default sizes" }
    );
    let started = Instant::now();

    let baseline = Latency::of(&bare_actor_round_trips(sizes.baseline_trips).await);
    let commit = Latency::of(&journal_commits(sizes.journal_commits).await);
    let delegate = delegate_round_trips(sizes.delegate_calls, sizes.delegate_warmup_calls).await;
    let fan_out = fan_out(sizes.fan_out_batches).await;

    let mean_ratio = delegate.call.mean_us / baseline.mean_us;
    let p50_ratio = delegate.call.p50_us / baseline.p50_us;

    println!();
    println!(
        "{:<48} {:>6} {:>11} {:>11} {:>11}",
        "latency", "n", "mean µs", "p50 µs", "p99 µs"
    );
    let row = |name: &str, l: &Latency| {
        println!(
            "{name:<48} {:>6} {:>11.1} {:>11.1} {:>11.1}",
            l.samples, l.mean_us, l.p50_us, l.p99_us
        );
    };
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
    println!(
        "delegate call / baseline: mean {mean_ratio:.1}x, p50 {p50_ratio:.1}x; run wall / calls: {:.1} µs",
        delegate.wall_per_call_us
    );
    println!(
        "per delegate call, whole run counted: {:.2} journal flushes, {:.1} events",
        delegate.flushes_per_call, delegate.events_per_call
    );
    println!(
        "fan-out: {} jobs in batches of {FAN_OUT}: {:.1} ms wall, {:.0} jobs/s, {:.2} journal flushes per job",
        fan_out.jobs,
        fan_out.wall.as_secs_f64() * 1e3,
        fan_out.jobs_per_second(),
        fan_out.flushes as f64 / fan_out.jobs as f64
    );
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
        "delegate_flushes_per_call": round(delegate.flushes_per_call),
        "ratio_mean": round(mean_ratio),
        "ratio_p50": round(p50_ratio),
        "fan_out_jobs": fan_out.jobs,
        "fan_out_wall_ms": round(fan_out.wall.as_secs_f64() * 1e3),
        "fan_out_jobs_per_s": round(fan_out.jobs_per_second()),
    });
    println!("summary {summary}");
}

// ---- 1. the baseline -------------------------------------------------------

/// An actor that answers one message and does nothing else.
struct Echo;

enum EchoMsg {
    Ping(RpcReplyPort<()>),
}

impl Actor for Echo {
    type Msg = EchoMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match message {
            EchoMsg::Ping(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

async fn bare_actor_round_trips(trips: usize) -> Vec<Duration> {
    let warmup = (trips / 10).max(10);
    let mut samples = Vec::with_capacity(trips);
    for i in 0..warmup + trips {
        let start = Instant::now();
        let (actor, exited) = Actor::spawn(None, Echo, ())
            .await
            .expect("the echo actor starts");
        ractor::call!(actor, EchoMsg::Ping).expect("the echo actor answers");
        actor.stop(None);
        exited.await.expect("the echo actor exits");
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
    samples
}

// ---- 2. one journal commit -------------------------------------------------

async fn journal_commits(commits: usize) -> Vec<Duration> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let journal = Journal::open(&dir.path().join("journal")).expect("the journal opens");
    let owner = ParentRef::Job(JobId::new());
    let mut samples = Vec::with_capacity(commits);
    for _ in 0..commits {
        let record = Record::Ledger(LedgerRecord {
            owner,
            op: LedgerOp::CallReserve { tokens: 4_096 },
            epoch: journal.epoch(),
        });
        let start = Instant::now();
        journal.commit(vec![record]).await.expect("the commit");
        samples.push(start.elapsed());
    }
    samples
}

// ---- 3. delegate round trips -----------------------------------------------

/// A child that submits on its first turn.
fn leaf() -> String {
    agent_md(
        "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    )
}

/// A parent that delegates `calls` times (wait = true), one call a turn, then submits.
fn serial_parent(calls: usize) -> String {
    let mut front = format!("subagents: [leaf]\nmax_turns: {}\nscript:\n", calls + 1);
    for _ in 0..calls {
        front.push_str("  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go}]}}\n");
    }
    front.push_str("  - call: {tool: submit_output, args: {output: done}}");
    agent_md(&front)
}

/// A parent that delegates `batches` batches of `FAN_OUT` (wait = false) and
/// collects each before the next, then submits.
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

/// The instants an observer saw, by kind, for one node.
#[derive(Default)]
struct Seen {
    /// Each `ModelCalled` of an agent that delegates (the children's are not kept).
    parent_model_calls: Vec<(RunId, Instant)>,
    /// Each `ToolCalled` of `delegate`, and whether it succeeded.
    delegates: Vec<(RunId, Instant, bool)>,
    finished: Vec<(RunId, Instant)>,
}

/// Installs an observer that timestamps the events that matter here, and a
/// bell rung at each RunFinished.
fn observe(node: &TestNode) -> (Arc<Mutex<Seen>>, Arc<tokio::sync::Notify>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let finished = Arc::new(tokio::sync::Notify::new());
    let (sink, bell) = (seen.clone(), finished.clone());
    // The parents are steps (a run's top agent); the leaves are jobs below them.
    let steps = Arc::new(Mutex::new(Vec::<JobId>::new()));
    node.observe(move |event| {
        let now = Instant::now();
        match &event.kind {
            EventKind::NodeSpawned {
                id,
                kind: arbor_protocol::NodeKind::Step,
                ..
            } => steps.lock().unwrap().push(*id),
            EventKind::ModelCalled { id, .. } if steps.lock().unwrap().contains(id) => {
                sink.lock()
                    .unwrap()
                    .parent_model_calls
                    .push((event.run, now));
            }
            EventKind::ToolCalled { tool, ok, .. } if tool == "delegate" => {
                sink.lock().unwrap().delegates.push((event.run, now, *ok));
            }
            EventKind::RunFinished { .. } => {
                sink.lock().unwrap().finished.push((event.run, now));
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
                .find(|(r, _)| *r == run)
                .map(|(_, at)| *at)
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
    let (parent, warmup, leaf) = (serial_parent(calls), serial_parent(warmup_calls), leaf());
    let node = TestNode::start(&[("parent", &parent), ("warmup", &warmup), ("leaf", &leaf)]).await;
    let (seen, finished) = observe(&node);

    run_to_end(&node, &seen, &finished, "warmup").await;

    let flushes_before = node.journal().flush_count();
    let (run, wall) = run_to_end(&node, &seen, &finished, "parent").await;
    let flushes = node.journal().flush_count() - flushes_before;
    let events = node.events(run).len();

    let seen = seen.lock().unwrap();
    let model_calls: Vec<Instant> = seen
        .parent_model_calls
        .iter()
        .filter(|(r, _)| *r == run)
        .map(|(_, at)| *at)
        .collect();
    let delegates: Vec<Instant> = seen
        .delegates
        .iter()
        .filter(|(r, _, _)| *r == run)
        .map(|(_, at, ok)| {
            assert!(ok, "a delegate call failed");
            *at
        })
        .collect();
    assert_eq!(delegates.len(), calls, "every delegate call was seen");
    assert!(
        model_calls.len() > calls,
        "a model call before each delegate call and one after"
    );

    // Call i: from the parent's model turn i (its reply, which asked for the
    // delegation) to the delegate's tool result.
    let call: Vec<Duration> = (0..calls).map(|i| delegates[i] - model_calls[i]).collect();
    // Turn i: from the previous delegate's result (or the first model reply) to this one's.
    let turn: Vec<Duration> = (0..calls)
        .map(|i| {
            delegates[i]
                - if i == 0 {
                    model_calls[0]
                } else {
                    delegates[i - 1]
                }
        })
        .collect();
    let tenth = (calls / 10).max(1);
    DelegateReport {
        call: Latency::of(&call),
        turn: Latency::of(&turn),
        call_first_tenth: Latency::of(&call[..tenth]),
        call_last_tenth: Latency::of(&call[calls - tenth..]),
        wall_per_call_us: wall.as_secs_f64() * 1e6 / calls as f64,
        flushes_per_call: flushes as f64 / calls as f64,
        events_per_call: events as f64 / calls as f64,
    }
}

// ---- 4. fan-out throughput -------------------------------------------------

async fn fan_out(batches: usize) -> FanOutReport {
    let (parent, warmup, leaf) = (fan_out_parent(batches), fan_out_parent(1), leaf());
    let node = TestNode::start(&[("parent", &parent), ("warmup", &warmup), ("leaf", &leaf)]).await;
    let (seen, finished) = observe(&node);

    run_to_end(&node, &seen, &finished, "warmup").await;

    let flushes_before = node.journal().flush_count();
    let (run, wall) = run_to_end(&node, &seen, &finished, "parent").await;
    let flushes = node.journal().flush_count() - flushes_before;

    let jobs = FAN_OUT * batches;
    let done = node
        .jobs(run)
        .iter()
        .filter(|j| j.agent.as_deref() == Some("leaf") && j.status == Status::Done)
        .count();
    assert_eq!(done, jobs, "every child finished done");
    FanOutReport {
        jobs,
        wall,
        flushes,
    }
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
