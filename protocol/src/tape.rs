//! A run's recording: what its models answered and its tools returned, job
//! by job, so the run can be replayed (I-49) and exported as a fixture.
//!
//! A job is named by its lineage, never by its id: the labels and attempts
//! from the root (`research#1/worker-2#1`), which a replay gives the same
//! job whatever the schedule. Each of a job's entries is numbered within the
//! job: its model calls in the order it made them, and so on.
//!
//! Invariants:
//! 1. Nothing here holds a secret's value: the recorder cuts them from every
//!    string before it journals an entry (I-27).
//! 2. A request is kept as digests only, one per part, so a recording of a
//!    long history stays small and a divergence can still name its field.

use crate::{ErrorClass, RunId, RunSpec, TreeNode, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a replaying run replays, and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplaySpec {
    /// The recorded run.
    pub of: RunId,
    #[serde(default)]
    pub tools: ToolReplay,
    #[serde(default)]
    pub after_divergence: AfterDivergence,
    /// A rerun of a failed run: only the jobs of these lineages are served
    /// from the recording; the others run live from their start. None:
    /// every job is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reuse: Option<std::collections::BTreeSet<String>>,
}

/// Where a replay's exec, read_file and MCP results come from.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ToolReplay {
    /// From the recording: the replay sees the world the original saw.
    #[default]
    Recorded,
    /// Run for real.
    Live,
}

/// What a replay does at the first request that differs from its recording.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AfterDivergence {
    /// The run fails, naming the divergence.
    #[default]
    Fail,
    /// The job goes on against its configured model from there: a fork.
    Live,
}

/// One job's recording.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobTape {
    /// Its model calls, retries and compaction summaries included, in order.
    #[serde(default)]
    pub calls: Vec<ModelExchange>,
    /// The prompt-size estimates it was given (they decide compaction).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub estimates: Vec<u64>,
    /// Its exec, read_file and MCP results, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolExchange>,
    /// The steering messages it took in, with the turn that received them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steering: Vec<SteeringEntry>,
    /// What its model counted each prompt at, in order, a call the budget
    /// refused before it was sent included (what was reserved, I-11).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counts: Vec<u64>,
    /// The decisions on its calls that waited for a person (I-46).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<ApprovalEntry>,
}

/// A whole run's recording, by lineage.
pub type Tape = BTreeMap<String, JobTape>;

/// One entry, as the journal keeps it: under its job, its kind and its
/// number within the job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TapeEntry {
    Call(Box<ModelExchange>),
    Estimate(u64),
    Tool(ToolExchange),
    Steering(SteeringEntry),
    Count(u64),
    Approval(ApprovalEntry),
}

impl TapeEntry {
    /// The entry's kind, as its key orders it.
    pub fn kind(&self) -> u8 {
        match self {
            TapeEntry::Call(_) => 0,
            TapeEntry::Estimate(_) => 1,
            TapeEntry::Tool(_) => 2,
            TapeEntry::Steering(_) => 3,
            TapeEntry::Count(_) => 4,
            TapeEntry::Approval(_) => 5,
        }
    }

    /// Adds the entry to its job's tape, at its place.
    pub fn add_to(self, tape: &mut JobTape) {
        match self {
            TapeEntry::Call(call) => tape.calls.push(*call),
            TapeEntry::Estimate(estimate) => tape.estimates.push(estimate),
            TapeEntry::Tool(tool) => tape.tools.push(tool),
            TapeEntry::Steering(steering) => tape.steering.push(steering),
            TapeEntry::Count(count) => tape.counts.push(count),
            TapeEntry::Approval(approval) => tape.approvals.push(approval),
        }
    }
}

/// One model call: the request as digests, the model as it was configured,
/// what the adapter learned while it was in flight, and how it ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelExchange {
    /// The canonical request's digest (sha256, hex): model, system prompt,
    /// tools, parameters and messages, with ids stripped.
    pub digest: String,
    /// Each part of the canonical request and its digest, in order.
    pub parts: Vec<RequestPart>,
    /// What the adapter counted the prompt at (what was reserved, I-11).
    pub input_counted: u64,
    pub model: RecordedModel,
    /// The fallback it went to, as its agent names it (`provider/model`),
    /// once its own model's supply was walled (I-55); None: the job's model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// What the adapter reported while the call was in flight: a stream's
    /// chunk boundaries, its usage reports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub meter: Vec<MeterStep>,
    pub outcome: CallOutcome,
}

/// A named part of a request and its digest (16 hex digits).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RequestPart {
    pub name: String,
    pub digest: String,
}

/// The model a call went to, as its adapter described it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordedModel {
    pub provider: String,
    pub model: String,
    pub max_output_tokens: Option<u64>,
    pub context_window: Option<u64>,
    /// Pico-dollars per input and per output token; None: no price.
    pub price: Option<[u64; 2]>,
    pub max_retries: u32,
    pub retry_base_ms: u64,
    pub retry_cap_ms: u64,
    pub billed: bool,
    /// Its extended thinking (`thinking_tokens`), if its entry gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_tokens: Option<Box<crate::ThinkingTokens>>,
    /// Its entry's default `effort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_effort: Option<crate::Effort>,
}

/// One thing an adapter told the call's meter, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MeterStep {
    Sent,
    Refused,
    Usage {
        input: Option<u64>,
        output: Option<u64>,
    },
    /// A chunk of streamed answer, in bytes.
    Streamed(u64),
}

/// How a call ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallOutcome {
    Answer {
        text: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        calls: Vec<RecordedToolCall>,
        usage: Option<Usage>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        truncated: bool,
    },
    Error {
        class: ErrorClass,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
    /// A stop cut it short: it was charged what its meter says.
    Cut,
}

/// A tool call as the model asked for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordedToolCall {
    pub id: String,
    pub tool: String,
    pub args: serde_json::Value,
}

/// One exec, read_file or MCP call and what it returned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolExchange {
    pub tool: String,
    /// The arguments' digest (16 hex digits).
    pub args: String,
    pub ok: bool,
    pub content: String,
    /// The files a command changed, by workdir path, as it left them: a
    /// replay writes them again, so what is graded and listed as artifacts
    /// is there. A file that could not be read as text is left out.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
}

/// What came of a call that waited for a person: a replay applies it
/// without asking again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalEntry {
    /// The model's id for the call (what a replay finds it by).
    pub call: String,
    pub tool: String,
    pub outcome: ApprovalOutcome,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalOutcome {
    /// It ran, with a person's edited arguments if they gave some.
    Approved { edited: Option<serde_json::Value> },
    /// It did not run (rejected, expired, cancelled): what the model read.
    Refused { message: String },
}

/// Steering messages a job took in at the start of a turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SteeringEntry {
    pub turn: u32,
    pub messages: Vec<SteeringMessage>,
}

/// One steering message: its text, and whether its parent sent it (a
/// replay waits for the parent to send it again) or an operator did (a
/// replay delivers the recorded text).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SteeringMessage {
    pub text: String,
    pub from_parent: bool,
}

/// `text` with every uuid replaced by `<id>`: ids are new in every run, so
/// a request or a tree is compared without them.
pub fn strip_ids(text: &str) -> std::borrow::Cow<'_, str> {
    const SHAPE: [usize; 5] = [8, 4, 4, 4, 12];
    let bytes = text.as_bytes();
    let is_uuid_at = |at: usize| {
        let mut i = at;
        for (n, len) in SHAPE.iter().enumerate() {
            if n > 0 {
                if bytes.get(i) != Some(&b'-') {
                    return false;
                }
                i += 1;
            }
            for _ in 0..*len {
                if !bytes.get(i).is_some_and(u8::is_ascii_hexdigit) {
                    return false;
                }
                i += 1;
            }
        }
        true
    };
    let mut out: Option<String> = None;
    let mut copied = 0;
    let mut at = 0;
    while at + 36 <= bytes.len() {
        if bytes[at].is_ascii_hexdigit() && is_uuid_at(at) {
            let out = out.get_or_insert_with(|| String::with_capacity(text.len()));
            out.push_str(&text[copied..at]);
            out.push_str("<id>");
            at += 36;
            copied = at;
        } else {
            at += 1;
        }
    }
    match out {
        None => std::borrow::Cow::Borrowed(text),
        Some(mut out) => {
            out.push_str(&text[copied..]);
            std::borrow::Cow::Owned(out)
        }
    }
}

/// What of a tree a replay must reproduce (I-49): every node's kind, agent,
/// label, statuses, reasons, depth, attempt, accounts, output, error,
/// limitations, turns and tool counts, and its children in order. Ids and
/// times are left out, and ids are stripped from the words; so are
/// artifacts, which a command's recorded result does not write again
/// (docs/replay.md), and the events elided, which count what the timeline
/// dropped.
pub fn comparable(node: &TreeNode) -> serde_json::Value {
    let words = |text: &Option<String>| text.as_deref().map(|t| strip_ids(t).into_owned());
    serde_json::json!({
        "kind": node.kind,
        "agent": node.agent,
        "label": node.label,
        "status": node.status,
        "task_status": node.task_status,
        "reason": words(&node.reason),
        "error_class": node.error_class,
        "depth": node.depth,
        "attempt": node.attempt,
        "account": node.account,
        "usd": node.usd,
        "output": strip_ids(&node.output.to_string()),
        "error": words(&node.error),
        "limitations": node.limitations,
        "turns": node.turns,
        "tools": node.tools,
        "children": node.children.iter().map(comparable).collect::<Vec<_>>(),
    })
}

/// The event kinds a replay must reproduce, in order, for each job: those
/// of its own doing. An account's changes interleave with its children's
/// ends as they are scheduled, and a recorded tool result comes without
/// the events of running it (a refusal, a card, a server), so they are not
/// among them.
pub const COMPARED_EVENTS: [&str; 6] = [
    "job_spawned",
    "job_running",
    "model_called",
    "tool_called",
    "context_compacted",
    "job_finished",
];

/// `arbor export RUN`'s document, version 1 (docs/contract/recording.schema.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Export {
    /// Always `arbor-recording`.
    pub format: String,
    pub version: u32,
    /// The recorded run.
    pub run: RunId,
    pub spec: RunSpec,
    /// The digests of the definitions it ran with (`RunSpec::digests`).
    pub workspace: BTreeMap<String, String>,
    /// Every agent its steps and jobs were.
    pub agents: Vec<String>,
    pub tape: Tape,
    /// The run's final tree, as `arbor run --json` prints it.
    pub tree: TreeNode,
    /// Each job's events of `COMPARED_EVENTS`, in order, by lineage.
    pub events: BTreeMap<String, Vec<String>>,
    /// SHA-256 (hex) of the document's JSON without this member, its keys
    /// sorted and no whitespace.
    #[serde(default)]
    pub digest: String,
}

impl Export {
    pub const FORMAT: &str = "arbor-recording";
    pub const VERSION: u32 = 1;

    /// The document's JSON Schema (docs/contract/recording.schema.json).
    pub fn schema() -> serde_json::Value {
        let mut schema = serde_json::to_value(schemars::schema_for!(Export)).unwrap_or_default();
        if let Some(object) = schema.as_object_mut() {
            object.insert("$id".into(), "arbor/recording".into());
        }
        schema
    }
}
