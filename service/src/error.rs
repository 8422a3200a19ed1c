//! Every refusal the API makes: `{"error": {"code", "message"}}` with the
//! status that says what kind of refusal it is (I-36).

use aide::generate::GenContext;
use aide::openapi::{MediaType, Operation, Response, SchemaObject};
use aide::operation::OperationOutput;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The body of every error response.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    /// A stable word for programs: `bad_request`, `unauthorized`,
    /// `not_found`, `method_not_allowed`, `conflict`, `too_large`, `unsupported_media_type`,
    /// `refused`, `queue_full`, `unavailable`, `internal` (and `quota`, in
    /// a 429 of its own shape, `QuotaRefusal`).
    pub code: String,
    /// What was wrong, in words, for people.
    pub message: String,
}

/// An error on its way out: a status, a code and a message.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// A submission over its tenant's quota: said in a body of its own.
    pub quota: Option<Box<QuotaRefusal>>,
}

/// A 429's body: the queue is full (the API's error shape), or the
/// tenant's quota has no room (`QuotaRefusal`, with `Retry-After`).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum TooMany {
    Quota(QuotaRefusal),
    Error(ErrorBody),
}

/// The body of a 429 for a submission over its tenant's quota (I-65),
/// with `Retry-After` saying the same `retry_after_s`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct QuotaRefusal {
    /// Always `quota`.
    pub error: String,
    /// The window with no room: `tokens_per_hour`, `usd_per_day`,
    /// `usd_per_month`, `runs_per_minute` or `concurrent_runs`.
    pub quota: String,
    pub tenant: String,
    /// When to try again: when the clock opens the window, or (when only a
    /// running run's end can) a short while.
    pub retry_after_s: u64,
    /// What was refused, in words, for people.
    pub message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            quota: None,
        }
    }
    /// Malformed: not JSON, the wrong shape or types, a bad id.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    /// A cross-site request that carries the console's session cookie.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    /// The thing exists but is in a state that does not allow this; or an
    /// idempotency key reused with another body.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            message,
        )
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            message,
        )
    }
    /// Well formed, and refused: an unknown flow or agent, a budget out of
    /// range, a cap exceeded.
    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "refused", message)
    }
    pub fn queue_full(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", message)
    }
    /// The node is shutting down, or its journal has failed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl From<arbor_storage::Error> for ApiError {
    fn from(e: arbor_storage::Error) -> Self {
        // A journal that cannot be read or written is the node's trouble,
        // not the client's; it is said as unavailable, never as a 500 that
        // looks like a bug.
        ApiError::unavailable(format!("journal: {e}"))
    }
}

impl From<crate::admission::SubmitError> for ApiError {
    fn from(e: crate::admission::SubmitError) -> Self {
        use crate::admission::SubmitError;
        match e {
            SubmitError::KeyConflict(_) => ApiError::conflict(e.to_string()),
            SubmitError::QueueFull(_) => ApiError::queue_full(e.to_string()),
            SubmitError::Closed => ApiError::unavailable(e.to_string()),
            SubmitError::QuotaNever { .. } => ApiError::refused(e.to_string()),
            SubmitError::Quota {
                ref tenant,
                ref over,
            } => {
                let mut error =
                    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "quota", e.to_string());
                error.quota = Some(Box::new(QuotaRefusal {
                    error: "quota".into(),
                    quota: over.window.name().into(),
                    tenant: tenant.clone(),
                    retry_after_s: over.retry_after_s(),
                    message: e.to_string(),
                }));
                error
            }
            SubmitError::Journal(e) => ApiError::from(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        if let Some(quota) = self.quota {
            let retry = quota.retry_after_s;
            let mut response = (self.status, axum::Json(quota)).into_response();
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, retry.into());
            return response;
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// Documented per route (`docs::errors`), not inferred.
impl OperationOutput for ApiError {
    type Inner = ErrorBody;

    fn operation_response(ctx: &mut GenContext, _operation: &mut Operation) -> Option<Response> {
        Some(Response {
            description: "An error: `{\"error\": {\"code\", \"message\"}}`".into(),
            content: [(
                "application/json".to_string(),
                MediaType {
                    schema: Some(SchemaObject {
                        json_schema: ctx.schema.subschema_for::<ErrorBody>(),
                        example: None,
                        external_docs: None,
                    }),
                    ..Default::default()
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        })
    }
}
