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
