//! S: what a small run costs as a whole process. `arbor run --agent lead`
//! of `bench/start` (one step delegating one job, the scripted model, its
//! journal in the workspace's `.arbor`, made fresh for each run) beside a
//! bare process of our own that starts a tokio runtime, opens a fresh sled
//! database, inserts one 200-byte record, flushes it and exits
//! (`arbor-bench --child start-bare DIR`), and beside `/bin/true` (what
//! any process costs here: fork, exec, exit, wait).
//!
//! Each repetition runs the three in turn (true, bare, arbor), so they
//! share the machine's moment; one unmeasured warm-up of each first, which
//! also checks, with `--json`, that the run completes with both nodes done.
//! A figure is the wall time from the spawn to the exit; the ratio is
//! arbor's median over the bare process's. Goal: under 2.

use crate::whole::{copy_of, median, wait};
use anyhow::{Context, ensure};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const GOAL: f64 = 2.0;

/// What the runs measured, each side's samples in run order.
pub struct Startup {
    pub arbor: PathBuf,
    pub true_: Vec<Duration>,
    pub bare: Vec<Duration>,
    pub run: Vec<Duration>,
    /// arbor's CPU (user + system, every thread) per run.
    pub run_cpu: Vec<Duration>,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("start")
}

/// The bare side, in the child process: tokio, a fresh sled, one durable record.
pub fn bare_child(dir: &Path) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("a tokio runtime")?;
    runtime.block_on(async {
        let db = sled::open(dir).with_context(|| format!("opening sled at {}", dir.display()))?;
        db.insert(b"run", vec![7u8; 200])?;
        db.flush_async().await?;
        anyhow::Ok(())
    })
}

pub fn run(arbor: PathBuf, repetitions: usize) -> anyhow::Result<Startup> {
    let me = std::env::current_exe().context("where arbor-bench is")?;
    let true_ = || timed(Command::new("/bin/true"), "/bin/true");
    let bare = || {
        let dir = tempfile::tempdir().context("a temporary directory")?;
        let mut bare = Command::new(&me);
        bare.args(["--child", "start-bare"])
            .arg(dir.path().join("db"));
        timed(bare, "the bare process")
    };
    let run = || {
        let copy = copy_of(&workspace(), "start")?;
        let mut run = Command::new(&arbor);
        run.arg("run")
            .arg(copy.path().join("start"))
            .args(["--agent", "lead", "--input", "the work"]);
        timed(run, "arbor run")
    };
    eprintln!("[S] warm-up");
    check_completes(&arbor)?;
    true_()?;
    bare()?;
    let mut measured = Startup {
        arbor: arbor.clone(),
        true_: vec![],
        bare: vec![],
        run: vec![],
        run_cpu: vec![],
    };
    for n in 1..=repetitions {
        eprintln!("[S] rep {n}/{repetitions}");
        measured.true_.push(true_()?.0);
        measured.bare.push(bare()?.0);
        let (wall, cpu) = run()?;
        measured.run.push(wall);
        measured.run_cpu.push(cpu);
    }
    Ok(measured)
}

/// Spawns `command` with no stdio, waits; its wall time and CPU. It must exit 0.
fn timed(mut command: Command, what: &str) -> anyhow::Result<(Duration, Duration)> {
    let start = Instant::now();
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let (status, cpu) = wait(child)?;
    let wall = start.elapsed();
    ensure!(status == 0, "{what} exited with status {status}");
    Ok((wall, cpu))
}

/// The warm-up's run, with `--json`: both nodes must be done.
fn check_completes(arbor: &Path) -> anyhow::Result<()> {
    let copy = copy_of(&workspace(), "start")?;
    let out = Command::new(arbor)
        .arg("run")
        .arg(copy.path().join("start"))
        .args(["--agent", "lead", "--input", "the work", "--json"])
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("starting {}", arbor.display()))?;
    ensure!(out.status.success(), "the warm-up run: {}", out.status);
    let doc: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("the warm-up's --json document")?;
    let step = &doc["run"]["children"][0];
    ensure!(
        step["status"] == "done" && step["children"][0]["status"] == "done",
        "the warm-up run did not finish its step and its job: {}",
        doc["run"]
    );
    Ok(())
}

impl Startup {
    pub fn ratio(&self) -> f64 {
        median(&self.run).as_secs_f64() / median(&self.bare).as_secs_f64()
    }

    /// The report: the samples, then one `S` line.
    pub fn print(&self) {
        use crate::report::{Unit, figure, significant, verdict};
        let secs = |d: &Duration| figure(d.as_secs_f64(), Unit::Seconds);
        let all = |v: &[Duration]| v.iter().map(secs).collect::<Vec<_>>().join(" ");
        println!(
            "S each repetition: /bin/true, then the bare process (tokio + a fresh sled + one flushed record), then `{} run bench/start --agent lead` on a fresh copy (one step, one job); wall from spawn to exit",
            self.arbor.display()
        );
        println!("S /bin/true samples: {}", all(&self.true_));
        println!("S bare samples:      {}", all(&self.bare));
        println!("S arbor samples:     {}", all(&self.run));
        println!(
            "S arbor cpu samples: {} (getrusage of the child: every thread)",
            all(&self.run_cpu)
        );
        println!(
            "S /bin/true median {}: arbor is {}x it",
            secs(&median(&self.true_)),
            significant(median(&self.run).as_secs_f64() / median(&self.true_).as_secs_f64())
        );
        let ratio = self.ratio();
        println!(
            "S baseline={} arbor={} ratio={} goal=<=2 {}",
            secs(&median(&self.bare)),
            secs(&median(&self.run)),
            significant(ratio),
            verdict(ratio <= GOAL)
        );
    }
}
