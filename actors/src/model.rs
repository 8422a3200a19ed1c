//! What the agent loop asks of a model. Adapters (the scripted model, an
//! OpenAI-compatible client) live in `arbor-runtime`; the loop knows only this.

use arbor_protocol::{AgentDef, ErrorClass, ToolName, Usage};
use futures::future::BoxFuture;
use std::sync::Arc;

/// One request: the history so far and what the model may do with it.
#[derive(Clone, Debug)]
pub struct ModelRequest {
    pub agent: String,
    pub system: String,
    pub messages: Vec<Message>,
    pub tools: Vec<ToolName>,
    /// What the account can still cover (I-11); a provider cuts output to it.
    pub max_output_tokens: u64,
    /// I-12: the wind-down notice. Sent with this request only, never stored in the history.
    pub wind_down: Option<String>,
    /// 0 for the first call of a job.
    pub turn: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    User(String),
    Assistant {
        text: Option<String>,
        calls: Vec<ToolCall>,
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
            Message::Assistant { text, calls } => {
                text.as_ref().map_or(0, |t| t.len())
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
    pub usage: Usage,
    /// Output was cut at `max_output_tokens`.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct ModelError {
    pub class: ErrorClass,
    pub message: String,
}

/// A model an agent talks to. `count_input` is the prompt estimate that the
/// loop reserves before sending (I-11): it must not under-count.
pub trait Model: Send + Sync {
    fn count_input(&self, request: &ModelRequest) -> u64;
    fn complete(&self, request: ModelRequest)
    -> BoxFuture<'static, Result<ModelReply, ModelError>>;
}

/// Picks the model for an agent.
pub trait ModelFactory: Send + Sync {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String>;
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
