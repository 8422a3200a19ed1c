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

use arbor_testkit::random_crashes;
use std::path::PathBuf;
use tokio::process::Command;

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
    let points = random_crashes::Options {
        points: options.points,
        seed: options.seed,
        max_delay_ms: options.max_delay_ms,
    };
    let arbor = &options.arbor;
    let tally = random_crashes::run(
        &points,
        |ws, data| {
            let mut child = Command::new(arbor);
            child
                .arg("run")
                .arg(ws)
                .args(["--flow", "crash", "--json", "--data-dir"])
                .arg(data);
            child
        },
        |_| {},
    )
    .await;
    println!("crash-driver: seed {} | {tally}", options.seed);
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
