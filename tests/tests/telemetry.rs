//! Traces (I-52), through the SDK's in-memory exporter: a run is one trace
//! whose id is the run's, its spans' parents mirror its tree, each span has
//! its conventions' name and attributes, content goes out only when asked
//! for and then redacted, and a dead collector changes nothing in a run.

use arbor_actors::secrets::Secrets;
use arbor_protocol::{Event, EventKind, JobId, RunId, Status, Tree, TreeNode};
use arbor_runtime::telemetry::{Settings, Telemetry};
use arbor_testkit::{TestNode, agent_md};
use opentelemetry::trace::{SpanId, SpanKind, Status as SpanStatus, TraceId};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use std::collections::BTreeMap;
use std::sync::Arc;

fn settings(capture_content: bool) -> Settings {
    Settings {
        traces_url: "http://127.0.0.1:4318/v1/traces".into(),
        service_name: Some("arbor-test".into()),
        capture_content,
    }
}

fn traced(node: &TestNode, capture: bool, secrets: Secrets) -> (Telemetry, InMemorySpanExporter) {
    let exporter = InMemorySpanExporter::default();
    let telemetry = Telemetry::with_exporter(
        exporter.clone(),
        &settings(capture),
        node.node().events(),
        node.journal().clone(),
        Arc::new(secrets),
    );
    (telemetry, exporter)
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn agent_span<'a>(spans: &'a [SpanData], job: &TreeNode) -> &'a SpanData {
    let found: Vec<&SpanData> = spans
        .iter()
        .filter(|s| attr(s, "gen_ai.agent.id").as_deref() == Some(job.id.as_str()))
        .collect();
    assert_eq!(found.len(), 1, "one span for {}: {found:?}", job.id);
    found[0]
}

fn all_nodes(node: &TreeNode, out: &mut Vec<TreeNode>) {
    for child in &node.children {
        out.push(child.clone());
        all_nodes(child, out);
    }
}

/// A lead that fans out to three workers; one worker calls a tool it was
/// not offered (a refusal) before it answers.
fn fan_out() -> Vec<(&'static str, String)> {
    let lead = agent_md(
        "subagents: [worker]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: \"part 1 of the secret plan\", label: w1}, {agent: worker, request: \"part 2\", label: w2}, {agent: worker, request: \"part 3\", label: w3}]}}\n  - call: {tool: submit_output, args: {output: all parts}}",
    );
    let worker = agent_md(
        "description: does one part\nscript:\n  - call: {tool: exec, args: {command: \"true\"}}\n  - say: the part is done\n    usage: {input: 40, output: 7}",
    );
    vec![("lead", lead), ("worker", worker)]
}

fn model_calls(events: &[Event], job: JobId) -> Vec<(u64, u64, u64)> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ModelCalled {
                id,
                reserved,
                input_tokens,
                output_tokens,
                ..
            } if *id == job => Some((*reserved, *input_tokens, *output_tokens)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn inv_52_a_fan_out_is_one_trace_whose_spans_mirror_its_tree() {
    let defs = fan_out();
    let agents: Vec<(&str, &str)> = defs.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let node = TestNode::start(&agents).await;
    let (telemetry, exporter) = traced(&node, false, Secrets::default());
    let run = node.run_agent("lead", "plan it").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    telemetry.flush().await;
    let spans = exporter.get_finished_spans().unwrap();
    let run_id: RunId = run;

    // One trace, whose id is the run's.
    let trace = TraceId::from_bytes(run_id.trace_id());
    assert!(spans.iter().all(|s| s.span_context.trace_id() == trace));

    // The run is the one root.
    let roots: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.parent_span_id == SpanId::INVALID)
        .collect();
    assert_eq!(roots.len(), 1, "{roots:?}");
    let root = roots[0];
    assert_eq!(root.name, "invoke_workflow agent:lead");
    assert_eq!(
        attr(root, "gen_ai.operation.name").as_deref(),
        Some("invoke_workflow")
    );
    assert_eq!(root.status, SpanStatus::Ok);

    // Each step and job is an invoke_agent span; a step hangs under the
    // run, a job under the delegate call that made it, which hangs under
    // its parent's span.
    let mut nodes = vec![];
    let top = tree.root();
    all_nodes(&top, &mut nodes);
    assert_eq!(nodes.len(), 4, "a step and three jobs");
    let by_id = |id: SpanId| spans.iter().find(|s| s.span_context.span_id() == id);
    for job in &nodes {
        let span = agent_span(&spans, job);
        let agent = job.agent.clone().unwrap();
        assert_eq!(span.name, format!("invoke_agent {agent}"));
        assert_eq!(span.span_kind, SpanKind::Internal);
        assert_eq!(attr(span, "gen_ai.agent.name"), Some(agent));
        let parent = by_id(span.parent_span_id).expect("its parent was exported");
        if job.kind == arbor_protocol::NodeKind::Step {
            assert_eq!(parent.span_context.span_id(), root.span_context.span_id());
        } else {
            assert_eq!(parent.name, "execute_tool delegate");
            let lead = &top.children[0];
            assert_eq!(
                parent.parent_span_id,
                agent_span(&spans, lead).span_context.span_id()
            );
        }
        // Its model calls: one chat span each, with what was charged.
        let events = node.events(run);
        let id: JobId = job.id.parse().unwrap();
        let charged = model_calls(&events, id);
        let mut chats: Vec<(u64, u64, u64)> = spans
            .iter()
            .filter(|s| {
                s.parent_span_id == span.span_context.span_id() && s.name == "chat scripted"
            })
            .map(|s| {
                assert_eq!(s.span_kind, SpanKind::Client);
                assert_eq!(attr(s, "gen_ai.provider.name").as_deref(), Some("scripted"));
                assert_eq!(attr(s, "gen_ai.request.model").as_deref(), Some("scripted"));
                let n = |k| attr(s, k).unwrap().parse::<u64>().unwrap();
                (
                    n("arbor.reserved_tokens"),
                    n("gen_ai.usage.input_tokens"),
                    n("gen_ai.usage.output_tokens"),
                )
            })
            .collect();
        chats.sort();
        let mut charged = charged;
        charged.sort();
        assert_eq!(chats, charged, "{}", job.id);
    }

    // The refused call is a failed tool span whose error is `refused`.
    let refused = named(&spans, "execute_tool exec");
    assert_eq!(refused.len(), 3);
    for span in refused {
        assert_eq!(attr(span, "error.type").as_deref(), Some("refused"));
        assert!(matches!(span.status, SpanStatus::Error { .. }));
    }

    // No content by default: not the request, not the answer.
    let everything = format!("{spans:?}");
    assert!(!everything.contains("secret plan"), "{everything}");
    assert!(!everything.contains("the part is done"), "{everything}");
    assert!(!everything.contains("gen_ai.input.messages"));
    telemetry.shutdown().await;
}

#[tokio::test]
async fn inv_52_content_goes_out_only_when_asked_for_and_redacted() {
    let defs = fan_out();
    let agents: Vec<(&str, &str)> = defs.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let node = TestNode::start(&agents).await;
    let secrets = Secrets::new(BTreeMap::from([(
        "PLAN".to_string(),
        "secret plan".to_string(),
    )]));
    let (telemetry, exporter) = traced(&node, true, secrets);
    let run = node.run_agent("lead", "plan it").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    telemetry.flush().await;
    let spans = exporter.get_finished_spans().unwrap();
    let everything = format!("{spans:?}");
    assert!(!everything.contains("secret plan"), "{everything}");
    let inputs: Vec<String> = spans
        .iter()
        .filter_map(|s| attr(s, "gen_ai.input.messages"))
        .collect();
    assert!(
        inputs
            .iter()
            .any(|m| m.contains("part 1 of the [secret PLAN]")),
        "{inputs:?}"
    );
    let outputs: Vec<String> = spans
        .iter()
        .filter_map(|s| attr(s, "gen_ai.output.messages"))
        .collect();
    assert!(
        outputs.iter().any(|m| m.contains("the part is done")),
        "{outputs:?}"
    );
    telemetry.shutdown().await;
}

#[tokio::test]
async fn inv_52_a_stopped_subtree_is_marked_stopped_on_every_span() {
    let lead = agent_md(
        "subagents: [sleeper]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: sleeper, request: wait, label: s}]}}\n  - call: {tool: submit_output, args: {output: never}}",
    );
    let sleeper = agent_md("description: sleeps\nscript:\n  - say: still here\n    delay: 1h");
    let node = TestNode::start(&[("lead", &lead), ("sleeper", &sleeper)]).await;
    let (telemetry, exporter) = traced(&node, false, Secrets::default());
    let run = node.run_agent("lead", "go").await;
    node.wait_for(run, "sleeper").await;
    node.stop_run(run).await;
    let tree: Tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    telemetry.flush().await;
    let spans = exporter.get_finished_spans().unwrap();
    for name in [
        "invoke_workflow agent:lead",
        "invoke_agent lead",
        "invoke_agent sleeper",
    ] {
        let span = named(&spans, name);
        assert_eq!(span.len(), 1, "{name}: {spans:?}");
        assert_eq!(
            attr(span[0], "error.type").as_deref(),
            Some("stopped"),
            "{name}"
        );
        assert!(matches!(span[0].status, SpanStatus::Error { .. }), "{name}");
    }
    telemetry.shutdown().await;
}

/// A collector that is not there: the run ends as it would, the spans are
/// counted as dropped, and the node's end is not held up.
#[tokio::test]
async fn inv_52_a_dead_collector_changes_nothing_in_the_run() {
    let defs = fan_out();
    let agents: Vec<(&str, &str)> = defs.iter().map(|(n, t)| (*n, t.as_str())).collect();
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}\"\n");
    let node = TestNode::start_with_config(&config, &agents).await;
    let run = node.run_agent("lead", "plan it").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    node.assert_conserved(run);
    node.node().close().await.unwrap();
    let stats = node.node().telemetry().expect("telemetry is on");
    assert_eq!(stats.spans_exported, 0, "{stats:?}");
    assert!(stats.spans_dropped > 0, "{stats:?}");
}

/// A step that a crash interrupted runs again after the restart as a new
/// attempt: its span links to the interrupted attempt's, and the resumed
/// run's root links to the root of the node's previous life.
#[tokio::test]
async fn a_step_run_again_after_a_crash_links_to_its_span_from_before() {
    let (node, run) = arbor_tests::scenarios::two_groups_crashed_in_the_second().await;
    // Attached after the restart: the fold reads the run's history from
    // the journal at its first event.
    let (telemetry, exporter) = traced(&node, false, Secrets::default());
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    telemetry.flush().await;
    let spans = exporter.get_finished_spans().unwrap();

    let attempt = |n: u32| -> JobId {
        tree.nodes()
            .find(|(_, j)| j.label.as_deref() == Some("second") && j.attempt == n)
            .map(|(_, j)| j.id.parse().unwrap())
            .unwrap()
    };
    let again = spans
        .iter()
        .find(|s| attr(s, "gen_ai.agent.id") == Some(attempt(2).to_string()))
        .expect("the new attempt's span");
    let linked: Vec<SpanId> = again
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(linked, [SpanId::from_bytes(attempt(1).span_id())]);

    let root = named(&spans, "invoke_workflow two");
    assert_eq!(root.len(), 1, "{spans:?}");
    let before = SpanId::from_bytes(run.span_id());
    assert_ne!(root[0].span_context.span_id(), before, "a new root");
    let linked: Vec<SpanId> = root[0]
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(linked, [before]);
    assert_eq!(again.parent_span_id, root[0].span_context.span_id());
    telemetry.shutdown().await;
}
