//! arbor's MCP client: one connection to one tool server, over the pipes of
//! a process someone else started (the sandbox seals and owns it), or over
//! streamable HTTP to an endpoint someone else runs.
//!
//! The rest of arbor speaks only the types here (`McpClient`, `McpTool`,
//! `McpOutcome`, `McpError`); rmcp, which speaks the protocol, stays inside
//! this crate, so a change of SDK touches one file.
//!
//! Invariants:
//! 1. Every request is bounded in time: a server that never answers costs
//!    its caller the timeout, never a hang.
//! 2. A call given up on (its timeout, or its caller dropped the future at
//!    a stop) is cancelled at the server with `notifications/cancelled`; its
//!    late answer, if one comes, is dropped by the SDK and reaches no one.
//! 3. One line from the server is at most `MAX_MESSAGE` bytes: a server that
//!    floods its stdout without a newline ends its connection, not the node.

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ClientRequest, ContentBlock, PingRequest};
use rmcp::service::{ClientInitializeError, RoleClient, RunningService};
use rmcp::transport::async_rw::AsyncRwTransport;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// The largest message (one line of JSON-RPC) read from a server.
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// A tool a server lists.
#[derive(Clone, Debug, PartialEq)]
pub struct McpTool {
    /// The server's own name for it.
    pub name: String,
    pub description: String,
    /// The JSON Schema its arguments must match (an object schema).
    pub input_schema: serde_json::Value,
}

/// What a call returned.
#[derive(Clone, Debug, PartialEq)]
pub struct McpOutcome {
    /// The server says the tool failed (`isError`): its text says why.
    pub is_error: bool,
    /// The content, as text: text blocks as they are, other blocks as a
    /// line that says what they were.
    pub text: String,
    /// The structured result, when the server gave one.
    pub structured: Option<serde_json::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The connection is gone: the server exited, closed its pipes or
    /// broke the protocol. A new connection is needed.
    #[error("the server's connection closed: {0}")]
    Closed(String),
    /// No session could be opened: the server ended, was not there, or
    /// refused the handshake. The text says which.
    #[error("{0}")]
    Start(String),
    /// The server did not start talking within its start timeout.
    #[error("the server did not answer `initialize` within {}", humantime(.0))]
    StartTimedOut(Duration),
    #[error("the server did not answer within {}", humantime(.0))]
    TimedOut(Duration),
    /// The server answered with a JSON-RPC error.
    #[error("the server refused: {0}")]
    Refused(String),
    /// The server answered with something the protocol does not allow here.
    #[error("the server answered out of protocol: {0}")]
    Protocol(String),
}

fn humantime(d: &Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// One initialized connection to a server.
pub struct McpClient {
    service: RunningService<RoleClient, rmcp::model::ClientConfig>,
}

impl McpClient {
    /// Speaks `initialize` over the server's stdout (`read`) and stdin
    /// (`write`), within `timeout`.
    pub async fn connect<R, W>(read: R, write: W, timeout: Duration) -> Result<Self, McpError>
    where
        R: AsyncRead + Send + Unpin + 'static,
        W: AsyncWrite + Send + Unpin + 'static,
    {
        let transport = AsyncRwTransport::<RoleClient, R, W>::new(read, write)
            .with_max_line_length(MAX_MESSAGE);
        // A server that exits at once breaks the pipe under the request;
        // what it wrote to stderr (the caller's) says why.
        Self::start(transport, timeout, || {
            "the server ended before it answered initialize".into()
        })
        .await
    }

    /// Speaks `initialize` to the streamable HTTP endpoint `url`, sending
    /// `headers` with every request, within `timeout`.
    #[cfg(feature = "http")]
    pub async fn connect_http(
        url: &str,
        headers: &[(String, String)],
        timeout: Duration,
    ) -> Result<Self, McpError> {
        use reqwest::header::{HeaderName, HeaderValue};
        let mut custom = std::collections::HashMap::new();
        for (name, value) in headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| McpError::Protocol(format!("`{name}` is not a header's name")))?;
            // The value may hold a secret: the error names the header only.
            let mut value = HeaderValue::from_str(value)
                .map_err(|_| McpError::Protocol(format!("header `{name}`: not a header value")))?;
            value.set_sensitive(true);
            custom.insert(name, value);
        }
        // No redirect is followed: one would carry the headers, secrets
        // among them, to wherever the server points.
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| McpError::Protocol(format!("an HTTP client: {e}")))?;
        use rmcp::transport::streamable_http_client::{
            StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
        };
        let config = StreamableHttpClientTransportConfig::with_uri(url)
            .custom_headers(custom)
            .max_sse_event_size(MAX_MESSAGE)
            .max_json_response_size(MAX_MESSAGE);
        let transport = StreamableHttpClientTransport::with_client(http, config);
        Self::start(transport, timeout, || {
            format!("the server at {url} did not answer initialize")
        })
        .await
    }

    async fn start<T, E, A>(
        transport: T,
        timeout: Duration,
        closed: impl FnOnce() -> String,
    ) -> Result<Self, McpError>
    where
        T: rmcp::transport::IntoTransport<RoleClient, E, A>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut config = rmcp::model::ClientConfig::default();
        config.client_info = rmcp::model::Implementation::new("arbor", env!("CARGO_PKG_VERSION"));
        // arbor speaks the `initialize` handshake, so it offers the newest
        // version that has one; a server answers with the one it speaks.
        config.protocol_version = rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE;
        let service = match tokio::time::timeout(timeout, config.serve(transport)).await {
            Err(_) => return Err(McpError::StartTimedOut(timeout)),
            Ok(Err(ClientInitializeError::ConnectionClosed(_))) => {
                return Err(McpError::Start(closed()));
            }
            Ok(Err(ClientInitializeError::TransportError { error, .. })) => {
                return Err(McpError::Start(format!(
                    "{}: {}",
                    closed(),
                    transport_error(&error)
                )));
            }
            Ok(Err(e)) => return Err(McpError::Protocol(e.to_string())),
            Ok(Ok(service)) => service,
        };
        Ok(Self { service })
    }

    /// Every tool the server lists, all pages, within `timeout`.
    pub async fn list_tools(&self, timeout: Duration) -> Result<Vec<McpTool>, McpError> {
        let listed = tokio::time::timeout(timeout, self.service.peer().list_all_tools())
            .await
            .map_err(|_| McpError::TimedOut(timeout))?
            .map_err(service_error)?;
        Ok(listed
            .into_iter()
            .map(|tool| McpTool {
                name: tool.name.to_string(),
                description: tool.description.map(|d| d.to_string()).unwrap_or_default(),
                input_schema: serde_json::Value::Object((*tool.input_schema).clone()),
            })
            .collect())
    }

    /// Calls `tool` with `arguments`, within `timeout`. Past it, or when the
    /// caller drops this future, the server is told the call is cancelled
    /// (invariant 2). `traceparent` goes in the request's `_meta` (the
    /// protocol's place for trace context), so a traced server's spans join
    /// the caller's trace.
    pub async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
        traceparent: Option<&str>,
    ) -> Result<McpOutcome, McpError> {
        let mut params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        if let Some(traceparent) = traceparent {
            let mut meta = rmcp::model::MetaObject::new();
            meta.set_traceparent(traceparent);
            params.meta = Some(rmcp::model::RequestMetaObject(meta));
        }
        let result = tokio::time::timeout(timeout, self.service.peer().call_tool(params))
            .await
            .map_err(|_| McpError::TimedOut(timeout))?
            .map_err(service_error)?;
        let text = result
            .content
            .iter()
            .map(block_text)
            .collect::<Vec<_>>()
            .join("\n");
        Ok(McpOutcome {
            is_error: result.is_error.unwrap_or(false),
            text,
            structured: result.structured_content,
        })
    }

    /// Whether the server answers a request at all within `grace`: a ping,
    /// which a server that does not know it refuses, and a refusal is an
    /// answer too. A server stuck on a cancelled call answers nothing.
    pub async fn answers_within(&self, grace: Duration) -> bool {
        let ping = ClientRequest::PingRequest(PingRequest::default());
        match tokio::time::timeout(grace, self.service.peer().send_request(ping)).await {
            Ok(Ok(_)) | Ok(Err(rmcp::service::ServiceError::McpError(_))) => true,
            Ok(Err(_)) | Err(_) => false,
        }
    }

    /// Ends the connection (an HTTP session is ended at the server as
    /// well, best effort); calls still in flight end with `Closed`.
    pub fn close(&self) {
        self.service.cancellation_token().cancel();
    }

    /// Whether the connection has ended (the server exited or broke the protocol).
    pub fn is_closed(&self) -> bool {
        self.service.is_closed()
    }
}

fn service_error(e: rmcp::service::ServiceError) -> McpError {
    use rmcp::service::ServiceError;
    match e {
        ServiceError::McpError(data) => McpError::Refused(data.message.to_string()),
        ServiceError::Timeout { timeout } => McpError::TimedOut(timeout),
        ServiceError::UnexpectedResponse => {
            McpError::Protocol("an answer of the wrong kind".into())
        }
        ServiceError::TransportSend(error) => McpError::Closed(transport_error(&error)),
        ServiceError::TransportClosed => McpError::Closed(e.to_string()),
        other => McpError::Protocol(other.to_string()),
    }
}

/// What went wrong under the protocol, said without the SDK's type names:
/// an HTTP server's refusal of its credentials plainly, an error with its
/// causes (a refused connection is a cause of reqwest's error, not in it).
fn transport_error(e: &rmcp::transport::DynamicTransportError) -> String {
    #[cfg(feature = "http")]
    {
        use rmcp::transport::streamable_http_client::StreamableHttpError;
        match e
            .error
            .downcast_ref::<StreamableHttpError<reqwest::Error>>()
        {
            Some(StreamableHttpError::AuthRequired(_)) => {
                return "the server requires authorization (HTTP 401): arbor sends the headers \
                        the server's declaration names and runs no OAuth flow; put a token in \
                        `headers`"
                    .into();
            }
            Some(StreamableHttpError::InsufficientScope(_)) => {
                return "the server refused the credentials' scope (HTTP 403)".into();
            }
            _ => {}
        }
    }
    let mut text = e.error.to_string();
    let mut source = e.error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        source = cause.source();
    }
    text
}

/// One content block as the text a model reads.
fn block_text(block: &ContentBlock) -> String {
    match block {
        ContentBlock::Text(text) => text.text.clone(),
        other => {
            // Images, audio and resources are described, not inlined: their
            // base64 would fill a context window and say nothing to a model.
            let mut value = serde_json::to_value(other).unwrap_or_default();
            let kind = value["type"].as_str().unwrap_or("content").to_string();
            if let Some(map) = value.as_object_mut() {
                for key in ["data", "blob"] {
                    if let Some(serde_json::Value::String(data)) = map.get(key) {
                        let note = format!("({} bytes of base64, not shown)", data.len());
                        map.insert(key.into(), serde_json::Value::String(note));
                    }
                }
                if let Some(serde_json::Value::Object(resource)) = map.get_mut("resource")
                    && let Some(serde_json::Value::String(blob)) = resource.get("blob")
                {
                    let note = format!("({} bytes of base64, not shown)", blob.len());
                    resource.insert("blob".into(), serde_json::Value::String(note));
                }
            }
            format!("[{kind}] {value}")
        }
    }
}
