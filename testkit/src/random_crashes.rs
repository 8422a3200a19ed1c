//! Random crash points: the crash workload (`crash_workload`) runs in a
//! child process that is killed with SIGKILL at a seeded random moment; a
//! node then recovers on the same data dir in this process, without
//! resuming anything (the next point's child resumes the run, so crashes
//! pile on each other), and `checks::recovered` runs over the journal. The
//! crash driver's child is `arbor run`; the soak's is itself.
//!
//! ```no_run
//! # #[tokio::main] async fn main() {
//! use arbor_testkit::random_crashes::{self, Options};
//! // The child: anything that runs the workload's flow `crash` on a data dir.
//! let options = Options { points: 200, seed: 7, max_delay_ms: 400 };
//! let tally = random_crashes::run(&options, |workspace, data| {
//!     let mut child = tokio::process::Command::new("arbor");
//!     child.arg("run").arg(workspace).args(["--flow", "crash", "--data-dir"]).arg(data);
//!     child
//! }, |_| {}).await;
//! assert!(tally.violations.is_empty(), "{:?}", tally.violations);
//! # }
//! ```

use crate::{Seeded, checks, crash_workload};
use arbor_runtime::{DefaultModels, EmbeddedNode, Workspace};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Crash points that share one data dir: within one, crashes pile up on
/// each other; a fresh one keeps each check's full read of the journal short.
const POINTS_PER_JOURNAL: u64 = 25;

pub struct Options {
    /// Real crashes to reach (a child that finishes first is not one).
    pub points: u64,
    pub seed: u64,
    /// A crash comes at a moment drawn from 0 to this, after the child starts.
    pub max_delay_ms: u64,
}

/// What the points did and found.
#[derive(Debug, Default)]
pub struct Tally {
    pub crash_points: u64,
    pub runs_finished: u64,
    pub recoveries: u64,
    pub jobs_failed: u64,
    pub processes_killed: u64,
    pub accounts_checked: u64,
    pub records_checked: u64,
    /// Each names its point and the moment of its crash; the first ends the
    /// points.
    pub violations: Vec<String>,
    pub seconds: f64,
}

/// One line of what the points did and checked, then each violation on a
/// line of its own.
impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} crash points, {} runs finished between them, {} recoveries | {} jobs failed as interrupted, {} process groups killed | {} accounts and {} records checked | {} violations | {:.1}s",
            self.crash_points,
            self.runs_finished,
            self.recoveries,
            self.jobs_failed,
            self.processes_killed,
            self.accounts_checked,
            self.records_checked,
            self.violations.len(),
            self.seconds
        )?;
        for v in &self.violations {
            write!(f, "\nviolation: {v}")?;
        }
        Ok(())
    }
}

/// Runs crash points until `options.points` crashes (or three times as many
/// points, if the child keeps finishing first) or the first violation.
/// `child` makes the command that runs the workload's flow `crash` in the
/// workspace folder on the data dir it is given; `progress` is called after
/// every point.
pub async fn run(
    options: &Options,
    child: impl Fn(&Path, &Path) -> tokio::process::Command,
    progress: impl Fn(&Tally),
) -> Tally {
    let started = Instant::now();
    let mut rng = Seeded::new(options.seed);
    let temp = tempfile::tempdir().expect("a temporary directory");
    let ws = temp.path().join("ws");
    crash_workload(&ws).expect("the workload is written");
    let workspace = Workspace::load(&ws).expect("the workload loads");
    let mut tally = Tally::default();
    let mut seen = checks::Seen::default();
    let mut point = 0;
    while tally.crash_points < options.points
        && point < options.points * 3
        && tally.violations.is_empty()
    {
        point += 1;
        let journal = (point - 1) / POINTS_PER_JOURNAL;
        let data = temp.path().join(format!("data-{journal}"));
        if (point - 1) % POINTS_PER_JOURNAL == 0 {
            seen = checks::Seen::default();
            if journal > 0 {
                let _ = std::fs::remove_dir_all(temp.path().join(format!("data-{}", journal - 1)));
            }
        }
        let delay = rng.between(0, options.max_delay_ms);
        let mut running = child(&ws, &data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("the child starts");
        // The crash moment: the run ends first, or the child is killed mid-flight.
        match tokio::time::timeout(Duration::from_millis(delay), running.wait()).await {
            Ok(_) => tally.runs_finished += 1,
            Err(_) => {
                let _ = running.start_kill(); // SIGKILL
                let _ = running.wait().await;
                tally.crash_points += 1;
            }
        }
        let at = format!("point {point} (delay {delay} ms)");
        let node =
            EmbeddedNode::start_resuming(&workspace, &data, Arc::new(DefaultModels), |_, _| false)
                .await;
        let node = match node {
            Ok(node) => node,
            Err(e) => {
                tally.violations.push(format!("{at}: restart failed: {e}"));
                break;
            }
        };
        tally.recoveries += 1;
        tally.jobs_failed += node.recovery().jobs_failed.len() as u64;
        tally.processes_killed += node.recovery().processes_killed.len() as u64;
        for breach in &node.recovery().breaches {
            tally
                .violations
                .push(format!("{at}: recovery breach: {breach}"));
        }
        let checked = checks::recovered(node.journal(), &mut seen);
        tally.accounts_checked += checked.accounts;
        tally.records_checked += checked.records;
        tally
            .violations
            .extend(checked.violations.into_iter().map(|v| format!("{at}: {v}")));
        if node.shutdown().await.is_err() {
            tally
                .violations
                .push(format!("{at}: the node did not shut down cleanly"));
        }
        tally.seconds = started.elapsed().as_secs_f64();
        progress(&tally);
    }
    tally.seconds = started.elapsed().as_secs_f64();
    tally
}
