//! A crash at every commit point of a fan-out with retries and a steer, as a
//! kill and as a power cut (`explore_crashes`). The README's example is
//! explored by the user-side example crate, `examples/testing`.

use arbor_protocol::Status;
use arbor_testkit::explore_crashes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_point_of_a_fan_out_with_retries_and_a_steer_recovers() {
    let scenario = arbor_tests::scenarios::fan_out_with_retries_and_steer();
    let report = explore_crashes(&scenario, |node, run| {
        // Retried as often as a crash interrupts it, the run ends done.
        let tree = node.tree(run);
        match tree.run_status() {
            Status::Done => Ok(()),
            other => Err(format!(
                "the run ended {other}: {}",
                tree.root().reason.clone().unwrap_or_default()
            )),
        }
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}
