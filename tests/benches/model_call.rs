//! What arbor adds to one model call: an agent's turns against the mock
//! provider on loopback, beside bare reqwest requests of the same body to the
//! same mock, in the same process and run.
//!
//! ```sh
//! cargo bench -p arbor-tests --bench model_call             # default sizes
//! cargo bench -p arbor-tests --bench model_call -- --quick  # a smoke run
//! ```
//!
//! A turn of the agent is: reserve the call's worst case (a durable ledger
//! commit), build and send the request, parse the answer, settle it (another
//! commit) with its `ModelCalled` event, and run the tool it asked for (a
//! `read_file` of a file that does not exist: the cheapest tool there is).
//! It is timed between consecutive `ModelCalled` events, by an observer that
//! runs in the emitting task.

use arbor_protocol::EventKind;
use arbor_testkit::mock_provider::{Format, MockProvider, openai};
use arbor_testkit::{TestNode, agent_md};
use arbor_tests::measure::{self, Latency};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Sizes {
    baseline: usize,
    turns: usize,
}

impl Sizes {
    const DEFAULT: Sizes = Sizes {
        baseline: 2_000,
        turns: 200,
    };
    const QUICK: Sizes = Sizes {
        baseline: 50,
        turns: 20,
    };
}

fn main() {
    let quick = measure::quick();
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let (runtime, workers) = measure::runtime();
    runtime.block_on(run(sizes, quick, workers));
}

const AGENT: &str = "You are the benchmarked agent.";

async fn run(sizes: Sizes, quick: bool, workers: usize) {
    println!(
        "arbor model call benchmark ({}, tokio multi-thread, {workers} workers)",
        if quick { "--quick" } else { "default sizes" }
    );
    let mock = MockProvider::start().await;
    let read = [("read_file", json!({"path": "missing.txt"}))];

    // arbor: one agent, one call a turn, every turn a read_file.
    for _ in 0..sizes.turns {
        mock.push_for(Format::Openai, AGENT, openai::tool_calls(&read, 300, 20));
    }
    mock.push_for(
        Format::Openai,
        AGENT,
        openai::tool_calls(&[("submit_output", json!({"output": "done"}))], 300, 5),
    );
    // A window large enough that no turn is compacted: this measures calls.
    let toml = mock
        .arbor_toml(Format::Openai, "stream = false\nmax_retries = 0")
        .replace("context_window = 8192", "context_window = 10000000");
    let agent = agent_md(&format!(
        "model: mock/small\ntools: [read_file]\nmax_turns: {}",
        sizes.turns + 1
    ))
    .replace("You are a test agent.", AGENT);
    let node = TestNode::start_with_config(&toml, &[("agent", &agent)]).await;
    let stamps = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let seen = stamps.clone();
    node.observe(move |e| {
        if matches!(e.kind, EventKind::ModelCalled { .. }) {
            seen.lock().unwrap().push(Instant::now());
        }
    });
    let cpu_before = measure::Cpu::now();
    let flushes_before = node.journal().flush_count();
    let started = Instant::now();
    let run = node.run_agent("agent", "Read, again and again.").await;
    let tree = node.wait_run(run).await;
    let wall = started.elapsed();
    let arbor_cpu = measure::Cpu::now().since(cpu_before);
    let flushes = node.journal().flush_count() - flushes_before;
    assert_eq!(
        tree.root().status,
        arbor_protocol::Status::Done,
        "{:#?}",
        tree.root()
    );
    let stamps = stamps.lock().unwrap().clone();
    let turns: Vec<Duration> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
    let calls = stamps.len();

    // Baseline: the very bodies arbor sent (they grow with the history),
    // in turn, by a bare reqwest client.
    let bodies: Vec<_> = mock
        .received_for(AGENT)
        .into_iter()
        .map(|r| r.raw)
        .collect();
    for _ in 0..sizes.baseline {
        mock.push(Format::Openai, openai::tool_calls(&read, 300, 20));
    }
    let client = reqwest::Client::new();
    let url = format!("{}/chat/completions", mock.base_url(Format::Openai));
    let cpu_before = measure::Cpu::now();
    let mut bare = Vec::with_capacity(sizes.baseline);
    for i in 0..sizes.baseline {
        let at = Instant::now();
        let response = client
            .post(&url)
            .header("content-type", "application/json")
            .body(bodies[i % bodies.len()].clone())
            .send()
            .await
            .expect("the mock answers");
        let bytes = response.bytes().await.expect("a body");
        let _: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        bare.push(at.elapsed());
    }
    let bare_cpu = measure::Cpu::now().since(cpu_before);
    let bare = Latency::of(&bare);
    let turn = Latency::of(&turns);

    println!();
    Latency::print_header(52);
    let row = |name: &str, l: &Latency| l.print_row(name, 52);
    row("reqwest: POST the same body, parse JSON (baseline)", &bare);
    row("arbor: one agent turn (reserve, call, settle, tool)", &turn);
    println!();
    let per_call_cpu = arbor_cpu.total().as_secs_f64() * 1e6 / calls as f64;
    let bare_cpu_per = bare_cpu.total().as_secs_f64() * 1e6 / bare.samples as f64;
    println!(
        "arbor: {calls} calls in {:.1} ms wall; {:.1} journal flushes a call; CPU {:.0} µs a call (reqwest alone {:.0} µs)",
        wall.as_secs_f64() * 1e3,
        flushes as f64 / calls as f64,
        per_call_cpu,
        bare_cpu_per,
    );
    println!(
        "ratio: p50 {:.1}x, mean {:.1}x, CPU {:.1}x; bodies of {} to {} bytes",
        turn.p50_us / bare.p50_us,
        turn.mean_us / bare.mean_us,
        per_call_cpu / bare_cpu_per,
        bodies.first().map_or(0, |b| b.len()),
        bodies.last().map_or(0, |b| b.len()),
    );
    println!(
        "summary {}",
        json!({
            "baseline_p50_us": bare.p50_us, "baseline_mean_us": bare.mean_us,
            "turn_p50_us": turn.p50_us, "turn_mean_us": turn.mean_us, "turn_p99_us": turn.p99_us,
            "ratio_p50": turn.p50_us / bare.p50_us, "flushes_per_call": flushes as f64 / calls as f64,
            "cpu_us_per_call": per_call_cpu, "baseline_cpu_us": bare_cpu_per,
        })
    );
}
