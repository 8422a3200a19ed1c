//! T1: traces (docs/operations.md, "Traces"). P2's fan-out on a node that
//! exports every run's trace over OTLP/HTTP to a collector on loopback,
//! beside the same fan-out on a node with telemetry off. Wall time from the
//! first start to the last run's end. Goal: at most 1.1x. Each repetition
//! runs baseline, arbor, arbor, baseline (`balanced`): in an A/A trial of
//! this workload (telemetry off on both nodes), run baseline then arbor,
//! the side measured second came out 1.04 to 1.44x the first.
//!
//! The collector is a sink in this process (axum): it takes each export
//! and answers 200 with an empty `ExportTraceServiceResponse`, so what is
//! measured is arbor's side: folding, the durability wait, encoding and
//! sending.

use crate::goals::Sizes;
use crate::goals::durable_fan_out::FanOutNode;
use crate::report::{Bound, Outcome, Unit};
use crate::trial::balanced;
use crate::workload::Flushes;
use anyhow::ensure;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A collector that takes everything: the address of its OTLP endpoint,
/// and the requests it took.
async fn sink() -> anyhow::Result<(String, Arc<AtomicU64>)> {
    let taken = Arc::new(AtomicU64::new(0));
    let counted = taken.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |_: axum::body::Bytes| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::Relaxed);
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{address}"), taken))
}

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shape = sizes.fan_out;
    let (endpoint, requests) = sink().await?;
    let off = FanOutNode::start(shape).await;
    let traced = FanOutNode::start_with(
        shape,
        &format!("[telemetry]\notlp_endpoint = {endpoint:?}\n"),
    )
    .await;
    let (mut off_flushes, mut traced_flushes) = (Flushes::default(), Flushes::default());
    let row = balanced(
        "T1",
        "",
        async |rep| {
            let round = off.round().await?;
            off_flushes.add(rep, round.flushes, round.jobs as u64);
            Ok(round.wall.as_secs_f64())
        },
        async |rep| {
            let round = traced.round().await?;
            traced_flushes.add(rep, round.flushes, round.jobs as u64);
            Ok(round.wall.as_secs_f64())
        },
    )
    .await?;
    ensure!(off.node.node().telemetry().is_none(), "the baseline traced");
    traced.node.node().close().await?;
    let stats = traced
        .node
        .node()
        .telemetry()
        .expect("the traced node has telemetry");
    ensure!(
        stats.spans_exported > 0 && stats.spans_dropped == 0 && stats.events_dropped == 0,
        "the traces did not all go out: {stats:?}"
    );
    off.node.shutdown().await;
    Ok(Outcome {
        id: "T1",
        what: "traces exported, beside off",
        unit: Unit::Seconds,
        per: "per round",
        bound: Bound::AtMost(1.1),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "journal flushes per job: arbor {:.2}, baseline {:.2}",
                traced_flushes.per_op(),
                off_flushes.per_op()
            ),
            format!(
                "each repetition: {} runs at once, each a step delegating {} children in one call, each child submitting on its first turn: {} jobs; arbor's node exports every run's trace over OTLP/HTTP to a sink on loopback ({} spans in {} requests over all rounds, none dropped), the baseline's has telemetry off; wall time from the first start to the last end",
                shape.runs,
                shape.children,
                shape.jobs(),
                stats.spans_exported,
                requests.load(Ordering::Relaxed)
            ),
        ],
    })
}
