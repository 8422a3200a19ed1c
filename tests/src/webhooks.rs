//! A webhook receiver on loopback for the notification suites: it records
//! every request (its Standard Webhooks headers and body) and answers with
//! the status a test sets, or holds the request unanswered.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// One request as it arrived.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub id: String,
    pub timestamp: String,
    pub signature: String,
    pub body: String,
}

impl Received {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_default()
    }

    pub fn event_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().to_string()
    }
}

/// What the receiver answers: a status, or `HOLD` (never answers).
pub const HOLD: u16 = 0;

struct Shared {
    answer: AtomicU16,
    seen: Mutex<Vec<Received>>,
    count: watch::Sender<usize>,
}

pub struct Receiver {
    /// Where to send: `http://127.0.0.1:PORT/hook`.
    pub url: String,
    shared: Arc<Shared>,
    _serving: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Listening on a port of its own, answering `status` (or `HOLD`).
    pub async fn start(status: u16) -> Receiver {
        Self::start_at("127.0.0.1:0", status).await
    }

    /// Listening at `address`.
    pub async fn start_at(address: &str, status: u16) -> Receiver {
        let shared = Arc::new(Shared {
            answer: AtomicU16::new(status),
            seen: Mutex::new(vec![]),
            count: watch::channel(0).0,
        });
        let app = axum::Router::new()
            .fallback(receive)
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .unwrap_or_else(|e| panic!("the receiver listens at {address}: {e}"));
        let url = format!("http://{}/hook", listener.local_addr().expect("an address"));
        let serving = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver {
            url,
            shared,
            _serving: serving,
        }
    }

    /// What it answers from now on.
    pub fn answer(&self, status: u16) {
        self.shared.answer.store(status, Ordering::SeqCst);
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<Received> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits (on the receiver's own count) until `pred` holds of what it
    /// has seen; panics after `limit`, with what it saw.
    pub async fn wait_for(
        &self,
        limit: std::time::Duration,
        pred: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let mut count = self.shared.count.subscribe();
        let waited = tokio::time::timeout(limit, async {
            loop {
                let seen = self.seen();
                if pred(&seen) {
                    return seen;
                }
                if count.changed().await.is_err() {
                    return seen;
                }
            }
        })
        .await;
        waited.unwrap_or_else(|_| {
            panic!(
                "the receiver did not see what was awaited; it saw {:#?}",
                self.seen()
            )
        })
    }
}

async fn receive(
    State(shared): State<Arc<Shared>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let received = Received {
        path: uri.path().to_string(),
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let answer = shared.answer.load(Ordering::SeqCst);
    {
        let mut seen = shared.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.push(received);
        shared.count.send_replace(seen.len());
    }
    if answer == HOLD {
        // Held until the sender gives up (or dies).
        std::future::pending::<()>().await;
    }
    let status = StatusCode::from_u16(answer).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if status.is_redirection() {
        return (status, [("location", "/elsewhere")]).into_response();
    }
    status.into_response()
}
