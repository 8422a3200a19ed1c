//! `/v1/jobs/{id}`: read, stop, steer and continue one job.

use super::common::{Reply, S, accepting, errors, json, parse_job, secured, stop_accepted};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::{JsonBody, Path};
use crate::forward::{self, Forwarded};
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use arbor_protocol::{JobId, RunId, Status, Tree};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

/// A job: read, stopped, steered, continued.
pub(super) fn job_routes() -> ApiRouter<Arc<Shared>> {
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

/// The run a step or job belongs to, and its tree.
fn job_tree(shared: &Shared, job: JobId) -> Result<(RunId, Tree), ApiError> {
    let events = shared.node.events();
    let run = crate::tenancy::run_of_job(shared, job)?
        .ok_or_else(|| ApiError::not_found(format!("no step or job {job}")))?;
    let tree = events
        .tree(run)
        .filter(|t| t.node(job).is_some())
        .ok_or_else(|| ApiError::not_found(format!("no step or job {job}")))?;
    Ok((run, tree))
}

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

async fn stop_job(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
) -> Reply {
    let job = parse_job(&path.id)?;
    let (run, _) = job_tree(&shared, job)?;
    if let Some(owner) = forward::elsewhere(&shared, run)? {
        return forward::send(&shared, run, &owner, Forwarded::StopJob { run, job }).await;
    }
    stop_job_here(&shared, run, job, Some(&audit)).await
}

/// `audit`, here and in the other `_here`s: the call's entry, taken into
/// the change's commit (I-64); none for a call another node forwarded (its
/// node keeps the entry).
pub(super) async fn stop_job_here(
    shared: &Shared,
    run: RunId,
    job: JobId,
    audit: Option<&crate::audit::Audit>,
) -> Reply {
    let (_, tree) = job_tree(shared, job)?;
    let status = tree.node(job).map(|n| n.status).unwrap_or(Status::Done);
    if status.is_terminal() {
        return Err(ApiError::conflict(format!(
            "{job} has already ended ({status})"
        )));
    }
    let entry = audit.and_then(|a| a.take(None, StatusCode::ACCEPTED));
    shared
        .node
        .stop_job_with(run, job, "stopped by an operator (API)", entry)
        .await
        .map_err(|e| ApiError::conflict(e.to_string()))?;
    Ok(stop_accepted(job, "stopping"))
}

// ---- approvals ----

async fn steer_job(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
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
    steer_here(&shared, job, body.text, Some(&audit)).await
}

pub(super) async fn steer_here(
    shared: &Shared,
    job: JobId,
    text: String,
    audit: Option<&crate::audit::Audit>,
) -> Reply {
    let (_, tree) = job_tree(shared, job)?;
    if let Some(status) = tree.node(job).map(|n| n.status)
        && status.is_terminal()
    {
        return Err(ApiError::conflict(format!(
            "{job} has already ended ({status}); the message was not queued"
        )));
    }
    let entry = audit.and_then(|a| a.take(None, StatusCode::ACCEPTED));
    let message_id = shared
        .node
        .steer_with(job, &text, entry)
        .await
        .map_err(|refusal| ApiError::conflict(refusal.to_string()))?;
    Ok(json(StatusCode::ACCEPTED, SteerQueued { job, message_id }))
}

async fn continue_job(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
) -> Reply {
    let job = parse_job(&path.id)?;
    job_tree(&shared, job)?;
    accepting(&shared)?;
    let run = shared
        .node
        .continue_job_with(job, audit.take(None, StatusCode::CREATED))
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
