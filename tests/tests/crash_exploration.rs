//! A crash at every commit point of the README's example and of a fan-out
//! with retries and a steer, as a kill and as a power cut (`explore_crashes`).

use arbor_protocol::{ErrorClass, RunId, Status};
use arbor_testkit::{Scenario, TestNode, explore_crashes};
use std::path::PathBuf;

/// The run ended done, or a restart interrupted it: then every step or job
/// that failed failed as interrupted, never for another reason.
fn done_or_interrupted(node: &TestNode, run: RunId) -> Result<(), String> {
    let tree = node.tree(run);
    match tree.run_status() {
        Status::Done => Ok(()),
        Status::Failed => {
            for (_, n) in tree.nodes() {
                if n.status == Status::Failed && n.error_class != Some(ErrorClass::Interrupted) {
                    return Err(format!(
                        "{} failed ({:?}): {}",
                        n.label.as_deref().or(n.agent.as_deref()).unwrap_or("?"),
                        n.error_class,
                        n.reason.as_deref().unwrap_or("")
                    ));
                }
            }
            Ok(())
        }
        other => Err(format!("the run ended {other}")),
    }
}

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_point_of_the_readme_example_recovers() {
    let scenario = Scenario::flow(example("research"), "research");
    let report = explore_crashes(&scenario, done_or_interrupted).await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

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
