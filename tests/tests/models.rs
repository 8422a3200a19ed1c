//! Real models: both wire formats against a mock provider on loopback, and
//! every budget, stop and retry rule on the usage a provider reports.

use arbor_actors::agent_loop::WIND_DOWN_NOTICE;
use arbor_protocol::{ErrorClass, Event, EventKind, RunId, Status, TaskStatus};
use arbor_runtime::Models;
use arbor_testkit::mock_provider::{Answer, Format, MockProvider, StreamEnd, anthropic, openai};
use arbor_testkit::{RecordingModels, TestNode};
use serde_json::json;
use std::sync::Arc;

const PLANNER: &str = "You are the planner.";
const RESEARCHER: &str = "You are the researcher.";

fn agent(front_matter: &str, prompt: &str) -> String {
    format!("---\nmodel: mock/small\n{front_matter}\n---\n{prompt}\n")
}

fn planner() -> String {
    agent(
        "subagents: [researcher]\ntools: [read_file, write_file]\nmax_turns: 6",
        &format!("{PLANNER} Delegate, then report."),
    )
}

fn researcher(front_matter: &str) -> String {
    agent(
        &format!("description: finds facts\n{front_matter}"),
        &format!("{RESEARCHER} Find one fact."),
    )
}

async fn start(mock: &MockProvider, format: Format, extra: &str) -> TestNode {
    let planner = planner();
    let researcher = researcher("tools: [read_file, write_file]");
    TestNode::start_with_config(
        &mock.arbor_toml(format, extra),
        &[("planner", &planner), ("researcher", &researcher)],
    )
    .await
}

fn model_calls(events: &[Event]) -> Vec<EventKind> {
    events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::ModelCalled { .. }))
        .map(|e| e.kind.clone())
        .collect()
}

fn charged(kind: &EventKind) -> u64 {
    match kind {
        EventKind::ModelCalled {
            input_tokens,
            output_tokens,
            ..
        } => input_tokens + output_tokens,
        _ => 0,
    }
}

fn outcome(kind: &EventKind) -> String {
    match kind {
        EventKind::ModelCalled { call, .. } => call.outcome.clone(),
        _ => String::new(),
    }
}

fn step<'a>(tree: &'a arbor_protocol::Tree, name: &str) -> &'a arbor_protocol::TreeNode {
    tree.node(tree.find(name).unwrap_or_else(|| panic!("no {name}")))
        .unwrap()
}

/// Two researchers delegated by two tool calls of one turn, collected, and
/// a report: the whole tree over one format.
async fn delegating_flow(format: Format, extra: &str) {
    let mock = MockProvider::start().await;
    let streamed = extra.is_empty();
    let delegate = |label: &str| {
        (
            "delegate",
            json!({"jobs": [{"agent": "researcher", "request": format!("Find {label}"), "label": label}], "wait": false}),
        )
    };
    let submit = ("submit_output", json!({"output": "Report: A and B."}));
    let answer = |text: &str, calls: &[(&str, serde_json::Value)], i: u64, o: u64| match (
        format, streamed,
    ) {
        (Format::Openai, true) => openai::stream(text, calls, Some((i, o))),
        (Format::Openai, false) if calls.is_empty() => openai::text(text, i, o),
        (Format::Openai, false) => openai::tool_calls(calls, i, o),
        (Format::Anthropic, true) => anthropic::stream(text, calls, i, o),
        (Format::Anthropic, false) => anthropic::message(text, calls, i, o),
    };
    mock.push_for(
        format,
        PLANNER,
        answer("", &[delegate("a"), delegate("b")], 300, 40),
    );
    mock.push_for(
        format,
        PLANNER,
        answer("", &[("collect", json!({}))], 500, 10),
    );
    mock.push_for(format, PLANNER, answer("", &[submit], 900, 20));
    mock.push_for(format, RESEARCHER, answer("A fact.", &[], 200, 5));
    mock.push_for(format, RESEARCHER, answer("A fact.", &[], 210, 6));
    let node = start(&mock, format, extra).await;
    let run = node.run_agent("planner", "Write a report.").await;
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Done, "{root:#?}");
    assert_eq!(root.output, json!("Report: A and B."));
    for label in ["a", "b"] {
        let job = step(&tree, label);
        assert_eq!(job.status, Status::Done);
        assert_eq!(job.output, json!("A fact."));
    }
    // Every token charged is one the provider reported.
    let planner_step = step(&tree, "planner");
    assert_eq!(
        planner_step.account.spent,
        300 + 40 + 500 + 10 + 900 + 20 + 205 + 216
    );
    node.assert_conserved(run);
    // The second turn carried both tool results back, in the provider's shape.
    let second = &mock.received_for(PLANNER)[1];
    let text = second.body.to_string();
    match format {
        Format::Openai => {
            let tools: Vec<_> = second.body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "tool")
                .collect();
            assert_eq!(tools.len(), 2, "{text}");
            assert_eq!(tools[1]["tool_call_id"], "call_mock_1");
        }
        Format::Anthropic => {
            assert_eq!(
                second.headers["anthropic-version"],
                arbor_providers::ANTHROPIC_VERSION
            );
            let last = second.body["messages"].as_array().unwrap().last().unwrap();
            assert_eq!(last["role"], "user");
            assert_eq!(last["content"][1]["tool_use_id"], "toolu_mock_1", "{text}");
        }
    }
    assert!(
        text.contains("\"name\":\"delegate\""),
        "tools offered: {text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delegating_flow_completes_over_openai_whole_answers() {
    delegating_flow(Format::Openai, "stream = false").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delegating_flow_completes_over_openai_streams() {
    delegating_flow(Format::Openai, "").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delegating_flow_completes_over_anthropic_whole_answers() {
    delegating_flow(Format::Anthropic, "stream = false").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delegating_flow_completes_over_anthropic_streams() {
    delegating_flow(Format::Anthropic, "").await;
}

/// One planner turn answered by `answer`, then a submit.
async fn one_call(format: Format, extra: &str, answer: Answer) -> (TestNode, RunId, MockProvider) {
    let mock = MockProvider::start().await;
    mock.push_for(format, PLANNER, answer);
    let submit = [("submit_output", json!({"output": "done"}))];
    mock.push_for(
        format,
        PLANNER,
        match format {
            Format::Openai => openai::tool_calls(&submit, 10, 5),
            Format::Anthropic => anthropic::message("", &submit, 10, 5),
        },
    );
    let node = start(&mock, format, extra).await;
    let run = node.run_agent("planner", "Go.").await;
    node.wait_run(run).await;
    (node, run, mock)
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_11_each_call_reserves_at_least_its_body_and_settles_on_reported_usage_both_ways() {
    let read = [("collect", json!({}))];
    // Below the estimate: charged exactly what was reported.
    let (node, run, mock) = one_call(
        Format::Openai,
        "stream = false",
        openai::tool_calls(&read, 17, 3),
    )
    .await;
    let calls = model_calls(&node.events(run));
    let EventKind::ModelCalled { reserved, .. } = &calls[0] else {
        unreachable!()
    };
    let body_bytes = mock.received_for(PLANNER)[0].raw.len() as u64;
    assert!(
        *reserved >= body_bytes,
        "reserved {reserved} < body {body_bytes} bytes"
    );
    assert_eq!(charged(&calls[0]), 20);
    assert_eq!(step(&node.tree(run), "planner").account.spent, 20 + 15);
    node.assert_conserved(run);

    // Above the reservation: charged as reported, and the overrun is an event with both figures.
    let (node, run, _mock) = one_call(
        Format::Anthropic,
        "stream = false",
        anthropic::message("", &read, 90_000, 7),
    )
    .await;
    let events = node.events(run);
    let calls = model_calls(&events);
    let EventKind::ModelCalled { reserved, .. } = calls[0].clone() else {
        unreachable!()
    };
    assert_eq!(charged(&calls[0]), 90_007);
    let overrun = events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::BudgetOverrun {
                reserved, reported, ..
            } => Some((*reserved, *reported)),
            _ => None,
        })
        .expect("a budget_overrun event");
    assert_eq!(overrun, (reserved, 90_007));
    assert_eq!(step(&node.tree(run), "planner").account.spent, 90_007 + 15);
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_11_a_stream_without_usage_is_charged_its_reservation_and_marked_estimated() {
    let (node, run, _mock) = one_call(
        Format::Openai,
        "",
        openai::stream("", &[("collect", json!({}))], None),
    )
    .await;
    let calls = model_calls(&node.events(run));
    let EventKind::ModelCalled { reserved, call, .. } = &calls[0] else {
        unreachable!()
    };
    assert!(call.usage_estimated);
    assert_eq!(charged(&calls[0]), *reserved);
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_12_past_the_wind_down_share_the_notice_rides_on_the_request_never_in_the_history() {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let read = [("read_file", json!({"path": "missing.txt"}))];
    // 20,000 tokens; the first call reports 16,500: past 80%.
    mock.push_for(format, PLANNER, openai::tool_calls(&read, 16_000, 500));
    mock.push_for(format, PLANNER, openai::tool_calls(&read, 100, 5));
    mock.push_for(
        format,
        PLANNER,
        openai::tool_calls(&[("submit_output", json!({"output": "short"}))], 100, 5),
    );
    let lone = agent("tools: [read_file]", &format!("{PLANNER} Read."));
    let node = TestNode::start_with_config(
        &mock.arbor_toml(format, "stream = false"),
        &[("planner", &lone)],
    )
    .await;
    let run = node
        .run_agent_with_budget("planner", "Go.", Some(20_000))
        .await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.root().status, Status::Done, "{:#?}", tree.root());
    let requests = mock.received_for(PLANNER);
    assert_eq!(requests.len(), 3);
    let system = |i: usize| {
        requests[i].body["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(!system(0).contains(WIND_DOWN_NOTICE));
    assert!(system(1).ends_with(WIND_DOWN_NOTICE), "{}", system(1));
    assert!(system(2).ends_with(WIND_DOWN_NOTICE));
    for r in &requests {
        let history = &r.body["messages"].as_array().unwrap()[1..];
        assert!(
            !serde_json::to_string(history)
                .unwrap()
                .contains("Budget notice"),
            "the notice entered the history"
        );
    }
    let wind_downs = node
        .events(run)
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::WindDown {
                    owner: arbor_protocol::ParentRef::Job(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(wind_downs, 1, "one event for the crossing");
    node.assert_conserved(run);
}

/// The researcher, granted `budget` tokens, answers once with `first` and
/// cannot pay for a second call; the planner then submits.
async fn researcher_at_its_ceiling(first: Answer, budget: u64) -> (TestNode, RunId) {
    let mock = MockProvider::start().await;
    let format = Format::Anthropic;
    let delegate = (
        "delegate",
        json!({"jobs": [{"agent": "researcher", "request": "Find it.", "label": "r", "budget": {"tokens": budget}}]}),
    );
    mock.push_for(
        format,
        PLANNER,
        anthropic::message("", &[delegate], 100, 10),
    );
    mock.push_for(format, RESEARCHER, first);
    mock.push_for(
        format,
        PLANNER,
        anthropic::message("", &[("submit_output", json!({"output": "ok"}))], 100, 10),
    );
    let node = start(&mock, format, "stream = false").await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.root().status, Status::Done, "the run goes on");
    assert_eq!(mock.received_for(RESEARCHER).len(), 1);
    node.assert_conserved(run);
    (node, run)
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_13_a_job_at_its_ceiling_returns_partial_with_the_text_it_produced() {
    // Reported below the estimate, but what is left cannot cover another call's bound.
    let read = [("read_file", json!({"path": "notes.md"}))];
    let (node, run) =
        researcher_at_its_ceiling(anthropic::message("Half of it.", &read, 1_500, 500), 3_000)
            .await;
    let tree = node.tree(run);
    let job = step(&tree, "r");
    assert_eq!(job.status, Status::Done);
    assert_eq!(job.task_status, Some(TaskStatus::Partial));
    assert_eq!(job.error_class, Some(ErrorClass::BudgetExhausted));
    assert_eq!(job.output, json!("Half of it."));
    assert_eq!(job.account.spent, 2_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_13_a_job_at_its_ceiling_whose_work_is_a_file_returns_partial() {
    let write = [("write_file", json!({"path": "notes.md", "content": "half"}))];
    let (node, run) =
        researcher_at_its_ceiling(anthropic::message("", &write, 1_500, 500), 3_000).await;
    let tree = node.tree(run);
    let job = step(&tree, "r");
    assert_eq!(job.task_status, Some(TaskStatus::Partial), "{job:#?}");
    assert_eq!(job.artifacts, vec!["notes.md".to_string()]);
}

/// The researcher's first answer is `error`; it may be retried twice.
async fn researcher_fails_with(error: Answer) -> (TestNode, RunId, MockProvider) {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let delegate = (
        "delegate",
        json!({"jobs": [{"agent": "researcher", "request": "Find it.", "label": "r", "retries": 2}]}),
    );
    mock.push_for(format, PLANNER, openai::tool_calls(&[delegate], 100, 10));
    mock.push_for(format, RESEARCHER, error);
    mock.push_for(format, RESEARCHER, openai::text("A fact.", 10, 3));
    mock.push_for(
        format,
        PLANNER,
        openai::tool_calls(&[("submit_output", json!({"output": "ok"}))], 100, 10),
    );
    let node = start(&mock, format, "stream = false\nmax_retries = 1").await;
    let run = node.run_agent("planner", "Go.").await;
    node.wait_run(run).await;
    node.assert_conserved(run);
    (node, run, mock)
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_23_a_usage_cap_and_an_auth_failure_are_never_retried() {
    let cases = [
        (
            openai::error(
                429,
                "insufficient_quota",
                "insufficient_quota",
                "You exceeded your current quota",
            ),
            ErrorClass::ModelUsageCap,
        ),
        (
            openai::error(
                401,
                "invalid_request_error",
                "invalid_api_key",
                "Incorrect API key provided",
            ),
            ErrorClass::ModelAuth,
        ),
        (
            openai::error(403, "permission_error", "", "not allowed"),
            ErrorClass::ModelAuth,
        ),
    ];
    for (error, class) in cases {
        let (node, run, mock) = researcher_fails_with(error).await;
        let tree = node.tree(run);
        let attempts: Vec<_> = tree
            .nodes()
            .filter(|(_, n)| n.label.as_deref() == Some("r"))
            .collect();
        assert_eq!(attempts.len(), 1, "{class}: no second attempt of the job");
        assert_eq!(attempts[0].1.status, Status::Failed);
        assert_eq!(attempts[0].1.error_class, Some(class));
        assert_eq!(
            mock.received_for(RESEARCHER).len(),
            1,
            "{class}: the loop did not retry either"
        );
        assert_eq!(
            attempts[0].1.account.spent, 0,
            "{class}: a refused request costs nothing"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_limit_is_retried_after_its_retry_after_and_each_attempt_is_one_event() {
    let limited = openai::error(429, "requests", "rate_limit_exceeded", "Rate limit reached")
        .with_header("retry-after-ms", "20");
    let (node, run, mock) = researcher_fails_with(limited).await;
    let tree = node.tree(run);
    let job = step(&tree, "r");
    assert_eq!(job.status, Status::Done);
    assert_eq!(job.output, json!("A fact."));
    assert_eq!(mock.received_for(RESEARCHER).len(), 2);
    let calls: Vec<_> = model_calls(&node.events(run))
        .into_iter()
        .filter(|k| matches!(k, EventKind::ModelCalled { id, .. } if tree.node(*id).unwrap().label.as_deref() == Some("r")))
        .collect();
    assert_eq!(
        calls.iter().map(outcome).collect::<Vec<_>>(),
        ["model_rate_limit", "ok"]
    );
    let EventKind::ModelCalled { call, .. } = &calls[1] else {
        unreachable!()
    };
    assert_eq!(call.retries, 1);
    assert_eq!(call.provider, "mock");
    assert_eq!(call.model, "mock-small");
    assert_eq!(job.account.spent, 13, "the refused attempt cost nothing");
}

#[tokio::test(flavor = "multi_thread")]
async fn overload_and_server_errors_are_retried_and_bounded() {
    let (node, run, _) = researcher_fails_with(anthropic_shaped_overload()).await;
    assert_eq!(step(&node.tree(run), "r").status, Status::Done);

    // Two server errors with max_retries = 1: the call fails for good after
    // its two attempts, and the job with it.
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let delegate = (
        "delegate",
        json!({"jobs": [{"agent": "researcher", "request": "Find it.", "label": "r"}]}),
    );
    mock.push_for(format, PLANNER, openai::tool_calls(&[delegate], 100, 10));
    mock.push_for(
        format,
        RESEARCHER,
        Answer::json(500, json!({"error": {"message": "boom"}})),
    );
    mock.push_for(
        format,
        RESEARCHER,
        Answer::json(502, json!({"error": {"message": "bad gateway"}})),
    );
    mock.push_for(
        format,
        PLANNER,
        openai::tool_calls(&[("submit_output", json!({"output": "ok"}))], 100, 10),
    );
    let node = start(&mock, format, "stream = false\nmax_retries = 1").await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    let job = step(&tree, "r");
    assert_eq!(job.status, Status::Failed);
    assert_eq!(job.error_class, Some(ErrorClass::ModelServer));
    assert!(
        job.error.as_deref().unwrap().contains("after 2 attempts"),
        "{job:#?}"
    );
    node.assert_conserved(run);
}

fn anthropic_shaped_overload() -> Answer {
    Answer::json(
        529,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    )
}

/// The step's one call is answered by `answer`, with no retries.
/// (The same answer twice: a prompt refused as too long is tried once more, compacted.)
async fn step_fails_with(format: Format, extra: &str, answer: Answer) -> arbor_protocol::TreeNode {
    let mock = MockProvider::start().await;
    mock.push_for(format, PLANNER, answer.clone());
    mock.push_for(format, PLANNER, answer);
    let node = start(&mock, format, &format!("{extra}\nmax_retries = 0")).await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    node.assert_conserved(run);
    assert_eq!(tree.root().status, Status::Failed);
    step(&tree, "planner").clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_answer_is_an_error_of_its_class_never_a_panic() {
    let cases: Vec<(Format, &str, Answer, ErrorClass)> = vec![
        (
            Format::Openai,
            "stream = false",
            openai::error(
                400,
                "invalid_request_error",
                "context_length_exceeded",
                "This model's maximum context length is 8192 tokens",
            ),
            ErrorClass::ContextTooLong,
        ),
        (
            Format::Openai,
            "stream = false",
            openai::error(
                400,
                "invalid_request_error",
                "",
                "Unrecognized request argument supplied: foo",
            ),
            ErrorClass::ModelBadRequest,
        ),
        (
            Format::Openai,
            "stream = false",
            Answer::Body {
                status: 200,
                headers: vec![],
                body: "<html>not json</html>".into(),
            },
            ErrorClass::ModelProtocol,
        ),
        (
            Format::Openai,
            "",
            Answer::Stream {
                events: vec!["data: {\"choices\": [{\"delta\": \n\n".into()],
                end: StreamEnd::Close,
            },
            ErrorClass::ModelProtocol,
        ),
        (
            Format::Anthropic,
            "",
            anthropic::partial_stream("Half an ans", 30, StreamEnd::Drop),
            ErrorClass::ModelServer,
        ),
        (
            Format::Anthropic,
            "stream = false",
            anthropic_shaped_overload(),
            ErrorClass::ModelOverloaded,
        ),
    ];
    for (format, extra, answer, class) in cases {
        let planner = step_fails_with(format, extra, answer).await;
        assert_eq!(planner.error_class, Some(class), "{planner:#?}");
        assert!(planner.output.is_null());
    }
}

/// The planner and a researcher on the workspace's own models, watched, so a
/// test can act once a call's answer has started streaming.
async fn watched_node(arbor_toml: &str) -> (TestNode, Arc<RecordingModels>) {
    let planner = planner();
    let researcher = researcher("");
    let agents = [
        ("planner", planner.as_str()),
        ("researcher", researcher.as_str()),
    ];
    let workspace =
        arbor_runtime::Workspace::from_texts("ws".into(), Some(arbor_toml), &agents, &[]).unwrap();
    let watched = RecordingModels::wrapping(Arc::new(Models::new(&workspace.config.providers)));
    let node = TestNode::start_full(Some(arbor_toml), &agents, watched.clone()).await;
    (node, watched)
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_16_a_stop_in_the_middle_of_a_streamed_answer_keeps_nothing_of_it_and_charges_what_streamed()
 {
    let mock = MockProvider::start().await;
    let format = Format::Anthropic;
    mock.push_for(
        format,
        PLANNER,
        anthropic::partial_stream("Partial ans", 25, StreamEnd::Hang),
    );
    let (node, watched) = watched_node(&mock.arbor_toml(format, "")).await;
    let run = node.run_agent("planner", "Go.").await;
    let meter = watched.meter("planner", 0).await;
    meter.streamed_at_least("Partial ans".len() as u64).await;
    let job = node.wait_for(run, "planner").await;
    node.stop_job(run, job).await;
    let tree = node.wait_run(run).await;
    let planner = step(&tree, "planner");
    assert_eq!(planner.status, Status::Stopped);
    assert!(
        planner.output.is_null(),
        "nothing of the answer reached the tree"
    );
    let events = node.events(run);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.kind, EventKind::ToolCalled { .. })),
        "nothing of it was acted on"
    );
    let calls = model_calls(&events);
    assert_eq!(calls.len(), 1);
    assert_eq!(outcome(&calls[0]), "stopped");
    // Input as message_start reported it, output as streamed (one token per byte at most).
    assert_eq!(charged(&calls[0]), 25 + 11);
    assert_eq!(planner.account.spent, 36);
    assert_eq!(mock.received().len(), 1, "no call after the stop");
    node.assert_conserved(run);
}

/// A node whose mock model costs `input` and `output` dollars per million tokens.
async fn priced(mock: &MockProvider, format: Format, input: f64, output: f64) -> TestNode {
    let toml = mock.arbor_toml(format, "stream = false").replace(
        "max_output_tokens = 1024\n",
        &format!("max_output_tokens = 1024\nusd_per_mtok_input = {input}\nusd_per_mtok_output = {output}\n"),
    );
    let planner = planner();
    let researcher = researcher("tools: [read_file, write_file]");
    TestNode::start_with_config(&toml, &[("planner", &planner), ("researcher", &researcher)]).await
}

/// A planner delegating one researcher, on a model at $3 and $15 per million
/// tokens (3 and 15 micro-dollars a token): 100 in and 10 out, then the
/// researcher's 200 and 20, then 300 and 30.
async fn priced_delegation() -> (MockProvider, TestNode) {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let delegate = (
        "delegate",
        json!({"jobs": [{"agent": "researcher", "request": "Find it.", "label": "r"}]}),
    );
    mock.push_for(format, PLANNER, openai::tool_calls(&[delegate], 100, 10));
    mock.push_for(format, RESEARCHER, openai::text("A fact.", 200, 20));
    mock.push_for(
        format,
        PLANNER,
        openai::tool_calls(&[("submit_output", json!({"output": "ok"}))], 300, 30),
    );
    let node = priced(&mock, format, 3.0, 15.0).await;
    (mock, node)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_usd_budgeted_run_charges_exact_micro_dollars_at_every_level() {
    let (_mock, node) = priced_delegation().await;
    let spec = node.workspace.agent_run("planner", "Go.", None).unwrap();
    let spec = node.workspace.with_usd_ceiling(spec, 1_000_000).unwrap();
    let run = node.node().start_run(spec).await.unwrap();
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Done, "{root:#?}");
    let cost = |i: u64, o: u64| i * 3 + o * 15;
    let researcher_cost = cost(200, 20);
    let total = cost(100, 10) + researcher_cost + cost(300, 30);
    assert_eq!(
        root.usd.unwrap(),
        arbor_protocol::AccountView {
            grant: 1_000_000,
            spent: total,
            held: 0
        }
    );
    let r = step(&tree, "r");
    assert_eq!(r.usd.unwrap().spent, researcher_cost);
    assert!(
        r.usd.unwrap().grant > 0,
        "the job got a usd grant of its own"
    );
    let per_call: Vec<u64> = model_calls(&node.events(run))
        .iter()
        .map(|k| match k {
            EventKind::ModelCalled { call, .. } => call.usd_micros,
            _ => 0,
        })
        .collect();
    assert_eq!(per_call.iter().sum::<u64>(), total);
    let finished = node
        .events(run)
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::JobFinished { result, .. }
                if tree.node(result.job).unwrap().label.as_deref() == Some("r") =>
            {
                Some(result.usd_micros_spent)
            }
            _ => None,
        })
        .unwrap();
    assert_eq!(
        finished, researcher_cost,
        "the envelope carries its micro-dollars"
    );
    node.assert_conserved(run);
    let document = serde_json::to_value(&root).unwrap();
    assert_eq!(document["usd"]["spent"], total);
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_11_a_usd_ceiling_is_never_passed_the_output_is_cut_to_what_it_can_pay() {
    let mock = MockProvider::start().await;
    let format = Format::Anthropic;
    let read = [("read_file", json!({"path": "a.txt"}))];
    // Each answer would be 1,000 output tokens; the provider stops at max_tokens.
    for _ in 0..4 {
        mock.push_for(format, PLANNER, anthropic::message("", &read, 1_000, 1_000));
    }
    // 0.5 and 10 micro-dollars a token, 5,000 micro-dollars in all.
    let node = priced(&mock, format, 0.5, 10.0).await;
    let seen = Arc::new(std::sync::Mutex::new(vec![]));
    let record = seen.clone();
    node.observe(move |e| {
        if let EventKind::AccountChanged { usd: Some(usd), .. } = &e.kind {
            record.lock().unwrap().push(*usd);
        }
    });
    let spec = node.workspace.agent_run("planner", "Go.", None).unwrap();
    let spec = node.workspace.with_usd_ceiling(spec, 5_000).unwrap();
    let run = node.node().start_run(spec).await.unwrap();
    let tree = node.wait_run(run).await;
    let planner = step(&tree, "planner");
    assert_eq!(planner.status, Status::Failed);
    assert_eq!(planner.error_class, Some(ErrorClass::BudgetExhausted));
    let requests = mock.received_for(PLANNER);
    let max_tokens = requests[0].body["max_tokens"].as_u64().unwrap();
    assert!(
        max_tokens < 1_000,
        "output cut to what the micro-dollars pay for: {max_tokens}"
    );
    let spent = tree.root().usd.unwrap().spent;
    assert_eq!(
        spent,
        500 + max_tokens * 10,
        "charged exactly: 1,000 in at 0.5, the output at 10"
    );
    assert!(spent <= 5_000);
    for usd in seen.lock().unwrap().iter() {
        assert!(
            usd.spent + usd.held <= usd.grant,
            "passed the ceiling: {usd:?}"
        );
    }
    node.assert_conserved(run);
}

const WRITER: &str = "You are the writer.";

/// One agent on a model with a 3,000-token window.
async fn small_window(mock: &MockProvider, tools: &str) -> TestNode {
    let toml = mock
        .arbor_toml(Format::Openai, "stream = false\nmax_retries = 0")
        .replace("context_window = 8192", "context_window = 3000");
    let writer = agent(&format!("tools: [{tools}]"), &format!("{WRITER} Write."));
    TestNode::start_with_config(&toml, &[("writer", &writer)]).await
}

fn compactions(events: &[Event]) -> Vec<(u32, u32)> {
    events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::ContextCompacted {
                tool_results_elided,
                messages_summarized,
                estimate_before,
                estimate_after,
                ..
            } => {
                assert!(estimate_after < estimate_before);
                Some((tool_results_elided, messages_summarized))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_that_would_not_fit_has_its_oldest_tool_results_elided_first() {
    let mock = MockProvider::start().await;
    let big = (
        "exec",
        json!({"command": "head -c 9000 /dev/zero | tr '\\0' a"}),
    );
    mock.push_for(Format::Openai, WRITER, openai::tool_calls(&[big], 500, 20));
    mock.push_for(
        Format::Openai,
        WRITER,
        openai::tool_calls(&[("submit_output", json!({"output": "done"}))], 700, 10),
    );
    let node = small_window(&mock, "exec").await;
    let run = node.run_agent("writer", "Go.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.root().status, Status::Done, "{:#?}", tree.root());
    let second = &mock.received_for(WRITER)[1];
    let text = second.body.to_string();
    assert!(!text.contains("aaaaaaaaaa"), "the big result was sent");
    assert!(
        text.contains("elided to fit the context window: "),
        "{text}"
    );
    assert_eq!(compactions(&node.events(run)), vec![(1, 0)]);
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn when_eliding_is_not_enough_old_turns_become_a_summary_made_by_a_metered_call() {
    let mock = MockProvider::start().await;
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        let write = (
            "write_file",
            json!({"path": format!("{name}.txt"), "content": name.repeat(1500)}),
        );
        mock.push_for(
            Format::Openai,
            WRITER,
            openai::tool_calls(&[write], 600 + i as u64, 30),
        );
    }
    mock.push_for(
        Format::Openai,
        WRITER,
        openai::tool_calls(
            &[("submit_output", json!({"output": "four files"}))],
            900,
            10,
        ),
    );
    for _ in 0..4 {
        mock.push_for(
            Format::Openai,
            "Summarize this conversation",
            openai::text("Wrote the first files.", 400, 12),
        );
    }
    let node = small_window(&mock, "write_file").await;
    let run = node.run_agent("writer", "Write four files.").await;
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Done, "{root:#?}");
    let summaries = mock.received_for("Summarize this conversation");
    assert!(!summaries.is_empty(), "a summary was asked for");
    assert!(
        summaries[0].body["tools"].is_null(),
        "a summary call offers no tools"
    );
    let compacted = compactions(&node.events(run));
    assert!(
        compacted.iter().any(|(_, summarized)| *summarized > 0),
        "{compacted:?}"
    );
    let last = mock.received_for(WRITER).pop().unwrap().body.to_string();
    assert!(
        last.contains("Summary of the earlier part of this conversation"),
        "{last}"
    );
    assert!(last.contains("Write four files."), "the request is kept");
    // The summary has its fixed sections; the model's words, under no
    // heading, are kept as critical context.
    for heading in arbor_actors::compaction::SUMMARY_HEADINGS {
        assert!(last.contains(&format!("## {heading}")), "{heading}: {last}");
    }
    assert!(
        last.contains("## Critical context\\nWrote the first files."),
        "{last}"
    );
    // A later summary updates the earlier one instead of retelling it.
    assert!(
        summaries.len() >= 2,
        "a second compaction: {}",
        summaries.len()
    );
    for later in &summaries[1..] {
        let text = later.body.to_string();
        assert!(text.contains("PREVIOUS SUMMARY:"), "{text}");
    }
    // The window filled past `context_warn` (0.75): the model was told once.
    let pressure: Vec<_> = node
        .events(run)
        .into_iter()
        .filter(|e| matches!(e.kind, EventKind::ContextPressure { .. }))
        .collect();
    assert_eq!(pressure.len(), 1, "{pressure:?}");
    let told = mock
        .received_for(WRITER)
        .iter()
        .filter(|r| {
            r.body
                .to_string()
                .contains("[arbor] Your context window is")
        })
        .count();
    assert!(told >= 1, "the notice reached the model");
    // The summary calls are metered like any other: spent is every call's usage.
    let calls = model_calls(&node.events(run));
    assert_eq!(calls.len(), 5 + summaries.len());
    assert_eq!(
        step(&tree, "writer").account.spent,
        calls.iter().map(charged).sum::<u64>()
    );
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_cannot_fit_ends_the_job_with_context_too_long_and_sends_nothing() {
    let mock = MockProvider::start().await;
    let node = small_window(&mock, "exec").await;
    let run = node.run_agent("writer", &"word ".repeat(3000)).await;
    let tree = node.wait_run(run).await;
    let writer = step(&tree, "writer");
    assert_eq!(
        writer.error_class,
        Some(ErrorClass::ContextTooLong),
        "{writer:#?}"
    );
    assert!(mock.received().is_empty());
    assert_eq!(writer.account.spent, 0);
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_ceiling_costs_are_still_metered_in_events_and_envelopes() {
    let (_mock, node) = priced_delegation().await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert!(tree.root().usd.is_none(), "no ceiling, no usd figures");
    let spent: std::collections::HashMap<Option<String>, u64> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::JobFinished { result, .. } => Some((
                tree.node(result.job).unwrap().label.clone(),
                result.usd_micros_spent,
            )),
            _ => None,
        })
        .collect();
    assert_eq!(spent[&Some("r".to_string())], 200 * 3 + 20 * 15);
    assert_eq!(
        spent[&Some("planner".to_string())],
        100 * 3 + 10 * 15 + 900 + 300 * 3 + 30 * 15
    );
    node.assert_conserved(run);
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_31_a_call_to_a_provider_in_flight_at_a_crash_is_charged_its_reservation() {
    let mock = MockProvider::start().await;
    let format = Format::Anthropic;
    mock.push_for(
        format,
        PLANNER,
        anthropic::partial_stream("Half an ans", 25, StreamEnd::Hang),
    );
    // The step's next attempt, after the restart.
    mock.push_for(
        format,
        PLANNER,
        anthropic::stream("", &[("submit_output", json!({"output": "again"}))], 40, 5),
    );
    let (node, watched) = watched_node(&mock.arbor_toml(format, "max_retries = 0")).await;
    let run = node.run_agent("planner", "Go.").await;
    watched
        .meter("planner", 0)
        .await
        .streamed_at_least(11)
        .await;
    let first = node.wait_for(run, "planner").await;
    let reserved = node
        .ledger(arbor_protocol::ParentRef::Job(first))
        .iter()
        .find_map(|e| match e.op {
            arbor_storage::LedgerOp::BilledCallReserve { amount: tokens }
                if e.unit == arbor_storage::Unit::Tokens =>
            {
                Some(tokens)
            }
            _ => None,
        })
        .expect("a provider call's reservation is marked as billed");

    // As a SIGKILL would: nothing more reaches the journal (the loop, seeing
    // its actors go, would otherwise settle the call it was in).
    node.journal().faults().fail_writes(true);
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    let interrupted = tree.node(first).unwrap();
    assert_eq!(interrupted.error_class, Some(ErrorClass::Interrupted));
    assert_eq!(
        interrupted.account.spent, reserved,
        "charged what it may have cost"
    );
    assert_eq!(
        tree.root().status,
        Status::Done,
        "resumed as a new attempt: {:#?}",
        tree.root()
    );
    assert_eq!(tree.root().account.spent, reserved + 45);
    node.assert_conserved(run);
}

/// A stream that stalls (its first bytes, then nothing) fails its attempt
/// as a retryable `model_timeout` after the provider's `idle_timeout`, long
/// before the call's whole `timeout`; the retry, answered, completes the
/// step. The stalled attempt is charged what it streamed, as any cut call.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_stream_is_an_idle_timeout_and_the_retry_succeeds() {
    for format in [Format::Openai, Format::Anthropic] {
        let mock = MockProvider::start().await;
        let (stalled, answer) = match format {
            Format::Openai => (
                openai::stream("Half an answer", &[], Some((40, 5))).cut_after(2, StreamEnd::Hang),
                openai::stream(
                    "",
                    &[("submit_output", json!({"output": "whole"}))],
                    Some((40, 5)),
                ),
            ),
            Format::Anthropic => (
                anthropic::partial_stream("Half an ans", 25, StreamEnd::Hang),
                anthropic::stream("", &[("submit_output", json!({"output": "whole"}))], 40, 5),
            ),
        };
        mock.push_for(format, PLANNER, stalled);
        mock.push_for(format, PLANNER, answer);
        let config = mock.arbor_toml(format, "timeout = \"300s\"\nidle_timeout = \"300ms\"");
        let (planner, researcher) = (planner(), researcher(""));
        let agents = [("planner", &*planner), ("researcher", &*researcher)];
        let node = TestNode::start_with_config(&config, &agents).await;
        let run = node.run_agent("planner", "Go.").await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.run_status(), Status::Done, "{format:?}");
        assert_eq!(step(&tree, "planner").output, json!("whole"));
        let outcomes: Vec<_> = model_calls(&node.events(run)).iter().map(outcome).collect();
        // The whole call's timeout is 300 s: only the idle timeout can have
        // ended the first attempt before the run did.
        assert_eq!(outcomes, ["model_timeout", "ok"], "{format:?}");
        node.shutdown().await;
    }
}

/// I-55: a parent names a model for its child's job among those the
/// child's agent allows. The job runs on it (its node and its request say
/// so), its first call is reserved at that model's prices, and a model the
/// agent does not allow is a tool error that starts nothing.
#[tokio::test(flavor = "multi_thread")]
async fn inv_55_a_job_runs_on_the_model_its_parent_names_within_what_its_agent_allows() {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let config = format!(
        "[budget]\ntokens = 1000000\nusd = 5.0\n\
         [providers.mock]\nkind = \"openai\"\nbase_url = \"{}\"\nstream = false\n\
         [providers.mock.models.small]\nid = \"mock-small\"\ncontext_window = 8192\nmax_output_tokens = 1024\nusd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n\
         [providers.mock.models.large]\nid = \"mock-large\"\ncontext_window = 8192\nmax_output_tokens = 1024\nusd_per_mtok_input = 10.0\nusd_per_mtok_output = 10.0\n",
        mock.base_url(format)
    );
    let researcher = format!(
        "---\ndescription: finds facts\nmodel: mock/small\nmodels: [mock/small, mock/large]\n---\n{RESEARCHER}\n"
    );
    let delegate = |model: &str| {
        format!(
            "  - call: {{tool: delegate, args: {{jobs: [{{agent: researcher, request: Find it., label: {}, model: {model}}}]}}}}\n",
            model.replace('/', "-")
        )
    };
    let planner = format!(
        "---\nsubagents: [researcher]\nscript:\n{}{}{}  - call: {{tool: submit_output, args: {{output: done}}}}\n---\nPlan.\n",
        delegate("mock/small"),
        delegate("mock/large"),
        delegate("mock/huge"),
    );
    mock.push_for(format, RESEARCHER, openai::text("A fact.", 30, 5));
    mock.push_for(format, RESEARCHER, openai::text("A fact.", 30, 5));
    let node = TestNode::start_with_config(
        &config,
        &[("planner", &planner), ("researcher", &researcher)],
    )
    .await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);

    // Each ran on the model named, and said so.
    let sent: Vec<String> = mock
        .received_for(RESEARCHER)
        .iter()
        .map(|r| serde_json::from_slice::<serde_json::Value>(&r.raw).unwrap()["model"].to_string())
        .collect();
    assert_eq!(sent, ["\"mock-small\"", "\"mock-large\""]);
    let small = tree.find("mock-small").unwrap();
    let large = tree.find("mock-large").unwrap();
    assert_eq!(
        tree.node(small).unwrap().model.as_deref(),
        Some("mock/small")
    );
    assert_eq!(
        tree.node(large).unwrap().model.as_deref(),
        Some("mock/large")
    );

    // The same request's worst case, reserved at ten times the price.
    let usd_reserved = |job| {
        node.ledger(arbor_protocol::ParentRef::Job(job))
            .iter()
            .find_map(|e| match e.op {
                arbor_storage::LedgerOp::BilledCallReserve { amount }
                    if e.unit == arbor_storage::Unit::UsdMicros =>
                {
                    Some(amount)
                }
                _ => None,
            })
            .expect("a priced call is reserved in micro-dollars")
    };
    assert!(usd_reserved(small) > 0);
    assert_eq!(usd_reserved(large), 10 * usd_reserved(small));

    // A model the agent does not allow: a tool error, nothing started.
    assert!(tree.find("mock-huge").is_none());
    let refused = node
        .tool_calls(run)
        .into_iter()
        .filter(|c| c.tool == "delegate" && !c.ok)
        .map(|c| c.detail)
        .collect::<Vec<_>>();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains("model \"mock/huge\" is not one agent \"researcher\" may run on; name one of: mock/small, mock/large"),
        "{refused:?}"
    );
    node.shutdown().await;
}

/// Anthropic's extended thinking for `effort`: the model entry's budget
/// for the level goes in the body and in the call's reservation as output,
/// and the turn's thinking block goes back unchanged, before its tool call.
#[tokio::test(flavor = "multi_thread")]
async fn effort_on_anthropic_thinks_within_the_reservation_and_sends_its_thinking_back() {
    let mock = MockProvider::start().await;
    let toml = format!(
        "[providers.mock]\nkind = \"anthropic\"\nbase_url = \"{}\"\nstream = false\n\
         [providers.mock.models.big]\nid = \"mock-big\"\ncontext_window = 32768\n\
         max_output_tokens = 8192\nthinking_tokens = {{ low = 1024, medium = 2048, high = 4096 }}\n",
        mock.base_url(Format::Anthropic)
    );
    let thinker = "---\nmodel: mock/big\neffort: medium\n---\nYou think first.\n";
    let block =
        json!({"type": "thinking", "thinking": "The file is small.", "signature": "sig-7f3a"});
    mock.push(
        Format::Anthropic,
        Answer::json(
            200,
            json!({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "mock-big",
                "content": [block, {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}],
                "stop_reason": "tool_use", "usage": {"input_tokens": 40, "output_tokens": 900}
            }),
        ),
    );
    let submit = [("submit_output", json!({"output": "done"}))];
    mock.push(Format::Anthropic, anthropic::message("", &submit, 60, 10));
    let node = TestNode::start_with_config(&toml, &[("thinker", thinker)]).await;
    let run = node.run_agent("thinker", "Look.").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);

    let received = mock.received();
    let first = &received[0].body;
    // [limits] max_output_tokens (4096) for the answer, 2048 to think.
    assert_eq!(
        first["thinking"],
        json!({"type": "enabled", "budget_tokens": 2048})
    );
    assert_eq!(first["max_tokens"], 4096 + 2048);
    assert!(first.get("temperature").is_none());
    let reserved: Vec<u64> = node
        .events(run)
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::ModelCalled { reserved, .. } => Some(reserved),
            _ => None,
        })
        .collect();
    assert!(reserved.iter().all(|r| *r > 4096 + 2048), "{reserved:?}");
    // The thinking block, unchanged, opens the assistant turn it came with.
    let assistant = &received[1].body["messages"][1];
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(assistant["content"][0], block);
    assert_eq!(assistant["content"][1]["type"], "tool_use");
}

/// I-55: a call whose supply is walled (a usage cap) goes to the agent's
/// next fallback on another supply: a fallback on the same supply (a
/// provider that says `supply = "a"`) is passed over. The call is reserved
/// again at the fallback's prices, the event says why it moved, the
/// answer's `model_called` names who answered, and the ledger balances. A
/// bad request does not move: it would fail anywhere.
#[tokio::test(flavor = "multi_thread")]
async fn inv_55_a_call_falls_back_on_a_walled_supply_at_its_prices_not_on_a_bad_request() {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let url = mock.base_url(format);
    let provider = |name: &str, extra: &str, price: f64| {
        format!(
            "[providers.{name}]\nkind = \"openai\"\nbase_url = \"{url}\"\nstream = false\n{extra}\
             [providers.{name}.models.m]\nid = \"{name}-m\"\ncontext_window = 8192\nmax_output_tokens = 1024\n\
             usd_per_mtok_input = {price}\nusd_per_mtok_output = {price}\n"
        )
    };
    let config = format!(
        "[budget]\ntokens = 1000000\nusd = 5.0\n{}{}{}",
        provider("a", "", 1.0),
        provider("twin", "supply = \"a\"\n", 1.0),
        provider("b", "", 10.0),
    );
    let agent = |prompt: &str| {
        format!(
            "---\nmodel: a/m\nmodels: [a/m, twin/m, b/m]\nfallback: [twin/m, b/m]\n---\n{prompt}\n"
        )
    };
    let capped = openai::error(
        429,
        "insufficient_quota",
        "insufficient_quota",
        "over quota",
    );
    mock.push_for(format, PLANNER, capped);
    mock.push_for(format, PLANNER, openai::text("Done on b.", 40, 6));
    mock.push_for(
        format,
        RESEARCHER,
        openai::error(400, "invalid_request_error", "bad", "no such parameter"),
    );
    let node = TestNode::start_with_config(
        &config,
        &[
            ("planner", &agent(PLANNER)),
            ("researcher", &agent(RESEARCHER)),
        ],
    )
    .await;

    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
    assert_eq!(tree.root().output, "Done on b.");
    let sent: Vec<String> = mock
        .received_for(PLANNER)
        .iter()
        .map(|r| r.body["model"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(sent, ["a-m", "b-m"], "twin is on a's supply: passed over");
    let events = node.events(run);
    let moved: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ModelFallback {
                from, to, class, ..
            } => Some((from.clone(), to.clone(), *class)),
            _ => None,
        })
        .collect();
    assert_eq!(
        moved,
        [(
            "a/m".to_string(),
            "b/m".to_string(),
            arbor_protocol::ErrorClass::ModelUsageCap
        )]
    );
    let calls: Vec<(String, String, u64)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ModelCalled { call, .. } => {
                Some((call.provider.clone(), call.outcome.clone(), call.usd_micros))
            }
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(
        (calls[0].0.as_str(), calls[0].1.as_str()),
        ("a", "model_usage_cap")
    );
    assert_eq!((calls[1].0.as_str(), calls[1].1.as_str()), ("b", "ok"));
    // Charged at b's prices: 46 tokens at $10 a million.
    assert_eq!(calls[1].2, 460);
    // Each attempt reserved at its own model's prices: b's at ten times a's.
    let step = tree.find("planner").unwrap();
    assert_eq!(tree.node(step).unwrap().model.as_deref(), Some("b/m"));
    let reserved: Vec<u64> = node
        .ledger(arbor_protocol::ParentRef::Job(step))
        .iter()
        .filter_map(|e| match e.op {
            arbor_storage::LedgerOp::BilledCallReserve { amount }
                if e.unit == arbor_storage::Unit::UsdMicros =>
            {
                Some(amount)
            }
            _ => None,
        })
        .collect();
    assert_eq!(reserved.len(), 2, "{reserved:?}");
    assert!(reserved[1] >= 9 * reserved[0], "{reserved:?}");
    node.assert_conserved(run);

    // A bad request fails where it is: nothing moves.
    let run = node.run_agent("researcher", "Find it.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    assert_eq!(
        tree.root().error_class,
        Some(arbor_protocol::ErrorClass::ModelBadRequest)
    );
    assert!(
        !node
            .events(run)
            .iter()
            .any(|e| matches!(e.kind, EventKind::ModelFallback { .. }))
    );
    assert_eq!(mock.received_for(RESEARCHER).len(), 1);
    node.assert_conserved(run);
    node.shutdown().await;
}

/// `on_fail` is never handed to a rescuer on the supply that walled the
/// step: a usage cap on provider `a`, a rescuer on `a` too: the run fails
/// and its limitations say the rescuer was skipped and why. A rescuer on
/// another supply (the scripted model) takes over.
#[tokio::test(flavor = "multi_thread")]
async fn inv_55_a_rescuer_on_the_walled_supply_is_skipped_and_said_so() {
    let mock = MockProvider::start().await;
    let format = Format::Openai;
    let config = format!(
        "[providers.a]\nkind = \"openai\"\nbase_url = \"{}\"\nstream = false\n\
         [providers.a.models.m]\nid = \"a-m\"\ncontext_window = 8192\nmax_output_tokens = 1024\n",
        mock.base_url(format)
    );
    let on_a = |prompt: &str| format!("---\nmodel: a/m\n---\n{prompt}\n");
    let scripted = arbor_testkit::agent_md(
        "script:\n  - call: {tool: submit_output, args: {output: rescued elsewhere}}",
    );
    let capped = || openai::error(402, "insufficient_quota", "insufficient_quota", "pay up");
    mock.push_for(format, PLANNER, capped());
    mock.push_for(format, PLANNER, capped());
    let flow = |rescuer: &str| {
        format!(
            "[[group]]\nsteps = [{{ agent = \"planner\", instruction = \"go\", on_fail = \"{rescuer}\" }}]\n"
        )
    };
    let (same, other) = (flow("researcher"), flow("elsewhere"));
    let node = TestNode::start_with_flows(
        &config,
        &[
            ("planner", &on_a(PLANNER)),
            ("researcher", &on_a(RESEARCHER)),
            ("elsewhere", &scripted),
        ],
        &[("same", &same), ("other", &other)],
    )
    .await;
    let run = node.run_flow("same").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    assert_eq!(
        tree.root().error_class,
        Some(arbor_protocol::ErrorClass::ModelUsageCap)
    );
    assert_eq!(
        tree.root().limitations,
        [
            "rescuer researcher skipped: step planner failed with model_usage_cap, which walls \
          supply a, and researcher's model draws on it too"
        ]
    );
    assert!(
        mock.received_for(RESEARCHER).is_empty(),
        "the rescuer never ran"
    );

    let run = node.run_flow("other").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
    assert_eq!(tree.root().output, "rescued elsewhere");
    node.assert_conserved(run);
    node.shutdown().await;
}

/// I-65: a provider's `rpm` is reserved before each request is sent: with
/// two requests a minute, a planner's third call is never sent within the
/// minute (the mock never sees it; it ends a rate-limit error here, its
/// wait longer than one attempt may take), and a model whose one request
/// could use more than its `tpm` is refused before anything is sent.
#[tokio::test(flavor = "multi_thread")]
async fn inv_65_no_request_is_sent_past_a_providers_rpm_or_tpm() {
    let mock = MockProvider::start().await;
    let collect = [("collect", json!({}))];
    for _ in 0..3 {
        mock.push_for(Format::Openai, PLANNER, openai::tool_calls(&collect, 10, 5));
    }
    let node = start(
        &mock,
        Format::Openai,
        "stream = false\nmax_retries = 0\ntimeout = \"2s\"\nrpm = 2",
    )
    .await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert_eq!(
        mock.received_for(PLANNER).len(),
        2,
        "the third was never sent"
    );
    let planner = step(&tree, "planner");
    assert_eq!(
        planner.error_class,
        Some(ErrorClass::ModelRateLimit),
        "{planner:?}"
    );
    assert!(
        planner
            .error
            .as_deref()
            .is_some_and(|e| e.contains("its rate limit (rpm, tpm) has no room")),
        "{planner:?}"
    );
    node.assert_conserved(run);

    // A whole request larger than a minute's tokens: refused, never sent.
    let mock = MockProvider::start().await;
    mock.push_for(Format::Openai, PLANNER, openai::tool_calls(&collect, 10, 5));
    let node = start(&mock, Format::Openai, "stream = false\ntpm = 100").await;
    let run = node.run_agent("planner", "Go.").await;
    let tree = node.wait_run(run).await;
    assert!(mock.received().is_empty());
    let planner = step(&tree, "planner");
    assert_eq!(planner.error_class, Some(ErrorClass::ModelBadRequest));
    assert!(
        planner
            .error
            .as_deref()
            .is_some_and(|e| e.contains("more than its tpm (100)")),
        "{planner:?}"
    );
}

/// Every span of 60 s in `served` (when each request was answered, and
/// its tokens) holds at most `rpm` requests and `tpm` tokens.
fn within(served: &[(std::time::Instant, u64)], rpm: u64, tpm: u64) -> Result<(), String> {
    let mut served = served.to_vec();
    served.sort();
    for (i, (start, _)) in served.iter().enumerate() {
        let span: Vec<u64> = served[i..]
            .iter()
            .take_while(|(at, _)| at.duration_since(*start) < std::time::Duration::from_secs(60))
            .map(|(_, t)| *t)
            .collect();
        let tokens: u64 = span.iter().sum();
        if span.len() as u64 > rpm || tokens > tpm {
            return Err(format!(
                "a minute from request {i} held {} requests and {tokens} tokens",
                span.len()
            ));
        }
    }
    Ok(())
}

/// A planner that sends `jobs` researchers at once, collects them and
/// reports, against a provider that limits as `MockProvider::limit` does.
async fn fan_out_under_limits(
    jobs: usize,
    rpm: u64,
    tpm: u64,
    ours: &str,
) -> (TestNode, RunId, MockProvider) {
    let mock = MockProvider::start().await;
    mock.limit(rpm, tpm);
    let requests: Vec<_> = (0..jobs)
        .map(|i| json!({"agent": "researcher", "request": format!("Find fact {i}")}))
        .collect();
    let delegate = [("delegate", json!({"jobs": requests, "wait": false}))];
    mock.push_for(
        Format::Openai,
        PLANNER,
        openai::tool_calls(&delegate, 300, 40),
    );
    mock.push_for(
        Format::Openai,
        PLANNER,
        openai::tool_calls(&[("collect", json!({}))], 500, 10),
    );
    let submit = [("submit_output", json!({"output": "Report."}))];
    mock.push_for(
        Format::Openai,
        PLANNER,
        openai::tool_calls(&submit, 900, 20),
    );
    for _ in 0..jobs {
        mock.push_for(Format::Openai, RESEARCHER, openai::text("A fact.", 200, 5));
    }
    let config = format!(
        "{}\n[limits]\nfan_out = {jobs}\nrunning_children = {jobs}\n",
        mock.arbor_toml(
            Format::Openai,
            &format!("stream = false\nmax_retries = 0\n{ours}")
        )
    );
    let node = TestNode::start_with_config(
        &config,
        &[("planner", &planner()), ("researcher", &researcher(""))],
    )
    .await;
    let run = node.run_agent("planner", "Write a report.").await;
    // Longer than a test's usual wait: its last calls wait out a minute.
    let ended = node.node().wait_tree(run, |t| t.run_status().is_terminal());
    tokio::time::timeout(std::time::Duration::from_secs(180), ended)
        .await
        .expect("the fan-out ends within three minutes");
    (node, run, mock)
}

/// I-65 against a provider that counts requests and tokens per minute
/// and refuses what passes them: a 64-job fan-out on a model with `rpm`
/// and `tpm` keeps every minute within both, is refused nothing, and
/// completes (its last calls wait for the first minute to pass); the same
/// run without the limits is refused by the provider.
#[tokio::test(flavor = "multi_thread")]
async fn inv_65_a_64_job_fan_out_keeps_every_minute_within_the_providers_rpm_and_tpm() {
    const JOBS: usize = 64;
    const RPM: u64 = 50;
    const TPM: u64 = 100_000;
    let (node, run, mock) =
        fan_out_under_limits(JOBS, RPM, TPM, &format!("rpm = {RPM}\ntpm = {TPM}")).await;
    let tree = node.tree(run);
    assert_eq!(tree.root().status, Status::Done, "{:?}", tree.root().reason);
    assert_eq!(mock.refused(), 0, "no 429");
    let served = mock.served();
    assert_eq!(served.len(), JOBS + 3, "every call answered once");
    within(&served, RPM, TPM).unwrap();
    let done = tree
        .nodes()
        .filter(|(_, n)| n.agent.as_deref() == Some("researcher") && n.status == Status::Done)
        .count();
    assert_eq!(done, JOBS);
    node.assert_conserved(run);

    let (node, run, mock) = fan_out_under_limits(JOBS, RPM, TPM, "").await;
    assert!(
        mock.refused() > 0,
        "without its limits, the provider refuses some"
    );
    within(&mock.served(), RPM, TPM).unwrap();
    node.assert_conserved(run);
}
