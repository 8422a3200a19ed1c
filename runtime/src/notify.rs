//! Notifications that leave the node (I-61): `[notify.NAME]` endpoints, the
//! outbox entries journaled in the same append as the events they tell of
//! (`NotifyOutbox`, an `arbor_actors::events::Outbox`), their bodies, their
//! Standard Webhooks signatures, and the task that delivers them
//! (`notify/deliver.rs`, with the `http` feature).
//!
//! Invariants:
//! 1. An entry is durable with its event or not at all, and is sent only
//!    once it is durable: a notification never tells of an event a crash
//!    took back.
//! 2. An entry's id is its `webhook-id`, fixed when it is made: every try,
//!    before and after a restart, sends the same id.
//! 3. A body holds ids, kinds, statuses, times and links: never a prompt,
//!    an output, a reason a model wrote, arguments or a secret's value
//!    (`payload` picks each field by name).

use arbor_actors::events::Outbox;
use arbor_protocol::{CardKind, Event, EventKind, RunId};
use arbor_storage::{Journal, OUTBOX_TABLE, Record, Table};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(feature = "http")]
pub(crate) mod deliver;

/// The event types an endpoint may ask for (`events = [...]`, or `"*"` for
/// all of them). `budget_reached` is named ahead of the budgets that pause.
pub const NOTIFY_EVENTS: [&str; 7] = [
    "run_finished",
    "approval_requested",
    "approval_expiring",
    "approval_decided",
    "needs_decision",
    "budget_reached",
    "schedule_missed",
];

/// The run a notification of no run (a schedule's missed ticks) is filed
/// under: the nil id, which no run has.
pub const NO_RUN: RunId = RunId(uuid::Uuid::nil());

const DEFAULT_MAX_ATTEMPTS: u32 = 8;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_RETRY_WAIT: Duration = Duration::from_secs(5);
const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(3600);

/// `[notify.NAME]`, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Endpoint {
    pub name: String,
    pub url: String,
    /// The event types it is sent; `None`: all of `NOTIFY_EVENTS`.
    pub events: Option<BTreeSet<String>>,
    /// The name of the secret (`[sandbox] secrets_file`, then the
    /// environment) whose value, `whsec_` and base64, signs its bodies.
    pub secret: String,
    /// Tries before an entry is dead-lettered.
    pub max_attempts: u32,
    /// The bound on one try, connection to answer.
    pub timeout: Duration,
    /// The wait after the first failed try, doubled after each next one, up
    /// to `max_wait`.
    pub retry_wait: Duration,
    pub max_wait: Duration,
}

impl Endpoint {
    /// Whether events of type `kind` go to this endpoint.
    pub fn wants(&self, kind: &str) -> bool {
        self.events.as_ref().is_none_or(|e| e.contains(kind))
    }

    /// The wait before try `attempts + 1`, after `attempts` failed.
    pub fn wait_after(&self, attempts: u32) -> Duration {
        let doubled = self
            .retry_wait
            .saturating_mul(1u32 << attempts.saturating_sub(1).min(20));
        doubled.min(self.max_wait)
    }
}

/// `[notify.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EndpointFile {
    url: String,
    events: Vec<String>,
    secret: String,
    max_attempts: Option<u32>,
    timeout: Option<String>,
    retry_wait: Option<String>,
    max_wait: Option<String>,
}

impl EndpointFile {
    pub(crate) fn check(self, name: &str) -> Result<Endpoint, String> {
        let at = format!("notify.{name}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        {
            return Err(format!(
                "{at}: a notification endpoint's name is lowercase letters, digits, '_' and '-'"
            ));
        }
        let url = url::Url::parse(&self.url)
            .map_err(|e| format!("{at}.url: {:?} is not a URL: {e}", self.url))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!(
                "{at}.url: {:?} must be an http:// or https:// URL with a host",
                self.url
            ));
        }
        if self.events.is_empty() {
            return Err(format!(
                "{at}.events: name at least one event type ({}), or \"*\" for all",
                NOTIFY_EVENTS.join(", ")
            ));
        }
        let events = if self.events.iter().any(|e| e == "*") {
            None
        } else {
            if let Some(unknown) = self
                .events
                .iter()
                .find(|e| !NOTIFY_EVENTS.contains(&e.as_str()))
            {
                return Err(format!(
                    "{at}.events: {unknown:?} is not an event type a notification is sent for; \
                     one of {}, or \"*\"",
                    NOTIFY_EVENTS.join(", ")
                ));
            }
            Some(self.events.into_iter().collect())
        };
        let secret_name = |s: &str| {
            !s.is_empty()
                && !s.starts_with(|c: char| c.is_ascii_digit())
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        if !secret_name(&self.secret) {
            return Err(format!(
                "{at}.secret: {:?} is not a secret's name (letters, digits and '_'): name the \
                 variable that holds the signing secret, not the secret itself",
                self.secret
            ));
        }
        let max_attempts = self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
        if !(1..=100).contains(&max_attempts) {
            return Err(format!(
                "{at}.max_attempts: {max_attempts} is not between 1 and 100"
            ));
        }
        let duration = |key: &str, value: Option<String>, default: Duration| {
            let Some(text) = value else {
                return Ok(default);
            };
            match humantime::parse_duration(&text) {
                Ok(d) if !d.is_zero() && d <= Duration::from_secs(7 * 86_400) => Ok(d),
                Ok(_) => Err(format!(
                    "{at}.{key}: {text:?} must be more than 0 and at most a week"
                )),
                Err(e) => Err(format!("{at}.{key}: {text:?} is not a duration: {e}")),
            }
        };
        let timeout = duration("timeout", self.timeout, DEFAULT_TIMEOUT)?;
        let retry_wait = duration("retry_wait", self.retry_wait, DEFAULT_RETRY_WAIT)?;
        let max_wait = duration("max_wait", self.max_wait, DEFAULT_MAX_WAIT)?;
        if max_wait < retry_wait {
            return Err(format!(
                "{at}.max_wait: it is shorter than retry_wait ({})",
                humantime::format_duration(retry_wait)
            ));
        }
        Ok(Endpoint {
            name: name.to_string(),
            url: self.url,
            events,
            secret: self.secret,
            max_attempts,
            timeout,
            retry_wait,
            max_wait,
        })
    }
}

/// A Standard Webhooks signing secret's key: the bytes base64 after
/// `whsec_` (the prefix may be left out).
pub fn secret_key(value: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let encoded = value.trim().strip_prefix("whsec_").unwrap_or(value.trim());
    match base64::engine::general_purpose::STANDARD.decode(encoded) {
        Ok(key) if key.len() >= 16 => Ok(key),
        Ok(key) => Err(format!(
            "it is {} bytes; a signing secret is at least 16 (whsec_ and base64)",
            key.len()
        )),
        Err(_) => Err("it is not whsec_ followed by base64 (the value is not shown)".into()),
    }
}

/// The signing key of arbor.toml's `block` (`notify.NAME`, `triggers.NAME`)
/// from the value of its secret `name`: refused if it has none, or one that
/// is no signing secret.
pub fn signing_key(
    secrets: &arbor_actors::secrets::Secrets,
    block: &str,
    name: &str,
) -> Result<Vec<u8>, String> {
    let value = secrets
        .env_for(&BTreeSet::from([name.to_string()]))
        .ok()
        .and_then(|v| v.into_iter().next())
        .map(|(_, v)| v)
        .ok_or_else(|| {
            format!(
                "arbor.toml: {block}.secret: the secret {name} has no value: set it in the \
                 node's environment or in [sandbox] secrets_file"
            )
        })?;
    secret_key(&value).map_err(|why| {
        format!("arbor.toml: {block}.secret: the value of {name} is no signing secret: {why}")
    })
}

/// The `webhook-signature` of a body (Standard Webhooks, `v1`: HMAC-SHA256
/// over `id.timestamp.body`, base64).
pub fn sign(key: &[u8], id: &str, timestamp: u64, body: &str) -> String {
    use base64::Engine as _;
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body.as_bytes());
    let tag = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag)
    )
}

/// Where an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeliveryState {
    /// To be sent (again) at `next_ms`.
    Pending,
    /// An endpoint answered 2xx.
    Delivered,
    /// Dead-lettered: `max_attempts` tries failed, or its endpoint answered
    /// 410 Gone (and is disabled); sent again only when a person asks.
    Failed,
}

impl DeliveryState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Delivered => "delivered",
            DeliveryState::Failed => "failed",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "pending" => Some(DeliveryState::Pending),
            "delivered" => Some(DeliveryState::Delivered),
            "failed" => Some(DeliveryState::Failed),
            _ => None,
        }
    }
}

/// One notification of one event to one endpoint, and how its delivery
/// stands: journaled with its event, rewritten after each try.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutboxRecord {
    /// Its id, uuid v7: `webhook-id` is `msg_` and its 32 hex digits.
    pub id: uuid::Uuid,
    pub run: RunId,
    pub endpoint: String,
    /// The event's type (`run_finished`, ...) and seq.
    pub event_type: String,
    pub event_seq: u64,
    /// The JSON body, fixed when the entry was made: every try sends it.
    pub body: String,
    pub state: DeliveryState,
    pub attempts: u32,
    /// When the next try is due (ms since the epoch).
    pub next_ms: u64,
    /// What the last failed try met.
    pub last_error: Option<String>,
    /// Its endpoint answered 410 Gone to it.
    pub gone: bool,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub epoch: u64,
}

/// The table, keyed by the run, then the entry's id.
pub static OUTBOX: Table<OutboxRecord> = Table::bincode(OUTBOX_TABLE, outbox_key, |o| o.epoch);

fn outbox_key(o: &OutboxRecord) -> Vec<u8> {
    let mut key = o.run.0.as_bytes().to_vec();
    key.extend_from_slice(o.id.as_bytes());
    key
}

impl OutboxRecord {
    /// The `webhook-id` every try of it sends.
    pub fn webhook_id(&self) -> String {
        format!("msg_{}", self.id.simple())
    }

    pub fn record(&self) -> Result<Record, arbor_storage::Error> {
        OUTBOX.row(self).map(Record::Row)
    }
}

/// An entry's id from its `webhook-id` (or its bare uuid).
pub fn parse_id(text: &str) -> Option<uuid::Uuid> {
    uuid::Uuid::parse_str(text.strip_prefix("msg_").unwrap_or(text)).ok()
}

/// The entry `id`, if the journal has it.
pub fn find(
    journal: &Journal,
    id: uuid::Uuid,
) -> Result<Option<OutboxRecord>, arbor_storage::Error> {
    Ok(all(journal)?.into_iter().find(|e| e.id == id))
}

/// Every entry in the journal, oldest first.
pub fn all(journal: &Journal) -> Result<Vec<OutboxRecord>, arbor_storage::Error> {
    let mut all = journal.read(&OUTBOX, &[])?;
    all.sort_by_key(|o| o.id);
    Ok(all)
}

/// The JSON body of `event`'s notification, if its type is one of
/// `NOTIFY_EVENTS` (invariant 3: each field picked by name).
pub fn payload(event: &Event) -> Option<(&'static str, String)> {
    use serde_json::json;
    let run = event.run;
    let links = |card: Option<&arbor_protocol::CardId>| {
        let mut links = json!({
            "run": format!("/v1/runs/{run}"),
            "events": format!("/v1/runs/{run}/events"),
            "console": format!("/ui/#/runs/{run}"),
        });
        if let Some(card) = card {
            links["card"] = json!(format!("/v1/approvals/{card}"));
        }
        links
    };
    let (kind, data) = match &event.kind {
        EventKind::RunFinished {
            status,
            error_class,
            ..
        } => (
            "run_finished",
            json!({"run": run, "status": status, "error_class": error_class, "links": links(None)}),
        ),
        EventKind::ApprovalRequested {
            id,
            card,
            tool,
            deadline_ms,
        } => (
            "approval_requested",
            json!({
                "run": run, "job": id, "card": card, "card_kind": CardKind::of_tool(tool),
                "tool": tool, "deadline_ms": deadline_ms, "links": links(Some(card)),
            }),
        ),
        EventKind::ApprovalExpiring {
            id,
            card,
            deadline_ms,
        } => (
            "approval_expiring",
            json!({"run": run, "job": id, "card": card, "deadline_ms": deadline_ms,
                   "links": links(Some(card))}),
        ),
        EventKind::ApprovalDecided {
            id,
            card,
            state,
            by,
            waited_ms,
            ..
        } => (
            "approval_decided",
            json!({"run": run, "job": id, "card": card, "state": state, "by": by,
                   "waited_ms": waited_ms, "links": links(Some(card))}),
        ),
        EventKind::NeedsDecision { id, label, .. } => (
            "needs_decision",
            json!({"run": run, "job": id, "label": label, "links": links(None)}),
        ),
        _ => return None,
    };
    let timestamp = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + Duration::from_millis(event.at_ms),
    );
    let body = json!({"type": kind, "timestamp": timestamp.to_string(), "data": data});
    Some((kind, body.to_string()))
}

/// The node's outbox: an entry per endpoint that wants an event, in the
/// event's own append; once appended, handed to the deliverer.
pub(crate) struct NotifyOutbox {
    endpoints: Vec<Arc<Endpoint>>,
    epoch: u64,
    /// Endpoints a 410 disabled: their entries are made failed at once.
    disabled: Arc<Mutex<BTreeSet<String>>>,
    /// The entries of the append under way (both calls come under the
    /// event bus's lock).
    stash: Mutex<Vec<OutboxRecord>>,
    to_deliver: tokio::sync::mpsc::UnboundedSender<Delivery>,
}

/// What the deliverer is handed.
pub(crate) enum Delivery {
    /// New entries, durable once the journal's durable seq reaches `seq`.
    New {
        seq: u64,
        entries: Vec<OutboxRecord>,
    },
    /// A dead-lettered entry a person asked to send again, committed pending.
    Again(OutboxRecord),
}

impl NotifyOutbox {
    pub(crate) fn new(
        endpoints: Vec<Arc<Endpoint>>,
        epoch: u64,
        disabled: Arc<Mutex<BTreeSet<String>>>,
        to_deliver: tokio::sync::mpsc::UnboundedSender<Delivery>,
    ) -> Self {
        Self {
            endpoints,
            epoch,
            disabled,
            stash: Mutex::new(vec![]),
            to_deliver,
        }
    }
}

impl Outbox for NotifyOutbox {
    fn entries(&self, event: &Event) -> Vec<Record> {
        let Some((kind, body)) = payload(event) else {
            return vec![];
        };
        let disabled = self.disabled.lock().unwrap_or_else(|p| p.into_inner());
        let made = entries_for(
            &self.endpoints,
            &disabled,
            (event.run, event.seq),
            kind,
            &body,
            self.epoch,
        );
        let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
        let mut records = vec![];
        for (record, entry) in made {
            records.push(record);
            stash.extend(entry);
        }
        records
    }

    fn appended(&self, appended: &Result<u64, arbor_storage::Error>) {
        let entries = std::mem::take(&mut *self.stash.lock().unwrap_or_else(|p| p.into_inner()));
        if let (Ok(seq), false) = (appended, entries.is_empty()) {
            let _ = self.to_deliver.send(Delivery::New { seq: *seq, entries });
        }
    }
}

/// One entry per endpoint that wants `kind`: its record, and the entry to
/// deliver once it is durable (none for a disabled endpoint's, made failed).
fn entries_for(
    endpoints: &[Arc<Endpoint>],
    disabled: &BTreeSet<String>,
    (run, event_seq): (RunId, u64),
    kind: &str,
    body: &str,
    epoch: u64,
) -> Vec<(Record, Option<OutboxRecord>)> {
    let now = arbor_actors::events::now_ms();
    let mut made = vec![];
    for endpoint in endpoints.iter().filter(|e| e.wants(kind)) {
        let off = disabled.contains(&endpoint.name);
        let entry = OutboxRecord {
            id: uuid::Uuid::now_v7(),
            run,
            endpoint: endpoint.name.clone(),
            event_type: kind.to_string(),
            event_seq,
            body: body.to_string(),
            state: if off {
                DeliveryState::Failed
            } else {
                DeliveryState::Pending
            },
            attempts: 0,
            next_ms: now,
            last_error: off.then(|| GONE.to_string()),
            gone: false,
            created_ms: now,
            updated_ms: now,
            epoch,
        };
        match entry.record() {
            Ok(record) => made.push((record, (!off).then_some(entry))),
            Err(e) => tracing::error!(error = %e, "a notification could not be encoded"),
        }
    }
    made
}

/// What a disabled endpoint's entries say.
pub const GONE: &str =
    "the endpoint answered 410 Gone and is disabled: retry an entry to enable it again";

/// The endpoints a 410 disabled, from the journal: those whose last tried
/// entry was answered 410 (a restart keeps them disabled).
pub(crate) fn disabled_endpoints(entries: &[OutboxRecord]) -> BTreeSet<String> {
    let mut last: BTreeMap<&str, &OutboxRecord> = BTreeMap::new();
    for entry in entries.iter().filter(|e| e.attempts > 0) {
        let newer = last
            .get(entry.endpoint.as_str())
            .is_none_or(|l| (l.updated_ms, l.id) < (entry.updated_ms, entry.id));
        if newer {
            last.insert(&entry.endpoint, entry);
        }
    }
    last.into_iter()
        .filter(|(_, e)| e.gone)
        .map(|(name, _)| name.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(events: &[&str]) -> EndpointFile {
        EndpointFile {
            url: "https://hooks.example.com/arbor".into(),
            events: events.iter().map(|e| e.to_string()).collect(),
            secret: "HOOK_SECRET".into(),
            max_attempts: None,
            timeout: None,
            retry_wait: Some("5s".into()),
            max_wait: Some("1m".into()),
        }
    }

    #[test]
    fn an_endpoint_is_checked_and_its_waits_double_up_to_the_cap() {
        let e = file(&["run_finished"]).check("ops").unwrap();
        assert!(e.wants("run_finished") && !e.wants("approval_requested"));
        assert!(file(&["*"]).check("ops").unwrap().wants("needs_decision"));
        let waits: Vec<u64> = (1..=6).map(|n| e.wait_after(n).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 60, 60]);
        let bad = file(&["run_started"]).check("ops").unwrap_err();
        assert!(
            bad.contains("\"run_started\" is not an event type"),
            "{bad}"
        );
        assert!(file(&[]).check("ops").unwrap_err().contains("at least one"));
        let mut secret = file(&["*"]);
        secret.secret = "whsec_abc=".into();
        assert!(
            secret
                .check("ops")
                .unwrap_err()
                .contains("not a secret's name")
        );
        let mut url = file(&["*"]);
        url.url = "ftp://x".into();
        assert!(
            url.check("ops")
                .unwrap_err()
                .contains("http:// or https://")
        );
        assert!(file(&["*"]).check("Ops").is_err());
    }

    /// The signature scheme's own example (standard-webhooks.com, the
    /// specification's "Signature scheme" section).
    #[test]
    fn a_signature_is_the_specifications_example() {
        let key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = sign(
            &key,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(secret_key("whsec_").is_err());
        assert!(secret_key("not base64!").is_err());
    }

    #[test]
    fn a_body_holds_no_output_reason_or_argument() {
        let event = Event {
            seq: 7,
            run: RunId::new(),
            at_ms: 1_700_000_000_000,
            kind: EventKind::RunFinished {
                status: arbor_protocol::Status::Failed,
                error_class: Some(arbor_protocol::ErrorClass::Model),
                reason: Some("the model wrote SECRET-REASON".into()),
                output: serde_json::json!("SECRET-OUTPUT"),
                limitations: vec![],
            },
        };
        let (kind, body) = payload(&event).unwrap();
        assert_eq!(kind, "run_finished");
        assert!(!body.contains("SECRET"), "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["type"], "run_finished");
        assert_eq!(body["data"]["status"], "failed");
        assert_eq!(body["timestamp"], "2023-11-14T22:13:20.000Z");
    }
}

/// Why a notification was not sent again.
#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    /// It is not failed, or its endpoint is gone from arbor.toml.
    #[error("{0}")]
    Refused(String),
    #[error("journal: {0}")]
    Journal(#[from] arbor_storage::Error),
}

/// A node's notifications: its endpoints, and its line to the deliverer.
pub struct Notifications {
    journal: Journal,
    endpoints: BTreeMap<String, Arc<Endpoint>>,
    disabled: Arc<Mutex<BTreeSet<String>>>,
    to_deliver: tokio::sync::mpsc::UnboundedSender<Delivery>,
    changes: tokio::sync::watch::Receiver<u64>,
    counts: Arc<Mutex<BTreeMap<(String, &'static str), u64>>>,
    /// Handed to `deliver` once recovery has claimed the node's runs.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    start: Mutex<Option<deliver_start::Start>>,
    /// Tells the deliverer the node is closing; its task, to wait for.
    stop: tokio::sync::watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// How long a closing node gives its deliverer for the last round.
const LAST_ROUND: Duration = Duration::from_secs(10);

mod deliver_start {
    /// What the deliverer starts with.
    pub(crate) struct Start {
        #[cfg_attr(not(feature = "http"), allow(dead_code))]
        pub keys: std::collections::BTreeMap<String, Vec<u8>>,
        #[cfg_attr(not(feature = "http"), allow(dead_code))]
        pub inbox: tokio::sync::mpsc::UnboundedReceiver<super::Delivery>,
        #[cfg_attr(not(feature = "http"), allow(dead_code))]
        pub changes: tokio::sync::watch::Sender<u64>,
    }
}

impl Notifications {
    /// The outbox of `[notify]`'s endpoints, set on `events` before any
    /// event: `None` without endpoints. Each endpoint's signing secret must
    /// have a value in `secrets`.
    pub(crate) fn install(
        endpoints: &BTreeMap<String, Endpoint>,
        secrets: &arbor_actors::secrets::Secrets,
        journal: &Journal,
        events: &arbor_actors::events::EventBus,
    ) -> Result<Option<Arc<Notifications>>, String> {
        if endpoints.is_empty() {
            return Ok(None);
        }
        if cfg!(not(feature = "http")) {
            return Err(
                "arbor.toml: [notify] needs arbor built with HTTP (arbor-runtime's `http` feature)"
                    .into(),
            );
        }
        let mut keys = BTreeMap::new();
        for endpoint in endpoints.values() {
            let key = signing_key(
                secrets,
                &format!("notify.{}", endpoint.name),
                &endpoint.secret,
            )?;
            keys.insert(endpoint.name.clone(), key);
        }
        let entries = all(journal).map_err(|e| format!("the outbox does not read: {e}"))?;
        let disabled = Arc::new(Mutex::new(disabled_endpoints(&entries)));
        let (to_deliver, inbox) = tokio::sync::mpsc::unbounded_channel();
        let (changes_tx, changes) = tokio::sync::watch::channel(0);
        let shared: Vec<Arc<Endpoint>> = endpoints.values().cloned().map(Arc::new).collect();
        let outbox = NotifyOutbox::new(
            shared.clone(),
            journal.epoch(),
            disabled.clone(),
            to_deliver.clone(),
        );
        if !events.set_outbox(Arc::new(outbox)) {
            return Err("the event bus has an outbox already".into());
        }
        Ok(Some(Arc::new(Notifications {
            journal: journal.clone(),
            endpoints: shared.into_iter().map(|e| (e.name.clone(), e)).collect(),
            disabled,
            to_deliver,
            changes,
            counts: Default::default(),
            start: Mutex::new(Some(deliver_start::Start {
                keys,
                inbox,
                changes: changes_tx,
            })),
            stop: tokio::sync::watch::channel(false).0,
            task: Mutex::new(None),
        })))
    }

    /// A schedule's ticks were missed (`data`: its name, flow, span and
    /// count): the entries to commit (with the tick's record), and a call
    /// that hands them to the deliverer once committed at a seq.
    pub fn schedule_missed(
        &self,
        data: serde_json::Value,
        at_ms: u64,
    ) -> (Vec<Record>, impl FnOnce(u64) + use<>) {
        let timestamp =
            humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(at_ms));
        let kind = "schedule_missed";
        let body =
            serde_json::json!({"type": kind, "timestamp": timestamp.to_string(), "data": data});
        let endpoints: Vec<Arc<Endpoint>> = self.endpoints.values().cloned().collect();
        let disabled = self.disabled.lock().unwrap_or_else(|p| p.into_inner());
        let made = entries_for(
            &endpoints,
            &disabled,
            (NO_RUN, 0),
            kind,
            &body.to_string(),
            self.journal.epoch(),
        );
        let (records, entries): (Vec<Record>, Vec<Option<OutboxRecord>>) = made.into_iter().unzip();
        let entries: Vec<OutboxRecord> = entries.into_iter().flatten().collect();
        let to_deliver = self.to_deliver.clone();
        (records, move |seq| {
            if !entries.is_empty() {
                let _ = to_deliver.send(Delivery::New { seq, entries });
            }
        })
    }

    /// Starts delivering: what is pending in the journal (of the runs this
    /// node owns, on a shared one), then each new entry. Once.
    #[cfg(feature = "http")]
    pub(crate) fn deliver(&self) {
        let Some(start) = self.start.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let pending = deliver::taken_over(&self.journal);
        let deliverer = deliver::Deliverer {
            journal: self.journal.clone(),
            endpoints: self
                .endpoints
                .iter()
                .map(|(name, e)| (name.clone(), (e.clone(), start.keys[name].clone())))
                .collect(),
            disabled: self.disabled.clone(),
            inbox: start.inbox,
            changes: start.changes,
            counts: self.counts.clone(),
            stop: self.stop.subscribe(),
        };
        *self.task.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(tokio::spawn(deliverer.run(pending)));
    }

    /// As the node closes: the deliverer sends what is due once more (within
    /// `LAST_ROUND`), then ends. What it could not send stays pending in
    /// the journal for the next start.
    pub(crate) async fn stop(&self) {
        self.stop.send_replace(true);
        let task = self.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut task) = task
            && tokio::time::timeout(LAST_ROUND, &mut task).await.is_err()
        {
            task.abort();
            let _ = task.await;
        }
    }

    #[cfg(not(feature = "http"))]
    pub(crate) fn deliver(&self) {}

    /// Every entry, or those in `state`, oldest first.
    pub fn list(&self, state: Option<DeliveryState>) -> Result<Vec<OutboxRecord>, String> {
        let mut entries = all(&self.journal).map_err(|e| e.to_string())?;
        entries.retain(|e| state.is_none_or(|s| e.state == s));
        Ok(entries)
    }

    /// Sends a dead-lettered entry again, from its first try; its endpoint,
    /// if a 410 disabled it, is enabled again. `Ok(None)`: no such entry.
    /// `audit`: the entry of the call that asks (I-64), committed with it.
    pub async fn retry(
        &self,
        id: uuid::Uuid,
        audit: Option<Record>,
    ) -> Result<Option<OutboxRecord>, RetryError> {
        let Some(mut entry) = find(&self.journal, id)? else {
            return Ok(None);
        };
        if entry.state != DeliveryState::Failed {
            return Err(RetryError::Refused(format!(
                "notification {} is {}: only a failed one is sent again",
                entry.webhook_id(),
                entry.state.as_str()
            )));
        }
        if !self.endpoints.contains_key(&entry.endpoint) {
            return Err(RetryError::Refused(format!(
                "notification {} is for the endpoint {:?}, which arbor.toml's [notify] no \
                 longer has",
                entry.webhook_id(),
                entry.endpoint
            )));
        }
        let now = arbor_actors::events::now_ms();
        entry.state = DeliveryState::Pending;
        entry.attempts = 0;
        entry.next_ms = now;
        entry.gone = false;
        entry.updated_ms = now;
        entry.epoch = self.journal.epoch();
        let mut records = vec![entry.record()?];
        records.extend(audit);
        self.journal.commit(records).await?;
        self.disabled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&entry.endpoint);
        let _ = self.to_deliver.send(Delivery::Again(entry.clone()));
        Ok(Some(entry))
    }

    /// Bumped after every outcome the deliverer commits.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.clone()
    }

    /// Tries so far by endpoint and outcome (`delivered`, `retried`,
    /// `failed`, `gone`), since the node started.
    pub fn counts(&self) -> BTreeMap<(String, &'static str), u64> {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The endpoints a 410 disabled.
    pub fn disabled(&self) -> BTreeSet<String> {
        self.disabled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
