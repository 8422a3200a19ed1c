//! The client `@modelcontextprotocol/conformance` grades: a real arbor node
//! whose one agent uses the MCP server at the URL it is given, through the
//! whole path an agent's call takes (the node's listing, the job's policy,
//! the schema check, the sandbox's connection, the journal).
//!
//! `mcp-conformance-probe URL`: the agent's model, on its first turn, calls
//! every MCP tool it is offered, with arguments made from each tool's input
//! schema, then submits. What each call returned is printed, a line each;
//! the exit status is 0 when the run ended done. The scenario's name
//! (`MCP_CONFORMANCE_SCENARIO`) is printed, never acted on: the probe does
//! the same for every scenario, as a node would.

use arbor_actors::model::{
    Message, Model, ModelError, ModelFactory, ModelReply, ModelRequest, ToolCall,
};
use arbor_protocol::{AgentDef, Status};
use arbor_testkit::{TestNode, agent_md};
use futures::future::BoxFuture;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// Calls every MCP tool it is offered, once, then submits.
struct CallEveryTool;

impl Model for CallEveryTool {
    fn count_input(&self, _request: &ModelRequest) -> u64 {
        1
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        let first_turn = !request
            .messages
            .iter()
            .any(|m| matches!(m, Message::Assistant { .. }));
        let calls = if first_turn {
            request
                .tools
                .iter()
                .filter(|t| t.name.starts_with(arbor_protocol::mcp::MCP_PREFIX))
                .enumerate()
                .map(|(i, t)| ToolCall {
                    id: format!("probe-{i}"),
                    tool: t.name.to_string(),
                    args: arguments(&t.parameters),
                })
                .collect()
        } else {
            vec![]
        };
        let calls = if calls.is_empty() {
            vec![ToolCall {
                id: "probe-submit".into(),
                tool: "submit_output".into(),
                args: json!({"output": "probed"}),
            }]
        } else {
            calls
        };
        Box::pin(async move {
            Ok(ModelReply {
                thinking: vec![],
                text: None,
                calls,
                usage: None,
                truncated: false,
            })
        })
    }
}

struct Factory;

impl ModelFactory for Factory {
    fn model_for(&self, _agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        Ok(Arc::new(CallEveryTool))
    }
}

/// Arguments that match `schema` as a caller would fill it in: each
/// required property given a plain value of its type.
fn arguments(schema: &Value) -> Value {
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut args = Map::new();
    for (i, name) in required.iter().enumerate() {
        let property = &schema["properties"][*name];
        let value = if let Some(first) = property["enum"].as_array().and_then(|e| e.first()) {
            first.clone()
        } else if let Some(default) = property.get("default") {
            default.clone()
        } else {
            match property["type"].as_str() {
                Some("integer") | Some("number") => json!(i as u64 + 2),
                Some("boolean") => json!(true),
                Some("array") => json!([]),
                Some("object") => arguments(property),
                Some("null") => Value::Null,
                _ => json!("arbor"),
            }
        };
        args.insert(name.to_string(), value);
    }
    Value::Object(args)
}

#[tokio::main]
async fn main() {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: mcp-conformance-probe URL");
        std::process::exit(2);
    };
    let scenario = std::env::var("MCP_CONFORMANCE_SCENARIO").unwrap_or_default();
    println!("scenario {scenario:?} at {url}");
    let config = format!(
        "[mcp.servers.peer]\nurl = {}\nstart_timeout = \"10s\"\ncall_timeout = \"10s\"\n",
        toml_string(&url)
    );
    let agent = agent_md("mcp: [peer]");
    let node = TestNode::start_full(Some(&config), &[("probe", &agent)], Arc::new(Factory)).await;
    let run = node.run_agent("probe", "call every tool").await;
    let tree = node.wait_run(run).await;
    for call in node.tool_calls(run) {
        println!("{} ok={} {}", call.tool, call.ok, call.detail);
    }
    let status = tree.run_status();
    println!("run {status:?}");
    if status != Status::Done {
        println!("{:?}", tree.root());
        std::process::exit(1);
    }
}

/// `text` as a TOML string.
fn toml_string(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}
