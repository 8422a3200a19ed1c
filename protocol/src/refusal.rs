//! Why a request was refused. A refusal changes nothing (I-04, I-06, I-36): it is
//! returned as data, shown to the model as an error result, and journaled as an event.

use serde::{Deserialize, Serialize};

#[derive(
    Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema, thiserror::Error,
)]
#[serde(tag = "refusal", rename_all = "snake_case")]
pub enum Refusal {
    #[error("tool {tool} is not offered to you{why}; call only the tools this request lists")]
    ToolNotOffered { tool: String, why: String },
    #[error(
        "bad arguments for {tool}: {message}; fix them to fit the tool's schema and call it again"
    )]
    BadArguments { tool: String, message: String },
    #[error(
        "depth cap {cap} reached: a job at depth {depth} cannot delegate; do the work yourself"
    )]
    DepthCap { depth: u32, cap: u32 },
    #[error(
        "fan-out cap: {asked} children in one call, at most {cap}; send at most {cap} jobs a call"
    )]
    FanOutCap { asked: u32, cap: u32 },
    #[error(
        "running children cap: {running} running + {asked} asked > {cap}; collect or stop a child first"
    )]
    RunningChildrenCap { running: u32, asked: u32, cap: u32 },
    #[error(
        "run spawn cap: {spawned} spawned + {asked} asked > {cap}; no more jobs start in this run, so do the rest yourself"
    )]
    SpawnCap { spawned: u64, asked: u64, cap: u64 },
    #[error("agent {agent:?} is not a sub-agent of {parent:?}; name one of: {allowed}")]
    NotASubagent {
        agent: String,
        parent: String,
        allowed: String,
    },
    #[error("budget: {message}")]
    Budget { message: String },
    #[error("label {label:?} is already used by another child; choose another label")]
    DuplicateLabel { label: String },
    #[error("no child {child:?}; name one of: {known}")]
    UnknownChild { child: String, known: String },
    #[error("child {child} has already ended ({status}); the message was not queued")]
    ChildEnded { child: String, status: String },
    #[error(
        "delegation key {key:?} was already used for a different request (conflict); nothing changed"
    )]
    KeyConflict { key: String },
    #[error(
        "limit reached: {limit} is at most {most} call(s) a job and this job has made {made}; the call was not run, so go on without it"
    )]
    ToolLimit {
        tool: String,
        /// The key of `limits` that refused it (`exec`, `mcp__fs__*`, `calls`).
        limit: String,
        most: u64,
        made: u64,
    },
    #[error("this job is stopping; nothing new starts under it")]
    Stopping,
    /// A `before_call` hook denied it (I-62).
    #[error("{tool} was not run: {why}; go on without it, or do it another way")]
    Denied { tool: String, why: String },
    #[error("{message}")]
    Invalid { message: String },
}
