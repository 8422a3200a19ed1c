//! Replaying a recorded run (I-49), exporting its recording as a fixture,
//! and reading a fixture back: everything that is checked before a replay
//! starts, so that bad input runs nothing (docs/replay.md).
//!
//! A replay is a new run of the recorded run's spec whose `replay` names
//! the recording; the actors serve its jobs' model calls and tool results
//! from it (`arbor_actors::tape`).
//!
//! Invariants:
//! 1. Every refusal here comes before the run starts: nothing is written.
//! 2. An export's digest covers the whole document, so a truncated or
//!    edited file is refused, never half-replayed.

use crate::node::EmbeddedNode;
use crate::workspace::Workspace;
use arbor_protocol::tape::{
    AfterDivergence, COMPARED_EVENTS, Export, ReplaySpec, Tape, ToolReplay,
};
use arbor_protocol::{EventKind, JobId, RunId, RunSpec, Tree, TreeNode};
use arbor_storage::Journal;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a replay, an export or a fixture was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("no run {0} in this journal")]
    NoRun(RunId),
    #[error(
        "run {0} was not recorded: run it with `arbor run --record`, or set `[record] models = true` in arbor.toml"
    )]
    NotRecorded(RunId),
    #[error(
        "run {run} was recorded in another workspace: its flow {flow:?} is not in this one (its flows: {known})"
    )]
    OtherWorkspace {
        run: RunId,
        flow: String,
        known: String,
    },
    #[error(
        "this workspace has no agent {agent:?}, which the recording's job {lineage} was: the replay cannot run it"
    )]
    MissingAgent { agent: String, lineage: String },
    #[error("{}: {message}", path.display())]
    BadExport { path: PathBuf, message: String },
    #[error("the replay could not start: {0}")]
    Start(String),
    #[error("run {run}'s recording is damaged: {message}")]
    Damaged { run: RunId, message: String },
    #[error("run {run} {status}: there is nothing to rerun (replay it instead)")]
    NothingFailed { run: RunId, status: String },
    #[error(
        "definitions changed since run {run} was recorded: {}; give --allow-changed to rerun with them (the jobs of a changed agent run again)",
        changed.join(", ")
    )]
    Changed { run: RunId, changed: Vec<String> },
    #[error("{}: {message}", path.display())]
    Script { path: PathBuf, message: String },
    #[error(transparent)]
    Journal(#[from] arbor_storage::Error),
}

/// How to replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    pub tools: ToolReplay,
    pub after_divergence: AfterDivergence,
    /// The replay records itself too.
    pub record: bool,
    /// Against the workspace as it is now, not the version the recorded
    /// run was admitted with (I-67): to see what an edit changes.
    pub current: bool,
}

/// A recorded run as the journal holds it.
pub struct Recorded {
    pub run: RunId,
    pub spec: RunSpec,
    pub tape: Tape,
    pub tree: Tree,
    /// Every step and job, by lineage: its agent.
    pub agents: BTreeMap<String, String>,
    /// Its events, in order.
    pub events: Vec<arbor_protocol::Event>,
}

/// Reads run `run`'s recording, spec and tree from the journal.
pub fn recorded(journal: &Journal, run: RunId) -> Result<Recorded, ReplayError> {
    if journal.run(run)?.is_none() {
        return Err(ReplayError::NoRun(run));
    }
    let events = journal.events(run)?;
    let spec = crate::recovery::started_spec(&events)
        .cloned()
        .ok_or(ReplayError::NotRecorded(run))?;
    let tape = arbor_actors::tape::tape_of(journal.tape(run)?)
        .map_err(|message| ReplayError::Damaged { run, message })?;
    if !spec.record || tape.is_empty() {
        return Err(ReplayError::NotRecorded(run));
    }
    let mut tree = Tree::new(run);
    for event in &events {
        tree.apply(event);
    }
    let agents = lineages(&tree.root())
        .into_iter()
        .map(|(lineage, node)| (lineage, node.agent.clone().unwrap_or_default()))
        .collect();
    Ok(Recorded {
        run,
        spec,
        tape,
        tree,
        agents,
        events,
    })
}

/// Every step and job of a tree with its lineage (`plan#1/worker-2#1`), as
/// the recorder names it.
pub fn lineages(run: &TreeNode) -> Vec<(String, &TreeNode)> {
    fn walk<'a>(node: &'a TreeNode, above: Option<&str>, out: &mut Vec<(String, &'a TreeNode)>) {
        for child in &node.children {
            let label = child
                .label
                .clone()
                .or_else(|| child.agent.clone())
                .unwrap_or_default();
            let key = arbor_actors::tape::lineage_key(above, &label, child.attempt).to_string();
            out.push((key.clone(), child));
            walk(child, Some(&key), out);
        }
    }
    let mut out = vec![];
    walk(run, None, &mut out);
    out
}

/// Refuses a recording this workspace cannot replay: of a flow it does not
/// have (another workspace), or with a job whose agent it lacks.
pub fn check(
    workspace: &Workspace,
    run: RunId,
    spec: &RunSpec,
    agents: &BTreeMap<String, String>,
) -> Result<(), ReplayError> {
    let single = spec.flow.starts_with("agent:") || spec.flow.starts_with("continue:");
    if !single && !workspace.flows.contains_key(&spec.flow) {
        return Err(ReplayError::OtherWorkspace {
            run,
            flow: spec.flow.clone(),
            known: known(workspace.flows.keys()),
        });
    }
    let steps = spec.groups.iter().flat_map(|g| &g.steps).map(|s| {
        (
            format!("step {}", s.label.as_deref().unwrap_or(&s.agent)),
            &s.agent,
        )
    });
    let jobs = agents.iter().map(|(l, a)| (l.clone(), a));
    for (lineage, agent) in steps.chain(jobs) {
        if !workspace.agents.contains_key(agent) {
            return Err(ReplayError::MissingAgent {
                agent: agent.clone(),
                lineage,
            });
        }
    }
    Ok(())
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Replays recorded run `run` of this node's journal as a new run.
pub async fn replay(
    node: &EmbeddedNode,
    workspace: &Workspace,
    run: RunId,
    options: ReplayOptions,
) -> Result<RunId, ReplayError> {
    let recorded = recorded(node.journal(), run)?;
    check(workspace, run, &recorded.spec, &recorded.agents)?;
    start(node, workspace, run, recorded.spec, recorded.tape, options).await
}

async fn start(
    node: &EmbeddedNode,
    workspace: &Workspace,
    of: RunId,
    spec: RunSpec,
    tape: Tape,
    options: ReplayOptions,
) -> Result<RunId, ReplayError> {
    node.start_replay(replay_spec(workspace, of, spec, options), Arc::new(tape))
        .await
        .map_err(|e| ReplayError::Start(e.to_string()))
}

/// The spec of a replay of run `of`, whose spec was `spec`: the same run,
/// its `replay` naming the recording (which its Run reads from the journal
/// when it is not handed one: a replay queued by arbord).
pub fn replay_spec(
    workspace: &Workspace,
    of: RunId,
    spec: RunSpec,
    options: ReplayOptions,
) -> RunSpec {
    let mut spec = workspace.recording(
        RunSpec {
            replay: None,
            ..spec
        },
        options.record,
    );
    spec.replay = Some(ReplaySpec {
        of,
        tools: options.tools,
        after_divergence: options.after_divergence,
        reuse: None,
    });
    if options.current {
        spec.version = Some(workspace.version.clone());
    }
    spec
}

/// Run `run`'s recording as one document, its digest set.
pub fn export(journal: &Journal, run: RunId) -> Result<Export, ReplayError> {
    let recorded = recorded(journal, run)?;
    let mut root = recorded.tree.root();
    let events = job_events(&root, &recorded.events);
    // A workdir is a path of the recording machine's, of no use elsewhere.
    fn no_workdirs(node: &mut TreeNode) {
        node.workdir = None;
        node.children.iter_mut().for_each(no_workdirs);
    }
    no_workdirs(&mut root);
    let mut export = Export {
        format: Export::FORMAT.into(),
        version: Export::VERSION,
        run,
        workspace: recorded.spec.digests.clone(),
        spec: recorded.spec,
        agents: {
            let mut agents: Vec<String> = recorded.agents.values().cloned().collect();
            agents.sort();
            agents.dedup();
            agents
        },
        tape: recorded.tape,
        tree: root,
        events,
        digest: String::new(),
    };
    export.digest = digest(&export);
    Ok(export)
}

/// Each job's events of `COMPARED_EVENTS`, in order, by lineage; a model
/// call a stop cut short is not among them.
pub fn job_events(
    run: &TreeNode,
    events: &[arbor_protocol::Event],
) -> BTreeMap<String, Vec<String>> {
    let by_job: BTreeMap<JobId, String> = lineages(run)
        .into_iter()
        .filter_map(|(lineage, node)| Some((node.id.parse().ok()?, lineage)))
        .collect();
    let mut kinds: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for event in events {
        // A call a stop cut short records a race (did the stop find the job
        // before or in its call?) that every run decides anew.
        if let EventKind::ModelCalled { call, .. } = &event.kind
            && call.outcome == "stopped"
        {
            continue;
        }
        let kind = event_kind(&event.kind);
        if let Some(lineage) = event.kind.job().and_then(|j| by_job.get(&j))
            && COMPARED_EVENTS.contains(&kind.as_str())
        {
            kinds.entry(lineage.clone()).or_default().push(kind);
        }
    }
    kinds
}

/// Where a replay differs from its recording (I-49), in words, at most
/// `limit` differences: the trees (`arbor_protocol::tape::comparable`),
/// then each job's events. Empty: they are the same.
pub fn differences(
    recorded: &TreeNode,
    recorded_events: &BTreeMap<String, Vec<String>>,
    replayed: &TreeNode,
    replayed_events: &BTreeMap<String, Vec<String>>,
    limit: usize,
) -> Vec<String> {
    let mut out = vec![];
    diff(
        "run",
        &arbor_protocol::tape::comparable(recorded),
        &arbor_protocol::tape::comparable(replayed),
        &mut out,
        limit,
    );
    for lineage in recorded_events.keys().chain(replayed_events.keys()) {
        if out.len() >= limit {
            break;
        }
        let (old, new) = (recorded_events.get(lineage), replayed_events.get(lineage));
        if old != new
            && !out
                .iter()
                .any(|d| d.starts_with(&format!("events of {lineage}:")))
        {
            let show = |k: Option<&Vec<String>>| k.map_or("none".into(), |k| k.join(" "));
            out.push(format!(
                "events of {lineage}: recorded [{}], replayed [{}]",
                show(old),
                show(new)
            ));
        }
    }
    out
}

fn diff(
    at: &str,
    old: &serde_json::Value,
    new: &serde_json::Value,
    out: &mut Vec<String>,
    limit: usize,
) {
    use serde_json::Value;
    if out.len() >= limit || old == new {
        return;
    }
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
                let (x, y) = (&a.get(key), &b.get(key));
                let null = Value::Null;
                let (x, y) = (x.unwrap_or(&null), y.unwrap_or(&null));
                if key == "children" {
                    let none = vec![];
                    let (xs, ys) = (x.as_array().unwrap_or(&none), y.as_array().unwrap_or(&none));
                    if xs.len() != ys.len() {
                        out.push(format!(
                            "{at}: {} children recorded, {} replayed",
                            xs.len(),
                            ys.len()
                        ));
                    }
                    for (c, d) in xs.iter().zip(ys) {
                        let label = c["label"].as_str().or(c["agent"].as_str()).unwrap_or("?");
                        diff(&format!("{at}/{label}#{}", c["attempt"]), c, d, out, limit);
                    }
                } else {
                    diff(&format!("{at}.{key}"), x, y, out, limit);
                }
            }
        }
        _ => {
            let show = |v: &Value| {
                let text = v.to_string();
                if text.chars().count() > 120 {
                    format!("{}...", text.chars().take(117).collect::<String>())
                } else {
                    text
                }
            };
            out.push(format!(
                "{at}: recorded {}, replayed {}",
                show(old),
                show(new)
            ));
        }
    }
}

/// An event's kind, as its JSON's `type` names it.
pub fn event_kind(kind: &EventKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.get("type")?.as_str().map(String::from))
        .unwrap_or_default()
}

/// The document's digest: SHA-256 of its JSON without `digest`, keys
/// sorted (serde_json's maps are ordered), no whitespace.
fn digest(export: &Export) -> String {
    let mut value = serde_json::to_value(export).unwrap_or_default();
    if let Some(map) = value.as_object_mut() {
        map.remove("digest");
    }
    digest_of(&value)
}

fn digest_of(value: &serde_json::Value) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(value.to_string().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Reads an export, refusing one that is not whole and as written: not
/// JSON (truncated), of another format, of a newer version, or whose
/// digest does not match its content (edited).
pub fn read_export(path: &Path) -> Result<Export, ReplayError> {
    let bad = |message: String| ReplayError::BadExport {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let mut value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "not a whole JSON document (truncated?): {e}; export it again with `arbor export`"
        ))
    })?;
    let format = value.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != Export::FORMAT {
        return Err(bad(format!(
            "not an arbor recording: its format is {format:?}, not {:?}",
            Export::FORMAT
        )));
    }
    match value.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(Export::VERSION) => {}
        Some(v) if v > u64::from(Export::VERSION) => {
            return Err(bad(format!(
                "its version is {v}, newer than this arbor reads ({}): replay it with a newer arbor",
                Export::VERSION
            )));
        }
        other => {
            return Err(bad(format!(
                "its version is {}, which this arbor does not read (it reads {})",
                other.map_or("missing".into(), |v| v.to_string()),
                Export::VERSION
            )));
        }
    }
    let stated = value
        .as_object_mut()
        .and_then(|m| m.remove("digest"))
        .and_then(|d| d.as_str().map(String::from))
        .ok_or_else(|| bad("it has no digest".into()))?;
    let actual = digest_of(&value);
    if stated != actual {
        return Err(bad(format!(
            "its digest does not match its content (it says {stated}, the content's is {actual}): \
             the file was changed after it was exported"
        )));
    }
    let mut export: Export = serde_json::from_value(value)
        .map_err(|e| bad(format!("not a recording this arbor reads: {e}")))?;
    export.digest = stated;
    Ok(export)
}

/// Replays an export against this workspace, as a new run.
pub async fn replay_export(
    node: &EmbeddedNode,
    workspace: &Workspace,
    export: &Export,
    options: ReplayOptions,
) -> Result<RunId, ReplayError> {
    let agents: BTreeMap<String, String> = lineages(&export.tree)
        .into_iter()
        .map(|(lineage, node)| (lineage, node.agent.clone().unwrap_or_default()))
        .collect();
    check(workspace, export.run, &export.spec, &agents)?;
    start(
        node,
        workspace,
        export.run,
        export.spec.clone(),
        export.tape.clone(),
        options,
    )
    .await
}

/// A rerun of a failed run (`arbor replay RUN --rerun-failed`): which jobs
/// are reused from the recording and which run again, and the most the
/// rerun part can spend.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct RerunPlan {
    /// The failed run.
    pub replay_of: RunId,
    pub flow: String,
    /// The definitions that changed since the recording (with
    /// `--allow-changed`; else the plan is refused).
    pub changed: Vec<String>,
    pub jobs: Vec<PlannedJob>,
    /// The grants of the rerun part's topmost jobs, in tokens: the most it
    /// can spend (its jobs' grants are held in the same accounts again).
    pub worst_case_tokens: u64,
    /// The same in micro-dollars, when the run has a usd ceiling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worst_case_usd_micros: Option<u64>,
    #[serde(skip)]
    #[schemars(skip)]
    spec: RunSpec,
    #[serde(skip)]
    #[schemars(skip)]
    tape: Tape,
}

/// One step or job of a rerun's plan.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct PlannedJob {
    pub lineage: String,
    pub agent: String,
    pub depth: u32,
    /// Served from the recording (true) or run again.
    pub reuse: bool,
    /// Why it runs again: how it ended, or that its agent changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    pub grant_tokens: u64,
}

/// Plans the rerun of failed run `run`: a job that completed, whose agent
/// and arbor.toml are unchanged, is reused; every other runs again. Changed
/// definitions are refused unless `allow_changed`.
pub fn plan_rerun(
    journal: &Journal,
    workspace: &Workspace,
    run: RunId,
    allow_changed: bool,
) -> Result<RerunPlan, ReplayError> {
    let recorded = recorded(journal, run)?;
    check(workspace, run, &recorded.spec, &recorded.agents)?;
    let root = recorded.tree.root();
    if root.status == arbor_protocol::Status::Done {
        return Err(ReplayError::NothingFailed {
            run,
            status: "completed".into(),
        });
    }
    if !root.status.is_terminal() {
        return Err(ReplayError::NothingFailed {
            run,
            status: format!("is {}", root.status),
        });
    }
    let now = workspace.digests_for(&recorded.spec);
    let then = &recorded.spec.digests;
    let changed: Vec<String> = then
        .keys()
        .chain(now.keys().filter(|k| !then.contains_key(*k)))
        .filter(|path| then.get(*path) != now.get(*path))
        .cloned()
        .collect();
    if !changed.is_empty() && !allow_changed {
        return Err(ReplayError::Changed { run, changed });
    }
    let config_changed = changed.iter().any(|p| p == "arbor.toml");
    // Each agent's first changed definition: its agent.md, or a skill it reads.
    let changed_of: std::collections::BTreeMap<String, String> = workspace
        .agents
        .values()
        .filter_map(|a| {
            std::iter::once(format!("agents/{}/agent.md", a.name))
                .chain(a.skills.iter().map(|s| format!("skills/{s}/SKILL.md")))
                .find(|p| changed.contains(p))
                .map(|p| (a.name.clone(), p))
        })
        .collect();
    let mut jobs = vec![];
    let mut worst = (0u64, 0u64);
    let usd = recorded.spec.budget_usd_micros.is_some();
    // Topmost: a rerun job whose parent is reused (or is the run).
    fn plan(
        node: &TreeNode,
        above: Option<&str>,
        parent_reused: bool,
        changed_of: &std::collections::BTreeMap<String, String>,
        config_changed: bool,
        jobs: &mut Vec<PlannedJob>,
        worst: &mut (u64, u64),
    ) {
        for child in &node.children {
            let label = child
                .label
                .clone()
                .or_else(|| child.agent.clone())
                .unwrap_or_default();
            let lineage = arbor_actors::tape::lineage_key(above, &label, child.attempt).to_string();
            let agent = child.agent.clone().unwrap_or_default();
            let why = if child.status != arbor_protocol::Status::Done {
                Some(match &child.reason {
                    Some(reason) => format!("{}: {reason}", child.status),
                    None => child.status.to_string(),
                })
            } else if let Some(path) = changed_of.get(&agent) {
                Some(format!("{path} changed"))
            } else if config_changed {
                Some("arbor.toml changed".into())
            } else {
                None
            };
            let reuse = why.is_none();
            if !reuse && parent_reused {
                worst.0 += child.account.grant;
                worst.1 += child.usd.as_ref().map_or(0, |u| u.grant);
            }
            jobs.push(PlannedJob {
                lineage: lineage.clone(),
                agent,
                depth: child.depth,
                reuse,
                why,
                grant_tokens: child.account.grant,
            });
            plan(
                child,
                Some(&lineage),
                reuse,
                changed_of,
                config_changed,
                jobs,
                worst,
            );
        }
    }
    plan(
        &root,
        None,
        true,
        &changed_of,
        config_changed,
        &mut jobs,
        &mut worst,
    );
    Ok(RerunPlan {
        replay_of: run,
        flow: recorded.spec.flow.clone(),
        changed,
        jobs,
        worst_case_tokens: worst.0,
        worst_case_usd_micros: usd.then_some(worst.1),
        spec: recorded.spec,
        tape: recorded.tape,
    })
}

/// Starts the rerun `plan` as a new run linked to the failed one
/// (`spec.replay.of`): its reused jobs are served from the recording, up to
/// a request that differs (then they go on live); the rest run live.
pub async fn rerun(
    node: &EmbeddedNode,
    workspace: &Workspace,
    plan: RerunPlan,
    record: bool,
) -> Result<RunId, ReplayError> {
    let (spec, tape) = rerun_spec(workspace, plan, record);
    node.start_replay(spec, Arc::new(tape))
        .await
        .map_err(|e| ReplayError::Start(e.to_string()))
}

/// The spec of the rerun `plan` (and its recording, to hand its Run).
pub fn rerun_spec(workspace: &Workspace, plan: RerunPlan, record: bool) -> (RunSpec, Tape) {
    let reuse = plan
        .jobs
        .iter()
        .filter(|j| j.reuse)
        .map(|j| j.lineage.clone())
        .collect();
    let mut spec = workspace.recording(
        RunSpec {
            replay: None,
            ..plan.spec
        },
        record,
    );
    spec.replay = Some(ReplaySpec {
        of: plan.replay_of,
        tools: ToolReplay::Recorded,
        after_divergence: AfterDivergence::Live,
        reuse: Some(reuse),
    });
    // A rerun is a new admission: what runs live runs as the files are now
    // (`allow_changed` said they may differ).
    spec.version = Some(workspace.version.clone());
    (spec, plan.tape)
}

/// Writes recorded run `run` as an offline example: a copy of the workspace
/// `from` in `to` (which must not exist), where each agent the run's jobs
/// were answers with a `script:` of the answers its recorded job got (its
/// `model:` removed: the scripted model). Returns what a person should know:
/// an agent whose jobs answered differently gets its first job's answers
/// (a script is one list per agent), and a call that ended in an error is
/// not a turn.
pub fn as_script(
    journal: &Journal,
    run: RunId,
    from: &Path,
    to: &Path,
) -> Result<Vec<String>, ReplayError> {
    let recorded = recorded(journal, run)?;
    let fail = |path: &Path, message: String| ReplayError::Script {
        path: path.to_path_buf(),
        message,
    };
    if to.exists() {
        return Err(fail(
            to,
            "exists already: give a folder that does not".into(),
        ));
    }
    copy_workspace(from, to)
        .map_err(|e| fail(to, format!("cannot copy the workspace here: {e}")))?;
    let mut notes = vec![];
    let mut scripts: BTreeMap<String, (String, Vec<serde_json::Value>, usize)> = BTreeMap::new();
    for (lineage, agent) in &recorded.agents {
        let Some(tape) = recorded.tape.get(lineage) else {
            continue;
        };
        let mut turns = vec![];
        for (at, call) in tape.calls.iter().enumerate() {
            match &call.outcome {
                arbor_protocol::tape::CallOutcome::Answer {
                    text, calls, usage, ..
                } => {
                    let mut turn = serde_json::Map::new();
                    if let Some(text) = text.as_ref().filter(|t| !t.is_empty()) {
                        turn.insert("say".into(), text.clone().into());
                    }
                    let calls: Vec<serde_json::Value> = calls
                        .iter()
                        .map(|c| serde_json::json!({"tool": c.tool, "args": c.args}))
                        .collect();
                    if !calls.is_empty() {
                        turn.insert("call".into(), calls.into());
                    }
                    if let Some(usage) = usage {
                        turn.insert(
                            "usage".into(),
                            serde_json::json!({"input": usage.input_tokens, "output": usage.output_tokens}),
                        );
                    }
                    turns.push(serde_json::Value::Object(turn));
                }
                _ => notes.push(format!(
                    "{lineage}: call {} ended in an error or a stop, which a script cannot say; it is left out",
                    at + 1
                )),
            }
        }
        match scripts.get_mut(agent) {
            None => {
                scripts.insert(agent.clone(), (lineage.clone(), turns, 1));
            }
            Some((first, script, _)) if *script != turns => notes.push(format!(
                "agent {agent}: job {lineage} answered otherwise than {first}; the script is {first}'s"
            )),
            Some((_, _, same)) => *same += 1,
        }
    }
    for (agent, (_, turns, _)) in scripts {
        let path = to.join("agents").join(&agent).join("agent.md");
        let text = std::fs::read_to_string(&path).map_err(|e| fail(&path, e.to_string()))?;
        let (yaml, prompt) =
            crate::workspace::split_front_matter(&text).map_err(|m| fail(&path, m))?;
        let mut front: serde_json::Value = if yaml.trim().is_empty() {
            serde_json::json!({})
        } else {
            serde_saphyr::from_str(yaml).map_err(|e| fail(&path, e.to_string()))?
        };
        let Some(map) = front.as_object_mut() else {
            return Err(fail(&path, "its front matter is not a mapping".into()));
        };
        map.remove("model");
        map.insert("script".into(), turns.into());
        let yaml = serde_saphyr::to_string(&front).map_err(|e| fail(&path, e.to_string()))?;
        std::fs::write(&path, format!("---\n{yaml}---\n{prompt}"))
            .map_err(|e| fail(&path, e.to_string()))?;
    }
    crate::workspace::Workspace::load(to)
        .map_err(|e| fail(to, format!("the written workspace does not load: {e}")))?;
    Ok(notes)
}

/// `from`'s files in `to`, but its data dir (`.arbor`) and other hidden ones.
fn copy_workspace(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_workspace(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}
