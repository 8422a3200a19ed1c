//! `/v1/runs`: submit, list, read, replay, stop and follow a run.

use super::common::{
    Reply, S, accepting, errors, idempotency_key, json, linked, parse_run, secured, stop_accepted,
};
use crate::Shared;
use crate::admission::Submitted;
use crate::api::*;
use crate::credentials::Caller;
use crate::error::ApiError;
use crate::extract::{JsonBody, Path, Query};
use crate::forward::{self, Forwarded};
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use arbor_protocol::OnCeiling;
use arbor_protocol::{RunId, RunSpec, Status, Tree};
use arbor_runtime::LoadError;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, sse};
use sha2::Digest;
use std::sync::Arc;
use std::time::Duration;

/// Submitting, listing, reading and replaying runs.
pub(super) fn run_routes() -> ApiRouter<Arc<Shared>> {
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
                        })
                        .response_with::<429, Json<crate::error::TooMany>, _>(too_many),
                    400,
                    403,
                    404,
                    409,
                    413,
                    415,
                    422,
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
pub(super) fn run_action_routes() -> ApiRouter<Arc<Shared>> {
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
            "/v1/runs/{id}/budget",
            post_with(top_up, |op| {
                errors!(
                    secured(op)
                        .id("topUpRun")
                        .summary("Raise a running run's ceiling (a top-up)")
                        .description(
                            "Adds tokens (and micro-dollars, to a run with a usd ceiling) to \
                             the run's root grant: a journaled grant, durable before it is \
                             answered; every account balances before and after it. A run \
                             that has ended is a 409; a top-up of nothing, or of a ceiling \
                             the run does not have, a 422.",
                        )
                        .response::<200, Json<crate::api::ToppedUp>>()
                        .response_with::<429, Json<crate::error::TooMany>, _>(too_many),
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

/// The run's tree now: from its events, or, for a run that waits in the
/// queue, a bare pending root. `None`: no such run.
pub(super) async fn run_tree(shared: &Shared, run: RunId) -> Result<Option<Tree>, ApiError> {
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
                    limitations: Vec::new(),
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

/// The tenant a submission is for (I-63): its caller's own, or the one a
/// caller of every tenant names (`default` if none). A caller of one
/// tenant naming another is told there is no such tenant.
fn submitting_tenant(caller: &Caller, body: &SubmitRun) -> Result<String, ApiError> {
    match (&caller.tenant, &body.tenant) {
        (Some(own), Some(named)) if own != named => {
            Err(ApiError::not_found(format!("no tenant {named}")))
        }
        (Some(own), _) => Ok(own.clone()),
        (None, Some(named)) => Ok(named.clone()),
        (None, None) => Ok(arbor_protocol::DEFAULT_TENANT.to_string()),
    }
}

/// The request as a `RunSpec`, every I-36 check made; nothing changes here.
pub(super) fn resolve(
    shared: &Shared,
    body: &SubmitRun,
    tenant: &str,
) -> Result<RunSpec, ApiError> {
    let ws = &shared.workspace();
    let cfg = &shared.config;
    let budget = body.budget.clone().unwrap_or_default();
    let tokens = budget.tokens().map_err(ApiError::refused)?;
    let usd = budget.usd_micros().map_err(ApiError::refused)?;
    let load = |e: LoadError| ApiError::refused(e.to_string());
    let spec = match (&body.flow, &body.agent, &body.input) {
        (Some(flow), None, input) => {
            if let Some(input) = input
                && input.to_string().len() > cfg.max_input_bytes
            {
                return Err(ApiError::refused(format!(
                    "`input` is more than {} bytes (max_input_bytes)",
                    cfg.max_input_bytes
                )));
            }
            ws.flow_run_with(flow, tokens, input.as_ref())
                .map_err(load)?
        }
        (None, Some(agent), Some(input)) => {
            let Some(input) = input.as_str() else {
                return Err(ApiError::refused("`input` for an `agent` is text"));
            };
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
            return Err(ApiError::bad_request(
                "`input` needs an `agent` or a `flow`",
            ));
        }
        _ => {
            return Err(ApiError::bad_request(
                "give `flow` (and its `input`, if it takes one), or `agent` and `input`, not both",
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
    let mut spec = ws.for_tenant(tenant, spec).map_err(load)?;
    // A submission's `on_ceiling` and `pause_timeout` stand for the flow's.
    let timeout =
        arbor_protocol::tools::parse_duration_arg("pause_timeout", body.pause_timeout.as_deref())
            .map_err(ApiError::bad_request)?;
    let on_ceiling = body.on_ceiling.or(spec.pause.map(|_| OnCeiling::Pause));
    let timeout = timeout.or(spec.pause.filter(|_| on_ceiling == Some(OnCeiling::Pause)));
    spec.pause = OnCeiling::pause(on_ceiling, timeout).map_err(ApiError::bad_request)?;
    if let Some(priority) = body.priority {
        if !(1..=5).contains(&priority) {
            return Err(ApiError::refused(format!(
                "priority {priority}: 1 starts first, 5 last"
            )));
        }
        spec.priority = Some(priority);
    }
    // `record` adds to arbor.toml's `[record] models`, never turns it off.
    Ok(if body.record {
        ws.recording(spec, true)
    } else {
        spec
    })
}

async fn submit_run(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<SubmitRun>,
) -> Reply {
    let tenant = submitting_tenant(&caller, &body).inspect_err(|_| audit.refused())?;
    let spec = resolve(&shared, &body, &tenant)?;
    // A key is its tenant's: another tenant's same key is another run.
    let key = idempotency_key(&headers)?.map(|key| match &spec.tenant {
        Some(tenant) => format!("{tenant}/{key}"),
        None => key,
    });
    let digest = {
        let canonical = serde_json::to_vec(&body).unwrap_or_default();
        let hash = sha2::Sha256::digest(&canonical);
        hash.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    queue(&shared, &spec, key, digest, &audit).await
}

/// Queues `spec` under `key` (a retry with the same key and `digest`
/// answers with the same run): 201 with its links, or 200 for a replay.
pub(super) async fn queue(
    shared: &Shared,
    spec: &RunSpec,
    key: Option<String>,
    digest: String,
    audit: &crate::audit::Audit,
) -> Reply {
    // A replay is answered even while draining: it changes nothing.
    if key.is_none() {
        accepting(shared)?;
    }
    let submitted = shared
        .admission
        .submit(spec, key, digest, Some(audit))
        .await?;
    let (run, status, replayed) = match submitted {
        Submitted::New(run) => (run, StatusCode::CREATED, false),
        Submitted::Replayed(run) => (run, StatusCode::OK, true),
    };
    let run_status = run_tree(shared, run)
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
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
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
        ReplayError::NoRun(run) => ApiError::not_found(format!("no run {run}")),
        ReplayError::Journal(e) => ApiError::from(e),
        other => ApiError::refused(other.to_string()),
    };
    let journal = shared.node.journal();
    let spec = if body.rerun_failed {
        let plan = replay::plan_rerun(journal, &shared.workspace(), of, body.allow_changed)
            .map_err(refused)?;
        if body.dry_run {
            return Ok(json(StatusCode::OK, plan));
        }
        replay::rerun_spec(&shared.workspace(), plan, body.record).0
    } else {
        let recorded = replay::recorded(journal, of).map_err(refused)?;
        replay::check(&shared.workspace(), of, &recorded.spec, &recorded.agents)
            .map_err(refused)?;
        let options = ReplayOptions {
            tools: body.tools,
            after_divergence: body.after_divergence,
            record: body.record,
            current: body.current,
        };
        replay::replay_spec(&shared.workspace(), of, recorded.spec, options)
    };
    accepting(&shared)?;
    let digest = String::new();
    let submitted = shared
        .admission
        .submit(&spec, None, digest, Some(&audit))
        .await?;
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

async fn list_runs(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    Query(query): Query<RunQuery>,
) -> Reply {
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
                budget_tokens: spec.as_ref().map(|s| s.budget_tokens).unwrap_or_default(),
                created_at_ms: created_at_ms(sub.run),
                started_at_ms: None,
                ended_at_ms: None,
                tokens: None,
                usd: None,
                queue_position: Some(position),
                failed_job: None,
                schedule: spec.as_ref().and_then(|s| s.schedule.clone()),
                version: spec.as_ref().and_then(|s| s.version.clone()),
                tenant: spec.and_then(|s| s.tenant),
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
                tenant: None,
                schedule: None,
                version: None,
            }),
    );
    // Ids are uuid v7: newest first is id order, reversed.
    all.sort_by_key(|r| std::cmp::Reverse(r.id));
    let mut page: Vec<RunSummary> = vec![];
    for run in all {
        if page.len() > limit as usize {
            break;
        }
        if query.status.is_none_or(|s| run.status == s)
            && query.after.is_none_or(|after| run.id < after)
            && crate::tenancy::sees_run(&shared, &caller, run.id)?
        {
            page.push(run);
        }
    }
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
                if head.tenant.is_some() {
                    run.tenant = head.tenant.clone();
                }
                if head.schedule.is_some() {
                    run.schedule = head.schedule.clone();
                }
                if head.version.is_some() {
                    run.version = head.version.clone();
                }
            }
        });
    }
    // A run stopped before it started has its schedule in its submission.
    for run in page
        .iter_mut()
        .filter(|r| r.started_at_ms.is_none() && r.queue_position.is_none())
    {
        if let Some(sub) = crate::submission::submission(shared.node.journal(), run.id)? {
            let spec = serde_json::from_str::<RunSpec>(&sub.spec_json).ok();
            run.version = spec.as_ref().and_then(|s| s.version.clone());
            run.schedule = spec.and_then(|s| s.schedule);
        }
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

async fn stop_run(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
) -> Reply {
    let run = parse_run(&path.id)?;
    let reason = "stopped by an operator (API)";
    if shared.admission.cancel(run, reason, Some(&audit)).await? {
        return Ok(stop_accepted(run, "stopped"));
    }
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        return forward::send(&shared, run, &owner, Forwarded::StopRun { run }).await;
    }
    stop_run_here(&shared, run, Some(&audit)).await
}

/// Stops a run this node owns (or one it has no owner for: its own), the
/// call's audit entry committed with the run's end.
pub(super) async fn stop_run_here(
    shared: &Shared,
    run: RunId,
    audit: Option<&crate::audit::Audit>,
) -> Reply {
    let reason = "stopped by an operator (API)";
    running_tree(shared, run).await?;
    let entry = audit.and_then(|a| a.take(None, StatusCode::ACCEPTED));
    shared
        .node
        .stop_run_with(run, reason, entry)
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok(stop_accepted(run, "stopping"))
}

async fn top_up(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
    JsonBody(body): JsonBody<crate::api::TopUpBody>,
) -> Reply {
    let run = parse_run(&path.id)?;
    // A run that is not there (or is another tenant's) is a 404 whatever the body.
    if run_tree(&shared, run).await?.is_none() {
        return Err(ApiError::not_found(format!("no run {run}")));
    }
    if body.tokens.is_none() && body.usd_micros.is_none() {
        return Err(ApiError::refused(
            "a top-up names `tokens`, `usd_micros` or both",
        ));
    }
    if body.tokens == Some(0) || body.usd_micros == Some(0) {
        return Err(ApiError::refused(
            "a top-up adds at least 1 (0 never means unlimited)",
        ));
    }
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        return forward::send(&shared, run, &owner, Forwarded::TopUp { run, body }).await;
    }
    top_up_here(&shared, run, body, Some(&audit)).await
}

/// The tree of a run that has not ended: an unknown run is a 404, an ended one a 409.
async fn running_tree(shared: &Shared, run: RunId) -> Result<arbor_protocol::Tree, ApiError> {
    let tree = run_tree(shared, run)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no run {run}")))?;
    let status = tree.run_status();
    if status.is_terminal() {
        return Err(ApiError::conflict(format!(
            "run {run} has already ended ({status})"
        )));
    }
    Ok(tree)
}

/// Tops up a run this node runs, the call's audit entry committed with the grant.
pub(super) async fn top_up_here(
    shared: &Shared,
    run: RunId,
    body: crate::api::TopUpBody,
    audit: Option<&crate::audit::Audit>,
) -> Reply {
    let tree = running_tree(shared, run).await?;
    if body.usd_micros.is_some() && tree.root().usd.is_none() {
        return Err(ApiError::refused(format!(
            "run {run} has no usd ceiling to raise: top it up in tokens"
        )));
    }
    let amount = arbor_protocol::Amount {
        tokens: body.tokens.unwrap_or(0),
        usd_micros: body.usd_micros.unwrap_or(0),
    };
    // What a top-up adds is its tenant's to give (I-65): reserved first.
    let tenant = tree.tenant().unwrap_or(arbor_protocol::DEFAULT_TENANT);
    shared.admission.reserve_top_up(run, tenant, amount).await?;
    let entry = audit.and_then(|a| a.take(None, StatusCode::OK));
    let account = shared
        .node
        .top_up(run, amount, entry)
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok((StatusCode::OK, Json(crate::api::ToppedUp { run, account })).into_response())
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

/// A 429 of a route that reserves from a tenant's quota (I-65).
fn too_many(
    r: aide::transform::TransformResponse<'_, crate::error::TooMany>,
) -> aide::transform::TransformResponse<'_, crate::error::TooMany> {
    r.description(
        "The queue is full (`{\"error\": {\"code\": \"queue_full\", ...}}`), or the tenant's \
         quota has no room: `{\"error\": \"quota\", \"quota\", \"tenant\", \"retry_after_s\"}` \
         with Retry-After",
    )
}
