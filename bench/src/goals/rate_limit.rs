//! L1: what a provider's rate limits (`rpm`, `tpm`, I-65) cost a call that
//! waits for nothing: R2's fan-out on the mock provider with limits far
//! above what it sends, beside the same without limits.

use super::replay::MockFanOut;
use crate::goals::{FanOut, Sizes};
use crate::report::{Bound, Outcome, Unit};
use crate::trial::interleaved;
use arbor_testkit::mock_provider::MockProvider;

/// Limits no round comes near: every request is admitted at once.
const WIDE: &str = "rpm = 1000000\ntpm = 1000000000000\n";

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shape = FanOut {
        runs: (sizes.fan_out.runs / 4).max(1),
        children: sizes.fan_out.children,
    };
    let (plain_mock, limited_mock) = (MockProvider::start().await, MockProvider::start().await);
    let plain = MockFanOut::start(&plain_mock, shape, "", "").await;
    let limited = MockFanOut::start(&limited_mock, shape, WIDE, "").await;
    let row = interleaved(
        "L1",
        "",
        async |_| Ok(plain.round(&plain_mock).await?.as_secs_f64()),
        async |_| Ok(limited.round(&limited_mock).await?.as_secs_f64()),
    )
    .await?;
    plain.node.shutdown().await;
    limited.node.shutdown().await;
    Ok(Outcome {
        id: "L1",
        what: "a provider's rate limits, on calls that wait for nothing",
        unit: Unit::Seconds,
        per: "per round",
        bound: Bound::AtMost(1.05),
        rows: vec![row],
        conditions: vec![],
        notes: vec![format!(
            "each repetition: {} runs at once, each a step delegating {} children in one call, every call streamed from the mock provider (loopback HTTP): {} calls; arbor's provider has rpm and tpm set far above what a round sends (each call reserved from both windows, stamped when sent and settled on its usage), the baseline's none; wall time from the first start to the last end",
            shape.runs,
            shape.children,
            shape.jobs() + shape.runs * 2
        )],
    })
}
