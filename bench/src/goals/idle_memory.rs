//! P4: resident memory per idle job. `idle_jobs` leaves, each inside its
//! first model call (which takes an hour), below steps of runs of 1,000
//! children each; the process's RSS (`/proc/self/statm`) before the runs
//! start and once every job is idle, the difference divided by the leaves.
//! Beside it, the same for as many bare idle ractor actors (`Echo`s that
//! are never asked anything).
//!
//! Each measurement, of either side, warm-up included, runs in a fresh
//! process (this binary again, `--child`): memory a process once touched
//! stays in its RSS after it is freed, so a second measurement in the same
//! process would reuse it and see almost nothing.

use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Unit, figure};
use crate::trial::{interleaved, progress};
use crate::workload::{BUDGET_TOKENS, Tally, delegating, leaf_waiting, limits};
use anyhow::{Context, bail};
use arbor_testkit::TestNode;
use arbor_tests::bare::Echo;
use ractor::Actor;

/// Children below one step: runs are as many as it takes.
const CHILDREN_PER_RUN: usize = 1_000;

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let plan = Plan::of(sizes.idle_jobs);
    let mut before_after = vec![];
    let row = interleaved(
        "P4",
        "",
        async |_| Ok(child(Side::Bare, plan).await?.per_job()),
        async |_| {
            let measured = child(Side::Arbor, plan).await?;
            before_after.push((measured.before, measured.after));
            Ok(measured.per_job())
        },
    )
    .await?;
    let (before, after) = before_after.last().copied().unwrap_or_default();
    let size_note = if sizes.idle_jobs == super::IDLE_JOBS_DEFAULT || sizes.quick {
        String::new()
    } else {
        format!(
            " (--jobs {}; the goal's size is {})",
            sizes.idle_jobs,
            super::IDLE_JOBS_DEFAULT
        )
    };
    Ok(Outcome {
        id: "P4",
        what: "memory per idle job",
        unit: Unit::Bytes,
        per: "RSS/job",
        bound: Bound::AtMost(3.0),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "size that ran: {} idle jobs{size_note}: {} run(s) at once, each a step delegating {} leaves in one call; the steps' own memory is counted, the figure is divided by the leaves",
                plan.jobs(),
                plan.runs,
                plan.children
            ),
            format!(
                "arbor, last repetition: RSS {} with the node started and no run, {} with every job idle",
                figure(before as f64, Unit::Bytes),
                figure(after as f64, Unit::Bytes)
            ),
            format!(
                "baseline: {} bare idle actors spawned and held; every measurement of either side in a fresh process",
                plan.jobs()
            ),
        ],
    })
}

/// Which side a child process measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Bare,
    Arbor,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Bare => "p4-bare",
            Side::Arbor => "p4-arbor",
        }
    }

    pub fn parse(text: &str) -> Option<Side> {
        [Side::Bare, Side::Arbor]
            .into_iter()
            .find(|s| s.name() == text)
    }
}

/// How the idle jobs are laid out.
#[derive(Clone, Copy, Debug)]
struct Plan {
    runs: usize,
    children: usize,
}

impl Plan {
    fn of(jobs: usize) -> Plan {
        let jobs = jobs.max(1);
        let runs = jobs.div_ceil(CHILDREN_PER_RUN);
        Plan {
            runs,
            children: jobs.div_ceil(runs),
        }
    }

    fn jobs(self) -> usize {
        self.runs * self.children
    }
}

/// One child process's figures, as it printed them.
#[derive(Clone, Copy, Debug)]
struct Measured {
    before: u64,
    after: u64,
    jobs: u64,
}

impl Measured {
    fn per_job(self) -> f64 {
        (self.after.saturating_sub(self.before)) as f64 / self.jobs as f64
    }
}

/// Runs this binary again to measure one side in a fresh process.
async fn child(side: Side, plan: Plan) -> anyhow::Result<Measured> {
    let exe = std::env::current_exe().context("this binary's path")?;
    let output = tokio::process::Command::new(exe)
        .args(["--child", side.name(), "--jobs", &plan.jobs().to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .context("the measuring process did not start")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the {} process failed ({}): {}",
            side.name(),
            output.status,
            stdout.trim()
        );
    }
    parse(&stdout).with_context(|| format!("the {} process printed {stdout:?}", side.name()))
}

/// `rss_before=<bytes> rss_after=<bytes> jobs=<n>`
fn parse(line: &str) -> Option<Measured> {
    let field = |key: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))?
            .parse()
            .ok()
    };
    Some(Measured {
        before: field("rss_before")?,
        after: field("rss_after")?,
        jobs: field("jobs")?,
    })
}

/// The child process: measures one side and prints one line.
pub async fn child_main(side: Side, jobs: usize) -> anyhow::Result<()> {
    let plan = Plan::of(jobs);
    let measured = match side {
        Side::Bare => bare_idle(plan.jobs()).await?,
        Side::Arbor => arbor_idle(plan).await?,
    };
    println!(
        "rss_before={} rss_after={} jobs={}",
        measured.before, measured.after, measured.jobs
    );
    Ok(())
}

async fn bare_idle(jobs: usize) -> anyhow::Result<Measured> {
    let before = rss_bytes()?;
    let mut actors = Vec::with_capacity(jobs);
    for _ in 0..jobs {
        actors.push(Actor::spawn(None, Echo, ()).await?.0);
    }
    let after = rss_bytes()?;
    for actor in &actors {
        actor.stop(None);
    }
    Ok(Measured {
        before,
        after,
        jobs: jobs as u64,
    })
}

async fn arbor_idle(plan: Plan) -> anyhow::Result<Measured> {
    let (fan, leaf) = (delegating("leaf", plan.children), leaf_waiting());
    let node =
        TestNode::start_with_config(&limits(plan.children, 2), &[("fan", &fan), ("leaf", &leaf)])
            .await;
    let tally = Tally::install(&node);
    let before = rss_bytes()?;
    let name = format!("P4 {}", Side::Arbor.name());
    progress(&name, &format!("starting {} idle jobs", plan.jobs()));
    for _ in 0..plan.runs {
        node.run_agent_with_budget("fan", "go", Some(BUDGET_TOKENS))
            .await;
    }
    let (runs, jobs) = (plan.runs as u64, plan.jobs() as u64);
    tally
        .wait("every job to be idle", |c| {
            c.running >= runs + jobs && c.first_reservations >= runs + jobs && c.model_calls >= runs
        })
        .await?;
    let after = rss_bytes()?;
    progress(&name, "measured; crashing the node");
    drop(node.crash().await);
    Ok(Measured {
        before,
        after,
        jobs,
    })
}

/// This process's resident set, in bytes.
fn rss_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").context("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .context("/proc/self/statm has no resident field")?;
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .context("sysconf(PAGE_SIZE)")?
        .context("no page size")?;
    Ok(pages * page.max(1) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_line_parses_and_a_plan_covers_the_jobs() {
        let m = parse("rss_before=100 rss_after=300 jobs=4\n").unwrap();
        assert_eq!(m.per_job(), 50.0);
        assert!(parse("rss_before=1").is_none());
        let plan = Plan::of(100_000);
        assert_eq!((plan.runs, plan.children), (100, 1_000));
        assert_eq!(Plan::of(100).jobs(), 100);
        assert!(Plan::of(1_500).jobs() >= 1_500);
    }
}
