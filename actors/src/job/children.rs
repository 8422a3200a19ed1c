//! The children's table: every attempt by id, each label's latest attempt,
//! the fan-out groups of delegate calls and the collect calls waiting on them.
//! A child is running, stopping (the parent decided it is stopped; its report
//! is awaited for its spend only) or settled; a job reports to its parent
//! only once all are settled (I-14).

use super::messages::{Brief, JobMsg};
use crate::account::{Grant, SpentMeter};
use crate::parent::ChildReport;
use crate::parent::dead_envelope;
use crate::policy::Policy;
use arbor_protocol::{AgentDef, JobId, OnFailure, Refusal, ResultEnvelope};
use ractor::{ActorRef, RpcReplyPort};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub(super) struct PlannedChild {
    pub(super) id: JobId,
    pub(super) label: String,
    pub(super) asked: Option<u64>,
    pub(super) asked_usd_micros: Option<u64>,
    pub(super) brief: Brief,
    pub(super) policy: Policy,
    pub(super) agent: Arc<AgentDef>,
    pub(super) retries: u32,
    /// Its retry policy (`retry`), in place of `retries`: attempts after waits.
    pub(super) retry: Option<Arc<arbor_protocol::RetryPolicy>>,
    pub(super) attempt: u32,
    pub(super) group: usize,
    /// The model's id of the delegate call that asked for it.
    pub(super) call: Arc<str>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ChildState {
    Running,
    /// The parent decided it is stopped; its report is awaited for its spend only.
    Stopping,
    Settled,
}

#[derive(Clone)]
pub(super) struct ChildEntry {
    pub(super) id: JobId,
    pub(super) label: String,
    pub(super) agent: String,
    pub(super) attempt: u32,
    pub(super) actor: ActorRef<JobMsg>,
    pub(super) grant: Grant,
    pub(super) meter: SpentMeter,
    pub(super) state: ChildState,
    pub(super) stop_reason: Option<crate::parent::StopReason>,
    pub(super) envelope: Option<ResultEnvelope>,
    pub(super) plan: PlannedChild,
    pub(super) retries_left: u32,
    pub(super) collected: bool,
}

impl ChildEntry {
    pub(super) fn status_word(&self) -> String {
        match (&self.state, &self.envelope) {
            (ChildState::Settled, Some(env)) => env.status.to_string(),
            (ChildState::Stopping, _) => "stopping".into(),
            _ => "running".into(),
        }
    }
}

pub(super) struct FanOut {
    pub(super) on_failure: OnFailure,
}

pub(super) struct Waiter {
    pub(super) labels: Vec<String>,
    pub(super) stop_on_timeout: bool,
    pub(super) timeout: Option<Duration>,
    pub(super) reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    /// Labels before this one were settled when last looked at: a waiter on
    /// 10,000 children is not read from the start at each one's end.
    pub(super) settled_upto: usize,
    /// Its timeout's timer, called off when the waiter is answered.
    pub(super) timer: Option<crate::timer::Timer>,
}

#[derive(Default)]
pub(super) struct Children {
    pub(super) by_id: BTreeMap<JobId, ChildEntry>,
    /// Label -> latest attempt.
    pub(super) latest: HashMap<String, JobId>,
    order: Vec<String>,
    pub(super) groups: Vec<FanOut>,
    pub(super) waiters: BTreeMap<u64, Waiter>,
    pub(super) next_waiter: u64,
    /// Running or stopping attempts, and their actors: kept beside `by_id`
    /// so that a parent of 10,000 children does not scan them all at each
    /// one's end.
    unsettled: usize,
    unsettled_actors: HashMap<ractor::ActorId, JobId>,
    /// Labels whose failed attempt waits to be tried again (its `retry`):
    /// unsettled until the next attempt starts or the retry is called off.
    pub(super) retrying: BTreeMap<String, PendingRetry>,
}

/// A failed child's next attempt, started when its timer fires.
pub(super) struct PendingRetry {
    pub(super) plan: PlannedChild,
    pub(super) grant: Grant,
    pub(super) _timer: crate::timer::Timer,
}

impl Children {
    pub(super) fn insert(&mut self, entry: ChildEntry) {
        if !self.latest.contains_key(&entry.label) {
            self.order.push(entry.label.clone());
        }
        self.latest.insert(entry.label.clone(), entry.id);
        if entry.state != ChildState::Settled {
            self.unsettled += 1;
            self.unsettled_actors.insert(entry.actor.get_id(), entry.id);
        }
        if let Some(old) = self.by_id.insert(entry.id, entry)
            && old.state != ChildState::Settled
        {
            self.unsettled -= 1;
        }
    }

    /// A child's final status, once its parent has decided it.
    pub(super) fn settle(&mut self, id: JobId, envelope: ResultEnvelope) {
        let Some(entry) = self.by_id.get_mut(&id) else {
            return;
        };
        if entry.state != ChildState::Settled {
            self.unsettled -= 1;
            self.unsettled_actors.remove(&entry.actor.get_id());
        }
        entry.state = ChildState::Settled;
        entry.envelope = Some(envelope);
    }

    pub(super) fn latest(&self, label: &str) -> Option<&ChildEntry> {
        self.latest.get(label).and_then(|id| self.by_id.get(id))
    }

    pub(super) fn latest_mut(&mut self, label: &str) -> Option<&mut ChildEntry> {
        let id = *self.latest.get(label)?;
        self.by_id.get_mut(&id)
    }

    pub(super) fn known(&self) -> String {
        if self.order.is_empty() {
            "none".into()
        } else {
            self.order.join(", ")
        }
    }

    /// A label or any attempt's id, to the label.
    pub(super) fn resolve(&self, name: &str) -> Result<String, Refusal> {
        if self.latest.contains_key(name) {
            return Ok(name.to_string());
        }
        if let Ok(id) = name.parse::<JobId>()
            && let Some(entry) = self.by_id.get(&id)
        {
            return Ok(entry.label.clone());
        }
        Err(Refusal::UnknownChild {
            child: name.to_string(),
            known: self.known(),
        })
    }

    pub(super) fn auto_label(&self, agent: &str, already_planned: usize) -> String {
        let mut n = self.order.len() + already_planned + 1;
        loop {
            let label = format!("{agent}-{n}");
            if !self.latest.contains_key(&label) {
                return label;
            }
            n += 1;
        }
    }

    pub(super) fn running_count(&self) -> u32 {
        self.unsettled as u32
    }

    pub(super) fn running_labels(&self) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| {
                self.latest(l)
                    .is_some_and(|c| c.state == ChildState::Running)
            })
            .cloned()
            .collect()
    }

    pub(super) fn running_in_group(&self, group: usize) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| {
                self.latest(l)
                    .is_some_and(|c| c.state == ChildState::Running && c.plan.group == group)
            })
            .cloned()
            .collect()
    }

    pub(super) fn all_settled(&self) -> bool {
        self.unsettled == 0 && self.retrying.is_empty()
    }

    /// Whether `label` is done: its latest attempt settled and none to come.
    pub(super) fn label_settled(&self, label: &str) -> bool {
        !self.retrying.contains_key(label)
            && self
                .latest(label)
                .is_none_or(|c| c.state == ChildState::Settled)
    }

    pub(super) fn cancel_retries(&mut self) {
        for c in self.by_id.values_mut() {
            c.retries_left = 0;
        }
        self.retrying.clear();
    }

    pub(super) fn uncollected_labels(&self) -> Vec<String> {
        self.order
            .iter()
            .filter(|l| self.latest(l).is_some_and(|c| !c.collected))
            .cloned()
            .collect()
    }

    pub(super) fn mark_collected(&mut self, label: &str) {
        if let Some(c) = self.latest_mut(label) {
            c.collected = true;
        }
    }

    /// The waiters whose children have all settled.
    pub(super) fn ready_waiters(&mut self) -> Vec<u64> {
        let settled = |children: &Children, label: &String| children.label_settled(label);
        let mut ready = vec![];
        let ids: Vec<u64> = self.waiters.keys().copied().collect();
        for id in ids {
            let w = &self.waiters[&id];
            let mut upto = w.settled_upto;
            while upto < w.labels.len() && settled(self, &w.labels[upto]) {
                upto += 1;
            }
            // A retry makes a settled label's latest attempt run again; the
            // whole list is read once more before the waiter is answered.
            let all = upto == w.labels.len() && w.labels.iter().all(|l| settled(self, l));
            if all {
                ready.push(id);
            } else if upto == w.labels.len() {
                upto = 0;
            }
            if let Some(w) = self.waiters.get_mut(&id) {
                w.settled_upto = upto;
            }
        }
        ready
    }

    /// Answers the waiters `ready_waiters` found.
    pub(super) fn answer(&mut self, ready: &[u64]) {
        for id in ready {
            let w = self.waiters.remove(id).expect("listed above");
            let mut results = vec![];
            for label in &w.labels {
                if let Some(env) = self.latest(label).and_then(|c| c.envelope.clone()) {
                    results.push(env);
                }
                self.mark_collected(label);
            }
            let _ = w.reply.send(Ok(results));
        }
    }

    /// Whether `actor` is the actor of a child that has not settled.
    pub(super) fn has_unsettled_actor(&self, actor: ractor::ActorId) -> bool {
        self.unsettled_actors.contains_key(&actor)
    }

    /// The report for a child actor that died without one, if it is an unsettled child's.
    pub(super) fn report_for_dead(&self, actor: ractor::ActorId, why: &str) -> Option<ChildReport> {
        let entry = self.by_id.get(self.unsettled_actors.get(&actor)?)?;
        Some(ChildReport {
            id: entry.id,
            envelope: dead_envelope(
                entry.id,
                &entry.label,
                entry.attempt,
                &entry.agent,
                &format!("the job's actor {why} before it reported"),
                entry.meter.amount(),
            ),
        })
    }
}
