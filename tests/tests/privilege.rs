//! Privilege down the chain (I-25): a child can narrow, never widen.

use arbor_protocol::EventKind;
use arbor_testkit::{TestNode, agent_md};

#[tokio::test]
async fn inv_25_a_child_cannot_widen_its_parents_tools_by_naming_them() {
    let boss = agent_md(
        "tools: [read_file, write_file]\ndeny: [exec]\nsubagents: [greedy]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: greedy, request: go, label: g, deny: [write_file]}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    // It names every sandbox tool; its parent has no exec and denies it, and the job denies write_file.
    let greedy = agent_md(
        "description: wants everything\ntools: [exec, read_file, write_file]\nscript:\n  - call:\n      - {tool: exec, args: {command: id}}\n      - {tool: write_file, args: {path: a.txt, content: x}}\n      - {tool: read_file, args: {path: missing.txt}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("greedy", &greedy)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let g = tree.find("g").unwrap();
    let results: Vec<(String, bool, String)> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ToolCalled {
                id,
                tool,
                ok,
                detail,
                ..
            } if id == g && tool != "submit_output" => Some((tool, ok, detail)),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 3);
    assert!(results[0].2.contains("exec is denied"), "{results:?}");
    assert!(results[1].2.contains("write_file is denied"), "{results:?}");
    // read_file is offered (the parent has it): the error is the missing file, not the privilege.
    assert!(!results[2].2.contains("not offered"), "{results:?}");
    assert!(results[2].2.contains("missing.txt"), "{results:?}");
    assert!(!node.workdir(run, g).join("a.txt").exists());
}
