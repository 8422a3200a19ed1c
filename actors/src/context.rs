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
    pub slots: Arc<crate::slots::AgentSlots>,
    /// agent.md `budget.per_run`: each pooled agent's pool in each run.
    pub pools: Arc<crate::pools::AgentPools>,
}

impl NodeContext {
    pub fn agent(&self, name: &str) -> Option<Arc<AgentDef>> {
        self.agents.get(name).cloned()
    }

    /// The same node with other definitions (an earlier version of the
    /// workspace, which a run admitted with it keeps, I-67): everything
    /// else, the journal, the bus, the slots and pools, is this one's.
    pub fn with_agents(&self, agents: BTreeMap<String, Arc<AgentDef>>) -> NodeContext {
        NodeContext {
            journal: self.journal.clone(),
            events: self.events.clone(),
            limits: self.limits.clone(),
            agents,
            models: self.models.clone(),
            work_root: self.work_root.clone(),
            sandbox_roots: self.sandbox_roots.clone(),
            sandbox: self.sandbox.clone(),
            secrets: self.secrets.clone(),
            skills: self.skills.clone(),
            mcp: self.mcp.clone(),
            approvals: self.approvals.clone(),
            gate: self.gate.clone(),
            slots: self.slots.clone(),
            pools: self.pools.clone(),
        }
    }
}

/// The node's contexts by workspace version (`RunSpec::version`): each
/// run is spawned with its version's (I-67); a run of a version not here,
/// or of none, with the node's own.
#[derive(Default)]
pub struct Versions {
    by_id: std::sync::RwLock<BTreeMap<String, Arc<NodeContext>>>,
    /// Makes a version's context from what the journal keeps of it (the
    /// runtime's, which can read a workspace).
    loader: std::sync::OnceLock<VersionLoader>,
}

/// `Versions`' loader: a version's context, if the journal has the version.
pub type VersionLoader = Box<dyn Fn(&str) -> Option<Arc<NodeContext>> + Send + Sync>;

impl Versions {
    /// Sets the loader, once.
    pub fn set_loader(&self, loader: VersionLoader) {
        let _ = self.loader.set(loader);
    }

    pub fn insert(&self, version: &str, ctx: Arc<NodeContext>) {
        self.by_id
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(version.to_string(), ctx);
    }

    /// `version`'s context: made once, by the loader, when first asked.
    pub fn get(&self, version: &str) -> Option<Arc<NodeContext>> {
        let known = self
            .by_id
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(version)
            .cloned();
        known.or_else(|| {
            let ctx = (self.loader.get()?)(version)?;
            self.insert(version, ctx.clone());
            Some(ctx)
        })
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
