//! P3: stopping a tree of 10,000 waiting jobs, in two shapes: flat (a step
//! with 10,000 children) and deep (a step, then 4 levels of 10 children
//! each: 10,000 leaves below 1,110 parents).
//!
//! A repetition builds the tree (not timed) and waits until it is idle:
//! every step and job running, every parent inside its delegate call, every
//! leaf inside its first model call, which takes an hour. Then the whole
//! supervision tree of the run is taken (the run, its account, and each
//! job's job and account actors: these agents are offered no tool that
//! uses a sandbox, so they have none), and the clock runs from
//! `stop_run` until the run's `RunFinished`, every job's `JobFinished` and
//! the exit of every one of those actors (ractor's own exit notice, no
//! polling). Afterwards the journal must hold every job terminal, and no
//! output may have come after the stop: a step or job that calls
//! `submit_output`, or ends done, while the stop is under way is late. Tasks that are not
//! actors (each job's agent loop) are checked apart, not timed: how many of
//! the tree's tasks were still alive when the last actor had exited, and
//! how long until they were gone (tokio's count of alive tasks, polled
//! every millisecond: there is no event for it).
//!
//! The baseline is ractor's stop of a bare tree of the same shape: parent
//! actors that `spawn_linked` their children, the root stopped, timed until
//! every actor has exited.

use crate::bare::Branch;
use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Row, Unit, figure};
use crate::trial::{interleaved, progress};
use crate::workload::{
    BUDGET_TOKENS, Flushes, Tally, all_exited, delegating, descendants, leaf_waiting, limits,
};
use anyhow::ensure;
use arbor_testkit::TestNode;
use ractor::Actor;
use std::time::{Duration, Instant};

/// A job and its account: these agents have no tool that uses a sandbox.
const ACTORS_PER_JOB: u64 = 2;

/// How long after its last actor a stopped tree's tasks may take to end.
const TASKS_LIMIT: Duration = Duration::from_secs(10);

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let shapes = [
        Shape::new("flat", sizes.stop_flat.clone()),
        Shape::new("deep", sizes.stop_deep.clone()),
    ];
    let children = shapes
        .iter()
        .flat_map(|s| s.levels.iter().copied())
        .max()
        .unwrap_or(1);
    let depth = shapes.iter().map(|s| s.levels.len()).max().unwrap_or(1);
    let mut agents: Vec<(String, String)> = vec![("leaf".into(), leaf_waiting())];
    for shape in &shapes {
        agents.extend(shape.agents());
    }
    let agents: Vec<(&str, &str)> = agents
        .iter()
        .map(|(name, text)| (name.as_str(), text.as_str()))
        .collect();
    let node = TestNode::start_with_config(&limits(children, depth as u32), &agents).await;
    let tally = Tally::install(&node);

    let mut rows: Vec<Row> = vec![];
    let (mut late, mut late_kept) = (0, 0);
    let mut notes = vec![];
    for shape in &shapes {
        let name = format!("P3 {}", shape.name);
        let mut flushes = Flushes::default();
        let (mut tasks_left, mut tasks_gone_after) = (0, Duration::ZERO);
        let row = interleaved(
            "P3",
            &shape.label(),
            async |_| shape.stop_bare().await,
            async |rep| {
                let stop = shape.stop_arbor(&node, &tally, &name).await?;
                late += stop.late_outputs;
                late_kept += stop.late_outputs_kept;
                flushes.add(rep, stop.flushes, shape.nodes());
                tasks_left = tasks_left.max(stop.tasks_left);
                tasks_gone_after = tasks_gone_after.max(stop.tasks_gone_after);
                Ok(stop.seconds)
            },
        )
        .await?;
        rows.push(row);
        notes.push(format!(
            "{}: {} steps and jobs ({} leaves), {} actors in arbor's tree (job and account each, no sandbox: no tool needs one; the run and its account); {} in the bare tree",
            shape.name,
            shape.nodes(),
            shape.leaves(),
            ACTORS_PER_JOB * shape.nodes() + 2,
            shape.nodes()
        ));
        notes.push(format!(
            "{}: journal flushes during the stop, per step or job: {:.2}",
            shape.name,
            flushes.per_op()
        ));
        notes.push(format!(
            "{}: tasks of the tree still alive when its last actor had exited: {tasks_left} at most; all gone {} later at most (not in the figure)",
            shape.name,
            figure(tasks_gone_after.as_secs_f64(), Unit::Seconds)
        ));
    }
    notes.push(
        "arbor's stop: from stop_run until RunFinished, every job's JobFinished and every actor of the run's supervision tree exited; the journal checked afterwards".into(),
    );
    node.shutdown().await;
    Ok(Outcome {
        id: "P3",
        what: "stop a subtree,",
        unit: Unit::Seconds,
        per: "to stop",
        bound: Bound::AtMost(2.0),
        rows,
        conditions: vec![(
            format!(
                "late outputs, all repetitions: {late} steps and jobs reported output after the stop, {late_kept} of them recorded done with it (must be 0)"
            ),
            late == 0,
        )],
        notes,
    })
}

/// What one arbor stop measured.
struct Stopped {
    seconds: f64,
    /// Outputs that came while the stop was under way.
    late_outputs: u64,
    late_outputs_kept: u64,
    /// Journal flushes from the stop to the end.
    flushes: u64,
    /// Tasks of the tree (beyond those alive before it was built) still
    /// alive when its last actor had exited, and how long until they were not.
    tasks_left: usize,
    tasks_gone_after: Duration,
}

/// A tree: `levels[0]` children below the step, `levels[1]` below each of
/// those, and so on; the last level's jobs are waiting leaves.
struct Shape {
    name: &'static str,
    levels: Vec<usize>,
}

impl Shape {
    fn new(name: &'static str, levels: Vec<usize>) -> Shape {
        assert!(!levels.is_empty(), "a tree has a level below its step");
        Shape { name, levels }
    }

    /// `flat 1 x 10000`, `deep 10 x 10 x 10 x 10`.
    fn label(&self) -> String {
        let levels: Vec<String> = self.levels.iter().map(|n| n.to_string()).collect();
        format!("{} {}", self.name, levels.join("x"))
    }

    /// The agent at each level: the step's, then each level's parents; the
    /// last level runs `leaf`.
    fn agent(&self, level: usize) -> String {
        match level {
            0 => format!("{}_step", self.name),
            l if l == self.levels.len() => "leaf".into(),
            l => format!("{}_level{l}", self.name),
        }
    }

    fn agents(&self) -> Vec<(String, String)> {
        (0..self.levels.len())
            .map(|level| {
                let text = delegating(&self.agent(level + 1), self.levels[level]);
                (self.agent(level), text)
            })
            .collect()
    }

    /// Jobs at each level, the step's level (1) first.
    fn widths(&self) -> Vec<u64> {
        let mut widths = vec![1u64];
        for &n in &self.levels {
            widths.push(widths.last().copied().unwrap_or(1) * n as u64);
        }
        widths
    }

    /// The step and every job below it.
    fn nodes(&self) -> u64 {
        self.widths().iter().sum()
    }

    fn leaves(&self) -> u64 {
        self.widths().last().copied().unwrap_or(1)
    }

    /// Those with children.
    fn parents(&self) -> u64 {
        self.nodes() - self.leaves()
    }

    /// One arbor repetition: build, wait until idle, stop, time.
    async fn stop_arbor(
        &self,
        node: &TestNode,
        tally: &Tally,
        name: &str,
    ) -> anyhow::Result<Stopped> {
        let (nodes, parents) = (self.nodes(), self.parents());
        let before = tally.counts();
        let tasks_before = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        progress(name, &format!("building a tree of {nodes} steps and jobs"));
        let run = node
            .run_agent_with_budget(&self.agent(0), "go", Some(BUDGET_TOKENS))
            .await;
        tally
            .wait("the tree to be built and idle", |c| {
                c.running >= before.running + nodes
                    && c.first_reservations >= before.first_reservations + nodes
                    && c.model_calls >= before.model_calls + parents
            })
            .await?;
        // The run's actors alone: the node's own (its approval gate) stay.
        let run_name = format!("arbor-run-{run}");
        let run_cell = node
            .node()
            .root_actor()
            .get_children()
            .into_iter()
            .find(|c| c.get_name().as_deref() == Some(run_name.as_str()))
            .ok_or_else(|| anyhow::anyhow!("no actor {run_name} below the node"))?;
        let mut actors = descendants(&run_cell);
        actors.push(run_cell);
        ensure!(
            actors.len() as u64 == ACTORS_PER_JOB * nodes + 2,
            "the run's supervision tree has {} actors, not {}",
            actors.len(),
            ACTORS_PER_JOB * nodes + 2
        );
        progress(name, "stopping it");
        tally.stopping(true);
        let tasks = tokio::runtime::Handle::current().metrics();
        let flushed = node.journal().flush_count();
        let start = Instant::now();
        node.stop_run(run).await;
        tally
            .wait("every job of the stopped run to end", |c| {
                c.runs_finished > before.runs_finished && c.finished >= before.finished + nodes
            })
            .await?;
        all_exited(&actors).await?;
        let stopped = start.elapsed();
        let flushes = node.journal().flush_count() - flushed;
        let tasks_left = tasks.num_alive_tasks().saturating_sub(tasks_before);
        let ended = Instant::now();
        while tasks.num_alive_tasks() > tasks_before && ended.elapsed() < TASKS_LIMIT {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        ensure!(
            tasks.num_alive_tasks() <= tasks_before,
            "{} of the stopped tree's tasks were still alive {TASKS_LIMIT:?} after its last actor",
            tasks.num_alive_tasks() - tasks_before
        );
        let tasks_gone_after = ended.elapsed();
        tally.stopping(false);
        let after = tally.counts();
        let late = after.late_outputs - before.late_outputs;
        let late_kept = after.late_outputs_kept - before.late_outputs_kept;
        let records = node.journal().jobs(run)?;
        ensure!(
            records.len() as u64 == nodes && records.iter().all(|j| j.status.is_terminal()),
            "after the stop the journal holds {} job records, {} of them not terminal",
            records.len(),
            records.iter().filter(|j| !j.status.is_terminal()).count()
        );
        Ok(Stopped {
            seconds: stopped.as_secs_f64(),
            late_outputs: late,
            late_outputs_kept: late_kept,
            flushes,
            tasks_left,
            tasks_gone_after,
        })
    }

    /// One baseline repetition: a bare tree of the same shape, its root
    /// stopped, timed until every actor has exited.
    async fn stop_bare(&self) -> anyhow::Result<f64> {
        let (root, _) = Actor::spawn(None, Branch, self.levels.clone()).await?;
        let mut actors = descendants(&root.get_cell());
        actors.push(root.get_cell());
        ensure!(
            actors.len() as u64 == self.nodes(),
            "the bare tree has {} actors, not {}",
            actors.len(),
            self.nodes()
        );
        let start = Instant::now();
        root.stop(None);
        all_exited(&actors).await?;
        Ok(start.elapsed().as_secs_f64())
    }
}
