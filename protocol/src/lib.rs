//! arbor's plain data: the words every other crate speaks.
//!
//! Invariant: nothing here knows tokio, ractor, sled or HTTP. Everything is
//! serde data that can cross a process boundary or be printed.

pub mod agent;
pub mod approval;
pub mod event;
pub mod ids;
pub mod limits;
pub mod mcp;
pub mod refusal;
pub mod result;
pub mod retry;
pub mod skill;
pub mod spec;
pub mod status;
pub mod tape;
pub mod tenant;
pub mod tools;
pub mod tree;
pub mod view;

mod duration_str;

pub use agent::{
    AgentDef, Effort, Hooks, ModelRef, Network, PerRun, Resources, ResourcesSpec, SandboxMode,
    ScriptCall, ScriptTurn, ScriptUsage, Settings, ThinkingTokens, needs_decision, outward_reasons,
};
pub use approval::{
    ApprovalSettings, ApproveEntry, ApproveMode, Card, CardKind, CardState, Decision, Verdict,
};
pub use event::{CallFacts, Event, EventKind, McpServerState, NodeKind, ParentRef};
pub use ids::{CardId, JobId, RunId};
pub use limits::Limits;
pub use mcp::{
    HttpServer, McpPattern, McpServerSpec, McpTransport, StdioServer, ToolLimits, ToolRef,
};
pub use refusal::Refusal;
pub use result::{Amount, ResultEnvelope, Usage};
pub use retry::RetryPolicy;
pub use skill::Skill;
pub use spec::{
    FlowGroup, FlowInput, FlowSpec, JudgeVerdict, OnCeiling, Overlap, ReviewVerdict, RunSpec,
    ScheduleSpec, ScheduleTick, StepSpec, Until, VerdictKind,
};
pub use status::{ErrorClass, Status, TaskStatus};
pub use tenant::DEFAULT_TENANT;
pub use tools::{
    AskPersonArgs, BudgetArg, CollectArgs, DelegateArgs, ExecArgs, JobArgs, Offer, OnFailure,
    ReadFileArgs, ReadSkillArgs, SendMessageArgs, SendPeerArgs, StopChildArgs, SubmitOutputArgs,
    ToolInfo, ToolName, WriteFileArgs,
};
pub use tree::{
    AccountView, IterationView, McpServerView, ReviewView, Tree, TreeNode, WaitingView,
};
pub use view::{ActorView, RateUsed, RateView, SandboxPosture};
