//! The routes, their handlers and their documentation. The OpenAPI document
//! is generated from these same declarations (aide, from the types' JSON
//! Schemas), so it cannot drift from what is served.

use crate::Shared;
use crate::error::ApiError;
use crate::forward::Forwarded;
use aide::axum::ApiRouter;
use aide::openapi::OpenApi;
use axum::Json;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

mod approvals;
mod audit;
mod common;
mod jobs;
mod node;
mod notifications;
mod public;
mod runs;
pub(crate) mod schedules;
mod tokens;
mod triggers;
mod workspace;

use approvals::{approval_routes, decide_here};
use audit::audit_routes;
use jobs::{job_routes, steer_here, stop_job_here};
use node::node_routes;
use notifications::notification_routes;
use public::public_routes;
use runs::{run_action_routes, run_routes, stop_run_here};
use tokens::token_routes;

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
    // The last layer added runs first: a call that may change something
    // opens its audit entry (`audit::record`, I-64), then the caller is
    // known (`require_token`), then what it may see and do (`authorize`).
    let protected = protected_routes()
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            crate::tenancy::authorize,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            token,
            crate::auth::require_token,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.node.journal().clone(),
            crate::audit::record,
        ));
    // The console's login and logout are audited as the API's calls are.
    let public = public_routes()
        .merge(triggers::trigger_routes())
        .route_layer(axum::middleware::from_fn_with_state(
            shared.node.journal().clone(),
            crate::audit::record,
        ));
    protected.merge(public).with_state(shared)
}

/// The same routes, for the document only.
fn api_router_docs() -> ApiRouter<Arc<Shared>> {
    protected_routes()
        .merge(public_routes())
        .merge(triggers::trigger_routes())
}

fn protected_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .merge(run_routes())
        .merge(run_action_routes())
        .merge(job_routes())
        .merge(approval_routes())
        .merge(notification_routes())
        .merge(audit_routes())
        .merge(token_routes())
        .merge(node_routes())
        .merge(schedules::schedule_routes())
        .merge(workspace::workspace_routes())
}

/// Acts on a call another node sent about a run this node owns
/// (`forward.rs`), as this node's API would.
pub(crate) fn handle_forwarded(
    shared: Arc<Shared>,
    call: Forwarded,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send + 'static>> {
    Box::pin(async move {
        let reply = match call {
            Forwarded::StopRun { run } => stop_run_here(&shared, run, None).await,
            Forwarded::StopJob { run, job } => stop_job_here(&shared, run, job, None).await,
            Forwarded::Steer { job, text } => steer_here(&shared, job, text, None).await,
            Forwarded::TopUp { run, body } => runs::top_up_here(&shared, run, body, None).await,
            Forwarded::Decide { card, body, by } => {
                decide_here(&shared, card, body, by, None).await
            }
        };
        reply.unwrap_or_else(IntoResponse::into_response)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
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
