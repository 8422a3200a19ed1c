//! The routes, their handlers and their documentation. The OpenAPI document
//! is generated from these same declarations (aide, from the types' JSON
//! Schemas), so it cannot drift from what is served.

use crate::Shared;
use crate::admission::{SubmitError, Submitted};
use crate::api::*;
use crate::error::ApiError;
use crate::extract::{JsonBody, Path, Query};
use crate::forward::{self, Forwarded};
use crate::status::*;
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use aide::openapi::OpenApi;
use aide::transform::TransformOperation;
use arbor_protocol::{JobId, RunId, RunSpec, Status, Tree};
use arbor_runtime::LoadError;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response, sse};
use sha2::Digest;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

type S = State<Arc<Shared>>;
type Reply = Result<Response, ApiError>;

/// Documents the error statuses a route can answer with.
macro_rules! errors {
    ($op:expr $(, $code:literal)*) => {{
        let op = $op;
        $( let op = op.response_with::<$code, ApiError, _>(|r| r.description(describe($code))); )*
        op
    }};
}

fn describe(code: u16) -> &'static str {
    match code {
        400 => "Malformed: not JSON, the wrong shape or types, a bad id or header",
        401 => "No bearer token, or the wrong one (I-37)",
        404 => "No such run or job (a finished run is forgotten `keep_finished` after its end)",
        403 => "The console's session cookie, sent from another site (I-53)",
        409 => "Not in a state that allows this; or an Idempotency-Key reused with another body",
        413 => "The body is larger than the node accepts",
        415 => "The body is not sent as application/json",
        422 => "Refused: an unknown flow or agent, a budget out of range, a cap exceeded",
        429 => "The queue is full",
        503 => "The node is shutting down, or its journal has failed",
        _ => "An error",
    }
}

pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    let mut api = OpenApi::default();
    let app = api_router(shared.clone()).finish_api_with(&mut api, document_info);
    let api = Arc::new(serde_json::to_value(&api).unwrap_or_default());
    app.route(
        "/v1/openapi.json",
        axum::routing::get(move || {
            let api = api.clone();
            async move { Json((*api).clone()) }
        })
        .layer(axum::middleware::from_fn_with_state(
            shared.tokens.clone(),
            crate::auth::require_token,
        )),
    )
    .merge(crate::console::routes())
    .layer(axum::extract::DefaultBodyLimit::max(
        shared.config.max_body_bytes,
    ))
    // I-38: a handler that panics answers one 500 in the API's shape; the
    // node and every other request go on.
    .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked))
    .fallback(|| async { ApiError::not_found("no such route") })
    .method_not_allowed_fallback(|| async {
        ApiError::method_not_allowed("this route does not take that method (see /v1/openapi.json)")
    })
}

/// What a request whose handler panicked gets.
fn panicked(_: Box<dyn std::any::Any + Send>) -> Response {
    tracing::error!("a request handler panicked");
    ApiError::internal("the request failed inside arbord; nothing else was affected")
        .into_response()
}

/// The document alone, for `arbord openapi` and the tests.
pub(crate) fn openapi_document() -> serde_json::Value {
    let mut api = OpenApi::default();
    // Handlers never run here; the state only has to exist as a type.
    let _ = api_router_docs().finish_api_with(&mut api, document_info);
    serde_json::to_value(&api).unwrap_or_default()
}

fn document_info(api: aide::transform::TransformOpenApi) -> aide::transform::TransformOpenApi {
    api.title("arbord")
        .version(env!("CARGO_PKG_VERSION"))
        .description(
            "One arbor node: submit runs, watch them, stop and steer their jobs. \
             Every route but /healthz, /readyz and /v1/ui/session needs `Authorization: Bearer TOKEN` \
             (the data dir's `token` file), or the console's session cookie. Errors are `{\"error\": {\"code\", \"message\"}}`.",
        )
        .security_scheme(
            "token",
            aide::openapi::SecurityScheme::Http {
                scheme: "bearer".into(),
                bearer_format: None,
                description: Some("The node's token, from <data dir>/token".into()),
                extensions: Default::default(),
            },
        )
}

fn api_router(shared: Arc<Shared>) -> ApiRouter {
    let token = shared.tokens.clone();
    let protected = protected_routes().route_layer(axum::middleware::from_fn_with_state(
        token,
        crate::auth::require_token,
    ));
    protected.merge(public_routes()).with_state(shared)
}

/// The same routes, for the document only.
fn api_router_docs() -> ApiRouter<Arc<Shared>> {
    protected_routes().merge(public_routes())
}

/// Says where an id for other operations comes from (for clients, and for
/// a fuzzer that follows links from one call to the next).
fn linked<'t, T>(
    mut r: aide::transform::TransformResponse<'t, T>,
    id_from: &str,
    operations: &[&str],
) -> aide::transform::TransformResponse<'t, T> {
    for operation in operations {
        r.inner().links.insert(
            (*operation).to_string(),
            aide::openapi::ReferenceOr::Item(aide::openapi::Link {
                description: None,
                operation: aide::openapi::LinkOperation::OperationId((*operation).to_string()),
                request_body: None,
                parameters: [("id".to_string(), serde_json::Value::from(id_from))]
                    .into_iter()
                    .collect(),
                server: None,
                extensions: Default::default(),
            }),
        );
    }
    r
}

fn secured(op: TransformOperation) -> TransformOperation {
    errors!(op.security_requirement("token"), 401)
}

fn protected_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .merge(run_routes())
        .merge(run_action_routes())
        .merge(job_routes())
        .merge(approval_routes())
        .merge(node_routes())
}

/// Submitting, listing, reading and replaying runs.
fn run_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/runs",
            post_with(submit_run, |op| {
                errors!(
                    secured(op)
                        .id("submitRun")
                        .summary("Submit a run: a flow, or one agent on an input")
                        .description(
                            "Queued, then started when fewer than max_running_runs run. \
                             With an Idempotency-Key header, the same key and body give the \
                             same run (200); the same key with another body is a 409.",
                        )
                        .parameter_untyped("Idempotency-Key", |p| {
                            p.description("Makes a retry safe: 1 to 255 visible ASCII characters")
                        })
                        .response_with::<201, Json<RunCreated>, _>(|r| {
                            linked(
                                r.description("Queued"),
                                "$response.body#/id",
                                &["getRun", "stopRun", "runEvents"],
                            )
                        })
                        .response_with::<200, Json<RunCreated>, _>(|r| {
                            r.description("A replay: this key and body made this run before")
                        }),
                    400,
                    409,
                    413,
                    415,
                    422,
                    429,
                    503
                )
            })
            .get_with(list_runs, |op| {
                errors!(
                    secured(op)
                        .id("listRuns")
                        .summary("Runs, newest first, by status, paged")
                        .response::<200, Json<RunList>>(),
                    400,
                    503
                )
            }),
        )
        .api_route(
            "/v1/runs/{id}",
            get_with(get_run, |op| {
                errors!(
                    secured(op)
                        .id("getRun")
                        .summary("A run's tree: the document `arbor run --json` prints")
                        .response_with::<200, Json<RunDocument>, _>(|r| {
                            linked(
                                r.description("The run's tree"),
                                "$response.body#/run/children/0/id",
                                &["getJob", "stopJob", "steerJob", "continueJob"],
                            )
                        }),
                    400,
                    404,
                    503
                )
            }),
        )
        .api_route(
            "/v1/runs/{id}/replay",
            post_with(replay_run, |op| {
                errors!(
                    secured(op)
                        .id("replayRun")
                        .summary("Replay a recorded run as a new run, or rerun a failed one")
                        .description(
                            "The new run is queued as a submission is. With rerun_failed, \
                             the jobs that completed (their agent and arbor.toml unchanged) \
                             are served from the recording and the rest run live; with \
                             dry_run too, the plan is answered and nothing starts. A run \
                             that was not recorded, of another workspace, that did not fail \
                             (rerun_failed), or whose definitions changed (without \
                             allow_changed) is a 422 naming why.",
                        )
                        .response::<201, Json<ReplayStarted>>()
                        .response_with::<200, Json<arbor_runtime::replay::RerunPlan>, _>(|r| {
                            r.description("dry_run: the rerun's plan")
                        }),
                    400,
                    404,
                    413,
                    415,
                    422,
                    429,
                    503
                )
            }),
        )
}

/// Stopping a run, and its events.
fn run_action_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/runs/{id}/stop",
            post_with(stop_run, |op| {
                errors!(
                    secured(op)
                        .id("stopRun")
                        .summary("Stop a run and its whole tree (a queued run never starts)")
                        .response::<202, Json<StopAccepted>>(),
                    400,
                    404,
                    409,
                    503
                )
            }),
        )
        .api_route(
            "/v1/runs/{id}/events",
            get_with(run_events, |op| {
                errors!(
                    secured(op)
                        .id("runEvents")
                        .summary("The run's events as Server-Sent Events")
                        .description(
                            "Each message's id is the event's place in the run (1, 2, ...); \
                             reconnect with Last-Event-ID to go on from there. The data is a \
                             StreamEvent (docs/contract/event.schema.json). Keep-alive comments \
                             every 15 s; the stream ends after the run's run_finished.",
                        )
                        .parameter_untyped("Last-Event-ID", |p| {
                            p.description("The id of the last event seen")
                        })
                        .response_with::<200, String, _>(|r| {
                            r.description("text/event-stream of StreamEvent")
                                .with(|mut r| {
                                    r.inner().content = [(
                                        "text/event-stream".to_string(),
                                        aide::openapi::MediaType::default(),
                                    )]
                                    .into_iter()
                                    .collect();
                                    r
                                })
                        }),
                    400,
                    404,
                    503
                )
            }),
        )
}

/// A job: read, stopped, steered, continued.
fn job_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/jobs/{id}",
            get_with(get_job, |op| {
                errors!(
                    secured(op)
                        .id("getJob")
                        .summary("A step or job and everything below it")
                        .response::<200, Json<JobDocument>>(),
                    400,
                    404,
                    503
                )
            }),
        )
        .api_route(
            "/v1/jobs/{id}/stop",
            post_with(stop_job, |op| {
                errors!(
                    secured(op)
                        .id("stopJob")
                        .summary("Stop one step or job and its subtree; its parent goes on")
                        .response::<202, Json<StopAccepted>>(),
                    400,
                    404,
                    409,
                    503
                )
            }),
        )
        .api_route(
            "/v1/jobs/{id}/messages",
            post_with(steer_job, |op| {
                errors!(
                    secured(op)
                        .id("steerJob")
                        .summary("Send a running step or job a message (steer)")
                        .response::<202, Json<SteerQueued>>(),
                    400,
                    404,
                    409,
                    413,
                    415,
                    422,
                    503
                )
            }),
        )
        .api_route(
            "/v1/jobs/{id}/continue",
            post_with(continue_job, |op| {
                errors!(
                    secured(op)
                        .id("continueJob")
                        .summary("Continue a job a restart interrupted, as its next attempt (I-33)")
                        .response::<201, Json<Continued>>(),
                    400,
                    404,
                    409,
                    503
                )
            }),
        )
}

/// Approval cards: listed, decided.
fn approval_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/approvals",
            get_with(list_approvals, |op| {
                errors!(
                    secured(op)
                        .id("listApprovals")
                        .summary("Approval cards of every run, oldest first, by run and state")
                        .description(
                            "One queue for the whole tree: a card of a job at depth 3 is here \
                             beside a step's. A card is in the journal before it is listed.",
                        )
                        .response_with::<200, Json<ApprovalList>, _>(|r| {
                            linked(
                                r.description("The cards"),
                                "$response.body#/approvals/0/id",
                                &["decideApproval"],
                            )
                        }),
                    400,
                    503
                )
            }),
        )
        .api_route(
            "/v1/approvals/{id}",
            post_with(decide_approval, |op| {
                errors!(
                    secured(op)
                        .id("decideApproval")
                        .summary("Approve, reject or edit a pending card (I-46)")
                        .description(
                            "The decision is committed before the call may run and records \
                             the token's name. 409 once the card is closed (decided, expired, \
                             or cancelled by a stop, which wins); 422 for a rejection without \
                             a reason or edited arguments the tool does not take.",
                        )
                        .response::<200, Json<CardView>>(),
                    400,
                    404,
                    409,
                    413,
                    415,
                    422,
                    503
                )
            }),
        )
}

/// The node: its status, a drain, its metrics.
fn node_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/status",
            get_with(node_status, |op| {
                errors!(
                    secured(op)
                        .id("status")
                        .summary("The node: live runs and their accounts, actors, sandboxes, queue, journal, last recovery")
                        .response::<200, Json<NodeStatus>>(),
                    503
                )
            }),
        )
        .api_route(
            "/v1/nodes/{id}/drain",
            post_with(drain_node, |op| {
                errors!(
                    secured(op)
                        .id("drainNode")
                        .summary("Drain a node of a shared journal: it takes no more runs, and its running ones finish or move")
                        .description(
                            "As SIGTERM to that node's arbord: queued runs stay in the shared \
                             queue, running ones get its `drain` time, then move to another \
                             node; it then exits 0. Another node learns it at its next lease \
                             renewal. A node whose journal is its own refuses (409): send \
                             its arbord SIGTERM.",
                        )
                        .response::<202, Json<DrainAsked>>(),
                    404,
                    409,
                    503
                )
            }),
        )
        .api_route(
            "/metrics",
            get_with(metrics, |op| {
                errors!(
                    secured(op)
                        .id("metrics")
                        .summary("Prometheus (OpenMetrics text) metrics; labels never name a run or job")
                        .response_with::<200, String, _>(|r| {
                            r.description("OpenMetrics text").with(|mut r| {
                                r.inner().content = [(
                                    "application/openmetrics-text".to_string(),
                                    aide::openapi::MediaType::default(),
                                )]
                                .into_iter()
                                .collect();
                                r
                            })
                        }),
                    503
                )
            }),
        )
}

fn public_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/ui/session",
            post_with(open_session, |op| {
                errors!(
                    op.id("openUiSession")
                        .summary("The console's login: a token in, a session cookie out")
                        .description(
                            "Sets `arbor_session` (HttpOnly, SameSite=Strict, 12 h), which every \
                             route that needs a token takes in place of the Authorization \
                             header, from the node's own pages only: a request from another \
                             site with it is refused (403). The cookie is a random id, never \
                             the token; a restart of the node ends every session.",
                        )
                        .response_with::<204, (), _>(
                            |r| r.description("Logged in: the cookie is set")
                        ),
                    400,
                    401,
                    403,
                    413,
                    415
                )
            })
            .delete_with(close_session, |op| {
                op.id("closeUiSession")
                    .summary("The console's logout: its session ends, its cookie is cleared")
                    .response_with::<204, (), _>(|r| {
                        r.description("Logged out (or was not logged in)")
                    })
            }),
        )
        .api_route(
            "/healthz",
            get_with(healthz, |op| {
                op.id("healthz")
                    .summary("The process answers (no token needed)")
                    .response::<200, Json<Health>>()
            }),
        )
        .api_route(
            "/readyz",
            get_with(readyz, |op| {
                op.id("readyz")
                    .summary(
                        "The node takes work: not draining, journal writable (no token needed)",
                    )
                    .response::<200, Json<Health>>()
                    .response_with::<503, Json<Health>, _>(|r| {
                        r.description("Draining, or the journal has failed")
                    })
            }),
        )
}

// ---- helpers ----

fn parse_run(id: &str) -> Result<RunId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("{id:?} is not a run id (a UUID)")))
}

fn parse_job(id: &str) -> Result<JobId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("{id:?} is not a job id (a UUID)")))
}

fn accepting(shared: &Shared) -> Result<(), ApiError> {
    if !shared.accepting.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable(
            "the node is shutting down and takes no new work",
        ));
    }
    if let Some(failure) = shared.node.journal().failed() {
        return Err(ApiError::unavailable(format!(
            "the journal has failed ({failure}); the node takes no new work"
        )));
    }
    Ok(())
}

/// The run's tree now: from its events, or, for a run that waits in the
/// queue, a bare pending root. `None`: no such run.
async fn run_tree(shared: &Shared, run: RunId) -> Result<Option<Tree>, ApiError> {
    if let Some(tree) = shared.node.events().tree(run) {
        return Ok(Some(tree));
    }
    if shared.admission.place(run).await.is_some() {
        return Ok(Some(Tree::new(run)));
    }
    // Another node's run, on a shared journal: its tree from its journaled
    // events (every event is journaled before it is sent).
    let events = shared.node.journal().events(run)?;
    if !events.is_empty() {
        let mut tree = Tree::new(run);
        for event in &events {
            tree.apply(event);
        }
        return Ok(Some(tree));
    }
    // A run with a record and no events (they were not journaled): what
    // its record says.
    if let Some(record) = shared.node.journal().run(run)? {
        let mut tree = Tree::new(run);
        if record.status.is_terminal() {
            tree.apply(&arbor_protocol::Event {
                seq: 0,
                run,
                at_ms: 0,
                kind: arbor_protocol::EventKind::RunFinished {
                    status: record.status,
                    error_class: record.error_class,
                    reason: record.reason,
                    output: serde_json::from_str(&record.output_json).unwrap_or_default(),
                },
            });
        }
        return Ok(Some(tree));
    }
    Ok(None)
}

/// The run a step or job belongs to, and its tree.
fn job_tree(shared: &Shared, job: JobId) -> Result<(RunId, Tree), ApiError> {
    let events = shared.node.events();
    let run = match events.find_job(job) {
        Some((run, _)) => run,
        None => shared
            .node
            .journal()
            .run_of_job(job)?
            .ok_or_else(|| ApiError::not_found(format!("no step or job {job}")))?,
    };
    let tree = events
        .tree(run)
        .filter(|t| t.node(job).is_some())
        .ok_or_else(|| ApiError::not_found(format!("no step or job {job}")))?;
    Ok((run, tree))
}

fn json(status: StatusCode, body: impl serde::Serialize) -> Response {
    (status, Json(body)).into_response()
}

fn stop_accepted(id: impl std::fmt::Display, state: &str) -> Response {
    json(
        StatusCode::ACCEPTED,
        StopAccepted {
            id: id.to_string(),
            state: state.into(),
        },
    )
}

// ---- runs ----

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::bad_request("Idempotency-Key must be 1 to 255 visible ASCII characters")
        })?;
    Ok(Some(key.to_string()))
}

/// The request as a `RunSpec`, every I-36 check made; nothing changes here.
fn resolve(shared: &Shared, body: &SubmitRun) -> Result<RunSpec, ApiError> {
    let ws = &shared.workspace;
    let cfg = &shared.config;
    let budget = body.budget.clone().unwrap_or_default();
    let tokens = budget.tokens().map_err(ApiError::refused)?;
    let usd = budget.usd_micros().map_err(ApiError::refused)?;
    let load = |e: LoadError| ApiError::refused(e.to_string());
    let spec = match (&body.flow, &body.agent, &body.input) {
        (Some(flow), None, None) => ws.flow_run(flow, tokens).map_err(load)?,
        (None, Some(agent), Some(input)) => {
            if input.trim().is_empty() {
                return Err(ApiError::refused(
                    "`input` is empty: say what the agent should do",
                ));
            }
            if input.len() > cfg.max_input_bytes {
                return Err(ApiError::refused(format!(
                    "`input` is {} bytes; this node takes at most {} (max_input_bytes)",
                    input.len(),
                    cfg.max_input_bytes
                )));
            }
            ws.agent_run(agent, input, tokens).map_err(load)?
        }
        (None, Some(_), None) => {
            return Err(ApiError::bad_request("`agent` needs an `input`"));
        }
        (None, None, Some(_)) => {
            return Err(ApiError::bad_request("`input` needs an `agent`"));
        }
        _ => {
            return Err(ApiError::bad_request(
                "give `flow`, or `agent` and `input` (not both)",
            ));
        }
    };
    if spec.budget_tokens > cfg.max_run_tokens {
        return Err(ApiError::refused(format!(
            "a budget of {} tokens is more than this node allows one run (max_run_tokens {})",
            spec.budget_tokens, cfg.max_run_tokens
        )));
    }
    let spec = match usd {
        Some(micros) if micros > cfg.max_run_usd_micros => {
            return Err(ApiError::refused(format!(
                "a ceiling of {micros} micro-dollars is more than this node allows one run (max_run_usd)"
            )));
        }
        Some(micros) => ws.with_usd_ceiling(spec, micros).map_err(load)?,
        None => spec,
    };
    // `record` adds to arbor.toml's `[record] models`, never turns it off.
    Ok(if body.record {
        ws.recording(spec, true)
    } else {
        spec
    })
}

async fn submit_run(
    State(shared): S,
    headers: HeaderMap,
    JsonBody(body): JsonBody<SubmitRun>,
) -> Reply {
    let key = idempotency_key(&headers)?;
    let spec = resolve(&shared, &body)?;
    let digest = {
        let canonical = serde_json::to_vec(&body).unwrap_or_default();
        let hash = sha2::Sha256::digest(&canonical);
        hash.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    // A replay is answered even while draining: it changes nothing.
    if key.is_none() {
        accepting(&shared)?;
    }
    let submitted = shared
        .admission
        .submit(&spec, key, digest)
        .await
        .map_err(|e| match e {
            SubmitError::KeyConflict(_) => ApiError::conflict(e.to_string()),
            SubmitError::QueueFull(_) => ApiError::queue_full(e.to_string()),
            SubmitError::Closed => ApiError::unavailable(e.to_string()),
            SubmitError::Journal(e) => ApiError::from(e),
        })?;
    let (run, status, replayed) = match submitted {
        Submitted::New(run) => (run, StatusCode::CREATED, false),
        Submitted::Replayed(run) => (run, StatusCode::OK, true),
    };
    let run_status = run_tree(&shared, run)
        .await?
        .map(|t| t.run_status())
        .unwrap_or(Status::Pending);
    let mut response = json(
        status,
        RunCreated {
            id: run,
            status: run_status,
            replayed,
            links: RunLinks::of(run),
        },
    );
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/runs/{run}")) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

async fn replay_run(
    State(shared): S,
    Path(path): Path<IdPath>,
    JsonBody(body): JsonBody<ReplayRun>,
) -> Reply {
    use arbor_runtime::replay::{self, ReplayError, ReplayOptions};
    let of = parse_run(&path.id)?;
    if (body.dry_run || body.allow_changed) && !body.rerun_failed {
        return Err(ApiError::bad_request(
            "`dry_run` and `allow_changed` go with `rerun_failed`",
        ));
    }
    if body.rerun_failed
        && (body.tools != Default::default() || body.after_divergence != Default::default())
    {
        return Err(ApiError::bad_request(
            "a rerun serves what it reuses from the recording and runs the rest live: \
             `tools` and `after_divergence` are a replay's",
        ));
    }
    let refused = |e: ReplayError| match e {
        ReplayError::NoRun(_) => ApiError::not_found(e.to_string()),
        ReplayError::Journal(e) => ApiError::from(e),
        other => ApiError::refused(other.to_string()),
    };
    let journal = shared.node.journal();
    let spec = if body.rerun_failed {
        let plan = replay::plan_rerun(journal, &shared.workspace, of, body.allow_changed)
            .map_err(refused)?;
        if body.dry_run {
            return Ok(json(StatusCode::OK, plan));
        }
        replay::rerun_spec(&shared.workspace, plan, body.record).0
    } else {
        let recorded = replay::recorded(journal, of).map_err(refused)?;
        replay::check(&shared.workspace, of, &recorded.spec, &recorded.agents).map_err(refused)?;
        let options = ReplayOptions {
            tools: body.tools,
            after_divergence: body.after_divergence,
            record: body.record,
        };
        replay::replay_spec(&shared.workspace, of, recorded.spec, options)
    };
    accepting(&shared)?;
    let digest = String::new();
    let submitted = shared
        .admission
        .submit(&spec, None, digest)
        .await
        .map_err(|e| match e {
            SubmitError::KeyConflict(_) => ApiError::conflict(e.to_string()),
            SubmitError::QueueFull(_) => ApiError::queue_full(e.to_string()),
            SubmitError::Closed => ApiError::unavailable(e.to_string()),
            SubmitError::Journal(e) => ApiError::from(e),
        })?;
    let (Submitted::New(run) | Submitted::Replayed(run)) = submitted;
    let status = run_tree(&shared, run)
        .await?
        .map(|t| t.run_status())
        .unwrap_or(Status::Pending);
    let mut response = json(
        StatusCode::CREATED,
        ReplayStarted {
            id: run,
            replay_of: of,
            status,
            links: RunLinks::of(run),
        },
    );
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/runs/{run}")) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// When a run was submitted: its id is a uuid v7, which carries that
/// millisecond.
fn created_at_ms(run: RunId) -> u64 {
    run.0.get_timestamp().map_or(0, |t| {
        let (secs, nanos) = t.to_unix();
        secs * 1000 + u64::from(nanos / 1_000_000)
    })
}

async fn list_runs(State(shared): S, Query(query): Query<RunQuery>) -> Reply {
    let limit = query.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::bad_request("limit must be 1 to 500"));
    }
    let queued = shared.admission.queued().await?;
    let mut all: Vec<RunSummary> = queued
        .iter()
        .enumerate()
        .map(|(position, sub)| {
            let spec: Option<RunSpec> = serde_json::from_str(&sub.spec_json).ok();
            RunSummary {
                id: sub.run,
                flow: spec.as_ref().map(|s| s.flow.clone()).unwrap_or_default(),
                status: Status::Pending,
                error_class: None,
                reason: None,
                budget_tokens: spec.map(|s| s.budget_tokens).unwrap_or_default(),
                created_at_ms: created_at_ms(sub.run),
                started_at_ms: None,
                ended_at_ms: None,
                tokens: None,
                usd: None,
                queue_position: Some(position),
                failed_job: None,
            }
        })
        .collect();
    all.extend(
        shared
            .node
            .journal()
            .runs()?
            .into_iter()
            .map(|r| RunSummary {
                id: r.id,
                flow: r.flow,
                status: r.status,
                error_class: r.error_class,
                reason: r.reason,
                budget_tokens: r.budget_tokens,
                created_at_ms: created_at_ms(r.id),
                started_at_ms: None,
                ended_at_ms: None,
                tokens: None,
                usd: None,
                queue_position: None,
                failed_job: None,
            }),
    );
    // Ids are uuid v7: newest first is id order, reversed.
    all.sort_by_key(|r| std::cmp::Reverse(r.id));
    let mut page: Vec<RunSummary> = all
        .into_iter()
        .filter(|r| query.status.is_none_or(|s| r.status == s))
        .filter(|r| query.after.is_none_or(|after| r.id < after))
        .take(limit as usize + 1)
        .collect();
    let next = (page.len() > limit as usize).then(|| {
        page.truncate(limit as usize);
        page.last().map(|r| r.id)
    });
    // Times and money from the run's own node of its tree (kept by the
    // event bus; a run ended before a restart is folded once).
    for run in page.iter_mut() {
        shared.node.events().with_tree(run.id, |tree| {
            if let Some(head) = tree.map(|t| t.head()) {
                run.started_at_ms = head.started_at_ms;
                run.ended_at_ms = head.ended_at_ms;
                run.tokens = head.started_at_ms.map(|_| head.account);
                run.usd = head.usd;
            }
        });
    }
    // A dead letter says where it died: its tree is read for that only.
    for run in page.iter_mut().filter(|r| r.status == Status::Failed) {
        if let Some(tree) = run_tree(&shared, run.id).await? {
            run.failed_job = FailedJob::first_in(&tree);
        }
    }
    Ok(json(
        StatusCode::OK,
        RunList {
            runs: page,
            next: next.flatten(),
        },
    ))
}

async fn get_run(State(shared): S, Path(path): Path<IdPath>) -> Reply {
    let run = parse_run(&path.id)?;
    let tree = run_tree(&shared, run)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no run {run}")))?;
    let owner = shared.node.journal().owner(run)?;
    Ok(json(
        StatusCode::OK,
        RunDocument {
            run: tree.root(),
            epoch: owner.as_ref().map(|(_, epoch)| *epoch),
            owner: owner.map(|(node, _)| node),
        },
    ))
}

async fn stop_run(State(shared): S, Path(path): Path<IdPath>) -> Reply {
    let run = parse_run(&path.id)?;
    let reason = "stopped by an operator (API)";
    if shared.admission.cancel(run, reason).await? {
        return Ok(stop_accepted(run, "stopped"));
    }
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        return forward::send(&shared, run, &owner, Forwarded::StopRun { run }).await;
    }
    stop_run_here(&shared, run).await
}

/// Stops a run this node owns (or one it has no owner for: its own).
async fn stop_run_here(shared: &Shared, run: RunId) -> Reply {
    let reason = "stopped by an operator (API)";
    let tree = run_tree(shared, run)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no run {run}")))?;
    let status = tree.run_status();
    if status.is_terminal() {
        return Err(ApiError::conflict(format!(
            "run {run} has already ended ({status})"
        )));
    }
    shared
        .node
        .stop_run(run, reason)
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok(stop_accepted(run, "stopping"))
}

async fn run_events(
    State(shared): S,
    Path(path): Path<IdPath>,
    Query(query): Query<EventsQuery>,
    headers: HeaderMap,
) -> Reply {
    let run = parse_run(&path.id)?;
    let after = match headers.get("last-event-id") {
        None => query.after.unwrap_or(0),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::bad_request("Last-Event-ID must be the id of an event: a whole number")
            })?,
    };
    let Some(tree) = run_tree(&shared, run).await? else {
        return Err(ApiError::not_found(format!("no run {run}")));
    };
    if let Some(job) = query.job
        && tree.node(job).is_none()
    {
        return Err(ApiError::not_found(format!(
            "no step or job {job} in run {run}"
        )));
    }
    // An ended run's stream ends after its history, even one whose end
    // event is not in the journal.
    let follow = query.follow.unwrap_or(true) && !tree.run_status().is_terminal();
    let stream = crate::sse::stream(crate::sse::Source {
        bus: shared.node.events().clone(),
        journal: shared.node.journal().clone(),
        run,
        after,
        follow,
        job: query.job,
        buffer: shared.config.sse_buffer,
        stall: shared.config.sse_stall,
        reread: shared
            .node
            .journal()
            .is_shared()
            .then_some(crate::sse::SHARED_REREAD),
        shutdown: shared.stopped.clone(),
        tasks: shared.tasks.clone(),
    });
    Ok(sse::Sse::new(stream)
        .keep_alive(
            sse::KeepAlive::new()
                .interval(Duration::from_secs(15))
                .text("keep-alive"),
        )
        .into_response())
}

// ---- jobs ----

async fn get_job(State(shared): S, Path(path): Path<IdPath>) -> Reply {
    let job = parse_job(&path.id)?;
    let (run, tree) = job_tree(&shared, job)?;
    let node = tree
        .subtree(job)
        .ok_or_else(|| ApiError::not_found(format!("no step or job {job}")))?;
    let setup = node
        .agent
        .as_deref()
        .and_then(|name| shared.node.context().agent(name))
        .map(|agent| JobSetup::of(&agent));
    let steering = shared
        .node
        .journal()
        .steering(job)?
        .into_iter()
        .map(SteerView::of)
        .collect();
    Ok(json(
        StatusCode::OK,
        JobDocument {
            run,
            job: node,
            setup,
            steering,
        },
    ))
}

async fn stop_job(State(shared): S, Path(path): Path<IdPath>) -> Reply {
    let job = parse_job(&path.id)?;
    let (run, _) = job_tree(&shared, job)?;
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        return forward::send(&shared, run, &owner, Forwarded::StopJob { run, job }).await;
    }
    stop_job_here(&shared, run, job).await
}

async fn stop_job_here(shared: &Shared, run: RunId, job: JobId) -> Reply {
    let (_, tree) = job_tree(shared, job)?;
    let status = tree.node(job).map(|n| n.status).unwrap_or(Status::Done);
    if status.is_terminal() {
        return Err(ApiError::conflict(format!(
            "{job} has already ended ({status})"
        )));
    }
    shared
        .node
        .stop_job(run, job, "stopped by an operator (API)")
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok(stop_accepted(job, "stopping"))
}

// ---- approvals ----

async fn list_approvals(State(shared): S, Query(query): Query<ApprovalQuery>) -> Reply {
    let cards = shared.node.approvals(query.run, query.state)?;
    Ok(json(
        StatusCode::OK,
        ApprovalList {
            approvals: cards.into_iter().map(CardView::from).collect(),
        },
    ))
}

async fn decide_approval(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::auth::Caller>,
    Path(path): Path<IdPath>,
    JsonBody(body): JsonBody<DecisionBody>,
) -> Reply {
    let id: arbor_protocol::CardId = path.id.parse().map_err(|_| {
        ApiError::bad_request(format!("{:?} is not an approval card id (a UUID)", path.id))
    })?;
    if body.reason.as_ref().is_some_and(|r| r.len() > 4096) {
        return Err(ApiError::refused("`reason` is longer than 4096 bytes"));
    }
    let run = shared
        .node
        .approvals(None, None)?
        .into_iter()
        .find(|card| card.id == id)
        .map(|card| card.run);
    if let Some(run) = run
        && let Some(owner) = forward::elsewhere(&shared, run)?
    {
        let call = Forwarded::Decide {
            card: id,
            body,
            by: caller.0,
        };
        return forward::send(&shared, run, &owner, call).await;
    }
    decide_here(&shared, id, body, caller.0).await
}

async fn decide_here(
    shared: &Shared,
    id: arbor_protocol::CardId,
    body: DecisionBody,
    by: String,
) -> Reply {
    use arbor_runtime::{Decide, DecideError};
    let decide = Decide {
        verdict: body.decision,
        reason: body.reason,
        args: body.args,
        by,
    };
    match shared.node.decide(id, decide).await {
        Ok(card) => Ok(json(StatusCode::OK, CardView::from(card))),
        Err(e @ DecideError::Unknown(_)) => Err(ApiError::not_found(e.to_string())),
        Err(e @ (DecideError::Closed { .. } | DecideError::Idle(_))) => {
            Err(ApiError::conflict(e.to_string()))
        }
        Err(e @ DecideError::Invalid(_)) => Err(ApiError::refused(e.to_string())),
        Err(e @ DecideError::Journal(_)) => Err(ApiError::unavailable(e.to_string())),
    }
}

async fn steer_job(
    State(shared): S,
    Path(path): Path<IdPath>,
    JsonBody(body): JsonBody<SteerMessage>,
) -> Reply {
    let job = parse_job(&path.id)?;
    if body.text.trim().is_empty() {
        return Err(ApiError::refused("`text` is empty"));
    }
    if body.text.len() > shared.config.max_input_bytes {
        return Err(ApiError::refused(format!(
            "the message is {} bytes; this node takes at most {} (max_input_bytes)",
            body.text.len(),
            shared.config.max_input_bytes
        )));
    }
    let (run, _) = job_tree(&shared, job)?;
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        let call = Forwarded::Steer {
            job,
            text: body.text,
        };
        return forward::send(&shared, run, &owner, call).await;
    }
    steer_here(&shared, job, body.text).await
}

async fn steer_here(shared: &Shared, job: JobId, text: String) -> Reply {
    let (_, tree) = job_tree(shared, job)?;
    if let Some(status) = tree.node(job).map(|n| n.status)
        && status.is_terminal()
    {
        return Err(ApiError::conflict(format!(
            "{job} has already ended ({status}); the message was not queued"
        )));
    }
    let message_id = shared
        .node
        .steer(job, &text)
        .await
        .map_err(|refusal| ApiError::conflict(refusal.to_string()))?;
    Ok(json(StatusCode::ACCEPTED, SteerQueued { job, message_id }))
}

/// Acts on a call another node sent about a run this node owns
/// (`forward.rs`), as this node's API would.
pub(crate) fn handle_forwarded(
    shared: Arc<Shared>,
    call: Forwarded,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send + 'static>> {
    Box::pin(async move {
        let reply = match call {
            Forwarded::StopRun { run } => stop_run_here(&shared, run).await,
            Forwarded::StopJob { run, job } => stop_job_here(&shared, run, job).await,
            Forwarded::Steer { job, text } => steer_here(&shared, job, text).await,
            Forwarded::Decide { card, body, by } => decide_here(&shared, card, body, by).await,
        };
        reply.unwrap_or_else(IntoResponse::into_response)
    })
}

async fn continue_job(State(shared): S, Path(path): Path<IdPath>) -> Reply {
    let job = parse_job(&path.id)?;
    job_tree(&shared, job)?;
    accepting(&shared)?;
    let run = shared
        .node
        .continue_job(job)
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok(json(
        StatusCode::CREATED,
        Continued {
            job,
            run,
            links: RunLinks::of(run),
        },
    ))
}

// ---- node ----

async fn node_status(State(shared): S) -> Reply {
    let node = &shared.node;
    let journal = node.journal();
    let (queued, running) = shared.admission.counts().await?;
    let mut runs: Vec<arbor_protocol::TreeNode> = vec![];
    for sub in shared.admission.queued().await? {
        runs.push(Tree::new(sub.run).root());
    }
    for record in journal.runs()? {
        if !record.status.is_terminal()
            && let Some(tree) = node.events().tree(record.id)
            && !tree.run_status().is_terminal()
        {
            runs.push(tree.root());
        }
    }
    let recovery = node.recovery();
    let status = NodeStatus {
        node: NodeInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            epoch: journal.epoch(),
            started_at_ms: shared.started_at_ms,
            uptime_ms: shared.started.elapsed().as_millis() as u64,
            accepting: shared.accepting.load(Ordering::SeqCst),
            sandbox: shared.node.sandbox(),
        },
        admission: AdmissionInfo {
            max_running_runs: shared.config.max_running_runs,
            running,
            queued,
        },
        journal: JournalInfo {
            applied_seq: journal.applied_seq(),
            durable_seq: journal.durable_seq(),
            flushes: journal.flush_count(),
            fsyncs: journal.sync_count(),
            failed: journal.failed(),
        },
        recovery: RecoveryInfo {
            epoch: recovery.epoch,
            jobs_failed: recovery.jobs_failed.clone(),
            processes_killed: recovery.processes_killed.clone(),
            grants_released: recovery.grants_released,
            runs_resumed: node.resumed().iter().map(|(id, _)| *id).collect(),
            undecodable: recovery.undecodable.len(),
            breaches: recovery.breaches.clone(),
        },
        runs,
        nodes: journal.nodes()?.map(|nodes| {
            nodes
                .into_iter()
                .map(|n| ClusterNode {
                    id: n.id,
                    epoch: n.epoch,
                    lease_left_ms: n.lease_left_ms,
                    runs: n
                        .runs
                        .into_iter()
                        .filter_map(|(key, epoch)| {
                            let run = uuid::Uuid::from_slice(&key).ok()?;
                            Some(OwnedRun {
                                run: RunId(run),
                                epoch,
                            })
                        })
                        .collect(),
                })
                .collect()
        }),
        actors: node.actors(),
        sandboxes: journal
            .live_sandboxes()?
            .into_iter()
            .map(|s| SandboxView {
                run: s.run,
                job: s.job,
                pgid: s.pgid,
            })
            .collect(),
    };
    Ok(json(StatusCode::OK, status))
}

async fn drain_node(State(shared): S, Path(path): Path<NodePath>) -> Reply {
    let journal = shared.node.journal();
    let Some(me) = journal.node_id() else {
        return Err(ApiError::conflict(
            "this node's journal is its own, with no other node to take its runs: drain it \
             with SIGTERM to its arbord",
        ));
    };
    if path.id == me {
        shared.drain_asked.cancel();
        return Ok(json(
            StatusCode::ACCEPTED,
            DrainAsked {
                node: me,
                state: "draining".into(),
            },
        ));
    }
    match journal.ask_drain(&path.id)? {
        Some(true) => Ok(json(
            StatusCode::ACCEPTED,
            DrainAsked {
                node: path.id,
                state: "asked".into(),
            },
        )),
        _ => Err(ApiError::not_found(format!(
            "no node {:?} in this journal (`arbor status` lists them)",
            path.id
        ))),
    }
}

async fn metrics(State(shared): S) -> Reply {
    let (queued, _) = shared.admission.counts().await?;
    let text = shared
        .metrics
        .render(shared.node.journal(), queued, shared.node.telemetry())
        .map_err(|e| ApiError::unavailable(format!("metrics: {e}")))?;
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response())
}

/// The session cookie's header: `id` for `max_age`, or cleared.
fn session_cookie_header(id: &str, max_age: Duration) -> Result<HeaderValue, ApiError> {
    HeaderValue::from_str(&format!(
        "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        crate::auth::SESSION_COOKIE,
        max_age.as_secs()
    ))
    .map_err(|_| ApiError::internal("the session cookie could not be written"))
}

async fn open_session(
    State(shared): S,
    headers: HeaderMap,
    JsonBody(login): JsonBody<UiLogin>,
) -> Reply {
    // A login forced from another site would log the browser in as
    // someone else's token: refused as the cookie's use is.
    if let Some(why) = crate::auth::cross_site(&headers) {
        return Err(ApiError::forbidden(format!(
            "{why}: the console logs in from its own page only"
        )));
    }
    use crate::auth::SessionRefused;
    let id = shared
        .tokens
        .open_session(login.token.trim())
        .map_err(|refused| match refused {
            SessionRefused::WrongToken => ApiError::unauthorized("the token is wrong"),
            SessionRefused::NoRandomness(error) => {
                ApiError::internal(format!("no session id could be drawn: {error}"))
            }
        })?;
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie_header(&id, crate::auth::SESSION_LIFETIME)?,
    );
    Ok(response)
}

async fn close_session(State(shared): S, headers: HeaderMap) -> Reply {
    if let Some(id) = crate::auth::session_cookie(&headers) {
        shared.tokens.close_session(id);
    }
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie_header("", Duration::ZERO)?,
    );
    Ok(response)
}

async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

async fn readyz(State(shared): S) -> Response {
    match accepting(&shared) {
        Ok(()) => json(
            StatusCode::OK,
            Health {
                status: "ok".into(),
            },
        ),
        Err(e) => json(
            StatusCode::SERVICE_UNAVAILABLE,
            Health { status: e.message },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    /// I-38 at the HTTP edge: a handler that panics is one 500 in the API's
    /// error shape, and the router serves the next request.
    #[tokio::test]
    async fn a_handler_that_panics_is_one_500_in_the_apis_shape() {
        let app = axum::Router::new()
            .route(
                "/boom",
                axum::routing::get(|| async {
                    if std::hint::black_box(true) {
                        panic!("a bug");
                    }
                    "unreachable"
                }),
            )
            .route("/fine", axum::routing::get(|| async { "ok" }))
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked));
        let request = |path: &str| {
            axum::http::Request::builder()
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap()
        };
        let response = app.clone().oneshot(request("/boom")).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["code"], "internal");
        let response = app.oneshot(request("/fine")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}
