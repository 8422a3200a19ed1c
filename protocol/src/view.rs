//! What a node shows of itself, as plain data: its sandboxes' posture and
//! its supervision tree. The node builds these; the service and the CLI
//! print them without reaching into the sandbox code or ractor's cells.

use serde::{Deserialize, Serialize};

/// The node's sandbox posture, found at start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SandboxPosture {
    /// `sealed` or `none`, as `[sandbox] mode` says.
    pub mode: String,
    /// Whether commands run sealed; false for `none`, and for a sealed node
    /// whose kernel refused (its jobs that run commands are refused).
    pub sealed: bool,
    /// One line for an operator.
    pub detail: String,
}

/// One actor of the supervision tree and those it supervises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ActorView {
    /// The registered name (`arbor-run-ID`, `arbor-job-ID`), if it has one.
    pub name: Option<String>,
    /// ractor's status: `Running`, `Stopping`, ...
    pub status: String,
    pub children: Vec<ActorView>,
}

/// One rate window of the node (a provider's `rpm` and `tpm`, I-65): its
/// limits and what the minute ending now holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RateView {
    /// `provider/model`, or `provider/*` for what its models share.
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    pub used: RateUsed,
    /// Closed by the provider (a 429's `Retry-After`, its limit headers)
    /// for this much longer, in ms; 0 when open.
    pub closed_ms: u64,
    /// Requests of this node waiting for room in it.
    #[serde(default)]
    pub waiting: u64,
}

/// What a rate window holds: requests, and tokens reserved or used.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct RateUsed {
    pub requests: u64,
    pub tokens: u64,
}
