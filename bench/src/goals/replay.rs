//! R1 and R2: record and replay (docs/replay.md).
//!
//! R1, replay: the P2 fan-out (`runs` runs at once, each a step delegating
//! `children` jobs in one call), recorded once; each repetition replays
//! every recorded run at once, beside the same runs with the scripted
//! model, on the same node. Wall time from the first start to the last
//! run's end. Goal: a replay costs at most 1.2x the scripted run.
//!
//! R2, recording: the same fan-out against the mock provider (OpenAI's wire
//! format, streamed, on loopback), recorded beside not recorded, on two
//! nodes of the same workspace but `[record]`. Goal: at most 1.1x.

use crate::goals::{FanOut, Sizes};
use crate::report::{Bound, Outcome, Unit};
use crate::trial::interleaved;
use crate::workload::{BUDGET_TOKENS, Tally, delegating, limits};
use anyhow::{Context, ensure};
use arbor_protocol::RunId;
use arbor_testkit::TestNode;
use arbor_testkit::mock_provider::{Format, MockProvider, openai};
use arbor_testkit::replay::ReplayOptions;
use arbor_tests::agents::leaf_at_once;
use std::time::{Duration, Instant};

const RECORD: &str = "[record]\nmodels = true\n";

/// Starts `start` for each of `n` runs at once and waits until all ended
/// done: the wall time from the first start to the last end.
async fn round(
    node: &TestNode,
    tally: &Tally,
    n: usize,
    mut start: impl AsyncFnMut(usize) -> anyhow::Result<RunId>,
) -> anyhow::Result<(Duration, Vec<RunId>)> {
    let before = tally.counts().runs_finished;
    let began = Instant::now();
    let mut runs = Vec::with_capacity(n);
    for i in 0..n {
        runs.push(start(i).await?);
    }
    tally
        .wait("the runs to end", |c| c.runs_finished >= before + n as u64)
        .await?;
    let end = tally.last_run_finished().context("a run ended unseen")?;
    for &run in &runs {
        let status = node.tree(run).run_status();
        ensure!(
            status == arbor_protocol::Status::Done,
            "run {run} ended {status}"
        );
    }
    Ok((end - began, runs))
}

pub async fn replay(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shape = sizes.fan_out;
    let (fan, leaf) = (delegating("leaf", shape.children), leaf_at_once());
    let config = format!("{}{RECORD}", limits(shape.children.max(16), 2));
    let node = TestNode::start_with_config(&config, &[("fan", &fan[..]), ("leaf", &leaf)]).await;
    let tally = Tally::install(&node);
    let scripted = async |_: usize| {
        Ok(node
            .run_agent_with_budget("fan", "go", Some(BUDGET_TOKENS))
            .await)
    };
    // The recordings every replay repetition replays.
    let (_, recorded) = round(&node, &tally, shape.runs, scripted).await?;
    let mut checked = false;
    let row = interleaved(
        "R1",
        "",
        async |_| {
            Ok(round(&node, &tally, shape.runs, scripted)
                .await?
                .0
                .as_secs_f64())
        },
        async |_| {
            let (wall, replays) = round(&node, &tally, shape.runs, async |i| {
                node.replay(recorded[i], ReplayOptions::default())
                    .await
                    .map_err(anyhow::Error::from)
            })
            .await?;
            if !checked {
                let differences = node.replay_differences(recorded[0], replays[0]);
                ensure!(differences.is_empty(), "a replay differs: {differences:?}");
                checked = true;
            }
            Ok(wall.as_secs_f64())
        },
    )
    .await?;
    node.shutdown().await;
    Ok(Outcome {
        id: "R1",
        what: "replay of a recorded fan-out",
        unit: Unit::Seconds,
        per: "per round",
        bound: Bound::AtMost(1.2),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "each repetition: {} runs at once, each a step delegating {} children in one call: {} jobs; the baseline runs them with the scripted model, arbor replays {} recorded runs of the same workload (read from the journal, checked against the workspace, served by lineage); wall time from the first start to the last end",
                shape.runs,
                shape.children,
                shape.jobs(),
                shape.runs
            ),
            "the first replay's tree, accounts and events are checked equal to its recording"
                .into(),
        ],
    })
}

const FAN_PROMPT: &str = "You fan the work out.";
const LEAF_PROMPT: &str = "You do one part.";
const LEAF_DONE: &str = "part-done";

/// A node of the mock-provider fan-out, recorded or not.
/// Runs of a step that fans out, every call answered by the mock provider.
pub(super) struct MockFanOut {
    pub(super) node: TestNode,
    tally: Tally,
    shape: FanOut,
}

impl MockFanOut {
    /// A node on `mock`, its provider block with `provider` added, and
    /// `config` after (`[record]`, say).
    pub(super) async fn start(
        mock: &MockProvider,
        shape: FanOut,
        provider: &str,
        config: &str,
    ) -> MockFanOut {
        let fan = format!(
            "---\nmodel: mock/small\ndescription: delegates\nsubagents: [leaf]\n---\n{FAN_PROMPT}\n"
        );
        let leaf = format!("---\nmodel: mock/small\ndescription: one part\n---\n{LEAF_PROMPT}\n");
        let config = format!(
            "{}{}{config}",
            mock.arbor_toml(Format::Openai, provider),
            limits(shape.children.max(16), 2),
        );
        let node = TestNode::start_with_config(&config, &[("fan", &fan), ("leaf", &leaf)]).await;
        let tally = Tally::install(&node);
        MockFanOut { node, tally, shape }
    }

    /// Queues one round's answers: each fan's report (asked once its
    /// children's results are in), each fan's delegate call, each leaf's
    /// answer (any request left: a leaf's). Then runs the round.
    pub(super) async fn round(&self, mock: &MockProvider) -> anyhow::Result<Duration> {
        let jobs =
            vec![serde_json::json!({"agent": "leaf", "request": "one part"}); self.shape.children];
        for _ in 0..self.shape.runs {
            mock.push_for(
                Format::Openai,
                LEAF_DONE,
                openai::stream("All parts are done.", &[], Some((200, 8))),
            );
        }
        for _ in 0..self.shape.runs {
            mock.push_for(
                Format::Openai,
                FAN_PROMPT,
                openai::stream(
                    "",
                    &[("delegate", serde_json::json!({"jobs": jobs}))],
                    Some((120, 40)),
                ),
            );
        }
        for _ in 0..self.shape.jobs() {
            mock.push(
                Format::Openai,
                openai::stream(LEAF_DONE, &[], Some((60, 4))),
            );
        }
        let node = &self.node;
        let (wall, _) = round(node, &self.tally, self.shape.runs, async |_| {
            Ok(node
                .run_agent_with_budget("fan", "go", Some(BUDGET_TOKENS))
                .await)
        })
        .await?;
        Ok(wall)
    }
}

pub async fn recording(sizes: &Sizes) -> anyhow::Result<Outcome> {
    // The mock answers from one queue, looked through per request: a
    // quarter of P2's runs keeps that look short.
    let shape = FanOut {
        runs: (sizes.fan_out.runs / 4).max(1),
        children: sizes.fan_out.children,
    };
    let (plain_mock, recorded_mock) = (MockProvider::start().await, MockProvider::start().await);
    let plain = MockFanOut::start(&plain_mock, shape, "", "").await;
    let recorded = MockFanOut::start(&recorded_mock, shape, "", RECORD).await;
    let row = interleaved(
        "R2",
        "",
        async |_| Ok(plain.round(&plain_mock).await?.as_secs_f64()),
        async |_| Ok(recorded.round(&recorded_mock).await?.as_secs_f64()),
    )
    .await?;
    let entries = recorded
        .node
        .journal()
        .tape(recorded_first(&recorded)?)?
        .len();
    plain.node.shutdown().await;
    recorded.node.shutdown().await;
    Ok(Outcome {
        id: "R2",
        what: "recording, against the mock provider",
        unit: Unit::Seconds,
        per: "per round",
        bound: Bound::AtMost(1.1),
        rows: vec![row],
        conditions: vec![],
        notes: vec![format!(
            "each repetition: {} runs at once, each a step delegating {} children in one call, every call streamed from the mock provider (OpenAI's wire format, loopback HTTP): {} jobs; the baseline's node does not record, arbor's records every exchange ({entries} recording entries a run); wall time from the first start to the last end",
            shape.runs,
            shape.children,
            shape.jobs()
        )],
    })
}

/// The first run of a node (the warm-up's), to count its recording.
fn recorded_first(fan: &MockFanOut) -> anyhow::Result<RunId> {
    fan.node
        .journal()
        .runs()?
        .first()
        .map(|r| r.id)
        .context("no run was recorded")
}
