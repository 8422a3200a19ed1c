//! Extractors whose every refusal is an `ApiError` (the API's own JSON
//! shape, I-36), documented in the OpenAPI as their axum counterparts are.

use crate::error::ApiError;
use aide::generate::GenContext;
use aide::openapi::Operation;
use aide::operation::OperationInput;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;

/// A JSON body: `Content-Type: application/json` (else 415), at most the
/// body limit (else 413), and the exact shape (else 400, saying where).
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let json = req
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::unsupported_media_type(
                "the body must be JSON, sent with `Content-Type: application/json`",
            ));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::too_large(
                        "the body is larger than this node accepts (max_body_bytes)",
                    )
                } else {
                    ApiError::bad_request(format!("the body could not be read: {rejection}"))
                }
            })?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| {
            ApiError::bad_request(format!("the body is not what this route takes: {e}"))
        })
    }
}

impl<T: JsonSchema> OperationInput for JsonBody<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        <axum::Json<T> as OperationInput>::operation_input(ctx, operation);
    }
}

/// The query string, in the route's shape (else 400).
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|q| Query(q.0))
            .map_err(|e| ApiError::bad_request(format!("bad query: {}", e.body_text())))
    }
}

impl<T: JsonSchema> OperationInput for Query<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        <axum::extract::Query<T> as OperationInput>::operation_input(ctx, operation);
    }
}

/// The path's parameters (else 400).
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| ApiError::bad_request(format!("bad path: {}", e.body_text())))
    }
}

impl<T: JsonSchema> OperationInput for Path<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        <axum::extract::Path<T> as OperationInput>::operation_input(ctx, operation);
    }
}
