//! The research workspace (`examples/research`), tested as its author would
//! test it, with nothing but `arbor-testkit`.

use arbor_testkit::protocol::{ErrorClass, RunId, Status};
use arbor_testkit::{Scenario, TestNode, explore_crashes};
use std::path::PathBuf;

fn research() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../research")
}

/// The run ended done, or a restart interrupted it (the flow has no
/// retries): then whatever failed failed as interrupted, for no other reason.
fn done_or_interrupted(node: &TestNode, run: RunId) -> Result<(), String> {
    let tree = node.tree(run);
    match tree.run_status() {
        Status::Done => Ok(()),
        Status::Failed => {
            match tree.nodes().map(|(_, n)| n).find(|n| {
                n.status == Status::Failed && n.error_class != Some(ErrorClass::Interrupted)
            }) {
                None => Ok(()),
                Some(n) => Err(format!(
                    "{} failed: {}",
                    n.label.as_deref().or(n.agent.as_deref()).unwrap_or("?"),
                    n.reason.as_deref().unwrap_or("")
                )),
            }
        }
        other => Err(format!("the run ended {other}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_is_written_and_every_budget_adds_up() {
    let node = TestNode::start_dir(research()).await;
    let run = node.run_flow("research").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(node.jobs_done(run, "writer"), 1);
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_point_of_the_research_flow_recovers() {
    let scenario = Scenario::flow(research(), "research");
    let report = explore_crashes(&scenario, done_or_interrupted).await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}
