//! P7: process CPU time (user and system, every thread: tokio's workers,
//! the journal's flusher, sled's threads) per delegated job, over P2's
//! fan-out workload on a node whose journal is on the temporary directory.
//! Beside it, the CPU of a bare spawn, call and stop of as many ractor
//! actors, one after another, per actor.

use crate::bare;
use crate::goals::Sizes;
use crate::goals::durable_fan_out::FanOutNode;
use crate::report::{Bound, Outcome, Unit};
use crate::trial::interleaved;

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shape = sizes.fan_out;
    let jobs = shape.jobs();
    let node = FanOutNode::start(shape).await;
    let row = interleaved(
        "P7",
        "",
        async |_| Ok(bare::spawn_call_stop(jobs).await.total().as_secs_f64() / jobs as f64),
        async |_| {
            let round = node.round().await?;
            Ok(round.cpu.total().as_secs_f64() / round.jobs as f64)
        },
    )
    .await?;
    node.node.shutdown().await;
    Ok(Outcome {
        id: "P7",
        what: "CPU per delegated job",
        unit: Unit::Seconds,
        per: "CPU/job",
        bound: Bound::AtMost(20.0),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "arbor: P2's workload ({} runs at once, {} children each: {jobs} jobs), process CPU over the round divided by its jobs",
                shape.runs, shape.children
            ),
            format!(
                "baseline: {jobs} bare actors, one after another, each spawned, called once, stopped and waited for; CPU divided by {jobs}"
            ),
        ],
    })
}
