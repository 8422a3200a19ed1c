//! Approval cards (I-46, I-47): a gated tool call staged for a person, and
//! what became of it. The card is the unit of the one queue
//! (`GET /v1/approvals`); `[approvals]` of arbor.toml says how long a card
//! waits and when its warning comes.

use crate::ids::{CardId, JobId, RunId};
use crate::mcp::{McpPattern, name_matches};
use crate::tools::ToolName;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How long a card waits for a person when arbor.toml does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);
/// The share of its wait after which a card warns (`approval_expiring`).
pub const DEFAULT_WARN_AT: f64 = 0.8;

/// Where a card is. `Pending` is the only state that changes; each of the
/// others is its one outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CardState {
    Pending,
    /// A person said yes (perhaps with edited arguments); the tool may run.
    Approved,
    /// A person said no, with a reason the model reads.
    Rejected,
    /// Nobody decided by the deadline: not a rejection, and the tool did not run.
    Expired,
    /// Its job or run was stopped, or ended, while it waited: a stop wins.
    Cancelled,
    /// A person answered the question (`Decision::answer`).
    Answered,
    /// A call of a tool its agent's `approve:` entry gates in `notify`
    /// mode: it ran at once, and this card, decided as it was made,
    /// records it (`Card::result`, `Card::undo`).
    Ran,
}

/// What a card asks of a person.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum CardKind {
    /// A gated tool call: approve (perhaps with edited arguments) or reject.
    #[default]
    Call,
    /// An agent's `ask_person`: answer it (one of its choices, if it gives
    /// some), or reject it with a reason.
    Question,
    /// A flow step that waits for a go-ahead before it starts.
    Step,
}

/// A step card's `tool`.
pub const STEP_TOOL: &str = "step";

impl CardKind {
    /// A card's kind follows from its tool: `ask_person` asks a question,
    /// `step` a step's go-ahead (neither is a tool a call card may gate).
    pub fn of_tool(tool: &str) -> Self {
        match tool {
            "ask_person" => CardKind::Question,
            STEP_TOOL => CardKind::Step,
            _ => CardKind::Call,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CardKind::Call => "call",
            CardKind::Question => "question",
            CardKind::Step => "step",
        }
    }
}

impl CardState {
    pub fn as_str(self) -> &'static str {
        match self {
            CardState::Pending => "pending",
            CardState::Approved => "approved",
            CardState::Rejected => "rejected",
            CardState::Expired => "expired",
            CardState::Cancelled => "cancelled",
            CardState::Answered => "answered",
            CardState::Ran => "ran",
        }
    }

    pub fn is_pending(self) -> bool {
        self == CardState::Pending
    }
}

impl std::fmt::Display for CardState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CardState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pending" => Ok(CardState::Pending),
            "approved" => Ok(CardState::Approved),
            "rejected" => Ok(CardState::Rejected),
            "expired" => Ok(CardState::Expired),
            "cancelled" => Ok(CardState::Cancelled),
            "answered" => Ok(CardState::Answered),
            other => Err(format!(
                "unknown card state {other:?}: pending, approved, rejected, expired, cancelled \
                 or answered"
            )),
        }
    }
}

/// What a person decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Approve,
    Reject,
    /// Approve with other arguments (`args`), checked against the tool's
    /// schema and the policy before anything is committed.
    Edit,
    /// Answer a question (`answer`).
    Answer,
}

/// Who closed a card, how and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Decision {
    /// The name of the API token that decided; `arbor` for the node itself
    /// (an expiry, a stop).
    pub by: String,
    pub reason: Option<String>,
    pub at_ms: u64,
    /// Whether the person changed the arguments (`args` are then the edited ones).
    pub edited: bool,
    /// A question's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// One gated call, staged. It is in the journal before anyone can see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Card {
    pub id: CardId,
    /// What it asks: a call's approval, a question's answer, a step's go-ahead.
    #[serde(default)]
    pub kind: CardKind,
    pub run: RunId,
    pub job: JobId,
    /// Labels from the root: the step's, then each delegated child's.
    pub lineage: Vec<String>,
    pub agent: String,
    /// The canonical tool name (`exec`, `mcp__github__merge`; `ask_person`
    /// for a question; for a step, `step`).
    pub tool: String,
    /// The model's id for the call.
    pub call: String,
    /// The arguments, secrets redacted and long strings clipped; after an
    /// edit, the edited arguments. A question's are `{question, choices}`;
    /// a step's `{label, agent, instruction}`.
    pub args: serde_json::Value,
    pub state: CardState,
    pub asked_at_ms: u64,
    pub deadline_ms: u64,
    /// Set once a card is decided, expired or cancelled.
    pub decision: Option<Decision>,
    /// A `ran` card's: what the call returned (or its error), secrets
    /// redacted and clipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// A `ran` card's: how an operator undoes the call, as its `approve:`
    /// entry says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<String>,
}

/// How an `approve:` entry gates its tool.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ApproveMode {
    /// The call waits for a person's decision.
    #[default]
    Ask,
    /// The call runs at once; a card decided `ran` records it.
    Notify,
}

/// One entry of agent.md's `approve:`: a tool name or pattern, as a string,
/// or `{tool, timeout, mode, undo}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, schemars::JsonSchema)]
pub struct ApproveEntry {
    /// A tool name or pattern (`mcp__pay__*`).
    pub tool: String,
    /// This tool's wait, instead of `[approvals] timeout` (ask mode).
    #[serde(
        default,
        with = "crate::duration_str::serde_humantime_opt",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub timeout: Option<Duration>,
    #[serde(default)]
    pub mode: ApproveMode,
    /// For notify: how an operator undoes the call, shown on its card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<String>,
}

impl ApproveEntry {
    /// An ask entry for `tool`, with the node's wait.
    pub fn ask(tool: impl Into<String>) -> Self {
        Self {
            tool: tool.into(),
            timeout: None,
            mode: ApproveMode::Ask,
            undo: None,
        }
    }

    /// Why the entry is refused, if it is: in words that name the key.
    pub fn check(&self) -> Result<(), String> {
        if self.tool.trim().is_empty() {
            return Err("approve: an entry names no tool".into());
        }
        if let Some(timeout) = self.timeout
            && (timeout.is_zero() || timeout > Duration::from_secs(30 * 86_400))
        {
            return Err(format!(
                "approve: {}: timeout must be more than 0 and at most 30 days",
                self.tool
            ));
        }
        match self.mode {
            ApproveMode::Ask if self.undo.is_some() => Err(format!(
                "approve: {}: undo is for mode notify (a call that runs at once); an ask \
                 entry's call waits for a person instead",
                self.tool
            )),
            ApproveMode::Notify if self.timeout.is_some() => Err(format!(
                "approve: {}: timeout is for mode ask; a notify entry's call does not wait",
                self.tool
            )),
            ApproveMode::Notify if self.tool == "ask_person" => {
                Err("approve: ask_person cannot be notify: a question waits for its answer".into())
            }
            _ => Ok(()),
        }
    }
}

impl From<&str> for ApproveEntry {
    fn from(tool: &str) -> Self {
        ApproveEntry::ask(tool)
    }
}

impl<'de> Deserialize<'de> for ApproveEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// The object form, whose unknown keys are refused by name.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            tool: String,
            #[serde(default, with = "crate::duration_str::serde_humantime_opt")]
            timeout: Option<Duration>,
            #[serde(default)]
            mode: ApproveMode,
            #[serde(default)]
            undo: Option<String>,
        }
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ApproveEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a tool name or pattern, or {tool, timeout, mode, undo}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ApproveEntry, E> {
                Ok(ApproveEntry::ask(v))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<ApproveEntry, A::Error> {
                let full = Full::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(ApproveEntry {
                    tool: full.tool,
                    timeout: full.timeout,
                    mode: full.mode,
                    undo: full.undo,
                })
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// `[approvals]` of arbor.toml.
#[derive(Clone, Debug, PartialEq)]
pub struct ApprovalSettings {
    /// Tools every agent of the node asks for (unioned with agent.md's `approve`).
    pub tools: Vec<String>,
    /// How long a card waits.
    pub timeout: Duration,
    /// The share of `timeout` after which `approval_expiring` is told.
    pub warn_at: f64,
}

impl Default for ApprovalSettings {
    fn default() -> Self {
        Self {
            tools: vec![],
            timeout: DEFAULT_TIMEOUT,
            warn_at: DEFAULT_WARN_AT,
        }
    }
}

/// Checks an `approve` entry: a tool a person can be asked about (any
/// built-in but `submit_output`, which must always stay open) or an MCP
/// tool or pattern. An entry that matched nothing would gate nothing, so a
/// misspelt one is an error, not a silent allow.
pub fn check_approve_entry(entry: &str) -> Result<(), String> {
    if let Some(pattern) = McpPattern::parse(entry) {
        return pattern.map(|_| ());
    }
    match entry.parse::<ToolName>() {
        Ok(ToolName::SubmitOutput) => Err(
            "submit_output cannot wait for a person: an agent must always be able to answer".into(),
        ),
        Ok(ToolName::AskPerson) => {
            Err("ask_person already waits for a person: its question is the card".into())
        }
        Ok(_) => Ok(()),
        Err(_) => Err(format!(
            "{entry:?} is not a tool: name a built-in tool (exec, write_file, delegate, ...) \
             or an MCP tool (mcp__SERVER__TOOL, mcp__SERVER__*)"
        )),
    }
}

/// Whether any of `entries` (names or `*` patterns) covers `tool`.
pub fn covers(entries: &std::collections::BTreeSet<String>, tool: &str) -> bool {
    entries.iter().any(|e| name_matches(e, tool))
}

/// A question card's choices (its `args.choices`), none when it takes any answer.
pub fn question_choices(args: &serde_json::Value) -> Vec<&str> {
    args.get("choices")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str())
        .collect()
}

/// Milliseconds since the epoch as RFC 3339, for people.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}
