//! Delegation: the tree's shape, lineage, caps, and refusals that change nothing.

use arbor_actors::node::job_name;
use arbor_protocol::{EventKind, JobId, ParentRef, Status, TaskStatus};
use arbor_runtime::Workspace;
use arbor_testkit::{TestNode, agent_md};
use std::time::Duration;

fn cell_of(job: JobId) -> ractor::ActorCell {
    ractor::registry::where_is(job_name(job)).expect("the job's actor is registered while it runs")
}

/// A slow leaf: it answers after an hour unless stopped.
const SLOW: &str = "description: slow\nscript:\n  - say: working\n    delay: 1h";

#[tokio::test]
async fn inv_01_every_node_is_an_actor_under_one_supervisor_and_stopping_stops_below() {
    let boss = agent_md(
        "tools: [read_file]\nsubagents: [mid]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: mid, request: go, label: mid}]}}\n  - call: {tool: collect, args: {}}",
    );
    let mid = agent_md(
        "description: middle\ntools: [read_file]\nsubagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: leaf, request: go, label: leaf}]}}\n  - call: {tool: collect, args: {}}",
    );
    // Every one of them may read files, so each has a sandbox (a job offered
    // no tool that uses one has none: surface.rs).
    let leaf = agent_md(&format!("tools: [read_file]\n{SLOW}"));
    let node = TestNode::start(&[("boss", &boss), ("mid", &mid), ("leaf", &leaf)]).await;
    let run = node.run_agent("boss", "go").await;
    node.wait_status(run, "leaf", Status::Running).await;
    let tree = node.tree(run);
    let (boss_id, mid_id, leaf_id) = (
        tree.find("boss").unwrap(),
        tree.find("mid").unwrap(),
        tree.find("leaf").unwrap(),
    );

    // The actor tree is the work tree: each job supervises its account, its
    // sandbox and its child jobs, and nothing else.
    let children_of = |job| {
        cell_of(job)
            .get_children()
            .into_iter()
            .map(|c| c.get_id())
            .collect::<Vec<_>>()
    };
    let boss_children = children_of(boss_id);
    assert_eq!(boss_children.len(), 3, "account, sandbox, mid");
    assert!(boss_children.contains(&cell_of(mid_id).get_id()));
    assert!(children_of(mid_id).contains(&cell_of(leaf_id).get_id()));
    assert_eq!(children_of(leaf_id).len(), 2, "account, sandbox");

    let cells = [cell_of(boss_id), cell_of(mid_id), cell_of(leaf_id)];
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    for id in [boss_id, mid_id, leaf_id] {
        assert_eq!(tree.node(id).unwrap().status, Status::Stopped);
    }
    for cell in cells {
        cell.wait(Some(Duration::from_secs(5)))
            .await
            .expect("the actor stops");
    }
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_02_lineage_is_set_by_the_spawner_not_by_a_request_or_a_definition() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go, label: a, depth: 0, run: other}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go, label: b}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;

    // The request that tried to set depth and run was refused whole.
    let refused = node
        .failed_calls(run, "delegate")
        .iter()
        .any(|d| d.contains("unknown field `depth`"));
    assert!(refused, "a job that names its own depth is refused");
    assert!(tree.find("a").is_none());

    let boss_id = tree.find("boss").unwrap();
    let b = tree.node(tree.find("b").unwrap()).unwrap();
    assert_eq!((b.depth, b.attempt), (1, 1));
    assert_eq!(tree.parent_of(tree.find("b").unwrap()), Some(boss_id));

    // Nor can a definition: lineage keys are unknown keys in agent.md.
    let err = Workspace::from_texts(
        "/nowhere".into(),
        None,
        &[("leaf", &agent_md("description: x\ndepth: 0"))],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("depth") && err.contains("agents/leaf/agent.md"),
        "{err}"
    );
}

#[tokio::test]
async fn inv_03_a_job_at_the_depth_cap_is_not_offered_delegate() {
    let boss = agent_md(
        "subagents: [mid]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: mid, request: go, label: mid}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let mid = agent_md(
        "description: middle\nsubagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go}]}}\n  - call: {tool: submit_output, args: {output: tried}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start_with_config(
        "[limits]\ndepth = 1",
        &[("boss", &boss), ("mid", &mid), ("leaf", &leaf)],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let mid_id = tree.find("mid").unwrap();
    assert_eq!(tree.node(mid_id).unwrap().depth, 1);
    assert!(tree.children_of(mid_id).is_empty(), "nothing below the cap");
    let refused = node.events(run).into_iter().any(|e| {
        matches!(&e.kind, EventKind::Refused { id, tool, refusal }
            if *id == mid_id && tool == "delegate" && refusal.to_string().contains("depth cap 1"))
    });
    assert!(
        refused,
        "the call past the cap is an error result naming the cap"
    );
    assert_eq!(
        tree.run_status(),
        Status::Done,
        "the loop went on after the refusal"
    );
}

#[tokio::test]
async fn inv_04_over_cap_fan_out_is_refused_whole_and_at_once() {
    let jobs3 = "[{agent: leaf, request: a}, {agent: leaf, request: b}, {agent: leaf, request: c}]";
    let boss = agent_md(&format!(
        "subagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{wait: false, jobs: {jobs3}}}}}\n  - call: {{tool: delegate, args: {{wait: false, jobs: [{{agent: leaf, request: a, label: one}}, {{agent: leaf, request: b, label: two}}]}}}}\n  - call: {{tool: delegate, args: {{wait: false, jobs: [{{agent: leaf, request: c, label: three}}]}}}}\n  - call: {{tool: stop_child, args: {{child: one}}}}\n  - call: {{tool: stop_child, args: {{child: two}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let node = TestNode::start_with_config(
        "[limits]\nfan_out = 2\nrunning_children = 2",
        &[("boss", &boss), ("leaf", &agent_md(SLOW))],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let boss_id = tree.find("boss").unwrap();
    // Only the two-job call started anything; the three-job call (fan-out)
    // and the third child (running children) were refused whole.
    let labels: Vec<_> = tree
        .children_of(boss_id)
        .iter()
        .map(|c| tree.node(*c).unwrap().label.clone().unwrap())
        .collect();
    assert_eq!(labels, ["one", "two"]);
    let refusals: Vec<String> = node.failed_calls(run, "delegate");
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert!(refusals[0].contains("fan-out cap: 3 children in one call, at most 2"));
    assert!(refusals[1].contains("running children cap"));
    // Nothing was reserved for the refused calls: two holds only.
    let holds = node
        .ledger(ParentRef::Job(boss_id))
        .into_iter()
        .filter(|r| matches!(r.op, arbor_storage::LedgerOp::Hold { .. }))
        .count();
    assert_eq!(holds, 2);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_05_the_spawn_cap_counts_retries_and_never_refunds() {
    let boss = agent_md(
        "subagents: [flaky]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: try, label: f, retries: 2}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: again, label: g}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let flaky = agent_md(
        "description: always fails\nscript:\n  - call: {tool: submit_output, args: {output: no, task_status: failed}}",
    );
    let node = TestNode::start_with_config(
        "[limits]\nspawn_cap = 3",
        &[("boss", &boss), ("flaky", &flaky)],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let mut attempts: Vec<u32> = node
        .jobs(run)
        .iter()
        .filter(|j| j.label.as_deref() == Some("f"))
        .map(|j| j.attempt)
        .collect();
    attempts.sort();
    assert_eq!(attempts, [1, 2, 3], "two retries, each a spawn");
    assert!(
        tree.find("g").is_none(),
        "the cap was spent: finished children gave nothing back"
    );
    let refused = node
        .failed_calls(run, "delegate")
        .iter()
        .any(|d| d.contains("run spawn cap: 3 spawned + 1 asked > 3"));
    assert!(refused);
}

#[tokio::test]
async fn inv_06_a_refused_or_failed_spawn_leaves_nothing_behind() {
    // `ghost` names a model no adapter serves: it is admitted, then fails to start.
    let boss = agent_md(
        "subagents: [leaf, ghost]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: big, budget: {tokens: 999999999}}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: ghost, request: boo, label: g}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let ghost = agent_md(
        "description: ghost\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    let models = std::sync::Arc::new(RefuseGhost);
    let node = TestNode::start_full(
        None,
        &[("boss", &boss), ("leaf", &leaf), ("ghost", &ghost)],
        models,
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let boss_id = tree.find("boss").unwrap();

    assert!(
        tree.children_of(boss_id).is_empty(),
        "no node in the tree for either"
    );
    let details: Vec<String> = node.failed_calls(run, "delegate");
    assert!(details[0].contains("budget"), "{details:?}");
    assert!(details[1].contains("could not start"), "{details:?}");
    // No held budget, no workdir, and no running record: the failed start is
    // recorded as failed, and nothing of the over-budget job was written.
    assert_eq!(tree.node(boss_id).unwrap().account.held, 0);
    let boss_dir = node.workdir(run, boss_id);
    assert!(
        !boss_dir.join("jobs").exists(),
        "no workdir was left behind"
    );
    let records = node.journal().jobs(run).unwrap();
    assert_eq!(records.len(), 2, "the step and the failed start");
    let ghost_record = records.iter().find(|r| r.agent == "ghost").unwrap();
    assert_eq!(ghost_record.status, Status::Failed);
    node.assert_conserved(run);
}

struct RefuseGhost;

impl arbor_actors::ModelFactory for RefuseGhost {
    fn model_for(
        &self,
        agent: &arbor_protocol::AgentDef,
    ) -> Result<std::sync::Arc<dyn arbor_actors::Model>, String> {
        if agent.name == "ghost" {
            return Err("no adapter serves the ghost's model".into());
        }
        arbor_actors::ModelFactory::model_for(&arbor_runtime::DefaultModels, agent)
    }
}

#[tokio::test]
async fn inv_42_cancel_siblings_stops_the_rest_when_one_fails() {
    let boss = agent_md(
        "subagents: [bad, leaf]\nscript:\n  - call: {tool: delegate, args: {on_failure: cancel_siblings, jobs: [{agent: bad, request: x, label: bad}, {agent: leaf, request: why, label: s1}, {agent: leaf, request: zed, label: s2}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let bad = agent_md(
        "description: fails\nscript:\n  - call: {tool: submit_output, args: {output: no, task_status: failed}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("bad", &bad), ("leaf", &agent_md(SLOW))]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    for label in ["s1", "s2"] {
        let sibling = tree.node(tree.find(label).unwrap()).unwrap();
        assert_eq!(sibling.status, Status::Stopped);
        assert_eq!(sibling.reason.as_deref(), Some("sibling bad failed"));
    }
    assert_eq!(
        tree.node(tree.find("bad").unwrap()).unwrap().status,
        Status::Failed
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_42_by_default_siblings_finish() {
    let boss = agent_md(
        "subagents: [bad, quick]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: bad, request: x, label: bad}, {agent: quick, request: why, label: q}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let bad = agent_md(
        "description: fails\nscript:\n  - call: {tool: submit_output, args: {output: no, task_status: failed}}",
    );
    let quick = agent_md(
        "description: quick\nscript:\n  - say: thinking\n    delay: 50ms\n    call: {tool: submit_output, args: {output: fine}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("bad", &bad), ("quick", &quick)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let q = tree.node(tree.find("q").unwrap()).unwrap();
    assert_eq!(
        (q.status, q.task_status),
        (Status::Done, Some(TaskStatus::Completed))
    );
}

/// A boss whose `f` job of `flaky` has `retry` (as a step's: attempts,
/// wait, backoff, the classes tried again).
fn retrying_boss(retry: &str) -> String {
    agent_md(&format!(
        "subagents: [flaky]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{{agent: flaky, request: try, label: f, retry: {retry}}}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ))
}

const FLAKY: &str =
    "description: fails at first\nscript:\n  - call: {tool: submit_output, args: {output: fine}}";

/// A delegated job's retry policy (issue 45): a failed attempt of a class
/// it names is tried again after its wait, growing by its backoff, each a
/// new node with its attempt; the wait is told and its parent's collect
/// waits through it for the attempt that stands (I-56).
#[tokio::test]
async fn inv_56_a_delegated_job_is_tried_again_after_its_waits() {
    use arbor_testkit::faults::{FaultyModels, ModelFault};
    let models = FaultyModels::new();
    models.on_job("flaky", 0, [ModelFault::Malformed]);
    models.on_job("flaky", 1, [ModelFault::Malformed]);
    let boss = retrying_boss("{attempts: 3, wait: 150ms, backoff: 2.0, \"on\": [model_protocol]}");
    let flaky = agent_md(FLAKY);
    let node = TestNode::start_full(None, &[("boss", &boss), ("flaky", &flaky)], models).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let events = node.events(run);
    let waits: Vec<(JobId, u32, u64, u64)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::RetryWaiting {
                id,
                attempt,
                until_ms,
                ..
            } => Some((*id, *attempt, *until_ms, e.at_ms)),
            _ => None,
        })
        .collect();
    let attempts: Vec<(JobId, u32, u64)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::JobSpawned {
                id, label, attempt, ..
            } if label.as_deref() == Some("f") => Some((*id, *attempt, e.at_ms)),
            _ => None,
        })
        .collect();
    assert_eq!(
        attempts.iter().map(|a| a.1).collect::<Vec<_>>(),
        [1, 2, 3],
        "three nodes, each with its attempt"
    );
    assert_eq!(waits.len(), 2, "{waits:?}");
    for (i, (failed, attempt, until, told)) in waits.iter().enumerate() {
        assert_eq!(
            *failed, attempts[i].0,
            "the wait names the attempt that failed"
        );
        assert_eq!(*attempt, attempts[i + 1].1);
        let wait = until - told;
        let wanted = 150 << i;
        assert!(
            (wanted..wanted + 100).contains(&wait),
            "wait {i} is {wait} ms, not {wanted}"
        );
        assert!(
            attempts[i + 1].2 >= *until,
            "attempt {} started at {}, before its wait's end at {until}",
            attempts[i + 1].1,
            attempts[i + 1].2
        );
    }
    let last = tree.node(attempts[2].0).unwrap();
    assert_eq!((last.attempt, &last.output), (3, &"fine".into()));
    node.assert_conserved(run);
}

/// A class the policy does not name fails at once; a stop during a wait
/// calls the next attempt off at once, and nothing is left running; bad
/// policies are tool errors that start nothing.
#[tokio::test]
async fn a_delegated_jobs_retry_tries_only_its_classes_and_a_stop_ends_its_wait() {
    use arbor_testkit::faults::{FaultyModels, ModelFault};
    let models = FaultyModels::new();
    models.on_every_job("flaky", [ModelFault::Malformed]);
    let boss = retrying_boss("{attempts: 3, \"on\": [model_server]}");
    let flaky = agent_md(FLAKY);
    let node =
        TestNode::start_full(None, &[("boss", &boss), ("flaky", &flaky)], models.clone()).await;
    let run = node.run_agent("boss", "go").await;
    node.wait_run(run).await;
    let attempts = |node: &TestNode, run| {
        node.jobs(run)
            .iter()
            .filter(|j| j.agent.as_deref() == Some("flaky"))
            .count()
    };
    assert_eq!(
        attempts(&node, run),
        1,
        "model_protocol is not among its classes"
    );

    let waiting = retrying_boss("{attempts: 3, wait: 1h}");
    let node = TestNode::start_full(
        None,
        &[("boss", &waiting), ("flaky", &flaky)],
        models.clone(),
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    node.wait_event(run, |k| matches!(k, EventKind::RetryWaiting { .. }))
        .await;
    let boss_id = node.tree(run).find("boss").unwrap();
    assert!(
        node.tree(run).node(boss_id).unwrap().waiting.is_some(),
        "the parent's node shows the wait"
    );
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    assert_eq!(attempts(&node, run), 1, "the stop called the retry off");
    node.assert_conserved(run);

    let bad = agent_md(
        "subagents: [flaky]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: a, retries: 1, retry: {attempts: 2}}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: b, retry: {attempts: 0}}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: c, retry: {attempts: 2, \"on\": [budget_exhausted]}}]}}\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: flaky, request: d, retry: {attempts: 2}}]}}\n  - call: {tool: submit_output, args: {output: refused}}",
    );
    let node = TestNode::start(&[("boss", &bad), ("flaky", &flaky)]).await;
    let run = node.run_agent("boss", "go").await;
    node.wait_run(run).await;
    let refused = node.failed_calls(run, "delegate");
    assert_eq!(refused.len(), 4, "{refused:?}");
    for (detail, says) in refused.iter().zip([
        "retries or retry, not both",
        "retry.attempts is 0",
        "`budget_exhausted`",
        "only while its caller waits",
    ]) {
        assert!(detail.contains(says), "{says:?} not in {detail:?}");
    }
    assert_eq!(attempts(&node, run), 0, "nothing started");
}

/// `[limits.concurrency] per_agent`: with `worker = 1`, the three workers a
/// lead delegates at once run one after another (each one's first model
/// call comes after the previous one ended), and all finish; without the
/// bound the same three overlap. What the node says while they wait is in
/// its slots' view.
#[tokio::test]
async fn an_agents_concurrency_bound_runs_its_jobs_one_at_a_time() {
    let lead = agent_md(
        "subagents: [worker]\nscript:\n  - call: {tool: delegate, args: {wait: true, jobs: [{agent: worker, request: a, label: a}, {agent: worker, request: b, label: b}, {agent: worker, request: c, label: c}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let worker = agent_md(
        "description: works\nscript:\n  - say: working\n    delay: 50ms\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    // Each worker's (first model call, end), as indexes in the run's events.
    let spans = |node: &TestNode, run| {
        let events = node.events(run);
        let tree = node.tree(run);
        let mut spans = vec![];
        for label in ["a", "b", "c"] {
            let id = tree.find(label).unwrap();
            let first = events
                .iter()
                .position(|e| matches!(&e.kind, EventKind::ModelCalled { id: j, .. } if *j == id));
            let end = events
                .iter()
                .position(|e| matches!(&e.kind, EventKind::JobFinished { id: j, .. } if *j == id));
            spans.push((first.unwrap(), end.unwrap()));
        }
        spans.sort_unstable();
        spans
    };
    let agents = [("lead", lead.as_str()), ("worker", worker.as_str())];
    let bounded = TestNode::start_with_config(
        "[limits.concurrency]\nper_agent = { worker = 1 }\n",
        &agents,
    )
    .await;
    let run = bounded.run_agent("lead", "go").await;
    let tree = bounded.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    let one_by_one = spans(&bounded, run);
    for pair in one_by_one.windows(2) {
        assert!(
            pair[0].1 < pair[1].0,
            "two workers ran at once: {one_by_one:?}"
        );
    }
    assert_eq!(
        bounded.node().agent_slots(),
        vec![("worker".to_string(), 1, 0, 0)],
        "every slot is free again"
    );

    let open = TestNode::start(&agents).await;
    let run = open.run_agent("lead", "go").await;
    open.wait_run(run).await;
    let together = spans(&open, run);
    assert!(
        together.windows(2).any(|pair| pair[1].0 < pair[0].1),
        "without the bound they overlap: {together:?}"
    );
}

/// A stop reaches a job waiting for its agent's slot (I-17): with `worker
/// = 1` and three slow workers, one runs and two wait; the run's stop ends
/// all three, and every slot is free again.
#[tokio::test]
async fn a_stop_ends_the_jobs_waiting_for_their_agents_slot() {
    let lead = agent_md(
        "subagents: [worker]\nscript:\n  - call: {tool: delegate, args: {wait: true, jobs: [{agent: worker, request: a}, {agent: worker, request: b}, {agent: worker, request: c}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let worker = agent_md(
        "description: works\nscript:\n  - say: working\n    delay: 1h\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    let node = TestNode::start_with_config(
        "[limits.concurrency]\nper_agent = { worker = 1 }\n",
        &[("lead", &lead), ("worker", &worker)],
    )
    .await;
    let run = node.run_agent("lead", "go").await;
    node.wait_until(run, |t| {
        t.nodes()
            .filter(|(_, n)| n.agent.as_deref() == Some("worker") && n.status == Status::Running)
            .count()
            == 3
    })
    .await;
    // Bounded wait on the view itself: two of the three take their place in line.
    let slots = || node.node().agent_slots();
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while slots() != vec![("worker".to_string(), 1, 1, 2)] {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{:?}", slots());
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    assert_eq!(slots(), vec![("worker".to_string(), 1, 0, 0)]);
}

/// I-65, an agent's `budget.per_run`: what all its jobs of one run hold
/// together (a running job its grant, an ended one what it spent) never
/// passes it. Three workers delegated at once share the pool's 3,000
/// tokens evenly (each granted at most 1,000, though the lead could give
/// more); a delegation while they hold it all is refused, saying so, and
/// starts no worker; the two delegated after the three ended share what
/// those left.
#[tokio::test]
async fn inv_65_an_agents_per_run_budget_bounds_what_all_its_jobs_hold_together() {
    let delegate = |names: &[&str], wait: bool| {
        let jobs: Vec<String> = names
            .iter()
            .map(|n| format!("{{agent: worker, request: {n}, label: {n}}}"))
            .collect();
        format!(
            "  - call: {{tool: delegate, args: {{wait: {wait}, jobs: [{}]}}}}\n",
            jobs.join(", ")
        )
    };
    let lead = agent_md(&format!(
        "subagents: [worker]\nscript:\n{}{}  - call: {{tool: collect, args: {{}}}}\n{}  - call: {{tool: submit_output, args: {{output: done}}}}",
        delegate(&["a", "b", "c"], false),
        delegate(&["d"], true),
        delegate(&["e", "f"], true),
    ));
    // The first turn waits long enough for the lead's next delegation to
    // find the three still holding their grants.
    let worker = agent_md(
        "description: works\nbudget: {per_run: {tokens: 3000}}\nscript:\n  - say: working\n    delay: 1s\n    usage: {input: 300, output: 100}\n  - call: {tool: submit_output, args: {output: ok}}\n    usage: {input: 400, output: 50}",
    );
    let node = TestNode::start(&[("lead", lead.as_str()), ("worker", worker.as_str())]).await;
    let run = node.run_agent("lead", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
    let account = |label: &str| {
        let id = tree
            .find(label)
            .unwrap_or_else(|| panic!("no worker {label}"));
        tree.node(id).unwrap().account
    };
    let first: Vec<_> = ["a", "b", "c"].iter().map(|l| account(l)).collect();
    for a in &first {
        assert_eq!(a.grant, 1_000, "a third of the pool: {a:?}");
    }
    let refused = node.events(run).into_iter().any(|e| {
        matches!(&e.kind, EventKind::ToolCalled { tool, ok: false, detail, .. }
            if tool == "delegate" && detail.contains("budget.per_run"))
    });
    assert!(refused, "the delegation is refused naming budget.per_run");
    assert!(
        tree.find("d").is_none(),
        "no worker of the refused delegation started"
    );
    let left = 3_000 - first.iter().map(|a| a.spent).sum::<u64>();
    assert!(left < 3_000, "the three spent something");
    for label in ["e", "f"] {
        let a = account(label);
        assert!(
            a.grant <= left / 2,
            "{label}: half of what the first three left ({left}) at most: {a:?}"
        );
    }
    node.assert_conserved(run);
}
