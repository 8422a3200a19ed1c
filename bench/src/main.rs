//! `arbor-bench`: arbor's seven performance goals, each measured
//! beside its baseline in the same process and the same run.
//!
//! ```text
//! cargo run --release -p arbor-bench -- all             # every goal: 5 to 10 minutes on 2 cores
//! cargo run --release -p arbor-bench -- P3              # one goal; or several: -- P1 P5
//! cargo build --release -p arbor-bin -p arbor-bench && target/release/arbor-bench W S
//!                                                       # the fan-out as whole `arbor run` processes,
//!                                                       # and a one-job run's start-up
//! cargo run --release -p arbor-bench -- P4 --jobs 20000 # P4 at another size
//! cargo run -p arbor-bench -- all --quick               # small sizes: each goal runs and reports
//! ARBOR_DATABASE_URL=postgres://... target/release/arbor-bench C
//!                                                       # several arbords on one PostgreSQL
//! ```
//!
//! Progress goes to stderr; the report to stdout. Every node and journal is
//! made in the temporary directory (`TMPDIR` decides its filesystem).
//!
//! # Protocol
//!
//! Every goal: one unmeasured warm-up of each side, then 5 repetitions that
//! alternate baseline and arbor (baseline, arbor, baseline, arbor, ...).
//! Each repetition gives one figure; a side's figure is the median of its
//! 5, and the ratio is arbor's median over the baseline's, of the same run.
//!
//! # Output
//!
//! A table for people (per goal: what, baseline and arbor medians with
//! units, what they are per, ratio, target, verdict), then for each goal its
//! 5 samples of each side, its conditions and notes, then, last, exactly one
//! line per goal, in goal order:
//!
//! ```text
//! P1 baseline=152us arbor=2.10ms ratio=13.8 goal=<=4 misses
//! ```
//!
//! - `baseline=` and `arbor=`: the medians, three significant digits and a
//!   unit with no space: `ns`, `us`, `ms`, `s` (times, CPU times), `/s`,
//!   `k/s`, `M/s` (rates), `B`, `KiB`, `MiB`, `GiB` (memory).
//! - `ratio=`: arbor / baseline, three significant digits, no unit.
//! - `goal=`: `<=X` or `>=X` on the ratio.
//! - `holds` or `misses`: the ratio against the goal, and the goal's other
//!   conditions (P3: no late output). P1's and P2's absolute goals are
//!   reported in notes, not on this line.
//! - P3 has a row per tree shape; its line gives the shape with the worse
//!   ratio, and holds only if both do.
//!
//! A goal that could not run prints `P<n> could not run: <why>` instead, on
//! stdout and stderr, and the exit status is 1. Otherwise it is 0, whether
//! the goals hold or miss.
//!
//! After the P lines, `all` (or `W` alone) measures the fan-out example as
//! whole `arbor run` processes (`whole.rs`): its samples, then one line,
//! `W wall=<median> cpu=<median> jobs=<n> rate=<jobs/s> goal=>=10.0k/s
//! holds|misses`. It runs the `arbor` built beside `arbor-bench`; under
//! `all`, without one, it says `W skipped: <why>` and is not a failure.
//!
//! Then `all` (or `S` alone) measures what a small run costs as a whole
//! process (`startup.rs`): `arbor run` of a one-step, one-job workspace
//! beside a bare tokio + sled process of our own and `/bin/true`, ending
//! with `S baseline=<bare> arbor=<run> ratio=<r> goal=<=2 holds|misses`;
//! without an `arbor` beside it, under `all`, `S skipped: <why>`.
//!
//! `C` (never part of `all`: it needs a PostgreSQL server, named by
//! `ARBOR_DATABASE_URL`) measures arbords sharing one journal
//! (`cluster.rs`): one node against three on many small runs, then the
//! failover time, ending with a `C` line and an `F` line.
//!
//! # Goals
//!
//! | id | arbor | baseline | goal |
//! |---|---|---|---|
//! | P1 | a delegate call (wait = true) to a child that submits at once, per call, median over 200 calls in a row | one 200 B append + fdatasync on the journal's filesystem | <= 4 (and <= 0.6 ms absolute, a note) |
//! | P2 | 64 runs at once, each a step delegating 16 children in one call; jobs/s | the same on a node whose journal does not fdatasync | >= 0.5 (and >= 10,000 jobs/s absolute, a note) |
//! | P3 | stop a run of 10,000 waiting jobs: flat (1 x 10,000) and deep (10 x 10 x 10 x 10), until every job ended and every actor exited | ractor's stop of a bare tree of the same shape | <= 2, and no late output |
//! | P4 | RSS per idle job, 100,000 jobs (`--jobs N`) | RSS per bare idle ractor actor | <= 3 |
//! | P5 | `Journal::open` + `recovery::recover` on 1,000,000 records with 10,000 jobs open | sled open + a walk of every entry | <= 1.5 |
//! | P6 | steering messages to one running step, 64 concurrent senders; msgs/s | casts to one bare actor from 64 senders | >= 0.5 |
//! | P7 | process CPU per delegated job, P2's workload | a bare spawn + call + stop of as many actors | <= 20 |
//! | P8 | 50 clients, each submitting a run of one step delegating 8 children and following it to its end, then the next, 3 s a repetition; jobs/s, over HTTP (arbord on loopback) and on the embedded node | P2's fan-out on a node of its own, alternating | >= 0.5 each, and over HTTP end p50 < 50 ms and jobs/s >= 0.9x embedded |
//! | M1 | one MCP call (the everything reference server's `echo`) from the model's reply to the tool result, 200 in a row | the same call from a bare rmcp client to the same server, unsealed | <= 1.5 (and the sealed start, a note) |
//!
//! Each goal's module says exactly what it measures.
//!
//! # Stand-ins and limits
//!
//! - P2's baseline: a node on the same filesystem whose journal skips its
//!   `fdatasync`s (storage's `Faults::skip_syncs`, switched on before any
//!   work, `workload::syncs_off`: the one place that says what syncs off is).
//! - Caps: each workload's node raises `[limits]` to what it needs
//!   (`fan_out` and `running_children` to its widest parent, `depth` to 4
//!   for P3's deep tree, `spawn_cap` to 10,000,000); no cap had to stay.
//! - P3's and P4's idle jobs are leaves whose first model call takes an
//!   hour (the scripted model's `delay`): idle as far as the node can tell.
//! - P4 measures each side in a fresh process: freed memory stays in a
//!   process's RSS, so a second measurement in one process sees little.

mod bare;
mod cluster;
mod goals;
mod report;
mod startup;
mod trial;
mod whole;
mod workload;

use clap::Parser;
use futures::FutureExt;
use goals::{Goal, Sizes, idle_memory};
use std::panic::AssertUnwindSafe;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "arbor's performance goals (P1-P8, M1, R1, R2, T1), each beside its baseline")]
struct Args {
    /// `all`, or goal ids: P1 ... P8, M1, R1, R2, T1.
    goals: Vec<String>,
    /// Small sizes: checks that each goal runs and reports, not its speed.
    #[arg(long)]
    quick: bool,
    /// P4's idle jobs (default 100,000; 100 with --quick).
    #[arg(long)]
    jobs: Option<usize>,
    /// Internal: measure one side of P4 in this process (`p4-bare`,
    /// `p4-arbor`), or be S's bare process (`start-bare DIR`).
    #[arg(long, hide = true)]
    child: Option<String>,
    /// W and S: how many timed `arbor run` processes (default W 20, S 30; 1 with --quick).
    #[arg(long)]
    runs: Option<usize>,
    /// W and S: the `arbor` to run (default: the one beside arbor-bench).
    #[arg(long)]
    arbor: Option<std::path::PathBuf>,
}

/// The allocator `arbor` and `arbord` ship with, so each goal measures
/// arbor as it runs (both sides of every ratio share it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    if args.child.as_deref() == Some("start-bare") {
        // S's bare process: nothing else of arbor-bench runs in it.
        let Some(dir) = args.goals.first() else {
            eprintln!("arbor-bench: --child start-bare needs a directory");
            return ExitCode::from(2);
        };
        return match startup::bare_child(std::path::Path::new(dir)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let (runtime, workers) = arbor_tests::measure::runtime();
    if let Some(child) = &args.child {
        let Some(side) = idle_memory::Side::parse(child) else {
            eprintln!("arbor-bench: unknown --child {child}");
            return ExitCode::from(2);
        };
        let jobs = args.jobs.unwrap_or(goals::IDLE_JOBS_DEFAULT);
        return match runtime.block_on(idle_memory::child_main(side, jobs)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let (goals, whole, start) = match chosen(&args.goals) {
        Ok(chosen) => chosen,
        Err(why) => {
            eprintln!("arbor-bench: {why}");
            return ExitCode::from(2);
        }
    };
    let mut sizes = if args.quick {
        Sizes::quick_sizes()
    } else {
        Sizes::default_sizes()
    };
    if let Some(jobs) = args.jobs {
        sizes.idle_jobs = jobs;
    }
    let mut failures = 0;
    if !goals.is_empty() {
        failures += runtime.block_on(run(&goals, &sizes, workers));
    }
    if whole != Whole::No {
        failures += run_process('W', &args, whole, 20);
    }
    if start != Whole::No {
        failures += run_process('S', &args, start, 30);
    }
    if args.goals.iter().any(|g| g.eq_ignore_ascii_case("C")) {
        failures += runtime.block_on(run_cluster(args.quick));
    }
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Whether to measure a whole process (W, S), and how its absence counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Whole {
    No,
    /// Named: without an `arbor` to run, it could not run.
    Asked,
    /// Part of `all`: without an `arbor` to run, it is skipped.
    IfBuilt,
}

/// The goals named on the command line, in goal order, W and S.
fn chosen(names: &[String]) -> Result<(Vec<Goal>, Whole, Whole), String> {
    if names.is_empty() {
        return Err("name the goals to run: `all`, W, S, C, or P1 ... P8, M1, R1, R2, T1".into());
    }
    let (mut goals, mut whole, mut start) = (vec![], Whole::No, Whole::No);
    for name in names {
        if name.eq_ignore_ascii_case("all") {
            goals.extend(Goal::ALL);
            for process in [&mut whole, &mut start] {
                if *process == Whole::No {
                    *process = Whole::IfBuilt;
                }
            }
            continue;
        }
        if name.eq_ignore_ascii_case("W") {
            whole = Whole::Asked;
            continue;
        }
        if name.eq_ignore_ascii_case("S") {
            start = Whole::Asked;
            continue;
        }
        if name.eq_ignore_ascii_case("C") {
            continue;
        }
        goals.push(Goal::parse(name).ok_or_else(|| {
            format!("no goal {name:?}: P1 ... P8, M1, R1, R2, T1, W, S, C or all")
        })?);
    }
    goals.sort();
    goals.dedup();
    Ok((goals, whole, start))
}

/// Measures W or S (`id`) and prints its report; returns 1 if it could not run.
fn run_process(id: char, args: &Args, how: Whole, default_runs: usize) -> usize {
    let arbor = match args.arbor.clone().map_or_else(whole::arbor_beside_me, Ok) {
        Ok(arbor) => arbor,
        Err(why) if how == Whole::IfBuilt => {
            println!("\n{id} skipped: {why:#}");
            return 0;
        }
        Err(why) => {
            println!("\n{id} could not run: {why:#}");
            eprintln!("{id} could not run: {why:#}");
            return 1;
        }
    };
    let runs = args
        .runs
        .unwrap_or(if args.quick { 1 } else { default_runs })
        .max(1);
    println!();
    let printed = if id == 'W' {
        whole::run(arbor, runs).map(|measured| measured.print())
    } else {
        startup::run(arbor, runs).map(|measured| measured.print())
    };
    match printed {
        Ok(()) => 0,
        Err(why) => {
            println!("{id} could not run: {why:#}");
            eprintln!("{id} could not run: {why:#}");
            1
        }
    }
}

/// Measures C and F and prints their report; returns 1 if they could not run.
async fn run_cluster(quick: bool) -> usize {
    let measured = async {
        let arbord = cluster::arbord_beside_me()?;
        let url = std::env::var("ARBOR_DATABASE_URL")
            .map_err(|_| anyhow::anyhow!("C needs a PostgreSQL server: set ARBOR_DATABASE_URL"))?;
        cluster::run(arbord, url, quick).await
    };
    println!();
    match measured.await {
        Ok(measured) => {
            measured.print();
            0
        }
        Err(why) => {
            println!("C could not run: {why:#}");
            eprintln!("C could not run: {why:#}");
            1
        }
    }
}

/// Runs each goal, prints the report; returns how many could not run.
async fn run(goals: &[Goal], sizes: &Sizes, workers: usize) -> usize {
    let mut outcomes = vec![];
    let mut failed = vec![];
    for &goal in goals {
        // A goal that panics (the testkit panics where a test would fail)
        // could not run; the others still do.
        match AssertUnwindSafe(goal.run(sizes)).catch_unwind().await {
            Ok(Ok(outcome)) => outcomes.push(outcome),
            Ok(Err(e)) => failed.push((goal, format!("{e:#}"))),
            Err(panic) => failed.push((goal, panic_message(&panic))),
        }
    }
    println!(
        "arbor-bench: {} ({}), tokio multi-thread with {workers} workers, temporary directory {}",
        goals.iter().map(|g| g.id()).collect::<Vec<_>>().join(" "),
        if sizes.quick {
            "--quick: small sizes, speed not judged"
        } else {
            "default sizes"
        },
        workload::temp_dir(),
    );
    println!();
    report::print_table(&outcomes);
    println!();
    for &goal in goals {
        if let Some(outcome) = outcomes.iter().find(|o| o.id == goal.id()) {
            println!("{}", outcome.line());
        } else if let Some((_, why)) = failed.iter().find(|(g, _)| *g == goal) {
            println!("{} could not run: {why}", goal.id());
            eprintln!("{} could not run: {why}", goal.id());
        }
    }
    failed.len()
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .map(|m| format!("panicked: {m}"))
        .unwrap_or_else(|| "panicked".into())
}
