//! The crash exploration catches a broken recovery: with recovery's sandbox
//! sweep (step 2, I-30) switched off, some commit point of a fan-out whose
//! workers leave processes behind must report a violation. Its own test
//! binary: the switch is process-wide.

use arbor_runtime::recovery::sabotage;
use arbor_testkit::explore::explore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_that_skips_its_sandbox_sweep_is_caught() {
    sabotage::skip_sandbox_sweep(true);
    let scenario = arbor_tests::scenarios::fan_out_with_retries_and_steer();
    let report = explore(&scenario, |_, _| Ok(())).await;
    sabotage::skip_sandbox_sweep(false);
    println!("{report}");
    assert!(
        report
            .violations
            .iter()
            .any(|v| v.contains("recorded live") || v.contains("is alive")),
        "the broken recovery went unnoticed: {report}"
    );
    let replay = report.replay.expect("a failing case names its replay");
    assert!(replay.starts_with("ARBOR_CRASH_CASE="), "{replay}");
}
