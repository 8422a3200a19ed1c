//! `GET /metrics`, in the OpenMetrics text format Prometheus scrapes.
//!
//! Labels are bounded: a status (five values), a provider's or an MCP
//! server's name (as arbor.toml configures them), an outcome (`ok`,
//! `stopped` or an error class; for MCP calls `ok`, `error`, `timed_out`,
//! `refused`). Never a run's or job's id, never a call's arguments.
//!
//! Counters fed by events (model calls, tokens, cost) count since this
//! start; gauges of runs and jobs by status are read from the journal at
//! each scrape, so they are the truth across restarts.

use arbor_protocol::{Event, EventKind, Status};
use arbor_storage::Journal;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A node of a shared journal (a few per cluster).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabel {
    node: String,
}

/// A rate window: `provider/model`, or `provider/*` (a few per node).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WindowLabel {
    window: String,
}

/// What a rate window counts: `requests` or `tokens`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WindowUnitLabel {
    window: String,
    unit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

/// A tenant of arbor.toml's (a bounded set) and a run's status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantStatusLabel {
    tenant: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyLabel {
    key: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabel {
    tenant: String,
    quota: String,
}

/// One tenant's runs in one status, and the tokens they spent: what the
/// `tenant_*` families say (I-63).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantRuns {
    pub runs: i64,
    pub tokens: i64,
}

/// The prefix of the families a credential of one tenant is shown.
const TENANT_FAMILIES: &str = "arbor_tenant_";

/// An MCP server's name (as arbor.toml declares it) and a call's outcome:
/// `ok`, `error` (the tool's or the server's), `timed_out`, `refused`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct McpLabel {
    server: String,
    outcome: String,
}

/// A schedule's name (a flow file's) and what became of its ticks:
/// `started`, `skipped`, `missed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TickLabel {
    schedule: String,
    outcome: String,
}

/// A failed run's error class (`none` when it has none): a bounded set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

/// An approval card's outcome: approved, rejected, expired, cancelled.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: String,
}

/// A `[notify.NAME]` endpoint (as arbor.toml names it) and a try's
/// outcome: `delivered`, `retried`, `failed` (dead-lettered), `gone` (410).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabel {
    server: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    provider: String,
    outcome: String,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    runs: Family<StatusLabel, Gauge>,
    tenant_runs: Family<TenantStatusLabel, Gauge>,
    tenant_tokens: Family<TenantLabel, Gauge>,
    runs_failed: Family<ClassLabel, Counter>,
    retries: Family<ClassLabel, Counter>,
    jobs: Family<StatusLabel, Gauge>,
    running_jobs: Gauge,
    queued_runs: Gauge,
    tokens: Counter,
    usd_micros: Counter,
    calls: Family<CallLabel, Counter>,
    mcp_calls: Family<McpLabel, Counter>,
    schedule_ticks: Family<TickLabel, Counter>,
    mcp_seconds: Family<ServerLabel, Histogram>,
    commit_seconds: Histogram,
    fsyncs: Counter,
    flushes: Counter,
    approvals_pending: Gauge,
    approval_decisions: Family<OutcomeLabel, Counter>,
    approval_seconds: Family<OutcomeLabel, Histogram>,
    node_runs: Family<NodeLabel, Gauge>,
    node_lease: Family<NodeLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    rate_used: Family<WindowUnitLabel, Gauge>,
    rate_limit: Family<WindowUnitLabel, Gauge>,
    rate_closed: Family<WindowLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    rate_waiting: Family<WindowLabel, Gauge>,
    quota_used: Family<QuotaLabel, Gauge>,
    quota_limit: Family<QuotaLabel, Gauge>,
    concurrency_running: Family<KeyLabel, Gauge>,
    concurrency_queued: Family<KeyLabel, Gauge>,
    concurrency_limit: Family<KeyLabel, Gauge>,
    spans_exported: Counter,
    spans_dropped: Counter,
    span_events_dropped: Counter,
    notifications: Family<StatusLabel, Gauge>,
    notification_tries: Family<EndpointLabel, Counter>,
    endpoints_disabled: Gauge,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let metrics = Self {
            registry: Mutex::new(Registry::with_prefix("arbor")),
            runs: Family::<StatusLabel, Gauge>::default(),
            tenant_runs: Family::<TenantStatusLabel, Gauge>::default(),
            tenant_tokens: Family::<TenantLabel, Gauge>::default(),
            runs_failed: Family::<ClassLabel, Counter>::default(),
            retries: Family::<ClassLabel, Counter>::default(),
            jobs: Family::<StatusLabel, Gauge>::default(),
            running_jobs: Gauge::default(),
            queued_runs: Gauge::default(),
            tokens: Counter::default(),
            usd_micros: Counter::default(),
            calls: Family::<CallLabel, Counter>::default(),
            mcp_calls: Family::<McpLabel, Counter>::default(),
            schedule_ticks: Family::<TickLabel, Counter>::default(),
            // 1 millisecond to about 9 minutes.
            mcp_seconds: Family::<ServerLabel, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 20))
            }),
            // 50 microseconds to about 3 seconds.
            commit_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 17)),
            fsyncs: Counter::default(),
            flushes: Counter::default(),
            approvals_pending: Gauge::default(),
            approval_decisions: Family::<OutcomeLabel, Counter>::default(),
            // 1 second to about 4.5 days.
            approval_seconds: Family::<OutcomeLabel, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(1.0, 2.0, 19))
            }),
            spans_exported: Counter::default(),
            spans_dropped: Counter::default(),
            span_events_dropped: Counter::default(),
            notifications: Family::<StatusLabel, Gauge>::default(),
            notification_tries: Family::<EndpointLabel, Counter>::default(),
            endpoints_disabled: Gauge::default(),
            node_runs: Family::<NodeLabel, Gauge>::default(),
            node_lease: Family::<NodeLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default(),
            rate_used: Family::default(),
            rate_limit: Family::default(),
            rate_closed: Family::default(),
            rate_waiting: Family::default(),
            quota_used: Family::default(),
            quota_limit: Family::default(),
            concurrency_running: Family::default(),
            concurrency_queued: Family::default(),
            concurrency_limit: Family::default(),
        };
        metrics.register();
        Arc::new(metrics)
    }

    /// Every metric in the registry `/metrics` encodes, with its help text.
    fn register(&self) {
        let mut registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        registry.register("runs", "Runs by status", self.runs.clone());
        self.register_tenants(&mut registry);
        registry.register(
            "runs_failed",
            "Runs that ended failed since this start, by error class",
            self.runs_failed.clone(),
        );
        registry.register(
            "retries",
            "Failed steps and jobs tried again under their retry policy since this start, by error class",
            self.retries.clone(),
        );
        registry.register("jobs", "Steps and jobs by status", self.jobs.clone());
        registry.register(
            "running_jobs",
            "Steps and jobs running now",
            self.running_jobs.clone(),
        );
        registry.register(
            "queued_runs",
            "Runs waiting for admission",
            self.queued_runs.clone(),
        );
        registry.register(
            "tokens_spent",
            "Tokens charged for model calls since this start",
            self.tokens.clone(),
        );
        registry.register(
            "usd_micros_spent",
            "Micro-dollars charged for model calls since this start",
            self.usd_micros.clone(),
        );
        registry.register(
            "model_calls",
            "Model calls by provider and outcome since this start",
            self.calls.clone(),
        );
        registry.register(
            "mcp_calls",
            "MCP tool calls by server and outcome since this start",
            self.mcp_calls.clone(),
        );
        registry.register(
            "schedule_ticks",
            "Schedule ticks by schedule and outcome (started, skipped, missed) since this start",
            self.schedule_ticks.clone(),
        );
        registry.register(
            "mcp_call_seconds",
            "MCP tool calls' time, checks to result, by server",
            self.mcp_seconds.clone(),
        );
        registry.register(
            "journal_commit_seconds",
            "Time from a journal append to its flush being durable",
            self.commit_seconds.clone(),
        );
        registry.register(
            "journal_fsyncs",
            "fdatasyncs of the journal's file since this start",
            self.fsyncs.clone(),
        );
        registry.register(
            "journal_flushes",
            "Group-commit flushes since this start",
            self.flushes.clone(),
        );
        registry.register(
            "approvals_pending",
            "Approval cards waiting for a person",
            self.approvals_pending.clone(),
        );
        self.register_node(&mut registry);
        registry.register(
            "telemetry_spans_exported",
            "Trace spans the OTLP collector took since this start",
            self.spans_exported.clone(),
        );
        registry.register(
            "telemetry_spans_dropped",
            "Trace spans lost since this start: a full queue or a collector that failed",
            self.spans_dropped.clone(),
        );
        registry.register(
            "telemetry_events_dropped",
            "Events the trace exporter had no room for since this start",
            self.span_events_dropped.clone(),
        );
        registry.register(
            "notifications",
            "Notifications in the outbox by state (pending, delivered, failed: the dead letters)",
            self.notifications.clone(),
        );
        registry.register(
            "notification_tries",
            "Tries to send a notification since this start, by endpoint and outcome",
            self.notification_tries.clone(),
        );
        registry.register(
            "notification_endpoints_disabled",
            "[notify] endpoints a 410 Gone disabled",
            self.endpoints_disabled.clone(),
        );
        registry.register(
            "approval_decisions",
            "Approval cards closed since this start, by outcome",
            self.approval_decisions.clone(),
        );
        registry.register(
            "approval_wait_seconds",
            "Time from a card's asking to its outcome, by outcome",
            self.approval_seconds.clone(),
        );
    }

    /// The node's own figures: a shared journal's nodes, the rate windows.
    fn register_node(&self, registry: &mut Registry) {
        registry.register(
            "node_owned_runs",
            "A shared journal's nodes: the runs each owns that have not ended",
            self.node_runs.clone(),
        );
        registry.register(
            "node_lease_left_seconds",
            "A shared journal's nodes: how long each one's lease runs on, by the database's clock",
            self.node_lease.clone(),
        );
        registry.register(
            "rate_window_used",
            "Each provider's rate window (rpm, tpm): the requests and tokens the minute ending now holds",
            self.rate_used.clone(),
        );
        registry.register(
            "rate_window_limit",
            "Each provider's rate window: the requests (rpm) and tokens (tpm) any minute may hold",
            self.rate_limit.clone(),
        );
        registry.register(
            "rate_window_closed_seconds",
            "Each provider's rate window: how long the provider closed it for (a 429's Retry-After, its limit headers)",
            self.rate_closed.clone(),
        );
        registry.register(
            "rate_window_waiting",
            "Each provider's rate window: the node's requests waiting for room in it",
            self.rate_waiting.clone(),
        );
        registry.register(
            "quota_used",
            "Each tenant's quota window: what it holds now (running runs' ceilings, ended runs' spend within its span; micro-dollars for usd)",
            self.quota_used.clone(),
        );
        registry.register(
            "quota_limit",
            "Each tenant's quota window: what any span of its length may hold",
            self.quota_limit.clone(),
        );
        registry.register(
            "concurrency_running",
            "Each concurrency key ([limits.concurrency]): its runs running on this node",
            self.concurrency_running.clone(),
        );
        registry.register(
            "concurrency_queued",
            "Each concurrency key: its runs waiting in the queue",
            self.concurrency_queued.clone(),
        );
        registry.register(
            "concurrency_limit",
            "Each concurrency key: how many of its runs may run at once",
            self.concurrency_limit.clone(),
        );
    }

    /// Called for every event (an `EventBus` observer): quick, no locks of ours.
    pub fn observe(&self, event: &Event) {
        match &event.kind {
            EventKind::ToolCalled {
                tool,
                ok,
                detail,
                latency_ms,
                ..
            } => {
                if let Some(server) = mcp_server_of(tool) {
                    let outcome = match (ok, detail.starts_with("timed_out")) {
                        (true, _) => "ok",
                        (false, true) => "timed_out",
                        (false, false) => "error",
                    };
                    self.mcp_call(server, outcome);
                    self.mcp_seconds
                        .get_or_create(&ServerLabel {
                            server: server.to_string(),
                        })
                        .observe(*latency_ms as f64 / 1000.0);
                }
                return;
            }
            EventKind::Refused { tool, .. } => {
                if let Some(server) = mcp_server_of(tool) {
                    self.mcp_call(server, "refused");
                }
                return;
            }
            EventKind::ApprovalDecided {
                state, waited_ms, ..
            } => {
                let label = OutcomeLabel {
                    outcome: state.as_str().into(),
                };
                self.approval_decisions.get_or_create(&label).inc();
                self.approval_seconds
                    .get_or_create(&label)
                    .observe(*waited_ms as f64 / 1000.0);
                return;
            }
            EventKind::RetryWaiting { class, .. } => {
                let class = class.to_string();
                self.retries.get_or_create(&ClassLabel { class }).inc();
                return;
            }
            EventKind::RunFinished {
                status: Status::Failed,
                error_class,
                ..
            } => {
                let class = error_class.map_or("none".to_string(), |c| c.to_string());
                self.runs_failed.get_or_create(&ClassLabel { class }).inc();
                return;
            }
            // A run that ended otherwise than failed, and the kinds below,
            // are counted after this match or not at all.
            EventKind::RunFinished { .. }
            | EventKind::NeedsDecision { .. }
            | EventKind::IterationChecked { .. }
            | EventKind::Reviewed { .. }
            | EventKind::BudgetReached { .. }
            | EventKind::BudgetPauseEnded { .. }
            | EventKind::ModelFallback { .. }
            | EventKind::RunStarted { .. }
            | EventKind::RunResumed { .. }
            | EventKind::Recovered { .. }
            | EventKind::JobSpawned { .. }
            | EventKind::JobRunning { .. }
            | EventKind::JobFinished { .. }
            | EventKind::AccountChanged { .. }
            | EventKind::WindDown { .. }
            | EventKind::ModelCalled { .. }
            | EventKind::ContextCompacted { .. }
            | EventKind::ContextPressure { .. }
            | EventKind::BudgetOverrun { .. }
            | EventKind::ToolStarted { .. }
            | EventKind::McpServer { .. }
            | EventKind::SteerQueued { .. }
            | EventKind::SteerDelivered { .. }
            | EventKind::SteerDiscarded { .. }
            | EventKind::PeerQueued { .. }
            | EventKind::PeerDelivered { .. }
            | EventKind::ApprovalRequested { .. }
            | EventKind::ApprovalExpiring { .. } => {}
        }
        if let EventKind::ModelCalled {
            input_tokens,
            output_tokens,
            call,
            ..
        } = &event.kind
        {
            self.tokens.inc_by(input_tokens + output_tokens);
            self.usd_micros.inc_by(call.usd_micros);
            self.calls
                .get_or_create(&CallLabel {
                    provider: call.provider.clone(),
                    outcome: call.outcome.clone(),
                })
                .inc();
        }
    }

    fn mcp_call(&self, server: &str, outcome: &str) {
        self.mcp_calls
            .get_or_create(&McpLabel {
                server: server.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// `count` of schedule `name`'s ticks went `outcome` (`started`,
    /// `skipped`, `missed`).
    pub fn schedule_ticks(&self, name: &str, outcome: &str, count: u64) {
        self.schedule_ticks
            .get_or_create(&TickLabel {
                schedule: name.to_string(),
                outcome: outcome.to_string(),
            })
            .inc_by(count);
    }

    pub fn observe_commit(&self, latency: std::time::Duration) {
        self.commit_seconds.observe(latency.as_secs_f64());
    }

    /// The families a credential of one tenant is shown (I-63).
    fn register_tenants(&self, registry: &mut Registry) {
        registry.register(
            "tenant_runs",
            "Runs in the journal by tenant (of arbor.toml's) and status",
            self.tenant_runs.clone(),
        );
        registry.register(
            "tenant_tokens_spent",
            "Tokens spent by the runs in the journal, by tenant",
            self.tenant_tokens.clone(),
        );
    }

    /// Sets the `tenant_*` families to `by_tenant` (tenant, status: its
    /// runs and tokens); a tenant or status not there reads 0.
    pub fn set_tenants(
        &self,
        by_tenant: &std::collections::BTreeMap<(String, &'static str), TenantRuns>,
    ) {
        self.tenant_runs.clear();
        self.tenant_tokens.clear();
        for ((tenant, status), figures) in by_tenant {
            self.tenant_runs
                .get_or_create(&TenantStatusLabel {
                    tenant: tenant.clone(),
                    status: (*status).into(),
                })
                .set(figures.runs);
            self.tenant_tokens
                .get_or_create(&TenantLabel {
                    tenant: tenant.clone(),
                })
                .inc_by(figures.tokens);
        }
    }

    /// The node's rate windows as they are now.
    pub fn set_limits(&self, windows: &[arbor_protocol::RateView]) {
        for w in windows {
            let unit = |unit: &str| WindowUnitLabel {
                window: w.model.clone(),
                unit: unit.into(),
            };
            let as_gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
            self.rate_used
                .get_or_create(&unit("requests"))
                .set(as_gauge(w.used.requests));
            self.rate_used
                .get_or_create(&unit("tokens"))
                .set(as_gauge(w.used.tokens));
            for (name, limit) in [("requests", w.rpm), ("tokens", w.tpm)] {
                if let Some(limit) = limit {
                    self.rate_limit
                        .get_or_create(&unit(name))
                        .set(as_gauge(limit));
                }
            }
            self.rate_closed
                .get_or_create(&WindowLabel {
                    window: w.model.clone(),
                })
                .set(w.closed_ms as f64 / 1000.0);
            self.rate_waiting
                .get_or_create(&WindowLabel {
                    window: w.model.clone(),
                })
                .set(as_gauge(w.waiting));
        }
    }

    /// Each tenant's quota windows as they are now.
    pub fn set_quotas(&self, tenants: &[crate::api::TenantQuota]) {
        let as_gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for t in tenants {
            let label = |quota: &str| QuotaLabel {
                tenant: t.tenant.clone(),
                quota: quota.into(),
            };
            for (quota, limit) in &t.quota {
                self.quota_limit
                    .get_or_create(&label(quota))
                    .set(as_gauge(*limit));
            }
            for (quota, used) in &t.used {
                self.quota_used
                    .get_or_create(&label(quota))
                    .set(as_gauge(*used));
            }
        }
    }

    /// Each concurrency key as it is now.
    pub fn set_concurrency(&self, keys: &[crate::api::ConcurrencyKey]) {
        let as_gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        for k in keys {
            let label = KeyLabel { key: k.key.clone() };
            self.concurrency_running
                .get_or_create(&label)
                .set(as_gauge(k.running));
            self.concurrency_queued
                .get_or_create(&label)
                .set(as_gauge(k.queued));
            self.concurrency_limit
                .get_or_create(&label)
                .set(i64::from(k.limit));
        }
    }

    /// The text a scrape gets, with the gauges read now.
    pub fn render(
        &self,
        journal: &Journal,
        queued: usize,
        telemetry: Option<arbor_runtime::telemetry::TelemetryStats>,
        notifications: Option<&arbor_runtime::notify::Notifications>,
    ) -> Result<String, String> {
        if let Some(notifications) = notifications {
            self.render_notifications(notifications)?;
        }
        if let Some(t) = telemetry {
            catch_up(&self.spans_exported, t.spans_exported);
            catch_up(&self.spans_dropped, t.spans_dropped);
            catch_up(&self.span_events_dropped, t.events_dropped);
        }
        let statuses = [
            Status::Pending,
            Status::Running,
            Status::Done,
            Status::Failed,
            Status::Stopped,
        ];
        let runs = journal.runs().map_err(|e| e.to_string())?;
        let jobs = journal.all_jobs().map_err(|e| e.to_string())?;
        for status in statuses {
            let mut run_count = runs.iter().filter(|r| r.status == status).count() as i64;
            if status == Status::Pending {
                run_count += queued as i64;
            }
            self.runs
                .get_or_create(&StatusLabel {
                    status: status.as_str().into(),
                })
                .set(run_count);
            let job_count = jobs.iter().filter(|j| j.status == status).count() as i64;
            self.jobs
                .get_or_create(&StatusLabel {
                    status: status.as_str().into(),
                })
                .set(job_count);
            if status == Status::Running {
                self.running_jobs.set(job_count);
            }
        }
        self.queued_runs.set(queued as i64);
        let pending = journal
            .all_approvals()
            .map_err(|e| e.to_string())?
            .iter()
            .filter(|c| c.state.is_pending())
            .count();
        self.approvals_pending.set(pending as i64);
        if let Some(nodes) = journal.nodes().map_err(|e| e.to_string())? {
            // A node gone from the journal is gone from the metrics.
            self.node_runs.clear();
            self.node_lease.clear();
            for node in nodes {
                let label = NodeLabel { node: node.id };
                self.node_runs
                    .get_or_create(&label)
                    .set(node.runs.len() as i64);
                self.node_lease
                    .get_or_create(&label)
                    .set(node.lease_left_ms as f64 / 1000.0);
            }
        }
        catch_up(&self.fsyncs, journal.sync_count());
        catch_up(&self.flushes, journal.flush_count());
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .map_err(|e| e.to_string())?;
        Ok(text)
    }
}

impl Metrics {
    fn render_notifications(
        &self,
        notifications: &arbor_runtime::notify::Notifications,
    ) -> Result<(), String> {
        use arbor_runtime::notify::DeliveryState;
        let entries = notifications.list(None)?;
        for state in [
            DeliveryState::Pending,
            DeliveryState::Delivered,
            DeliveryState::Failed,
        ] {
            let count = entries.iter().filter(|e| e.state == state).count();
            self.notifications
                .get_or_create(&StatusLabel {
                    status: state.as_str().into(),
                })
                .set(count as i64);
        }
        for ((endpoint, outcome), count) in notifications.counts() {
            let label = EndpointLabel {
                endpoint,
                outcome: outcome.into(),
            };
            catch_up(&self.notification_tries.get_or_create(&label), count);
        }
        self.endpoints_disabled
            .set(notifications.disabled().len() as i64);
        Ok(())
    }
}

/// Counters cannot be set; one that mirrors a count kept elsewhere is moved
/// up to it.
/// The server of an MCP tool's canonical name (`mcp__SERVER__TOOL`).
fn mcp_server_of(tool: &str) -> Option<&str> {
    let rest = tool.strip_prefix(arbor_protocol::mcp::MCP_PREFIX)?;
    rest.split_once("__").map(|(server, _)| server)
}

fn catch_up(counter: &Counter, now: u64) {
    let have = counter.get();
    if now > have {
        counter.inc_by(now - have);
    }
}

/// A scrape's text as a credential of `tenant` sees it (I-63): the
/// `tenant_*` families, its own tenant's samples only; the node's own
/// figures are its admins'.
pub fn for_tenant(text: &str, tenant: &str) -> String {
    let label = format!("tenant=\"{tenant}\"");
    let mut kept: String = text
        .lines()
        .filter(|line| {
            let family = line
                .strip_prefix("# HELP ")
                .or_else(|| line.strip_prefix("# TYPE "))
                .or_else(|| line.strip_prefix("# UNIT "));
            match family {
                Some(rest) => rest.starts_with(TENANT_FAMILIES),
                None => line.starts_with(TENANT_FAMILIES) && line.contains(&label),
            }
        })
        .map(|line| format!("{line}\n"))
        .collect();
    kept.push_str("# EOF\n");
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::{JobId, Refusal, RunId};

    fn event(kind: EventKind) -> Event {
        Event {
            seq: 1,
            run: RunId::new(),
            at_ms: 0,
            kind,
        }
    }

    fn called(tool: &str, ok: bool, detail: &str, latency_ms: u64) -> Event {
        event(EventKind::ToolCalled {
            id: JobId::new(),
            turn: 1,
            tool: tool.into(),
            call: String::new(),
            ok,
            detail: detail.into(),
            latency_ms,
            repeat: 1,
            digest: String::new(),
        })
    }

    #[test]
    fn mcp_calls_are_counted_per_server_and_outcome_and_timed_per_server() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(&dir.path().join("journal")).unwrap();
        let metrics = Metrics::new();
        metrics.observe(&called("mcp__fs__read_file", true, "\"hi\"", 40));
        metrics.observe(&called("mcp__fs__read_file", true, "\"hi\"", 60));
        metrics.observe(&called(
            "mcp__fs__write",
            false,
            "timed_out: the call",
            3000,
        ));
        metrics.observe(&called("mcp__gh__list", false, "the server refused", 5));
        metrics.observe(&called("exec", true, "{}", 5));
        metrics.observe(&event(EventKind::Refused {
            id: JobId::new(),
            tool: "mcp__fs__write".into(),
            refusal: Refusal::ToolLimit {
                tool: "mcp__fs__write".into(),
                limit: "calls".into(),
                most: 1,
                made: 1,
            },
        }));
        let text = metrics.render(&journal, 0, None, None).unwrap();
        for needle in [
            "arbor_mcp_calls_total{server=\"fs\",outcome=\"ok\"} 2",
            "arbor_mcp_calls_total{server=\"fs\",outcome=\"timed_out\"} 1",
            "arbor_mcp_calls_total{server=\"fs\",outcome=\"refused\"} 1",
            "arbor_mcp_calls_total{server=\"gh\",outcome=\"error\"} 1",
            "arbor_mcp_call_seconds_count{server=\"fs\"} 3",
            "arbor_mcp_call_seconds_sum{server=\"fs\"} 3.1",
        ] {
            assert!(text.contains(needle), "{needle} in\n{text}");
        }
        assert!(
            !text.contains("exec"),
            "a built-in tool is not an MCP server"
        );
    }
}
