//! `/v1/notifications`: what `[notify]` sends out, its dead letters, and
//! sending one again (I-61).

use super::common::{Reply, S, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::{Path, Query};
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

/// Notifications: listed, sent again.
pub(super) fn notification_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/notifications",
            get_with(list_notifications, |op| {
                errors!(
                    secured(op)
                        .id("listNotifications")
                        .summary("Notifications of events to [notify] endpoints, oldest first")
                        .description(
                            "Each is in the journal with its event before it is sent, and \
                             keeps its `webhook-id` across tries and restarts. \
                             `?state=failed` lists the dead letters: sent again only by \
                             `POST /v1/notifications/{id}/retry`. Empty without [notify].",
                        )
                        .response::<200, Json<NotificationList>>(),
                    400,
                    503
                )
            }),
        )
        .api_route(
            "/v1/notifications/{id}/retry",
            post_with(retry_notification, |op| {
                errors!(
                    secured(op)
                        .id("retryNotification")
                        .summary("Send a dead-lettered notification again, from its first try")
                        .description(
                            "The same `webhook-id` and body; an endpoint a 410 disabled is \
                             enabled again. 409 unless the notification has failed.",
                        )
                        .response::<200, Json<NotificationView>>(),
                    400,
                    404,
                    409,
                    503
                )
            }),
        )
}

async fn list_notifications(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
    Query(query): Query<NotificationQuery>,
) -> Reply {
    use arbor_runtime::notify::DeliveryState;
    let Some(notifications) = shared.node.notifications() else {
        return Ok(json(
            StatusCode::OK,
            NotificationList {
                notifications: vec![],
            },
        ));
    };
    let state = query.state.map(|s| match s {
        NotificationState::Pending => DeliveryState::Pending,
        NotificationState::Delivered => DeliveryState::Delivered,
        NotificationState::Failed => DeliveryState::Failed,
    });
    let mut entries = notifications.list(state).map_err(ApiError::unavailable)?;
    entries.retain(|e| query.run.is_none_or(|run| e.run == run));
    crate::tenancy::retain_seen(&mut entries, |entry| {
        crate::tenancy::sees_run(&shared, &caller, entry.run)
    })?;
    Ok(json(
        StatusCode::OK,
        NotificationList {
            notifications: entries.into_iter().map(NotificationView::from).collect(),
        },
    ))
}

async fn retry_notification(
    State(shared): S,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
) -> Reply {
    use arbor_runtime::notify::RetryError;
    let id = arbor_runtime::notify::parse_id(&path.id).ok_or_else(|| {
        ApiError::bad_request(format!(
            "{:?} is not a notification id (msg_ and 32 hex digits)",
            path.id
        ))
    })?;
    let unknown = || ApiError::not_found(format!("no notification {}", path.id));
    let notifications = shared.node.notifications().ok_or_else(unknown)?;
    match notifications
        .retry(id, audit.take(None, StatusCode::OK))
        .await
    {
        Ok(Some(entry)) => Ok(json(StatusCode::OK, NotificationView::from(entry))),
        Ok(None) => Err(unknown()),
        Err(e @ RetryError::Refused(_)) => Err(ApiError::conflict(e.to_string())),
        Err(e @ RetryError::Journal(_)) => Err(ApiError::unavailable(e.to_string())),
    }
}
