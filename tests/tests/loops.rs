//! Work that is checked: a step's loop runs it again until a check passes
//! (a command, a pattern, a judge), within its bounds, journaled so a
//! restart resumes it at its iteration (I-56).

use arbor_protocol::{
    ErrorClass, EventKind, IterationView, NodeKind, Status, TreeNode, VerdictKind,
};
use arbor_testkit::{TestNode, agent_md, exec_script};
use std::sync::Arc;

/// Waits until `marker` is in `dir` and a process runs there: a command
/// that made it is running (a process that just ended may still show).
async fn wait_command(dir: &std::path::Path, marker: &str) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + arbor_testkit::WAIT_LIMIT;
    loop {
        let found = arbor_testkit::wait_processes_in(dir, 1).await;
        if dir.join(marker).exists() {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {marker} in {}",
            dir.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Each run of the worker counts itself in `count`, in the loop's shared workdir.
const COUNT: &str = "n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count";

async fn node(agents: &[(&str, &str)], flow: &str) -> TestNode {
    TestNode::start_workspace(
        None,
        agents,
        &[("work", flow)],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await
}

fn worker(commands: &[&str]) -> String {
    agent_md(&format!(
        "description: works\ntools: [exec]\nscript:\n{}",
        exec_script(commands)
    ))
}

/// The run's step nodes of `label`, attempt by attempt.
fn attempts<'a>(tree: &'a arbor_protocol::Tree, label: &str) -> Vec<&'a TreeNode> {
    let mut found: Vec<&TreeNode> = tree
        .nodes()
        .map(|(_, n)| n)
        .filter(|n| n.kind == NodeKind::Step && n.label.as_deref() == Some(label))
        .collect();
    found.sort_by_key(|n| n.attempt);
    found
}

fn checks(node: &TestNode, run: arbor_protocol::RunId) -> Vec<(u32, bool)> {
    node.events(run)
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::IterationChecked {
                iteration, passed, ..
            } => Some((*iteration, *passed)),
            _ => None,
        })
        .collect()
}

fn summary(iterations: &[IterationView]) -> Vec<(u32, bool)> {
    iterations.iter().map(|i| (i.iteration, i.passed)).collect()
}

/// A command loop: the step runs until `test` passes, each iteration in
/// the same workdir, told the last one's output and what the command said;
/// it passes on its third and the run goes on with its answer.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_command_loop_passes_on_its_third_iteration() {
    let flow = "[[group]]\nsteps = [{ agent = \"coder\", instruction = \"make the count reach 3\", label = \"fix\", until = { command = \"echo count is $(cat count); test $(cat count) -ge 3\" } }]\n";
    let node = node(&[("coder", &worker(&[COUNT]))], flow).await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:#?}", tree.root());
    let steps = attempts(&tree, "fix");
    assert_eq!(steps.len(), 3, "three iterations, one attempt each");
    assert!(steps.iter().all(|s| s.status == Status::Done));
    let last = steps.last().unwrap();
    assert_eq!(
        summary(&last.iterations),
        [(1, false), (2, false), (3, true)]
    );
    assert_eq!(checks(&node, run), [(1, false), (2, false), (3, true)]);
    let workdirs: std::collections::BTreeSet<_> = steps.iter().map(|s| &s.workdir).collect();
    assert_eq!(workdirs.len(), 1, "the iterations share one workdir");
    // The second iteration is told the first's output and what the check printed.
    let requests: Vec<String> = node
        .events(run)
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::JobSpawned {
                request, attempt, ..
            } if *attempt == 2 => Some(request.clone()),
            _ => None,
        })
        .collect();
    let [second] = requests.as_slice() else {
        panic!("one second iteration: {requests:?}")
    };
    assert!(second.starts_with("make the count reach 3"), "{second}");
    assert!(second.contains("iteration 2 of at most 5"), "{second}");
    assert!(
        second.contains("exited 1") && second.contains("count is 1"),
        "{second}"
    );
    assert_eq!(tree.root().output, serde_json::json!("done"));
    node.assert_conserved(run);
}

/// A judge loop that never passes ends at `max_iterations`: the step and
/// the run fail `check_failed`, the reason quotes the last verdict and its
/// issues, and the document has each iteration's verdict.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_judge_loop_ends_at_max_iterations_with_the_last_verdict_in_the_result() {
    let writer = agent_md(
        "description: writes\nscript:\n  - call: {tool: submit_output, args: {output: a draft}}",
    );
    let critic = agent_md(
        "description: judges\nscript:\n  - call: {tool: submit_output, args: {output: {verdict: revise, issues: [too short, no title]}}}",
    );
    let flow = "[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\", until = { judge = \"critic\", max_iterations = 2 } }]\n";
    let node = node(&[("writer", &writer), ("critic", &critic)], flow).await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    assert_eq!(tree.root().error_class, Some(ErrorClass::CheckFailed));
    let reason = tree.root().reason.clone().unwrap_or_default();
    assert!(
        reason.contains("did not pass in 2 iterations")
            && reason.contains("until.max_iterations (2) reached")
            && reason.contains("\"revise\" (too short; no title)"),
        "{reason}"
    );
    let steps = attempts(&tree, "writer");
    assert_eq!(steps.len(), 2, "no third iteration");
    let judges = attempts(&tree, "writer.judge");
    assert_eq!(judges.len(), 2, "one judge a iteration");
    assert!(judges.iter().all(|j| j.status == Status::Done));
    let last = &steps[1].iterations;
    assert_eq!(summary(last), [(1, false), (2, false)]);
    assert!(
        last.iter().all(
            |i| i.verdict == Some(VerdictKind::Revise) && i.issues == ["too short", "no title"]
        )
    );
    assert!(last[1].ended.is_some() && last[0].ended.is_none());
    node.assert_conserved(run);
}

/// A loop's `max_tokens` bounds what its iterations and judges spend
/// together: each iteration's grant is at most what is left, so the sum
/// never passes it, and no iteration starts once it is spent.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_loops_token_bound_is_never_exceeded() {
    let writer = agent_md(
        "description: writes\nscript:\n  - usage: {input: 3000, output: 1000}\n    call: {tool: submit_output, args: {output: a draft}}",
    );
    let flow = "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\", until = { pattern = \"NEVER\", max_iterations = 10, max_tokens = 10000 } }]\n";
    let node = node(&[("writer", &writer)], flow).await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    let steps = attempts(&tree, "writer");
    let spent: u64 = steps.iter().map(|s| s.account.spent).sum();
    assert!(spent <= 10_000, "the loop spent {spent} of its 10000");
    assert_eq!(spent, 8_000, "two whole iterations");
    // The third was granted only what was left, and ended on it.
    assert_eq!(steps.len(), 3);
    assert!(steps[2].account.grant <= 2_000, "{:?}", steps[2].account);
    assert!(steps.iter().all(|s| s.account.grant <= 10_000));
    node.assert_conserved(run);
}

/// A node killed during an iteration resumes the loop at that iteration:
/// no check repeated, no iteration skipped or run twice.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_kill_mid_loop_resumes_at_the_same_iteration() {
    // The second iteration hangs in its command until the node is killed;
    // run again, it counts 3 and passes.
    let hang = "n=$(cat count 2>/dev/null || echo 0); n=$((n+1)); echo $n > count; if [ $n -eq 2 ]; then touch hanging; sleep 600; fi";
    let flow = "[[group]]\nsteps = [{ agent = \"coder\", instruction = \"count\", label = \"fix\", retries = 2, rerun_interrupted = true, until = { command = \"test $(cat count) -ge 3\" } }]\n";
    let node = node(&[("coder", &worker(&[hang]))], flow).await;
    let run = node.run_flow("work").await;
    node.wait_event(run, |k| {
        matches!(k, EventKind::IterationChecked { iteration: 1, .. })
    })
    .await;
    let tree = node
        .wait_until(run, |t| attempts(t, "fix").len() == 2)
        .await;
    let workdir = attempts(&tree, "fix")[0].workdir.clone().unwrap();
    wait_command(std::path::Path::new(&workdir), "hanging").await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:#?}", tree.root());
    assert_eq!(checks(&node, run), [(1, false), (2, true)]);
    let steps = attempts(&tree, "fix");
    assert_eq!(
        steps
            .iter()
            .map(|s| (s.attempt, s.status))
            .collect::<Vec<_>>(),
        [(1, Status::Done), (2, Status::Failed), (3, Status::Done)],
        "the interrupted second iteration ran again as the second"
    );
    assert_eq!(summary(&steps[2].iterations), [(1, false), (2, true)]);
    node.assert_conserved(run);
}

/// A reviewer (`verify`) reads the run's request and result after its last
/// group and finds something missing: the last group runs once more, each
/// step told what was missing and its answer before; the group before it
/// does not; the reviewer is asked once, and the run's document records
/// the review.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_reviewer_sends_the_last_group_back_once() {
    let say = |what: &str| {
        agent_md(&format!(
            "description: {what}\nscript:\n  - call: {{tool: submit_output, args: {{output: {what}}}}}"
        ))
    };
    let checker = agent_md(
        "description: reviews\nscript:\n  - call: {tool: submit_output, args: {output: {accept: false, missing: [a title]}}}",
    );
    let flow = "verify = \"checker\"\n[[group]]\nsteps = [{ agent = \"finder\", instruction = \"find facts\" }]\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write it up\" }]\n";
    let node = node(
        &[
            ("finder", &say("facts")),
            ("writer", &say("a report")),
            ("checker", &checker),
        ],
        flow,
    )
    .await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:#?}", tree.root());
    assert_eq!(
        attempts(&tree, "finder").len(),
        1,
        "the group before is not run again"
    );
    let writers = attempts(&tree, "writer");
    assert_eq!(writers.len(), 2, "the last group ran once more, once");
    assert_eq!(
        attempts(&tree, "review").len(),
        1,
        "the reviewer is asked once"
    );
    let review = tree
        .root()
        .review
        .clone()
        .expect("the run records its review");
    assert!(!review.accept && review.missing == ["a title"] && review.failed.is_none());
    let requests: Vec<String> = node
        .events(run)
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::JobSpawned { request, label, .. } if label.as_deref() == Some("writer") => {
                Some(request.clone())
            }
            EventKind::JobSpawned { request, label, .. } if label.as_deref() == Some("review") => {
                Some(request.clone())
            }
            _ => None,
        })
        .collect();
    let [first, asked, again] = requests.as_slice() else {
        panic!("{requests:?}")
    };
    assert!(
        first.starts_with("write it up") && first.contains("facts"),
        "{first}"
    );
    assert!(
        asked.contains("- writer: write it up") && asked.contains("a report"),
        "{asked}"
    );
    assert!(
        again.contains("found this missing or wrong:\n- a title")
            && again.contains("Your answer before was: \"a report\"")
            && again.contains("facts"),
        "the second round is told what was missing, its answer and the group before: {again}"
    );
    node.assert_conserved(run);
}

/// A stop while a loop's check runs ends the run at once: no verdict is
/// journaled, no iteration starts after it, and the check's command is
/// killed.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_stop_during_a_check_ends_the_run_at_once_and_kills_the_check() {
    let flow = "[[group]]\nsteps = [{ agent = \"coder\", instruction = \"count\", label = \"fix\", until = { command = \"touch checking; sleep 600\" } }]\n";
    let node = node(&[("coder", &worker(&[COUNT]))], flow).await;
    let run = node.run_flow("work").await;
    let tree = node
        .wait_until(run, |t| {
            attempts(t, "fix")
                .first()
                .is_some_and(|s| s.status == Status::Done)
        })
        .await;
    let workdir = std::path::PathBuf::from(attempts(&tree, "fix")[0].workdir.clone().unwrap());
    let checking = wait_command(&workdir, "checking").await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    assert_eq!(
        attempts(&tree, "fix").len(),
        1,
        "no iteration after the stop"
    );
    assert!(checks(&node, run).is_empty(), "no verdict after the stop");
    for pid in checking {
        assert!(
            arbor_testkit::process_exits_within(pid, std::time::Duration::from_secs(5)).await,
            "the check's process {pid} outlived its run"
        );
    }
    node.assert_conserved(run);
}

/// A loop's `max_time` bounds its iterations: one that would run past it
/// is cut at the bound (its timeout is what is left), and the step fails.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_loops_time_bound_cuts_an_iteration_at_what_is_left() {
    let flow = "[[group]]\nsteps = [{ agent = \"coder\", instruction = \"count\", label = \"fix\", until = { command = \"false\", max_time = \"1s\" } }]\n";
    let node = node(&[("coder", &worker(&["sleep 600"]))], flow).await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    let steps = attempts(&tree, "fix");
    assert_eq!(steps.len(), 1);
    assert_eq!(
        steps[0].error_class,
        Some(ErrorClass::Timeout),
        "{:?}",
        steps[0]
    );
    assert!(
        steps[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("1s"),
        "cut at the loop's bound, not the job's hour: {:?}",
        steps[0].reason
    );
    node.assert_conserved(run);
}
