//! The console's page: its files, compiled into arbord, served at `/ui`
//! with a strict Content-Security-Policy (nothing but this origin's own
//! files; no inline script), an ETag each, and their content types. The
//! page holds no data: what it shows it reads from the API with the
//! session cookie `POST /v1/ui/session` sets (`auth.rs`, I-53).

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::Digest;
use std::sync::LazyLock;

/// What the page may load and where it may connect: its own origin only.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

/// One file of the page.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static str,
    /// A digest of the body, quoted.
    etag: HeaderValue,
}

static ASSETS: LazyLock<Vec<Asset>> = LazyLock::new(|| {
    [
        (
            "/ui",
            "text/html; charset=utf-8",
            include_str!("../ui/index.html"),
        ),
        (
            "/ui/app.js",
            "text/javascript; charset=utf-8",
            include_str!("../ui/app.js"),
        ),
        (
            "/ui/style.css",
            "text/css; charset=utf-8",
            include_str!("../ui/style.css"),
        ),
    ]
    .into_iter()
    .map(|(path, content_type, body)| {
        let digest = sha2::Sha256::digest(body.as_bytes());
        let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
        Asset {
            path,
            content_type,
            body,
            etag: HeaderValue::from_str(&format!("\"{hex}\"")).expect("hex is a header value"),
        }
    })
    .collect()
});

/// The page's routes (no token: the page holds no data).
pub(crate) fn routes() -> axum::Router {
    let mut router = axum::Router::new();
    for (at, asset) in ASSETS.iter().enumerate() {
        let handler = move |headers: HeaderMap| async move { serve(&ASSETS[at], &headers) };
        router = router.route(asset.path, axum::routing::get(handler));
        if asset.path == "/ui" {
            router = router.route("/ui/", axum::routing::get(handler));
        }
    }
    router
}

fn serve(asset: &Asset, request: &HeaderMap) -> Response {
    let fresh = request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|tag| tag.trim() == asset.etag || tag.trim() == "*");
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let mut response = asset.body.into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(asset.content_type),
        );
        response
    };
    let headers = response.headers_mut();
    headers.insert(header::ETAG, asset.etag.clone());
    // Asked again each time, answered 304 while it has not changed.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}
