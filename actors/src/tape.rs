//! Recording a run and replaying it (I-49), beside a job's model and tools.
//!
//! A recording job's model is wrapped in a `RecordingModel`, which journals
//! each exchange (the request as digests, the answer, what the call's meter
//! was told) under the job's lineage and the call's number; the loop gives
//! the job's `TapeWriter` its exec, read_file and MCP results and its
//! steering. A replaying job's model is a `TapeModel`, which serves the
//! job's calls from the recording by the same numbers, so a fan-out replays
//! the same whatever the schedule; the loop asks the job's `JobReplay` for
//! the recorded tool results and steering.
//!
//! Invariants:
//! 1. Every string is cut of the node's secret values before it is
//!    journaled (I-27).
//! 2. A replayed call whose request differs from its recording's is never
//!    answered from the recording: strict, the run fails naming the job's
//!    lineage, the call and the first part that differs; forked, the job
//!    asks its configured model from there on.
//! 3. Job ids and run ids are stripped from a request before it is digested:
//!    they are new in every run.

use crate::model::{CallMeter, Message, Model, ModelError, ModelInfo, ModelReply, ModelRequest};
use crate::model::{Price, RetryPolicy, ToolCall, estimate_tokens};
use crate::secrets::Secrets;
use arbor_protocol::tape::{
    AfterDivergence, ApprovalEntry, ApprovalOutcome, CallOutcome, JobTape, ModelExchange,
    RecordedModel, RecordedToolCall, ReplaySpec, RequestPart, SteeringEntry, SteeringMessage, Tape,
    TapeEntry, ToolExchange, ToolReplay, strip_ids,
};
use arbor_protocol::{ErrorClass, JobId, RunId};
use arbor_storage::{Journal, Record, TapeRecord};
use futures::FutureExt;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A job's lineage as a recording names it: each label from the root with
/// its attempt (`plan#1/worker-2#1`).
pub fn lineage_key(parent: Option<&str>, label: &str, attempt: u32) -> Arc<str> {
    match parent {
        Some(parent) => format!("{parent}/{label}#{attempt}").into(),
        None => format!("{label}#{attempt}").into(),
    }
}

/// A job's model as the agent's definition names it, as a request's
/// `model` part.
pub fn model_ref(agent: &arbor_protocol::AgentDef) -> String {
    match &agent.model {
        arbor_protocol::ModelRef::Scripted => "scripted".into(),
        arbor_protocol::ModelRef::Provider { provider, model } => format!("{provider}/{model}"),
    }
}

/// A job's side of its run's recording or replay, for its loop.
#[derive(Clone, Default)]
pub struct JobTapes {
    pub writer: Option<Arc<TapeWriter>>,
    pub replay: Option<Arc<JobReplay>>,
}

/// Where a job's recording goes.
pub struct TapeWriter {
    journal: Journal,
    secrets: Arc<Secrets>,
    run: RunId,
    job: JobId,
    lineage: Arc<str>,
    volatile: Volatile,
    /// The next number of each kind of entry (`TapeEntry::kind`).
    next: Mutex<[u32; 6]>,
}

impl TapeWriter {
    pub fn new(
        journal: Journal,
        secrets: Arc<Secrets>,
        run: RunId,
        job: JobId,
        lineage: Arc<str>,
        volatile: Volatile,
    ) -> Self {
        Self {
            journal,
            secrets,
            run,
            job,
            lineage,
            volatile,
            next: Mutex::new([0; 6]),
        }
    }

    /// Journals `entry` as the job's next of its kind. It is appended, not
    /// committed: the job's end, which waits for durability, covers it.
    pub fn write(&self, entry: TapeEntry) {
        let kind = entry.kind();
        let index = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let index = next[usize::from(kind)];
            next[usize::from(kind)] += 1;
            index
        };
        let mut value = serde_json::to_value(&entry).unwrap_or_default();
        redact(&mut value, &self.secrets);
        let record = TapeRecord {
            run: self.run,
            job: self.job,
            lineage: self.lineage.to_string(),
            kind,
            index,
            entry_json: value.to_string(),
            epoch: self.journal.epoch(),
        };
        if let Err(e) = self.journal.append(vec![Record::Tape(record)]) {
            tracing::warn!(run = %self.run, job = %self.job, "a recording entry was not journaled: {e}");
        }
    }

    /// A recorded tool's result: `called` is the name the model called it by,
    /// `canonical` the tool's own.
    pub fn tool(
        &self,
        called: &str,
        canonical: &str,
        args: &serde_json::Value,
        result: &Result<String, String>,
        files: BTreeMap<String, String>,
    ) {
        let (ok, content) = match result {
            Ok(content) => (true, content.clone()),
            Err(error) => (false, error.clone()),
        };
        self.write(TapeEntry::Tool(ToolExchange {
            tool: canonical.to_string(),
            args: args_digest(&self.volatile, called, args),
            ok,
            content,
            files,
        }));
    }

    /// What came of call `call` of tool `tool`, which waited for a person.
    pub fn approval(
        &self,
        call: &str,
        tool: &str,
        decided: &Result<Option<serde_json::Value>, String>,
    ) {
        self.write(TapeEntry::Approval(ApprovalEntry {
            call: call.to_string(),
            tool: tool.to_string(),
            outcome: match decided {
                Ok(edited) => ApprovalOutcome::Approved {
                    edited: edited.clone(),
                },
                Err(message) => ApprovalOutcome::Refused {
                    message: message.clone(),
                },
            },
        }));
    }

    /// The messages a job took in at `turn`, each with whether its parent sent it.
    pub fn steering(&self, turn: u32, messages: &[(String, bool)]) {
        if !messages.is_empty() {
            self.write(TapeEntry::Steering(SteeringEntry {
                turn,
                messages: messages
                    .iter()
                    .map(|(text, from_parent)| SteeringMessage {
                        text: text.clone(),
                        from_parent: *from_parent,
                    })
                    .collect(),
            }));
        }
    }
}

/// Every string in `value` cut of the secrets' values (invariant 1).
fn redact(value: &mut serde_json::Value, secrets: &Secrets) {
    match value {
        serde_json::Value::String(text) => {
            let cut = secrets.redact(text);
            if cut != *text {
                *text = cut;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| redact(v, secrets)),
        serde_json::Value::Object(map) => map.values_mut().for_each(|v| redact(v, secrets)),
        _ => {}
    }
}

/// Whether a tool's results are recorded and replayed: an MCP tool's (it
/// reads the world), and a built-in's as its entry says (`ToolInfo::recorded`).
pub fn is_recorded_tool(name: &str, is_mcp: bool) -> bool {
    is_mcp
        || name
            .parse::<arbor_protocol::ToolName>()
            .is_ok_and(|t| t.info().recorded)
}

// ---------------------------------------------------------------- digests

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]])
        .map(char::from)
        .collect()
}

/// A part's digest: the first 8 bytes of its SHA-256, in hex.
fn short_digest(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes)[..8])
}

/// What is new in every run, and so taken out of a request before it is
/// digested (invariant 3): ids, and the node's work root in workdir paths.
#[derive(Clone, Debug, Default)]
pub struct Volatile {
    work_root: Arc<str>,
}

impl Volatile {
    pub fn new(work_root: &std::path::Path) -> Self {
        Self {
            work_root: work_root.display().to_string().into(),
        }
    }

    pub fn clean<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        use std::borrow::Cow;
        if self.work_root.is_empty() || !text.contains(&*self.work_root) {
            return strip_ids(text);
        }
        let text = text.replace(&*self.work_root, "<work>");
        Cow::Owned(strip_ids(&text).into_owned())
    }
}

fn args_digest(volatile: &Volatile, tool: &str, args: &serde_json::Value) -> String {
    short_digest(format!("{tool}\n{}", volatile.clean(&args.to_string())).as_bytes())
}

/// A request as a recording keeps it: each part's digest, and the whole's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Canonical {
    pub digest: String,
    pub parts: Vec<RequestPart>,
}

/// The canonical request: the agent's model, the system prompt, the tools
/// shown, the parameters and each message, ids stripped (invariant 3).
pub fn canonical(model: &str, volatile: &Volatile, request: &ModelRequest) -> Canonical {
    let mut parts = Vec::with_capacity(request.messages.len() + 5);
    let mut part = |name: String, bytes: &[u8]| {
        parts.push(RequestPart {
            name,
            digest: short_digest(bytes),
        })
    };
    part("model".into(), model.as_bytes());
    part("system".into(), volatile.clean(&request.system).as_bytes());
    let mut tools = Vec::new();
    for tool in request.tools.iter() {
        tools.extend_from_slice(tool.name.as_bytes());
        tools.push(0);
        tools.extend_from_slice(tool.description.as_bytes());
        tools.push(0);
        tools.extend_from_slice(tool.parameters.to_string().as_bytes());
        tools.push(0);
    }
    part("tools".into(), &tools);
    part(
        "max_output_tokens".into(),
        request.max_output_tokens.to_string().as_bytes(),
    );
    part(
        "wind_down".into(),
        request.wind_down.as_deref().unwrap_or("").as_bytes(),
    );
    // Only when set, so a recording made before settings existed still
    // compares equal.
    if !request.settings.is_empty() {
        let settings = serde_json::to_vec(&request.settings).unwrap_or_default();
        part("settings".into(), &settings);
    }
    for (i, message) in request.messages.iter().enumerate() {
        let (role, body) = match message {
            Message::User(text) => ("user", volatile.clean(text).into_owned()),
            // Thinking is the provider's to check, and a recording keeps
            // none: a replay's history has the same turns without it.
            Message::Assistant { text, calls, .. } => {
                let mut body = text.clone().unwrap_or_default();
                for call in calls {
                    body.push('\0');
                    body.push_str(&call.id);
                    body.push('\0');
                    body.push_str(&call.tool);
                    body.push('\0');
                    body.push_str(&volatile.clean(&call.args.to_string()));
                }
                ("assistant", body)
            }
            Message::ToolResult {
                call_id,
                content,
                is_error,
            } => (
                "tool_result",
                format!("{call_id}\0{is_error}\0{}", volatile.clean(content)),
            ),
        };
        part(format!("messages[{i}] ({role})"), body.as_bytes());
    }
    let mut whole = Sha256::new();
    for part in &parts {
        whole.update(part.name.as_bytes());
        whole.update([0]);
        whole.update(part.digest.as_bytes());
        whole.update([0]);
    }
    Canonical {
        digest: hex(&whole.finalize()),
        parts,
    }
}

/// The first part where `replayed` differs from `recorded`, in words.
pub fn first_difference(recorded: &[RequestPart], replayed: &[RequestPart]) -> String {
    for (at, (old, new)) in recorded.iter().zip(replayed).enumerate() {
        if old.name != new.name {
            return format!(
                "part {at} is {} in the replay, {} in the recording",
                new.name, old.name
            );
        }
        if old.digest != new.digest {
            return format!("{} differs", new.name);
        }
    }
    match (recorded.len(), replayed.len()) {
        (old, new) if new > old => format!(
            "{} is not in the recording (it has {} parts, the replay {})",
            replayed[old].name, old, new
        ),
        (old, new) if old > new => format!(
            "{} is missing from the replay (it has {} parts, the recording {})",
            recorded[new].name, new, old
        ),
        _ => "the digests differ".into(),
    }
}

fn recorded_model(info: &ModelInfo) -> RecordedModel {
    RecordedModel {
        provider: info.provider.clone(),
        model: info.model.clone(),
        max_output_tokens: info.max_output_tokens,
        context_window: info.context_window,
        price: info
            .price
            .map(|p| [p.input_picos_per_token, p.output_picos_per_token]),
        max_retries: info.retry.max_retries,
        retry_base_ms: info.retry.base.as_millis() as u64,
        retry_cap_ms: info.retry.cap.as_millis() as u64,
        billed: info.billed,
        thinking_tokens: info.thinking_tokens.map(Box::new),
        default_effort: info.default_effort,
    }
}

fn model_info(recorded: &RecordedModel) -> ModelInfo {
    ModelInfo {
        provider: recorded.provider.clone(),
        supply: recorded.provider.clone(),
        model: recorded.model.clone(),
        max_output_tokens: recorded.max_output_tokens,
        context_window: recorded.context_window,
        price: recorded.price.map(|[input, output]| Price {
            input_picos_per_token: input,
            output_picos_per_token: output,
        }),
        retry: RetryPolicy {
            max_retries: recorded.max_retries,
            base: Duration::from_millis(recorded.retry_base_ms),
            cap: Duration::from_millis(recorded.retry_cap_ms),
        },
        billed: recorded.billed,
        thinking_tokens: recorded.thinking_tokens.as_deref().copied(),
        default_effort: recorded.default_effort,
    }
}

// ---------------------------------------------------------------- recording

/// A job's model, recorded.
pub struct RecordingModel {
    inner: Arc<dyn Model>,
    writer: Arc<TapeWriter>,
    /// The agent's model as its definition names it (`ModelRef`).
    model_ref: String,
    /// What `count_input` said of the call about to be made.
    counted: AtomicU64,
    /// It is one of the agent's fallbacks: its calls say so, for a replay.
    fallback: bool,
}

impl RecordingModel {
    pub fn new(inner: Arc<dyn Model>, writer: Arc<TapeWriter>, model_ref: String) -> Self {
        Self {
            inner,
            writer,
            model_ref,
            counted: AtomicU64::new(0),
            fallback: false,
        }
    }

    /// A fallback's model (I-55): each call names it, so that a replay
    /// moves where the recorded run moved.
    pub fn fallback(inner: Arc<dyn Model>, writer: Arc<TapeWriter>, model_ref: String) -> Self {
        Self {
            fallback: true,
            ..Self::new(inner, writer, model_ref)
        }
    }
}

/// Journals a call's exchange when the call ends, or, if it never does (a
/// stop dropped it), as cut short, with what its meter was told.
struct Pending {
    writer: Arc<TapeWriter>,
    exchange: Option<ModelExchange>,
    meter: CallMeter,
}

impl Pending {
    fn finish(&mut self, outcome: CallOutcome) {
        if let Some(mut exchange) = self.exchange.take() {
            exchange.meter = self.meter.log();
            exchange.outcome = outcome;
            self.writer.write(TapeEntry::Call(Box::new(exchange)));
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.finish(CallOutcome::Cut);
    }
}

impl Model for RecordingModel {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        let counted = self.inner.count_input(request);
        self.counted.store(counted, Ordering::Release);
        self.writer.write(TapeEntry::Count(counted));
        counted
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        let estimate = self.inner.estimate_prompt(request);
        self.writer.write(TapeEntry::Estimate(estimate));
        estimate
    }

    fn info(&self) -> ModelInfo {
        self.inner.info()
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        let canonical = canonical(&self.model_ref, &self.writer.volatile, &request);
        request.meter.keep_log();
        let mut pending = Pending {
            writer: self.writer.clone(),
            exchange: Some(ModelExchange {
                digest: canonical.digest,
                parts: canonical.parts,
                input_counted: self.counted.load(Ordering::Acquire),
                model: recorded_model(&self.inner.info()),
                fallback: self.fallback.then(|| self.model_ref.clone()),
                meter: vec![],
                outcome: CallOutcome::Cut,
            }),
            meter: request.meter.clone(),
        };
        let answer = self.inner.complete(request);
        async move {
            let result = answer.await;
            pending.finish(match &result {
                Ok(reply) => CallOutcome::Answer {
                    text: reply.text.clone(),
                    calls: reply
                        .calls
                        .iter()
                        .map(|c| RecordedToolCall {
                            id: c.id.clone(),
                            tool: c.tool.clone(),
                            args: c.args.clone(),
                        })
                        .collect(),
                    usage: reply.usage,
                    truncated: reply.truncated,
                },
                Err(error) => CallOutcome::Error {
                    class: error.class,
                    message: error.message.clone(),
                    retry_after_ms: error.retry_after.map(|d| d.as_millis() as u64),
                },
            });
            result
        }
        .boxed()
    }
}

// ---------------------------------------------------------------- replay

/// A replaying run's recording, and its first divergence.
pub struct Replay {
    pub spec: ReplaySpec,
    tape: Arc<Tape>,
    first: tokio::sync::watch::Sender<Option<String>>,
}

impl Replay {
    pub fn new(spec: ReplaySpec, tape: Arc<Tape>) -> Arc<Self> {
        Arc::new(Self {
            spec,
            tape,
            first: tokio::sync::watch::channel(None).0,
        })
    }

    /// A job's side of the replay. `live`: its configured model, which a
    /// forked replay goes on with after a divergence.
    pub fn job(
        self: &Arc<Self>,
        lineage: Arc<str>,
        model_ref: String,
        volatile: Volatile,
        live: Option<Arc<dyn Model>>,
    ) -> Arc<JobReplay> {
        // A rerun's job that is not reused runs live from its start.
        let fresh = self
            .spec
            .reuse
            .as_ref()
            .is_some_and(|reuse| !reuse.contains(&*lineage));
        let live = live.filter(|_| self.spec.after_divergence == AfterDivergence::Live);
        Arc::new(JobReplay {
            replay: self.clone(),
            volatile,
            forked: AtomicBool::new(fresh && live.is_some()),
            tape: self.tape.get(&*lineage).cloned(),
            lineage,
            model_ref,
            live,
            calls: AtomicUsize::new(0),
            counts: AtomicUsize::new(0),
            estimates: AtomicUsize::new(0),
            tools: AtomicUsize::new(0),
        })
    }

    /// Once: the first divergence of the run, which fails it.
    fn diverge(&self, why: &str) {
        self.first.send_if_modified(|first| {
            if first.is_some() {
                return false;
            }
            *first = Some(why.to_string());
            true
        });
    }

    /// Resolves with the run's first divergence, when there is one, or
    /// with None once the replay is gone without one.
    pub fn diverged(&self) -> impl std::future::Future<Output = Option<String>> + Send + 'static {
        let mut first = self.first.subscribe();
        async move { first.wait_for(Option::is_some).await.ok()?.clone() }
    }
}

/// One job of a replaying run: its recording and how far it has got.
pub struct JobReplay {
    replay: Arc<Replay>,
    volatile: Volatile,
    lineage: Arc<str>,
    model_ref: String,
    /// None: the recording has no such job.
    tape: Option<JobTape>,
    live: Option<Arc<dyn Model>>,
    calls: AtomicUsize,
    counts: AtomicUsize,
    estimates: AtomicUsize,
    tools: AtomicUsize,
    /// It diverged and goes on live (a forked replay).
    forked: AtomicBool,
}

/// What a replay gives a tool call in place of running it.
pub enum Served {
    /// The recorded result: its tool's canonical name, what it returned,
    /// and the files it left (to write again).
    Result(
        String,
        Result<serde_json::Value, String>,
        BTreeMap<String, String>,
    ),
    /// The call differs from the recording's (the run is failing).
    Diverged(String),
}

impl JobReplay {
    fn forked(&self) -> bool {
        self.forked.load(Ordering::Acquire)
    }

    /// Whether this job's exec, read_file and MCP calls are served from the
    /// recording.
    pub fn serves_tools(&self) -> bool {
        self.replay.spec.tools == ToolReplay::Recorded && !self.forked()
    }

    /// A divergence: in a strict replay it fails the run (and is returned as
    /// the error to give); forked, the job goes live and None is returned.
    fn diverge(&self, what: String) -> Option<String> {
        let why = format!("the replay diverged at {}: {what}", self.lineage);
        if self.live.is_some() {
            tracing::info!("{why}; it goes on live");
            self.forked.store(true, Ordering::Release);
            return None;
        }
        self.replay.diverge(&why);
        Some(why)
    }

    /// The recorded result of the job's next recorded tool call.
    pub fn tool(&self, name: &str, args: &serde_json::Value) -> Option<Served> {
        let at = self.tools.fetch_add(1, Ordering::AcqRel);
        let recorded = self.tape.as_ref().and_then(|t| t.tools.get(at));
        let what = match recorded {
            None => format!("tool call {} ({name}) is not in the recording", at + 1),
            Some(r) if r.args != args_digest(&self.volatile, name, args) => format!(
                "tool call {} ({name}) differs from the recording's ({}) in its name or arguments",
                at + 1,
                r.tool
            ),
            Some(r) => {
                let result = if r.ok {
                    serde_json::from_str(&r.content)
                        .or_else(|_| Ok(serde_json::Value::String(r.content.clone())))
                } else {
                    Err(r.content.clone())
                };
                return Some(Served::Result(r.tool.clone(), result, r.files.clone()));
            }
        };
        self.diverge(what).map(Served::Diverged)
    }

    /// The recorded decision on call `call`, if the recording has one
    /// (and the job has not forked): applied without asking again.
    pub fn approval(&self, call: &str) -> Option<Result<Option<serde_json::Value>, String>> {
        if self.forked() {
            return None;
        }
        let entry = self
            .tape
            .as_ref()?
            .approvals
            .iter()
            .find(|a| a.call == call)?;
        Some(match &entry.outcome {
            ApprovalOutcome::Approved { edited } => Ok(edited.clone()),
            ApprovalOutcome::Refused { message } => Err(message.clone()),
        })
    }

    /// Whether the job takes in its recording's steering, not what comes
    /// live (until a fork).
    pub fn serves_steering(&self) -> bool {
        !self.forked()
    }

    /// The steering the job took in at `turn` in the recording.
    pub fn steering(&self, turn: u32) -> Vec<SteeringMessage> {
        self.tape
            .iter()
            .flat_map(|t| &t.steering)
            .filter(|s| s.turn == turn)
            .flat_map(|s| s.messages.iter().cloned())
            .collect()
    }

    fn call(&self, at: usize) -> Option<&ModelExchange> {
        self.tape.as_ref().and_then(|t| t.calls.get(at))
    }
}

/// A replaying job's model: its calls are answered from the recording.
/// One per model the recorded job called: its own, and each fallback it
/// moved to (I-55), all reading the one recording in order.
pub struct TapeModel {
    job: Arc<JobReplay>,
    /// Which fallback this is; None: the job's own model.
    fallback: Option<String>,
}

impl TapeModel {
    pub fn new(job: Arc<JobReplay>) -> Self {
        Self {
            job,
            fallback: None,
        }
    }

    /// The models the recorded job moved to, in the order it moved, each
    /// with its name: a replay's fallbacks are exactly those.
    pub fn fallbacks(job: &Arc<JobReplay>) -> Vec<(String, Self)> {
        let mut names: Vec<&String> = vec![];
        for call in job.tape.iter().flat_map(|t| &t.calls) {
            if let Some(name) = &call.fallback
                && !names.contains(&name)
            {
                names.push(name);
            }
        }
        names
            .into_iter()
            .map(|name| {
                let model = Self {
                    job: job.clone(),
                    fallback: Some(name.clone()),
                };
                (name.clone(), model)
            })
            .collect()
    }

    fn model_ref(&self) -> &str {
        self.fallback.as_deref().unwrap_or(&self.job.model_ref)
    }
}

impl Model for TapeModel {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        let job = &self.job;
        let live = job.live.as_ref().map(|m| m.count_input(request));
        if job.forked() {
            return live.unwrap_or_else(|| estimate_tokens(request));
        }
        let at = job.counts.fetch_add(1, Ordering::AcqRel);
        let recorded = job
            .tape
            .as_ref()
            .and_then(|t| t.counts.get(at).copied())
            .unwrap_or_else(|| estimate_tokens(request));
        // A fork reserves what its live call may cost too (I-11).
        recorded.max(live.unwrap_or(0))
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        let job = &self.job;
        match &job.live {
            Some(live) if job.forked() => live.estimate_prompt(request),
            _ => {
                let at = job.estimates.fetch_add(1, Ordering::AcqRel);
                job.tape
                    .as_ref()
                    .and_then(|t| t.estimates.get(at).copied())
                    .unwrap_or_else(|| estimate_tokens(request))
            }
        }
    }

    fn info(&self) -> ModelInfo {
        let job = &self.job;
        if let Some(live) = job.live.as_ref().filter(|_| job.forked()) {
            return live.info();
        }
        let at = job.calls.load(Ordering::Acquire);
        match job.call(at).or_else(|| job.tape.as_ref()?.calls.last()) {
            Some(call) => model_info(&call.model),
            None => job
                .live
                .as_ref()
                .map_or_else(ModelInfo::scripted, |m| m.info()),
        }
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        let job = &self.job;
        if let Some(live) = job.live.as_ref().filter(|_| job.forked()) {
            return live.complete(request);
        }
        let at = job.calls.fetch_add(1, Ordering::AcqRel);
        let what = match job.call(at) {
            None if job.tape.is_none() => "the job is not in the recording".to_string(),
            None => format!(
                "call {} is not in the recording (it has {})",
                at + 1,
                job.tape.as_ref().map_or(0, |t| t.calls.len())
            ),
            Some(recorded) => {
                let replayed = canonical(self.model_ref(), &job.volatile, &request);
                if replayed.digest == recorded.digest {
                    return answer(recorded, &request.meter);
                }
                format!(
                    "call {}: {}",
                    at + 1,
                    first_difference(&recorded.parts, &replayed.parts)
                )
            }
        };
        match job.diverge(what) {
            Some(why) => {
                futures::future::ready(Err(ModelError::new(ErrorClass::Diverged, why))).boxed()
            }
            None => match &job.live {
                Some(live) => live.complete(request),
                None => futures::future::ready(Err(ModelError::new(
                    ErrorClass::Diverged,
                    "no live model to go on with",
                )))
                .boxed(),
            },
        }
    }
}

/// The recorded answer, its meter's steps told again first, so that a call
/// cut short is charged as it was.
fn answer(
    recorded: &ModelExchange,
    meter: &CallMeter,
) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
    meter.replay(&recorded.meter);
    let result = match &recorded.outcome {
        CallOutcome::Answer {
            text,
            calls,
            usage,
            truncated,
        } => Ok(ModelReply {
            text: text.clone(),
            thinking: vec![],
            calls: calls
                .iter()
                .map(|c| ToolCall {
                    id: c.id.clone(),
                    tool: c.tool.clone(),
                    args: c.args.clone(),
                })
                .collect(),
            usage: *usage,
            truncated: *truncated,
        }),
        CallOutcome::Error {
            class,
            message,
            retry_after_ms,
        } => Err(ModelError {
            class: *class,
            message: message.clone(),
            retry_after: retry_after_ms.map(Duration::from_millis),
        }),
        // A stop cut it short: it waits for the stop, which comes again
        // from where it came (its parent, its run's end), as it did then.
        CallOutcome::Cut => return futures::future::pending().boxed(),
    };
    futures::future::ready(result).boxed()
}

/// A run's recording as journaled, by lineage. An entry that does not
/// decode is an error naming it: a replay never runs on half a recording.
pub fn tape_of(records: Vec<TapeRecord>) -> Result<Tape, String> {
    let mut tape = Tape::new();
    for record in records {
        let entry: TapeEntry = serde_json::from_str(&record.entry_json).map_err(|e| {
            format!(
                "entry {} of kind {} of job {} ({}) does not decode: {e}",
                record.index, record.kind, record.job, record.lineage
            )
        })?;
        entry.add_to(tape.entry(record.lineage).or_default());
    }
    Ok(tape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stripped_and_nothing_else() {
        let text = "job 0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b ended; 0190a1b2 is not one";
        assert_eq!(strip_ids(text), "job <id> ended; 0190a1b2 is not one");
        assert!(matches!(
            strip_ids("no ids here"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            strip_ids("ü0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5bü"),
            "ü<id>ü",
            "multi-byte neighbours"
        );
    }

    fn request(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            input_estimate: 0,
            agent: "a".into(),
            system: "be brief".into(),
            messages,
            tools: Arc::from([]),
            max_output_tokens: 100,
            wind_down: None,
            settings: Default::default(),
            turn: 0,
            meter: CallMeter::default(),
        }
    }

    /// I-49: a replay compares the settings a request was sent with; a
    /// request with none has the digest it had before settings existed.
    #[test]
    fn settings_are_a_part_only_when_set() {
        let plain = request(vec![Message::User("a".into())]);
        let without = canonical("m", &Volatile::default(), &plain);
        assert!(without.parts.iter().all(|p| p.name != "settings"));
        let mut warm = plain.clone();
        warm.settings = arbor_protocol::Settings::from_figures(Some(0.7), None, None).unwrap();
        let mut cold = plain;
        cold.settings = arbor_protocol::Settings::from_figures(Some(0.0), None, None).unwrap();
        let (warm, cold) = (
            canonical("m", &Volatile::default(), &warm),
            canonical("m", &Volatile::default(), &cold),
        );
        assert_ne!(warm.digest, cold.digest);
        assert_eq!(
            first_difference(&warm.parts, &cold.parts),
            "settings differs"
        );
    }

    #[test]
    fn the_first_differing_part_is_named() {
        let old = canonical(
            "scripted",
            &Volatile::default(),
            &request(vec![Message::User("a".into()), Message::User("b".into())]),
        );
        let same = canonical(
            "scripted",
            &Volatile::default(),
            &request(vec![Message::User("a".into()), Message::User("b".into())]),
        );
        assert_eq!(old, same);
        let new = canonical(
            "scripted",
            &Volatile::default(),
            &request(vec![Message::User("a".into()), Message::User("c".into())]),
        );
        assert_ne!(old.digest, new.digest);
        assert_eq!(
            first_difference(&old.parts, &new.parts),
            "messages[1] (user) differs"
        );
        let longer = canonical(
            "scripted",
            &Volatile::default(),
            &request(vec![
                Message::User("a".into()),
                Message::User("b".into()),
                Message::User("d".into()),
            ]),
        );
        assert!(
            first_difference(&old.parts, &longer.parts)
                .starts_with("messages[2] (user) is not in the recording")
        );
        let other_model = canonical("openai/gpt", &Volatile::default(), &request(vec![]));
        let scripted = canonical("scripted", &Volatile::default(), &request(vec![]));
        assert_eq!(
            first_difference(&scripted.parts, &other_model.parts),
            "model differs"
        );
    }
}
