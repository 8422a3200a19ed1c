//! The long mode: random crash points, then a concurrency soak.
//!
//! ```text
//! cargo run --release -p arbor-testkit --bin soak -- [--points 5000] [--minutes 10] [--runs 50] [--fan-out 8] [--keep 1m] [--seed S]
//! ```
//!
//! 1. **Crash points.** A delegating workload with real sandbox processes
//!    runs in a child process (this binary again, `--child`), which is
//!    killed with SIGKILL at a seeded random moment; a node then recovers on
//!    the same data dir in this process and `arbor_testkit::checks` runs
//!    over the journal. The next point's child resumes the run, so crashes
//!    pile on each other; every 25 points start a fresh data dir.
//! 2. **Concurrency.** arbord (the real router, token and admission queue)
//!    on a loopback port; `--runs` runs at a time, each a step fanning out
//!    to `--fan-out` children, submitted over HTTP and followed to their end
//!    over the event stream, for `--minutes`, with arbord's retention
//!    (`keep_finished`) at `--keep`, so the journal reaches a steady size
//!    early on, as a node's does in service. This process's RSS is sampled
//!    every second; the soak fails if the second half's peak is more than
//!    10% above the first half's.
//!
//! It prints the seed first and one summary line per part; exit 1 on any
//! violation, with the line that replays it.

use arbor_runtime::{EmbeddedNode, Workspace};
use arbor_testkit::random_crashes;
use arbor_testkit::service::{TestService, Texts};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The allocator arbord and arbor use, so that the memory measured is theirs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Options {
    points: u64,
    minutes: f64,
    runs: usize,
    fan_out: usize,
    seed: u64,
    max_delay_ms: u64,
    keep: String,
}

fn options(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        points: 5000,
        minutes: 10.0,
        runs: 50,
        fan_out: 8,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        max_delay_ms: 400,
        keep: "1m".into(),
    };
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| format!("{flag}: {e}");
        match flag.as_str() {
            "--points" => o.points = value()?.parse().map_err(|e| bad(&e))?,
            "--minutes" => o.minutes = value()?.parse().map_err(|e| bad(&e))?,
            "--runs" => o.runs = value()?.parse().map_err(|e| bad(&e))?,
            "--fan-out" => o.fan_out = value()?.parse().map_err(|e| bad(&e))?,
            "--seed" => o.seed = value()?.parse().map_err(|e| bad(&e))?,
            "--max-delay-ms" => o.max_delay_ms = value()?.parse().map_err(|e| bad(&e))?,
            "--keep" => {
                let keep = value()?;
                humantime::parse_duration(keep).map_err(|e| bad(&e))?;
                o.keep = keep.clone();
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !(1..=16).contains(&o.fan_out) {
        return Err("--fan-out: 1 to 16 (a delegate call's limit)".into());
    }
    if o.runs == 0 || !o.minutes.is_finite() || o.minutes < 0.0 {
        return Err("--runs must be at least 1 and --minutes a length of time".into());
    }
    Ok(o)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]).await;
    }
    let options = match options(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "soak: seed {} ({} crash points, then {} runs x fan-out {} for {} min)",
        options.seed, options.points, options.runs, options.fan_out, options.minutes
    );
    let mut failed = false;
    if options.points > 0 {
        failed |= !crash_points(&options).await;
    }
    if options.minutes > 0.0 {
        failed |= !concurrency(&options).await;
    }
    if failed {
        println!(
            "replay with: soak --seed {} --points {} --minutes {} --runs {} --fan-out {} --keep {}",
            options.seed,
            options.points,
            options.minutes,
            options.runs,
            options.fan_out,
            options.keep
        );
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The child: runs (or resumes) the workload's flow on `data` until killed.
async fn child(args: &[String]) -> ExitCode {
    let (Some(ws), Some(data)) = (args.first(), args.get(1)) else {
        eprintln!("soak --child WORKSPACE DATA");
        return ExitCode::from(2);
    };
    let Ok(workspace) = Workspace::load(Path::new(ws)) else {
        return ExitCode::from(2);
    };
    let node = match EmbeddedNode::start(&workspace, Path::new(data)).await {
        Ok(node) => node,
        Err(e) => {
            eprintln!("soak child: {e}");
            return ExitCode::from(1);
        }
    };
    let run = match node.resumed().first() {
        Some((run, _)) => *run,
        None => {
            let spec = workspace
                .flow_run("crash", None)
                .expect("the workload's flow");
            node.start_run(spec).await.expect("the run starts")
        }
    };
    node.wait_run(run).await;
    let _ = node.shutdown().await;
    ExitCode::SUCCESS
}

async fn crash_points(options: &Options) -> bool {
    let exe = std::env::current_exe().expect("this binary");
    let points = random_crashes::Options {
        points: options.points,
        seed: options.seed,
        max_delay_ms: options.max_delay_ms,
    };
    let tally = random_crashes::run(
        &points,
        |ws, data| {
            let mut child = tokio::process::Command::new(&exe);
            child.arg("--child").arg(ws).arg(data);
            child
        },
        |tally| {
            if tally.recoveries % 500 == 0 {
                println!(
                    "soak: {} points, {} crashes, {:.0}s",
                    tally.recoveries, tally.crash_points, tally.seconds
                );
            }
        },
    )
    .await;
    println!("crash points: {tally}");
    tally.violations.is_empty()
}

/// Bytes in the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|entry| match entry.metadata() {
                Ok(m) if m.is_dir() => dir_bytes(&entry.path()),
                Ok(m) => m.len(),
                Err(_) => 0,
            })
            .sum()
    })
}

/// This process's resident set, in bytes.
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

async fn concurrency(options: &Options) -> bool {
    let started = Instant::now();
    let leaf = arbor_testkit::agent_md(
        "description: answers\nscript:\n  - usage: {input: 10, output: 2}\n    call: {tool: submit_output, args: {output: ok}}",
    );
    let jobs: Vec<String> = (0..options.fan_out)
        .map(|i| format!("{{agent: leaf, request: r{i}}}"))
        .collect();
    let lead = arbor_testkit::agent_md(&format!(
        "subagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{}]}}}}\n  - call: {{tool: submit_output, args: {{output: fanned}}}}",
        jobs.join(", ")
    ));
    let texts = Texts::new(
        &[("lead", &lead), ("leaf", &leaf)],
        &[(
            "fan",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"lead\", instruction = \"go\" }]\n",
        )],
    )
    .with_config(&format!(
        "[service]\nmax_running_runs = {}\nmax_queued_runs = {}\nkeep_finished = {:?}\n",
        options.runs,
        options.runs * 2,
        options.keep
    ));
    let service = Arc::new(TestService::start(texts).await);
    let until = started + Duration::from_secs_f64(options.minutes * 60.0);
    // (seconds, RSS, the data dir's bytes): RSS every second, the disk
    // every tenth second (a walk of the data dir), carried between.
    let samples = Arc::new(std::sync::Mutex::new(Vec::<(f64, u64, u64)>::new()));
    let sampler = {
        let samples = samples.clone();
        let data = service.data_dir();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut disk = 0;
            for n in 0u64.. {
                tick.tick().await;
                if n % 10 == 0 {
                    disk = dir_bytes(&data);
                }
                samples
                    .lock()
                    .unwrap()
                    .push((started.elapsed().as_secs_f64(), rss(), disk));
            }
        })
    };
    let mut workers = vec![];
    for _ in 0..options.runs {
        let service = service.clone();
        workers.push(tokio::spawn(async move {
            let (mut done, mut other) = (0u64, 0u64);
            while Instant::now() < until {
                let run = service.submit(serde_json::json!({"flow": "fan"})).await;
                let doc = service.wait_run(run).await;
                if arbor_testkit::service::status_of(&doc) == arbor_protocol::Status::Done {
                    done += 1;
                } else {
                    other += 1;
                }
            }
            (done, other)
        }));
    }
    let (mut done, mut other) = (0, 0);
    for w in workers {
        let (d, o) = w.await.expect("a soak worker");
        done += d;
        other += o;
    }
    sampler.abort();
    let samples = samples.lock().unwrap().clone();
    let half = samples.len() / 2;
    let peak = |s: &[(f64, u64, u64)]| s.iter().map(|(_, r, _)| *r).max().unwrap_or(0);
    let (first, second) = (peak(&samples[..half]), peak(&samples[half..]));
    let grew = second as f64 > first as f64 * 1.10;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "concurrency: {} runs done ({} jobs), {other} not done, {:.0} runs/s; RSS peak {:.1} MiB in the first half, {:.1} MiB in the second ({} samples): {}; {:.1}s",
        done,
        done * (options.fan_out as u64 + 1),
        done as f64 / started.elapsed().as_secs_f64(),
        mib(first),
        mib(second),
        samples.len(),
        if grew { "GREW" } else { "no growth" },
        started.elapsed().as_secs_f64()
    );
    // The curve, at each tenth of the soak: a cache filling flattens out, a
    // leak does not.
    let tenths: Vec<&(f64, u64, u64)> = (1..=10)
        .filter_map(|tenth| samples.get(samples.len() * tenth / 10 - 1))
        .collect();
    let curve = |of: fn(&(f64, u64, u64)) -> u64| -> String {
        let mibs: Vec<String> = tenths
            .iter()
            .map(|s| format!("{:.0}", mib(of(s))))
            .collect();
        mibs.join(" ")
    };
    println!("concurrency: RSS (MiB) at each tenth: {}", curve(|s| s.1));
    println!(
        "concurrency: data dir (MiB) at each tenth: {}",
        curve(|s| s.2)
    );
    let kept = service
        .service
        .node()
        .journal()
        .runs()
        .map_or(0, |runs| runs.len());
    println!(
        "concurrency: the journal keeps {kept} runs at the end (finished runs forgotten after {}), {:.0} MiB on disk",
        options.keep,
        mib(dir_bytes(&service.data_dir()))
    );
    other == 0 && !grew
}
