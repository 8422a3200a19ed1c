//! The run as a tree, folded from its events. This is what `arbor run --json`
//! prints, what the live view draws and what tests read.

use crate::event::{Event, EventKind, McpServerState, NodeKind, ParentRef};
use crate::{ErrorClass, JobId, RunId, Status, TaskStatus};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// I-39: a job's events relayed into the run's timeline are bounded; past this
/// many, one elision marker counts the rest.
pub const EVENTS_PER_JOB: u64 = 200;

/// One node of `arbor run --json` (shared/contract/run-output.schema.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct TreeNode {
    pub id: String,
    pub kind: NodeKind,
    pub agent: Option<String>,
    /// The model it runs on, `provider/model` or `scripted` (I-55).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub label: Option<String>,
    pub status: Status,
    pub task_status: Option<TaskStatus>,
    pub reason: Option<String>,
    pub error_class: Option<ErrorClass>,
    pub depth: u32,
    pub attempt: u32,
    pub account: AccountView,
    /// The same figures in micro-dollars, when the run has a usd ceiling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usd: Option<AccountView>,
    pub output: serde_json::Value,
    pub error: Option<String>,
    pub limitations: Vec<String>,
    pub artifacts: Vec<String>,
    /// Where its artifacts are: artifacts are relative to this folder.
    pub workdir: Option<String>,
    pub turns: u32,
    /// Its tool calls so far, per tool (canonical names), whatever their outcome.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<String, u64>,
    /// Its MCP servers, by name: what each is now, and its restarts.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mcp: BTreeMap<String, McpServerView>,
    pub events_elided: u64,
    /// Messages its peers of a `peers` group sent it, in order: queued,
    /// and read once `turn` is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peer_messages: Vec<PeerMessageView>,
    /// The approval card it waits on, if it waits on one (I-46).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<WaitingView>,
    /// When it was admitted (a run: started), in ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When it ended, in ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// The run node only: the tenant whose run it is (I-63), when
    /// arbor.toml names tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The run node only: the schedule tick that started it (I-66).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<crate::ScheduleTick>,
    /// The run node only: the workspace version it runs with (I-67).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The run node only: its reviewer's finding (`verify`), once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review: Option<ReviewView>,
    /// A step's loop (`until`): each checked iteration up to this attempt, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub iterations: Vec<IterationView>,
    pub children: Vec<TreeNode>,
}

impl IterationView {
    /// An `iteration_checked` event's step label and view; None for any other kind.
    pub fn of(kind: &EventKind) -> Option<(&str, IterationView)> {
        let EventKind::IterationChecked {
            id,
            label,
            iteration,
            passed,
            verdict,
            issues,
            ended,
        } = kind
        else {
            return None;
        };
        let view = IterationView {
            iteration: *iteration,
            job: *id,
            passed: *passed,
            verdict: *verdict,
            issues: issues.clone(),
            ended: ended.clone(),
        };
        Some((label, view))
    }
}

/// A run's review (`verify`): accepted, or what was missing (the last
/// group then ran once more), or why it could not be made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ReviewView {
    /// The reviewer's job.
    pub job: JobId,
    pub accept: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// One checked iteration of a step's loop (`until`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct IterationView {
    pub iteration: u32,
    /// The attempt that ran it.
    pub job: JobId,
    pub passed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<crate::spec::VerdictKind>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub issues: Vec<String>,
    /// The loop ended here without passing, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
}

/// What a node waits on, named by `reason`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum WaitingView {
    /// A job's gated call waits for a person's decision on this card (I-46).
    Approval {
        card: crate::CardId,
        tool: String,
        deadline_ms: u64,
        /// Past `[approvals] warn_at` of its wait.
        #[serde(default)]
        expiring: bool,
    },
    /// The run (for a step) or a job (for its child) waits to try `label`
    /// again: attempt `attempt` starts at `until_ms` (its retry policy).
    Retry {
        /// The attempt that failed.
        job: JobId,
        label: String,
        attempt: u32,
        class: ErrorClass,
        until_ms: u64,
    },
    /// The run waits for a person: step `label` (its attempt `job`) was
    /// interrupted by a restart and may have acted outside its workdir
    /// (`why`); `arbor continue JOB` runs it again, a stop ends the run.
    NeedsDecision {
        job: JobId,
        label: String,
        why: String,
    },
    /// The run reached its ceiling and pauses (`on_ceiling = "pause"`):
    /// a top-up of at least `needs` lets its waiting steps go on; at
    /// `deadline_ms` they end as they would have without the pause.
    Budget {
        needs: crate::Amount,
        deadline_ms: u64,
    },
}

impl WaitingView {
    /// The approval card it waits on, if it waits on one.
    pub fn card(&self) -> Option<crate::CardId> {
        match self {
            WaitingView::Approval { card, .. } => Some(*card),
            WaitingView::Retry { .. }
            | WaitingView::NeedsDecision { .. }
            | WaitingView::Budget { .. } => None,
        }
    }
}

/// A message a peer sent a step (`send_peer`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PeerMessageView {
    /// The sender's label.
    pub from: String,
    pub message_id: u64,
    /// The turn that read it; none while it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
}

/// One MCP server of a job, as its events tell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct McpServerView {
    pub state: McpServerState,
    pub restarts: u32,
}

/// Tokens: granted to the node, spent by it and its settled descendants, held
/// for running children and in-flight model calls.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct AccountView {
    pub grant: u64,
    pub spent: u64,
    pub held: u64,
}

impl AccountView {
    pub fn available(&self) -> i128 {
        self.grant as i128 - self.spent as i128 - self.held as i128
    }
}

#[derive(Clone, Debug)]
struct Entry {
    node: TreeNode,
    parent: Option<JobId>,
    children: Vec<JobId>,
    /// Tokens its own model calls spent, to check that spent = own + settled children.
    own_spent: u64,
    /// Micro-dollars its own model calls cost.
    own_usd_micros: u64,
    events: u64,
}

/// A run's tree, built by applying its events in order.
#[derive(Clone, Debug)]
pub struct Tree {
    run: RunId,
    root: TreeNode,
    root_children: Vec<JobId>,
    root_own_spent: u64,
    root_own_usd_micros: u64,
    entries: HashMap<JobId, Entry>,
    /// Each looping step's checked iterations so far, by label.
    loops: HashMap<String, Vec<IterationView>>,
    /// Every event applied, as the run's bounded timeline would keep them.
    timeline_len: u64,
    /// The last event's seq: events are applied in seq order (I-39).
    last_seq: u64,
}

impl Tree {
    pub fn new(run: RunId) -> Self {
        Self {
            run,
            root: TreeNode {
                id: run.to_string(),
                kind: NodeKind::Run,
                agent: None,
                model: None,
                label: None,
                status: Status::Pending,
                task_status: None,
                reason: None,
                error_class: None,
                depth: 0,
                attempt: 1,
                account: AccountView::default(),
                usd: None,
                output: serde_json::Value::Null,
                error: None,
                limitations: vec![],
                artifacts: vec![],
                workdir: None,
                turns: 0,
                tools: BTreeMap::new(),
                mcp: BTreeMap::new(),
                events_elided: 0,
                peer_messages: vec![],
                waiting: None,
                started_at_ms: None,
                ended_at_ms: None,
                tenant: None,
                schedule: None,
                version: None,
                review: None,
                iterations: vec![],
                children: vec![],
            },
            root_children: vec![],
            root_own_spent: 0,
            root_own_usd_micros: 0,
            entries: HashMap::new(),
            loops: HashMap::new(),
            timeline_len: 0,
            last_seq: 0,
        }
    }

    pub fn run_id(&self) -> RunId {
        self.run
    }

    /// The tenant whose run it is, once its start is applied (I-63).
    pub fn tenant(&self) -> Option<&str> {
        self.root
            .started_at_ms
            .is_some()
            .then(|| self.root.tenant.as_deref().unwrap_or(crate::DEFAULT_TENANT))
    }

    /// Folds one event in. Events of other runs are ignored.
    pub fn apply(&mut self, event: &Event) {
        if event.run != self.run {
            return;
        }
        // I-39: a run's events are folded in the order they were emitted.
        debug_assert!(
            event.seq > self.last_seq || event.seq == 0,
            "event {} applied after {}",
            event.seq,
            self.last_seq
        );
        self.last_seq = event.seq;
        if let Some(id) = event.kind.job()
            && let Some(entry) = self.entries.get_mut(&id)
        {
            entry.events += 1;
            if entry.events > EVENTS_PER_JOB {
                entry.node.events_elided += 1;
                // Counted, not kept: the state change below still applies.
            } else {
                self.timeline_len += 1;
            }
        } else {
            self.timeline_len += 1;
        }
        match &event.kind {
            EventKind::RunStarted {
                budget_tokens,
                budget_usd_micros,
                spec,
                ..
            } => {
                self.root.tenant = spec.tenant.clone();
                self.root.schedule = spec.schedule.clone();
                self.root.version = spec.version.clone();
                self.root.status = Status::Running;
                self.root.started_at_ms.get_or_insert(event.at_ms);
                self.root.account.grant = *budget_tokens;
                self.root.usd = budget_usd_micros.map(|grant| AccountView {
                    grant,
                    spent: 0,
                    held: 0,
                });
            }
            EventKind::RunResumed { .. } => {
                self.root.status = Status::Running;
                self.root.reason = None;
            }
            EventKind::RunFinished {
                status,
                error_class,
                reason,
                output,
                limitations,
            } => {
                self.root.status = *status;
                self.root.ended_at_ms = Some(event.at_ms);
                self.root.error_class = *error_class;
                self.root.reason = reason.clone();
                self.root.output = output.clone();
                self.root.limitations = limitations.clone();
                self.root.waiting = None;
                self.root.task_status = match status {
                    Status::Done if limitations.is_empty() => Some(TaskStatus::Completed),
                    Status::Done => Some(TaskStatus::Partial),
                    _ => None,
                };
            }
            EventKind::JobSpawned {
                id,
                parent,
                kind,
                agent,
                label,
                depth,
                attempt,
                grant_tokens,
                grant_usd_micros,
                workdir,
                model,
                ..
            } => {
                let parent_job = match parent {
                    ParentRef::Run(_) => {
                        self.root_children.push(*id);
                        None
                    }
                    ParentRef::Job(p) => {
                        if let Some(pe) = self.entries.get_mut(p) {
                            pe.children.push(*id);
                        }
                        Some(*p)
                    }
                };
                let mut node = self.root.clone();
                node.id = id.to_string();
                node.kind = *kind;
                node.agent = Some(agent.clone());
                node.model = (!model.is_empty()).then(|| model.clone());
                node.label = label.clone();
                node.status = Status::Pending;
                node.started_at_ms = Some(event.at_ms);
                node.ended_at_ms = None;
                node.depth = *depth;
                node.attempt = *attempt;
                node.account = AccountView {
                    grant: *grant_tokens,
                    spent: 0,
                    held: 0,
                };
                node.usd = grant_usd_micros.map(|grant| AccountView {
                    grant,
                    spent: 0,
                    held: 0,
                });
                node.output = serde_json::Value::Null;
                node.error_class = None;
                node.reason = None;
                node.task_status = None;
                node.workdir = Some(workdir.clone());
                node.children = vec![];
                node.tools = BTreeMap::new();
                node.mcp = BTreeMap::new();
                node.waiting = None;
                node.tenant = None;
                node.schedule = None;
                node.version = None;
                let waiter = match parent_job {
                    Some(p) => self.entries.get_mut(&p).map(|e| &mut e.node),
                    None => Some(&mut self.root),
                };
                if let Some(w) = waiter
                    && matches!(&w.waiting, Some(WaitingView::Retry { label: l, .. }
                        | WaitingView::NeedsDecision { label: l, .. })
                        if Some(l) == label.as_ref())
                {
                    w.waiting = None;
                }
                self.entries.insert(
                    *id,
                    Entry {
                        node,
                        parent: parent_job,
                        children: vec![],
                        own_spent: 0,
                        own_usd_micros: 0,
                        events: 1,
                    },
                );
            }
            EventKind::JobRunning { id } => {
                if let Some(e) = self.entries.get_mut(id)
                    && !e.node.status.is_terminal()
                {
                    e.node.status = Status::Running;
                }
            }
            EventKind::JobFinished { reason, result, .. } => {
                if let Some(e) = self.entries.get_mut(&result.job) {
                    let n = &mut e.node;
                    n.status = result.status;
                    n.ended_at_ms = Some(event.at_ms);
                    n.task_status = result.task_status;
                    n.error_class = result.error_class;
                    n.reason = reason.clone();
                    n.output = result.output.clone();
                    n.error = result.error.clone();
                    n.limitations = result.limitations.clone();
                    n.artifacts = result.artifacts.clone();
                    n.turns = result.turns;
                    n.waiting = None;
                }
            }
            EventKind::AccountChanged {
                owner,
                grant,
                spent,
                held,
                usd,
            } => {
                let view = AccountView {
                    grant: *grant,
                    spent: *spent,
                    held: *held,
                };
                let node = match owner {
                    ParentRef::Run(_) => Some(&mut self.root),
                    ParentRef::Job(id) => self.entries.get_mut(id).map(|e| &mut e.node),
                };
                if let Some(node) = node {
                    node.account = view;
                    if usd.is_some() {
                        node.usd = *usd;
                    }
                }
            }
            EventKind::ToolCalled { id, tool, .. } => {
                if let Some(e) = self.entries.get_mut(id) {
                    *e.node.tools.entry(tool.clone()).or_default() += 1;
                }
            }
            EventKind::McpServer {
                id,
                server,
                state,
                restarts,
                ..
            } => {
                if let Some(e) = self.entries.get_mut(id) {
                    let view = McpServerView {
                        state: *state,
                        restarts: *restarts,
                    };
                    e.node.mcp.insert(server.clone(), view);
                }
            }
            EventKind::ApprovalRequested {
                id,
                card,
                tool,
                deadline_ms,
            } => {
                // A step's go-ahead is asked before the step has a node: the run waits.
                let node = self.waiter(*id);
                node.waiting = Some(WaitingView::Approval {
                    card: *card,
                    tool: tool.clone(),
                    deadline_ms: *deadline_ms,
                    expiring: false,
                });
            }
            EventKind::ApprovalExpiring { id, card, .. } => {
                if let Some(WaitingView::Approval {
                    card: waits_on,
                    expiring,
                    ..
                }) = self.waiter(*id).waiting.as_mut()
                    && waits_on == card
                {
                    *expiring = true;
                }
            }
            EventKind::ApprovalDecided { id, card, .. } => {
                let node = self.waiter(*id);
                if matches!(&node.waiting,
                    Some(WaitingView::Approval { card: waits_on, .. }) if waits_on == card)
                {
                    node.waiting = None;
                }
            }
            EventKind::RetryWaiting {
                id,
                label,
                attempt,
                class,
                until_ms,
            } => {
                let view = WaitingView::Retry {
                    job: *id,
                    label: label.clone(),
                    attempt: *attempt,
                    class: *class,
                    until_ms: *until_ms,
                };
                self.set_waiting_above(*id, view);
            }
            EventKind::ModelFallback { id, to, .. } => {
                if let Some(e) = self.entries.get_mut(id) {
                    e.node.model = Some(to.clone());
                }
            }
            EventKind::IterationChecked { id, .. } => {
                if let Some((label, view)) = IterationView::of(&event.kind) {
                    let checked = self.loops.entry(label.to_string()).or_default();
                    checked.push(view);
                    if let Some(e) = self.entries.get_mut(id) {
                        e.node.iterations = checked.clone();
                    }
                }
            }
            EventKind::Reviewed {
                id,
                accept,
                missing,
                failed,
            } => {
                self.root.review = Some(ReviewView {
                    job: *id,
                    accept: *accept,
                    missing: missing.clone(),
                    failed: failed.clone(),
                });
            }
            EventKind::BudgetReached {
                needs, deadline_ms, ..
            } => {
                // What the latest waiter asked for: the least top-up
                // after which the next step goes on.
                self.root.waiting = Some(WaitingView::Budget {
                    needs: *needs,
                    deadline_ms: *deadline_ms,
                });
            }
            EventKind::BudgetPauseEnded { .. } => {
                if matches!(self.root.waiting, Some(WaitingView::Budget { .. })) {
                    self.root.waiting = None;
                }
            }
            EventKind::NeedsDecision { id, label, why } => {
                let view = WaitingView::NeedsDecision {
                    job: *id,
                    label: label.clone(),
                    why: why.clone(),
                };
                self.set_waiting_above(*id, view);
            }
            EventKind::ModelCalled {
                id,
                input_tokens,
                output_tokens,
                call,
                ..
            } => {
                if let Some(e) = self.entries.get_mut(id) {
                    e.own_spent += input_tokens + output_tokens;
                    e.own_usd_micros += call.usd_micros;
                }
            }
            EventKind::Recovered { .. }
            | EventKind::WindDown { .. }
            | EventKind::ContextCompacted { .. }
            | EventKind::ContextPressure { .. }
            | EventKind::BudgetOverrun { .. }
            | EventKind::ToolStarted { .. }
            | EventKind::Refused { .. }
            | EventKind::SteerQueued { .. }
            | EventKind::SteerDelivered { .. }
            | EventKind::SteerDiscarded { .. } => {}
            EventKind::PeerQueued {
                id,
                from,
                message_id,
                ..
            } => {
                if let Some(e) = self.entries.get_mut(id) {
                    e.node.peer_messages.push(PeerMessageView {
                        from: from.clone(),
                        message_id: *message_id,
                        turn: None,
                    });
                }
            }
            EventKind::PeerDelivered {
                id,
                message_id,
                turn,
                ..
            } => {
                if let Some(m) = self.entries.get_mut(id).and_then(|e| {
                    e.node
                        .peer_messages
                        .iter_mut()
                        .find(|m| m.message_id == *message_id)
                }) {
                    m.turn = Some(*turn);
                }
            }
        }
    }

    /// `view` on the node above `id`: its parent job's, or the run's for a
    /// step, and for one the tree has not seen (a crash can take a step's
    /// `JobSpawned` while its record, committed first, survives).
    /// The node a card of job `id` waits at: the job's, or the run's when
    /// the job has no node yet (a step waiting for its go-ahead).
    fn waiter(&mut self, id: JobId) -> &mut TreeNode {
        match self.entries.get_mut(&id) {
            Some(e) => &mut e.node,
            None => &mut self.root,
        }
    }

    fn set_waiting_above(&mut self, id: JobId, view: WaitingView) {
        match self.entries.get(&id).and_then(|e| e.parent) {
            Some(parent) => {
                if let Some(p) = self.entries.get_mut(&parent) {
                    p.node.waiting = Some(view);
                }
            }
            None => self.root.waiting = Some(view),
        }
    }

    /// The run's own node, without its children (nothing is copied).
    pub fn head(&self) -> &TreeNode {
        &self.root
    }

    /// The whole tree, children in spawn order.
    pub fn root(&self) -> TreeNode {
        let mut root = self.root.clone();
        root.children = self.root_children.iter().map(|c| self.build(*c)).collect();
        root
    }

    fn build(&self, id: JobId) -> TreeNode {
        let e = &self.entries[&id];
        let mut node = e.node.clone();
        node.children = e.children.iter().map(|c| self.build(*c)).collect();
        node
    }

    /// Visits the run and every node below it in the order `root` lists
    /// them (depth first, children in spawn order), without building a
    /// copy of the tree. `f` gets each node (whose `children` are empty
    /// here) and, for each level from the run's children down to the node
    /// itself, whether the node at that level is the last of its siblings:
    /// all a drawing needs for its branches.
    pub fn walk(&self, mut f: impl FnMut(&TreeNode, &[bool])) {
        f(&self.root, &[]);
        let mut path = Vec::new();
        self.walk_below(&self.root_children, &mut path, &mut f);
    }

    fn walk_below(
        &self,
        children: &[JobId],
        path: &mut Vec<bool>,
        f: &mut impl FnMut(&TreeNode, &[bool]),
    ) {
        for (i, id) in children.iter().enumerate() {
            let Some(e) = self.entries.get(id) else {
                continue;
            };
            path.push(i + 1 == children.len());
            f(&e.node, path);
            self.walk_below(&e.children, path, f);
            path.pop();
        }
    }

    /// One step or job with its descendants, as `root` would show it.
    pub fn subtree(&self, id: JobId) -> Option<TreeNode> {
        self.entries.contains_key(&id).then(|| self.build(id))
    }

    pub fn node(&self, id: JobId) -> Option<&TreeNode> {
        self.entries.get(&id).map(|e| &e.node)
    }

    pub fn parent_of(&self, id: JobId) -> Option<JobId> {
        self.entries.get(&id).and_then(|e| e.parent)
    }

    pub fn children_of(&self, id: JobId) -> Vec<JobId> {
        self.entries
            .get(&id)
            .map(|e| e.children.clone())
            .unwrap_or_default()
    }

    /// Every step and job, in no particular order.
    pub fn nodes(&self) -> impl Iterator<Item = (JobId, &TreeNode)> {
        self.entries.iter().map(|(id, e)| (*id, &e.node))
    }

    /// The first node with this label (or agent name when no label matches).
    pub fn find(&self, label_or_agent: &str) -> Option<JobId> {
        let mut by_label: Vec<_> = self
            .entries
            .iter()
            .filter(|(_, e)| e.node.label.as_deref() == Some(label_or_agent))
            .map(|(id, _)| *id)
            .collect();
        if by_label.is_empty() {
            by_label = self
                .entries
                .iter()
                .filter(|(_, e)| e.node.agent.as_deref() == Some(label_or_agent))
                .map(|(id, _)| *id)
                .collect();
        }
        by_label.sort();
        by_label.first().copied()
    }

    pub fn run_status(&self) -> Status {
        self.root.status
    }

    /// I-14 at a quiescent point: for every account, grant = spent + held +
    /// available with available >= 0, and spent = own model spend + the spent
    /// of every settled child. Returns every breach, described.
    pub fn check_conservation(&self) -> Result<(), Vec<String>> {
        let mut breaches = vec![];
        // Tokens, then micro-dollars where a node has them: the same rules.
        for usd in [false, true] {
            let view = |n: &TreeNode| if usd { n.usd } else { Some(n.account) };
            let unit = if usd { "usd " } else { "" };
            let mut check = |name: String, acct: AccountView, own: u64, kids: &[JobId]| {
                if acct.available() < 0 {
                    breaches.push(format!(
                        "{unit}{name}: spent {} + held {} exceed grant {}",
                        acct.spent, acct.held, acct.grant
                    ));
                }
                let kids: Vec<&Entry> = kids.iter().filter_map(|k| self.entries.get(k)).collect();
                let settled: u64 = kids
                    .iter()
                    .filter(|k| k.node.status.is_terminal())
                    .filter_map(|k| view(&k.node))
                    .map(|v| v.spent)
                    .sum();
                let running_grants: u64 = kids
                    .iter()
                    .filter(|k| !k.node.status.is_terminal())
                    .filter_map(|k| view(&k.node))
                    .map(|v| v.grant)
                    .sum();
                if acct.spent != own + settled {
                    breaches.push(format!(
                        "{unit}{name}: spent {} != own {} + settled children {}",
                        acct.spent, own, settled
                    ));
                }
                if acct.held < running_grants {
                    breaches.push(format!(
                        "{unit}{name}: held {} < grants of running children {}",
                        acct.held, running_grants
                    ));
                }
            };
            if let Some(acct) = view(&self.root) {
                let own = if usd {
                    self.root_own_usd_micros
                } else {
                    self.root_own_spent
                };
                check(format!("run {}", self.run), acct, own, &self.root_children);
            }
            let mut ended_holding = vec![];
            for (id, e) in &self.entries {
                let Some(acct) = view(&e.node) else { continue };
                if e.node.status.is_terminal() && acct.held != 0 {
                    ended_holding.push(format!(
                        "{unit}{} {id} ended but still holds {}",
                        e.node.kind.as_str(),
                        acct.held
                    ));
                }
                let own = if usd { e.own_usd_micros } else { e.own_spent };
                check(
                    format!("{} {}", e.node.kind.as_str(), id),
                    acct,
                    own,
                    &e.children,
                );
            }
            breaches.extend(ended_holding);
        }
        if breaches.is_empty() {
            Ok(())
        } else {
            Err(breaches)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, EventKind, NodeKind, ParentRef};

    fn at(run: RunId, seq: u64, kind: EventKind) -> Event {
        Event {
            seq,
            run,
            at_ms: 0,
            kind,
        }
    }

    fn spawned(run: RunId, id: JobId, parent: ParentRef, grant: u64) -> EventKind {
        EventKind::JobSpawned {
            grant_usd_micros: None,
            id,
            parent,
            kind: NodeKind::Step,
            agent: "a".into(),
            label: None,
            depth: 0,
            attempt: 1,
            grant_tokens: grant,
            workdir: format!("/w/{run}"),
            record_seq: 1,
            request: "x".into(),
            call: None,
            model: "scripted".into(),
        }
    }

    fn finished(id: JobId, spent: u64) -> EventKind {
        EventKind::job_finished(
            crate::ResultEnvelope {
                job: id,
                label: None,
                attempt: 1,
                agent: "a".into(),
                status: Status::Done,
                task_status: Some(TaskStatus::Completed),
                output: serde_json::Value::Null,
                error: None,
                error_class: None,
                limitations: vec![],
                artifacts: vec![],
                tokens_spent: spent,
                usd_micros_spent: 0,
                turns: 1,
                workdir: "/w".into(),
            },
            None,
            false,
        )
    }

    fn account(owner: ParentRef, grant: u64, spent: u64, held: u64) -> EventKind {
        EventKind::AccountChanged {
            usd: None,
            owner,
            grant,
            spent,
            held,
        }
    }

    /// `walk` visits what `root` builds, in the same order, and says at
    /// each level whether the node there is the last of its siblings.
    #[test]
    fn a_walk_visits_the_nodes_root_lists_in_its_order() {
        let run = RunId::new();
        let (a, b, a1, a2) = (JobId::new(), JobId::new(), JobId::new(), JobId::new());
        let job = |id, parent| spawned(run, id, parent, 10);
        let events = [
            job(a, ParentRef::Run(run)),
            job(b, ParentRef::Run(run)),
            job(a1, ParentRef::Job(a)),
            job(a2, ParentRef::Job(a)),
        ];
        let mut tree = Tree::new(run);
        for (i, kind) in events.into_iter().enumerate() {
            tree.apply(&at(run, i as u64, kind));
        }
        fn flatten(node: &TreeNode, out: &mut Vec<String>) {
            out.push(node.id.clone());
            for child in &node.children {
                flatten(child, out);
            }
        }
        let mut built = vec![];
        flatten(&tree.root(), &mut built);
        let mut walked = vec![];
        tree.walk(|node, last| walked.push((node.id.clone(), last.to_vec())));
        assert_eq!(
            walked.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(),
            built
        );
        let lasts: Vec<Vec<bool>> = walked.into_iter().map(|(_, l)| l).collect();
        assert_eq!(
            lasts,
            vec![
                vec![],
                vec![false],
                vec![false, false],
                vec![false, true],
                vec![true]
            ]
        );
    }

    /// A run waits on a retry or a person: shown on the run node, even for
    /// a step whose `JobSpawned` a crash took; the step's next attempt
    /// ends the wait, and a job's child's retry shows on the job.
    #[test]
    fn a_wait_shows_above_the_attempt_and_the_next_attempt_ends_it() {
        let run = RunId::new();
        let (lost, next, job, child) = (JobId::new(), JobId::new(), JobId::new(), JobId::new());
        let mut tree = Tree::new(run);
        let mut seq = 0;
        let mut apply = |tree: &mut Tree, kind| {
            seq += 1;
            tree.apply(&at(run, seq, kind));
        };
        apply(
            &mut tree,
            EventKind::NeedsDecision {
                id: lost,
                label: "pay".into(),
                why: "payer: holds secrets KEY".into(),
            },
        );
        assert!(matches!(
            &tree.head().waiting,
            Some(WaitingView::NeedsDecision { job, label, .. }) if *job == lost && label == "pay"
        ));
        let mut again = spawned(run, next, ParentRef::Run(run), 10);
        if let EventKind::JobSpawned { label, attempt, .. } = &mut again {
            *label = Some("pay".into());
            *attempt = 2;
        }
        apply(&mut tree, again);
        assert_eq!(tree.head().waiting, None);
        apply(&mut tree, spawned(run, job, ParentRef::Run(run), 10));
        apply(&mut tree, spawned(run, child, ParentRef::Job(job), 5));
        apply(
            &mut tree,
            EventKind::RetryWaiting {
                id: child,
                label: "c".into(),
                attempt: 2,
                class: ErrorClass::ModelServer,
                until_ms: 7,
            },
        );
        assert_eq!(tree.head().waiting, None);
        assert!(matches!(
            tree.node(job).and_then(|n| n.waiting.as_ref()),
            Some(WaitingView::Retry { until_ms: 7, .. })
        ));
    }

    #[test]
    fn inv_14_the_tree_finds_an_account_that_does_not_add_up() {
        let run = RunId::new();
        let step = JobId::new();
        let model = EventKind::ModelCalled {
            id: step,
            turn: 0,
            reserved: 50,
            input_tokens: 30,
            output_tokens: 10,
            truncated: false,
            wind_down: false,
            call: Default::default(),
        };
        let good = [
            EventKind::RunStarted {
                budget_usd_micros: None,
                flow: "f".into(),
                budget_tokens: 100,
                spec: Box::new(crate::RunSpec::single("a", "x", 100)),
            },
            spawned(run, step, ParentRef::Run(run), 100),
            account(ParentRef::Run(run), 100, 0, 100),
            model.clone(),
            account(ParentRef::Job(step), 100, 40, 0),
            finished(step, 40),
            account(ParentRef::Run(run), 100, 40, 0),
        ];
        let mut tree = Tree::new(run);
        for (i, kind) in good.iter().enumerate() {
            tree.apply(&at(run, i as u64, kind.clone()));
        }
        assert_eq!(tree.check_conservation(), Ok(()));

        // The run charged less than its step spent.
        let mut bad = tree.clone();
        bad.apply(&at(run, 99, account(ParentRef::Run(run), 100, 39, 0)));
        assert!(
            bad.check_conservation().unwrap_err()[0]
                .contains("spent 39 != own 0 + settled children 40")
        );
        // A step that ended still holding budget.
        let mut bad = tree.clone();
        bad.apply(&at(run, 99, account(ParentRef::Job(step), 100, 40, 5)));
        assert!(
            bad.check_conservation()
                .unwrap_err()
                .iter()
                .any(|b| b.contains("ended but still holds 5"))
        );
        // More spent and held than granted.
        let mut bad = tree;
        bad.apply(&at(run, 99, account(ParentRef::Run(run), 100, 40, 61)));
        assert!(bad.check_conservation().unwrap_err()[0].contains("exceed grant 100"));
    }
}
