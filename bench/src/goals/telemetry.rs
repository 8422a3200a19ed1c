//! T1: traces (docs/operations.md, "Traces"). P2's fan-out on a node that
//! exports every run's trace over OTLP/HTTP to a collector on loopback,
//! beside the same fan-out on a node with telemetry off. Wall time from the
//! first start to the last run's end. Goal: at most 1.1x. Each repetition
//! runs baseline, arbor, arbor, baseline (`balanced`): in an A/A trial of
//! this workload (telemetry off on both nodes), run baseline then arbor,
//! the side measured second came out 1.04 to 1.44x the first. Balanced, an
//! A/A trial still scatters by 10-20% from run to run (a round's wall time
//! is mostly its journal flushes, and the disk's flush latency drifts), so
//! T1 takes `REPETITIONS_T1` repetitions and measures that A/A trial, the
//! control, in the same run: its ratio is printed beside T1's as the noise
//! floor the verdict stands on.
//!
//! The collector is a sink in this process (axum): it takes each export
//! and answers 200 with an empty `ExportTraceServiceResponse`, so what is
//! measured is arbor's side: folding, the durability wait, encoding and
//! sending.

use crate::goals::Sizes;
use crate::goals::durable_fan_out::FanOutNode;
use crate::report::{Bound, Outcome, Unit};
use crate::trial::{REPETITIONS, Rep, balanced};
use crate::workload::Flushes;
use anyhow::ensure;
use arbor_tests::measure::median;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// T1's repetitions of each side in a full run (a quick run takes the
/// usual `REPETITIONS`).
const REPETITIONS_T1: usize = 15;

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

/// What one side's measured rounds did besides their wall time.
#[derive(Default)]
struct Side {
    flushes: Flushes,
    /// The process's CPU time (user + system) over each measured round:
    /// what telemetry costs the machine, which the flush-bound wall time
    /// hides. Exporting can spill past a round's end into the next round,
    /// of either side.
    cpu: Vec<f64>,
}

impl Side {
    /// One round on `node`; its wall time in seconds.
    async fn round(&mut self, node: &FanOutNode, rep: Rep) -> anyhow::Result<f64> {
        let round = node.round().await?;
        self.flushes.add(rep, round.flushes, round.jobs as u64);
        if rep != Rep::Warmup {
            self.cpu.push(round.cpu.total().as_secs_f64());
        }
        Ok(round.wall.as_secs_f64())
    }

    /// The median CPU time of a round, in seconds.
    fn cpu(&self) -> f64 {
        median(&self.cpu)
    }

    fn cpu_ms(&self) -> f64 {
        (self.cpu() * 1e3).round()
    }
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
    let repetitions = if sizes.quick {
        REPETITIONS
    } else {
        REPETITIONS_T1
    };
    let (mut off_side, mut traced_side) = (Side::default(), Side::default());
    let row = balanced(
        "T1",
        "",
        repetitions,
        async |rep| off_side.round(&off, rep).await,
        async |rep| traced_side.round(&traced, rep).await,
    )
    .await?;
    ensure!(off.node.node().telemetry().is_none(), "the baseline traced");
    traced.node.node().close().await?;
    // The control: the same protocol with telemetry off on both sides.
    let control = FanOutNode::start(shape).await;
    let (mut off_again, mut control_side) = (Side::default(), Side::default());
    let control_row = balanced(
        "T1 control",
        "",
        repetitions,
        async |rep| off_again.round(&off, rep).await,
        async |rep| control_side.round(&control, rep).await,
    )
    .await?;
    control.node.shutdown().await;
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
                "process CPU a round (user + system): arbor {} ms, baseline {} ms ({:.2}x)",
                traced_side.cpu_ms(),
                off_side.cpu_ms(),
                traced_side.cpu() / off_side.cpu()
            ),
            format!(
                "control, the same protocol with telemetry off on both sides (the noise floor): wall {:.2}x ({} ms beside {} ms), CPU {:.2}x",
                control_row.ratio(),
                (control_row.arbor_median() * 1e3).round(),
                (control_row.baseline_median() * 1e3).round(),
                control_side.cpu() / off_again.cpu()
            ),
            format!(
                "journal flushes per job: arbor {:.2}, baseline {:.2}",
                traced_side.flushes.per_op(),
                off_side.flushes.per_op()
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
