//! The routes that take no bearer token: the console's session, `/healthz`
//! and `/readyz`.

use super::common::{Reply, S, accepting, errors, json};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::JsonBody;
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;

pub(super) fn public_routes() -> ApiRouter<Arc<Shared>> {
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

/// The session cookie's header: `id` for `max_age`, or cleared.
fn session_cookie_header(id: &str, max_age: Duration) -> Result<HeaderValue, ApiError> {
    HeaderValue::from_str(&format!(
        "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        crate::auth::SESSION_COOKIE,
        max_age.as_secs()
    ))
    .map_err(|_| ApiError::internal("the session cookie could not be written"))
}

/// The audit entry a login or a logout makes (I-64): who it is, once known.
type Audit = Option<axum::Extension<crate::audit::Audit>>;

/// A login and a logout change who may act: each is an audit entry, its
/// outcome the answer's (`audit::record`).
async fn open_session(
    State(shared): S,
    audit: Audit,
    headers: HeaderMap,
    JsonBody(login): JsonBody<UiLogin>,
) -> Reply {
    if let (Ok(caller), Some(audit)) = (shared.tokens.identify(login.token.trim()), &audit) {
        audit.caller(&caller);
    }
    login_answer(&shared, &headers, &login).await
}

async fn login_answer(shared: &Shared, headers: &HeaderMap, login: &UiLogin) -> Reply {
    // A login forced from another site would log the browser in as
    // someone else's token: refused as the cookie's use is.
    if let Some(why) = crate::auth::cross_site(headers) {
        return Err(ApiError::forbidden(format!(
            "{why}: the console logs in from its own page only"
        )));
    }
    use crate::auth::SessionRefused;
    let id = shared
        .tokens
        .open_session(login.token.trim())
        .map_err(|refused| match refused {
            SessionRefused::Refused(why) => ApiError::unauthorized(why),
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

async fn close_session(State(shared): S, audit: Audit, headers: HeaderMap) -> Reply {
    if let Some(id) = crate::auth::session_cookie(&headers)
        && let Some(caller) = shared.tokens.close_session(id)
        && let Some(audit) = &audit
    {
        audit.caller(&caller);
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
