//! What the loop is given, what it asks its job, and how it ends: the
//! words the loop's parts and its job share (a leaf: it names no other
//! part of the loop).

use crate::account::AccountMsg;
use crate::context::NodeContext;
use crate::model::{CallMeter, ModelInfo};
use crate::policy::Policy;
use crate::sandbox::SandboxMsg;
use arbor_protocol::{
    AgentDef, Amount, DelegateArgs, ErrorClass, JobId, Refusal, ResultEnvelope, RunId, TaskStatus,
    ToolName,
};
use ractor::{ActorRef, RpcReplyPort};
use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The notice a model request carries once spend has crossed the wind-down share.
pub const WIND_DOWN_NOTICE: &str = "Budget notice: most of your budget is spent. Finish now: submit your best answer with submit_output, and list what is missing in limitations.";

/// What the loop asks of its job. The loop's own words: the Job wraps them
/// (`JobMsg::Loop`), so the loop names no type of the job's.
pub enum LoopMsg {
    Delegate {
        args: DelegateArgs,
        call_id: String,
        reply: RpcReplyPort<Result<Vec<ChildHandle>, Refusal>>,
    },
    Collect {
        children: Vec<String>,
        timeout: Option<Duration>,
        /// A waiting delegate call: children still running at the timeout are stopped.
        stop_on_timeout: bool,
        reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    },
    StopChild {
        child: String,
        reply: RpcReplyPort<Result<String, Refusal>>,
    },
    SendMessage {
        child: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
    /// A message for a peer (`send_peer`): its label, the text.
    SendPeer {
        to: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
    /// The queued messages, each with whether its parent sent it.
    TakeSteering {
        turn: u32,
        reply: RpcReplyPort<Vec<(String, bool)>>,
    },
    /// It waits on a person's approval (true) or no longer does: the job's
    /// wall timeout is paused meanwhile (the card's deadline is its own).
    Waiting(bool),
}

/// What `delegate` returns for each child it started.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChildHandle {
    pub label: String,
    pub id: JobId,
    pub agent: String,
    pub grant_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grant_usd_micros: Option<u64>,
}

/// A model call in flight: what was reserved for it and what its adapter
/// has learned so far. Whoever takes it from the job's slot settles it,
/// exactly once: the loop when the call returns or is cancelled, the job
/// when it aborted the loop mid-call.
pub struct InFlight {
    /// What the call's reservation holds, in both units.
    pub reserved: Amount,
    pub input_reserved: u64,
    pub max_output: u64,
    pub wind_down: bool,
    pub turn: u32,
    pub retries: u32,
    pub started: std::time::Instant,
    pub meter: CallMeter,
    pub info: ModelInfo,
}

/// The job's handle on its loop's call in flight.
pub type InFlightSlot = Arc<Mutex<Option<InFlight>>>;

pub struct LoopArgs {
    /// A step of a `peers` group: its siblings' labels, agents and
    /// descriptions, listed in its prompt.
    pub peers: Arc<[(String, String, String)]>,
    /// Its run's tenant's shared instructions (I-63), in its prompt.
    pub instructions: Option<Arc<str>>,
    pub ctx: Arc<NodeContext>,
    pub run: RunId,
    pub id: JobId,
    /// The labels from the root to it (an approval card's lineage).
    pub path: Arc<[String]>,
    /// Its job, spoken to in the loop's own words (`LoopMsg`).
    pub job: ractor::DerivedActorRef<LoopMsg>,
    pub account: ActorRef<AccountMsg>,
    /// None when no tool that uses a sandbox is offered (`ToolInfo::sandbox`).
    pub sandbox: Option<ActorRef<SandboxMsg>>,
    /// How many steering messages the job holds for the next turn.
    pub steering_queued: Arc<AtomicUsize>,
    /// Woken when a message is queued.
    pub steering_arrived: Arc<tokio::sync::Notify>,
    /// Its model, and its fallbacks (I-55).
    pub model: Arc<crate::model::ModelChain>,
    pub agent: Arc<AgentDef>,
    pub offered: Arc<BTreeMap<ToolName, Result<(), String>>>,
    /// Its MCP tools and its limits come from here (I-44, I-45).
    pub policy: Arc<Policy>,
    /// Calls counted against its limits before it started, and the run of
    /// identical calls it was on (a predecessor's).
    pub tool_counts: Made,
    pub request: String,
    pub max_turns: u32,
    pub cancel: CancellationToken,
    /// Shared with the job, which settles a call its abort cut short.
    pub in_flight: InFlightSlot,
    /// Where its recording goes, and the recording it replays.
    pub tapes: crate::tape::JobTapes,
    /// Its children's ends it was answered on before they were durable, and
    /// its events after them: told (`Held::release`) before it acts outside.
    pub held: crate::ends::Held,
    /// A step of a run that pauses at its ceiling (`on_ceiling = "pause"`):
    /// its run, asked for a top-up when a call is refused (I-58).
    pub payer: Option<crate::parent::Payer>,
}

/// What a job's interrupted attempts leave the attempt that takes over
/// from them: the calls its limits counted (I-45), and the run of
/// identical calls it was on (`max_repeats`), so a restart resets neither.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Made {
    pub calls: BTreeMap<String, u64>,
    /// The last call's digest (`repeats::digest`), and how many times in a
    /// row it was made.
    pub streak: Option<(String, u32)>,
}

/// How the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopEnd {
    /// The agent called submit_output.
    Submitted,
    /// A model answer with no tool call (it declares completed).
    FinalAnswer,
    TurnCap,
    /// The account could not cover the next call (I-13).
    BudgetExhausted,
    /// The model failed or the job's actor went away.
    Failed,
    /// A stop cut it short (its cancel token): the stop is the job's end.
    Stopped,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LoopOutcome {
    pub end: LoopEnd,
    pub declared: Option<TaskStatus>,
    pub output: serde_json::Value,
    pub limitations: Vec<String>,
    pub error: Option<(ErrorClass, String)>,
    pub turns: u32,
    /// The agent said something that can stand as a partial answer.
    pub produced: bool,
}

impl LoopOutcome {
    pub fn failed(class: ErrorClass, message: String, turns: u32) -> Self {
        Self {
            end: LoopEnd::Failed,
            declared: None,
            output: serde_json::Value::Null,
            limitations: vec![],
            error: Some((class, message)),
            turns,
            produced: false,
        }
    }
}

/// The journal failed while the loop waited for what it holds to be durable.
pub(super) fn journal_failed(e: arbor_storage::Error, turn: u32) -> LoopOutcome {
    LoopOutcome::failed(
        ErrorClass::Internal,
        format!("the journal failed: {e}"),
        turn,
    )
}

/// How a loop ends that a stop cut short; the job's own finish says why.
pub(super) fn stopped(turn: u32) -> LoopOutcome {
    LoopOutcome {
        end: LoopEnd::Stopped,
        ..LoopOutcome::failed(ErrorClass::Internal, "stopped".into(), turn)
    }
}

pub(super) fn ended_without_answer(
    end: LoopEnd,
    last_text: Option<String>,
    turns: u32,
    why: String,
) -> LoopOutcome {
    let produced = last_text.is_some();
    let class = match end {
        LoopEnd::BudgetExhausted => ErrorClass::BudgetExhausted,
        _ => ErrorClass::Task,
    };
    LoopOutcome {
        end,
        declared: None,
        output: last_text
            .map(serde_json::Value::String)
            .unwrap_or(serde_json::Value::Null),
        limitations: vec![why.clone()],
        error: Some((class, why)),
        turns,
        produced,
    }
}

pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

pub(super) fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
