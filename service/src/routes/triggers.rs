//! `POST /v1/triggers/{name}`: a flow started by a call signed as the
//! Standard Webhooks specification says (`arbor_runtime::triggers`). No
//! bearer token: the signature is the credential.

use super::common::{Reply, S, errors};
use crate::Shared;
use crate::api::*;
use crate::credentials::{Caller, Roles};
use crate::error::ApiError;
use crate::extract::Path;
use aide::axum::ApiRouter;
use aide::axum::routing::post_with;
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use sha2::Digest;
use std::sync::Arc;

pub(super) fn trigger_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new().api_route(
        "/v1/triggers/{name}",
        post_with(fire, |op| {
            errors!(
                op.id("fireTrigger")
                    .summary("Start a trigger's flow: a signed call (Standard Webhooks)")
                    .description(
                        "No bearer token: the call carries webhook-id, webhook-timestamp (within \
                         five minutes) and webhook-signature (v1, HMAC-SHA256 of \
                         id.timestamp.body with the trigger's secret). The body is JSON; the \
                         trigger's `input` pointer (or the whole body) is the flow's input, \
                         checked against its schema. The same webhook-id gives the same run \
                         (200); with another body it is a 409.",
                    )
                    .response_with::<201, Json<RunCreated>, _>(|r| r.description("Queued"))
                    .response_with::<200, Json<RunCreated>, _>(|r| {
                        r.description("This webhook-id made this run before")
                    }),
                400,
                401,
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

async fn fire(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<NamePath>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Reply {
    let name = path.name;
    let deployed = shared.deployed();
    let (Some(trigger), Some(key)) = (
        deployed.workspace.config.triggers.get(&name),
        deployed.trigger_keys.get(&name),
    ) else {
        return Err(ApiError::not_found(format!("no trigger {name}")));
    };
    let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    arbor_runtime::triggers::verify(
        key,
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
        &body,
        now_s,
    )
    .map_err(|why| ApiError::unauthorized(format!("trigger {name}: {why}")))?;
    audit.caller(&Caller {
        name: format!("trigger:{name}"),
        tenant: trigger.tenant.clone(),
        roles: Roles::default(),
    });
    let document: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}")))?;
    let takes_input = deployed
        .workspace
        .flows
        .get(&trigger.flow)
        .is_some_and(|f| f.input.is_some());
    let input = match trigger.input.as_deref() {
        Some(pointer) if !pointer.is_empty() => Some(
            document
                .pointer(pointer)
                .cloned()
                .ok_or_else(|| ApiError::refused(format!("the body has no value at {pointer}")))?,
        ),
        _ if takes_input => Some(document),
        _ => None,
    };
    let tenant = trigger
        .tenant
        .clone()
        .unwrap_or_else(|| arbor_protocol::DEFAULT_TENANT.to_string());
    let submit = SubmitRun {
        flow: Some(trigger.flow.clone()),
        input,
        ..SubmitRun::default()
    };
    let spec = super::runs::resolve(&shared, &submit, &tenant)?;
    // Verified above: the id is the sender's, and names one run.
    let key = header("webhook-id").map(|id| format!("{tenant}/trigger/{name}/{id}"));
    let digest = sha2::Sha256::digest(&body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    super::runs::queue(&shared, &spec, key, digest, &audit).await
}
