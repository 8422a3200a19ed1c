//! Who may touch what (I-63), decided in one place for every route: after
//! the caller is known (`auth::require_token`), the object a route's path
//! names (a run, a step or job, a card, a notification) is looked up to the
//! tenant whose run it is. Another tenant's object is a 404 in the same
//! words as an id that never was, whatever the caller's roles; only then
//! are the roles asked (`auth::required_role`), so a 403 is only ever said
//! about one's own tenant's objects. An object whose tenant cannot be told
//! (a run whose start is not in the journal) is nobody's but an admin of
//! every tenant's.
//!
//! Lists (`GET /v1/runs`, approvals, notifications, status) keep only what
//! `sees` allows; they are filtered in their routes.

use crate::Shared;
use crate::credentials::Caller;
use crate::error::ApiError;
use arbor_protocol::{CardId, JobId, RunId, RunSpec};
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Whether `caller` sees the work of `tenant`.
pub(crate) fn sees(caller: &Caller, tenant: &str) -> bool {
    caller.tenant.as_deref().is_none_or(|own| own == tenant)
}

/// Whether `caller` sees an audit entry of a caller of `tenant` (none:
/// of every tenant, or of no credential: an admin of every tenant's only).
pub(crate) fn sees_entry(caller: &Caller, tenant: Option<&str>) -> bool {
    match (&caller.tenant, tenant) {
        (None, _) => true,
        (Some(own), Some(tenant)) => own == tenant,
        (Some(_), None) => false,
    }
}

/// Whether `caller` sees run `run` (a list's filter): its tenant, looked
/// up as for a route's path.
pub(crate) fn sees_run(shared: &Shared, caller: &Caller, run: RunId) -> Result<bool, ApiError> {
    if caller.tenant.is_none() {
        return Ok(true);
    }
    Ok(match run_tenant(shared, run)? {
        Owner::Tenant(tenant) => sees(caller, &tenant),
        Owner::None | Owner::Untold => false,
    })
}

/// Keeps the items `sees` says yes to, in order (a list filtered to what
/// a credential sees).
pub(crate) fn retain_seen<T>(
    items: &mut Vec<T>,
    mut sees: impl FnMut(&T) -> Result<bool, ApiError>,
) -> Result<(), ApiError> {
    let mut kept = Vec::with_capacity(items.len());
    for item in std::mem::take(items) {
        if sees(&item)? {
            kept.push(item);
        }
    }
    *items = kept;
    Ok(())
}

/// Whether `caller` sees step or job `job`.
pub(crate) fn sees_job(shared: &Shared, caller: &Caller, job: JobId) -> Result<bool, ApiError> {
    if caller.tenant.is_none() {
        return Ok(true);
    }
    match run_of_job(shared, job)? {
        Some(run) => sees_run(shared, caller, run),
        None => Ok(false),
    }
}

/// The run a step or job belongs to: the event bus's index, else the journal.
pub(crate) fn run_of_job(shared: &Shared, job: JobId) -> Result<Option<RunId>, ApiError> {
    Ok(match shared.node.events().find_job(job) {
        Some((run, _)) => Some(run),
        None => shared.node.journal().run_of_job(job)?,
    })
}

/// Each tenant of arbor.toml's runs in the journal by status, and the
/// tokens they spent: the metrics' `tenant_*` families. A run of a tenant
/// arbor.toml no longer names is left out (the labels stay bounded).
pub(crate) fn runs_by_tenant(
    shared: &Shared,
) -> Result<std::collections::BTreeMap<(String, &'static str), crate::metrics::TenantRuns>, ApiError>
{
    use arbor_protocol::Status;
    let tenants = shared.workspace().tenant_names();
    let mut by_tenant: std::collections::BTreeMap<_, crate::metrics::TenantRuns> =
        std::collections::BTreeMap::new();
    for tenant in &tenants {
        for status in [
            Status::Pending,
            Status::Running,
            Status::Done,
            Status::Failed,
            Status::Stopped,
        ] {
            by_tenant.insert((tenant.clone(), status.as_str()), Default::default());
        }
    }
    for run in shared.node.journal().runs()? {
        let seen = shared.node.events().with_tree(run.id, |tree| {
            let tree = tree?;
            Some((tree.tenant()?.to_string(), tree.head().account.spent))
        });
        if let Some((tenant, spent)) = seen
            && let Some(figures) = by_tenant.get_mut(&(tenant, run.status.as_str()))
        {
            figures.runs += 1;
            figures.tokens += spent as i64;
        }
    }
    Ok(by_tenant)
}

/// The kinds of object a path can name, by the segment before its `{id}`.
#[derive(Clone, Copy)]
enum Kind {
    Run,
    Job,
    Card,
    Notification,
}

impl Kind {
    fn of(template: &str) -> Option<Kind> {
        let mut segments = template.trim_start_matches('/').split('/');
        match (segments.next(), segments.next(), segments.next()) {
            (Some("v1"), Some(kind), Some("{id}")) => match kind {
                "runs" => Some(Kind::Run),
                "jobs" => Some(Kind::Job),
                "approvals" => Some(Kind::Card),
                "notifications" => Some(Kind::Notification),
                _ => None,
            },
            _ => None,
        }
    }

    /// What its route answers for an id it does not know: said so for
    /// another tenant's, word for word.
    fn unknown(self, id: &str) -> ApiError {
        ApiError::not_found(match self {
            Kind::Run => format!("no run {id}"),
            Kind::Job => format!("no step or job {id}"),
            Kind::Card => format!("no card {id} waits on this node"),
            Kind::Notification => format!("no notification {id}"),
        })
    }
}

/// Whose an object is.
enum Owner {
    /// No such object (its route says so).
    None,
    Tenant(String),
    /// It exists, and its tenant is not in the journal.
    Untold,
}

/// The middleware on every protected route, after `require_token`.
pub(crate) async fn authorize(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(caller) = request.extensions().get::<Caller>().cloned() else {
        return ApiError::unauthorized("no credential was presented").into_response();
    };
    let template = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| request.uri().path().to_string());
    let need = crate::auth::required_role(request.method(), &template);
    if let Some(audit) = request.extensions().get::<crate::audit::Audit>() {
        audit.role(need);
    }
    if caller.tenant.is_some()
        && let Some(kind) = Kind::of(&template)
        && let Some(id) = request.uri().path().split('/').nth(3)
    {
        match owner(&shared, kind, id) {
            Ok(Owner::Tenant(tenant)) if sees(&caller, &tenant) => {}
            Ok(Owner::None) => {}
            Ok(_) => {
                if let Some(audit) = request.extensions().get::<crate::audit::Audit>() {
                    audit.refused();
                }
                return kind.unknown(id).into_response();
            }
            Err(e) => return e.into_response(),
        }
    }
    if !caller.roles.allow(need) {
        return ApiError::forbidden(format!(
            "the credential {:?} has the roles {}; {} {template} needs {}",
            caller.name,
            caller.roles,
            request.method(),
            need.as_str()
        ))
        .into_response();
    }
    next.run(request).await
}

/// Whose the object `id` of `kind` is. A malformed id is nobody's: its
/// route refuses it as malformed, for every caller alike.
fn owner(shared: &Shared, kind: Kind, id: &str) -> Result<Owner, ApiError> {
    let run = match kind {
        Kind::Run => id.parse::<RunId>().ok(),
        Kind::Job => match id.parse::<JobId>() {
            Ok(job) => run_of_job(shared, job)?,
            Err(_) => None,
        },
        Kind::Card => match id.parse::<CardId>() {
            Ok(card) => shared.node.approval(card)?.map(|c| c.run),
            Err(_) => None,
        },
        Kind::Notification => match arbor_runtime::notify::parse_id(id) {
            Some(entry) => {
                arbor_runtime::notify::find(shared.node.journal(), entry)?.map(|e| e.run)
            }
            None => None,
        },
    };
    match run {
        Some(run) => run_tenant(shared, run),
        None => Ok(Owner::None),
    }
}

/// Whose run `run` is: its tree's start, else its submission's spec (a
/// queued run), else its journaled start.
fn run_tenant(shared: &Shared, run: RunId) -> Result<Owner, ApiError> {
    let told = shared.node.events().with_tree(run, |tree| {
        tree.and_then(|t| t.tenant().map(str::to_string))
    });
    if let Some(tenant) = told {
        return Ok(Owner::Tenant(tenant));
    }
    if let Some(submitted) = crate::submission::submission(shared.node.journal(), run)? {
        return Ok(serde_json::from_str::<RunSpec>(&submitted.spec_json)
            .map(|spec| Owner::Tenant(spec.tenant().to_string()))
            .unwrap_or(Owner::Untold));
    }
    Ok(match shared.node.journal().run(run)? {
        Some(_) => Owner::Untold,
        None => Owner::None,
    })
}
