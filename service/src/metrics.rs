//! `GET /metrics`, in the OpenMetrics text format Prometheus scrapes.
//!
//! Labels are bounded: a status (five values), a provider's name (as
//! arbor.toml configures them), an outcome (`ok`, `stopped` or an error
//! class). Never a run's or job's id.
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    provider: String,
    outcome: String,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    runs: Family<StatusLabel, Gauge>,
    jobs: Family<StatusLabel, Gauge>,
    running_jobs: Gauge,
    queued_runs: Gauge,
    tokens: Counter,
    usd_micros: Counter,
    calls: Family<CallLabel, Counter>,
    commit_seconds: Histogram,
    fsyncs: Counter,
    flushes: Counter,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let runs = Family::<StatusLabel, Gauge>::default();
        let jobs = Family::<StatusLabel, Gauge>::default();
        let running_jobs = Gauge::default();
        let queued_runs = Gauge::default();
        let tokens = Counter::default();
        let usd_micros = Counter::default();
        let calls = Family::<CallLabel, Counter>::default();
        // 50 microseconds to about 3 seconds.
        let commit_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 17));
        let fsyncs = Counter::default();
        let flushes = Counter::default();
        let mut registry = Registry::with_prefix("arbor");
        registry.register("runs", "Runs by status", runs.clone());
        registry.register("jobs", "Steps and jobs by status", jobs.clone());
        registry.register(
            "running_jobs",
            "Steps and jobs running now",
            running_jobs.clone(),
        );
        registry.register(
            "queued_runs",
            "Runs waiting for admission",
            queued_runs.clone(),
        );
        registry.register(
            "tokens_spent",
            "Tokens charged for model calls since this start",
            tokens.clone(),
        );
        registry.register(
            "usd_micros_spent",
            "Micro-dollars charged for model calls since this start",
            usd_micros.clone(),
        );
        registry.register(
            "model_calls",
            "Model calls by provider and outcome since this start",
            calls.clone(),
        );
        registry.register(
            "journal_commit_seconds",
            "Time from a journal append to its flush being durable",
            commit_seconds.clone(),
        );
        registry.register(
            "journal_fsyncs",
            "fdatasyncs of the journal's file since this start",
            fsyncs.clone(),
        );
        registry.register(
            "journal_flushes",
            "Group-commit flushes since this start",
            flushes.clone(),
        );
        Arc::new(Self {
            registry: Mutex::new(registry),
            runs,
            jobs,
            running_jobs,
            queued_runs,
            tokens,
            usd_micros,
            calls,
            commit_seconds,
            fsyncs,
            flushes,
        })
    }

    /// Called for every event (an `EventBus` observer): quick, no locks of ours.
    pub fn observe(&self, event: &Event) {
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

    pub fn observe_commit(&self, latency: std::time::Duration) {
        self.commit_seconds.observe(latency.as_secs_f64());
    }

    /// The text a scrape gets, with the gauges read now.
    pub fn render(&self, journal: &Journal, queued: usize) -> Result<String, String> {
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
        catch_up(&self.fsyncs, journal.sync_count());
        catch_up(&self.flushes, journal.flush_count());
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .map_err(|e| e.to_string())?;
        Ok(text)
    }
}

/// Counters cannot be set; one that mirrors a count kept elsewhere is moved
/// up to it.
fn catch_up(counter: &Counter, now: u64) {
    let have = counter.get();
    if now > have {
        counter.inc_by(now - have);
    }
}
