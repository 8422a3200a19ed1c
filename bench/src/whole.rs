//! W: the fan-out as a new user runs it. Whole `arbor run examples/fanout
//! --flow fanout` processes (64 steps at once, each delegating 16 jobs in
//! one call: 1,088 steps and jobs), each on a fresh copy of the workspace,
//! its journal in the temporary directory, stdout to nowhere (plain output,
//! as a pipe or a log file gets). A run's figure is its wall time from the
//! spawn to the exit; its CPU is the process's, every thread (`getrusage` of
//! the children reaped).
//!
//! One warm-up run with `--json` checks what the timed runs then only
//! count on: that the run completes with every step and job done. The
//! timed runs must exit 0 (the run completed).
//!
//! The `arbor` measured is the one built beside this `arbor-bench`
//! (`cargo build --release -p arbor-bin -p arbor-bench`), or `--arbor`.
//! There is no baseline: the goal is absolute, P2's figure (10,000 jobs/s)
//! for the whole process.

use anyhow::{Context, ensure};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// P2's absolute figure, which the whole process is held to.
const GOAL_JOBS_PER_SECOND: f64 = 10_000.0;

/// What the runs measured.
pub struct Whole {
    pub arbor: PathBuf,
    pub jobs: usize,
    /// Wall time of each timed run, in the order they ran.
    pub walls: Vec<Duration>,
    /// CPU time (user + system) of each.
    pub cpus: Vec<Duration>,
}

/// The `arbor` beside the running `arbor-bench`.
pub fn arbor_beside_me() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("where arbor-bench is")?;
    let arbor = me.with_file_name("arbor");
    ensure!(
        arbor.is_file(),
        "no arbor beside {} (build it: cargo build --release -p arbor-bin -p arbor-bench)",
        me.display()
    );
    Ok(arbor)
}

/// The example workspace this measures.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fanout")
}

pub fn run(arbor: PathBuf, runs: usize) -> anyhow::Result<Whole> {
    let jobs = warm_up(&arbor)?;
    let (mut walls, mut cpus) = (vec![], vec![]);
    for n in 1..=runs {
        eprintln!("[W] run {n}/{runs}");
        let copy = fresh_copy()?;
        let start = Instant::now();
        let child = Command::new(&arbor)
            .arg("run")
            .arg(copy.path().join("fanout"))
            .args(["--flow", "fanout"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", arbor.display()))?;
        let (status, cpu) = wait(child)?;
        let wall = start.elapsed();
        ensure!(status == 0, "run {n}: arbor exited with status {status}");
        walls.push(wall);
        cpus.push(cpu);
    }
    Ok(Whole {
        arbor,
        jobs,
        walls,
        cpus,
    })
}

/// One run with `--json`: it must complete with every node done. Returns
/// how many steps and jobs it ran.
fn warm_up(arbor: &Path) -> anyhow::Result<usize> {
    eprintln!("[W] warm-up");
    let copy = fresh_copy()?;
    let out = Command::new(arbor)
        .arg("run")
        .arg(copy.path().join("fanout"))
        .args(["--flow", "fanout", "--json"])
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("starting {}", arbor.display()))?;
    ensure!(
        out.status.success(),
        "the warm-up run did not complete: {}",
        out.status
    );
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("the warm-up's --json document")?;
    let mut nodes = vec![&doc["run"]];
    let (mut jobs, mut done) = (0, 0);
    while let Some(node) = nodes.pop() {
        for child in node["children"].as_array().into_iter().flatten() {
            jobs += 1;
            done += usize::from(child["status"] == "done");
            nodes.push(child);
        }
    }
    ensure!(
        jobs > 0 && done == jobs,
        "the warm-up run had {done} of {jobs} steps and jobs done"
    );
    Ok(jobs)
}

fn fresh_copy() -> anyhow::Result<tempfile::TempDir> {
    copy_of(&workspace(), "fanout")
}

/// A temporary directory holding a copy of `workspace` as `name`.
pub fn copy_of(workspace: &Path, name: &str) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    copy_dir(workspace, &dir.path().join(name))?;
    Ok(dir)
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("making {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        // Only the workspace: a journal a run left in the source is not copied.
        if entry.file_name() == ".arbor" {
            continue;
        }
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Waits for the child, returning its exit status and CPU time: what the
/// children reaped in between used, every thread (this waits for one at a
/// time, so that is this child, and what it reaped itself).
pub fn wait(mut child: std::process::Child) -> anyhow::Result<(i32, Duration)> {
    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;
    let cpu = || -> anyhow::Result<Duration> {
        let usage = getrusage(UsageWho::RUSAGE_CHILDREN)?;
        let micros = usage.user_time().num_microseconds() + usage.system_time().num_microseconds();
        Ok(Duration::from_micros(micros as u64))
    };
    let before = cpu()?;
    let status = child
        .wait()
        .map_err(|e| anyhow::anyhow!("waiting for a child process: {e}"))?;
    Ok((status.code().unwrap_or(-1), cpu()? - before))
}

pub fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

impl Whole {
    pub fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / median(&self.walls).as_secs_f64()
    }

    /// The report: the runs, then one `W` line.
    pub fn print(&self) {
        use crate::report::{Unit, figure, verdict};
        let secs = |d: &Duration| figure(d.as_secs_f64(), Unit::Seconds);
        println!(
            "W each run: `{} run examples/fanout --flow fanout` on a fresh copy, {} steps and jobs, stdout to /dev/null; wall from spawn to exit, CPU from getrusage(RUSAGE_CHILDREN)",
            self.arbor.display(),
            self.jobs
        );
        println!(
            "W wall samples: {}",
            self.walls.iter().map(secs).collect::<Vec<_>>().join(" ")
        );
        println!(
            "W cpu samples:  {}",
            self.cpus.iter().map(secs).collect::<Vec<_>>().join(" ")
        );
        let rate = self.jobs_per_second();
        println!(
            "W wall={} cpu={} jobs={} rate={} goal=>={} {}",
            secs(&median(&self.walls)),
            secs(&median(&self.cpus)),
            self.jobs,
            figure(rate, Unit::PerSecond),
            figure(GOAL_JOBS_PER_SECOND, Unit::PerSecond),
            verdict(rate >= GOAL_JOBS_PER_SECOND)
        );
    }
}
