//! An MCP server for arbor's scenario suites: real JSON-RPC through rmcp's
//! server, one tool per behaviour a test needs, good and bad. Over stdio by
//! default; `--http` serves streamable HTTP on a loopback port instead and
//! prints its URL as the first line on stdout.
//!
//! Each call appends its tool's name to `mcp-calls.log` in the working
//! directory as it begins. Tools (none writes outside that directory):
//! - `echo {text}`: the text back.
//! - `env {name}`: the value of an environment variable ("" if unset).
//! - `pid {}`: its own pid.
//! - `sleep {ms}`: waits, or ends when the call is cancelled. Every
//!   `notifications/cancelled` it reads appends `cancelled` to
//!   `mcp-cancelled.log` in its working directory.
//! - `hang {}`: blocks its only thread: it answers nothing, not even a ping.
//! - `spawn {}`: starts a detached grandchild (`sleep 1000` in a new
//!   session), writes its pid to `grandchild.pid`, answers it.
//! - `exit {}`: exits with status 3 in the middle of the call.
//! - `big {bytes}`: that many bytes of text.
//! - `noise {}`: writes a line that is not JSON to stdout, then answers ok.
//! - `fail {}`: a result with `isError`.
//! - `header {name}`: over HTTP, the value of that header of the request
//!   that carried the call ("" if absent).

use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ServerHandler, ServiceExt};
use std::io::Write;
use std::sync::Arc;

#[derive(Clone)]
struct TestServer;

fn tool(name: &'static str, description: &'static str, schema: serde_json::Value) -> Tool {
    let serde_json::Value::Object(schema) = schema else {
        unreachable!("every schema here is an object")
    };
    Tool::new(name, description, Arc::new(schema))
}

fn object(properties: serde_json::Value, required: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

fn text(t: impl Into<String>) -> Result<CallToolResponse, ErrorData> {
    Ok(CallToolResult::success(vec![ContentBlock::text(t.into())]).into())
}

/// Appends `cancelled` to `mcp-cancelled.log` in the working directory.
fn log_cancel() {
    if let Ok(mut log) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("mcp-cancelled.log")
    {
        let _ = writeln!(log, "cancelled");
    }
}

impl ServerHandler for TestServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn on_cancelled(
        &self,
        _notification: CancelledNotificationParam,
        _context: rmcp::service::NotificationContext<RoleServer>,
    ) {
        log_cancel();
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let none = || object(serde_json::json!({}), &[]);
        Ok(ListToolsResult::with_all_items(vec![
            tool(
                "echo",
                "Says the text back.",
                object(serde_json::json!({"text": {"type": "string"}}), &["text"]),
            ),
            tool(
                "env",
                "An environment variable's value.",
                object(serde_json::json!({"name": {"type": "string"}}), &["name"]),
            ),
            tool("pid", "The server's pid.", none()),
            tool(
                "write",
                "Writes text to a file of its working directory.",
                object(
                    serde_json::json!({"path": {"type": "string"}, "text": {"type": "string"}}),
                    &["path", "text"],
                ),
            ),
            tool(
                "sleep",
                "Waits ms milliseconds.",
                object(
                    serde_json::json!({"ms": {"type": "integer", "minimum": 0}}),
                    &["ms"],
                ),
            ),
            tool("hang", "Never answers.", none()),
            tool("spawn", "Starts a detached grandchild.", none()),
            tool("exit", "Exits mid-call.", none()),
            tool(
                "big",
                "A long text.",
                object(
                    serde_json::json!({"bytes": {"type": "integer", "minimum": 0}}),
                    &["bytes"],
                ),
            ),
            tool("noise", "Writes a line that is not JSON to stdout.", none()),
            tool("fail", "Fails.", none()),
            tool(
                "traceparent",
                "The trace context the call came with (_meta.traceparent).",
                none(),
            ),
            tool(
                "header",
                "A header of the HTTP request that carried the call.",
                object(serde_json::json!({"name": {"type": "string"}}), &["name"]),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if let Ok(mut log) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open("mcp-calls.log")
        {
            let _ = writeln!(log, "{}", request.name);
        }
        let args = request.arguments.unwrap_or_default();
        let str_arg = |k: &str| {
            args.get(k)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string()
        };
        let int_arg = |k: &str| args.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        match request.name.as_ref() {
            "echo" => text(str_arg("text")),
            "env" => text(std::env::var(str_arg("name")).unwrap_or_default()),
            "pid" => text(std::process::id().to_string()),
            "write" => {
                std::fs::write(str_arg("path"), str_arg("text"))
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                text("written")
            }
            "sleep" => {
                let ms = int_arg("ms");
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(ms)) => text(format!("slept {ms} ms")),
                    _ = context.ct.cancelled() => Err(ErrorData::internal_error("cancelled", None)),
                }
            }
            "hang" => {
                // The runtime has one thread: blocking it answers nothing more.
                std::thread::sleep(std::time::Duration::from_secs(3600));
                text("woke")
            }
            "spawn" => {
                let child = std::process::Command::new("setsid")
                    .args(["sleep", "1000"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                let pid = child.id();
                std::fs::write("grandchild.pid", pid.to_string())
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                // Not waited on: it is left to outlive this server, if it can.
                std::mem::forget(child);
                text(pid.to_string())
            }
            "exit" => {
                eprintln!("mcp-test-server: exiting mid-call, as asked");
                std::process::exit(3)
            }
            "big" => text("x".repeat(int_arg("bytes") as usize)),
            "noise" => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(b"this line is not JSON\n");
                let _ = out.flush();
                text("made noise")
            }
            "fail" => {
                Ok(CallToolResult::error(vec![ContentBlock::text("it failed, as asked")]).into())
            }
            "traceparent" => {
                let from_request = request.meta.as_ref().and_then(|m| m.0.get_traceparent());
                let from_context = context.meta.0.get_traceparent();
                text(from_request.or(from_context).unwrap_or("none"))
            }
            "header" => {
                let parts = context.extensions.get::<axum::http::request::Parts>();
                let value = parts
                    .and_then(|p| p.headers.get(str_arg("name")))
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                text(value)
            }
            other => Err(ErrorData::invalid_params(format!("no tool {other}"), None)),
        }
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    if std::env::args().nth(1).as_deref() == Some("--http") {
        runtime.block_on(serve_http());
        return;
    }
    runtime.block_on(async {
        let service = TestServer
            .serve(rmcp::transport::stdio())
            .await
            .expect("the client initializes");
        let _ = service.waiting().await;
    });
}

/// Streamable HTTP at `/mcp` on a loopback port; the URL is the first line
/// on stdout. Ends when stdin closes, so it dies with whoever started it.
async fn serve_http() {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let service = StreamableHttpService::new(
        || Ok(TestServer),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("its address");
    println!("http://{addr}/mcp");
    let _ = std::io::stdout().flush();
    let stdin_closed = async {
        let mut sink = Vec::new();
        let _ = tokio::io::AsyncReadExt::read_to_end(&mut tokio::io::stdin(), &mut sink).await;
    };
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(stdin_closed)
        .await;
}
