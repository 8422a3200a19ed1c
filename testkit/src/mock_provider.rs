//! A model provider on loopback that speaks both wire formats, scripted per
//! test: each request to `/v1/chat/completions` (OpenAI) or `/v1/messages`
//! (Anthropic) takes the next answer queued for its format, and every
//! request is recorded (headers and body) for the test to read.
//!
//! The fixtures (`openai::*`, `anthropic::*`) build answers in the shapes the
//! providers document: whole answers, SSE streams with usage last (or none),
//! and errors.
//!
//! ```no_run
//! # async fn demo() {
//! use arbor_testkit::mock_provider::{MockProvider, Format, openai};
//! let mock = MockProvider::start().await;
//! mock.push(Format::Openai, openai::text("Tide pools hold anemones.", 40, 12));
//! let arbor_toml = mock.arbor_toml(Format::Openai, "");
//! # }
//! ```

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Openai,
    Anthropic,
}

/// How a streamed answer ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// The body ends normally after the last event.
    Close,
    /// The server stops sending and keeps the connection open, forever.
    Hang,
    /// The connection is cut after the last event.
    Drop,
}

/// One scripted answer.
#[derive(Clone, Debug)]
pub enum Answer {
    /// A whole body with a status, and extra headers.
    Body {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// Server-Sent Events: each string is one event's raw text (`event:`
    /// and `data:` lines), then the end.
    Stream { events: Vec<String>, end: StreamEnd },
}

impl Answer {
    /// A streamed answer's first `k` events, then `end` (a dropped
    /// connection, or one held open with nothing more on it); a body as it is.
    pub fn cut_after(self, k: usize, end: StreamEnd) -> Answer {
        match self {
            Answer::Stream { events, .. } => Answer::Stream {
                events: events[..k.min(events.len())].to_vec(),
                end,
            },
            other => other,
        }
    }

    pub fn json(status: u16, body: Value) -> Self {
        Answer::Body {
            status,
            headers: vec![],
            body: body.to_string(),
        }
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        if let Answer::Body { headers, .. } = &mut self {
            headers.push((name.to_string(), value.to_string()));
        }
        self
    }

    pub fn ending(mut self, how: StreamEnd) -> Self {
        if let Answer::Stream { end, .. } = &mut self {
            *end = how;
        }
        self
    }
}

/// A request as the mock received it.
#[derive(Clone, Debug)]
pub struct Received {
    pub format: Format,
    pub headers: HeaderMap,
    /// The body as sent (its bytes count is what the reservation bound is).
    pub raw: Bytes,
    pub body: Value,
}

#[derive(Default)]
struct Shared {
    /// Answers in order, each for requests whose body contains its marker
    /// (None: any request), so that agents running at once each get theirs.
    openai: VecDeque<(Option<String>, Answer)>,
    anthropic: VecDeque<(Option<String>, Answer)>,
    received: Vec<Received>,
    /// Streams that have sent all their events (and now end, hang or drop).
    streams_sent: usize,
    /// A provider's rate limits, as it counts them: requests, and the
    /// tokens each answer reports, in any 60 s (`limit`).
    limit: Option<(u64, u64)>,
    /// Requests answered under the limits: when, and the tokens reported.
    served: Vec<(std::time::Instant, u64)>,
    /// Requests refused with a 429 for the limits.
    refused: usize,
}

/// The running mock. Dropping it stops the server.
pub struct MockProvider {
    addr: std::net::SocketAddr,
    shared: Arc<Mutex<Shared>>,
    changed: Arc<Notify>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

type AppState = (Arc<Mutex<Shared>>, Arc<Notify>);

impl MockProvider {
    /// Starts on 127.0.0.1, on a port the system picks.
    pub async fn start() -> Self {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let changed = Arc::new(Notify::new());
        let state: AppState = (shared.clone(), changed.clone());
        let app = axum::Router::new()
            .route(
                "/v1/chat/completions",
                post(|s, h, b| answer(Format::Openai, s, h, b)),
            )
            .route(
                "/v1/messages",
                post(|s, h, b| answer(Format::Anthropic, s, h, b)),
            )
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let addr = listener.local_addr().expect("its address");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            shared,
            changed,
            server,
        }
    }

    /// The `base_url` a provider of this format is configured with.
    pub fn base_url(&self, format: Format) -> String {
        match format {
            Format::Openai => format!("http://{}/v1", self.addr),
            Format::Anthropic => format!("http://{}", self.addr),
        }
    }

    /// An arbor.toml with one provider `mock` of this format and one model
    /// `small` (id `mock-small`, 8,192 tokens of context, 1,024 out), with
    /// `extra` lines added to the provider block (`stream = false`, say).
    pub fn arbor_toml(&self, format: Format, extra: &str) -> String {
        let kind = match format {
            Format::Openai => "openai",
            Format::Anthropic => "anthropic",
        };
        format!(
            "[providers.mock]\nkind = \"{kind}\"\nbase_url = \"{}\"\n{extra}\n\
             [providers.mock.models.small]\nid = \"mock-small\"\ncontext_window = 8192\nmax_output_tokens = 1024\n",
            self.base_url(format)
        )
    }

    /// Limits it as a provider would: a request that would make any 60 s
    /// hold more than `rpm` requests or `tpm` tokens (its answer's reported
    /// usage) is refused with a 429 and `Retry-After`, its answer kept.
    pub fn limit(&self, rpm: u64, tpm: u64) {
        self.shared.lock().unwrap().limit = Some((rpm, tpm));
    }

    /// When each request under the limits was answered, and its tokens.
    pub fn served(&self) -> Vec<(std::time::Instant, u64)> {
        self.shared.lock().unwrap().served.clone()
    }

    /// How many requests the limits refused.
    pub fn refused(&self) -> usize {
        self.shared.lock().unwrap().refused
    }

    /// Queues the answer to the next request of this format.
    pub fn push(&self, format: Format, answer: Answer) {
        self.queue(format, None, answer);
    }

    /// Queues the answer to the next request of this format whose body
    /// contains `marker` (an agent's system prompt, say).
    pub fn push_for(&self, format: Format, marker: &str, answer: Answer) {
        self.queue(format, Some(marker.to_string()), answer);
    }

    fn queue(&self, format: Format, marker: Option<String>, answer: Answer) {
        let mut shared = self.shared.lock().unwrap();
        match format {
            Format::Openai => shared.openai.push_back((marker, answer)),
            Format::Anthropic => shared.anthropic.push_back((marker, answer)),
        }
    }

    /// The requests whose body contains `marker`.
    pub fn received_for(&self, marker: &str) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| contains(&r.raw, marker))
            .collect()
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.lock().unwrap().received.clone()
    }

    /// Waits until `n` streamed answers have sent all their events.
    pub async fn wait_streams_sent(&self, n: usize) {
        loop {
            let notified = self.changed.notified();
            if self.shared.lock().unwrap().streams_sent >= n {
                return;
            }
            notified.await;
        }
    }
}

async fn answer(
    format: Format,
    State((shared, changed)): State<AppState>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    let max_tokens = body.get("max_tokens").and_then(Value::as_u64);
    let next = {
        let mut s = shared.lock().unwrap();
        let queue = match format {
            Format::Openai => &mut s.openai,
            Format::Anthropic => &mut s.anthropic,
        };
        let at = queue
            .iter()
            .position(|(marker, _)| marker.as_deref().is_none_or(|m| contains(&raw, m)));
        let next = at.and_then(|i| queue.remove(i).map(|(marker, a)| (i, marker, a)));
        let next = match (next, s.limit) {
            (Some((i, marker, answer)), Some((rpm, tpm))) => {
                let now = std::time::Instant::now();
                let tokens = reported(&answer, max_tokens);
                let recent: Vec<u64> = s
                    .served
                    .iter()
                    .filter(|(at, _)| now.duration_since(*at) < std::time::Duration::from_secs(60))
                    .map(|(_, t)| *t)
                    .collect();
                if recent.len() as u64 >= rpm || recent.iter().sum::<u64>() + tokens > tpm {
                    let queue = match format {
                        Format::Openai => &mut s.openai,
                        Format::Anthropic => &mut s.anthropic,
                    };
                    queue.insert(i, (marker, answer));
                    s.refused += 1;
                    Some(Answer::json(
                        429,
                        json!({"error": {"message": "Rate limit reached (mock)", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}),
                    ).with_header("retry-after", "1"))
                } else {
                    s.served.push((now, tokens));
                    Some(answer)
                }
            }
            (next, _) => next.map(|(_, _, a)| a),
        };
        s.received.push(Received {
            format,
            headers,
            raw,
            body,
        });
        next
    };
    changed.notify_waiters();
    match next {
        None => Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from(
                "the mock has no answer scripted for this request",
            ))
            .unwrap(),
        Some(Answer::Body {
            status,
            headers,
            body,
        }) => {
            // Like a provider, never more output than the request allowed.
            let body = cap_output(&body, max_tokens);
            let mut response = Response::builder()
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK))
                .header("content-type", "application/json");
            for (name, value) in headers {
                response = response.header(name, value);
            }
            response.body(Body::from(body)).unwrap()
        }
        Some(Answer::Stream { events, end }) => {
            let events = futures::stream::iter(
                events
                    .into_iter()
                    .map(|e| Ok::<_, std::io::Error>(Bytes::from(e))),
            );
            let after = futures::stream::once(async move {
                shared.lock().unwrap().streams_sent += 1;
                changed.notify_waiters();
                match end {
                    StreamEnd::Close => Ok(Bytes::new()),
                    StreamEnd::Hang => futures::future::pending().await,
                    StreamEnd::Drop => Err(std::io::Error::other("connection cut")),
                }
            });
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(events.chain(after)))
                .unwrap()
        }
    }
}

/// The tokens an answer reports (input and output, output capped as sent).
fn reported(answer: &Answer, max_tokens: Option<u64>) -> u64 {
    let Answer::Body { body, .. } = answer else {
        return 0;
    };
    let Ok(value) = serde_json::from_str::<Value>(&cap_output(body, max_tokens)) else {
        return 0;
    };
    let usage = &value["usage"];
    [
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
    ]
    .iter()
    .filter_map(|k| usage[*k].as_u64())
    .sum()
}

fn cap_output(body: &str, max_tokens: Option<u64>) -> String {
    let (Some(max), Ok(mut value)) = (max_tokens, serde_json::from_str::<Value>(body)) else {
        return body.to_string();
    };
    let Some(usage) = value.get_mut("usage") else {
        return body.to_string();
    };
    for key in ["completion_tokens", "output_tokens"] {
        if let Some(n) = usage.get(key).and_then(Value::as_u64)
            && n > max
        {
            usage[key] = json!(max);
        }
    }
    value.to_string()
}

fn contains(raw: &[u8], marker: &str) -> bool {
    std::str::from_utf8(raw).is_ok_and(|text| text.contains(marker))
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// OpenAI Chat Completions answers.
pub mod openai {
    use super::*;

    /// A whole answer: text, no tool call.
    pub fn text(text: &str, input: u64, output: u64) -> Answer {
        Answer::json(
            200,
            json!({
                "id": "chatcmpl-mock", "object": "chat.completion", "model": "mock-small",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output},
            }),
        )
    }

    /// A whole answer with these tool calls (name, arguments), in one turn.
    pub fn tool_calls(calls: &[(&str, Value)], input: u64, output: u64) -> Answer {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| {
                json!({"id": format!("call_mock_{i}"), "type": "function",
                       "function": {"name": name, "arguments": args.to_string()}})
            })
            .collect();
        Answer::json(
            200,
            json!({
                "id": "chatcmpl-mock", "object": "chat.completion", "model": "mock-small",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": calls}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output},
            }),
        )
    }

    /// A streamed answer: the text word by word, the tool calls' arguments
    /// in two pieces, then usage last when given (`stream_options.include_usage`).
    pub fn stream(text: &str, calls: &[(&str, Value)], usage: Option<(u64, u64)>) -> Answer {
        let chunk = |delta: Value, finish: Value| {
            sse(
                None,
                &json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "model": "mock-small",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
            )
        };
        let mut events = vec![chunk(json!({"role": "assistant"}), Value::Null)];
        for word in text.split_inclusive(' ') {
            events.push(chunk(json!({"content": word}), Value::Null));
        }
        for (i, (name, args)) in calls.iter().enumerate() {
            let args = args.to_string();
            let (a, b) = args.split_at(args.len() / 2);
            events.push(chunk(
                json!({"tool_calls": [{"index": i, "id": format!("call_mock_{i}"), "type": "function", "function": {"name": name, "arguments": a}}]}),
                Value::Null,
            ));
            events.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": b}}]}),
                Value::Null,
            ));
        }
        let finish = if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        events.push(chunk(json!({}), json!(finish)));
        if let Some((input, output)) = usage {
            events.push(sse(
                None,
                &json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "choices": [],
                        "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}}),
            ));
        }
        events.push("data: [DONE]\n\n".to_string());
        Answer::Stream {
            events,
            end: StreamEnd::Close,
        }
    }

    /// An error in OpenAI's shape.
    pub fn error(status: u16, kind: &str, code: &str, message: &str) -> Answer {
        Answer::json(
            status,
            json!({"error": {"message": message, "type": kind, "code": code, "param": null}}),
        )
    }
}

/// Anthropic Messages answers.
pub mod anthropic {
    use super::*;

    fn blocks(text: &str, calls: &[(&str, Value)]) -> Vec<Value> {
        let mut blocks = vec![];
        if !text.is_empty() {
            blocks.push(json!({"type": "text", "text": text}));
        }
        for (i, (name, args)) in calls.iter().enumerate() {
            blocks.push(
                json!({"type": "tool_use", "id": format!("toolu_mock_{i}"), "name": name, "input": args}),
            );
        }
        blocks
    }

    /// A whole answer: optional text, then these tool uses.
    pub fn message(text: &str, calls: &[(&str, Value)], input: u64, output: u64) -> Answer {
        Answer::json(
            200,
            json!({
                "id": "msg_mock", "type": "message", "role": "assistant", "model": "mock-small",
                "content": blocks(text, calls),
                "stop_reason": if calls.is_empty() { "end_turn" } else { "tool_use" },
                "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": output},
            }),
        )
    }

    /// A streamed answer: `message_start` with the input tokens, the blocks
    /// as deltas, `message_delta` with the output tokens, `message_stop`.
    pub fn stream(text: &str, calls: &[(&str, Value)], input: u64, output: u64) -> Answer {
        let mut events = vec![sse(
            Some("message_start"),
            &json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message", "role": "assistant",
                    "content": [], "model": "mock-small", "stop_reason": null,
                    "usage": {"input_tokens": input, "output_tokens": 1}}}),
        )];
        let mut index = 0;
        if !text.is_empty() {
            events.push(sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ));
            for word in text.split_inclusive(' ') {
                events.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}),
                ));
            }
            events.push(sse(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": 0}),
            ));
            index = 1;
        }
        for (i, (name, args)) in calls.iter().enumerate() {
            let at = index + i;
            events.push(sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": at,
                        "content_block": {"type": "tool_use", "id": format!("toolu_mock_{i}"), "name": name, "input": {}}}),
            ));
            let args = args.to_string();
            let (a, b) = args.split_at(args.len() / 2);
            for piece in [a, b] {
                events.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": at, "delta": {"type": "input_json_delta", "partial_json": piece}}),
                ));
            }
            events.push(sse(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": at}),
            ));
        }
        events.push(sse(
            Some("message_delta"),
            &json!({"type": "message_delta", "delta": {"stop_reason": if calls.is_empty() { "end_turn" } else { "tool_use" }, "stop_sequence": null},
                    "usage": {"output_tokens": output}}),
        ));
        events.push(sse(Some("message_stop"), &json!({"type": "message_stop"})));
        Answer::Stream {
            events,
            end: StreamEnd::Close,
        }
    }

    /// The first part of a streamed text answer: `message_start` and one
    /// text delta; then the stream ends as `end` says.
    pub fn partial_stream(text: &str, input: u64, end: StreamEnd) -> Answer {
        Answer::Stream {
            events: vec![
                sse(
                    Some("message_start"),
                    &json!({"type": "message_start", "message": {"id": "msg_mock", "type": "message", "role": "assistant",
                            "content": [], "model": "mock-small", "usage": {"input_tokens": input, "output_tokens": 1}}}),
                ),
                sse(
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
                sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
                ),
            ],
            end,
        }
    }

    /// An error in Anthropic's shape.
    pub fn error(status: u16, kind: &str, message: &str) -> Answer {
        Answer::json(
            status,
            json!({"type": "error", "error": {"type": kind, "message": message}}),
        )
    }
}
