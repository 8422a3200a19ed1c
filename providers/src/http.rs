//! One provider's HTTP client and the `Model` its agents talk to: one
//! request per `complete`, streamed or not, its failures classified from
//! status and body. Retries are the agent loop's (each attempt reserved).
//!
//! Invariants:
//! 1. `count_input` is the request body's length in bytes (built as it will
//!    be sent, with the largest `max_tokens` and the wind-down notice), plus a
//!    margin for what the provider's template adds. A byte-level BPE token is
//!    at least one byte, so the provider cannot count more (I-11).
//! 2. The key goes into one header and nowhere else; no error message here
//!    quotes a request.
//! 3. Reading is bounded: a body or stream past `MAX_ANSWER_BYTES` is an error.

use crate::config::{ApiKey, Provider, ProviderKind, ProviderModel};
use crate::rate;
use crate::wire::{classify, protocol_error};
use crate::{anthropic, openai};
use arbor_actors::model::{Model, ModelError, ModelInfo, ModelReply, ModelRequest};
use arbor_protocol::ErrorClass;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use futures::future::BoxFuture;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The most bytes one answer may take, streamed or not.
pub const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;
/// Tokens a provider may add around the body: per message (role markers)...
const TEMPLATE_TOKENS_PER_MESSAGE: u64 = 8;
/// ...and once, for the instructions that come with tools (Anthropic's is
/// documented at about 350) and the start of the answer.
const TEMPLATE_TOKENS_PER_CALL: u64 = 512;

/// What every model of one provider shares: its config, its connection
/// pool, and its limit of requests in flight.
pub struct ProviderClient {
    pub(crate) config: Provider,
    client: reqwest::Client,
    permits: Arc<Semaphore>,
    /// Each model's rate windows, its provider's shared by all (`rate`).
    windows: std::collections::BTreeMap<String, rate::Windows>,
    own: Option<Arc<std::sync::Mutex<rate::Window>>>,
    /// The windows every node shares, while the journal is a shared one.
    shared: rate::Shared,
}

impl ProviderClient {
    pub fn new(config: Provider) -> Self {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10).min(config.timeout))
            .user_agent(concat!("arbor/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_default();
        let own = config
            .limits
            .is_set()
            .then(|| Arc::new(std::sync::Mutex::new(rate::Window::new(config.limits))));
        let shared: rate::Shared = Default::default();
        let provider = &config.name;
        let windows = config
            .models
            .iter()
            .map(|(name, m)| {
                let windows = rate::Windows::new(
                    own.clone().map(|w| (format!("{provider}/*"), w)),
                    (format!("{provider}/{name}"), m.limits),
                    shared.clone(),
                );
                (name.clone(), windows)
            })
            .collect();
        Self {
            permits: Arc::new(Semaphore::new(config.max_concurrent as usize)),
            config,
            client,
            windows,
            own,
            shared,
        }
    }

    /// Its windows are shared with every node of this journal from now on
    /// (`None`: the node's journal is its own).
    pub fn share(&self, shared: Option<rate::SharedWindows>) {
        *self.shared.write().unwrap_or_else(|e| e.into_inner()) = shared;
    }

    /// Its rate windows as the node shows them: its own (`NAME/*`), then
    /// each model's that has limits of its own.
    pub fn limits(&self) -> Vec<arbor_protocol::RateView> {
        let now = std::time::Instant::now();
        let name = &self.config.name;
        let shared = self
            .shared
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let own = self
            .own
            .iter()
            .map(|w| rate::view(format!("{name}/*"), w, shared.as_ref(), now));
        let models = self.windows.iter().filter_map(|(model, windows)| {
            windows
                .model_window()
                .map(|w| rate::view(format!("{name}/{model}"), w, shared.as_ref(), now))
        });
        own.chain(models).collect()
    }
}

/// A provider's model as an agent's `Model`.
pub struct HttpModel {
    provider: Arc<ProviderClient>,
    name: String,
    model: ProviderModel,
    key: Option<ApiKey>,
    windows: rate::Windows,
}

impl HttpModel {
    pub(crate) fn new(provider: Arc<ProviderClient>, name: &str, key: Option<ApiKey>) -> Self {
        let model = provider.config.models[name].clone();
        let windows = provider.windows[name].clone();
        Self {
            windows,
            provider,
            name: name.to_string(),
            model,
            key,
        }
    }

    fn body(&self, request: &ModelRequest, max_tokens: u64) -> Value {
        let stream = self.provider.config.stream;
        match self.provider.config.kind {
            ProviderKind::Openai => openai::body(
                &self.model.id,
                self.model.settings,
                request,
                max_tokens,
                stream,
            ),
            ProviderKind::Anthropic => anthropic::body(
                &self.model.id,
                self.model.settings,
                self.model.thinking_tokens,
                request,
                max_tokens,
                stream,
            ),
        }
    }
}

impl Model for HttpModel {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        // The largest max_tokens this model sends: the body can only be shorter.
        let widest = self.model.max_output_tokens.max(request.max_output_tokens);
        let bytes = json_len(&self.body(request, widest));
        bytes
            + TEMPLATE_TOKENS_PER_MESSAGE * (request.messages.len() as u64 + 1)
            + TEMPLATE_TOKENS_PER_CALL
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        let body = self.body(&request, request.max_output_tokens);
        let provider = self.provider.clone();
        let key = self.key.clone();
        let windows = self.windows.clone();
        // Its worst case, as the budget reserves it: the prompt as counted
        // and all the output it may ask for.
        let tokens = match (windows.is_set(), request.input_estimate) {
            (false, _) => 0,
            (true, 0) => self.count_input(&request) + request.max_output_tokens,
            (true, counted) => counted + request.max_output_tokens,
        };
        Box::pin(async move {
            let mut ticket = match windows.is_set() {
                true => Some(admit(&windows, tokens, &provider.config).await?),
                false => None,
            };
            let answer = ask(&provider, key.as_ref(), body, &request, ticket.as_mut()).await;
            if let Some(ticket) = ticket {
                settle(&windows, ticket, &answer);
            }
            answer
        })
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        // About four bytes a token in English; three is generous.
        let bytes = json_len(&self.body(request, request.max_output_tokens));
        bytes.div_ceil(3) + TEMPLATE_TOKENS_PER_MESSAGE * (request.messages.len() as u64 + 1)
    }

    fn info(&self) -> ModelInfo {
        self.provider.config.model_info(&self.model)
    }
}

impl std::fmt::Debug for HttpModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HttpModel({}/{})", self.provider.config.name, self.name)
    }
}

/// One request sent within the provider's limit of requests in flight and
/// its timeout.
async fn ask(
    provider: &ProviderClient,
    key: Option<&ApiKey>,
    body: Value,
    request: &ModelRequest,
    ticket: Option<&mut rate::Ticket>,
) -> Result<ModelReply, ModelError> {
    let _permit = provider
        .permits
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ModelError::new(ErrorClass::Model, "the provider client closed"))?;
    // Its minute in the rate windows starts as it goes out, not while it
    // waited for a connection. The windows every node shares admit it
    // only now: there, its stamp is its sending.
    let ticket = match ticket {
        Some(ticket) => {
            admit_shared(ticket, &provider.config).await?;
            ticket.sent(std::time::Instant::now());
            Some(&*ticket)
        }
        None => None,
    };
    let timeout = provider.config.timeout;
    match tokio::time::timeout(timeout, send(provider, key, body, request, ticket)).await {
        Ok(result) => result,
        Err(_) => Err(ModelError::new(
            ErrorClass::ModelTimeout,
            format!(
                "provider {}: no complete answer within {}",
                provider.config.name,
                humantime::format_duration(timeout)
            ),
        )),
    }
}

/// A request of `tokens` admitted by its rate windows (I-65), waiting
/// (holding nothing) while they are full, for no longer than one attempt
/// may take: past that, a rate-limit error that says when there is room.
async fn admit(
    windows: &rate::Windows,
    tokens: u64,
    config: &Provider,
) -> Result<rate::Ticket, ModelError> {
    let deadline = tokio::time::Instant::now() + config.timeout;
    let mut waiting = None;
    loop {
        let now = tokio::time::Instant::now();
        match windows.try_admit(now.into_std(), tokens) {
            Ok(ticket) => return Ok(ticket),
            Err(wait) => {
                waiting.get_or_insert_with(|| windows.waiting());
                wait_for(wait, now, deadline, config).await?;
            }
        }
    }
}

/// On a shared journal, the windows every node shares admit `ticket` too,
/// waiting (holding its connection) while they are full, as `admit` does.
async fn admit_shared(ticket: &mut rate::Ticket, config: &Provider) -> Result<(), ModelError> {
    let deadline = tokio::time::Instant::now() + config.timeout;
    let mut waiting = None;
    loop {
        let now = tokio::time::Instant::now();
        match ticket.admit_shared().await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(wait)) => {
                waiting.get_or_insert_with(|| ticket.windows().waiting());
                wait_for(wait, now, deadline, config).await?;
            }
            Err(error) => {
                return Err(ModelError::new(
                    ErrorClass::ModelOverloaded,
                    format!(
                        "provider {}: its rate windows shared by the nodes could not be read: {error}",
                        config.name
                    ),
                ));
            }
        }
    }
}

/// Waits as `wait` says, if it can end before `deadline`; else the error
/// the call ends with.
async fn wait_for(
    wait: rate::Wait,
    now: tokio::time::Instant,
    deadline: tokio::time::Instant,
    config: &Provider,
) -> Result<(), ModelError> {
    match wait {
        rate::Wait::TooLarge { tokens, tpm } => Err(ModelError::new(
            ErrorClass::ModelBadRequest,
            format!(
                "provider {}: one request may use {tokens} tokens, more than its tpm ({tpm}) lets a minute hold",
                config.name
            ),
        )),
        rate::Wait::Until(at) => {
            let at = tokio::time::Instant::from_std(at);
            if at > deadline {
                let mut error = ModelError::new(
                    ErrorClass::ModelRateLimit,
                    format!(
                        "provider {}: its rate limit (rpm, tpm) has no room within the call's timeout",
                        config.name
                    ),
                );
                error.retry_after = Some(at - now);
                return Err(error);
            }
            tokio::time::sleep_until(at).await;
            Ok(())
        }
    }
}

/// What an answered request used goes back to its windows: its usage
/// (what it held beyond is given back). A request the provider refused
/// used no tokens, and its `Retry-After` closes the windows until then; any
/// other end may have used all it asked for, and keeps it.
fn settle(windows: &rate::Windows, ticket: rate::Ticket, answer: &Result<ModelReply, ModelError>) {
    match answer {
        Ok(reply) => {
            if let Some(usage) = reply.usage {
                ticket.settle(usage.input_tokens + usage.output_tokens);
            }
        }
        Err(error) => {
            if let Some(after) = error.retry_after {
                windows.close_for(std::time::Instant::now(), after);
            }
            if matches!(
                error.class,
                ErrorClass::ModelRateLimit
                    | ErrorClass::ModelAuth
                    | ErrorClass::ModelBadRequest
                    | ErrorClass::ModelUsageCap
            ) {
                ticket.settle(0);
            }
        }
    }
}

async fn send(
    provider: &ProviderClient,
    key: Option<&ApiKey>,
    body: Value,
    request: &ModelRequest,
    ticket: Option<&rate::Ticket>,
) -> Result<ModelReply, ModelError> {
    let config = &provider.config;
    let mut http = provider
        .client
        .post(config.endpoint())
        .header(reqwest::header::CONTENT_TYPE, "application/json");
    match config.kind {
        ProviderKind::Openai => {
            if let Some(key) = key {
                http = http.bearer_auth(key.expose());
            }
        }
        ProviderKind::Anthropic => {
            http = http.header("anthropic-version", anthropic::API_VERSION);
            if let Some(key) = key {
                http = http.header("x-api-key", key.expose());
            }
        }
    }
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let meter = &request.meter;
    meter.mark_sent();
    let response = http.body(bytes).send().await.map_err(|e| {
        if e.is_connect() {
            // Nothing reached the provider: nothing to bill.
            meter.mark_refused();
        }
        transport_error(&config.name, &e)
    })?;
    let status = response.status();
    // A provider that says it has no room left closes the windows until it has.
    if let (Some(ticket), Some(wait)) = (ticket, no_room_for(response.headers())) {
        ticket.close_for(std::time::Instant::now(), wait);
    }
    if !status.is_success() {
        meter.mark_refused();
        let retry_after = retry_after(response.headers());
        let text = read_bounded(response).await.unwrap_or_default();
        let mut error = classify(status.as_u16(), &String::from_utf8_lossy(&text));
        error.message = format!("provider {}: {}", config.name, error.message);
        error.retry_after = retry_after;
        return Err(error);
    }
    if !config.stream {
        let text = read_bounded(response)
            .await
            .map_err(|e| transport_error(&config.name, &e))?;
        return match config.kind {
            ProviderKind::Openai => openai::parse_reply(&text, request.turn),
            ProviderKind::Anthropic => anthropic::parse_reply(&text),
        };
    }
    let mut events = std::pin::pin!(idle_bounded(response, config.idle_timeout).eventsource());
    let mut seen = 0usize;
    let mut openai_stream = openai::Stream::default();
    let mut anthropic_stream = anthropic::Stream::default();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(eventsource_stream::EventStreamError::Transport(Chunk::Http(e))) => {
                return Err(transport_error(&config.name, &e));
            }
            Err(eventsource_stream::EventStreamError::Transport(Chunk::Idle)) => {
                return Err(ModelError::new(
                    ErrorClass::ModelTimeout,
                    format!(
                        "provider {}: the stream sent nothing for {} (idle_timeout)",
                        config.name,
                        humantime::format_duration(config.idle_timeout)
                    ),
                ));
            }
            Err(e) => return Err(protocol_error(&format!("a malformed event stream: {e}"))),
        };
        seen += event.data.len();
        if seen > MAX_ANSWER_BYTES {
            return Err(protocol_error("the answer is larger than 32 MiB"));
        }
        if event.data.is_empty() {
            continue;
        }
        let done = match config.kind {
            ProviderKind::Openai => openai_stream.on_data(&event.data, meter)?,
            ProviderKind::Anthropic => anthropic_stream.on_data(&event.data, meter)?,
        };
        if done {
            break;
        }
    }
    match config.kind {
        ProviderKind::Openai => openai_stream.finish(request.turn),
        ProviderKind::Anthropic => anthropic_stream.finish(),
    }
}

/// Why a streamed answer's bytes stopped.
#[derive(Debug)]
enum Chunk {
    Http(reqwest::Error),
    /// No byte came for `idle_timeout`.
    Idle,
}

impl std::fmt::Display for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Chunk::Http(e) => e.fmt(f),
            Chunk::Idle => f.write_str("no bytes within the idle timeout"),
        }
    }
}

/// The answer's bytes, each awaited at most `idle`: a stall is told apart
/// from a slow answer (the call's whole `timeout`).
fn idle_bounded(
    response: reqwest::Response,
    idle: Duration,
) -> impl futures::Stream<Item = Result<impl AsRef<[u8]>, Chunk>> {
    futures::stream::unfold(
        Some(Box::pin(response.bytes_stream())),
        move |stream| async move {
            let mut stream = stream?;
            match tokio::time::timeout(idle, stream.next()).await {
                Ok(Some(Ok(bytes))) => Some((Ok(bytes), Some(stream))),
                Ok(Some(Err(e))) => Some((Err(Chunk::Http(e)), Some(stream))),
                Ok(None) => None,
                // Said once; the stream ends after it.
                Err(_) => Some((Err(Chunk::Idle), None)),
            }
        },
    )
}

async fn read_bounded(response: reqwest::Response) -> Result<Vec<u8>, reqwest::Error> {
    let mut bytes = vec![];
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
            break;
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

fn transport_error(provider: &str, e: &reqwest::Error) -> ModelError {
    let class = if e.is_timeout() {
        ErrorClass::ModelTimeout
    } else {
        ErrorClass::ModelServer
    };
    // reqwest's message names the URL, never a header.
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    ModelError::new(class, format!("provider {provider}: {message}"))
}

/// `Retry-After` as seconds or an HTTP date; `retry-after-ms` when given.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

/// How long the provider's own limit headers say it has no room: a limit
/// whose remainder is 0, until its reset. OpenAI's `x-ratelimit-remaining-*`
/// with `x-ratelimit-reset-*` (a duration, `6m0s`), Anthropic's
/// `anthropic-ratelimit-*-remaining` with `-reset` (an RFC 3339 time).
fn no_room_for(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let spent = |name: &str| text(name).and_then(|v| v.parse::<u64>().ok()) == Some(0);
    let mut wait: Option<Duration> = None;
    let mut until = |d: Duration| wait = Some(wait.map_or(d, |w| w.max(d)));
    for limit in ["requests", "tokens"] {
        if spent(&format!("x-ratelimit-remaining-{limit}"))
            && let Some(reset) = text(&format!("x-ratelimit-reset-{limit}"))
            && let Ok(d) = humantime::parse_duration(reset)
        {
            until(d);
        }
    }
    for limit in ["requests", "tokens", "input-tokens", "output-tokens"] {
        if spent(&format!("anthropic-ratelimit-{limit}-remaining"))
            && let Some(reset) = text(&format!("anthropic-ratelimit-{limit}-reset"))
            && let Ok(at) = humantime::parse_rfc3339_weak(reset)
        {
            until(
                at.duration_since(std::time::SystemTime::now())
                    .unwrap_or_default(),
            );
        }
    }
    wait
}

/// The length of a value's JSON, as `serde_json::to_vec` would write it,
/// without building the bytes.
fn json_len(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_providers_limit_headers_say_when_it_has_room_only_when_a_limit_is_spent() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = reqwest::header::HeaderMap::new();
            for (name, value) in pairs {
                h.insert(
                    reqwest::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    value.parse().unwrap(),
                );
            }
            h
        };
        let openai = headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "20ms"),
        ]);
        assert_eq!(no_room_for(&openai), Some(Duration::from_secs(360)));
        let room = headers(&[
            ("x-ratelimit-remaining-requests", "4"),
            ("x-ratelimit-reset-requests", "6m0s"),
        ]);
        assert_eq!(no_room_for(&room), None, "room left: nothing closes");
        let later = std::time::SystemTime::now() + Duration::from_secs(30);
        let anthropic = headers(&[
            ("anthropic-ratelimit-tokens-remaining", "0"),
            (
                "anthropic-ratelimit-tokens-reset",
                &humantime::format_rfc3339_seconds(later).to_string(),
            ),
        ]);
        let wait = no_room_for(&anthropic).unwrap();
        assert!(
            wait > Duration::from_secs(27) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_milliseconds() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("retry-after", "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", "150".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_millis(150)));
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            "retry-after",
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO), "a date in the past");
    }
}
