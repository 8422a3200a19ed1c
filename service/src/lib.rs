//! arbord's service: one embedded node behind an HTTP JSON API.
//!
//! `Service::start` opens the node (recovery first), the admission queue and
//! the token; `Service::router` is the API (`routes.rs`); `Service::serve`
//! answers on a listener until told to stop, then drains (I-40): it takes no
//! more work, lets running runs go on for `drain`, stops the rest, journals
//! a consistent state, and returns.
//!
//! Invariant: nothing here decides what a run does. Every run, step and job
//! is the node's; the service only admits, reads and asks.

pub mod admission;
pub mod api;
pub mod audit;
pub mod auth;
#[cfg(feature = "client")]
pub mod client;
pub mod config;
pub mod console;
pub mod credentials;
pub mod deploy;
pub mod dispatch;
pub mod error;
pub mod extract;
mod forward;
pub mod metrics;
pub mod oidc;
pub mod quota;
pub mod retention;
mod routes;
pub mod schedules;
pub mod sse;
pub mod status;
pub mod submission;
mod tenancy;

pub use config::{Flags, ServiceConfig};
pub use error::{ApiError, ErrorBody};
pub use submission::{SUBMISSIONS, SubmissionRecord, SubmissionState};

use admission::Admission;
use arbor_actors::ModelFactory;
use arbor_protocol::RunId;
use arbor_runtime::{EmbeddedNode, Models, Workspace};
use auth::{Token, Tokens};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// Why the service did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Node(#[from] arbor_runtime::Error),
    #[error("{0}")]
    Token(String),
    #[error("journal: {0}")]
    Journal(#[from] arbor_storage::Error),
}

/// A started service: the node, its queue and its token.
#[derive(Clone)]
pub struct Service {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub node: Arc<EmbeddedNode>,
    /// The workspace version new runs and schedules take: swapped whole by
    /// a reload or a rollback (`deploy.rs`); a run keeps its own (I-67).
    pub deployed: std::sync::RwLock<Arc<deploy::Deployed>>,
    pub config: ServiceConfig,
    pub tokens: Tokens,
    /// `[auth.oidc]`, whose keys a task keeps fresh (the same keys the
    /// tokens check JWTs with).
    pub oidc: Option<oidc::Oidc>,
    pub token_path: PathBuf,
    pub admission: Arc<Admission>,
    pub metrics: Arc<metrics::Metrics>,
    /// False from the start of a drain.
    pub accepting: AtomicBool,
    /// Cancelled when the drain is done: event streams end, the server stops.
    pub stopped: CancellationToken,
    /// Cancelled when this node is asked to drain through the API (its own,
    /// or another node's, through the shared journal): `serve` drains as
    /// at SIGTERM.
    pub drain_asked: CancellationToken,
    /// The pump and every event stream's producer: each holds the journal,
    /// so a drain waits for them all before it says the node is closed.
    pub tasks: tokio_util::task::TaskTracker,
    pub started: Instant,
    pub started_at_ms: u64,
    /// Held while this node moves a schedule (with the journal's lock on
    /// it, for a shared journal's other nodes).
    pub schedule_lock: tokio::sync::Mutex<()>,
    /// Held by a reload or a rollback, one at a time.
    pub deploy_lock: tokio::sync::Mutex<()>,
}

impl Shared {
    /// The workspace new runs take now.
    pub fn workspace(&self) -> Arc<Workspace> {
        self.deployed().workspace.clone()
    }

    /// What is deployed now: the workspace and its triggers' keys.
    pub fn deployed(&self) -> Arc<deploy::Deployed> {
        self.deployed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Service {
    /// Starts the node on `config.data_dir` with the workspace's models.
    pub async fn start(workspace: Workspace, config: ServiceConfig) -> Result<Self, StartError> {
        let models = Arc::new(Models::new(&workspace.config.providers));
        Self::start_with(workspace, config, models).await
    }

    /// As `start`, with the models a test (or an embedder) chooses.
    pub async fn start_with(
        workspace: Workspace,
        config: ServiceConfig,
        models: Arc<dyn ModelFactory>,
    ) -> Result<Self, StartError> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| StartError::Token(format!("{}: {e}", config.data_dir.display())))?;
        let (token, token_path) =
            Token::load_or_create(&config.data_dir).map_err(StartError::Token)?;
        let oidc = oidc::Oidc::from_auth(&workspace.config.auth, &workspace.root)
            .map_err(StartError::Token)?;
        let keep_audit = audit::keep(&workspace.config.retention).map_err(StartError::Token)?;
        // A provider that is down does not stop the start: its JWTs are
        // refused, saying so, until its keys are fetched (`Oidc::refresh`).
        if let Some(oidc) = &oidc
            && let Err(why) = oidc.fetch().await
        {
            tracing::warn!(%why, "the OIDC provider's keys were not fetched; JWTs are refused until they are");
        }
        let tokens = Tokens::load(&config.data_dir, token)
            .map_err(StartError::Token)?
            .with_oidc(oidc.clone())
            .with_tenants(workspace.tenant_names());
        // Interrupted runs are resumed (I-34) and count against the limit.
        let node = Arc::new(EmbeddedNode::start_with(&workspace, &config.data_dir, models).await?);
        let posture = node.sandbox();
        if posture.sealed {
            tracing::info!(detail = %posture.detail, "sandbox");
        } else {
            tracing::warn!(detail = %posture.detail, "sandbox");
        }
        let metrics = metrics::Metrics::new();
        {
            let metrics = metrics.clone();
            node.events().observe(Arc::new(move |e| metrics.observe(e)));
        }
        {
            let metrics = metrics.clone();
            node.journal()
                .on_commit(move |latency| metrics.observe_commit(latency));
        }
        let deployed = deploy::at_start(&node, workspace).await?;
        let workspace = deployed.workspace.clone();
        let admission = Admission::open(
            node.clone(),
            config.max_running_runs,
            config.max_queued_runs,
            admission::Policy::of(&workspace),
        )?;
        let tasks = tokio_util::task::TaskTracker::new();
        tasks.spawn(admission.clone().pump());
        let keep_finished = config.keep_finished;
        let started_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let service = Self {
            shared: Arc::new(Shared {
                node,
                deployed: std::sync::RwLock::new(Arc::new(deployed)),
                config,
                tokens,
                oidc: oidc.clone(),
                token_path,
                admission,
                metrics,
                accepting: AtomicBool::new(true),
                stopped: CancellationToken::new(),
                drain_asked: CancellationToken::new(),
                tasks,
                started: Instant::now(),
                started_at_ms,
                schedule_lock: tokio::sync::Mutex::new(()),
                deploy_lock: tokio::sync::Mutex::new(()),
            }),
        };
        if let Some(keep) = keep_finished {
            let shared = service.shared.clone();
            service
                .shared
                .tasks
                .spawn(retention::keep_finished(shared, keep));
        }
        if let Some(oidc) = oidc {
            let stopped = service.shared.stopped.clone();
            service.shared.tasks.spawn(oidc.refresh(stopped));
        }
        if let Some(keep) = keep_audit {
            let shared = service.shared.clone();
            service
                .shared
                .tasks
                .spawn(retention::keep_audit(shared, keep));
        }
        // Another node's `POST /v1/nodes/{id}/drain` for this one.
        if let Some(mut asked) = service.shared.node.journal().drain_asked() {
            let shared = service.shared.clone();
            service.shared.tasks.spawn(async move {
                tokio::select! {
                    _ = shared.stopped.cancelled() => {}
                    Ok(_) = asked.wait_for(|asked| *asked) => shared.drain_asked.cancel(),
                }
            });
        }
        if service.shared.config.schedule_clock {
            let shared = service.shared.clone();
            service.shared.tasks.spawn(follow_the_clock(shared));
        }
        // Calls other nodes send about this node's runs (a shared journal's).
        service.shared.tasks.spawn(forward::serve(
            service.shared.clone(),
            routes::handle_forwarded,
        ));
        Ok(service)
    }

    /// Forgets the runs that were over `keep_finished` before `now`
    /// (`retention.rs`): what the service does by itself every tenth of
    /// `keep_finished` (at most a minute apart). Nothing, if they are kept
    /// forever.
    pub async fn forget_finished(
        &self,
        now: SystemTime,
    ) -> Result<Vec<RunId>, retention::RetentionError> {
        match self.shared.config.keep_finished {
            Some(keep) => retention::forget_finished(&self.shared, keep, now).await,
            None => Ok(vec![]),
        }
    }

    /// Moves every schedule to `now`: the ticks due by then start, skip,
    /// wait or are recorded as missed (`routes/schedules.rs`). What the
    /// service does by itself every second, unless `schedule_clock` is off.
    pub async fn run_schedules(&self, now: SystemTime) -> Result<(), ApiError> {
        let now = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        routes::schedules::run_due(&self.shared, now).await
    }

    /// Reads the workspace's files again and, if they load, makes them the
    /// version new runs and schedules take (`deploy.rs`): SIGHUP's.
    pub async fn reload(&self) -> Result<api::Deployment, ApiError> {
        deploy::reload(&self.shared).await
    }

    /// The API, with the OpenAPI document it serves built from the same routes.
    pub fn router(&self) -> axum::Router {
        routes::router(self.shared.clone())
    }

    /// The OpenAPI document, as `/v1/openapi.json` serves it.
    pub fn openapi() -> serde_json::Value {
        routes::openapi_document()
    }

    /// The JSON Schema of one event-stream message's data
    /// (docs/contract/event.schema.json is this, committed).
    pub fn event_schema() -> serde_json::Value {
        let mut schema =
            serde_json::to_value(schemars::schema_for!(api::StreamEvent)).unwrap_or_default();
        if let Some(object) = schema.as_object_mut() {
            object.insert("$id".into(), "arbor/event".into());
        }
        schema
    }

    pub fn token(&self) -> &str {
        self.shared.tokens.main().as_str()
    }

    /// `[auth.oidc]`, if configured.
    pub fn oidc(&self) -> Option<&oidc::Oidc> {
        self.shared.oidc.as_ref()
    }

    pub fn token_path(&self) -> &std::path::Path {
        &self.shared.token_path
    }

    pub fn node(&self) -> &EmbeddedNode {
        &self.shared.node
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.shared.config
    }

    /// Serves on `listener` until `stop` resolves, then drains (I-40) and
    /// returns once the journal is flushed.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let stopped = self.shared.stopped.clone();
        // Without TCP_NODELAY, an SSE event written while the response's
        // headers wait for their ACK is held by Nagle's algorithm until the
        // client's delayed ACK (40 ms on Linux): every small run paid it.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(%error, "TCP_NODELAY could not be set on a connection");
            }
        });
        // The client's address goes into the audit log (I-64).
        let app = self
            .router()
            .into_make_service_with_connect_info::<std::net::SocketAddr>();
        let server =
            axum::serve(listener, app).with_graceful_shutdown(stopped.clone().cancelled_owned());
        let server = tokio::spawn(async move { server.await });
        let asked = self.shared.drain_asked.clone();
        tokio::select! {
            _ = stop => {}
            _ = asked.cancelled() => tracing::info!("asked to drain (API): draining"),
        }
        self.drain().await;
        match server.await {
            Ok(result) => result,
            Err(e) => Err(std::io::Error::other(e)),
        }
    }

    /// Stops taking work, gives running runs `drain` to end by themselves,
    /// stops the rest (each subtree stopped, processes killed, accounts
    /// settled and journaled), flushes the journal, and ends every event
    /// stream. Queued runs stay queued for the next start.
    pub async fn drain(&self) {
        let shared = &self.shared;
        if !shared.accepting.swap(false, Ordering::SeqCst) {
            return;
        }
        tracing::info!("draining: no new work is taken");
        shared.admission.close().await;
        let running = shared.admission.running().await;
        if !shared.config.drain.is_zero() && !running.is_empty() {
            tracing::info!(runs = running.len(), drain = ?shared.config.drain, "letting running runs finish");
            let all_ended = async {
                for run in &running {
                    shared.node.wait_run(*run).await;
                }
            };
            let _ = tokio::time::timeout(shared.config.drain, all_ended).await;
        }
        // On a shared journal the runs still running move to another node.
        if !shared.node.hand_over().await
            && let Err(error) = shared.node.close().await
        {
            tracing::error!(%error, "the node did not close cleanly");
        }
        shared.stopped.cancel();
        shared.tasks.close();
        shared.tasks.wait().await;
        tracing::info!("drained: the journal is flushed");
    }
}

/// Moves the schedules every second, by this node's clock, until the drain.
async fn follow_the_clock(shared: Arc<Shared>) {
    let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.stopped.cancelled() => return,
            _ = every.tick() => {}
        }
        if !shared.accepting.load(Ordering::SeqCst) {
            return;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        if let Err(e) = routes::schedules::run_due(&shared, now).await {
            tracing::warn!(error = %e.message, "the schedules could not move");
        }
    }
}
