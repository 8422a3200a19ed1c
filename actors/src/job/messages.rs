//! The Job's messages: what its loop asks (`JobMsg::Loop`, in the loop's own
//! words), what its parent, an operator or its children tell it, and what
//! it is asked to do (`Brief`). A leaf of the job's files: the actor
//! (`job.rs`) and its parts (`job/`) all speak these, and these name none of
//! them.

use crate::agent_loop::{LoopMsg, LoopOutcome};
use crate::parent::ChildReport;
use arbor_protocol::{JobId, Refusal};
use ractor::RpcReplyPort;
use std::time::Duration;

/// What the job is asked to do, resolved from the request and the agent.
#[derive(Clone, Debug)]
pub struct Brief {
    pub request: String,
    pub max_turns: u32,
    pub timeout: Option<Duration>,
    pub output_schema: Option<serde_json::Value>,
    pub require_artifacts: Vec<String>,
}

/// The loop's requests arrive as `JobMsg::Loop`.
impl From<LoopMsg> for JobMsg {
    fn from(message: LoopMsg) -> Self {
        JobMsg::Loop(message)
    }
}

impl TryFrom<JobMsg> for LoopMsg {
    type Error = ();
    fn try_from(message: JobMsg) -> Result<Self, ()> {
        match message {
            JobMsg::Loop(message) => Ok(message),
            _ => Err(()),
        }
    }
}

/// A child's report arrives as `JobMsg::ChildEnded` (`Parent`).
impl From<ChildReport> for JobMsg {
    fn from(report: ChildReport) -> Self {
        JobMsg::ChildEnded { report }
    }
}

impl TryFrom<JobMsg> for ChildReport {
    type Error = ();
    fn try_from(message: JobMsg) -> Result<Self, ()> {
        match message {
            JobMsg::ChildEnded { report } => Ok(report),
            _ => Err(()),
        }
    }
}

/// A step's siblings in a `peers` group, and how a message reaches them
/// (through its run, which knows who is running).
pub struct Peers {
    /// Each sibling's label, agent and description, in the group's order.
    pub siblings: Vec<(String, String, String)>,
    pub send: Box<dyn Fn(PeerSend) + Send + Sync>,
}

/// A message from one step of a `peers` group to another.
pub struct PeerSend {
    pub from: String,
    pub to: String,
    pub text: String,
    /// The message's id in the recipient, once it is durable there.
    pub reply: RpcReplyPort<Result<u64, Refusal>>,
}

pub enum JobMsg {
    /// From its own loop, in the loop's words.
    Loop(LoopMsg),
    /// Its loop's task has ended, with the loop's outcome.
    LoopEnded {
        outcome: LoopOutcome,
    },
    // From its parent or an operator.
    Steer {
        text: String,
        /// Its parent sent it (`send_message`), not an operator.
        from_parent: bool,
        reply: Option<RpcReplyPort<Result<u64, Refusal>>>,
        /// An operator's call's audit entry (I-64), committed with it.
        audit: Option<Box<arbor_storage::Record>>,
    },
    Stop {
        reason: String,
        propagated: bool,
    },
    /// An operator stops one of this job's children by id.
    StopChildById {
        id: JobId,
        reason: String,
        /// Committed with the child's end (I-64).
        audit: Option<Box<arbor_storage::Record>>,
    },
    /// A sibling's message (`send_peer`), read at its next turn.
    Peer {
        from: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
    // From its children and timers.
    ChildEnded {
        report: ChildReport,
    },
    /// A child's actor ended; if it never reported, it failed.
    ChildGone {
        actor: ractor::ActorId,
        why: String,
    },
    WaitTimedOut {
        waiter: u64,
    },
    /// A failed child's retry has waited its time (`retry`'s wait).
    RetryDue {
        label: String,
    },
    /// The children's ends appended so far are durable (or the journal failed).
    EndsDurable {
        result: Result<(), String>,
    },
    /// Its wall timeout's timer, of the generation it was armed in.
    TimedOut {
        generation: u64,
    },
}
