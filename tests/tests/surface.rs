//! The node's surface: contained panics (I-38) and events (I-39).

use arbor_actors::node::job_name;
use arbor_protocol::{ErrorClass, EventKind, ParentRef, Status};
use arbor_storage::LedgerOp;
use arbor_testkit::faults::{FaultyModels, ModelFault};
use arbor_testkit::{TestNode, agent_md};

#[tokio::test]
async fn inv_38_a_panicking_model_adapter_fails_its_job_not_the_node() {
    let boss = agent_md(
        "subagents: [crasher]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: crasher, request: go, label: c}]}}\n  - call: {tool: submit_output, args: {output: survived}}",
    );
    let crasher = agent_md(
        "description: its adapter panics\nscript:\n  - call: {tool: submit_output, args: {output: x}}",
    );
    let models = FaultyModels::new();
    models.on_every_job("crasher", [ModelFault::Panic]);
    let node = TestNode::start_full(None, &[("boss", &boss), ("crasher", &crasher)], models).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let c = tree.node(tree.find("c").unwrap()).unwrap();
    assert_eq!(
        (c.status, c.error_class),
        (Status::Failed, Some(ErrorClass::Panicked))
    );
    assert!(c.error.as_deref().unwrap().contains("a model adapter bug"));
    assert_eq!(
        tree.run_status(),
        Status::Done,
        "one error result; the boss went on"
    );
    // The node still takes work.
    let again = node.run_agent("boss", "again").await;
    assert_eq!(node.wait_run(again).await.run_status(), Status::Done);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_38_a_job_actor_that_dies_is_failed_and_charged_by_its_parent() {
    let boss = agent_md(
        "subagents: [victim]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: victim, request: go, label: v}]}}\n  - call: {tool: submit_output, args: {output: survived}}",
    );
    let victim = agent_md(
        "description: dies mid-work\nscript:\n  - usage: {input: 10, output: 5}\n    call: {tool: collect, args: {}}\n  - say: hanging\n    delay: 1h",
    );
    let node = TestNode::start(&[("boss", &boss), ("victim", &victim)]).await;
    let run = node.run_agent("boss", "go").await;
    let v = node.wait_for(run, "v").await;
    node.wait_until(run, |t| t.node(v).is_some_and(|n| n.account.spent == 15))
        .await;
    ractor::registry::where_is(job_name(v)).unwrap().kill();
    let tree = node.wait_run(run).await;
    let victim = tree.node(v).unwrap();
    assert_eq!(
        (victim.status, victim.error_class),
        (Status::Failed, Some(ErrorClass::Panicked))
    );
    assert_eq!(victim.account.spent, 15, "charged what it had spent");
    assert_eq!(tree.run_status(), Status::Done);
    let boss = tree.node(tree.find("boss").unwrap()).unwrap();
    assert_eq!(boss.account.held, 0);
}

#[tokio::test]
async fn inv_39_every_state_change_emits_an_event() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: a}, {agent: leaf, request: b}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let events = node.events(run);
    // Every node's lifecycle: spawned, running, finished; the run's start and end.
    for (id, _) in tree.nodes() {
        let mine: Vec<&str> = events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::JobSpawned { id: i, .. } if *i == id => Some("spawned"),
                EventKind::JobRunning { id: i } if *i == id => Some("running"),
                EventKind::JobFinished { result, .. } if result.job == id => Some("finished"),
                _ => None,
            })
            .collect();
        assert_eq!(mine, ["spawned", "running", "finished"]);
    }
    assert!(matches!(
        events.first().unwrap().kind,
        EventKind::RunStarted { .. }
    ));
    assert!(matches!(
        events.last().unwrap().kind,
        EventKind::RunFinished { .. }
    ));
    // Every change of every account is one event: each message that changed it
    // (a reservation of several holds is one change; opening is in JobSpawned).
    let mut owners = vec![(ParentRef::Run(run), 1)];
    owners.extend(tree.nodes().map(|(id, _)| {
        (
            ParentRef::Job(id),
            node.journal().delegations(id).unwrap().len(),
        )
    }));
    for (owner, reservations) in owners {
        let ledger = node.ledger(owner);
        let holds = ledger
            .iter()
            .filter(|r| matches!(r.op, LedgerOp::Hold { .. }))
            .count();
        let changes = ledger
            .iter()
            .filter(|r| !matches!(r.op, LedgerOp::Close { .. } | LedgerOp::Open { .. }))
            .count()
            - holds
            + reservations;
        let events = events
            .iter()
            .filter(
                |e| matches!(&e.kind, EventKind::AccountChanged { owner: o, .. } if *o == owner),
            )
            .count();
        assert_eq!(changes, events, "{owner:?}");
    }
}

#[tokio::test]
async fn inv_39_a_chatty_jobs_events_are_bounded_in_the_timeline() {
    let turns = "  - call: {tool: exec, args: {command: \"true\"}}\n".repeat(70);
    let chatty = agent_md(&format!(
        "max_turns: 100\nmax_repeats: 100\nscript:\n{turns}  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let node = TestNode::start(&[("chatty", &chatty)]).await;
    let run = node.run_agent("chatty", "go").await;
    let tree = node.wait_run(run).await;
    let id = tree.find("chatty").unwrap();
    let about_it = node
        .events(run)
        .iter()
        .filter(|e| e.kind.job() == Some(id))
        .count() as u64;
    assert!(about_it > 200, "{about_it} events");
    let elided = tree.node(id).unwrap().events_elided;
    assert_eq!(elided, about_it - arbor_protocol::tree::EVENTS_PER_JOB);
}

/// A job is given a Sandbox actor only when it is offered a tool that uses
/// one (`exec`, `read_file`, `write_file`): a wide fan-out of jobs that only
/// think and answer spawns no sandbox for any of them. Counted on the live
/// actors: each job's children are its Account, its Sandbox if any, and
/// its own jobs.
#[tokio::test]
async fn a_job_has_a_sandbox_actor_only_when_offered_a_tool_that_uses_one() {
    let boss = agent_md(
        "tools: [write_file]\nsubagents: [thinker, writer]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: thinker, request: a, label: t}, {agent: writer, request: b, label: w}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let waits = "script:\n  - say: working\n    delay: 1h\n    call: {tool: submit_output, args: {output: late}}";
    let thinker = agent_md(&format!("description: thinks\n{waits}"));
    let writer = agent_md(&format!(
        "description: writes\ntools: [write_file]\n{waits}"
    ));
    let node =
        TestNode::start(&[("boss", &boss), ("thinker", &thinker), ("writer", &writer)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node
        .wait_until(run, |t| {
            ["t", "w"].iter().all(|l| {
                t.find(l)
                    .and_then(|id| t.node(id))
                    .is_some_and(|n| n.account.held > 0)
            })
        })
        .await;
    let children = |label: &str| {
        let id = tree.find(label).expect(label);
        ractor::registry::where_is(job_name(id))
            .expect("its actor is alive")
            .get_children()
            .len()
    };
    assert_eq!(
        children("t"),
        1,
        "a job with no sandbox tool: its Account only"
    );
    assert_eq!(
        children("w"),
        2,
        "write_file (its parent holds it too): its Account and its Sandbox"
    );
    assert_eq!(
        children("boss"),
        4,
        "its Account, its Sandbox and its two jobs"
    );
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    node.assert_conserved(run);
}
