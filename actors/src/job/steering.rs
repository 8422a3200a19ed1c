//! Steering (I-20): a message to a job is journaled and queued, durable
//! before its sender hears "queued", and reaches the model only in a turn,
//! journaled again as delivered. A job that is finishing refuses
//! new messages, and `begin_finish` discards the queued ones. A message for a
//! child is passed on to it: the child answers the loop itself, so this
//! mailbox never waits on a child.

use super::JobState;
use super::children::ChildState;
use super::messages::JobMsg;
use arbor_protocol::{EventKind, Refusal};
use arbor_storage::{Record, SteerRecord, SteerState};
use ractor::RpcReplyPort;

impl JobState {
    pub(super) fn journal_steer(&self, message_id: u64, text: &str, state: SteerState) {
        let _ = self.ctx.journal.append(vec![Record::Steer(SteerRecord {
            job: self.lineage.id,
            message_id,
            text: text.to_string(),
            state,
            epoch: self.ctx.journal.epoch(),
        })]);
    }

    /// Queues a message; it is durable before the sender hears "queued".
    ///
    /// The job does not wait for that itself: the record is appended, the
    /// message queued, and a task answers the sender once a flush covers it,
    /// so many messages arriving together share one flush. Nothing acts on a
    /// queued message before then: it reaches the model only in a turn, and
    /// a turn's request goes out after its reservation's commit, which covers
    /// this record too. If the journal fails instead, that commit fails as
    /// well and the message never reaches the model.
    pub(super) fn queue_steering(
        &mut self,
        text: String,
        from_parent: bool,
        reply: Option<RpcReplyPort<Result<u64, Refusal>>>,
        audit: Option<Record>,
    ) {
        self.queue_message(text, from_parent, None, reply, audit);
    }

    /// A sibling's message (`send_peer`): queued and delivered as steering
    /// is (I-20), said as the peer's, told as `peer_queued` and
    /// `peer_delivered`.
    pub(super) fn queue_peer(
        &mut self,
        from: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    ) {
        let text = format!("A message from your peer `{from}`: {text}");
        self.queue_message(text, false, Some(from), Some(reply), None);
    }

    fn queue_message(
        &mut self,
        text: String,
        from_parent: bool,
        peer: Option<String>,
        reply: Option<RpcReplyPort<Result<u64, Refusal>>>,
        audit: Option<Record>,
    ) {
        let answer = |result| {
            if let Some(reply) = reply {
                let _ = reply.send(result);
            }
        };
        if let Some(finish) = &self.finish {
            return answer(Err(Refusal::ChildEnded {
                child: self.lineage.id.to_string(),
                status: format!("ending as {}", finish.status),
            }));
        }
        let journaled = |e: arbor_storage::Error| Refusal::Invalid {
            message: format!("the message could not be journaled: {e}"),
        };
        let id = self.next_message_id;
        let record = Record::Steer(SteerRecord {
            job: self.lineage.id,
            message_id: id,
            text: text.clone(),
            state: SteerState::Queued,
            epoch: self.ctx.journal.epoch(),
        });
        let mut records = vec![record];
        records.extend(audit);
        let seq = match self.ctx.journal.append(records) {
            Ok(seq) => seq,
            Err(e) => return answer(Err(journaled(e))),
        };
        self.next_message_id += 1;
        self.steering.push_back((id, text, from_parent));
        self.steering_queued
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        self.steering_arrived.notify_one();
        let kind = match peer {
            Some(from) => {
                self.peer_messages.insert(id, from.clone());
                EventKind::PeerQueued {
                    id: self.lineage.id,
                    from,
                    to: self.lineage.label.clone().unwrap_or_default(),
                    message_id: id,
                }
            }
            None => EventKind::SteerQueued {
                id: self.lineage.id,
                message_id: id,
            },
        };
        self.ctx.events.emit(self.lineage.run, kind);
        let journal = self.ctx.journal.clone();
        tokio::spawn(async move {
            answer(
                journal
                    .wait_durable(seq)
                    .await
                    .map(|()| id)
                    .map_err(journaled),
            );
        });
    }

    pub(super) fn deliver_steering(&mut self, turn: u32) -> Vec<(String, bool)> {
        self.steering_queued
            .store(0, std::sync::atomic::Ordering::Release);
        let mut texts = vec![];
        while let Some((id, text, from_parent)) = self.steering.pop_front() {
            // After what the loop holds: its last turn's results come first.
            self.journal_steer(id, &text, SteerState::Delivered);
            let kind = match self.peer_messages.remove(&id) {
                Some(from) => EventKind::PeerDelivered {
                    id: self.lineage.id,
                    from,
                    message_id: id,
                    turn,
                },
                None => EventKind::SteerDelivered {
                    id: self.lineage.id,
                    message_id: id,
                    turn,
                },
            };
            self.ended.held().emit(&self.ctx, self.lineage.run, kind);
            texts.push((text, from_parent));
        }
        texts
    }

    pub(super) fn send_message(
        &mut self,
        child: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    ) {
        let entry = self.children.resolve(&child).and_then(|label| {
            self.children
                .latest(&label)
                .cloned()
                .ok_or(Refusal::UnknownChild {
                    child: child.clone(),
                    known: String::new(),
                })
        });
        match entry {
            Err(refusal) => {
                let _ = reply.send(Err(refusal));
            }
            Ok(entry) if entry.state != ChildState::Running => {
                let _ = reply.send(Err(Refusal::ChildEnded {
                    child,
                    status: entry.status_word(),
                }));
            }
            Ok(entry) => {
                // The child answers the loop itself: this mailbox never waits on a child.
                if entry
                    .actor
                    .cast(JobMsg::Steer {
                        text,
                        from_parent: true,
                        reply: Some(reply),
                        audit: None,
                    })
                    .is_err()
                {
                    // The port went with the failed message; the loop sees the call fail.
                }
            }
        }
    }
}
