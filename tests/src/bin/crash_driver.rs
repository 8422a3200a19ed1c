//! The crash driver: runs a delegating workload with real sandbox processes
//! in a child process (`arbor run`), kills it with SIGKILL at seeded random
//! moments, restarts on the same data dir, and checks after each restart:
//!
//! - no job left running;
//! - no sandbox process alive, and none recorded live;
//! - conservation for every account (I-14), and nothing undecodable (I-35);
//! - every record seen durable before a crash is still there after it;
//! - one spawn per delegation key; no child released (charged) twice;
//! - no late output: a job failed as interrupted stays so, output null.
//!
//! ```text
//! crash-driver [--points N] [--seed S] [--arbor PATH] [--max-delay-ms MS]
//! ```
//! It prints the seed first, so a failure replays with `--seed`, and ends
//! with one summary line of what it checked. Exit 1 on any violation.

use arbor_runtime::{DefaultModels, EmbeddedNode, Workspace};
use arbor_testkit::{Seeded, checks};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::process::Command;

/// Crash points that share one data dir.
const POINTS_PER_JOURNAL: u64 = 25;

struct Options {
    points: u64,
    seed: u64,
    arbor: PathBuf,
    max_delay_ms: u64,
}

fn options() -> Result<Options, String> {
    let mut points = 200;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut arbor = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name("arbor");
    let mut max_delay_ms = 400;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--points" => points = value()?.parse().map_err(|e| format!("--points: {e}"))?,
            "--seed" => seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--arbor" => arbor = PathBuf::from(value()?),
            "--max-delay-ms" => {
                max_delay_ms = value()?
                    .parse()
                    .map_err(|e| format!("--max-delay-ms: {e}"))?
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !arbor.is_file() {
        return Err(format!(
            "no arbor binary at {} (build it with `cargo build -p arbor-bin`, or give --arbor)",
            arbor.display()
        ));
    }
    Ok(Options {
        points,
        seed,
        arbor,
        max_delay_ms,
    })
}

#[derive(Default)]
struct Tally {
    crash_points: u64,
    recoveries: u64,
    runs_finished: u64,
    jobs_failed: u64,
    processes_killed: u64,
    accounts_checked: u64,
    records_checked: u64,
    violations: Vec<String>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let options = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("crash-driver: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    println!(
        "crash-driver: seed {} ({} crash points)",
        options.seed, options.points
    );
    let mut rng = Seeded::new(options.seed);
    let temp = tempfile::tempdir().expect("a temporary directory");
    let ws_dir = temp.path().join("ws");
    arbor_testkit::crash_workload(&ws_dir).expect("the workspace is written");
    let workspace = Workspace::load(&ws_dir).expect("the workspace loads");
    let mut tally = Tally::default();
    let mut seen = checks::Seen::default();
    let started = Instant::now();

    let mut point = 0;
    // Until `points` real crashes, each a SIGKILL of a node mid-flight.
    while tally.crash_points < options.points && point < options.points * 3 {
        point += 1;
        // A fresh data dir every so often keeps each check's full read of
        // the journal short; within one, crashes pile up on each other.
        let data = temp
            .path()
            .join(format!("data-{}", (point - 1) / POINTS_PER_JOURNAL));
        if (point - 1) % POINTS_PER_JOURNAL == 0 {
            seen = checks::Seen::default();
        }
        let delay = rng.between(0, options.max_delay_ms);
        let mut child = Command::new(&options.arbor)
            .args([
                "run",
                ws_dir.to_str().unwrap(),
                "--flow",
                "crash",
                "--json",
                "--data-dir",
            ])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("arbor starts");
        // The crash moment: the run ends first, or the node is killed mid-flight.
        match tokio::time::timeout(Duration::from_millis(delay), child.wait()).await {
            Ok(_) => tally.runs_finished += 1,
            Err(_) => {
                let _ = child.start_kill(); // SIGKILL
                let _ = child.wait().await;
                tally.crash_points += 1;
            }
        }
        // Restart on the same data dir: recovery, without resuming (the next
        // point's `arbor run` resumes), then the checks.
        let node =
            match EmbeddedNode::start_resuming(&workspace, &data, Arc::new(DefaultModels), |_| {
                false
            })
            .await
            {
                Ok(node) => node,
                Err(e) => {
                    tally.violations.push(format!(
                        "point {point} (delay {delay} ms): restart failed: {e}"
                    ));
                    break;
                }
            };
        tally.recoveries += 1;
        tally.jobs_failed += node.recovery().jobs_failed.len() as u64;
        tally.processes_killed += node.recovery().processes_killed.len() as u64;
        for b in &node.recovery().breaches {
            tally
                .violations
                .push(format!("point {point}: recovery breach: {b}"));
        }
        let journal = node.journal().clone();
        let checked = checks::recovered(&journal, &mut seen);
        tally.accounts_checked += checked.accounts;
        tally.records_checked += checked.records;
        for v in checked.violations {
            tally
                .violations
                .push(format!("point {point} (delay {delay} ms): {v}"));
        }
        if node.shutdown().await.is_err() {
            tally
                .violations
                .push(format!("point {point}: the node did not shut down cleanly"));
        }
        if !tally.violations.is_empty() {
            break;
        }
    }
    println!(
        "crash-driver: seed {} | {} crash points, {} runs finished between them, {} recoveries | {} jobs failed as interrupted, {} process groups killed | {} accounts and {} records checked | {} violations | {:.1}s",
        options.seed,
        tally.crash_points,
        tally.runs_finished,
        tally.recoveries,
        tally.jobs_failed,
        tally.processes_killed,
        tally.accounts_checked,
        tally.records_checked,
        tally.violations.len(),
        started.elapsed().as_secs_f64()
    );
    for v in &tally.violations {
        println!("violation: {v}");
    }
    if tally.violations.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        println!(
            "replay with: crash-driver --seed {} --points {}",
            options.seed, options.points
        );
        std::process::ExitCode::from(1)
    }
}
