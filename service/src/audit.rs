//! The audit log (I-64): every call through the API that would change
//! something, and every refused attempt at one, is an entry: who (the
//! credential's name, or the JWT's subject), its tenant, the role the
//! route needs, the route, its target, the outcome, the time and the
//! client's address.
//!
//! An entry of a change is committed in the same append as the change: the
//! handler takes it (`Audit::take`) and hands it down with the change, to
//! the admission queue, the run, the job, the approval gate or the outbox,
//! which append it with their own record. An entry of a refusal, of an
//! error, or of a call whose change the journal does not keep (a drain, a
//! login) is appended alone, after the answer (`record`). So a change is
//! never without its entry, and an entry of a change never without it.
//!
//! The table is the service's (`AUDIT_TABLE`, keyed by time: a run's
//! retention does not remove it); `[retention] keep_audit` (a year) does.

use crate::credentials::{Caller, Role};
use arbor_storage::{AUDIT_TABLE, Journal, Record, Table};
use axum::extract::{ConnectInfo, MatchedPath, Request};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One entry of the audit log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// uuid v7: its time, then its place.
    pub id: uuid::Uuid,
    pub at_ms: u64,
    /// The credential's name (`operator` for the main token), the JWT's
    /// subject; `anonymous` when none was taken.
    pub subject: String,
    /// The caller's tenant; none: every tenant (or no credential).
    pub tenant: Option<String>,
    /// The role the route needs.
    pub role: Option<String>,
    /// `POST /v1/runs/{id}/stop`: the method and the route's template.
    pub route: String,
    /// The id the route names, or the run a submission made.
    pub target: Option<String>,
    pub outcome: AuditOutcome,
    /// The answer's HTTP status.
    pub status: u16,
    /// The client's address, as the connection gave it.
    pub client: Option<String>,
    pub epoch: u64,
}

/// How a call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AuditOutcome {
    /// It changed what it asked to (or, for a drain or a login, did it).
    Ok,
    /// No credential, the wrong one, a role it lacks, or another tenant's object.
    Refused,
    /// Taken, and it failed: a bad body, a conflict, the node's trouble.
    Error,
}

impl AuditOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AuditOutcome::Ok => "ok",
            AuditOutcome::Refused => "refused",
            AuditOutcome::Error => "error",
        }
    }
}

/// The table, keyed by the entry's time (big-endian ms) and id.
pub static AUDIT: Table<AuditRecord> = Table::bincode(AUDIT_TABLE, audit_key, |a| a.epoch);

fn audit_key(a: &AuditRecord) -> Vec<u8> {
    let mut key = a.at_ms.to_be_bytes().to_vec();
    key.extend_from_slice(a.id.as_bytes());
    key
}

/// How long entries are kept when `[retention] keep_audit` does not say.
pub const DEFAULT_KEEP: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// `[retention]` in arbor.toml: `keep_audit`, a duration of a minute or
/// more (a year unless given), or `forever` (`None`).
pub fn keep(table: &toml::Table) -> Result<Option<std::time::Duration>, String> {
    for key in table.keys() {
        if key != "keep_audit" {
            return Err(format!(
                "arbor.toml [retention]: unknown key `{key}` (known: keep_audit)"
            ));
        }
    }
    let Some(value) = table.get("keep_audit") else {
        return Ok(Some(DEFAULT_KEEP));
    };
    let text = value.as_str().ok_or_else(|| {
        "arbor.toml [retention] keep_audit: a duration such as \"365d\", or \"forever\"".to_string()
    })?;
    if text == "forever" {
        return Ok(None);
    }
    let keep = humantime::parse_duration(text).map_err(|e| {
        format!("arbor.toml [retention] keep_audit: {text:?} is neither a duration such as \"365d\" nor \"forever\": {e}")
    })?;
    if keep < std::time::Duration::from_secs(60) {
        return Err(format!(
            "arbor.toml [retention] keep_audit: {text:?} is under a minute (to keep the log \
             without end, say \"forever\"; 0 never means that)"
        ));
    }
    Ok(Some(keep))
}

/// Removes the entries older than `keep` before `now`; how many.
pub fn forget_before(
    journal: &Journal,
    keep: std::time::Duration,
    now: std::time::SystemTime,
) -> Result<usize, arbor_storage::Error> {
    let cutoff = now
        .checked_sub(keep)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    journal.remove_before(&AUDIT, cutoff)
}

/// Every entry, oldest first.
pub fn entries(journal: &Journal) -> Result<Vec<AuditRecord>, arbor_storage::Error> {
    journal.read(&AUDIT, &[])
}

/// The entry a call is making, a request extension: the middleware opens
/// it, the credential's check names the caller, the tenancy check the role
/// and a refusal, and a handler that makes its change takes it.
#[derive(Clone, Debug)]
pub struct Audit(Arc<Mutex<Draft>>);

#[derive(Debug)]
struct Draft {
    entry: AuditRecord,
    taken: bool,
    refused: bool,
}

impl Audit {
    fn lock(&self) -> std::sync::MutexGuard<'_, Draft> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Who is calling.
    pub(crate) fn caller(&self, caller: &Caller) {
        let mut draft = self.lock();
        draft.entry.subject = caller.name.clone();
        draft.entry.tenant = caller.tenant.clone();
    }

    /// The role the route needs.
    pub(crate) fn role(&self, role: Role) {
        self.lock().entry.role = Some(role.as_str().to_string());
    }

    /// Refused before its handler: another tenant's object.
    pub(crate) fn refused(&self) {
        self.lock().refused = true;
    }

    /// The entry, as the record that goes into the change's own append,
    /// its outcome `ok`, `target` (if given) its target, `status` what the
    /// call answers once the change is made. Taken once.
    pub fn take(&self, target: Option<String>, status: StatusCode) -> Option<Record> {
        let mut draft = self.lock();
        if draft.taken {
            return None;
        }
        draft.taken = true;
        if target.is_some() {
            draft.entry.target = target;
        }
        draft.entry.outcome = AuditOutcome::Ok;
        draft.entry.status = status.as_u16();
        match AUDIT.row(&draft.entry) {
            Ok(row) => Some(Record::Row(row)),
            Err(error) => {
                tracing::error!(%error, "an audit entry does not encode");
                None
            }
        }
    }

    /// The call is answered with `status`: an entry nobody took goes in
    /// alone. One taken into a change's append is there already.
    fn finish(&self, journal: &Journal, status: StatusCode) {
        let mut draft = self.lock();
        if draft.taken && status.is_success() {
            return;
        }
        draft.entry.status = status.as_u16();
        draft.entry.outcome = if draft.refused
            || matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
        {
            AuditOutcome::Refused
        } else if status.is_success() {
            AuditOutcome::Ok
        } else {
            AuditOutcome::Error
        };
        let appended = AUDIT
            .row(&draft.entry)
            .and_then(|row| journal.append(vec![Record::Row(row)]));
        if let Err(error) = appended {
            tracing::error!(%error, route = %draft.entry.route, "an audit entry could not be journaled");
        }
    }
}

fn open(
    journal: &Journal,
    route: String,
    target: Option<String>,
    client: Option<SocketAddr>,
) -> Audit {
    let id = uuid::Uuid::now_v7();
    let at_ms = arbor_actors::events::now_ms();
    Audit(Arc::new(Mutex::new(Draft {
        entry: AuditRecord {
            id,
            at_ms,
            subject: "anonymous".into(),
            tenant: None,
            role: None,
            route,
            target,
            outcome: AuditOutcome::Error,
            status: 0,
            client: client.map(|c| c.to_string()),
            epoch: journal.epoch(),
        },
        taken: false,
        refused: false,
    })))
}

/// The middleware around every protected route (outside the credential's
/// check): a call that may change something gets its entry.
pub(crate) async fn record(
    axum::extract::State(journal): axum::extract::State<Journal>,
    mut request: Request,
    next: Next,
) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let template = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| request.uri().path().to_string());
    let target = template
        .contains("{id}")
        .then(|| request.uri().path().split('/').nth(3).map(str::to_string))
        .flatten();
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let route = format!("{} {template}", request.method());
    let audit = open(&journal, route, target, client);
    request.extensions_mut().insert(audit.clone());
    let response = next.run(request).await;
    audit.finish(&journal, response.status());
    response
}
