//! The deliverer: one task per node that sends the outbox's pending entries
//! (I-61). An entry is sent once durable; each try is bounded in time, its
//! outcome committed before the next: a 2xx delivers it, a 410 disables its
//! endpoint, anything else (a redirect included: none is followed) waits
//! `Endpoint::wait_after` and tries again, until `max_attempts`, when it is
//! dead-lettered. A node that dies mid-try finds the entry pending at its
//! next start and sends it again, with the same id.

use super::{Delivery, DeliveryState, Endpoint, GONE, OutboxRecord};
use arbor_storage::Journal;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Tries sent at once, over every endpoint.
const AT_ONCE: usize = 8;
/// On a shared journal, how often the deliverer looks for pending entries
/// of runs this node took over from another.
const RESCAN: Duration = Duration::from_secs(15);

pub(crate) struct Deliverer {
    pub journal: Journal,
    pub endpoints: BTreeMap<String, (Arc<Endpoint>, Vec<u8>)>,
    pub disabled: Arc<Mutex<BTreeSet<String>>>,
    pub inbox: mpsc::UnboundedReceiver<Delivery>,
    /// Bumped after every outcome committed.
    pub changes: watch::Sender<u64>,
    /// Counted per endpoint and outcome (`delivered`, `retried`,
    /// `failed`, `gone`), for metrics.
    pub counts: Arc<Mutex<BTreeMap<(String, &'static str), u64>>>,
    /// Turns true as the node closes: one last round of what is due, then
    /// the task ends (and lets go of the journal).
    pub stop: watch::Receiver<bool>,
}

/// One try's outcome.
enum Outcome {
    Delivered,
    Gone,
    Failed(String),
}

impl Deliverer {
    /// Runs until the node closes (`stop`), or its journal fails.
    pub(crate) async fn run(mut self, pending: Vec<OutboxRecord>) {
        let client = match reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("arbor/", env!("CARGO_PKG_VERSION")))
            .build()
        {
            Ok(client) => client,
            Err(e) => {
                tracing::error!(error = %e, "notifications cannot be sent: no HTTP client");
                return;
            }
        };
        let mut pending: HashMap<uuid::Uuid, OutboxRecord> =
            pending.into_iter().map(|e| (e.id, e)).collect();
        let shared = self.journal.is_shared();
        let mut rescan = tokio::time::interval(RESCAN);
        rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_round = false;
        let mut stop = self.stop.clone();
        while !last_round {
            let now = arbor_actors::events::now_ms();
            let next = pending.values().map(|e| e.next_ms).min();
            let due_in = next.map(|n| Duration::from_millis(n.saturating_sub(now)));
            let journal_ok = tokio::select! {
                delivery = self.inbox.recv() => match delivery {
                    Some(delivery) => self.take(delivery, &mut pending).await,
                    None => return,
                },
                () = sleep_for(due_in) => true,
                _ = rescan.tick(), if shared => {
                    for entry in taken_over(&self.journal) {
                        pending.entry(entry.id).or_insert(entry);
                    }
                    true
                }
                () = async { drop(stop.wait_for(|stop| *stop).await) } => {
                    last_round = true;
                    let mut ok = true;
                    while let Ok(delivery) = self.inbox.try_recv() {
                        ok &= self.take(delivery, &mut pending).await;
                    }
                    ok
                }
            };
            if !journal_ok || !self.round(&client, &mut pending).await {
                return;
            }
        }
    }

    /// Takes what the outbox handed over; false if the journal failed.
    async fn take(
        &self,
        delivery: Delivery,
        pending: &mut HashMap<uuid::Uuid, OutboxRecord>,
    ) -> bool {
        match delivery {
            Delivery::New { seq, entries } => {
                // Invariant 1: sent only once durable.
                if let Err(e) = self.journal.wait_durable(seq).await {
                    tracing::error!(error = %e, "notifications were not made durable");
                    return false;
                }
                pending.extend(entries.into_iter().map(|e| (e.id, e)));
            }
            Delivery::Again(entry) => {
                pending.insert(entry.id, entry);
            }
        }
        true
    }

    /// Sends what is due (up to `AT_ONCE`), committing each outcome; then
    /// fails what waits for an endpoint a 410 disabled. False if the
    /// journal failed.
    async fn round(
        &self,
        client: &reqwest::Client,
        pending: &mut HashMap<uuid::Uuid, OutboxRecord>,
    ) -> bool {
        let now = arbor_actors::events::now_ms();
        let mut due: Vec<OutboxRecord> = pending
            .values()
            .filter(|e| e.next_ms <= now)
            .cloned()
            .collect();
        due.sort_by_key(|e| (e.next_ms, e.id));
        due.truncate(AT_ONCE);
        let tries = due.iter().map(|entry| self.attempt(client, entry));
        let outcomes = futures::future::join_all(tries).await;
        let mut done = vec![];
        for (mut entry, outcome) in due.into_iter().zip(outcomes) {
            self.settle(&mut entry, outcome);
            done.push(entry);
        }
        let disabled = self
            .disabled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for entry in pending.values() {
            if disabled.contains(&entry.endpoint) && !done.iter().any(|d| d.id == entry.id) {
                let mut entry = entry.clone();
                entry.state = DeliveryState::Failed;
                entry.last_error = Some(GONE.into());
                entry.updated_ms = now;
                entry.epoch = self.journal.epoch();
                done.push(entry);
            }
        }
        if done.is_empty() {
            return true;
        }
        // One commit for the round's outcomes: one flush, however many tries.
        let mut records = Vec::with_capacity(done.len());
        for entry in &done {
            match entry.record() {
                Ok(record) => records.push(record),
                Err(e) => tracing::error!(error = %e, "a notification could not be encoded"),
            }
        }
        if let Err(e) = self.journal.commit(records).await {
            tracing::error!(error = %e, "notifications' outcomes were not committed");
            return false;
        }
        for entry in done {
            if entry.state == DeliveryState::Pending {
                pending.insert(entry.id, entry);
            } else {
                pending.remove(&entry.id);
            }
        }
        self.changes.send_modify(|v| *v += 1);
        true
    }

    /// One try of `entry`, bounded by its endpoint's `timeout`.
    async fn attempt(&self, client: &reqwest::Client, entry: &OutboxRecord) -> Outcome {
        let Some((endpoint, key)) = self.endpoints.get(&entry.endpoint) else {
            return Outcome::Failed(format!(
                "the endpoint {:?} is no longer in arbor.toml's [notify]",
                entry.endpoint
            ));
        };
        let id = entry.webhook_id();
        let timestamp = arbor_actors::events::now_ms() / 1000;
        let signature = super::sign(key, &id, timestamp, &entry.body);
        let sent = client
            .post(&endpoint.url)
            .timeout(endpoint.timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(entry.body.clone())
            .send()
            .await;
        match sent {
            Ok(answer) if answer.status().is_success() => Outcome::Delivered,
            Ok(answer) if answer.status() == reqwest::StatusCode::GONE => Outcome::Gone,
            Ok(answer) if answer.status().is_redirection() => Outcome::Failed(format!(
                "answered {} (redirects are not followed)",
                answer.status()
            )),
            Ok(answer) => Outcome::Failed(format!("answered {}", answer.status())),
            Err(e) if e.is_timeout() => Outcome::Failed(format!(
                "no answer within {}",
                humantime::format_duration(endpoint.timeout)
            )),
            Err(e) => Outcome::Failed(format!("could not be sent: {}", error_chain(&e))),
        }
    }

    /// The entry after a try: delivered, dead-lettered, or due again.
    fn settle(&self, entry: &mut OutboxRecord, outcome: Outcome) {
        let now = arbor_actors::events::now_ms();
        entry.attempts += 1;
        entry.updated_ms = now;
        // Rewritten by this open (I-41), whichever open made it.
        entry.epoch = self.journal.epoch();
        let max_attempts = self
            .endpoints
            .get(&entry.endpoint)
            .map_or(1, |(e, _)| e.max_attempts);
        let counted = match outcome {
            Outcome::Delivered => {
                entry.state = DeliveryState::Delivered;
                entry.last_error = None;
                entry.gone = false;
                "delivered"
            }
            Outcome::Gone => {
                entry.state = DeliveryState::Failed;
                entry.last_error = Some(GONE.into());
                entry.gone = true;
                self.disabled
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(entry.endpoint.clone());
                tracing::warn!(endpoint = %entry.endpoint, "a notification endpoint answered 410 Gone: disabled");
                "gone"
            }
            Outcome::Failed(why) if entry.attempts >= max_attempts => {
                entry.state = DeliveryState::Failed;
                entry.last_error =
                    Some(format!("{why} (try {} of {max_attempts})", entry.attempts));
                tracing::warn!(endpoint = %entry.endpoint, id = %entry.webhook_id(), %why, "a notification was dead-lettered");
                "failed"
            }
            Outcome::Failed(why) => {
                let wait = self
                    .endpoints
                    .get(&entry.endpoint)
                    .map_or(Duration::from_secs(5), |(e, _)| {
                        e.wait_after(entry.attempts)
                    });
                entry.next_ms = now + wait.as_millis() as u64;
                entry.last_error =
                    Some(format!("{why} (try {} of {max_attempts})", entry.attempts));
                "retried"
            }
        };
        *self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((entry.endpoint.clone(), counted))
            .or_default() += 1;
    }
}

async fn sleep_for(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

/// A reqwest error with its causes (the first line alone is often "error
/// sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// On a shared journal, the pending entries of runs this node owns (runs it
/// took over included).
pub(crate) fn taken_over(journal: &Journal) -> Vec<OutboxRecord> {
    let me = journal.node_id();
    super::all(journal)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.state == DeliveryState::Pending)
        // A notification of no run (a schedule's) is every node's to send:
        // twice at worst, with one webhook-id.
        .filter(|e| {
            e.run == super::NO_RUN
                || match journal.owner(e.run) {
                    Ok(Some((node, _))) => Some(node) == me,
                    Ok(None) => me.is_none(),
                    Err(_) => false,
                }
        })
        .collect()
}
