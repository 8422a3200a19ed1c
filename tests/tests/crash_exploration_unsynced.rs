//! The power cut is real enough to catch a commit acknowledged without its
//! `fdatasync`: with the journal's syncs switched off mid-run
//! (`Faults::skip_syncs`), a kill loses nothing (the kernel keeps the
//! writes) and a power cut loses what was acknowledged, which the
//! exploration reports.

use arbor_testkit::agent_md;
use arbor_testkit::explore::{Scenario, explore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_acknowledged_without_its_sync_is_lost_to_a_power_cut_and_caught() {
    let solo = agent_md(
        "script:\n  - say: one\n    usage: {input: 10, output: 2}\n  - say: two\n    usage: {input: 10, output: 2}\n  - say: three\n    usage: {input: 10, output: 2}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let scenario = Scenario::agent(&[("solo", &solo)], "solo", "go")
        .during(|node, _| Box::pin(async move { node.journal().faults().skip_syncs(true) }));
    let report = explore(&scenario, |_, _| Ok(())).await;
    println!("{report}");
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.contains(":power:") && v.contains("acknowledged")),
        "the unsynced commits went unnoticed: {report}"
    );
    assert!(
        report.violations.iter().all(|v| v.contains(":power:")),
        "a kill keeps what the kernel was given: {report}"
    );
}
