//! Faults from outside, chosen per job (`arbor_testkit::faults`): a model
//! that 429s, is overloaded, times out, hangs, answers garbage or panics.
//! Transient ones are retried; the rest fail the job with their class; a
//! hang ends with a stop; every account adds up after each (I-14, I-38).

use arbor_protocol::{ErrorClass, Status};
use arbor_testkit::faults::{FaultyModels, ModelFault};
use arbor_testkit::{TestNode, agent_md};

fn lead() -> String {
    agent_md(
        "subagents: [worker]\nscript:\n  - call: {tool: delegate, args: {on_failure: continue, jobs: [{agent: worker, request: a, label: w1}, {agent: worker, request: b, label: w2}]}}\n  - call: {tool: submit_output, args: {output: led}}",
    )
}

fn worker() -> String {
    agent_md(
        "description: works\nscript:\n  - usage: {input: 10, output: 2}\n    call: {tool: submit_output, args: {output: worked}}",
    )
}

async fn node(models: std::sync::Arc<FaultyModels>) -> TestNode {
    TestNode::start_full(None, &[("lead", &lead()), ("worker", &worker())], models).await
}

#[tokio::test]
async fn transient_faults_are_retried_and_the_job_is_done() {
    let models = FaultyModels::new();
    models.on_job(
        "worker",
        0,
        [
            ModelFault::RateLimited,
            ModelFault::Overloaded,
            ModelFault::Timeout,
        ],
    );
    let node = node(models.clone()).await;
    let run = node.run_agent("lead", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(node.jobs_done(run, "worker"), 2);
    // Three failed attempts and the answer for the first worker, one call for the second.
    assert_eq!(models.calls("worker"), 5);
    node.assert_conserved(run);
}

#[tokio::test]
async fn a_fault_past_the_retries_fails_the_job_with_its_class() {
    let models = FaultyModels::new();
    models.on_job("worker", 1, [ModelFault::ServerError; 4]);
    let node = node(models.clone()).await;
    let run = node.run_agent("lead", "go").await;
    node.wait_run(run).await;
    let w2 = node.wait_status(run, "w2", Status::Failed).await;
    assert_eq!(w2.error_class, Some(ErrorClass::ModelServer));
    assert!(w2.reason.unwrap_or_default().contains("after 4 attempts"));
    assert_eq!(
        node.wait_status(run, "w1", Status::Done).await.status,
        Status::Done
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn a_malformed_answer_is_not_retried_and_a_panic_is_contained() {
    let models = FaultyModels::new();
    models.on_job("worker", 0, [ModelFault::Malformed]);
    models.on_job("worker", 1, [ModelFault::Panic]);
    let node = node(models.clone()).await;
    let run = node.run_agent("lead", "go").await;
    node.wait_run(run).await;
    let classes: Vec<Option<ErrorClass>> = ["w1", "w2"]
        .iter()
        .map(|w| {
            let tree = node.tree(run);
            tree.node(tree.find(w).unwrap()).unwrap().error_class
        })
        .collect();
    assert_eq!(
        classes,
        [Some(ErrorClass::ModelProtocol), Some(ErrorClass::Panicked)]
    );
    assert_eq!(models.calls("worker"), 2, "neither is retried");
    node.assert_conserved(run);
    // The node lives on: another run is done.
    let again = node.run_agent("worker", "again").await;
    assert_eq!(node.wait_run(again).await.run_status(), Status::Done);
}

#[tokio::test]
async fn a_hung_call_ends_with_a_stop_and_holds_nothing() {
    let models = FaultyModels::new();
    models.on_job("worker", 0, [ModelFault::Hang]);
    let node = node(models.clone()).await;
    let run = node.run_agent("lead", "go").await;
    let w1 = node.wait_for(run, "w1").await;
    node.wait_status(run, "w1", Status::Running).await;
    node.wait_until(run, |_| models.calls("worker") >= 1).await;
    node.stop_job(run, w1).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.node(w1).unwrap().status, Status::Stopped);
    node.assert_conserved(run);
}

/// A command that ignores SIGTERM, and its background child, past the
/// call's timeout: the call fails saying so, the job goes on, and nothing
/// of theirs is left running within 2 s (I-17).
#[tokio::test]
async fn a_command_past_its_timeout_that_ignores_sigterm_is_killed_whole() {
    use arbor_testkit::faults::{
        command_that_hangs, command_that_ignores_sigterm, processes_running,
    };
    // The check below can see such a process.
    let hang = command_that_hangs();
    let mut own = std::process::Command::new("sh")
        .args(["-c", &format!("exec {hang}")])
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut seen = processes_running();
    while seen.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        seen = processes_running();
    }
    own.kill().unwrap();
    own.wait().unwrap();
    assert!(!seen.is_empty(), "a running command is found");
    let script = format!(
        "tools: [exec]\nscript:\n  - call: {{tool: exec, args: {{command: {}, timeout: 300ms}}}}\n  - call: {{tool: submit_output, args: {{output: went on}}}}",
        serde_json::to_string(&command_that_ignores_sigterm()).unwrap()
    );
    let node = TestNode::start(&[("stubborn", &agent_md(&script))]).await;
    let run = node.run_agent("stubborn", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    let calls = node.tool_calls(run);
    let exec = calls
        .iter()
        .find(|c| c.tool == "exec")
        .expect("the exec call");
    assert!(!exec.ok && exec.detail.contains("timed out"), "{exec:?}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !processes_running().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(processes_running(), Vec::<i32>::new());
}
