//! The gate (I-46, I-47): one actor per node through which every change of
//! every approval card passes, so each card has exactly one outcome whatever
//! races. A card is asked by a job's loop, decided by a person (through
//! `EmbeddedNode::decide`), expired by its timer, or cancelled when its job
//! is stopped or its run ends.
//!
//! Invariants:
//! 1. A card is durable in the journal before anyone can see it (its event,
//!    the queue), and each outcome is durable before its waiter or its
//!    decider hears of it: the tool never runs without a committed approval.
//! 2. Only a pending card changes, and only here, one message at a time: a
//!    second decision, a decision after the deadline's expiry or after a
//!    stop finds the card closed and is refused.
//! 3. A stop wins: once the waiting job's token is cancelled, a decision that
//!    comes before the gate has heard of the stop closes the card as
//!    cancelled instead.
//! 4. A card a restart carried over keeps its id and deadline; the resumed
//!    job that makes the same call (same lineage, tool and arguments) waits
//!    on it rather than asking again.

use crate::events::{EventBus, now_ms};
use crate::timer::{self, Timer};
use arbor_protocol::{
    ApprovalSettings, Card, CardId, CardKind, CardState, Decision, EventKind, JobId, RunId, Verdict,
};
use arbor_storage::{ApprovalRecord, Journal, Record};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Who closes a card when no person does: an expiry, a stop, a run's end.
pub const NODE: &str = "arbor";

pub struct Gate;

pub struct GateArgs {
    pub journal: Journal,
    pub events: EventBus,
    pub settings: ApprovalSettings,
    /// Cards of resumed runs that a restart found pending, or expired at
    /// recovery: their jobs' next attempts adopt them (invariant 4).
    pub carried: Vec<Card>,
}

/// Checks edited arguments against the tool's schema; `Err` says why not.
pub type ArgsCheck = Arc<dyn Fn(&serde_json::Value) -> Result<(), String> + Send + Sync>;

/// A gated call, as its loop asks for it.
pub struct Ask {
    pub run: RunId,
    pub job: JobId,
    pub lineage: Vec<String>,
    pub agent: String,
    pub tool: String,
    pub call: String,
    /// As the card shows them: secrets redacted, long strings clipped.
    pub args: serde_json::Value,
    /// The waiting job's token: cancelled, the card is.
    pub cancel: CancellationToken,
    pub check: ArgsCheck,
    /// Its `approve:` entry's own wait, instead of `[approvals] timeout`.
    pub timeout: Option<Duration>,
}

/// What the loop hears back.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Run it, with these arguments if a person edited them.
    Approved {
        edited: Option<serde_json::Value>,
    },
    Rejected {
        by: String,
        reason: String,
    },
    /// A question's answer.
    Answered {
        by: String,
        answer: String,
    },
    Expired,
    Cancelled,
    /// The card could not be made durable, so the call does not run.
    Failed(String),
}

/// A person's decision.
#[derive(Clone, Debug)]
pub struct Decide {
    pub verdict: Verdict,
    pub reason: Option<String>,
    pub args: Option<serde_json::Value>,
    /// A question's answer (`Verdict::Answer`).
    pub answer: Option<String>,
    /// The API token's name.
    pub by: String,
    /// The audit entry of the call that decides (I-64), committed with the
    /// card's outcome.
    pub audit: Option<Record>,
}

/// Why a decision was refused; nothing changed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DecideError {
    #[error("no card {0} waits on this node")]
    Unknown(CardId),
    #[error("card {id} is {state} already")]
    Closed { id: CardId, state: CardState },
    #[error(
        "card {0} is pending, but its run is not running on this node: it is decided once the run resumes"
    )]
    Idle(CardId),
    #[error("{0}")]
    Invalid(String),
    #[error("the decision could not be journaled: {0}")]
    Journal(String),
}

pub enum GateMsg {
    Ask {
        ask: Box<Ask>,
        reply: RpcReplyPort<Answer>,
    },
    Decide {
        card: CardId,
        decide: Box<Decide>,
        reply: RpcReplyPort<Result<Card, DecideError>>,
    },
    /// The card's `warn_at` has come.
    Warn { card: CardId },
    /// Its deadline has come.
    Expire { card: CardId },
    /// Its job's token was cancelled.
    Stopped { card: CardId },
    /// The run ended: nothing of it waits any more.
    RunEnded { run: RunId, reply: RpcReplyPort<()> },
    /// Cards recovery carried over for runs this node took over from
    /// another (a shared journal), as `GateArgs::carried` at a start.
    Carry { cards: Vec<Card> },
    /// A notify-mode call that ran (I-60): its card, decided `ran`,
    /// committed and told; the reply once it is durable.
    Record {
        card: Box<Card>,
        reply: RpcReplyPort<Result<(), String>>,
    },
}

struct Entry {
    card: Card,
    waiter: Option<Waiter>,
    /// A pending card's warning and expiry, called off when it closes.
    timers: Vec<Timer>,
}

struct Waiter {
    reply: RpcReplyPort<Answer>,
    cancel: CancellationToken,
    check: ArgsCheck,
    /// Ends the task that watches `cancel` once the card is closed.
    closed: CancellationToken,
}

pub struct GateState {
    journal: Journal,
    events: EventBus,
    settings: ApprovalSettings,
    /// Pending cards, and carried cards closed before their job came back.
    cards: HashMap<CardId, Entry>,
}

impl Actor for Gate {
    type Msg = GateMsg;
    type State = GateState;
    type Arguments = GateArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<GateMsg>,
        args: GateArgs,
    ) -> Result<GateState, ActorProcessingErr> {
        let mut state = GateState {
            journal: args.journal,
            events: args.events,
            settings: args.settings,
            cards: HashMap::new(),
        };
        state.carry(&myself, args.carried);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<GateMsg>,
        message: GateMsg,
        state: &mut GateState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            GateMsg::Carry { cards } => state.carry(&myself, cards),
            GateMsg::Ask { ask, reply } => Box::pin(state.ask(&myself, *ask, reply)).await,
            GateMsg::Record { card, reply } => {
                let _ = reply.send(Box::pin(state.record(*card)).await);
            }
            GateMsg::Decide {
                card,
                decide,
                reply,
            } => {
                let result = Box::pin(state.decide(card, *decide)).await;
                let _ = reply.send(result);
            }
            GateMsg::Warn { card } => state.warn(card),
            GateMsg::Expire { card } => {
                let reason = "no decision by the deadline".to_string();
                let _ = Box::pin(state.close(
                    card,
                    CardState::Expired,
                    NODE,
                    Some(reason),
                    Closing::default(),
                ))
                .await;
            }
            GateMsg::Stopped { card } => {
                let reason = "its job was stopped".to_string();
                let _ = Box::pin(state.close(
                    card,
                    CardState::Cancelled,
                    NODE,
                    Some(reason),
                    Closing::default(),
                ))
                .await;
            }
            GateMsg::RunEnded { run, reply } => {
                let ids: Vec<CardId> = state
                    .cards
                    .values()
                    .filter(|e| e.card.run == run)
                    .map(|e| e.card.id)
                    .collect();
                for id in ids {
                    let reason = "its run ended".to_string();
                    let _ = Box::pin(state.close(
                        id,
                        CardState::Cancelled,
                        NODE,
                        Some(reason),
                        Closing::default(),
                    ))
                    .await;
                    state.cards.remove(&id);
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

impl GateState {
    /// Takes cards a recovery carried over (invariant 4).
    fn carry(&mut self, myself: &ActorRef<GateMsg>, cards: Vec<Card>) {
        for card in cards {
            let timers = if card.state.is_pending() {
                self.arm(myself, &card)
            } else {
                Vec::new()
            };
            self.cards.insert(
                card.id,
                Entry {
                    card,
                    waiter: None,
                    timers,
                },
            );
        }
    }

    /// Timers for a pending card: its warning (if still to come) and its expiry.
    fn arm(&self, myself: &ActorRef<GateMsg>, card: &Card) -> Vec<Timer> {
        let now = now_ms();
        let wait = card.deadline_ms.saturating_sub(card.asked_at_ms);
        let warn_ms = card.asked_at_ms + (wait as f64 * self.settings.warn_at) as u64;
        let id = card.id;
        let mut timers = Vec::with_capacity(2);
        if warn_ms > now && warn_ms < card.deadline_ms {
            timers.push(timer::after(
                myself,
                Duration::from_millis(warn_ms - now),
                move || GateMsg::Warn { card: id },
            ));
        }
        timers.push(timer::after(
            myself,
            Duration::from_millis(card.deadline_ms.saturating_sub(now)),
            move || GateMsg::Expire { card: id },
        ));
        timers
    }

    async fn ask(&mut self, myself: &ActorRef<GateMsg>, ask: Ask, reply: RpcReplyPort<Answer>) {
        if ask.cancel.is_cancelled() {
            let _ = reply.send(Answer::Cancelled);
            return;
        }
        // Invariant 4: the same call of the same job's lineage, carried over.
        let carried = self.cards.values().find(|e| {
            e.waiter.is_none()
                && e.card.run == ask.run
                && e.card.lineage == ask.lineage
                && e.card.tool == ask.tool
                && e.card.args == ask.args
        });
        if let Some(entry) = carried {
            let id = entry.card.id;
            if !entry.card.state.is_pending() {
                // Decided while its job was down: the job that makes the
                // call now is the one the card names, then it hears how.
                let mut card = self.cards.remove(&id).expect("found above").card;
                card.job = ask.job;
                card.call = ask.call.clone();
                let answer = match self.commit(&card, None).await {
                    Ok(()) => answer_of(&card),
                    Err(e) => Answer::Failed(e),
                };
                let _ = reply.send(answer);
                return;
            }
            let mut card = entry.card.clone();
            card.job = ask.job;
            card.call = ask.call.clone();
            if let Err(e) = self.commit(&card, None).await {
                let _ = reply.send(Answer::Failed(e));
                return;
            }
            self.requested(&card);
            let waiter = self.waiter(myself, id, reply, ask.cancel, ask.check);
            let timers = self.cards.remove(&id).map(|e| e.timers).unwrap_or_default();
            self.cards.insert(
                id,
                Entry {
                    card,
                    waiter: Some(waiter),
                    timers,
                },
            );
            return;
        }
        let asked_at_ms = now_ms();
        let card = Card {
            id: CardId::new(),
            kind: arbor_protocol::CardKind::of_tool(&ask.tool),
            run: ask.run,
            job: ask.job,
            lineage: ask.lineage,
            agent: ask.agent,
            tool: ask.tool,
            call: ask.call,
            args: ask.args,
            state: CardState::Pending,
            asked_at_ms,
            deadline_ms: asked_at_ms
                + ask.timeout.unwrap_or(self.settings.timeout).as_millis() as u64,
            decision: None,
            result: None,
            undo: None,
        };
        // Invariant 1: durable before anyone can see it.
        if let Err(e) = self.commit(&card, None).await {
            let _ = reply.send(Answer::Failed(e));
            return;
        }
        self.requested(&card);
        let timers = self.arm(myself, &card);
        let waiter = self.waiter(myself, card.id, reply, ask.cancel, ask.check);
        self.cards.insert(
            card.id,
            Entry {
                card,
                waiter: Some(waiter),
                timers,
            },
        );
    }

    /// A notify-mode call's card: made decided (`ran`), durable, then told
    /// as a decision; nothing waits on it.
    async fn record(&self, card: Card) -> Result<(), String> {
        self.commit(&card, None).await?;
        let decision = card.decision.as_ref();
        self.events.emit(
            card.run,
            EventKind::ApprovalDecided {
                id: card.job,
                card: card.id,
                state: CardState::Ran,
                by: decision.map(|d| d.by.clone()).unwrap_or_default(),
                reason: None,
                waited_ms: 0,
            },
        );
        tracing::info!(run = %card.run, job = %card.job, card = %card.id, tool = %card.tool, "a notify-mode call ran");
        Ok(())
    }

    fn requested(&self, card: &Card) {
        self.events.emit(
            card.run,
            EventKind::ApprovalRequested {
                id: card.job,
                card: card.id,
                tool: card.tool.clone(),
                deadline_ms: card.deadline_ms,
            },
        );
        tracing::info!(
            run = %card.run,
            job = %card.job,
            card = %card.id,
            tool = %card.tool,
            "approval requested"
        );
    }

    /// A waiter, and a task that tells the gate when its job is stopped.
    fn waiter(
        &self,
        myself: &ActorRef<GateMsg>,
        card: CardId,
        reply: RpcReplyPort<Answer>,
        cancel: CancellationToken,
        check: ArgsCheck,
    ) -> Waiter {
        let closed = CancellationToken::new();
        let (stop, done, gate) = (cancel.clone(), closed.clone(), myself.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {
                    let _ = gate.cast(GateMsg::Stopped { card });
                }
                _ = done.cancelled() => {}
            }
        });
        Waiter {
            reply,
            cancel,
            check,
            closed,
        }
    }

    async fn decide(&mut self, id: CardId, decide: Decide) -> Result<Card, DecideError> {
        let entry = self.cards.get(&id).ok_or(DecideError::Unknown(id))?;
        if !entry.card.state.is_pending() {
            return Err(DecideError::Closed {
                id,
                state: entry.card.state,
            });
        }
        // Invariant 3: the stop came first, whether or not its message has.
        if entry
            .waiter
            .as_ref()
            .is_some_and(|w| w.cancel.is_cancelled())
        {
            let reason = "its job was stopped".to_string();
            self.close(
                id,
                CardState::Cancelled,
                NODE,
                Some(reason),
                Closing::default(),
            )
            .await?;
            return Err(DecideError::Closed {
                id,
                state: CardState::Cancelled,
            });
        }
        let reason = decide
            .reason
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty());
        let kind = entry.card.kind;
        match (kind, decide.verdict) {
            (CardKind::Question, Verdict::Approve | Verdict::Edit) => {
                return Err(DecideError::Invalid(format!(
                    "card {id} is a question: answer it (decision \"answer\" with an answer), \
                     or reject it with a reason"
                )));
            }
            (CardKind::Call | CardKind::Step, Verdict::Answer) => {
                return Err(DecideError::Invalid(format!(
                    "card {id} asks for a {}'s go-ahead, not an answer: approve or reject it",
                    kind.as_str()
                )));
            }
            (CardKind::Step, Verdict::Edit) => {
                return Err(DecideError::Invalid(format!(
                    "card {id} is a step's go-ahead: it has no arguments to edit; approve or \
                     reject it"
                )));
            }
            _ => {}
        }
        if decide.answer.is_some() && decide.verdict != Verdict::Answer {
            return Err(DecideError::Invalid(
                "an answer is for a question: give decision \"answer\" with it".into(),
            ));
        }
        let mut answer = None;
        let (state, edited) = match decide.verdict {
            Verdict::Answer => {
                answer = Some(check_answer(&entry.card.args, decide.answer)?);
                (CardState::Answered, None)
            }
            Verdict::Approve => {
                if decide.args.is_some() {
                    return Err(DecideError::Invalid(
                        "args are for an edit: give decision \"edit\" to run the call with them"
                            .into(),
                    ));
                }
                (CardState::Approved, None)
            }
            Verdict::Reject => {
                if reason.is_none() {
                    return Err(DecideError::Invalid(
                        "a rejection needs a reason: the agent reads it".into(),
                    ));
                }
                (CardState::Rejected, None)
            }
            Verdict::Edit => {
                let Some(args) = decide.args else {
                    return Err(DecideError::Invalid(
                        "an edit needs args: the arguments to run the call with".into(),
                    ));
                };
                let Some(waiter) = &entry.waiter else {
                    return Err(DecideError::Invalid(
                        "its job is not waiting on it yet (the run was resumed and has not \
                         reached the call), so edited arguments cannot be checked: approve or \
                         reject it, or edit once it waits"
                            .into(),
                    ));
                };
                (waiter.check)(&args).map_err(|why| {
                    DecideError::Invalid(format!("the edited arguments are refused: {why}"))
                })?;
                (CardState::Approved, Some(args))
            }
        };
        let closing = Closing {
            edited,
            answer,
            audit: decide.audit,
        };
        self.close(id, state, &decide.by, reason, closing).await
    }

    /// Closes a pending card: its one outcome, durable, then told.
    async fn close(
        &mut self,
        id: CardId,
        state: CardState,
        by: &str,
        reason: Option<String>,
        closing: Closing,
    ) -> Result<Card, DecideError> {
        let Closing {
            edited,
            answer,
            audit,
        } = closing;
        let Some(entry) = self.cards.get(&id) else {
            return Err(DecideError::Unknown(id));
        };
        if !entry.card.state.is_pending() {
            return Err(DecideError::Closed {
                id,
                state: entry.card.state,
            });
        }
        let mut card = entry.card.clone();
        card.state = state;
        let at_ms = now_ms();
        card.decision = Some(Decision {
            by: by.to_string(),
            reason: reason.clone(),
            at_ms,
            edited: edited.is_some(),
            answer,
        });
        if let Some(args) = &edited {
            card.args = args.clone();
        }
        self.commit(&card, audit)
            .await
            .map_err(DecideError::Journal)?;
        self.events.emit(
            card.run,
            EventKind::ApprovalDecided {
                id: card.job,
                card: id,
                state,
                by: by.to_string(),
                reason,
                waited_ms: at_ms.saturating_sub(card.asked_at_ms),
            },
        );
        tracing::info!(run = %card.run, job = %card.job, card = %id, %state, by, "approval decided");
        let entry = self.cards.remove(&id).expect("looked up above");
        match entry.waiter {
            Some(waiter) => {
                waiter.closed.cancel();
                let answer = match state {
                    CardState::Approved => Answer::Approved { edited },
                    _ => answer_of(&card),
                };
                let _ = waiter.reply.send(answer);
            }
            // A carried card closed before its job came back: kept, so the
            // job hears this outcome instead of asking again.
            None => {
                self.cards.insert(
                    id,
                    Entry {
                        card: card.clone(),
                        waiter: None,
                        timers: Vec::new(),
                    },
                );
            }
        }
        Ok(card)
    }

    fn warn(&self, id: CardId) {
        if let Some(entry) = self.cards.get(&id).filter(|e| e.card.state.is_pending()) {
            self.events.emit(
                entry.card.run,
                EventKind::ApprovalExpiring {
                    id: entry.card.job,
                    card: id,
                    deadline_ms: entry.card.deadline_ms,
                },
            );
        }
    }

    async fn commit(&self, card: &Card, also: Option<Record>) -> Result<(), String> {
        let record = Record::Approval(ApprovalRecord::of(card, self.journal.epoch()));
        let mut records = vec![record];
        records.extend(also);
        self.journal
            .commit(records)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// The answer a closed card gives its job.
pub fn answer_of(card: &Card) -> Answer {
    let decision = card.decision.as_ref();
    match card.state {
        CardState::Approved => Answer::Approved {
            edited: decision.filter(|d| d.edited).map(|_| card.args.clone()),
        },
        CardState::Rejected => Answer::Rejected {
            by: decision.map(|d| d.by.clone()).unwrap_or_default(),
            reason: decision.and_then(|d| d.reason.clone()).unwrap_or_default(),
        },
        CardState::Answered => Answer::Answered {
            by: decision.map(|d| d.by.clone()).unwrap_or_default(),
            answer: decision.and_then(|d| d.answer.clone()).unwrap_or_default(),
        },
        CardState::Expired => Answer::Expired,
        // A ran card is never waited on: its call ran before it was made.
        CardState::Ran => Answer::Approved { edited: None },
        CardState::Cancelled | CardState::Pending => Answer::Cancelled,
    }
}

/// What a closing decision carries beyond its state: a call's edited
/// arguments, a question's answer.
#[derive(Default)]
struct Closing {
    edited: Option<serde_json::Value>,
    answer: Option<String>,
    audit: Option<Record>,
}

/// A question's answer, checked: not empty, and one of its choices when it
/// gives some (the text of the choice, as the model wrote it).
fn check_answer(args: &serde_json::Value, answer: Option<String>) -> Result<String, DecideError> {
    let answer = answer
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .ok_or_else(|| DecideError::Invalid("an answer needs its text (answer)".into()))?;
    if answer.len() > MAX_ANSWER_LEN {
        return Err(DecideError::Invalid(format!(
            "the answer is {} bytes: at most {MAX_ANSWER_LEN}",
            answer.len()
        )));
    }
    let choices = arbor_protocol::approval::question_choices(args);
    if choices.is_empty() {
        return Ok(answer);
    }
    choices
        .iter()
        .find(|c| c.trim() == answer)
        .map(|c| c.to_string())
        .ok_or_else(|| {
            DecideError::Invalid(format!(
                "{answer:?} is not one of the question's choices: {}",
                choices.join(", ")
            ))
        })
}

/// The longest answer a person may give, in bytes.
pub const MAX_ANSWER_LEN: usize = 16 * 1024;
