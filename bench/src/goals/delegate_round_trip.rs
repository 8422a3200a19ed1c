//! P1: one delegation, wait = true, from the parent's view: from the
//! parent's model reply that asks for it to the tool result, the child's
//! whole life and every journal commit of the path inside. Beside it, what
//! one durable write costs on the same filesystem: a 200-byte append and
//! `fdatasync`.
//!
//! A repetition is one run whose step delegates `delegate_calls` times in a
//! row, one call a turn, to a leaf that submits at once; its figure is the
//! median over its calls. Each call is timed by an observer in the emitting
//! task, at the step's `ModelCalled` and at its `ToolCalled { delegate }`
//! (event timestamps in the journal are milliseconds). The baseline's
//! repetition is as many raw appends into a file in the node's data dir,
//! its figure their median.

use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Unit, figure, verdict};
use crate::trial::interleaved;
use crate::workload::{BUDGET_TOKENS, Flushes, Marks, Tally, filesystem};
use anyhow::ensure;
use arbor_protocol::Status;
use arbor_testkit::TestNode;
use arbor_tests::agents::{leaf_at_once, serial_parent};
use arbor_tests::measure::{RawLog, RawWrite, median};
use std::time::{Duration, Instant};

/// The raw write of the baseline, in bytes.
const RAW_WRITE: usize = 200;

/// The absolute goal beside the ratio, on this machine.
const ABSOLUTE_GOAL: Duration = Duration::from_micros(600);

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let calls = sizes.delegate_calls;
    let parent = serial_parent(calls);
    let node = TestNode::start(&[("parent", &parent), ("leaf", &leaf_at_once())]).await;
    let tally = Tally::install(&node);
    let marks = Marks::install(&node, "delegate");
    let mut log = RawLog::create(&node.data_dir());
    let record = [0x5a_u8; RAW_WRITE];
    let mut flushes = Flushes::default();

    let row = interleaved(
        "P1",
        "",
        async |_| {
            let samples: Vec<f64> = (0..calls)
                .map(|_| {
                    let start = Instant::now();
                    log.write_synced(&record, RawWrite::Append);
                    start.elapsed().as_secs_f64()
                })
                .collect();
            Ok(median(&samples))
        },
        async |rep| {
            let before = tally.counts().runs_finished;
            let flushed = node.journal().flush_count();
            let run = node
                .run_agent_with_budget("parent", "go", Some(BUDGET_TOKENS))
                .await;
            tally
                .wait("the delegating run to end", |c| c.runs_finished > before)
                .await?;
            ensure!(
                node.tree(run).run_status() == Status::Done,
                "the delegating run did not end done"
            );
            let samples = marks.calls(run, calls)?;
            flushes.add(rep, node.journal().flush_count() - flushed, calls as u64);
            Ok(median(&samples))
        },
    )
    .await?;
    let arbor = row.arbor_median();
    let absolute = arbor <= ABSOLUTE_GOAL.as_secs_f64();
    let notes = vec![
        format!(
            "absolute: arbor {} a call against <={}: {}",
            figure(arbor, Unit::Seconds),
            figure(ABSOLUTE_GOAL.as_secs_f64(), Unit::Seconds),
            verdict(absolute)
        ),
        format!(
            "journal flushes per delegate call, the whole run counted: {:.2}",
            flushes.per_op()
        ),
        format!(
            "each repetition: one run whose step delegates {calls} times in a row (wait = true) to a leaf that submits at once; its figure is the median over its calls"
        ),
        format!(
            "baseline: {calls} appends of {RAW_WRITE} B, each followed by fdatasync, to a file in the node's data dir ({}); its figure is their median",
            filesystem(&node.data_dir())
        ),
    ];
    node.shutdown().await;
    Ok(Outcome {
        id: "P1",
        what: "delegate round trip (wait = true)",
        unit: Unit::Seconds,
        per: "per call",
        bound: Bound::AtMost(4.0),
        rows: vec![row],
        conditions: vec![],
        notes,
    })
}
