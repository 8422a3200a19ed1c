//! What every actor of a node shares: the journal, the event bus, the agents,
//! the models and the limits. Built once by the runtime, read-only after.

use crate::events::EventBus;
use crate::model::ModelFactory;
use arbor_protocol::{AgentDef, Limits, Refusal, RunId};
use arbor_storage::Journal;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct NodeContext {
    pub journal: Journal,
    pub events: EventBus,
    pub limits: Limits,
    pub agents: BTreeMap<String, Arc<AgentDef>>,
    pub models: Arc<dyn ModelFactory>,
    /// Workdirs are made below this: `<work_root>/<run>/...`.
    pub work_root: PathBuf,
    /// Sealed commands' root folders are made below this (swept at start).
    pub sandbox_roots: PathBuf,
    /// What the node's sandboxes can be: sealed, or not and why.
    pub sandbox: Arc<arbor_sandbox::seal::Posture>,
    /// The values of the secrets agents declare, by name (I-27). Read when a
    /// sandbox starts; never logged, journaled or shown.
    pub secrets: Arc<crate::secrets::Secrets>,
    /// The workspace's skills (`skills/NAME/SKILL.md`), by name.
    pub skills: BTreeMap<String, Arc<arbor_protocol::Skill>>,
    /// The node's MCP servers and the tools each lists.
    pub mcp: Arc<crate::mcp::McpCatalog>,
    /// `[approvals]`: what every agent asks about, how long a card waits.
    pub approvals: arbor_protocol::ApprovalSettings,
    /// The node's approval gate, set once when the node starts; a call that
    /// must wait for a person is refused while there is none (fail safe).
    pub gate: std::sync::OnceLock<ractor::ActorRef<crate::approvals::GateMsg>>,
    /// `[limits.concurrency] per_agent`: each bounded agent's job slots.
    pub slots: crate::slots::AgentSlots,
    /// agent.md `budget.per_run`: each pooled agent's pool in each run.
    pub pools: crate::pools::AgentPools,
}

impl NodeContext {
    pub fn agent(&self, name: &str) -> Option<Arc<AgentDef>> {
        self.agents.get(name).cloned()
    }
}

/// What the actors of one run share.
pub struct RunContext {
    pub run: RunId,
    spawned: AtomicU64,
    spawn_cap: u64,
    /// Its jobs journal their model exchanges and tool results (`tape`).
    pub record: bool,
    /// It replays this recording instead of asking its models.
    pub replay: Option<Arc<crate::tape::Replay>>,
    /// Its tenant's shared instructions, in every prompt of its jobs (I-63).
    pub instructions: Option<Arc<str>>,
}

impl RunContext {
    pub fn new(run: RunId, spawn_cap: u64) -> Self {
        Self {
            run,
            spawned: AtomicU64::new(0),
            spawn_cap,
            record: false,
            replay: None,
            instructions: None,
        }
    }

    /// A resumed run's context: the spawns counted before the restart stay counted (I-05).
    pub fn resumed(run: RunId, spawn_cap: u64, spawned: u64) -> Self {
        Self {
            run,
            spawned: AtomicU64::new(spawned),
            spawn_cap,
            record: false,
            replay: None,
            instructions: None,
        }
    }

    /// As recorded, or replaying, as its spec says.
    pub fn with_tape(mut self, record: bool, replay: Option<Arc<crate::tape::Replay>>) -> Self {
        self.record = record;
        self.replay = replay;
        self
    }

    /// Its tenant's shared instructions, as its spec carries them.
    pub fn with_instructions(mut self, instructions: Option<&str>) -> Self {
        self.instructions = instructions.map(Arc::from);
        self
    }

    pub fn spawned(&self) -> u64 {
        self.spawned.load(Ordering::Acquire)
    }

    /// I-05: counts `n` spawns against the run's cap, all or none. Retries
    /// count; a finished child never gives its spawn back.
    pub fn count_spawns(&self, n: u64) -> Result<(), Refusal> {
        self.spawned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |spawned| {
                (spawned + n <= self.spawn_cap).then_some(spawned + n)
            })
            .map(|_| ())
            .map_err(|spawned| Refusal::SpawnCap {
                spawned,
                asked: n,
                cap: self.spawn_cap,
            })
    }

    /// Takes back spawns that were counted but never started (I-06: a refused
    /// spawn leaves nothing behind, not even a count).
    pub fn uncount_spawns(&self, n: u64) {
        self.spawned.fetch_sub(n, Ordering::AcqRel);
    }
}
