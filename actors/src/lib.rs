//! arbor's actors: the node, runs, jobs (steps and delegated jobs), sandboxes
//! and accounts, supervised as one tree; and the agent loop they share.
//!
//! Invariant: nothing here knows HTTP, reqwest, config files or argv. The
//! outside world comes in through `Model`/`ModelFactory` and the journal.

pub mod account;
pub mod agent_loop;
pub mod approvals;
pub mod compaction;
pub mod context;
mod ends;
pub mod events;
pub mod grant;
pub mod job;
pub mod mcp;
mod mcp_server;
pub mod model;
pub mod node;
pub mod parent;
pub mod policy;
pub mod pools;
pub mod run;
pub mod sandbox;
pub mod secrets;
pub mod skills;
pub mod slots;
pub mod tape;
mod timer;

pub use account::{Account, AccountMsg, CallHold, GrantAsk, Ledger, Share, SpentMeter};
pub use approvals::{Gate, GateArgs, GateMsg};
pub use context::{NodeContext, RunContext, Versions};
pub use events::EventBus;
pub use job::{ChildHandle, Job, JobMsg};
pub use model::{
    Message, Model, ModelError, ModelFactory, ModelReply, ModelRequest, ToolCall, ToolSpec,
};
pub use node::{Node, NodeArgs, NodeMsg};
pub use policy::Policy;
pub use run::{Run, RunMsg};
pub use sandbox::{ExecOutcome, Sandbox, SandboxMsg};
