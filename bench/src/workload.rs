//! What the arbor side of every goal is built from: agents written as
//! scripts, a node with its caps raised to the workload, an observer that
//! counts what the node emits (so a workload waits on events, never on the
//! clock or on a copy of a tree), and the supervision tree's actors, to
//! wait until each has exited.

use crate::trial::Rep;
use anyhow::bail;
use arbor_protocol::{EventKind, JobId, NodeKind, ParentRef, RunId, Status};
use arbor_testkit::{TestNode, agent_md};
use ractor::ActorCell;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A run's budget that no workload here comes near: budgets are not what is
/// measured, and a tree of 10,000 jobs below a step must still leave each
/// leaf enough for its first model call.
pub const BUDGET_TOKENS: u64 = 1_000_000_000_000;

/// `limits.spawn_cap` for every workload: far above any run here.
const SPAWN_CAP: u64 = 10_000_000;

/// How long one wait for a workload may take before the goal gives up.
pub const WAIT_LIMIT: Duration = Duration::from_secs(1_800);

/// A leaf whose first model call takes an hour (a model that has not
/// answered yet): an idle job, as far as the node can tell.
pub fn leaf_waiting() -> String {
    agent_md(
        "description: waits\nscript:\n  - say: working\n    delay: 1h\n    call: {tool: submit_output, args: {output: late}}",
    )
}

/// A parent that delegates `children` jobs of `subagent` in one call (wait =
/// true), then submits.
pub fn delegating(subagent: &str, children: usize) -> String {
    let jobs = vec![format!("{{agent: {subagent}, request: go}}"); children].join(", ");
    agent_md(&format!(
        "description: delegates\nsubagents: [{subagent}]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{jobs}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ))
}

/// arbor.toml's `[limits]` for a workload: `children` under one parent (in
/// one call and running at once), `depth` levels below a step, and spawns
/// per run far above what any run here makes. The rest stay at their defaults.
pub fn limits(children: usize, depth: u32) -> String {
    format!(
        "[limits]\ndepth = {depth}\nfan_out = {children}\nrunning_children = {children}\nspawn_cap = {SPAWN_CAP}\n"
    )
}

/// Turns a node's journal syncs off, before it does any work: the one
/// place that decides what "syncs off" means for a baseline.
///
/// Storage's switch for benchmarks, `Faults::skip_syncs`: the journal's
/// flusher still writes its log, on the same filesystem, and no longer
/// calls `fdatasync`, so each commit costs what it would on a disk whose
/// syncs were free. Its checkpoints (sled flushed and synced, every so many
/// bytes of log) still sync; they are off every commit's path. Before
/// storage had the switch the plan was a stand-in, the node's data dir on
/// tmpfs; that measures another disk, not this one without syncs.
pub fn syncs_off(node: &TestNode) {
    node.journal().faults().skip_syncs(true);
}

/// The kind of filesystem `path` is on: `ext4`, `tmpfs`, ... or its magic number.
pub fn filesystem(path: &Path) -> String {
    let Ok(stats) = nix::sys::statfs::statfs(path) else {
        return "unknown".into();
    };
    match stats.filesystem_type().0 as u64 {
        0xEF53 => "ext4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794C_7630 => "overlayfs".into(),
        other => format!("filesystem {other:#x}"),
    }
}

/// The temporary directory every node and journal here is made in, and its kind.
pub fn temp_dir() -> String {
    let dir = std::env::temp_dir();
    format!("{} on {}", dir.display(), filesystem(&dir))
}

/// Counts of what one node emitted, since it started.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// `JobRunning`: steps and jobs that started.
    pub running: u64,
    /// `JobFinished`: steps and jobs that ended.
    pub finished: u64,
    pub runs_finished: u64,
    /// A step's or job's first model call reserved (its account holds
    /// something and has spent nothing): from here its loop is in the call.
    pub first_reservations: u64,
    /// `ModelCalled`: model calls that returned.
    pub model_calls: u64,
    /// Steps and jobs that reported output while a stop was under way
    /// (`Tally::stopping`): called `submit_output`, or ended done.
    pub late_outputs: u64,
    /// Of those, the ones recorded done, their output kept.
    pub late_outputs_kept: u64,
}

/// An observer on one node that counts its events and rings at each one.
/// It runs in the emitting task, so it only counts; anything that is not
/// what a workload expects (a failed tool call, a job not done) outside a
/// stop is kept as the workload's failure.
#[derive(Clone)]
pub struct Tally {
    inner: Arc<TallyInner>,
}

#[derive(Default)]
struct TallyInner {
    running: AtomicU64,
    finished: AtomicU64,
    runs_finished: AtomicU64,
    first_reservations: AtomicU64,
    model_calls: AtomicU64,
    late: Mutex<Late>,
    stopping: AtomicBool,
    last_run_finished: Mutex<Option<Instant>>,
    failure: Mutex<Option<String>>,
    bell: tokio::sync::Notify,
}

impl Tally {
    pub fn install(node: &TestNode) -> Tally {
        let tally = Tally {
            inner: Arc::default(),
        };
        let inner = tally.inner.clone();
        node.observe(move |event| inner.count(&event.kind));
        tally
    }

    pub fn counts(&self) -> Counts {
        let read = |n: &AtomicU64| n.load(Ordering::Acquire);
        let inner = &self.inner;
        let (late_outputs, late_outputs_kept) = {
            let late = inner.late.lock().unwrap();
            (late.reported.len() as u64, late.kept.len() as u64)
        };
        Counts {
            running: read(&inner.running),
            finished: read(&inner.finished),
            runs_finished: read(&inner.runs_finished),
            first_reservations: read(&inner.first_reservations),
            model_calls: read(&inner.model_calls),
            late_outputs,
            late_outputs_kept,
        }
    }

    /// While on, steps and jobs that end not done are expected (a stop is
    /// under way), and output is late.
    pub fn stopping(&self, on: bool) {
        self.inner.stopping.store(on, Ordering::Release);
    }

    /// When the observer saw the latest `RunFinished`.
    pub fn last_run_finished(&self) -> Option<Instant> {
        *self.inner.last_run_finished.lock().unwrap()
    }

    /// Waits until `done` holds of the counts, re-checked at every event;
    /// fails if the workload failed first or `WAIT_LIMIT` passed.
    pub async fn wait(&self, what: &str, done: impl Fn(&Counts) -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
        loop {
            let rung = self.inner.bell.notified();
            if let Some(failure) = self.inner.failure.lock().unwrap().clone() {
                bail!("while waiting for {what}: {failure}");
            }
            let counts = self.counts();
            if done(&counts) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, rung).await.is_err() {
                bail!("waited {WAIT_LIMIT:?} for {what} in vain; counts: {counts:?}");
            }
        }
    }
}

impl TallyInner {
    fn count(&self, kind: &EventKind) {
        let add = |n: &AtomicU64| {
            n.fetch_add(1, Ordering::AcqRel);
        };
        let stopping = self.stopping.load(Ordering::Acquire);
        match kind {
            EventKind::JobRunning { .. } => add(&self.running),
            EventKind::JobFinished { reason, result, .. } => {
                let (id, status, error) = (&result.job, &result.status, &result.error);
                add(&self.finished);
                if stopping && *status == Status::Done {
                    let mut late = self.late.lock().unwrap();
                    late.reported.insert(*id);
                    late.kept.insert(*id);
                }
                if !stopping && *status != Status::Done {
                    self.fail(format!("a job ended {status}: {reason:?} {error:?}"));
                }
            }
            EventKind::RunFinished { status, reason, .. } => {
                *self.last_run_finished.lock().unwrap() = Some(Instant::now());
                add(&self.runs_finished);
                if !stopping && *status != Status::Done {
                    self.fail(format!("a run ended {status}: {reason:?}"));
                }
            }
            EventKind::AccountChanged {
                owner: ParentRef::Job(_),
                held,
                spent,
                ..
            } if *held > 0 && *spent == 0 => add(&self.first_reservations),
            EventKind::ModelCalled { .. } => add(&self.model_calls),
            EventKind::ToolCalled {
                id,
                tool,
                ok,
                detail,
                ..
            } => {
                if stopping && tool == "submit_output" {
                    self.late.lock().unwrap().reported.insert(*id);
                }
                if !ok && !stopping {
                    self.fail(format!("a {tool} call failed: {detail}"));
                }
            }
            _ => {}
        }
        self.bell.notify_waiters();
    }

    fn fail(&self, why: String) {
        self.failure.lock().unwrap().get_or_insert(why);
    }
}

/// Journal flushes over the measured repetitions, per operation: where a
/// workload's durable commits go (one flush may carry several).
#[derive(Clone, Copy, Debug, Default)]
pub struct Flushes {
    flushes: u64,
    ops: u64,
}

impl Flushes {
    /// Counts `flushes` over `ops` operations, unless `rep` is the warm-up.
    pub fn add(&mut self, rep: Rep, flushes: u64, ops: u64) {
        if rep != Rep::Warmup {
            self.flushes += flushes;
            self.ops += ops;
        }
    }

    pub fn per_op(&self) -> f64 {
        self.flushes as f64 / self.ops.max(1) as f64
    }
}

/// Who reported output while a stop was under way.
#[derive(Default)]
struct Late {
    reported: HashSet<JobId>,
    kept: HashSet<JobId>,
}

/// Every actor below `root` by supervision links, `root` not included.
pub fn descendants(root: &ActorCell) -> Vec<ActorCell> {
    let mut found = vec![];
    let mut pending = root.get_children();
    while let Some(cell) = pending.pop() {
        pending.extend(cell.get_children());
        found.push(cell);
    }
    found
}

/// Waits until every actor of `cells` has exited (ractor's own exit
/// notification: no polling), within `WAIT_LIMIT` in all.
pub async fn all_exited(cells: &[ActorCell]) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT_LIMIT;
    for cell in cells {
        let left = deadline.saturating_duration_since(Instant::now());
        if cell.wait(Some(left)).await.is_err() {
            bail!(
                "an actor ({}) had not exited {WAIT_LIMIT:?} after the stop",
                cell.get_id()
            );
        }
    }
    Ok(())
}

/// When each step's model calls returned and each of its good calls of one
/// tool did, by run, as an observer in the emitting task saw them: a call's
/// time is from the model reply that asked for it to its result, the model
/// turn around it excluded (event timestamps in the journal are
/// milliseconds).
#[derive(Clone)]
pub struct Marks {
    tool: Arc<str>,
    inner: Arc<Mutex<MarksInner>>,
}

#[derive(Default)]
struct MarksInner {
    steps: HashSet<JobId>,
    model_calls: HashMap<RunId, Vec<Instant>>,
    calls: HashMap<RunId, Vec<Instant>>,
}

impl Marks {
    pub fn install(node: &TestNode, tool: &str) -> Marks {
        let marks = Marks {
            tool: tool.into(),
            inner: Default::default(),
        };
        let (inner, tool) = (marks.inner.clone(), marks.tool.clone());
        node.observe(move |event| {
            let at = Instant::now();
            let mut inner = inner.lock().unwrap();
            match &event.kind {
                EventKind::JobSpawned {
                    id,
                    kind: NodeKind::Step,
                    ..
                } => {
                    inner.steps.insert(*id);
                }
                EventKind::ModelCalled { id, .. } if inner.steps.contains(id) => {
                    inner.model_calls.entry(event.run).or_default().push(at);
                }
                EventKind::ToolCalled {
                    tool: t, ok: true, ..
                } if **t == *tool => {
                    inner.calls.entry(event.run).or_default().push(at);
                }
                _ => {}
            }
        });
        marks
    }

    /// Each call of the run, in seconds, from the step's model call that
    /// asked for it to its result; the run made `calls` and one last turn.
    pub fn calls(&self, run: RunId, calls: usize) -> anyhow::Result<Vec<f64>> {
        let inner = self.inner.lock().unwrap();
        let none = vec![];
        let model_calls = inner.model_calls.get(&run).unwrap_or(&none);
        let made = inner.calls.get(&run).unwrap_or(&none);
        if made.len() != calls || model_calls.len() != calls + 1 {
            bail!(
                "expected {calls} good {} calls and {} model calls of the step, saw {} and {}",
                self.tool,
                calls + 1,
                made.len(),
                model_calls.len()
            );
        }
        Ok(made
            .iter()
            .zip(model_calls)
            .map(|(result, asked)| (*result - *asked).as_secs_f64())
            .collect())
    }
}
