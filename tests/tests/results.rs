//! Results and status: the envelope (I-21), task_status grading (I-22),
//! retries (I-23), and artifacts the runtime saw (I-24).

use arbor_actors::model::Message;
use arbor_protocol::{ErrorClass, Status, TaskStatus};
use arbor_testkit::{RecordingModels, TestNode, agent_md};

const LEAF: &str = "description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: {answer: 42}, limitations: [none really]}}";

#[tokio::test]
async fn inv_21_a_result_is_a_machine_readable_envelope() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go, label: a}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let models = RecordingModels::new();
    let node = TestNode::start_full(
        None,
        &[("boss", &boss), ("leaf", &agent_md(LEAF))],
        models.clone(),
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let second = &models.requests("boss")[1];
    let result = second
        .messages
        .iter()
        .find_map(|m| match m {
            Message::ToolResult {
                content,
                is_error: false,
                ..
            } => Some(content.clone()),
            _ => None,
        })
        .expect("the delegate result is in the boss's history");
    let envelopes: serde_json::Value = serde_json::from_str(&result).unwrap();
    let env = &envelopes[0];
    for key in [
        "job",
        "attempt",
        "agent",
        "status",
        "task_status",
        "output",
        "error",
        "limitations",
        "artifacts",
        "tokens_spent",
        "usd_micros_spent",
        "turns",
        "workdir",
    ] {
        assert!(env.get(key).is_some(), "the envelope has {key}: {env}");
    }
    assert_eq!(env["job"], tree.find("a").unwrap().to_string());
    assert_eq!(env["status"], "done");
    assert_eq!(env["task_status"], "completed");
    assert_eq!(env["output"], serde_json::json!({"answer": 42}));
    assert_eq!(env["limitations"], serde_json::json!(["none really"]));
    assert_eq!(env["attempt"], 1);
    assert_eq!(env["turns"], 1);
    assert!(env["tokens_spent"].as_u64().unwrap() > 0);
}

async fn one_child(child_front: &str, job_extra: &str) -> arbor_protocol::TreeNode {
    let boss = agent_md(&format!(
        "tools: [exec, write_file]\nsubagents: [child]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{{agent: child, request: go, label: c{job_extra}}}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let child = agent_md(&format!("description: child\n{child_front}"));
    let node = TestNode::start(&[("boss", &boss), ("child", &child)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    node.assert_conserved(run);
    tree.node(tree.find("c").unwrap()).unwrap().clone()
}

#[tokio::test]
async fn inv_22_task_status_starts_from_the_declaration_and_checks_only_lower_it() {
    // A final answer without a tool call declares completed.
    let c = one_child("script:\n  - say: the answer is 42", "").await;
    assert_eq!(
        (c.status, c.task_status, c.output.clone()),
        (
            Status::Done,
            Some(TaskStatus::Completed),
            "the answer is 42".into()
        )
    );
    // The agent's own declaration stands.
    let c = one_child(
        "script:\n  - call: {tool: submit_output, args: {output: half, task_status: blocked}}",
        "",
    )
    .await;
    assert_eq!(c.task_status, Some(TaskStatus::Blocked));
    // An empty answer fails; so does a script that runs out.
    let c = one_child(
        "script:\n  - call: {tool: submit_output, args: {output: \"\"}}",
        "",
    )
    .await;
    assert_eq!(
        (c.status, c.task_status),
        (Status::Failed, Some(TaskStatus::Failed))
    );
    let c = one_child("script: []", "").await;
    assert_eq!(c.task_status, Some(TaskStatus::Failed));
    // The turn cap: partial if it said something, else failed.
    let c = one_child("max_turns: 2\nscript:\n  - say: progress so far\n    call: {tool: collect, args: {}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: never}}", "").await;
    assert_eq!(
        (c.task_status, c.output.clone()),
        (Some(TaskStatus::Partial), "progress so far".into())
    );
    let c = one_child(
        "max_turns: 1\nscript:\n  - call: {tool: collect, args: {}}",
        "",
    )
    .await;
    assert_eq!(c.task_status, Some(TaskStatus::Failed));
    // An output that violates its schema fails, whatever was declared.
    let c = one_child(
        "script:\n  - call: {tool: submit_output, args: {output: {count: many}}}",
        ", output_schema: {type: object, properties: {count: {type: integer}}, required: [count]}",
    )
    .await;
    assert_eq!(
        (c.status, c.task_status),
        (Status::Failed, Some(TaskStatus::Failed))
    );
    assert!(
        c.limitations
            .iter()
            .any(|l| l.contains("does not match its schema")),
        "{:?}",
        c.limitations
    );
    // A required artifact missing caps it at partial.
    let c = one_child(
        "script:\n  - call: {tool: submit_output, args: {output: wrote it}}",
        ", require_artifacts: [report.md]",
    )
    .await;
    assert_eq!(
        (c.status, c.task_status),
        (Status::Done, Some(TaskStatus::Partial))
    );
    assert!(c.limitations.iter().any(|l| l.contains("report.md")));
}

#[tokio::test]
async fn inv_23_a_retry_is_a_new_attempt_told_why_the_last_one_failed() {
    let boss = agent_md(
        "subagents: [flaky]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: flaky, request: count the stars, label: f, retries: 9}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let flaky = agent_md(
        "description: fails\nscript:\n  - call: {tool: submit_output, args: {output: lost count, task_status: failed, limitations: [too many stars]}}",
    );
    let models = RecordingModels::new();
    let node =
        TestNode::start_full(None, &[("boss", &boss), ("flaky", &flaky)], models.clone()).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let mut attempts: Vec<(u32, String)> = tree
        .nodes()
        .filter(|(_, n)| n.label.as_deref() == Some("f"))
        .map(|(id, n)| (n.attempt, id.to_string()))
        .collect();
    attempts.sort();
    assert_eq!(attempts.len(), 3, "9 retries are clamped to 2");
    let ids: std::collections::BTreeSet<_> = attempts.iter().map(|a| a.1.clone()).collect();
    assert_eq!(ids.len(), 3, "each attempt has its own id");
    let requests = models.requests("flaky");
    let first_message = |i: usize| match &requests[i].messages[0] {
        Message::User(t) => t.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(first_message(0), "count the stars");
    assert!(first_message(1).contains("A previous attempt failed"));
    assert!(
        first_message(1).contains("too many stars"),
        "{}",
        first_message(1)
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_23_no_retry_after_budget_exhausted_and_malformed_retries_are_refused() {
    let boss = agent_md(
        "subagents: [broke]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: broke, request: go, label: b, retries: -1}]}}\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: broke, request: go, label: b, retries: 1}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: broke, request: go, label: b, retries: 2, budget: {tokens: 50}}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let broke = agent_md(
        "description: spends everything and says nothing\nscript:\n  - usage: {input: 40, output: 100}\n    call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: never}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("broke", &broke)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let refusals: Vec<String> = node.failed_calls(run, "delegate");
    assert!(
        refusals[0].contains("retries must be 0 to 2, got -1"),
        "{refusals:?}"
    );
    assert!(
        refusals[1].contains("retries need wait = true"),
        "{refusals:?}"
    );
    let attempts: Vec<_> = tree
        .nodes()
        .filter(|(_, n)| n.label.as_deref() == Some("b"))
        .collect();
    assert_eq!(attempts.len(), 1, "budget_exhausted is never retried");
    let b = attempts[0].1;
    assert_eq!(
        (b.status, b.error_class),
        (Status::Failed, Some(ErrorClass::BudgetExhausted))
    );
}

#[tokio::test]
async fn inv_24_artifacts_are_what_the_runtime_saw_written_not_what_the_agent_claims() {
    let c = one_child(
        "tools: [exec, write_file]\nscript:\n  - call: {tool: exec, args: {command: \"echo data > seen.csv && mkdir -p sub && echo x > sub/deep.txt\"}}\n  - call: {tool: write_file, args: {path: notes.md, content: hi}}\n  - call: {tool: exec, args: {command: \"rm notes.md\"}}\n  - call: {tool: submit_output, args: {output: \"wrote seen.csv, notes.md and claimed.pdf\"}}",
        "",
    )
    .await;
    assert_eq!(c.artifacts, ["seen.csv", "sub/deep.txt"]);
}
