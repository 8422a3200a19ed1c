//! `GET /v1/status`: the whole node at a glance. Live runs with their trees
//! (every account's grant, spent and held), the supervision tree as ractor
//! has it, the sandboxes' process groups, the queue, the journal, and what
//! the last recovery did.

use arbor_protocol::{ActorView, JobId, RunId, SandboxPosture, TreeNode};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct NodeStatus {
    pub node: NodeInfo,
    pub admission: AdmissionInfo,
    pub journal: JournalInfo,
    pub recovery: RecoveryInfo,
    /// Every run queued or running, as its tree: the run, its steps, their
    /// jobs, each with its account (tokens and, under a usd ceiling, micro-dollars).
    pub runs: Vec<TreeNode>,
    /// On a shared journal ([journal] backend = "postgres"): every node,
    /// its lease, and the runs it owns at which epoch (docs/cluster.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<ClusterNode>>,
    /// The actor tree: Node, Runs, Jobs, Accounts, Sandboxes.
    pub actors: ActorView,
    /// Process groups the sandboxes started that are still live.
    pub sandboxes: Vec<SandboxView>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct NodeInfo {
    pub version: String,
    /// The journal's boot epoch: 1 on a fresh data dir, +1 every start.
    pub epoch: u64,
    pub started_at_ms: u64,
    pub uptime_ms: u64,
    /// False once a SIGTERM began the drain.
    pub accepting: bool,
    /// What the node's sandboxes are.
    pub sandbox: SandboxPosture,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AdmissionInfo {
    pub max_running_runs: usize,
    pub running: usize,
    pub queued: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct JournalInfo {
    pub applied_seq: u64,
    pub durable_seq: u64,
    pub flushes: u64,
    pub fsyncs: u64,
    /// The first write or flush that failed; the node takes no new work then.
    pub failed: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RecoveryInfo {
    pub epoch: u64,
    /// Steps and jobs marked failed, `interrupted: node restarted` (I-30).
    pub jobs_failed: Vec<JobId>,
    /// Leaders of the process groups killed.
    pub processes_killed: Vec<i32>,
    pub grants_released: u32,
    /// Runs resumed at step granularity (I-34).
    pub runs_resumed: Vec<RunId>,
    /// Records that did not decode (listed, never skipped).
    pub undecodable: usize,
    /// Accounts that did not add up; empty when all is well (I-14).
    pub breaches: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SandboxView {
    pub run: RunId,
    pub job: JobId,
    pub pgid: i32,
}

/// A node of a shared journal.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ClusterNode {
    pub id: String,
    /// The epoch of the node's open that holds the id now.
    pub epoch: u64,
    /// How long its lease runs on, by the database's clock (0: run out).
    pub lease_left_ms: u64,
    /// The runs it owns that have not ended, each at its run epoch.
    pub runs: Vec<OwnedRun>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct OwnedRun {
    pub run: RunId,
    pub epoch: u64,
}
