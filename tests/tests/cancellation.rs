//! Cancellation: a stop reaches the whole subtree, wins every race, and leaves no process.

use arbor_protocol::{ErrorClass, EventKind, JobId, Status};
use arbor_testkit::{
    Seeded, TestNode, agent_md, process_exits_within, processes_in, wait_processes_in,
};
use std::time::Duration;

const SLOW: &str = "description: slow\nscript:\n  - say: working\n    delay: 1h";

#[tokio::test]
async fn inv_15_stopping_a_job_stops_its_whole_subtree_with_reasons() {
    let boss = agent_md(
        "subagents: [mid]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: mid, request: go, label: mid}]}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let mid = agent_md(
        "description: mid\nsubagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: leaf, request: go, label: leaf}]}}\n  - call: {tool: collect, args: {}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("mid", &mid), ("leaf", &agent_md(SLOW))]).await;
    let run = node.run_agent("boss", "go").await;
    node.wait_status(run, "leaf", Status::Running).await;
    let mid_id = node.tree(run).find("mid").unwrap();
    node.stop_job(run, mid_id).await;
    let tree = node.wait_run(run).await;

    let mid = tree.node(mid_id).unwrap();
    assert_eq!(mid.status, Status::Stopped);
    assert_eq!(
        mid.reason.as_deref(),
        Some("stopped by an operator"),
        "the target: not propagated"
    );
    let leaf = tree.node(tree.find("leaf").unwrap()).unwrap();
    assert_eq!(leaf.status, Status::Stopped);
    assert_eq!(
        leaf.reason.as_deref(),
        Some("its parent was stopped (propagated)")
    );
    assert_eq!(
        tree.run_status(),
        Status::Done,
        "the boss went on without it"
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_15_stopping_an_attempt_cancels_the_retry_chain() {
    // Every attempt thinks for 200ms, then fails; attempt 2 is stopped while it thinks.
    let boss = agent_md(
        "subagents: [flaky]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: go, label: f, retries: 2}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let flaky = agent_md(
        "description: fails\nscript:\n  - say: thinking\n    delay: 200ms\n    call: {tool: submit_output, args: {output: no, task_status: failed}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("flaky", &flaky)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node
        .wait_until(run, |t| t.nodes().any(|(_, n)| n.attempt == 2))
        .await;
    let second = tree
        .nodes()
        .find(|(_, n)| n.attempt == 2)
        .map(|(id, _)| id)
        .unwrap();
    node.stop_job(run, second).await;
    let tree = node.wait_run(run).await;
    let mut attempts: Vec<u32> = tree
        .nodes()
        .filter(|(_, n)| n.label.as_deref() == Some("f"))
        .map(|(_, n)| n.attempt)
        .collect();
    attempts.sort();
    assert_eq!(attempts, [1, 2], "no attempt after the stop");
    assert_eq!(tree.node(second).unwrap().status, Status::Stopped);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_16_a_stop_wins_the_race_against_a_result_already_on_its_way() {
    let mut stopped_before_result = 0;
    for seed in 1..=24u64 {
        let mut rng = Seeded::new(seed);
        let boss = agent_md(
            "subagents: [quick]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: quick, request: go, label: q}]}}\n  - call: {tool: stop_child, args: {child: q}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
        );
        let quick = agent_md(&format!(
            "description: answers at once\nscript:\n  - say: secret\n    delay: {}us\n    call: {{tool: submit_output, args: {{output: SECRET-OUTPUT}}}}",
            rng.between(0, 3000)
        ));
        let node = TestNode::start(&[("boss", &boss), ("quick", &quick)]).await;
        let run = node.run_agent("boss", "go").await;
        let tree = node.wait_run(run).await;
        let q_id = tree.find("q").unwrap();
        let q = tree.node(q_id).unwrap();
        let stop_taken = node.events(run).iter().any(|e| {
            matches!(&e.kind, EventKind::ToolCalled { tool, ok: true, .. } if tool == "stop_child")
        });
        if stop_taken {
            stopped_before_result += 1;
            // Once the parent took the stop, nothing of the child's output escapes.
            assert_eq!(q.status, Status::Stopped, "seed {seed}");
            assert!(q.output.is_null(), "seed {seed}");
            let record = node.journal().job(run, q_id).unwrap().unwrap();
            assert_eq!(
                record.output_json, "null",
                "seed {seed}: not in the journal as a result"
            );
            let leaked = node.events(run).iter().any(|e| match &e.kind {
                EventKind::JobFinished { result, .. } => {
                    result.output.to_string().contains("SECRET-OUTPUT")
                }
                _ => false,
            });
            assert!(!leaked, "seed {seed}: not in any event");
        } else {
            // The result got there first: the stop was refused, naming the status.
            assert_eq!(q.status, Status::Done, "seed {seed}");
        }
        assert_eq!(tree.run_status(), Status::Done);
        node.assert_conserved(run);
    }
    assert!(stopped_before_result > 0, "the race was never exercised");
}

#[tokio::test]
async fn inv_16_a_stopped_run_delivers_no_output_from_anywhere_below() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: leaf, request: a, label: a}, {agent: leaf, request: b, label: b}]}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: BOSS-OUTPUT}}",
    );
    let leaf = agent_md(
        "description: leaf\nscript:\n  - say: x\n    delay: 20ms\n    call: {tool: submit_output, args: {output: LEAF-OUTPUT}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node.run_agent("boss", "go").await;
    node.wait_status(run, "a", Status::Running).await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    assert!(tree.root().output.is_null());
    for (id, n) in tree.nodes() {
        if n.status == Status::Stopped {
            assert!(n.output.is_null());
            assert_eq!(
                node.journal().job(run, id).unwrap().unwrap().output_json,
                "null"
            );
        }
    }
    let boss = tree.node(tree.find("boss").unwrap()).unwrap();
    assert_eq!(boss.status, Status::Stopped);
}

/// Every way a command's processes try to outlive it: a background job, one
/// that called setsid, one whose parent exited (a double fork), and the
/// foreground process itself.
const ESCAPES: &str = "sleep 300 & setsid sleep 301 & (sleep 302 &) ; exec sleep 303";

#[tokio::test]
async fn inv_17_a_stopped_jobs_processes_are_gone_setsid_and_double_forks_too() {
    let boss = agent_md(
        "tools: [exec]\nsubagents: [worker]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: worker, request: go, label: w}]}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let worker = agent_md(&format!(
        "description: leaves processes behind\ntools: [exec]\nscript:\n  - call: {{tool: exec, args: {{command: \"{ESCAPES}\"}}}}"
    ));
    let node = TestNode::start(&[("boss", &boss), ("worker", &worker)]).await;
    let run = node.run_agent("boss", "go").await;
    let w = node.wait_for(run, "w").await;
    let workdir = node.workdir(run, w);
    let before = wait_processes_in(&workdir, 4).await;

    node.stop_job(run, w).await;
    node.wait_status(run, "w", Status::Stopped).await;
    for pid in processes_in(&workdir).into_iter().chain(before) {
        assert!(
            process_exits_within(pid, Duration::from_secs(2)).await,
            "process {pid} outlived its job"
        );
    }
}

#[tokio::test]
async fn inv_17_when_the_parent_stops_waiting_the_childs_command_is_killed() {
    let boss = agent_md(
        "tools: [exec]\nsubagents: [worker]\nscript:\n  - call: {tool: delegate, args: {timeout: 300ms, jobs: [{agent: worker, request: go, label: w}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let worker = agent_md(
        "description: blocks\ntools: [exec]\nscript:\n  - call: {tool: exec, args: {command: \"sleep 303 & exec sleep 304\"}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("worker", &worker)]).await;
    let run = node.run_agent("boss", "go").await;
    let w = node.wait_for(run, "w").await;
    let workdir = node.workdir(run, w);
    let tree = node.wait_run(run).await;
    let worker_node = tree.node(w).unwrap();
    assert_eq!(worker_node.status, Status::Stopped);
    assert!(
        worker_node
            .reason
            .as_deref()
            .unwrap()
            .contains("stopped waiting after 300ms")
    );
    for pid in processes_in(&workdir) {
        assert!(
            process_exits_within(pid, Duration::from_secs(2)).await,
            "process {pid} outlived its job"
        );
    }
    assert_eq!(tree.run_status(), Status::Done);
}

#[tokio::test]
async fn inv_18_a_parent_that_ends_stops_its_running_children_first() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: leaf, request: go, label: orphan}]}}\n  - call: {tool: submit_output, args: {output: done early}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("leaf", &agent_md(SLOW))]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let orphan_id = tree.find("orphan").unwrap();
    let orphan = tree.node(orphan_id).unwrap();
    assert_eq!(orphan.status, Status::Stopped);
    assert_eq!(
        orphan.reason.as_deref(),
        Some("its parent ended (propagated)")
    );
    let boss = tree.node(tree.find("boss").unwrap()).unwrap();
    assert_eq!(boss.status, Status::Done);
    // The child's end was recorded before its parent's: nothing outlived the step.
    let order: Vec<JobId> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::JobFinished { result, .. } => Some(result.job),
            _ => None,
        })
        .collect();
    assert_eq!(order, [orphan_id, tree.find("boss").unwrap()]);
}

#[tokio::test]
async fn inv_19_a_job_timeout_fails_it_with_class_timeout_and_charges_its_spend() {
    let boss = agent_md(
        "subagents: [slowpoke]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: slowpoke, request: go, label: s, timeout: 200ms}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let slowpoke = agent_md(
        "description: slow\nscript:\n  - usage: {input: 40, output: 2}\n    call: {tool: collect, args: {}}\n  - say: late\n    delay: 1h",
    );
    let node = TestNode::start(&[("boss", &boss), ("slowpoke", &slowpoke)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let s = tree.node(tree.find("s").unwrap()).unwrap();
    assert_eq!(
        (s.status, s.error_class),
        (Status::Failed, Some(ErrorClass::Timeout))
    );
    assert_eq!(s.reason.as_deref(), Some("timed out after 200ms"));
    assert_eq!(
        s.account.spent, 42,
        "its spend is charged back to the parent"
    );
    assert_eq!(tree.run_status(), Status::Done);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_17_a_node_shutdown_stops_every_run_and_kills_its_processes() {
    let worker = agent_md(&format!(
        "tools: [exec]\nscript:\n  - call: {{tool: exec, args: {{command: \"{ESCAPES}\"}}}}"
    ));
    let node = TestNode::start(&[("worker", &worker)]).await;
    let run = node.run_agent("worker", "go").await;
    let w = node.wait_for(run, "worker").await;
    let workdir = node.workdir(run, w);
    let running = wait_processes_in(&workdir, 4).await;
    let journal = node.journal().clone();

    node.shutdown().await;

    for pid in running.into_iter().chain(processes_in(&workdir)) {
        assert!(
            process_exits_within(pid, Duration::from_secs(2)).await,
            "process {pid} outlived the node"
        );
    }
    let record = journal.job(run, w).unwrap().unwrap();
    assert_eq!(
        record.status,
        Status::Stopped,
        "the stop was journaled, not left running"
    );
    assert_eq!(journal.run(run).unwrap().unwrap().status, Status::Stopped);
}

/// I-59: a step and a delegated job whose agents give no `timeout`, and a
/// run whose flow gives none, are capped by `[limits] job_timeout` and
/// `run_timeout`; neither may be set to zero.
#[tokio::test]
async fn inv_59_every_run_and_job_has_a_wall_clock_cap_by_default() {
    // A job: the node's job_timeout ends the hung child; the step says a
    // longer cap of its own.
    let boss = agent_md(
        "subagents: [slowpoke]\ntimeout: 1m\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: slowpoke, request: go, label: s}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let slowpoke = agent_md("description: slow\nscript:\n  - say: late\n    delay: 1h");
    let node = TestNode::start_with_config(
        "[limits]\njob_timeout = \"300ms\"\n",
        &[("boss", &boss), ("slowpoke", &slowpoke)],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let s = tree.node(tree.find("s").unwrap()).unwrap();
    assert_eq!(
        (s.status, s.error_class, s.reason.as_deref()),
        (
            Status::Failed,
            Some(ErrorClass::Timeout),
            Some("timed out after 300ms")
        )
    );
    assert_eq!(tree.run_status(), Status::Done);
    node.assert_conserved(run);

    // A run: run_timeout ends it though its step's own cap is longer.
    let node = TestNode::start_with_config(
        "[limits]\nrun_timeout = \"300ms\"\njob_timeout = \"1h\"\n",
        &[("slowpoke", &slowpoke)],
    )
    .await;
    let run = node.run_agent("slowpoke", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    let root = tree.root();
    assert_eq!(root.error_class, Some(ErrorClass::Timeout), "{root:#?}");
    assert!(
        root.reason
            .as_deref()
            .is_some_and(|r| r.contains("timed out after 300ms")),
        "{root:#?}"
    );
    node.assert_conserved(run);

    // The defaults are finite, and zero (unlimited) is refused.
    let limits = arbor_protocol::Limits::default();
    assert_eq!(limits.run_timeout, std::time::Duration::from_secs(4 * 3600));
    assert_eq!(limits.job_timeout, std::time::Duration::from_secs(3600));
    for key in ["run_timeout", "job_timeout"] {
        let toml = format!("[limits]\n{key} = \"0s\"\n");
        let err =
            arbor_runtime::Workspace::from_texts("ws".into(), Some(&toml), &[("a", &boss)], &[])
                .map(|_| ())
                .unwrap_err()
                .to_string();
        assert!(
            err.contains(&format!("limits.{key} must be more than 0")),
            "{err}"
        );
    }
}
