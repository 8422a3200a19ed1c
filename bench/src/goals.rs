//! The goals, by id, and the sizes each runs at.

mod cpu_per_job;
mod delegate_round_trip;
mod durable_fan_out;
mod fairness;
pub mod idle_memory;
mod many_small_runs;
mod mcp_call;
mod rate_limit;
mod replay;
mod restart;
mod steering;
mod stop_subtree;
mod telemetry;

use crate::report::Outcome;
use arbor_tests::load::Shape;
use std::time::Duration;

/// One of arbor's performance goals (docs/benchmarks.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Goal {
    P1,
    P2,
    P3,
    P4,
    P5,
    P6,
    P7,
    /// Many small runs at once, over HTTP and embedded, beside P2.
    P8,
    /// An MCP call beside a bare rmcp client's (needs `npm ci --prefix tests/mcp`).
    M1,
    /// A recorded fan-out replayed, beside the same runs scripted.
    R1,
    /// A fan-out on the mock provider recorded, beside not recorded.
    R2,
    /// P2's fan-out exporting its trace, beside telemetry off.
    T1,
    /// A fan-out on the mock provider with rate limits that never bind, beside none.
    L1,
    /// A quiet tenant's run behind another's flood of the queue, beside the idle node.
    F1,
}

impl Goal {
    pub const ALL: [Goal; 14] = [
        Goal::P1,
        Goal::P2,
        Goal::P3,
        Goal::P4,
        Goal::P5,
        Goal::P6,
        Goal::P7,
        Goal::P8,
        Goal::M1,
        Goal::R1,
        Goal::R2,
        Goal::T1,
        Goal::L1,
        Goal::F1,
    ];

    /// `P3` or `p3`.
    pub fn parse(text: &str) -> Option<Goal> {
        Goal::ALL
            .into_iter()
            .find(|g| g.id().eq_ignore_ascii_case(text))
    }

    pub fn id(self) -> &'static str {
        match self {
            Goal::P1 => "P1",
            Goal::P2 => "P2",
            Goal::P3 => "P3",
            Goal::P4 => "P4",
            Goal::P5 => "P5",
            Goal::P6 => "P6",
            Goal::P7 => "P7",
            Goal::P8 => "P8",
            Goal::M1 => "M1",
            Goal::R1 => "R1",
            Goal::R2 => "R2",
            Goal::T1 => "T1",
            Goal::L1 => "L1",
            Goal::F1 => "F1",
        }
    }

    /// Measures the goal: warm-up and repetitions of both sides.
    pub async fn run(self, sizes: &Sizes) -> anyhow::Result<Outcome> {
        match self {
            Goal::P1 => delegate_round_trip::run(sizes).await,
            Goal::P2 => durable_fan_out::run(sizes).await,
            Goal::P3 => stop_subtree::run(sizes).await,
            Goal::P4 => idle_memory::run(sizes).await,
            Goal::P5 => restart::run(sizes).await,
            Goal::P6 => steering::run(sizes).await,
            Goal::P7 => cpu_per_job::run(sizes).await,
            Goal::P8 => many_small_runs::run(sizes).await,
            Goal::M1 => mcp_call::run(sizes).await,
            Goal::R1 => replay::replay(sizes).await,
            Goal::R2 => replay::recording(sizes).await,
            Goal::T1 => telemetry::run(sizes).await,
            Goal::L1 => rate_limit::run(sizes).await,
            Goal::F1 => fairness::run(sizes).await,
        }
    }
}

/// How much of everything each goal does in one repetition.
#[derive(Clone, Debug)]
pub struct Sizes {
    pub quick: bool,
    /// P1: delegate calls in one run, one after another.
    pub delegate_calls: usize,
    /// P2 and P7: runs at once, and children each run's step delegates.
    pub fan_out: FanOut,
    /// P3: children per level below the step, one tree of each shape.
    pub stop_flat: Vec<usize>,
    pub stop_deep: Vec<usize>,
    /// P4: idle jobs.
    pub idle_jobs: usize,
    /// P5: records in the journal, and steps and jobs open at the crash.
    pub journal_records: u64,
    pub open_jobs: usize,
    /// P6: concurrent senders, and what each sends to arbor and to the bare actor.
    pub steer_senders: usize,
    pub steers_each: usize,
    pub casts_each: usize,
    /// M1: MCP calls one after another, in each repetition of each side.
    pub mcp_calls: usize,
    /// P8: clients and the children of each run, and how long each
    /// repetition drives them.
    pub load: Shape,
    pub load_seconds: Duration,
}

/// A fan-out workload: `runs` runs at once, each a step that delegates
/// `children` jobs in one call.
#[derive(Clone, Copy, Debug)]
pub struct FanOut {
    pub runs: usize,
    pub children: usize,
}

impl FanOut {
    pub fn jobs(self) -> usize {
        self.runs * self.children
    }
}

/// P4's size unless `--jobs` says otherwise.
pub const IDLE_JOBS_DEFAULT: usize = 100_000;

impl Sizes {
    pub fn default_sizes() -> Sizes {
        Sizes {
            quick: false,
            delegate_calls: 200,
            fan_out: FanOut {
                runs: 64,
                children: 16,
            },
            stop_flat: vec![10_000],
            stop_deep: vec![10, 10, 10, 10],
            idle_jobs: IDLE_JOBS_DEFAULT,
            journal_records: 1_000_000,
            open_jobs: 10_000,
            steer_senders: 64,
            steers_each: 50,
            casts_each: 2_000,
            mcp_calls: 200,
            load: Shape {
                clients: 50,
                fanout: 8,
            },
            load_seconds: Duration::from_secs(3),
        }
    }

    /// Small enough for a debug build in CI: each goal runs and reports.
    pub fn quick_sizes() -> Sizes {
        Sizes {
            quick: true,
            delegate_calls: 10,
            fan_out: FanOut {
                runs: 4,
                children: 4,
            },
            stop_flat: vec![40],
            stop_deep: vec![2, 2, 2, 2],
            idle_jobs: 100,
            journal_records: 5_000,
            open_jobs: 40,
            steer_senders: 4,
            steers_each: 5,
            casts_each: 100,
            mcp_calls: 10,
            load: Shape {
                clients: 4,
                fanout: 2,
            },
            load_seconds: Duration::from_millis(300),
        }
    }
}
