//! Traces: each run exported as one OpenTelemetry trace in the GenAI
//! semantic conventions, over OTLP (docs/operations.md, "Traces").
//!
//! Invariants:
//! 1. Spans are folded from the events the node emits (`Spans`), never from
//!    an actor's state, and a batch is handed on only once the journal is
//!    durable past the events it was made of: a span never claims what the
//!    journal does not hold.
//! 2. Ids are derived, not drawn: the trace id is the run's id, a job's span
//!    id the end of its id, a call's a digest of its job and call id. A child
//!    names its parent's span before that span ends, a restarted node names
//!    the spans of its previous life, and a log line carries its span's ids
//!    without asking anyone.
//! 3. Telemetry never waits in a run's way (I-52): the observer only
//!    pushes the shared event into a bounded inbox; export is the SDK's batch
//!    processor on its own thread behind a bounded queue. What does not fit,
//!    and what a collector refuses, is dropped and counted; a warning says
//!    so at most once a minute.
//! 4. Content (requests, outputs, tool results) is exported only under
//!    `capture_content`, and then redacted of every secret's value.

use arbor_actors::events::EventBus;
use arbor_actors::secrets::Secrets;
use arbor_protocol::{Event, EventKind, JobId, NodeKind, ParentRef, RunId, Status};
use arbor_storage::Journal;
use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status as SpanStatus, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanExporter, SpanLinks,
    SpanProcessor,
};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// Events waiting to be folded; past this, an event is dropped and counted.
const EVENT_QUEUE: usize = 16_384;
/// Spans waiting to be exported (the batch processor's queue).
const SPAN_QUEUE: usize = 8_192;
/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a node's end waits for its last spans to go out; and when the
/// collector failed the last export, as it will this one.
const FLUSH_AT_CLOSE: Duration = Duration::from_secs(3);
const FLUSH_AT_CLOSE_FAILING: Duration = Duration::from_millis(250);
/// How often the fold takes the events waiting (`Inbox`).
const FOLD_EVERY: Duration = Duration::from_millis(50);
/// At most one warning about lost spans in this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The attribute names: the semantic conventions crate's, in one place. The
/// GenAI ones are marked deprecated there only because they moved to a
/// repository of their own; the names are the same.
#[allow(deprecated)]
mod attr {
    use opentelemetry_semantic_conventions::attribute as sc;
    pub const OPERATION: &str = sc::GEN_AI_OPERATION_NAME;
    pub const WORKFLOW: &str = sc::GEN_AI_WORKFLOW_NAME;
    pub const AGENT_NAME: &str = sc::GEN_AI_AGENT_NAME;
    pub const AGENT_ID: &str = sc::GEN_AI_AGENT_ID;
    pub const PROVIDER: &str = sc::GEN_AI_PROVIDER_NAME;
    pub const REQUEST_MODEL: &str = sc::GEN_AI_REQUEST_MODEL;
    pub const INPUT_TOKENS: &str = sc::GEN_AI_USAGE_INPUT_TOKENS;
    pub const OUTPUT_TOKENS: &str = sc::GEN_AI_USAGE_OUTPUT_TOKENS;
    pub const FINISH_REASONS: &str = sc::GEN_AI_RESPONSE_FINISH_REASONS;
    pub const TOOL_NAME: &str = sc::GEN_AI_TOOL_NAME;
    pub const TOOL_CALL_ID: &str = sc::GEN_AI_TOOL_CALL_ID;
    pub const TOOL_TYPE: &str = sc::GEN_AI_TOOL_TYPE;
    pub const TOOL_RESULT: &str = sc::GEN_AI_TOOL_CALL_RESULT;
    pub const INPUT_MESSAGES: &str = sc::GEN_AI_INPUT_MESSAGES;
    pub const OUTPUT_MESSAGES: &str = sc::GEN_AI_OUTPUT_MESSAGES;
    pub const ERROR_TYPE: &str = sc::ERROR_TYPE;
}

/// `[telemetry]` in arbor.toml, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP address (`http://host:4318`, to which
    /// `/v1/traces` is added, or the whole traces URL).
    pub otlp_endpoint: Option<String>,
    pub service_name: Option<String>,
    /// Export requests, outputs and tool results (redacted).
    pub capture_content: bool,
}

/// Where the spans go and what they hold, after the environment had its say.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The full URL spans are posted to.
    pub traces_url: String,
    /// `None`: the SDK's own reading of `OTEL_SERVICE_NAME` and
    /// `OTEL_RESOURCE_ATTRIBUTES` stands.
    pub service_name: Option<String>,
    pub capture_content: bool,
}

/// An endpoint as `[telemetry] otlp_endpoint` and the OTLP variables take it.
pub fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("{endpoint:?} is not a URL: {e}"))?;
    match url.scheme() {
        "http" | "https" => Ok(()),
        other => Err(format!(
            "{endpoint:?}: OTLP over HTTP needs http or https, not {other}"
        )),
    }
}

/// `base` with the traces path, unless it names it already.
fn traces_url(base: &str) -> String {
    if base.trim_end_matches('/').ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{}/v1/traces", base.trim_end_matches('/'))
    }
}

impl Settings {
    /// The file's settings under the standard variables, which win over it
    /// as `ARBOR_*` variables win over arbor.toml. `Ok(None)`: telemetry is
    /// off (nothing configured, or `OTEL_SDK_DISABLED=true`).
    pub fn resolve(
        config: &TelemetryConfig,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Settings>, String> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let traces_url = if let Some(url) = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            check_endpoint(&url).map_err(|e| format!("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {e}"))?;
            url
        } else if let Some(base) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
            check_endpoint(&base).map_err(|e| format!("OTEL_EXPORTER_OTLP_ENDPOINT: {e}"))?;
            traces_url(&base)
        } else if let Some(base) = &config.otlp_endpoint {
            traces_url(base)
        } else {
            return Ok(None);
        };
        let named_by_env = var("OTEL_SERVICE_NAME").is_some()
            || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| {
                a.split(',')
                    .any(|kv| kv.trim_start().starts_with("service.name="))
            });
        let service_name = if named_by_env {
            None
        } else {
            Some(
                config
                    .service_name
                    .clone()
                    .unwrap_or_else(|| "arbor".to_string()),
            )
        };
        Ok(Some(Settings {
            traces_url,
            service_name,
            capture_content: config.capture_content,
        }))
    }
}

/// What telemetry has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TelemetryStats {
    /// Spans the collector took.
    pub spans_exported: u64,
    /// Spans lost: a full queue, a failed export, a journal that could not
    /// say they were durable.
    pub spans_dropped: u64,
    /// Events that did not fit the queue (their spans are incomplete).
    pub events_dropped: u64,
}

#[derive(Default)]
struct Counters {
    exported: AtomicU64,
    dropped: AtomicU64,
    events_dropped: AtomicU64,
    /// Handed to the processor and not yet given to the exporter.
    queued: AtomicU64,
    /// The last export failed.
    failing: AtomicBool,
    last_warning: Mutex<Option<Instant>>,
}

impl Counters {
    fn lost(&self, spans: u64, why: &dyn std::fmt::Display) {
        let total = self.dropped.fetch_add(spans, Ordering::Relaxed) + spans;
        let mut last = self.last_warning.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(dropped_total = total, "traces: spans dropped: {why}");
        }
    }
}

/// The exporter, counted: what it took and what it lost.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    counters: Arc<Counters>,
}

// The SDK's exporter trait asks for `Debug`.
impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Counters")
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let counters = &self.counters;
        counters.queued.fetch_sub(n, Ordering::Relaxed);
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                counters.failing.store(false, Ordering::Relaxed);
                counters.exported.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                counters.failing.store(true, Ordering::Relaxed);
                counters.lost(n, &format!("the collector did not take them: {e}"));
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// What the fold is asked besides events.
enum Ask {
    /// Answered once everything emitted before it is folded and handed on.
    Sync(oneshot::Sender<()>),
    /// As `Sync`, and the task ends.
    Close(oneshot::Sender<()>),
}

/// Events waiting to be folded. A lock and a push, never a wake: a channel
/// that woke the fold at each event put it ahead of the run's own tasks
/// thousands of times a second (a 1,024-job fan-out took 1.1 to 1.3x as
/// long); the fold takes the lot every `FOLD_EVERY` instead.
#[derive(Default)]
struct Inbox(Mutex<Vec<Arc<Event>>>);

/// A node's traces: the observer on its event bus, the task that folds
/// events into spans, and the batch processor that exports them.
pub struct Telemetry {
    asks: mpsc::Sender<Ask>,
    closed: Arc<AtomicBool>,
    counters: Arc<Counters>,
    processor: Arc<BatchSpanProcessor>,
}

impl Telemetry {
    /// Telemetry as `[telemetry]` and the environment say: `Ok(None)` when
    /// off. Attach it before recovery, so the spans recovery closes are
    /// exported too.
    pub fn from_config(
        config: &TelemetryConfig,
        events: &EventBus,
        journal: Journal,
        secrets: Arc<Secrets>,
    ) -> Result<Option<Telemetry>, String> {
        let Some(settings) = Settings::resolve(config, |name| std::env::var(name).ok())? else {
            return Ok(None);
        };
        let exporter = otlp_exporter(&settings.traces_url)?;
        Ok(Some(Self::with_exporter(
            exporter, &settings, events, journal, secrets,
        )))
    }

    /// Telemetry exporting through `exporter` (the OTLP one, or a test's).
    pub fn with_exporter<E: SpanExporter + 'static>(
        exporter: E,
        settings: &Settings,
        events: &EventBus,
        journal: Journal,
        secrets: Arc<Secrets>,
    ) -> Telemetry {
        let counters = Arc::new(Counters::default());
        let mut resource = Resource::builder();
        if let Some(name) = &settings.service_name {
            resource = resource.with_service_name(name.clone());
        }
        let resource = resource.build();
        let mut processor = BatchSpanProcessor::builder(Counted {
            inner: exporter,
            counters: counters.clone(),
        })
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(SPAN_QUEUE)
                .with_scheduled_delay(Duration::from_millis(500))
                .build(),
        )
        .build();
        processor.set_resource(&resource);
        let processor = Arc::new(processor);
        let inbox = Arc::new(Inbox::default());
        let (asks, asked) = mpsc::channel(4);
        let closed = Arc::new(AtomicBool::new(false));
        {
            let inbox = inbox.clone();
            let closed = closed.clone();
            let counters = counters.clone();
            events.observe(Arc::new(move |event: &Arc<Event>| {
                if !Spans::uses(&event.kind) || closed.load(Ordering::Relaxed) {
                    return;
                }
                let mut waiting = inbox.0.lock().unwrap_or_else(|p| p.into_inner());
                if waiting.len() < EVENT_QUEUE {
                    waiting.push(event.clone());
                } else {
                    counters.events_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        let spans = Spans::new(settings.capture_content, secrets);
        tokio::spawn(pump(
            inbox,
            asked,
            spans,
            journal,
            processor.clone(),
            counters.clone(),
        ));
        Telemetry {
            asks,
            closed,
            counters,
            processor,
        }
    }

    pub fn stats(&self) -> TelemetryStats {
        let c = &self.counters;
        TelemetryStats {
            spans_exported: c.exported.load(Ordering::Relaxed),
            spans_dropped: c.dropped.load(Ordering::Relaxed),
            events_dropped: c.events_dropped.load(Ordering::Relaxed),
        }
    }

    /// Folds what was emitted so far and exports every span it ended.
    pub async fn flush(&self) {
        let (reply, folded) = oneshot::channel();
        if self.asks.send(Ask::Sync(reply)).await.is_ok() {
            let _ = folded.await;
        }
        let processor = self.processor.clone();
        let _ = tokio::task::spawn_blocking(move || processor.force_flush()).await;
    }

    /// Folds what was emitted so far, hands its spans on, and exports what
    /// is queued, within `FLUSH_AT_CLOSE` for the export. Later events are
    /// not traced. A second call does nothing.
    pub async fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let (reply, folded) = oneshot::channel();
        if self.asks.send(Ask::Close(reply)).await.is_ok() {
            let _ = folded.await;
        }
        let processor = self.processor.clone();
        let within = if self.counters.failing.load(Ordering::Relaxed) {
            FLUSH_AT_CLOSE_FAILING
        } else {
            FLUSH_AT_CLOSE
        };
        let _ = tokio::task::spawn_blocking(move || {
            let _ = processor.shutdown_with_timeout(within);
        })
        .await;
    }
}

#[cfg(feature = "http")]
fn otlp_exporter(url: &str) -> Result<impl SpanExporter + 'static, String> {
    // Headers (a collector's key) come from OTEL_EXPORTER_OTLP_HEADERS, as
    // the exporter reads them itself.
    use opentelemetry_otlp::{RetryPolicy, WithExportConfig, WithHttpConfig};
    // Retries are few and short: the batch that waits on them is the last
    // one at a node's end, and a collector that is down stays down.
    let retries = RetryPolicy::default()
        .with_max_retries(1)
        .with_initial_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_millis(100))
        .with_max_jitter(Duration::from_millis(10));
    opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_retry_policy(retries)
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| format!("the OTLP exporter could not be made: {e}"))
}

#[cfg(not(feature = "http"))]
fn otlp_exporter(_url: &str) -> Result<opentelemetry_sdk::trace::InMemorySpanExporter, String> {
    Err("traces need HTTP, and this arbor was built without its http feature".into())
}

/// The task: events in, spans out once the journal holds their events.
async fn pump(
    inbox: Arc<Inbox>,
    mut asked: mpsc::Receiver<Ask>,
    mut spans: Spans,
    journal: Journal,
    processor: Arc<BatchSpanProcessor>,
    counters: Arc<Counters>,
) {
    let mut done = Vec::new();
    let mut every = tokio::time::interval(FOLD_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Outer None: a tick; inner None: the handle is gone, so this is the last fold.
        let ask = tokio::select! {
            _ = every.tick() => None,
            ask = asked.recv() => Some(ask),
        };
        let waiting = std::mem::take(&mut *inbox.0.lock().unwrap_or_else(|p| p.into_inner()));
        for event in &waiting {
            if !spans.knows(event.run) && !matches!(event.kind, EventKind::RunStarted { .. }) {
                spans.load_history(&journal, event.run, event.seq);
            }
            spans.apply(event, &mut done);
        }
        if !done.is_empty() {
            let n = done.len() as u64;
            let durable =
                tokio::time::timeout(EXPORT_TIMEOUT, journal.wait_durable(journal.applied_seq()))
                    .await;
            match durable {
                Ok(Ok(())) => {
                    for span in done.drain(..) {
                        if counters.queued.load(Ordering::Relaxed) >= SPAN_QUEUE as u64 {
                            counters.lost(1, &"the export queue is full");
                            continue;
                        }
                        counters.queued.fetch_add(1, Ordering::Relaxed);
                        processor.on_end(span);
                    }
                }
                Ok(Err(e)) => {
                    done.clear();
                    counters.lost(n, &format!("the journal failed: {e}"));
                }
                Err(_) => {
                    done.clear();
                    counters.lost(n, &"the journal did not sync in time");
                }
            }
        }
        match ask {
            Some(Some(Ask::Sync(reply))) => {
                let _ = reply.send(());
            }
            Some(Some(Ask::Close(reply))) => {
                let _ = reply.send(());
                return;
            }
            Some(None) => return,
            None => {}
        }
    }
}

fn time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// A span id derived from its parts, never zero.
fn derived(parts: &[&[u8]]) -> SpanId {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u32).to_be_bytes());
        hash.update(part);
    }
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&hash.finalize()[..8]);
    if bytes == [0; 8] {
        bytes[7] = 1;
    }
    SpanId::from_bytes(bytes)
}

fn context(run: RunId, span: SpanId) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(run.trace_id()),
        span,
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

/// The span of the call `call` of `job`.
fn call_span(job: JobId, call: &str) -> SpanId {
    SpanId::from_bytes(job.call_span_id(call))
}

/// A span as the fold ends it.
struct Finished {
    run: RunId,
    id: SpanId,
    parent: SpanId,
    name: String,
    kind: SpanKind,
    start_ms: u64,
    end_ms: u64,
    attributes: Vec<KeyValue>,
    links: Vec<Link>,
    status: SpanStatus,
}

struct OpenRun {
    span: SpanId,
    flow: String,
    start_ms: u64,
    attributes: Vec<KeyValue>,
    links: Vec<Link>,
    /// The latest attempt's span by parent and label: a new attempt links to it.
    attempts: HashMap<(ParentRef, String), SpanId>,
}

struct OpenJob {
    run: RunId,
    span: SpanId,
    parent: SpanId,
    agent: String,
    start_ms: u64,
    attributes: Vec<KeyValue>,
    links: Vec<Link>,
    /// `ModelCalled` events so far: each call's span is numbered by it.
    calls: u32,
    /// A refusal told and not yet followed by its `ToolCalled`.
    refused: bool,
}

/// The fold: events in, finished spans out. Pure but for the journal read
/// of a run it has not seen begin (after a restart).
pub struct Spans {
    capture: bool,
    secrets: Arc<Secrets>,
    scope: InstrumentationScope,
    runs: HashMap<RunId, OpenRun>,
    jobs: HashMap<JobId, OpenJob>,
}

impl Spans {
    pub fn new(capture: bool, secrets: Arc<Secrets>) -> Self {
        Spans {
            capture,
            secrets,
            scope: InstrumentationScope::builder("arbor")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            runs: HashMap::new(),
            jobs: HashMap::new(),
        }
    }

    /// The events a span is made of; the rest are not even copied.
    pub fn uses(kind: &EventKind) -> bool {
        matches!(
            kind,
            EventKind::RunStarted { .. }
                | EventKind::RunResumed { .. }
                | EventKind::RunFinished { .. }
                | EventKind::JobSpawned { .. }
                | EventKind::JobFinished { .. }
                | EventKind::ModelCalled { .. }
                | EventKind::ToolCalled { .. }
                | EventKind::Refused { .. }
        )
    }

    fn knows(&self, run: RunId) -> bool {
        self.runs.contains_key(&run)
    }

    /// A run first seen in the middle (a restart, a run taken over): its
    /// journaled events before `seq` are folded without exporting, so what
    /// is still open (its root, its interrupted jobs) closes with the
    /// times and parents it had.
    fn load_history(&mut self, journal: &Journal, run: RunId, seq: u64) {
        let Ok(history) = journal.events(run) else {
            return;
        };
        let mut ignored = Vec::new();
        for event in history.iter().filter(|e| e.seq < seq) {
            if Self::uses(&event.kind) {
                self.apply(event, &mut ignored);
            }
            ignored.clear();
        }
    }

    fn content(&self, text: &str) -> Value {
        Value::from(self.secrets.redact(text))
    }

    fn messages(&self, role: &str, text: &str) -> Value {
        let message = serde_json::json!([{
            "role": role,
            "parts": [{"type": "text", "content": self.secrets.redact(text)}],
        }]);
        Value::from(message.to_string())
    }

    /// How a run or job ended, on its span: `arbor.status`, `error.type`
    /// and, under `capture_content`, its output; and the span's status,
    /// described by `why` or else by the error's type.
    fn ended(
        &self,
        attributes: &mut Vec<KeyValue>,
        status: Status,
        class: Option<arbor_protocol::ErrorClass>,
        output: &serde_json::Value,
        why: impl FnOnce() -> Option<String>,
    ) -> SpanStatus {
        attributes.push(KeyValue::new("arbor.status", status.as_str()));
        let error = match (status, class) {
            (Status::Done, _) => None,
            (Status::Stopped, _) => Some("stopped"),
            (_, Some(class)) => Some(class.as_str()),
            (_, None) => Some("failed"),
        };
        if let Some(error) = error {
            attributes.push(KeyValue::new(attr::ERROR_TYPE, error));
        }
        if self.capture && !output.is_null() {
            attributes.push(KeyValue::new(
                attr::OUTPUT_MESSAGES,
                self.messages("assistant", &text_of(output)),
            ));
        }
        match error {
            None => SpanStatus::Ok,
            Some(error) => SpanStatus::error(why().unwrap_or_else(|| error.to_string())),
        }
    }

    fn finish(&self, span: Finished) -> SpanData {
        let mut links = SpanLinks::default();
        links.links = span.links;
        SpanData {
            span_context: context(span.run, span.id),
            parent_span_id: span.parent,
            parent_span_is_remote: false,
            span_kind: span.kind,
            name: span.name.into(),
            start_time: time(span.start_ms),
            end_time: time(span.end_ms.max(span.start_ms)),
            attributes: span.attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links,
            status: span.status,
            instrumentation_scope: self.scope.clone(),
        }
    }

    /// Folds one event; a span it ends is pushed to `out`.
    pub fn apply(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        match &event.kind {
            EventKind::RunStarted { .. } => self.run_started(event),
            EventKind::RunResumed { .. } => self.run_resumed(event, out),
            EventKind::RunFinished { .. } => self.run_finished(event, out),
            EventKind::JobSpawned { .. } => self.job_spawned(event),
            EventKind::JobFinished { .. } => self.job_finished(event, out),
            EventKind::ModelCalled { .. } => self.model_called(event, out),
            EventKind::Refused { id, .. } => {
                if let Some(job) = self.jobs.get_mut(id) {
                    job.refused = true;
                }
            }
            EventKind::ToolCalled { .. } => self.tool_called(event, out),
            EventKind::Recovered { .. }
            | EventKind::JobRunning { .. }
            | EventKind::AccountChanged { .. }
            | EventKind::WindDown { .. }
            | EventKind::ContextCompacted { .. }
            | EventKind::ContextPressure { .. }
            | EventKind::BudgetOverrun { .. }
            | EventKind::ToolStarted { .. }
            | EventKind::McpServer { .. }
            | EventKind::SteerQueued { .. }
            | EventKind::SteerDelivered { .. }
            | EventKind::SteerDiscarded { .. }
            | EventKind::PeerQueued { .. }
            | EventKind::PeerDelivered { .. }
            | EventKind::ApprovalRequested { .. }
            | EventKind::ApprovalExpiring { .. }
            | EventKind::ApprovalDecided { .. }
            | EventKind::RetryWaiting { .. }
            | EventKind::ModelFallback { .. }
            | EventKind::NeedsDecision { .. }
            | EventKind::IterationChecked { .. }
            | EventKind::Reviewed { .. }
            | EventKind::BudgetReached { .. }
            | EventKind::BudgetPauseEnded { .. } => {}
        }
    }

    fn run_started(&mut self, event: &Event) {
        let EventKind::RunStarted {
            flow,
            budget_tokens,
            ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        self.runs.insert(
            run,
            OpenRun {
                span: SpanId::from_bytes(run.span_id()),
                flow: flow.clone(),
                start_ms: at,
                attributes: vec![
                    KeyValue::new(attr::OPERATION, "invoke_workflow"),
                    KeyValue::new(attr::WORKFLOW, flow.clone()),
                    KeyValue::new("arbor.run.id", run.to_string()),
                    KeyValue::new("arbor.budget_tokens", *budget_tokens as i64),
                ],
                links: vec![],
                attempts: HashMap::new(),
            },
        );
    }

    fn run_resumed(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        let EventKind::RunResumed { epoch, .. } = &event.kind else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        // The root of the node's previous life ends where it died;
        // the resumed run is a new root linked to it.
        let Some(open) = self.runs.get_mut(&run) else {
            return;
        };
        let before = open.span;
        let start_ms = std::mem::replace(&mut open.start_ms, at);
        open.span = derived(&[run.0.as_bytes(), b"resumed", &epoch.to_be_bytes()]);
        let mut attributes = open.attributes.clone();
        attributes.push(KeyValue::new("arbor.status", "interrupted"));
        attributes.push(KeyValue::new(attr::ERROR_TYPE, "interrupted"));
        let links = std::mem::replace(
            &mut open.links,
            vec![Link::with_context(context(run, before))],
        );
        let name = format!("invoke_workflow {}", open.flow);
        out.push(self.finish(Finished {
            run,
            id: before,
            parent: SpanId::INVALID,
            name,
            kind: SpanKind::Internal,
            start_ms,
            end_ms: at,
            attributes,
            links,
            status: SpanStatus::error("the node stopped under the run; it was resumed"),
        }));
    }

    fn run_finished(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        let EventKind::RunFinished {
            status,
            error_class,
            reason,
            output,
            ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        let Some(open) = self.runs.remove(&run) else {
            return;
        };
        self.jobs.retain(|_, j| j.run != run);
        let mut attributes = open.attributes;
        let status = self.ended(&mut attributes, *status, *error_class, output, || {
            reason.clone()
        });
        out.push(self.finish(Finished {
            run,
            id: open.span,
            parent: SpanId::INVALID,
            name: format!("invoke_workflow {}", open.flow),
            kind: SpanKind::Internal,
            start_ms: open.start_ms,
            end_ms: at,
            attributes,
            links: open.links,
            status,
        }));
    }

    fn job_spawned(&mut self, event: &Event) {
        let EventKind::JobSpawned {
            id,
            parent,
            kind,
            agent,
            label,
            depth,
            attempt,
            grant_tokens,
            request,
            call,
            model,
            ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        let mut attributes = vec![
            KeyValue::new(attr::OPERATION, "invoke_agent"),
            KeyValue::new(attr::AGENT_NAME, agent.clone()),
            KeyValue::new(attr::AGENT_ID, id.to_string()),
            KeyValue::new(
                "arbor.kind",
                match kind {
                    NodeKind::Step => "step",
                    _ => "job",
                },
            ),
            KeyValue::new("arbor.depth", *depth as i64),
            KeyValue::new("arbor.attempt", *attempt as i64),
            KeyValue::new("arbor.grant_tokens", *grant_tokens as i64),
        ];
        if let Some(label) = label {
            attributes.push(KeyValue::new("arbor.label", label.clone()));
        }
        if !model.is_empty() {
            // The model the job runs on (I-55), as agent.md names it.
            attributes.push(KeyValue::new("arbor.model", model.clone()));
        }
        if self.capture && !request.is_empty() {
            attributes.push(KeyValue::new(
                attr::INPUT_MESSAGES,
                self.messages("user", request),
            ));
        }
        let Some(open) = self.runs.get_mut(&run) else {
            return;
        };
        let parent_span = match (parent, call) {
            (ParentRef::Run(_), _) => open.span,
            (ParentRef::Job(parent), Some(call)) => call_span(*parent, call),
            (ParentRef::Job(parent), None) => SpanId::from_bytes(parent.span_id()),
        };
        let span = SpanId::from_bytes(id.span_id());
        let mut links = vec![];
        if let Some(label) = label {
            let before = open.attempts.insert((*parent, label.clone()), span);
            if let Some(before) = before {
                links.push(Link::new(
                    context(run, before),
                    vec![KeyValue::new("arbor.link", "previous_attempt")],
                    0,
                ));
            }
        }
        self.jobs.insert(
            *id,
            OpenJob {
                run,
                span,
                parent: parent_span,
                agent: agent.clone(),
                start_ms: at,
                attributes,
                links,
                calls: 0,
                refused: false,
            },
        );
    }

    fn job_finished(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        let EventKind::JobFinished {
            id, reason, result, ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        let Some(open) = self.jobs.remove(id) else {
            return;
        };
        let mut attributes = open.attributes;
        if let Some(task) = result.task_status {
            attributes.push(KeyValue::new("arbor.task_status", task.as_str()));
        }
        attributes.push(KeyValue::new(
            "arbor.tokens_spent",
            result.tokens_spent as i64,
        ));
        attributes.push(KeyValue::new(
            "arbor.cost_usd_micros",
            result.usd_micros_spent as i64,
        ));
        attributes.push(KeyValue::new("arbor.turns", result.turns as i64));
        let status = self.ended(
            &mut attributes,
            result.status,
            result.error_class,
            &result.output,
            || reason.clone().or_else(|| result.error.clone()),
        );
        out.push(self.finish(Finished {
            run,
            id: open.span,
            parent: open.parent,
            name: format!("invoke_agent {}", open.agent),
            kind: SpanKind::Internal,
            start_ms: open.start_ms,
            end_ms: at,
            attributes,
            links: open.links,
            status,
        }));
    }

    fn model_called(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        let EventKind::ModelCalled {
            id,
            turn,
            reserved,
            input_tokens,
            output_tokens,
            truncated,
            call,
            ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        let Some(job) = self.jobs.get_mut(id) else {
            return;
        };
        job.calls += 1;
        let span = derived(&[id.0.as_bytes(), b"chat", &job.calls.to_be_bytes()]);
        let parent = job.span;
        let mut attributes = vec![
            KeyValue::new(attr::OPERATION, "chat"),
            KeyValue::new(attr::PROVIDER, call.provider.clone()),
            KeyValue::new(attr::REQUEST_MODEL, call.model.clone()),
            KeyValue::new(attr::INPUT_TOKENS, *input_tokens as i64),
            KeyValue::new(attr::OUTPUT_TOKENS, *output_tokens as i64),
            KeyValue::new("arbor.reserved_tokens", *reserved as i64),
            KeyValue::new("arbor.cost_usd_micros", call.usd_micros as i64),
            KeyValue::new("arbor.turn", *turn as i64),
            KeyValue::new("arbor.retries", call.retries as i64),
        ];
        if *truncated {
            attributes.push(KeyValue::new(
                attr::FINISH_REASONS,
                Value::Array(opentelemetry::Array::String(vec!["length".into()])),
            ));
        }
        if call.usage_estimated {
            attributes.push(KeyValue::new("arbor.usage_estimated", true));
        }
        let status = if call.outcome == "ok" || call.outcome.is_empty() {
            SpanStatus::Unset
        } else {
            attributes.push(KeyValue::new(attr::ERROR_TYPE, call.outcome.clone()));
            SpanStatus::error(call.outcome.clone())
        };
        out.push(self.finish(Finished {
            run,
            id: span,
            parent,
            name: format!("chat {}", call.model),
            kind: SpanKind::Client,
            start_ms: at.saturating_sub(call.latency_ms),
            end_ms: at,
            attributes,
            links: vec![],
            status,
        }));
    }

    fn tool_called(&mut self, event: &Event, out: &mut Vec<SpanData>) {
        let EventKind::ToolCalled {
            id,
            turn,
            tool,
            call,
            ok,
            detail,
            latency_ms,
            ..
        } = &event.kind
        else {
            return;
        };
        let (run, at) = (event.run, event.at_ms);
        let Some(job) = self.jobs.get_mut(id) else {
            return;
        };
        let refused = std::mem::take(&mut job.refused);
        let parent = job.span;
        let span = if call.is_empty() {
            job.calls += 1;
            derived(&[id.0.as_bytes(), b"tool#", &job.calls.to_be_bytes()])
        } else {
            call_span(*id, call)
        };
        let mut attributes = vec![
            KeyValue::new(attr::OPERATION, "execute_tool"),
            KeyValue::new(attr::TOOL_NAME, tool.clone()),
            KeyValue::new(
                attr::TOOL_TYPE,
                if tool.starts_with("mcp__") {
                    "extension"
                } else {
                    "function"
                },
            ),
            KeyValue::new("arbor.turn", *turn as i64),
        ];
        if !call.is_empty() {
            attributes.push(KeyValue::new(attr::TOOL_CALL_ID, call.clone()));
        }
        if self.capture {
            attributes.push(KeyValue::new(attr::TOOL_RESULT, self.content(detail)));
        }
        let status = if *ok {
            SpanStatus::Unset
        } else {
            let error = if refused {
                "refused"
            } else if detail.starts_with("timed_out") {
                "timed_out"
            } else {
                "tool_error"
            };
            attributes.push(KeyValue::new(attr::ERROR_TYPE, error));
            SpanStatus::error(error)
        };
        out.push(self.finish(Finished {
            run,
            id: span,
            parent,
            name: format!("execute_tool {tool}"),
            kind: SpanKind::Internal,
            start_ms: at.saturating_sub(*latency_ms),
            end_ms: at,
            attributes,
            links: vec![],
            status,
        }));
    }
}

/// An output as the text of a message: a string as it is, anything else as JSON.
fn text_of(output: &serde_json::Value) -> String {
    match output {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(file: Option<&str>, env: &[(&str, &str)]) -> Result<Option<Settings>, String> {
        let config = TelemetryConfig {
            otlp_endpoint: file.map(str::to_string),
            service_name: None,
            capture_content: false,
        };
        Settings::resolve(&config, |name| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    fn url(settings: Result<Option<Settings>, String>) -> Option<String> {
        settings.unwrap().map(|s| s.traces_url)
    }

    #[test]
    fn off_unless_configured_and_the_variables_win_over_the_file() {
        assert_eq!(url(resolve(None, &[])), None);
        assert_eq!(
            url(resolve(Some("http://c:4318"), &[])).as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(
            url(resolve(Some("http://c:4318/v1/traces"), &[])).as_deref(),
            Some("http://c:4318/v1/traces")
        );
        let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318/")];
        assert_eq!(
            url(resolve(Some("http://c:4318"), &env)).as_deref(),
            Some("http://env:4318/v1/traces")
        );
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:1/x"),
        ];
        assert_eq!(url(resolve(None, &env)).as_deref(), Some("http://t:1/x"));
        let env = [("OTEL_SDK_DISABLED", "TRUE")];
        assert_eq!(url(resolve(Some("http://c:4318"), &env)), None);
        let env = [("OTEL_SDK_DISABLED", "false")];
        assert!(url(resolve(Some("http://c:4318"), &env)).is_some());
    }

    #[test]
    fn a_bad_endpoint_is_named_and_the_service_name_defers_to_the_variables() {
        let err = resolve(None, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://x")]).unwrap_err();
        assert!(err.starts_with("OTEL_EXPORTER_OTLP_ENDPOINT:"), "{err}");
        assert!(check_endpoint("not a url").is_err());
        let named = |env: &[(&str, &str)]| resolve(Some("http://c"), env).unwrap().unwrap();
        assert_eq!(named(&[]).service_name.as_deref(), Some("arbor"));
        assert_eq!(named(&[("OTEL_SERVICE_NAME", "svc")]).service_name, None);
        let attrs = [("OTEL_RESOURCE_ATTRIBUTES", "a=b, service.name=x")];
        assert_eq!(named(&attrs).service_name, None);
    }

    #[test]
    fn ids_are_derived_and_a_span_never_has_the_invalid_id() {
        let job = JobId::new();
        assert_eq!(call_span(job, "c1"), call_span(job, "c1"));
        assert_ne!(call_span(job, "c1"), call_span(job, "c2"));
        assert_ne!(call_span(job, "c1"), SpanId::INVALID);
        assert_eq!(
            SpanId::from_bytes(job.span_id()).to_string(),
            job.span_hex(),
            "a log line's span id is the span's"
        );
    }
}
