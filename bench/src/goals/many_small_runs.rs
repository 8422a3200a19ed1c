//! P8: many small runs, as a service's users send them. K clients each
//! submit a run of one step that delegates F scripted children (wait =
//! true), follow its events to its end, and submit the next, for a fixed
//! time a repetition (`arbor_tests::load`). Two rows: over HTTP (arbord in
//! this process on a loopback port: the real router, the token, the typed
//! client, SSE), and on the embedded node with no HTTP, to show the
//! service's own share. Baseline: P2's fan-out on a node of its own, in the
//! same run, alternating. Goals: each row's jobs/s at least 0.5x P2's; over
//! HTTP, the end latency's p50 under 50 ms and jobs/s at least 0.9x the
//! embedded row's.
//!
//! Each load's node lives through all its repetitions, as a service does;
//! after them the HTTP load checks that every run the API lists is terminal,
//! that the journal agrees run for run, and that it verifies clean.

use crate::goals::Sizes;
use crate::goals::durable_fan_out::FanOutNode;
use crate::report::{Bound, Outcome, Unit, figure};
use crate::trial::{Rep, interleaved};
use arbor_tests::load::{EmbeddedLoad, HttpLoad, Samples};
use arbor_tests::measure::Latency;
use std::time::Duration;

/// Over HTTP, a run's end from its submission, at the median.
const END_P50_GOAL: Duration = Duration::from_millis(50);
/// HTTP's jobs/s over the embedded node's.
const HTTP_SHARE_GOAL: f64 = 0.9;

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let (shape, seconds) = (sizes.load, sizes.load_seconds);
    let dir = tempfile::tempdir()?;
    let fan = FanOutNode::start(sizes.fan_out).await;
    let http = HttpLoad::start(shape, &dir.path().join("http")).await;
    let embedded = EmbeddedLoad::start(shape, &dir.path().join("embedded")).await;
    let (mut over_http, mut in_process) = (Samples::default(), Samples::default());
    let fan_round = async |_| Ok(fan.round().await?.jobs_per_second());
    let http_row = interleaved("P8", "http", fan_round, async |rep| {
        let samples = http.drive(seconds).await;
        let jobs_per_second = samples.jobs_per_second();
        if rep != Rep::Warmup {
            over_http.extend(samples);
        }
        Ok(jobs_per_second)
    })
    .await?;
    let fan_round = async |_| Ok(fan.round().await?.jobs_per_second());
    let embedded_row = interleaved("P8", "embedded", fan_round, async |rep| {
        let samples = embedded.drive(seconds).await;
        let jobs_per_second = samples.jobs_per_second();
        if rep != Rep::Warmup {
            in_process.extend(samples);
        }
        Ok(jobs_per_second)
    })
    .await?;
    http.finish().await;
    embedded.finish().await;
    fan.node.shutdown().await;

    let http_end = Latency::of(&over_http.end);
    let share = http_row.arbor_median() / embedded_row.arbor_median();
    let end_p50 = Duration::from_secs_f64(http_end.p50_us / 1e6);
    let mut notes = vec![format!(
        "each repetition: {} clients for {} ms, each submitting a run of one step delegating {} children (wait = true) and following it to its end, then the next; baseline: P2's fan-out ({} runs x {} children) on a node of its own",
        shape.clients,
        seconds.as_millis(),
        shape.fanout,
        sizes.fan_out.runs,
        sizes.fan_out.children,
    )];
    for (name, samples) in [("http", &over_http), ("embedded", &in_process)] {
        let end = Latency::of(&samples.end);
        let first = Latency::of(&samples.first_job);
        notes.push(format!(
            "{name}: {} runs/s; end p50 {}, p99 {}; first job p50 {}, p99 {}",
            figure(samples.runs_per_second(), Unit::PerSecond),
            micros(end.p50_us),
            micros(end.p99_us),
            micros(first.p50_us),
            micros(first.p99_us),
        ));
    }
    Ok(Outcome {
        id: "P8",
        what: "many small runs at once, jobs/s",
        unit: Unit::PerSecond,
        per: "jobs/s",
        bound: Bound::AtLeast(0.5),
        rows: vec![http_row, embedded_row],
        conditions: vec![
            (
                format!(
                    "over HTTP, a run's end p50 {} (goal under {})",
                    micros(http_end.p50_us),
                    figure(END_P50_GOAL.as_secs_f64(), Unit::Seconds)
                ),
                end_p50 < END_P50_GOAL,
            ),
            (
                format!(
                    "HTTP's jobs/s {share:.2}x the embedded node's (goal {HTTP_SHARE_GOAL}x or more)"
                ),
                share >= HTTP_SHARE_GOAL,
            ),
        ],
        notes,
    })
}

fn micros(us: f64) -> String {
    figure(us / 1e6, Unit::Seconds)
}
