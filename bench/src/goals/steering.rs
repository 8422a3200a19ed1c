//! P6: steering throughput to one running step. The step is inside its
//! first model call, which takes an hour, so every message stays queued.
//! `steer_senders` tasks each send `steers_each` messages one after
//! another (`EmbeddedNode::steer`: a call that is answered once the message
//! is queued and journaled); messages per second of wall time until the
//! last answer.
//!
//! The baseline: as many tasks casting to one bare ractor actor that counts
//! them, timed until it has counted every cast. Each sends `casts_each`, more
//! than arbor's senders, so its wall time is not down to the clock's grain;
//! the figure is a rate either way.

use crate::bare::{Counter, CounterArgs};
use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Unit};
use crate::trial::interleaved;
use crate::workload::{BUDGET_TOKENS, Flushes, Tally, leaf_waiting};
use anyhow::Context;
use arbor_protocol::NodeKind;
use arbor_testkit::TestNode;
use ractor::Actor;
use std::sync::Arc;
use std::time::Instant;

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let (senders, steers, casts) = (sizes.steer_senders, sizes.steers_each, sizes.casts_each);
    let node = Arc::new(TestNode::start(&[("listener", &leaf_waiting())]).await);
    let tally = Tally::install(&node);
    let run = node
        .run_agent_with_budget("listener", "go", Some(BUDGET_TOKENS))
        .await;
    tally
        .wait("the step to be inside its model call", |c| {
            c.running >= 1 && c.first_reservations >= 1
        })
        .await?;
    let step = node
        .tree(run)
        .nodes()
        .find(|(_, n)| n.kind == NodeKind::Step)
        .map(|(id, _)| id)
        .context("the run has no step")?;

    let mut flushes = Flushes::default();
    let row = interleaved(
        "P6",
        "",
        async |_| bare_casts(senders, casts).await,
        async |rep| {
            let flushed = node.journal().flush_count();
            let start = Instant::now();
            let tasks: Vec<_> = (0..senders)
                .map(|_| {
                    let node = node.clone();
                    tokio::spawn(async move {
                        for _ in 0..steers {
                            node.steer(step, "keep going").await?;
                        }
                        Ok::<_, arbor_protocol::Refusal>(())
                    })
                })
                .collect();
            for task in tasks {
                task.await?.context("a steering message was refused")?;
            }
            let rate = (senders * steers) as f64 / start.elapsed().as_secs_f64();
            let messages = (senders * steers) as u64;
            flushes.add(rep, node.journal().flush_count() - flushed, messages);
            Ok(rate)
        },
    )
    .await?;
    Arc::into_inner(node)
        .context("a sender still holds the node")?
        .shutdown()
        .await;
    Ok(Outcome {
        id: "P6",
        what: "steering one running job",
        unit: Unit::PerSecond,
        per: "msgs/s",
        bound: Bound::AtLeast(0.5),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "arbor: {senders} concurrent senders x {steers} steers each to one step waiting in its model call; each steer answered once queued and journaled"
            ),
            format!(
                "baseline: {senders} concurrent senders x {casts} casts each to one bare actor, until it has counted them all"
            ),
            format!("journal flushes per message: {:.2}", flushes.per_op()),
        ],
    })
}

/// Messages per second from `senders` tasks casting `each` to one counter.
async fn bare_casts(senders: usize, each: usize) -> anyhow::Result<f64> {
    let (reached, counted) = tokio::sync::oneshot::channel();
    let target = (senders * each) as u64;
    let (counter, exited) = Actor::spawn(None, Counter, CounterArgs { target, reached }).await?;
    let start = Instant::now();
    for _ in 0..senders {
        let counter = counter.clone();
        tokio::spawn(async move {
            for _ in 0..each {
                let _ = counter.cast(());
            }
        });
    }
    counted
        .await
        .context("the counter stopped before counting")?;
    let rate = target as f64 / start.elapsed().as_secs_f64();
    counter.stop(None);
    exited.await?;
    Ok(rate)
}
