//! `/v1/audit`: who changed what through the API, and who was refused
//! (I-64); an admin's to read, a tenant's admin its tenant's only.

use super::common::{Reply, S, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::Query;
use aide::axum::ApiRouter;
use aide::axum::routing::get_with;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

pub(super) fn audit_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new().api_route(
        "/v1/audit",
        get_with(list_audit, |op| {
            errors!(
                secured(op)
                    .id("listAudit")
                    .summary("The audit log, oldest first (admin)")
                    .description(
                        "Every call that changes something (submit, stop, steer, continue, \
                         replay, decide, answer, retry, drain, login, logout), and every \
                         refused attempt at one: who, its tenant, the role the route needs, \
                         the route, its target, the outcome (`ok`, `refused`, `error`), the \
                         time and the client's address. An entry of a change is in the same \
                         commit as the change. `?tenant=&subject=&since=&until=` (ms since \
                         the epoch) filter; `limit` (100, at most 1000) and `after` page.",
                    )
                    .response::<200, Json<AuditList>>(),
                400,
                403,
                503
            )
        }),
    )
}

async fn list_audit(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
    Query(query): Query<AuditQuery>,
) -> Reply {
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit must be 1 to 1000"));
    }
    let all = crate::audit::entries(shared.node.journal())?;
    let mut entries: Vec<AuditEntry> = all
        .into_iter()
        .filter(|e| crate::tenancy::sees_entry(&caller, e.tenant.as_deref()))
        .filter(|e| {
            query
                .tenant
                .as_ref()
                .is_none_or(|t| e.tenant.as_ref() == Some(t))
        })
        .filter(|e| query.subject.as_ref().is_none_or(|s| &e.subject == s))
        .filter(|e| query.since.is_none_or(|since| e.at_ms >= since))
        .filter(|e| query.until.is_none_or(|until| e.at_ms < until))
        .filter(|e| query.after.is_none_or(|after| e.id > after))
        .take(limit as usize + 1)
        .map(AuditEntry::from)
        .map(|mut e| {
            // A tenant's own refused probe at an id that is not its tenant's
            // names nothing it may see.
            if caller.tenant.is_some() && e.status == 404 {
                e.target = None;
            }
            e
        })
        .collect();
    let next = (entries.len() > limit as usize).then(|| {
        entries.truncate(limit as usize);
        entries.last().map(|e| e.id)
    });
    Ok(json(
        StatusCode::OK,
        AuditList {
            entries,
            next: next.flatten(),
        },
    ))
}
