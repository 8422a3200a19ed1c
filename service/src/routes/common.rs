//! What every resource's routes share: the state and reply types, the
//! error statuses' documentation, ids from paths, and the shapes of common
//! answers.

use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use aide::transform::TransformOperation;
use arbor_protocol::{JobId, RunId};
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) type S = State<Arc<Shared>>;

pub(super) type Reply = Result<Response, ApiError>;

/// Documents the error statuses a route can answer with.
macro_rules! errors {
    ($op:expr $(, $code:literal)*) => {{
        let op = $op;
        $( let op = op.response_with::<$code, $crate::error::ApiError, _>(|r| {
            r.description($crate::routes::common::describe($code))
        }); )*
        op
    }};
}
pub(super) use errors;

pub(super) fn describe(code: u16) -> &'static str {
    match code {
        400 => "Malformed: not JSON, the wrong shape or types, a bad id or header",
        401 => "No bearer token, or the wrong one (I-37)",
        404 => {
            "No such run, job, card or notification, or another tenant's (I-63); a finished run is forgotten `keep_finished` after its end"
        }
        403 => {
            "The credential lacks the role the route needs (I-63), or the console's session cookie was sent from another site (I-53)"
        }
        409 => "Not in a state that allows this; or an Idempotency-Key reused with another body",
        413 => "The body is larger than the node accepts",
        415 => "The body is not sent as application/json",
        422 => "Refused: an unknown flow or agent, a budget out of range, a cap exceeded",
        429 => "The queue is full",
        503 => "The node is shutting down, or its journal has failed",
        _ => "An error",
    }
}

/// Says where an id for other operations comes from (for clients, and for
/// a fuzzer that follows links from one call to the next).
pub(super) fn linked<'t, T>(
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

pub(super) fn secured(op: TransformOperation) -> TransformOperation {
    errors!(op.security_requirement("token"), 401)
}

pub(super) fn parse_run(id: &str) -> Result<RunId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("{id:?} is not a run id (a UUID)")))
}

pub(super) fn parse_job(id: &str) -> Result<JobId, ApiError> {
    id.parse()
        .map_err(|_| ApiError::bad_request(format!("{id:?} is not a job id (a UUID)")))
}

pub(super) fn accepting(shared: &Shared) -> Result<(), ApiError> {
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

pub(super) fn json(status: StatusCode, body: impl serde::Serialize) -> Response {
    (status, Json(body)).into_response()
}

pub(super) fn stop_accepted(id: impl std::fmt::Display, state: &str) -> Response {
    json(
        StatusCode::ACCEPTED,
        StopAccepted {
            id: id.to_string(),
            state: state.into(),
        },
    )
}

// ---- runs ----

pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
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
