//! What the agent loop asks of a model. Adapters (the scripted model, the
//! OpenAI and Anthropic clients) live in `arbor-runtime`; the loop knows only this.
//!
//! Invariants an adapter keeps:
//! 1. `count_input` never counts fewer tokens than the provider will (I-11).
//!    An HTTP adapter counts the request body's bytes, which no byte-level BPE
//!    tokenizer can exceed.
//! 2. `complete` makes at most one request. Retries are the loop's, so each
//!    attempt is reserved before it is sent.
//! 3. What the adapter learns while a call is in flight (that it was sent,
//!    usage the provider reported, bytes streamed) goes into the request's
//!    `CallMeter`, so a call that is stopped half-way is still charged.

use arbor_protocol::tape::MeterStep;
use arbor_protocol::{AgentDef, ErrorClass, ToolName, Usage};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// One request: the history so far and what the model may do with it.
#[derive(Clone, Debug)]
pub struct ModelRequest {
    pub agent: String,
    pub system: String,
    pub messages: Vec<Message>,
    /// What the model may call, made once per job (`ToolSpec`).
    pub tools: Arc<[ToolSpec]>,
    /// What the account can still cover (I-11); a provider cuts output to it.
    pub max_output_tokens: u64,
    /// Its prompt's tokens as its reservation counted them (`count_input`);
    /// 0 if it was not counted.
    pub input_estimate: u64,
    /// I-12: the wind-down notice. Sent with this request only, never stored in the history.
    pub wind_down: Option<String>,
    /// The agent's sampling and reasoning settings (a provider's model
    /// entry fills what it leaves unset).
    pub settings: arbor_protocol::Settings,
    /// 0 for the first call of a job.
    pub turn: u32,
    /// Filled by the adapter while the call is in flight.
    pub meter: CallMeter,
}

/// One tool as a model is shown it: its name, what it does, and the JSON
/// Schema of its arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: Arc<str>,
    pub description: Arc<str>,
    pub parameters: Arc<serde_json::Value>,
}

impl ToolSpec {
    /// A built-in tool, as `ToolName` describes it: made once per process,
    /// so a job's list costs a few reference counts.
    pub fn builtin(tool: ToolName) -> Self {
        static SPECS: std::sync::OnceLock<Vec<ToolSpec>> = std::sync::OnceLock::new();
        let specs = SPECS.get_or_init(|| {
            ToolName::ALL
                .iter()
                .map(|t| ToolSpec {
                    name: t.as_str().into(),
                    description: t.description().into(),
                    parameters: Arc::new(t.parameters().clone()),
                })
                .collect()
        });
        // `ALL` is the enum's own variant list, in declaration order.
        specs[tool as usize].clone()
    }
}

impl From<ToolName> for ToolSpec {
    fn from(tool: ToolName) -> Self {
        ToolSpec::builtin(tool)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    User(String),
    Assistant {
        text: Option<String>,
        calls: Vec<ToolCall>,
        /// The provider's thinking blocks of this turn (Anthropic's extended
        /// thinking), sent back unchanged with it; empty for most.
        thinking: Vec<serde_json::Value>,
    },
    ToolResult {
        call_id: String,
        content: String,
        is_error: bool,
    },
}

impl Message {
    pub fn text_len(&self) -> usize {
        match self {
            Message::User(t) => t.len(),
            Message::Assistant {
                text,
                calls,
                thinking,
            } => {
                thinking.iter().map(|b| b.to_string().len()).sum::<usize>()
                    + text.as_ref().map_or(0, |t| t.len())
                    + calls
                        .iter()
                        .map(|c| c.tool.len() + c.args.to_string().len())
                        .sum::<usize>()
            }
            Message::ToolResult { content, .. } => content.len(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub tool: String,
    pub args: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelReply {
    pub text: Option<String>,
    pub calls: Vec<ToolCall>,
    /// Thinking blocks to send back with this turn (`Message::Assistant`).
    pub thinking: Vec<serde_json::Value>,
    /// What the provider reported it counted; None when it reported nothing
    /// (the loop then charges the call's whole reservation).
    pub usage: Option<Usage>,
    /// Output was cut at `max_output_tokens`.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct ModelError {
    pub class: ErrorClass,
    pub message: String,
    /// The provider asked to wait this long before the next attempt (Retry-After).
    pub retry_after: Option<Duration>,
}

impl ModelError {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
            retry_after: None,
        }
    }
}

/// Prices in pico-dollars per token, so that a price such as $0.075 per
/// million tokens is a whole number (75,000). Micro-dollars come from them by
/// rounding up, per call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Price {
    pub input_picos_per_token: u64,
    pub output_picos_per_token: u64,
}

impl Price {
    /// The cost of a call in micro-dollars, rounded up: never under-charged.
    pub fn micros(&self, input_tokens: u64, output_tokens: u64) -> u64 {
        let picos = u128::from(input_tokens) * u128::from(self.input_picos_per_token)
            + u128::from(output_tokens) * u128::from(self.output_picos_per_token);
        u64::try_from(picos.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    /// The most output tokens a call with this input can have and still
    /// cost at most `micros`.
    pub fn max_output_within(&self, input_tokens: u64, micros: u64) -> u64 {
        let budget = u128::from(micros) * 1_000_000;
        let input = u128::from(input_tokens) * u128::from(self.input_picos_per_token);
        if self.output_picos_per_token == 0 {
            return if input <= budget { u64::MAX } else { 0 };
        }
        let left = budget.saturating_sub(input);
        u64::try_from(left / u128::from(self.output_picos_per_token)).unwrap_or(u64::MAX)
    }
}

/// How the loop retries a call that failed transiently (rate limit, overload,
/// a server error, a timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts after the first; 0 never retries.
    pub max_retries: u32,
    /// The first backoff; each later one doubles, with full jitter.
    pub base: Duration,
    /// No backoff is longer, and a Retry-After longer than this is cut to it.
    pub cap: Duration,
}

impl RetryPolicy {
    pub const NONE: RetryPolicy = RetryPolicy {
        max_retries: 0,
        base: Duration::ZERO,
        cap: Duration::ZERO,
    };

    /// The pause before retry number `retry` (0 for the first retry):
    /// the provider's Retry-After when it gave one, else exponential with
    /// full jitter (`jitter` in [0, 1)), never above `cap`.
    pub fn backoff(&self, retry: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(self.cap);
        }
        let exp = self
            .base
            .saturating_mul(2u32.saturating_pow(retry.min(16)))
            .min(self.cap);
        exp.mul_f64(jitter.clamp(0.0, 1.0))
    }
}

/// Who a model is, for events, traces and the budget rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// The provider's name in arbor.toml, or `scripted`.
    pub provider: String,
    /// The account it draws on: its provider's `supply`, else the
    /// provider's name. A fallback never stays on a walled supply (I-55).
    pub supply: String,
    /// The model as the provider calls it.
    pub model: String,
    /// The most output tokens one call may ask for.
    pub max_output_tokens: Option<u64>,
    /// The model's context window in tokens, if it has one to respect.
    pub context_window: Option<u64>,
    /// None: no price is configured (a usd ceiling cannot be kept on it).
    pub price: Option<Price>,
    pub retry: RetryPolicy,
    /// Its provider bills what it receives, so a call a crash cut short is
    /// charged in full at recovery (the scripted model bills nothing).
    pub billed: bool,
    /// Anthropic's extended thinking: the budget at each effort, counted in
    /// a call's reservation as output.
    pub thinking_tokens: Option<arbor_protocol::ThinkingTokens>,
    /// Its entry's `effort`, for an agent that does not say.
    pub default_effort: Option<arbor_protocol::Effort>,
}

impl ModelInfo {
    pub fn scripted() -> Self {
        Self {
            provider: "scripted".into(),
            supply: "scripted".into(),
            model: "scripted".into(),
            max_output_tokens: None,
            context_window: None,
            // The scripted model costs nothing.
            price: Some(Price::default()),
            retry: RetryPolicy::NONE,
            billed: false,
            thinking_tokens: None,
            default_effort: None,
        }
    }

    /// The tokens a call made with `settings` may think with, beside its
    /// answer: the thinking budget at its effort, 0 for a model that does
    /// not think apart.
    pub fn thinking_budget(&self, settings: arbor_protocol::Settings) -> u64 {
        match (
            self.thinking_tokens,
            settings.effort.or(self.default_effort),
        ) {
            (Some(tokens), Some(effort)) => tokens.at(effort),
            _ => 0,
        }
    }
}

/// A model an agent talks to. `count_input` is the prompt bound that the
/// loop reserves before sending (I-11): it must not under-count.
pub trait Model: Send + Sync {
    fn count_input(&self, request: &ModelRequest) -> u64;
    fn complete(&self, request: ModelRequest)
    -> BoxFuture<'static, Result<ModelReply, ModelError>>;
    fn info(&self) -> ModelInfo {
        ModelInfo::scripted()
    }
    /// A realistic size of the prompt in tokens, to keep it within the
    /// context window (`count_input` is the bound that is reserved).
    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        estimate_tokens(request)
    }
}

/// The model a job's calls go to, and the models they move to, in order,
/// when its supply is walled (I-55: its agent's `fallback`, each among
/// the models it allows, checked at load).
/// Each model with its name as agent.md writes it (`provider/model`).
pub struct ModelChain {
    current: std::sync::Mutex<(String, Arc<dyn Model>)>,
    fallbacks: std::sync::Mutex<std::collections::VecDeque<(String, Arc<dyn Model>)>>,
}

impl ModelChain {
    pub fn new(model: (String, Arc<dyn Model>), fallbacks: Vec<(String, Arc<dyn Model>)>) -> Self {
        Self {
            current: std::sync::Mutex::new(model),
            fallbacks: std::sync::Mutex::new(fallbacks.into()),
        }
    }

    /// The model a call goes to now, and its name.
    pub fn current_named(&self) -> (String, Arc<dyn Model>) {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The model a call goes to now.
    pub fn current(&self) -> Arc<dyn Model> {
        self.current_named().1
    }

    /// Moves on to the next fallback on none of the `walled` supplies (those
    /// passed over are dropped: their supply is walled too, or they come
    /// before); the model moved to and its name, or None when none is left.
    pub fn fall_back(&self, walled: &[String]) -> Option<(String, Arc<dyn Model>)> {
        let mut fallbacks = self.fallbacks.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(next) = fallbacks.pop_front() {
            if !walled.contains(&next.1.info().supply) {
                *self.current.lock().unwrap_or_else(|p| p.into_inner()) = next.clone();
                return Some(next);
            }
        }
        None
    }
}

/// Picks the model for an agent.
pub trait ModelFactory: Send + Sync {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String>;

    /// Checked for every agent a run can reach before the run starts, so a
    /// run that could not get its models is refused whole (a provider's key
    /// variable unset, say) rather than failing half-way.
    fn preflight(&self, agent: &AgentDef) -> Result<(), String> {
        let _ = agent;
        Ok(())
    }

    /// The model a replaying job talks to: `recording`, which answers from
    /// the run's recording. A factory may wrap it (a test that varies the
    /// schedule does), never replace it.
    fn replaying(&self, agent: &AgentDef, recording: Arc<dyn Model>) -> Arc<dyn Model> {
        let _ = agent;
        recording
    }

    /// Its rate windows (a provider's `rpm`, `tpm`) and what they hold now.
    fn limits(&self) -> Vec<arbor_protocol::RateView> {
        vec![]
    }

    /// The node's journal: if it is shared with other nodes (PostgreSQL),
    /// its rate windows must be every node's from now on.
    fn share_rates(&self, journal: &arbor_storage::Journal) {
        let _ = journal;
    }
}

/// What an adapter learned of one call while it was in flight, shared with
/// the loop so that a call stopped half-way is charged what it cost (I-16:
/// nothing of its answer is kept, but its spend is).
#[derive(Clone, Debug, Default)]
pub struct CallMeter(Arc<MeterInner>);

#[derive(Debug, Default)]
struct MeterInner {
    sent: AtomicBool,
    usage_reported: AtomicBool,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    streamed_bytes: AtomicU64,
    /// Woken at each change, for whoever watches a call (a test).
    changed: tokio::sync::Notify,
    /// Set by a recorder: every step is then kept, in order (`MeterStep`).
    logging: AtomicBool,
    log: std::sync::Mutex<Vec<MeterStep>>,
}

impl CallMeter {
    /// From now on every step is kept, for a recording.
    pub fn keep_log(&self) {
        self.0.logging.store(true, Ordering::Release);
    }

    /// The steps kept since `keep_log`.
    pub fn log(&self) -> Vec<MeterStep> {
        self.0.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn note(&self, step: MeterStep) {
        if self.0.logging.load(Ordering::Acquire) {
            self.0
                .log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(step);
        }
    }

    /// Tells the meter what a recording says it was told, in order.
    pub fn replay(&self, steps: &[MeterStep]) {
        for step in steps {
            match *step {
                MeterStep::Sent => self.mark_sent(),
                MeterStep::Refused => self.mark_refused(),
                MeterStep::Usage { input, output } => self.report_usage(input, output),
                MeterStep::Streamed(bytes) => self.add_streamed(bytes),
            }
        }
    }

    /// The request left for the provider: from now on it may be billed.
    pub fn mark_sent(&self) {
        self.note(MeterStep::Sent);
        self.0.sent.store(true, Ordering::Release);
    }

    /// The provider answered with an error status before generating
    /// anything: such a request is not billed.
    pub fn mark_refused(&self) {
        self.note(MeterStep::Refused);
        self.0.sent.store(false, Ordering::Release);
    }

    /// Usage the provider reported so far (a stream's first or last event).
    pub fn report_usage(&self, input_tokens: Option<u64>, output_tokens: Option<u64>) {
        self.note(MeterStep::Usage {
            input: input_tokens,
            output: output_tokens,
        });
        if let Some(input) = input_tokens {
            self.0.input_tokens.fetch_max(input, Ordering::AcqRel);
        }
        if let Some(output) = output_tokens {
            self.0.output_tokens.fetch_max(output, Ordering::AcqRel);
        }
        self.0.usage_reported.store(true, Ordering::Release);
        self.0.changed.notify_waiters();
    }

    /// Bytes of answer streamed so far.
    pub fn add_streamed(&self, bytes: u64) {
        self.note(MeterStep::Streamed(bytes));
        self.0.streamed_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }

    /// Bytes of answer streamed so far.
    pub fn streamed_bytes(&self) -> u64 {
        self.0.streamed_bytes.load(Ordering::Acquire)
    }

    /// Waits until at least `bytes` of answer have streamed.
    pub async fn streamed_at_least(&self, bytes: u64) {
        loop {
            let changed = self.0.changed.notified();
            if self.streamed_bytes() >= bytes {
                return;
            }
            changed.await;
        }
    }

    /// What a call cut short is charged, never less than it may have cost:
    /// nothing if no request was sent; if the provider reported usage, that
    /// plus the streamed output (one token per byte at most, and no more
    /// than the call's max output); otherwise its whole reservation.
    pub fn charge_when_cut(&self, input_reserved: u64, max_output: u64) -> Usage {
        let m = &self.0;
        if !m.sent.load(Ordering::Acquire) {
            return Usage::default();
        }
        if !m.usage_reported.load(Ordering::Acquire) {
            return Usage {
                input_tokens: input_reserved,
                output_tokens: max_output,
            };
        }
        let input = m.input_tokens.load(Ordering::Acquire);
        let streamed = m.streamed_bytes.load(Ordering::Acquire).min(max_output);
        Usage {
            input_tokens: if input == 0 { input_reserved } else { input },
            output_tokens: m.output_tokens.load(Ordering::Acquire).max(streamed),
        }
    }
}

/// A prompt-size estimate for adapters without a tokenizer: one token per
/// three bytes, rounded up, plus a per-message overhead. Generous on purpose.
pub fn estimate_tokens(request: &ModelRequest) -> u64 {
    let bytes: usize = request.system.len()
        + request
            .messages
            .iter()
            .map(Message::text_len)
            .sum::<usize>();
    (bytes as u64).div_ceil(3) + 4 * (request.messages.len() as u64 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_round_up_to_the_next_micro_dollar() {
        // $0.15 and $0.60 per million tokens.
        let price = Price {
            input_picos_per_token: 150_000,
            output_picos_per_token: 600_000,
        };
        assert_eq!(price.micros(1_000_000, 0), 150_000);
        assert_eq!(price.micros(1, 0), 1, "a fraction of a micro-dollar is one");
        assert_eq!(price.micros(10, 10), 8, "1.5 + 6 = 7.5, rounded up");
        assert_eq!(price.micros(0, 0), 0);
        assert_eq!(Price::default().micros(u64::MAX, u64::MAX), 0);
    }

    #[test]
    fn a_cut_call_is_charged_what_it_may_have_cost() {
        let meter = CallMeter::default();
        assert_eq!(
            meter.charge_when_cut(100, 50),
            Usage::default(),
            "never sent"
        );
        meter.mark_sent();
        assert_eq!(
            meter.charge_when_cut(100, 50),
            Usage {
                input_tokens: 100,
                output_tokens: 50
            },
            "sent, nothing reported: the reservation"
        );
        meter.report_usage(Some(80), Some(1));
        meter.add_streamed(12);
        assert_eq!(
            meter.charge_when_cut(100, 50),
            Usage {
                input_tokens: 80,
                output_tokens: 12
            },
            "reported input, streamed output"
        );
        meter.add_streamed(1000);
        assert_eq!(meter.charge_when_cut(100, 50).output_tokens, 50);
    }

    #[test]
    fn backoff_honours_retry_after_and_caps_and_doubles() {
        let policy = RetryPolicy {
            max_retries: 3,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
        };
        assert_eq!(
            policy.backoff(0, Some(Duration::from_secs(1)), 0.5),
            Duration::from_secs(1)
        );
        assert_eq!(
            policy.backoff(0, Some(Duration::from_secs(60)), 0.5),
            Duration::from_secs(2)
        );
        assert_eq!(
            policy.backoff(0, None, 0.999),
            Duration::from_micros(99_900)
        );
        assert_eq!(policy.backoff(3, None, 0.5), Duration::from_millis(400));
        assert_eq!(policy.backoff(10, None, 0.5), Duration::from_secs(1));
    }
}
