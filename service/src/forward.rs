//! On a shared journal, a call about a run another node owns (a stop, a
//! steering message, a decision on one of its cards) is sent to that node
//! through the database (`Journal::send_request`), and the caller gets the
//! owner's own answer: the same status and body as if it had asked the
//! owner. The owner takes the requests of its runs when the database
//! notifies it (and by the clock, should a notification be lost), acts on
//! each as its API would, and writes the answer back.
//!
//! A request outlives its sender's wait: an owner that answers after
//! `ANSWER_WAIT` still acts, and a run taken over before its owner acted
//! has its requests taken by the next owner. A request that was acted on
//! by an owner that died before it wrote its answer is acted on again by
//! the next: a stop twice is one stop; a steering message may arrive twice.

use crate::Shared;
use crate::error::ApiError;
use arbor_protocol::{CardId, JobId, RunId};
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How long a caller waits for the owner's answer before it is told the
/// request was sent (202) and the owner has not answered yet.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// How often the database is looked at without a notification.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// What the owner is asked to do: the API call, checked by the sender.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Forwarded {
    StopRun {
        run: RunId,
    },
    StopJob {
        run: RunId,
        job: JobId,
    },
    Steer {
        job: JobId,
        text: String,
    },
    TopUp {
        run: RunId,
        body: crate::api::TopUpBody,
    },
    Decide {
        card: CardId,
        body: crate::api::DecisionBody,
        by: String,
    },
}

/// The owner's answer: its status and body.
#[derive(Serialize, Deserialize)]
struct Answer {
    status: u16,
    body: serde_json::Value,
}

/// The node that owns `run`, when that is not this node (a shared
/// journal's run another node runs).
pub fn elsewhere(shared: &Shared, run: RunId) -> Result<Option<String>, ApiError> {
    let journal = shared.node.journal();
    let Some(me) = journal.node_id() else {
        return Ok(None);
    };
    Ok(journal
        .owner(run)?
        .map(|(node, _)| node)
        .filter(|node| *node != me))
}

/// Sends `call` about `run` to its owner, `owner`, and answers as it does.
pub async fn send(
    shared: &Shared,
    run: RunId,
    owner: &str,
    call: Forwarded,
) -> Result<Response, ApiError> {
    let journal = shared.node.journal();
    let body = serde_json::to_vec(&call).map_err(|e| ApiError::unavailable(e.to_string()))?;
    let Some(id) = journal.send_request(run, body)? else {
        return Err(ApiError::unavailable(
            "this node's journal is its own: it cannot reach another node",
        ));
    };
    let mut woken = journal.woken();
    let deadline = tokio::time::Instant::now() + ANSWER_WAIT;
    loop {
        if let Some(answer) = journal.request_answer(id)? {
            let answer: Answer = serde_json::from_slice(&answer)
                .map_err(|e| ApiError::unavailable(format!("node {owner}'s answer: {e}")))?;
            let status =
                StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Ok((status, Json(answer.body)).into_response());
        }
        let woken_up = async {
            let alive = match &mut woken {
                Some(woken) => woken.changed().await.is_ok(),
                None => false,
            };
            if !alive {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = woken_up => {}
            _ = tokio::time::sleep(LOOK_EVERY / 4) => {}
            _ = tokio::time::sleep_until(deadline) => {
                return Ok((
                    StatusCode::ACCEPTED,
                    Json(serde_json::json!({
                        "request": id,
                        "state": format!(
                            "sent to node {owner}, which owns run {run}; it has not answered \
                             within {}s and will act when it takes the request",
                            ANSWER_WAIT.as_secs()
                        ),
                    })),
                )
                    .into_response());
            }
        }
    }
}

/// How the owner acts on a call: as its API would, here.
pub type Handle =
    fn(Arc<Shared>, Forwarded) -> Pin<Box<dyn Future<Output = Response> + Send + 'static>>;

/// Until the service stops: takes the requests for runs this node owns,
/// acts on each (`handle`), and writes its answer.
pub async fn serve(shared: Arc<Shared>, handle: Handle) {
    let journal = shared.node.journal().clone();
    let Some(mut woken) = journal.woken() else {
        return; // a journal of this node's own: nobody sends it anything
    };
    loop {
        let taken = {
            let journal = journal.clone();
            tokio::task::spawn_blocking(move || journal.take_requests()).await
        };
        match taken {
            Ok(Ok(requests)) => {
                for (id, run, body) in requests {
                    let response = match serde_json::from_slice::<Forwarded>(&body) {
                        Ok(call) => handle(shared.clone(), call).await,
                        Err(e) => ApiError::bad_request(format!("a request for run {run}: {e}"))
                            .into_response(),
                    };
                    let status = response.status().as_u16();
                    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
                        .await
                        .ok()
                        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
                        .unwrap_or(serde_json::Value::Null);
                    let answer = serde_json::to_vec(&Answer { status, body }).unwrap_or_default();
                    if let Err(error) = journal.answer_request(id, answer) {
                        tracing::warn!(%error, request = id, "could not answer a request");
                    }
                }
            }
            Ok(Err(error)) => tracing::warn!(%error, "could not read the requests for this node"),
            Err(error) => tracing::warn!(%error, "reading the requests for this node"),
        }
        tokio::select! {
            _ = shared.stopped.cancelled() => return,
            changed = woken.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = tokio::time::sleep(LOOK_EVERY) => {}
        }
    }
}
