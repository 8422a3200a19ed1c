//! Deploys (I-67): `POST /v1/workspace/reload`, `GET
//! /v1/workspace/versions` and `POST /v1/workspace/rollback`; the work is
//! `crate::deploy`'s.

use super::common::{Reply, S, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::extract::JsonBody;
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

pub(super) fn workspace_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/workspace/reload",
            post_with(reload, |op| {
                errors!(
                    secured(op)
                        .id("reloadWorkspace")
                        .summary("Read the workspace's files again and deploy them, if they load")
                        .description(
                            "Checked whole first: a broken edit is refused (422) and the running \
                             version stays. New runs and schedules take the new version; a run \
                             admitted before keeps its own to its end. arbor.toml is read at \
                             start: an edit to it is refused here (restart arbord). SIGHUP does \
                             the same.",
                        )
                        .response_with::<200, Json<Deployment>, _>(|r| r),
                    403,
                    422,
                    503
                )
            }),
        )
        .api_route(
            "/v1/workspace/versions",
            get_with(versions, |op| {
                errors!(
                    secured(op)
                        .id("workspaceVersions")
                        .summary("Every workspace version the journal keeps, and the current one")
                        .response_with::<200, Json<VersionList>, _>(|r| r),
                    403
                )
            }),
        )
        .api_route(
            "/v1/workspace/rollback",
            post_with(rollback, |op| {
                errors!(
                    secured(op)
                        .id("rollbackWorkspace")
                        .summary("Make an earlier workspace version current again")
                        .response_with::<200, Json<Deployment>, _>(|r| r),
                    400,
                    403,
                    404,
                    413,
                    415,
                    422,
                    503
                )
            }),
        )
}

async fn reload(State(shared): S) -> Reply {
    let deployed = crate::deploy::reload(&shared).await?;
    Ok(json(StatusCode::OK, deployed))
}

async fn rollback(State(shared): S, JsonBody(body): JsonBody<RollbackBody>) -> Reply {
    let deployed = crate::deploy::rollback(&shared, &body.version).await?;
    Ok(json(StatusCode::OK, deployed))
}

async fn versions(State(shared): S) -> Reply {
    let current = shared.workspace().version.clone();
    let versions = arbor_runtime::versions::all(shared.node.journal())?
        .into_iter()
        .map(|(id, created_at_ms, files)| VersionView {
            current: id == current,
            id,
            created_at_ms,
            files,
        })
        .collect();
    Ok(json(StatusCode::OK, VersionList { current, versions }))
}
