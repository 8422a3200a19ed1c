//! Write-ahead (I-29): what starts a child is durable before the child starts.

use arbor_protocol::{EventKind, ParentRef};
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
        if let EventKind::NodeSpawned {
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
