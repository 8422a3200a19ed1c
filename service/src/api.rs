//! The API's request and response bodies. Their JSON Schemas, generated
//! from these types, are what `/v1/openapi.json` says.

use arbor_protocol::{
    AccountView, BudgetArg, Card, CardId, CardState, ErrorClass, Event, JobId, RunId, Status,
    TreeNode, Verdict,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `POST /v1/runs`: a flow, or one agent on an input.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("oneOf" = [
    {"required": ["flow"], "not": {"required": ["agent"]}},
    {"required": ["agent", "input"], "not": {"required": ["flow"]}}
]))]
pub struct SubmitRun {
    /// A flow of the workspace (flows/NAME.toml). Give this, or `agent` and `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", length(min = 1))]
    pub flow: Option<String>,
    /// One agent of the workspace, run on `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", length(min = 1))]
    pub agent: Option<String>,
    /// The instruction for `agent` (text, not only blanks); or what a
    /// `flow` that declares an `input` is given: text, or JSON that meets
    /// its schema (JSON sent as text is read as JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// Overrides the flow's (or arbor.toml's) budget: whole tokens, and
    /// dollars as a number (metered in micro-dollars). Never 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetArg>,
    /// Record the run's model exchanges and tool results, so it can be
    /// replayed (`[record] models = true` records every run).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub record: bool,
    /// The tenant the run is for. A credential of one tenant submits for
    /// its own (naming another is a 404); one of every tenant names it, or
    /// submits for `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", length(min = 1))]
    pub tenant: Option<String>,
    /// At the run's ceiling: `end`, or `pause` for a top-up (I-58); the
    /// flow's if not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_ceiling: Option<arbor_protocol::OnCeiling>,
    /// How long a pause waits for a top-up (`90m`, `24h`); 24 h if not
    /// said. Only with a pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", length(min = 1))]
    pub pause_timeout: Option<String>,
    /// Its place among its tenant's queued runs: 1 starts first, 5 last;
    /// 3 if not said. Other tenants' runs are not passed by it: the queue
    /// serves tenants in turn, by their `weight`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 5))]
    pub priority: Option<u8>,
}

/// Where to find a run.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunLinks {
    #[serde(rename = "self")]
    pub this: String,
    pub events: String,
    pub stop: String,
}

impl RunLinks {
    pub fn of(run: RunId) -> Self {
        Self {
            this: format!("/v1/runs/{run}"),
            events: format!("/v1/runs/{run}/events"),
            stop: format!("/v1/runs/{run}/stop"),
        }
    }
}

/// The answer to a submission.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunCreated {
    pub id: RunId,
    pub status: Status,
    /// True when an earlier request with the same `Idempotency-Key` and body
    /// made this run; nothing new was queued.
    pub replayed: bool,
    pub links: RunLinks,
}

/// `POST /v1/runs/{id}/replay`: a recorded run replayed as a new run, or a
/// failed one rerun keeping what worked (docs/replay.md).
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRun {
    /// Where exec, read_file and MCP results come from: `recorded` (the
    /// default) or `live`.
    #[serde(default)]
    pub tools: arbor_protocol::tape::ToolReplay,
    /// At the first request that differs: `fail` (the default), or `live`,
    /// going on against the configured models.
    #[serde(default)]
    pub after_divergence: arbor_protocol::tape::AfterDivergence,
    /// Rerun a failed run: the jobs that completed, with their agent and
    /// arbor.toml unchanged, are served from the recording; the rest run live.
    #[serde(default)]
    pub rerun_failed: bool,
    /// With `rerun_failed`: answer the plan (200), start nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// With `rerun_failed`: go on although definitions changed (named).
    #[serde(default)]
    pub allow_changed: bool,
    /// Record the new run too.
    #[serde(default)]
    pub record: bool,
    /// Replay against the workspace as it is now, not the version the
    /// recorded run was admitted with: to see what an edit changes.
    #[serde(default)]
    pub current: bool,
}

/// The answer to a replay: the new run, queued, and the run it replays.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ReplayStarted {
    pub id: RunId,
    pub replay_of: RunId,
    pub status: Status,
    pub links: RunLinks,
}

/// `GET /v1/runs/{id}`: the same document `arbor run --json` prints
/// (docs/contract/run-output.schema.json).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunDocument {
    pub run: TreeNode,
    /// On a shared journal ([journal] backend = "postgres"): the node that
    /// owns the run, and the run's epoch there (docs/cluster.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

/// One line of `GET /v1/runs`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunSummary {
    pub id: RunId,
    pub flow: String,
    pub status: Status,
    pub error_class: Option<ErrorClass>,
    pub reason: Option<String>,
    pub budget_tokens: u64,
    /// When it was submitted, in ms since the Unix epoch (its id's time).
    pub created_at_ms: u64,
    /// When it started and ended, in ms since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// Its account in tokens: the ceiling (`grant`), `spent` and `held`,
    /// once it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<AccountView>,
    /// The same in micro-dollars, for a run with a usd ceiling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usd: Option<AccountView>,
    /// Its place in the queue (0 starts next), while it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// A failed run's first failing step or job: where its failure began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_job: Option<FailedJob>,
    /// The tenant whose run it is, when arbor.toml names tenants (I-63).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The schedule tick that started it, if a schedule did (I-66).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<arbor_protocol::ScheduleTick>,
    /// The workspace version it runs with (I-67).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// The step or job a failed run's failure began at: the first to fail.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct FailedJob {
    pub id: String,
    pub agent: Option<String>,
    pub label: Option<String>,
    pub error_class: Option<ErrorClass>,
    pub error: Option<String>,
}

impl FailedJob {
    /// The first step or job of `tree` to end failed (the others failed
    /// after it, most often because of it), if one did.
    pub fn first_in(tree: &arbor_protocol::Tree) -> Option<Self> {
        tree.nodes()
            .map(|(_, node)| node)
            .filter(|node| node.status == Status::Failed)
            .min_by_key(|node| {
                (
                    node.ended_at_ms.unwrap_or(u64::MAX),
                    std::cmp::Reverse(node.depth),
                )
            })
            .map(|node| Self {
                id: node.id.clone(),
                agent: node.agent.clone(),
                label: node.label.clone(),
                error_class: node.error_class,
                error: node.error.clone().or_else(|| node.reason.clone()),
            })
    }
}

/// `GET /v1/runs`, newest first.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunList {
    pub runs: Vec<RunSummary>,
    /// Pass as `after` for the next page; absent on the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<RunId>,
}

/// The filter and page of `GET /v1/runs`.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunQuery {
    /// Only runs in this status.
    pub status: Option<Status>,
    /// At most this many (1 to 500; default 50).
    #[schemars(range(min = 1, max = 500))]
    pub limit: Option<u32>,
    /// Runs older than this one (the `next` of the previous page).
    pub after: Option<RunId>,
}

/// `GET /v1/jobs/{id}`: a step or job and everything below it.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct JobDocument {
    /// The run it belongs to.
    pub run: RunId,
    pub job: TreeNode,
    /// What its agent is allowed, as this node's workspace defines it
    /// (absent for an agent the workspace no longer has).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup: Option<JobSetup>,
    /// The messages sent to it (I-20), oldest first.
    #[serde(default)]
    pub steering: Vec<SteerView>,
}

impl JobSetup {
    pub fn of(agent: &arbor_protocol::AgentDef) -> Self {
        use arbor_protocol::{ModelRef, Network, SandboxMode};
        JobSetup {
            model: match &agent.model {
                ModelRef::Scripted => "scripted".into(),
                ModelRef::Provider { provider, model } => format!("{provider}/{model}"),
            },
            tools: agent
                .tools
                .iter()
                .map(ToString::to_string)
                .chain(agent.mcp.iter().map(|m| m.to_string()))
                .collect(),
            deny: agent.deny.clone(),
            approve: agent.approve.clone(),
            sandbox: match agent.sandbox {
                SandboxMode::Shared => "shared",
                SandboxMode::Own => "own",
            }
            .into(),
            network: match agent.network {
                Network::None => "none",
                Network::Open => "open",
            }
            .into(),
            subagents: agent.subagents.clone(),
        }
    }
}

impl SteerView {
    pub fn of(record: arbor_storage::SteerRecord) -> Self {
        use arbor_storage::SteerState;
        SteerView {
            message_id: record.message_id,
            text: record.text,
            state: match record.state {
                SteerState::Queued => "queued",
                SteerState::Delivered => "delivered",
                SteerState::Discarded => "discarded",
            }
            .into(),
        }
    }
}

/// A job's agent: its model, tools, sandbox and network.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct JobSetup {
    /// `scripted`, or `provider/model`.
    pub model: String,
    pub tools: Vec<String>,
    /// Tools it and everything below it may not use (I-25).
    pub deny: Vec<String>,
    /// Its `approve:` entries: tools whose calls wait for a person (I-46),
    /// or run at once and are recorded on a card (`mode: notify`, I-60).
    pub approve: Vec<arbor_protocol::ApproveEntry>,
    /// `shared` (a folder of its parent's workdir) or `own` (I-26).
    pub sandbox: String,
    /// `none` or `open`.
    pub network: String,
    /// The agents it may delegate to.
    pub subagents: Vec<String>,
}

/// One steering message and what became of it.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SteerView {
    pub message_id: u64,
    pub text: String,
    /// `queued`, `delivered` (the model read it at a turn) or `discarded`
    /// (the job ended first).
    pub state: String,
}

/// `POST /v1/jobs/{id}/messages`: steer a running step or job (I-20).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SteerMessage {
    /// Delivered at the job's next turn boundary, in order.
    #[schemars(length(min = 1))]
    pub text: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SteerQueued {
    pub job: JobId,
    /// The message's number among this job's messages.
    pub message_id: u64,
}

/// `POST /v1/runs/{id}/budget`: raise a running run's ceiling (a top-up,
/// I-58). At least one, each a positive whole number.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TopUpBody {
    /// Tokens added to the run's root grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens: Option<u64>,
    /// Micro-dollars added to its usd ceiling (the run must have one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub usd_micros: Option<u64>,
}

/// A top-up made: the run's root account as it now is.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ToppedUp {
    pub run: RunId,
    /// Its tokens: grant, spent and held.
    pub account: arbor_protocol::AccountView,
}

/// What a stop was asked of.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct StopAccepted {
    pub id: String,
    /// `stopping` (it ends soon, stopped) or `stopped` (it had not started).
    pub state: String,
}

/// `POST /v1/jobs/{id}/continue`: the run that carries the next attempt.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Continued {
    pub job: JobId,
    pub run: RunId,
    pub links: RunLinks,
}

/// `POST /v1/ui/session`: the console's login.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UiLogin {
    /// The node's token (the data dir's `token` file), or a named token.
    pub token: String,
}

/// `/healthz` and `/readyz`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Health {
    /// `ok`, or why not (`draining`, `journal failed`).
    pub status: String,
}

/// One event of `GET /v1/runs/{id}/events` (docs/contract/event.schema.json):
/// the `data:` of each SSE message; its `id:` is `index`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct StreamEvent {
    /// 1 for the run's first event, then 2, 3, ...: what `Last-Event-ID` names.
    pub index: u64,
    #[serde(flatten)]
    pub event: Event,
}

/// The options of `GET /v1/runs/{id}/events`.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// `false`: send the events so far and end, without waiting for more
    /// (default `true`: follow until the run ends).
    pub follow: Option<bool>,
    /// Send the events after this index only: `Last-Event-ID` for a client
    /// that cannot set the header (a browser's EventSource opened again
    /// after a reload). The header wins when both are given: EventSource
    /// sends it on its own reconnections, with the later id.
    pub after: Option<u64>,
    /// Only the events about this step or job (its own account's among
    /// them), and the run's end. Indices stay the run's, so `after` and
    /// `Last-Event-ID` mean the same.
    pub job: Option<JobId>,
}

/// The filter of `GET /v1/approvals`.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalQuery {
    /// Only this run's cards.
    pub run: Option<RunId>,
    /// Only cards in this state (`pending` for what waits for a person).
    pub state: Option<CardState>,
}

/// `POST /v1/approvals/{id}`: a person's decision on a pending card.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    /// `approve`, `reject` (a reason is required: the agent reads it),
    /// `edit` (approve with `args`, checked against the tool's arguments),
    /// or, for a question, `answer` (with `answer`).
    pub decision: Verdict,
    /// Why; recorded with the decision, and told to the agent on a rejection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub reason: Option<String>,
    /// For `edit`: the arguments the call runs with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<serde_json::Value>,
    /// For `answer`: a question's answer (one of its `choices` if it has some).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16384))]
    pub answer: Option<String>,
}

/// A card's outcome: who closed it, when and why.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct DecisionView {
    /// The API token's name; `arbor` for an expiry or a stop.
    pub by: String,
    pub reason: Option<String>,
    /// RFC 3339.
    pub at: String,
    /// The arguments were edited (`args` are the edited ones).
    pub edited: bool,
    /// A question's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// One approval card (I-46).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct CardView {
    pub id: CardId,
    /// `call` (a gated tool call), `question` (an agent's `ask_person`:
    /// `args` are its `question` and `choices`), or `step` (a step's go-ahead).
    pub kind: arbor_protocol::CardKind,
    pub run: RunId,
    /// The step or job whose call waits.
    pub job: JobId,
    /// Labels from the root: the step's, then each delegated child's.
    pub lineage: Vec<String>,
    pub agent: String,
    pub tool: String,
    /// Secrets redacted, long strings clipped; after an edit, the edited ones.
    pub args: serde_json::Value,
    pub state: CardState,
    /// RFC 3339.
    pub asked_at: String,
    /// RFC 3339: the card expires then if nobody decided.
    pub deadline: String,
    pub asked_at_ms: u64,
    pub deadline_ms: u64,
    pub decision: Option<DecisionView>,
    /// A `ran` card's (a notify-mode call that ran at once): what the call
    /// returned, secrets redacted and clipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// A `ran` card's: how an operator undoes the call (its `approve:`
    /// entry's `undo`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<String>,
}

impl From<Card> for CardView {
    fn from(card: Card) -> Self {
        use arbor_protocol::approval::rfc3339;
        CardView {
            id: card.id,
            kind: card.kind,
            run: card.run,
            job: card.job,
            lineage: card.lineage,
            agent: card.agent,
            tool: card.tool,
            args: card.args,
            state: card.state,
            asked_at: rfc3339(card.asked_at_ms),
            deadline: rfc3339(card.deadline_ms),
            asked_at_ms: card.asked_at_ms,
            deadline_ms: card.deadline_ms,
            result: card.result,
            undo: card.undo,
            decision: card.decision.map(|d| DecisionView {
                by: d.by,
                reason: d.reason,
                at: rfc3339(d.at_ms),
                edited: d.edited,
                answer: d.answer,
            }),
        }
    }
}

/// `GET /v1/approvals`: the one queue of the whole node, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalList {
    pub approvals: Vec<CardView>,
}

/// `POST /v1/nodes/{id}/drain`: the node asked to drain.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct DrainAsked {
    pub node: String,
    /// `draining`: this node, now; `asked`: another node, which learns it
    /// at its next lease renewal (within a third of its lease).
    pub state: String,
}

/// `GET /v1/limits`: what this node throttles, and how full each window is.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Limits {
    /// Each provider's rate windows (`rpm`, `tpm` in arbor.toml, I-65):
    /// what each may hold in any minute and what the minute ending now
    /// holds. A provider's shared window is `NAME/*`.
    pub models: Vec<arbor_protocol::RateView>,
    /// Each tenant's quota windows (`[tenants.NAME.quota]`, I-65), for the
    /// tenants the caller sees that have one.
    pub tenants: Vec<TenantQuota>,
    /// Each `[limits.concurrency]` key (`tenant:NAME`, `flow:NAME`): its
    /// bound, the runs it has running on this node and those queued.
    pub concurrency: Vec<ConcurrencyKey>,
}

/// One concurrency key and how full it is.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ConcurrencyKey {
    /// `tenant:NAME` or `flow:NAME`.
    pub key: String,
    pub limit: u32,
    pub running: usize,
    pub queued: usize,
}

/// One tenant's quota: each window it sets, its limit and what it holds.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct TenantQuota {
    pub tenant: String,
    /// Each window it sets (`tokens_per_hour`, `usd_per_day`,
    /// `usd_per_month` in micro-dollars, `runs_per_minute`,
    /// `concurrent_runs`) and its limit.
    pub quota: std::collections::BTreeMap<String, u64>,
    /// What each window holds now: the ceilings of its running (and
    /// admitted) runs, and what ended runs spent within the window's span.
    pub used: std::collections::BTreeMap<String, u64>,
    /// Its runs queued that have yet to reserve (`on_quota = "queue"`):
    /// waiting for room in its windows, or for a free slot.
    pub queued: usize,
    /// What a submission over the quota meets: `refuse` (429) or `queue`.
    pub on_quota: String,
}

/// A node's id in a path.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct NodePath {
    /// The node's id (`--node-id`, `ARBOR_NODE_ID`, or its host's name).
    pub id: String,
}

/// A path's name (a trigger's).
#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct NamePath {
    pub name: String,
}

/// A path's id, as text: checked by the handler, so that a malformed id is
/// a clear 400 in the API's own error shape.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct IdPath {
    /// A run's or job's id (a UUID).
    #[schemars(extend("format" = "uuid"))]
    pub id: String,
}

/// Where a notification is (`GET /v1/notifications`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NotificationState {
    /// To be sent, or sent again after a failed try.
    Pending,
    /// Its endpoint answered 2xx.
    Delivered,
    /// Dead-lettered: every try failed, or its endpoint answered 410 Gone.
    Failed,
}

/// The filter of `GET /v1/notifications`.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NotificationQuery {
    /// Only notifications in this state (`failed`: the dead letters).
    pub state: Option<NotificationState>,
    /// Only this run's.
    pub run: Option<RunId>,
}

/// One notification of one event to one `[notify.NAME]` endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct NotificationView {
    /// Its `webhook-id`, the same on every try.
    pub id: String,
    pub run: RunId,
    /// The `[notify.NAME]` it goes to.
    pub endpoint: String,
    /// The event's type (`run_finished`, `approval_requested`, ...) and seq.
    pub event_type: String,
    pub event_seq: u64,
    pub state: NotificationState,
    /// Tries made so far.
    pub attempts: u32,
    /// When the next try is due (ms since the epoch), while pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_ms: Option<u64>,
    /// What the last failed try met.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub created_ms: u64,
    pub updated_ms: u64,
}

impl From<arbor_runtime::notify::OutboxRecord> for NotificationView {
    fn from(entry: arbor_runtime::notify::OutboxRecord) -> Self {
        use arbor_runtime::notify::DeliveryState;
        let state = match entry.state {
            DeliveryState::Pending => NotificationState::Pending,
            DeliveryState::Delivered => NotificationState::Delivered,
            DeliveryState::Failed => NotificationState::Failed,
        };
        Self {
            id: entry.webhook_id(),
            run: entry.run,
            endpoint: entry.endpoint,
            event_type: entry.event_type,
            event_seq: entry.event_seq,
            state,
            attempts: entry.attempts,
            next_attempt_ms: (state == NotificationState::Pending).then_some(entry.next_ms),
            last_error: entry.last_error,
            created_ms: entry.created_ms,
            updated_ms: entry.updated_ms,
        }
    }
}

/// `GET /v1/notifications`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct NotificationList {
    pub notifications: Vec<NotificationView>,
}

/// The filter of `GET /v1/audit`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only this tenant's calls.
    pub tenant: Option<String>,
    /// Only this caller's (a credential's name, a JWT's subject).
    pub subject: Option<String>,
    /// From this time on, in ms since the Unix epoch.
    pub since: Option<u64>,
    /// Before this time, in ms since the Unix epoch.
    pub until: Option<u64>,
    /// At most this many, 1 to 1000 (100).
    pub limit: Option<u32>,
    /// After this entry (the `next` of the page before).
    pub after: Option<uuid::Uuid>,
}

/// A page of the audit log, oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AuditList {
    pub entries: Vec<AuditEntry>,
    /// The last entry's id, when there are more: `?after=` it for the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<uuid::Uuid>,
}

/// One call that changed something, or a refused attempt at one (I-64).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AuditEntry {
    pub id: uuid::Uuid,
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    /// The credential's name (`operator`: the main token), a JWT's
    /// subject; `anonymous` when none was taken.
    pub subject: String,
    /// The caller's tenant; none: every tenant, or no credential.
    pub tenant: Option<String>,
    /// The role the route needs.
    pub role: Option<String>,
    /// The method and route: `POST /v1/runs/{id}/stop`.
    pub route: String,
    /// The id the route names, or the run a submission made.
    pub target: Option<String>,
    pub outcome: crate::audit::AuditOutcome,
    /// The answer's HTTP status.
    pub status: u16,
    /// The client's address.
    pub client: Option<String>,
}

impl From<crate::audit::AuditRecord> for AuditEntry {
    fn from(a: crate::audit::AuditRecord) -> Self {
        Self {
            id: a.id,
            at_ms: a.at_ms,
            subject: a.subject,
            tenant: a.tenant,
            role: a.role,
            route: a.route,
            target: a.target,
            outcome: a.outcome,
            status: a.status,
            client: a.client,
        }
    }
}

/// `POST /v1/tokens`: a named credential to make.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NewCredential {
    /// 1 to 64 letters, digits, `-`, `_` or `.`.
    #[schemars(length(min = 1, max = 64))]
    pub name: String,
    /// Its tenant, or `*` for every tenant; a credential of one tenant
    /// makes its own tenant's only (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its roles: `viewer`, `operator`, `approver`, `admin`.
    #[schemars(length(min = 1))]
    pub roles: Vec<String>,
}

/// A named credential, as the node keeps it (never its token).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct CredentialView {
    pub name: String,
    /// Its tenant; `*`: every tenant.
    pub tenant: String,
    pub roles: Vec<String>,
}

impl From<&crate::credentials::Credential> for CredentialView {
    fn from(c: &crate::credentials::Credential) -> Self {
        Self {
            name: c.name.clone(),
            tenant: c.tenant.clone().unwrap_or_else(|| "*".into()),
            roles: c.roles.names().into_iter().map(str::to_string).collect(),
        }
    }
}

/// `GET /v1/tokens`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct CredentialList {
    pub credentials: Vec<CredentialView>,
}

/// A credential just made: its token, shown this once.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct CredentialMade {
    pub name: String,
    pub tenant: String,
    pub roles: Vec<String>,
    /// The token: the node keeps only its SHA-256.
    pub token: String,
}

/// `GET /v1/schedules`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ScheduleList {
    pub schedules: Vec<ScheduleView>,
}

/// A schedule (a flow file's `[[schedule]]`) and where it stands.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ScheduleView {
    pub name: String,
    pub flow: String,
    pub cron: String,
    /// The IANA zone its cron is read in.
    pub timezone: String,
    pub paused: bool,
    /// When its next run starts (RFC 3339, UTC, its jitter added); none
    /// while it is paused.
    pub next_fire_at: Option<String>,
    pub overlap: arbor_protocol::Overlap,
    pub catchup_window_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its runs that had not ended when it last looked.
    #[serde(default)]
    pub active: Vec<RunId>,
    /// Ticks waiting for its earlier runs to end (RFC 3339).
    #[serde(default)]
    pub buffered: Vec<String>,
}

/// `POST /v1/schedules/{name}/backfill`: the ticks from `from` to `to`
/// (RFC 3339), both included.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BackfillBody {
    pub from: String,
    pub to: String,
}

/// What a backfill started, and the ticks that had started a run before.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
pub struct BackfillResult {
    pub started: Vec<BackfilledTick>,
    pub already: Vec<BackfilledTick>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct BackfilledTick {
    /// RFC 3339, UTC.
    pub tick: String,
    pub run: RunId,
}

/// A reload's or a rollback's outcome.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Deployment {
    /// The version current now.
    pub version: String,
    /// The one that was.
    pub previous: String,
    /// False when the files were that version already.
    pub changed: bool,
}

/// `GET /v1/workspace/versions`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct VersionList {
    /// The version new runs and schedules take.
    pub current: String,
    /// Every version the journal keeps, oldest first.
    pub versions: Vec<VersionView>,
}

/// A workspace version: arbor.toml, the agents and the flows, as runs
/// admitted with it keep them (I-67).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct VersionView {
    pub id: String,
    /// When the journal first kept it, in ms since the Unix epoch.
    pub created_at_ms: u64,
    pub current: bool,
    /// Its files' paths (`arbor.toml`, `agents/NAME/agent.md`, `flows/NAME.toml`).
    pub files: Vec<String>,
}

/// `POST /v1/workspace/rollback`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RollbackBody {
    /// A version `GET /v1/workspace/versions` lists.
    pub version: String,
}
