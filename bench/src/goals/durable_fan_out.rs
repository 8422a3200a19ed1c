//! P2: durable fan-out throughput. `runs` runs start at once, each a step
//! that delegates `children` jobs in one call (wait = true); each child
//! submits on its first turn. Jobs per second of wall time, from the first
//! `start_run` to the last `RunFinished` the observer sees.
//!
//! The baseline is the same workload on a node, on the same filesystem,
//! whose journal does not `fdatasync` (`workload::syncs_off`).

use crate::goals::{FanOut, Sizes};
use crate::report::{Bound, Outcome, Unit, figure, verdict};
use crate::trial::interleaved;
use crate::workload::{BUDGET_TOKENS, Flushes, Tally, delegating, filesystem, syncs_off};
use anyhow::{Context, ensure};
use arbor_testkit::TestNode;
use arbor_tests::agents::leaf_at_once;
use arbor_tests::measure::Cpu;
use std::time::{Duration, Instant};

/// The absolute goal beside the ratio.
const ABSOLUTE_GOAL_JOBS_PER_SECOND: f64 = 10_000.0;

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shape = sizes.fan_out;
    let unsynced = FanOutNode::start(shape).await;
    syncs_off(&unsynced.node);
    let synced = FanOutNode::start(shape).await;
    let (mut unsynced_flushes, mut synced_flushes) = (Flushes::default(), Flushes::default());
    let row = interleaved(
        "P2",
        "",
        async |rep| {
            let syncs_before = unsynced.node.journal().sync_count();
            let round = unsynced.round().await?;
            ensure!(
                unsynced.node.journal().sync_count() == syncs_before,
                "the baseline's journal synced with its syncs off"
            );
            unsynced_flushes.add(rep, round.flushes, round.jobs as u64);
            Ok(round.jobs_per_second())
        },
        async |rep| {
            let round = synced.round().await?;
            synced_flushes.add(rep, round.flushes, round.jobs as u64);
            Ok(round.jobs_per_second())
        },
    )
    .await?;
    let arbor = row.arbor_median();
    let notes = vec![
        format!(
            "absolute: arbor {} against >={}: {}",
            figure(arbor, Unit::PerSecond),
            figure(ABSOLUTE_GOAL_JOBS_PER_SECOND, Unit::PerSecond),
            verdict(arbor >= ABSOLUTE_GOAL_JOBS_PER_SECOND)
        ),
        format!(
            "journal flushes per job: arbor {:.2}, baseline {:.2}",
            synced_flushes.per_op(),
            unsynced_flushes.per_op()
        ),
        format!(
            "each repetition: {} runs at once, each a step delegating {} children in one call (wait = true), each child submitting on its first turn: {} jobs; its figure is jobs over the wall time from the first start to the last run's end",
            shape.runs,
            shape.children,
            shape.jobs()
        ),
        format!(
            "both journals on {}; the baseline's with its syncs off (Faults::skip_syncs: its log is written and never fdatasynced; 0 syncs checked each round)",
            filesystem(&synced.node.data_dir()),
        ),
    ];
    synced.node.shutdown().await;
    unsynced.node.shutdown().await;
    Ok(Outcome {
        id: "P2",
        what: "durable fan-out",
        unit: Unit::PerSecond,
        per: "jobs/s",
        bound: Bound::AtLeast(0.5),
        rows: vec![row],
        conditions: vec![],
        notes,
    })
}

/// A node with a fan-out parent and a leaf, and its tally.
pub struct FanOutNode {
    pub node: TestNode,
    tally: Tally,
    shape: FanOut,
}

/// What one round of a fan-out measured.
pub struct Round {
    pub jobs: usize,
    pub wall: Duration,
    /// Process CPU time from the first start to the end of the wait.
    pub cpu: Cpu,
    /// Journal flushes over the same time.
    pub flushes: u64,
}

impl Round {
    pub fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / self.wall.as_secs_f64()
    }
}

impl FanOutNode {
    pub async fn start(shape: FanOut) -> FanOutNode {
        Self::start_with(shape, "").await
    }

    /// As `start`, with more of arbor.toml.
    pub async fn start_with(shape: FanOut, extra: &str) -> FanOutNode {
        let (fan, leaf) = (delegating("leaf", shape.children), leaf_at_once());
        let agents = [("fan", &fan[..]), ("leaf", &leaf)];
        // The default caps allow 16 children under one parent.
        let limits = crate::workload::limits(shape.children.max(16), 2);
        let config = format!("{limits}{extra}");
        let node = TestNode::start_with_config(&config, &agents).await;
        let tally = Tally::install(&node);
        FanOutNode { node, tally, shape }
    }

    /// Starts every run of the shape at once and waits until all have ended done.
    pub async fn round(&self) -> anyhow::Result<Round> {
        let before = self.tally.counts().runs_finished;
        let flushed = self.node.journal().flush_count();
        let (cpu, start) = (Cpu::now(), Instant::now());
        let mut runs = Vec::with_capacity(self.shape.runs);
        for _ in 0..self.shape.runs {
            runs.push(
                self.node
                    .run_agent_with_budget("fan", "go", Some(BUDGET_TOKENS))
                    .await,
            );
        }
        let runs_total = self.shape.runs as u64;
        self.tally
            .wait("the fan-out runs to end", |c| {
                c.runs_finished >= before + runs_total
            })
            .await?;
        let cpu = Cpu::now().since(cpu);
        let flushes = self.node.journal().flush_count() - flushed;
        let end = self
            .tally
            .last_run_finished()
            .context("a run ended unseen")?;
        for run in runs {
            let done = self.node.jobs_done(run, "leaf");
            ensure!(
                done == self.shape.children,
                "a fan-out run ended with {done} of its {} children done",
                self.shape.children
            );
        }
        Ok(Round {
            jobs: self.shape.jobs(),
            wall: end - start,
            cpu,
            flushes,
        })
    }
}
