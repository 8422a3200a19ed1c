//! Stopping, collecting and settling children. The parent is the only writer
//! of a child's final status (`parent::record_child_end`, shared with the
//! Run): a child is charged (I-10) and its terminal record made durable
//! (I-29); a child its parent stopped has no output, whatever it sent (I-16);
//! one whose actor died
//! without reporting failed, class `panicked` (I-38). A failed child may be
//! retried (I-23) or stop its siblings (I-42), if that is the rule.

use super::JobState;
use super::children::{ChildState, PlannedChild, Waiter};
use super::messages::JobMsg;
use crate::account::{AccountMsg, Grant, GrantAsk, Share};
use crate::parent::ChildReport;
use crate::parent::{ChildEnd, StopReason, record_child_end};
use arbor_protocol::{
    Amount, ErrorClass, JobId, NodeKind, OnFailure, ParentRef, Refusal, ResultEnvelope, Status,
};
use arbor_storage::Record;
use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use std::time::Duration;

impl JobState {
    pub(super) fn stop_child_label(
        &mut self,
        label: &str,
        reason: &str,
        propagated: bool,
        audit: Option<arbor_storage::Record>,
    ) -> Result<String, Refusal> {
        if self.children.retrying.remove(label).is_some() {
            // Its failed attempt stands; the wait's timer goes with it.
            self.answer_waiters();
            return Ok(format!("{label} will not be tried again"));
        }
        let Some(entry) = self.children.latest_mut(label) else {
            return Err(Refusal::UnknownChild {
                child: label.to_string(),
                known: self.children.known(),
            });
        };
        // Stopping any attempt cancels the chain (I-23).
        entry.retries_left = 0;
        match entry.state {
            ChildState::Running => {
                entry.state = ChildState::Stopping;
                entry.stop_reason = Some(StopReason::new(reason, propagated).with_audit(audit));
                let _ = entry.actor.cast(JobMsg::Stop {
                    reason: reason.to_string(),
                    propagated,
                });
                Ok(format!("{label} is stopping"))
            }
            ChildState::Stopping => Ok(format!("{label} is already stopping")),
            ChildState::Settled => Err(Refusal::ChildEnded {
                child: label.to_string(),
                status: entry.status_word(),
            }),
        }
    }

    pub(super) fn collect(
        &mut self,
        myself: &ActorRef<JobMsg>,
        children: Vec<String>,
        timeout: Option<Duration>,
        stop_on_timeout: bool,
        reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    ) {
        let labels = if children.is_empty() {
            self.children.uncollected_labels()
        } else {
            match children
                .iter()
                .map(|c| self.children.resolve(c))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(labels) => labels,
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                    return;
                }
            }
        };
        let id = self.children.next_waiter;
        self.children.next_waiter += 1;
        self.children.waiters.insert(
            id,
            Waiter {
                labels,
                stop_on_timeout,
                timeout,
                reply,
                settled_upto: 0,
                timer: None,
            },
        );
        if !self.answer_waiters().contains(&id)
            && let Some(timeout) = timeout
            && let Some(waiter) = self.children.waiters.get_mut(&id)
        {
            waiter.timer = Some(crate::timer::after(myself, timeout, move || {
                JobMsg::WaitTimedOut { waiter: id }
            }));
        }
    }

    pub(super) async fn wait_timed_out(&mut self, waiter: u64) -> Result<(), ActorProcessingErr> {
        if !self.children.waiters.contains_key(&waiter) {
            return Ok(());
        }
        // Its results may name children whose end is not durable yet.
        self.settles_durable().await?;
        let Some(w) = self.children.waiters.remove(&waiter) else {
            return Ok(());
        };
        let timeout = humantime::format_duration(w.timeout.unwrap_or_default()).to_string();
        let mut results = vec![];
        for label in &w.labels {
            let entry = self.children.latest(label).cloned();
            let Some(entry) = entry else { continue };
            if self.children.label_settled(label) {
                if let Some(env) = &entry.envelope {
                    results.push(env.clone());
                }
                self.children.mark_collected(label);
                continue;
            }
            let (status, error) = if w.stop_on_timeout {
                // I-17: the parent stopped waiting, so the child is stopped.
                let reason = format!("its parent stopped waiting after {timeout}");
                let _ = self.stop_child_label(label, &reason, false, None);
                (Status::Stopped, reason)
            } else {
                (
                    Status::Running,
                    format!("still running when collect timed out after {timeout}"),
                )
            };
            results.push(ResultEnvelope {
                job: entry.id,
                label: Some(entry.label.clone()),
                attempt: entry.attempt,
                agent: entry.agent.clone(),
                status,
                task_status: None,
                output: serde_json::Value::Null,
                error: Some(error),
                error_class: w.stop_on_timeout.then_some(ErrorClass::Timeout),
                limitations: vec![],
                artifacts: vec![],
                tokens_spent: entry.meter.get(),
                usd_micros_spent: entry.meter.amount().usd_micros,
                turns: 0,
                workdir: String::new(),
            });
        }
        let _ = w.reply.send(Ok(results));
        Ok(())
    }

    /// A child's final word: charge it (I-10), write its terminal record, drop
    /// its output if it was stopped (I-16), retry it (I-23) or stop its
    /// siblings (I-42) if that is the rule.
    pub(super) async fn child_ended(
        &mut self,
        myself: &ActorRef<JobMsg>,
        report: ChildReport,
    ) -> Result<(), ActorProcessingErr> {
        let Some(entry) = self.children.by_id.get(&report.id) else {
            return Ok(());
        };
        if entry.state == ChildState::Settled {
            return Ok(());
        }
        let mut entry = entry.clone();
        // A stop above this job cancels every descendant's token at once,
        // ahead of the Stop messages that follow parent by parent. A child
        // that ended meanwhile (its children cut short, its next turn
        // answered before its own Stop arrived) was stopped all the same: its
        // output must not become a result (I-16).
        if entry.stop_reason.is_none() && self.cancel.is_cancelled() {
            let reason = StopReason::new("stopped: an ancestor is stopping", true);
            entry.stop_reason = Some(reason.clone());
            if let Some(e) = self.children.by_id.get_mut(&entry.id) {
                e.stop_reason = Some(reason);
            }
        }
        let envelope = record_child_end(
            &self.ctx,
            &self.account,
            &mut self.ended,
            ChildEnd {
                id: entry.id,
                run: self.lineage.run,
                parent: ParentRef::Job(self.lineage.id),
                agent: &entry.plan.agent.name,
                kind: NodeKind::Job,
                depth: self.lineage.depth + 1,
                grant_tokens: entry.grant.tokens,
                stop: entry.stop_reason.as_ref(),
            },
            report.envelope,
        )
        .await?;
        self.children.settle(entry.id, envelope.clone());
        let class = envelope.error_class.unwrap_or(ErrorClass::Task);
        let tries_again = match &entry.plan.retry {
            Some(policy) => policy.retries(entry.attempt, class),
            None => entry.retries_left > 0 && class.is_retryable(),
        };
        let retry = envelope.status == Status::Failed
            && tries_again
            && entry.stop_reason.is_none()
            && self.finish.is_none();
        if retry {
            let mut plan = entry.plan.clone();
            plan.id = JobId::new();
            plan.attempt += 1;
            plan.retries = entry.retries_left.saturating_sub(1);
            plan.asked = None;
            plan.asked_usd_micros = None;
            plan.brief.request = format!(
                "{}\n\nA previous attempt failed: {}{}",
                entry.plan.brief.request,
                envelope.error.clone().unwrap_or_default(),
                if envelope.limitations.is_empty() {
                    String::new()
                } else {
                    format!("\nIts limitations: {}", envelope.limitations.join("; "))
                }
            );
            // The first attempt's end is told before the next one starts.
            self.settles_durable().await?;
            let wait = entry
                .plan
                .retry
                .as_ref()
                .map(|p| p.wait_before(plan.attempt))
                .unwrap_or_default();
            if !wait.is_zero() {
                self.wait_to_retry(myself, &entry, plan, class, wait);
                return Ok(());
            }
            self.start_retry(myself, plan, entry.grant).await;
            return Ok(());
        }
        if envelope.status == Status::Failed
            && self
                .children
                .groups
                .get(entry.plan.group)
                .map(|g| g.on_failure)
                == Some(OnFailure::CancelSiblings)
        {
            let reason = format!("sibling {} failed", entry.label);
            for label in self.children.running_in_group(entry.plan.group) {
                let _ = self.stop_child_label(&label, &reason, false, None);
            }
        }
        // A loop answered takes the ends; what no loop waits on is flushed.
        self.answer_waiters();
        self.release_ended(myself);
        Ok(())
    }

    /// Answers the collect calls whose children have all settled; returns
    /// the waiters answered. Ends not yet durable go to the loop with the
    /// answer (`Ends::hand_over`): it tells them, once they are, before it
    /// acts on them outside, and its next commit makes them so.
    pub(super) fn answer_waiters(&mut self) -> Vec<u64> {
        let ready = self.children.ready_waiters();
        if !ready.is_empty() {
            // Before the answer: the loop must find them held.
            self.ended.hand_over();
            self.children.answer(&ready);
        }
        ready
    }

    /// Tells the ends that are durable; asks to be told when the rest are.
    pub(super) fn release_ended(&mut self, myself: &ActorRef<JobMsg>) {
        let myself = myself.clone();
        self.ended
            .release(&self.ctx, self.lineage.run, move |result| {
                let _ = myself.cast(JobMsg::EndsDurable { result });
            });
    }

    /// Waits here until every end is durable, and tells them.
    pub(super) async fn settles_durable(&mut self) -> Result<(), ActorProcessingErr> {
        self.ended.settle(&self.ctx, self.lineage.run).await?;
        Ok(())
    }

    /// A failed child's next attempt waits `wait` (its `retry` policy): the
    /// wait is told (`retry_waiting`, the parent's node shows it) and the
    /// label stays unsettled, so a collect waits on through it. A stop, of
    /// the label or of this job, calls it off. Not resumed after a restart:
    /// recovery runs an interrupted step again whole.
    fn wait_to_retry(
        &mut self,
        myself: &ActorRef<JobMsg>,
        failed: &super::children::ChildEntry,
        plan: PlannedChild,
        class: ErrorClass,
        wait: Duration,
    ) {
        let until_ms = crate::events::now_ms().saturating_add(wait.as_millis() as u64);
        self.ctx.events.emit(
            self.lineage.run,
            arbor_protocol::EventKind::RetryWaiting {
                id: failed.id,
                label: failed.label.clone(),
                attempt: plan.attempt,
                class,
                until_ms,
            },
        );
        let label = failed.label.clone();
        let timer = crate::timer::after(myself, wait, move || JobMsg::RetryDue { label });
        self.children.retrying.insert(
            failed.label.clone(),
            super::children::PendingRetry {
                plan,
                grant: failed.grant,
                _timer: timer,
            },
        );
    }

    /// A waiting retry's time has come: its attempt starts, unless it was
    /// called off meanwhile.
    pub(super) async fn retry_due(&mut self, myself: &ActorRef<JobMsg>, label: &str) {
        if let Some(pending) = self.children.retrying.remove(label) {
            self.start_retry(myself, pending.plan, pending.grant).await;
        }
    }

    /// Starts a failed child's next attempt; a refusal (the spawn cap, the
    /// budget) leaves the failure standing, with the refusal among its
    /// limitations.
    async fn start_retry(
        &mut self,
        myself: &ActorRef<JobMsg>,
        plan: PlannedChild,
        previous_grant: Grant,
    ) {
        let label = plan.label.clone();
        if let Err(refusal) = self.retry_child(myself, plan, previous_grant).await
            && let Some(env) = self
                .children
                .latest_mut(&label)
                .and_then(|e| e.envelope.as_mut())
        {
            env.limitations.push(format!("retry refused: {refusal}"));
        }
        self.answer_waiters();
        self.release_ended(myself);
    }

    /// A new attempt: new id, new reservation, counted by the spawn cap (I-23).
    async fn retry_child(
        &mut self,
        myself: &ActorRef<JobMsg>,
        plan: PlannedChild,
        previous_grant: Grant,
    ) -> Result<(), Refusal> {
        self.run_ctx.count_spawns(1)?;
        // A retry may be granted at most what the attempt before it was.
        let asks = vec![GrantAsk {
            child: plan.id,
            agent: plan.agent.name.clone(),
            asked: None,
            agent_max: Some(previous_grant.tokens),
            asked_usd_micros: None,
            agent_max_usd_micros: previous_grant.usd_micros,
        }];
        let share = Share::Fraction(self.ctx.limits.grant_fraction);
        let grant = match ractor::call!(self.account, |reply| AccountMsg::Reserve {
            asks,
            share,
            reply
        }) {
            Ok(Ok(g)) => g[0],
            Ok(Err(r)) => {
                self.run_ctx.uncount_spawns(1);
                return Err(r);
            }
            Err(e) => {
                self.run_ctx.uncount_spawns(1);
                return Err(Refusal::Invalid {
                    message: e.to_string(),
                });
            }
        };
        let record = self.child_record(&plan, grant, Status::Pending);
        let record_seq = match self.ctx.journal.commit(vec![Record::Job(record)]).await {
            Ok(seq) => seq,
            Err(e) => {
                let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                    child: plan.id,
                    spent: Amount::ZERO,
                    reply
                });
                self.run_ctx.uncount_spawns(1);
                return Err(Refusal::Invalid {
                    message: e.to_string(),
                });
            }
        };
        self.spawn_child(myself, &plan, grant, record_seq, Default::default())
            .await
            .map(|_| ())
            .map_err(|message| {
                self.run_ctx.uncount_spawns(1);
                Refusal::Invalid { message }
            })
    }
}
