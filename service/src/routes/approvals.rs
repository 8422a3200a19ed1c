//! `/v1/approvals`: the cards waiting for a person, and their decisions.

use super::common::{Reply, S, errors, json, linked, secured};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::{JsonBody, Path, Query};
use crate::forward::{self, Forwarded};
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

/// Approval cards: listed, decided.
pub(super) fn approval_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/approvals",
            get_with(list_approvals, |op| {
                errors!(
                    secured(op)
                        .id("listApprovals")
                        .summary("Approval cards of every run, oldest first, by run and state")
                        .description(
                            "One queue for the whole tree: a card of a job at depth 3 is here \
                             beside a step's. A card is in the journal before it is listed.",
                        )
                        .response_with::<200, Json<ApprovalList>, _>(|r| {
                            linked(
                                r.description("The cards"),
                                "$response.body#/approvals/0/id",
                                &["decideApproval"],
                            )
                        }),
                    400,
                    503
                )
            }),
        )
        .api_route(
            "/v1/approvals/{id}",
            post_with(decide_approval, |op| {
                errors!(
                    secured(op)
                        .id("decideApproval")
                        .summary("Approve, reject or edit a pending card, or answer a question (I-46, I-60)")
                        .description(
                            "The decision is committed before the call may run and records \
                             the token's name. 409 once the card is closed (decided, expired, \
                             or cancelled by a stop, which wins); 422 for a rejection without \
                             a reason, edited arguments the tool does not take, an answer to \
                             a card that is not a question, or an answer not among its choices.",
                        )
                        .response::<200, Json<CardView>>(),
                    400,
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

async fn list_approvals(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
    Query(query): Query<ApprovalQuery>,
) -> Reply {
    let mut cards = shared.node.approvals(query.run, query.state)?;
    crate::tenancy::retain_seen(&mut cards, |card| {
        crate::tenancy::sees_run(&shared, &caller, card.run)
    })?;
    Ok(json(
        StatusCode::OK,
        ApprovalList {
            approvals: cards.into_iter().map(CardView::from).collect(),
        },
    ))
}

async fn decide_approval(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::auth::Caller>,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
    JsonBody(body): JsonBody<DecisionBody>,
) -> Reply {
    let id: arbor_protocol::CardId = path.id.parse().map_err(|_| {
        ApiError::bad_request(format!("{:?} is not an approval card id (a UUID)", path.id))
    })?;
    if body.reason.as_ref().is_some_and(|r| r.len() > 4096) {
        return Err(ApiError::refused("`reason` is longer than 4096 bytes"));
    }
    let run = shared
        .node
        .approvals(None, None)?
        .into_iter()
        .find(|card| card.id == id)
        .map(|card| card.run);
    if let Some(run) = run
        && let Some(owner) = forward::elsewhere(&shared, run)?
    {
        let call = Forwarded::Decide {
            card: id,
            body,
            by: caller.name.clone(),
        };
        return forward::send(&shared, run, &owner, call).await;
    }
    decide_here(&shared, id, body, caller.name, Some(&audit)).await
}

pub(super) async fn decide_here(
    shared: &Shared,
    id: arbor_protocol::CardId,
    body: DecisionBody,
    by: String,
    audit: Option<&crate::audit::Audit>,
) -> Reply {
    use arbor_runtime::{Decide, DecideError};
    let decide = Decide {
        verdict: body.decision,
        reason: body.reason,
        args: body.args,
        answer: body.answer,
        by,
        audit: audit.and_then(|a| a.take(None, StatusCode::OK)),
    };
    match shared.node.decide(id, decide).await {
        Ok(card) => Ok(json(StatusCode::OK, CardView::from(card))),
        Err(e @ DecideError::Unknown(_)) => Err(ApiError::not_found(e.to_string())),
        Err(e @ (DecideError::Closed { .. } | DecideError::Idle(_))) => {
            Err(ApiError::conflict(e.to_string()))
        }
        Err(e @ DecideError::Invalid(_)) => Err(ApiError::refused(e.to_string())),
        Err(e @ DecideError::Journal(_)) => Err(ApiError::unavailable(e.to_string())),
    }
}
