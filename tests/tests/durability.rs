//! Write-ahead (I-29): what starts a child is durable before the child starts.

use arbor_protocol::{EventKind, NodeKind, ParentRef};
use arbor_testkit::{TestNode, agent_md};
use std::sync::{Arc, Mutex};

#[tokio::test]
async fn inv_29_a_delegation_and_its_grant_are_durable_before_the_child_starts() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: a, label: a}, {agent: leaf, request: b, label: b}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let journal = node.journal().clone();
    let checked = Arc::new(Mutex::new(vec![]));
    let log = checked.clone();
    // Looked at in the very moment each node is spawned, before it runs.
    node.observe(move |e| {
        if let EventKind::JobSpawned {
            id,
            parent,
            record_seq,
            ..
        } = &e.kind
        {
            let durable = journal.durable_seq();
            let record = journal.job(e.run, *id).unwrap();
            let delegated = match parent {
                ParentRef::Job(p) => journal
                    .delegations(*p)
                    .unwrap()
                    .iter()
                    .any(|d| d.children.contains(id)),
                ParentRef::Run(_) => true,
            };
            let held = match parent {
                ParentRef::Job(p) => journal.ledger(ParentRef::Job(*p)).unwrap().iter().any(
                    |r| matches!(r.op, arbor_storage::LedgerOp::Hold { child, .. } if child == *id),
                ),
                ParentRef::Run(r) => journal.ledger(ParentRef::Run(*r)).unwrap().iter().any(
                    |l| matches!(l.op, arbor_storage::LedgerOp::Hold { child, .. } if child == *id),
                ),
            };
            log.lock()
                .unwrap()
                .push((durable >= *record_seq, record.is_some(), delegated, held));
        }
    });
    let run = node.run_agent("boss", "go").await;
    node.wait_run(run).await;
    let checked = checked.lock().unwrap();
    assert_eq!(checked.len(), 3, "the step and two jobs");
    for (durable, recorded, delegated, held) in checked.iter() {
        assert!(
            *durable,
            "its admission record was flushed before it started"
        );
        assert!(
            *recorded && *delegated && *held,
            "its record, delegation and grant were written"
        );
    }
}

/// I-29 for a child's end: its parent appends the terminal record without
/// waiting (a stop of 10,000 children does not wait for 10,000 syncs in a
/// row), and tells nobody of it, no `JobFinished` and not the result of the
/// delegate call waiting on it, until a flush covers it.
#[tokio::test]
async fn inv_29_a_childs_end_is_told_only_once_it_is_durable() {
    const CHILDREN: usize = 8;
    let jobs = ["{agent: leaf, request: go}"; CHILDREN].join(", ");
    let boss = agent_md(&format!(
        "subagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{jobs}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let leaf = agent_md(
        "description: waits\nscript:\n  - say: working\n    delay: 1h\n    call: {tool: submit_output, args: {output: late}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node.run_agent("boss", "go").await;
    // Every child spawned, its grant held by the parent.
    let tree = node
        .wait_until(run, |t| {
            t.find("boss").is_some_and(|b| {
                t.children_of(b).len() == CHILDREN && t.node(b).is_some_and(|n| n.account.held > 0)
            })
        })
        .await;
    let boss_id = tree.find("boss").expect("the step");
    let leaves = tree.children_of(boss_id);
    node.journal().flush().await.expect("flush");

    node.journal().faults().hold_flushes(true);
    for leaf in &leaves {
        node.stop_job(run, *leaf).await;
    }
    // The parent has settled every child: each grant released.
    node.wait_until(run, |t| {
        t.node(boss_id).is_some_and(|b| b.account.held == 0)
    })
    .await;
    let faults = node.journal().clone();
    let parked = tokio::task::spawn_blocking(move || {
        faults
            .faults()
            .wait_until_flush_held(std::time::Duration::from_secs(10))
    })
    .await
    .expect("join");
    assert!(
        parked,
        "the parent waits for a flush to cover its children's ends"
    );
    let told = |events: &[arbor_protocol::Event]| {
        events
            .iter()
            .filter(|e| matches!(&e.kind, EventKind::JobFinished { result, .. } if leaves.contains(&result.job)))
            .count()
    };
    let events = node.events(run);
    assert_eq!(told(&events), 0, "no child's end told before it is durable");
    assert!(
        !events
            .iter()
            .any(|e| matches!(&e.kind, EventKind::ToolCalled { tool, .. } if tool == "delegate")),
        "the delegate call is not answered before its children's ends are durable"
    );

    node.journal().faults().hold_flushes(false);
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), arbor_protocol::Status::Done);
    let events = node.events(run);
    assert_eq!(told(&events), CHILDREN, "each end told once it was durable");
    let answered = events
        .iter()
        .position(|e| matches!(&e.kind, EventKind::ToolCalled { tool, .. } if tool == "delegate"))
        .expect("the delegate call answered");
    assert_eq!(
        told(&events[..answered]),
        CHILDREN,
        "every child's end is told before the call that waited on them returns"
    );
    for leaf in &leaves {
        let record = node.journal().job(run, *leaf).unwrap().expect("its record");
        assert_eq!(record.status, arbor_protocol::Status::Stopped);
    }
}

/// A delegate call that waits takes two flushes, not four. The admission's
/// commit also opens the child's account and reserves its first call, so the
/// child's first request waits for no commit of its own. The child's end
/// takes no flush of its own either: the parent's loop is answered on the
/// appended end, holds back what it would tell, and its next model call's
/// reservation, a commit, makes the end durable with it. A watcher still
/// reads the child's end before the call that waited on it.
#[tokio::test]
async fn inv_29_a_delegation_that_waits_takes_two_flushes() {
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let flushes = |calls: usize| {
        let leaf = leaf.clone();
        async move {
            let delegate =
                "  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go}]}}\n"
                    .repeat(calls);
            let boss = agent_md(&format!(
                "subagents: [leaf]\nmax_repeats: 100\nscript:\n{delegate}  - call: {{tool: submit_output, args: {{output: done}}}}"
            ));
            let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
            let before = node.journal().flush_count();
            let run = node.run_agent("boss", "go").await;
            let tree = node.wait_run(run).await;
            assert_eq!(tree.run_status(), arbor_protocol::Status::Done);
            node.journal().flush().await.expect("flush");
            (node.journal().flush_count() - before, node.events(run))
        }
    };
    let (few, _) = flushes(2).await;
    let (many, events) = flushes(12).await;
    let per_call = (many - few) as f64 / 10.0;
    // The count is the sled log's: it flushes only when a commit waits. A
    // PostgreSQL journal's writer sends whatever is queued whenever it
    // wakes, so its count says how often it woke, not what waited.
    if !arbor_testkit::backend::on_postgres() {
        assert!(
            per_call <= 2.2,
            "{per_call} flushes a delegation ({few} for 2, {many} for 12): more than its admission and its parent's next reservation"
        );
    }
    // Each child's end, then the call that waited on it, then the turn after.
    let mut last_end = None;
    let mut answered = 0;
    for (i, e) in events.iter().enumerate() {
        match &e.kind {
            EventKind::JobFinished { result, .. } if result.agent == "leaf" => last_end = Some(i),
            EventKind::ToolCalled { tool, .. } if tool == "delegate" => {
                assert!(
                    last_end.take().is_some(),
                    "a delegate call told before its child's end, at event {i}"
                );
                answered += 1;
            }
            _ => {}
        }
    }
    assert_eq!(answered, 12);
}

/// I-29 for a step's end, as for a job's: the Run appends each step's
/// terminal record without waiting for a sync of its own (64 steps that end
/// together do not wait for 64 syncs in a row), and tells nobody of it until
/// a flush covers it.
#[tokio::test]
async fn inv_29_a_steps_end_is_told_only_once_it_is_durable() {
    const STEPS: usize = 8;
    let waiter = agent_md(
        "description: waits\nscript:\n  - say: working\n    delay: 1h\n    call: {tool: submit_output, args: {output: late}}",
    );
    let steps = (1..=STEPS)
        .map(|i| format!("{{ agent = \"waiter\", instruction = \"part {i}\" }}"))
        .collect::<Vec<_>>()
        .join(", ");
    let flow = format!("[[group]]\nsteps = [{steps}]\n");
    let node = TestNode::start_workspace(
        None,
        &[("waiter", &waiter)],
        &[("wide", &flow)],
        arbor_testkit::RecordingModels::new(),
    )
    .await;
    let run = node.run_flow("wide").await;
    // Every step in its model call: its reservation committed and shown.
    let in_call = |t: &arbor_protocol::Tree| {
        t.nodes()
            .filter(|(_, n)| n.kind == NodeKind::Step && n.account.held > 0)
            .map(|(id, _)| id)
            .collect::<Vec<_>>()
    };
    let tree = node.wait_until(run, |t| in_call(t).len() == STEPS).await;
    let steps = in_call(&tree);
    node.journal().flush().await.expect("flush");

    node.journal().faults().hold_flushes(true);
    for step in &steps {
        node.stop_job(run, *step).await;
    }
    // The Run has settled every step while no flush could complete: each
    // grant released to the run's account.
    node.wait_until(run, |t| t.root().account.held == 0).await;
    let faults = node.journal().clone();
    let parked = tokio::task::spawn_blocking(move || {
        faults
            .faults()
            .wait_until_flush_held(std::time::Duration::from_secs(10))
    })
    .await
    .expect("join");
    assert!(parked, "the Run waits for a flush to cover its steps' ends");
    let told = |events: &[arbor_protocol::Event]| {
        events
            .iter()
            .filter(|e| matches!(&e.kind, EventKind::JobFinished { result, .. } if steps.contains(&result.job)))
            .count()
    };
    assert_eq!(
        told(&node.events(run)),
        0,
        "no step's end told before it is durable"
    );

    node.journal().faults().hold_flushes(false);
    let tree = node.wait_run(run).await;
    assert!(tree.run_status().is_terminal());
    let events = node.events(run);
    assert_eq!(told(&events), STEPS, "each end told once it was durable");
    let finished = events
        .iter()
        .position(|e| matches!(e.kind, EventKind::RunFinished { .. }))
        .expect("the run's end");
    assert_eq!(
        told(&events[..finished]),
        STEPS,
        "every step's end is told before the run's"
    );
    for step in &steps {
        let record = node.journal().job(run, *step).unwrap().expect("its record");
        assert_eq!(record.status, arbor_protocol::Status::Stopped);
    }
    node.assert_conserved(run);
}
