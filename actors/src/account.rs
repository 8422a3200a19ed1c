//! Account: one per run, step and job. Every token spent below it is reserved here first.
//!
//! Parent: the run, step or job it pays for (spawned linked to it).
//! Journals: every hold, release, call reservation and call settlement before
//! it replies (I-29), so a crash loses no charge (I-31).
//!
//! Invariants:
//! 1. grant == spent + held + available, available >= 0 (I-14). `available` is
//!    derived, so the check that bites is that `held` is exactly the sum of
//!    open holds and `spent` exactly own calls plus settled children.
//! 2. A reservation is all or nothing: siblings reserved in one message are
//!    admitted together or not at all, and the mailbox serializes callers (I-07).
//! 3. Zero is never a grant (I-09).

use crate::context::NodeContext;
use arbor_protocol::{EventKind, JobId, ParentRef, Refusal, RunId};
use arbor_storage::{LedgerOp, LedgerRecord, Record};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct Account;

pub struct AccountArgs {
    pub ctx: Arc<NodeContext>,
    pub run: RunId,
    pub owner: ParentRef,
    pub grant: u64,
    /// I-12: the share of the grant after which model requests wind down.
    pub wind_down: f64,
    pub meter: SpentMeter,
    /// A resumed run's account: it was opened before the restart and had spent
    /// this much, all of it settled. Nothing new is journaled on open.
    pub resume_spent: Option<u64>,
}

/// The account's total spent, readable by the parent without a message, so a
/// child whose actors died abnormally is still charged what it spent (I-10).
#[derive(Clone, Debug, Default)]
pub struct SpentMeter(Arc<AtomicU64>);

impl SpentMeter {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Release)
    }
}

/// One child's part of a reservation.
#[derive(Clone, Debug)]
pub struct GrantAsk {
    pub child: JobId,
    pub agent: String,
    /// What the request asked for, if anything.
    pub asked: Option<u64>,
    /// The agent's front-matter budget: the most one of its jobs may be granted.
    pub agent_max: Option<u64>,
}

/// How a reservation divides the available budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Share {
    /// I-08: a delegate call grants together at most this share of available.
    Fraction(f64),
    /// The steps of a flow group share what is available evenly.
    Even,
}

/// A model call's reservation (I-11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHold {
    pub reserved: u64,
    pub max_output: u64,
    /// I-12: spend had crossed the wind-down share when the call was reserved.
    pub wind_down: bool,
}

pub enum AccountMsg {
    /// Hold grants for children; refused whole if any part can't be met.
    Reserve {
        asks: Vec<GrantAsk>,
        share: Share,
        reply: RpcReplyPort<Result<Vec<u64>, Refusal>>,
    },
    /// Hold the worst case of one model call before it is sent.
    ReserveCall {
        input_estimate: u64,
        max_output_limit: u64,
        reply: RpcReplyPort<Result<CallHold, Refusal>>,
    },
    /// The call came back: release its hold, charge what it used.
    SettleCall {
        reserved: u64,
        spent: u64,
        /// The call's `ModelCalled` event, emitted with the charge so that no
        /// stop can land between them (the tree checks spent = its calls).
        event: Option<EventKind>,
        reply: RpcReplyPort<()>,
    },
    /// The child is done: charge what it spent, return the rest (I-10).
    Settle {
        child: JobId,
        spent: u64,
        reply: RpcReplyPort<()>,
    },
    /// Final figures; the account takes no more reservations.
    Close {
        reply: RpcReplyPort<arbor_protocol::AccountView>,
    },
    Snapshot {
        reply: RpcReplyPort<arbor_protocol::AccountView>,
    },
}

impl Actor for Account {
    type Msg = AccountMsg;
    type State = AccountState;
    type Arguments = AccountArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: AccountArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let resumed = args.resume_spent.is_some();
        let state = AccountState::new(args);
        // A resumed account was opened before the restart, unless the crash
        // came between the run's record and its account's: then open it now.
        let opened = resumed
            && state
                .ctx
                .journal
                .ledger(state.owner)?
                .iter()
                .any(|r| matches!(r.op, LedgerOp::Open { .. }));
        if opened {
            return Ok(state);
        }
        state
            .journal(
                LedgerOp::Open {
                    grant: state.ledger.grant,
                },
                true,
            )
            .await?;
        // No event here: the opening figures are in the owner's NodeSpawned
        // (or RunStarted), which the tree folds.
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            AccountMsg::Reserve { asks, share, reply } => {
                let result = state.ledger.plan_grants(&asks, share);
                if let Ok(grants) = &result {
                    let ops = asks
                        .iter()
                        .zip(grants)
                        .map(|(a, g)| LedgerOp::Hold {
                            child: a.child,
                            tokens: *g,
                        })
                        .collect();
                    state.journal_many(ops, true).await?;
                    for (ask, grant) in asks.iter().zip(grants) {
                        state.ledger.held_children.insert(ask.child, *grant);
                    }
                    state.publish();
                }
                let _ = reply.send(result);
            }
            AccountMsg::ReserveCall {
                input_estimate,
                max_output_limit,
                reply,
            } => {
                let result = state.ledger.plan_call(input_estimate, max_output_limit);
                if let Ok(hold) = &result {
                    state
                        .journal(
                            LedgerOp::CallReserve {
                                tokens: hold.reserved,
                            },
                            true,
                        )
                        .await?;
                    state.ledger.held_calls += hold.reserved;
                    state.publish();
                }
                let _ = reply.send(result);
            }
            AccountMsg::SettleCall {
                reserved,
                spent,
                event,
                reply,
            } => {
                state.ledger.settle_call(reserved, spent);
                if let Some(event) = event {
                    state.ctx.events.emit(state.run, event);
                }
                state
                    // Durable: a charge lost in a crash would be settled at 0 (I-31).
                    .journal(LedgerOp::CallSettle { reserved, spent }, true)
                    .await?;
                state.publish();
                let _ = reply.send(());
            }
            AccountMsg::Settle {
                child,
                spent,
                reply,
            } => {
                if let Some(granted) = state.ledger.settle_child(child, spent) {
                    state
                        .journal(
                            LedgerOp::Release {
                                child,
                                granted,
                                spent,
                            },
                            true,
                        )
                        .await?;
                    state.publish();
                }
                let _ = reply.send(());
            }
            AccountMsg::Close { reply } => {
                // A call whose loop was stopped mid-flight never reported
                // usage: its hold is released uncharged, so a closed account
                // holds nothing.
                let outstanding = state.ledger.held_calls;
                if outstanding > 0 {
                    state.ledger.settle_call(outstanding, 0);
                    state
                        .journal(
                            LedgerOp::CallSettle {
                                reserved: outstanding,
                                spent: 0,
                            },
                            false,
                        )
                        .await?;
                    state.publish();
                }
                state.ledger.closed = true;
                state
                    .journal(
                        LedgerOp::Close {
                            spent: state.ledger.spent(),
                        },
                        true,
                    )
                    .await?;
                let _ = reply.send(state.ledger.view());
            }
            AccountMsg::Snapshot { reply } => {
                let _ = reply.send(state.ledger.view());
            }
        }
        Ok(())
    }
}

pub struct AccountState {
    ctx: Arc<NodeContext>,
    run: RunId,
    owner: ParentRef,
    ledger: Ledger,
    wind_down_emitted: bool,
    meter: SpentMeter,
}

/// The account's arithmetic, pure so that every rule is unit-tested without actors.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    pub grant: u64,
    own_spent: u64,
    children_spent: u64,
    held_children: BTreeMap<JobId, u64>,
    held_calls: u64,
    wind_down_at: u64,
    closed: bool,
}

impl AccountState {
    pub fn new(args: AccountArgs) -> Self {
        Self {
            ctx: args.ctx,
            run: args.run,
            owner: args.owner,
            ledger: Ledger::resumed(args.grant, args.wind_down, args.resume_spent.unwrap_or(0)),
            wind_down_emitted: false,
            meter: args.meter,
        }
    }

    async fn journal(&self, op: LedgerOp, durable: bool) -> Result<(), ActorProcessingErr> {
        self.journal_many(vec![op], durable).await
    }

    async fn journal_many(
        &self,
        ops: Vec<LedgerOp>,
        durable: bool,
    ) -> Result<(), ActorProcessingErr> {
        let epoch = self.ctx.journal.epoch();
        let records = ops
            .into_iter()
            .map(|op| {
                Record::Ledger(LedgerRecord {
                    owner: self.owner,
                    op,
                    epoch,
                })
            })
            .collect();
        if durable {
            self.ctx.journal.commit(records).await?;
        } else {
            self.ctx.journal.append(records)?;
        }
        Ok(())
    }

    /// Emits the figures after a change, and the wind-down crossing once.
    fn publish(&mut self) {
        self.meter.set(self.ledger.spent());
        let view = self.ledger.view();
        self.ctx.events.emit(
            self.run,
            EventKind::AccountChanged {
                owner: self.owner,
                grant: view.grant,
                spent: view.spent,
                held: view.held,
            },
        );
        if !self.wind_down_emitted && view.spent >= self.ledger.wind_down_at && view.spent > 0 {
            self.wind_down_emitted = true;
            self.ctx.events.emit(
                self.run,
                EventKind::WindDown {
                    owner: self.owner,
                    spent: view.spent,
                    grant: view.grant,
                },
            );
        }
    }
}

impl Ledger {
    /// An account reopened after a restart: what it spent before is settled
    /// spend of its (ended) children; nothing is held.
    pub fn resumed(grant: u64, wind_down: f64, spent: u64) -> Self {
        Self {
            children_spent: spent,
            ..Self::new(grant, wind_down)
        }
    }

    pub fn new(grant: u64, wind_down: f64) -> Self {
        Self {
            grant,
            wind_down_at: ((grant as f64) * wind_down).ceil() as u64,
            ..Self::default()
        }
    }

    pub fn spent(&self) -> u64 {
        self.own_spent + self.children_spent
    }

    pub fn held(&self) -> u64 {
        self.held_children.values().sum::<u64>() + self.held_calls
    }

    /// grant - spent - held. Saturates: a provider that reports more than was
    /// reserved is charged the truth, and then nothing more is available.
    pub fn available(&self) -> u64 {
        self.grant.saturating_sub(self.spent() + self.held())
    }

    pub fn view(&self) -> arbor_protocol::AccountView {
        arbor_protocol::AccountView {
            grant: self.grant,
            spent: self.spent(),
            held: self.held(),
        }
    }

    /// I-07, I-08, I-09: the grants for `asks`, measured against what is
    /// available now, or why none can be made. Pure.
    pub fn plan_grants(&self, asks: &[GrantAsk], share: Share) -> Result<Vec<u64>, Refusal> {
        let refuse = |message: String| Err(Refusal::Budget { message });
        if self.closed {
            return refuse("the account is closed; nothing new can be granted".into());
        }
        if asks.is_empty() {
            return Ok(vec![]);
        }
        let available = self.available();
        for ask in asks {
            if let (Some(asked), Some(max)) = (ask.asked, ask.agent_max)
                && asked > max
            {
                return refuse(format!(
                    "a job of {} asks {asked} tokens, more than the {max} its agent may be granted",
                    ask.agent
                ));
            }
        }
        let cap = match share {
            Share::Fraction(f) => (((available as f64) * f).floor() as u64).min(available),
            Share::Even => available,
        };
        let asked_total: u64 = asks.iter().filter_map(|a| a.asked).sum();
        if asked_total > cap {
            return refuse(match share {
                Share::Fraction(f) => format!(
                    "the jobs ask {asked_total} tokens together; one delegate call may grant at most {cap} ({f} of the {available} available)"
                ),
                Share::Even => {
                    format!("the steps ask {asked_total} tokens; {available} are available")
                }
            });
        }
        let unasked = asks.iter().filter(|a| a.asked.is_none()).count() as u64;
        let each = (cap - asked_total).checked_div(unasked).unwrap_or(0);
        let mut grants = Vec::with_capacity(asks.len());
        for ask in asks {
            let grant = match ask.asked {
                Some(asked) => asked,
                None => each.min(ask.agent_max.unwrap_or(u64::MAX)),
            };
            if grant == 0 {
                return refuse(format!(
                    "a job of {} would be granted 0 tokens ({} left of the cap {cap} for {unasked} jobs without a budget); 0 never means unlimited",
                    ask.agent,
                    cap - asked_total
                ));
            }
            grants.push(grant);
        }
        debug_assert!(grants.iter().sum::<u64>() <= available);
        Ok(grants)
    }

    /// I-11: the worst case of the next model call, or `budget_exhausted`.
    pub fn plan_call(
        &self,
        input_estimate: u64,
        max_output_limit: u64,
    ) -> Result<CallHold, Refusal> {
        let available = self.available();
        if self.closed || available <= input_estimate {
            return Err(Refusal::Budget {
                message: format!(
                    "budget exhausted: the next model call needs more than {input_estimate} tokens and {available} are available"
                ),
            });
        }
        let max_output = max_output_limit.min(available - input_estimate);
        Ok(CallHold {
            reserved: input_estimate + max_output,
            max_output,
            wind_down: self.spent() >= self.wind_down_at,
        })
    }

    pub fn settle_call(&mut self, reserved: u64, spent: u64) {
        self.held_calls = self.held_calls.saturating_sub(reserved);
        self.own_spent += spent;
    }

    /// Returns the grant that was held for `child`, or None if it was not held
    /// (settled already: a second settle must not charge twice).
    pub fn settle_child(&mut self, child: JobId, spent: u64) -> Option<u64> {
        let granted = self.held_children.remove(&child)?;
        self.children_spent += spent;
        Some(granted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(asked: Option<u64>, agent_max: Option<u64>) -> GrantAsk {
        GrantAsk {
            child: JobId::new(),
            agent: "a".into(),
            asked,
            agent_max,
        }
    }

    /// One rule per row: (grant, already spent, asks, share) -> grants or the refusal's words.
    fn check(case: (u64, u64, Vec<GrantAsk>, Share), expected: Result<Vec<u64>, &str>) {
        let (grant, spent, asks, share) = case;
        let mut ledger = Ledger::new(grant, 0.8);
        ledger.settle_call(0, spent);
        match (ledger.plan_grants(&asks, share), expected) {
            (Ok(got), Ok(want)) => assert_eq!(got, want),
            (Err(got), Err(words)) => assert!(got.to_string().contains(words), "{got}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn inv_08_grants_follow_the_fraction_rule() {
        let half = Share::Fraction(0.5);
        // No asks: the cap shared evenly.
        check(
            (1000, 0, vec![ask(None, None), ask(None, None)], half),
            Ok(vec![250, 250]),
        );
        // Askers get what they ask; the rest share what is left of the cap.
        check(
            (
                1000,
                0,
                vec![ask(Some(100), None), ask(None, None), ask(None, None)],
                half,
            ),
            Ok(vec![100, 200, 200]),
        );
        // Available is measured now: spent counts.
        check((1000, 600, vec![ask(None, None)], half), Ok(vec![200]));
        // The agent's own budget caps an even share...
        check(
            (1000, 0, vec![ask(None, Some(30)), ask(None, None)], half),
            Ok(vec![30, 250]),
        );
        // ...and refuses a request above it, never clamps it.
        check(
            (1000, 0, vec![ask(Some(40), Some(30))], half),
            Err("more than the 30 its agent may be granted"),
        );
        // Asking above the cap is refused naming the cap.
        check(
            (1000, 0, vec![ask(Some(501), None)], half),
            Err("may grant at most 500"),
        );
        // Steps share all that is available evenly.
        check(
            (
                999,
                0,
                vec![ask(None, None), ask(None, None), ask(None, None)],
                Share::Even,
            ),
            Ok(vec![333, 333, 333]),
        );
    }

    #[test]
    fn inv_09_a_grant_that_would_be_zero_refuses_the_spawn() {
        check(
            (
                3,
                0,
                vec![ask(None, None), ask(None, None)],
                Share::Fraction(0.5),
            ),
            Err("would be granted 0 tokens"),
        );
        check(
            (100, 100, vec![ask(None, None)], Share::Even),
            Err("would be granted 0 tokens"),
        );
    }

    #[test]
    fn inv_11_a_call_reserves_its_worst_case_or_is_refused() {
        let mut ledger = Ledger::new(1000, 0.8);
        let hold = ledger.plan_call(300, 4096).unwrap();
        assert_eq!(
            (hold.reserved, hold.max_output),
            (1000, 700),
            "output cut to what is left"
        );
        ledger.held_calls += hold.reserved;
        assert!(
            ledger.plan_call(1, 10).is_err(),
            "nothing left while the call is out"
        );
        ledger.settle_call(hold.reserved, 400);
        assert_eq!(
            ledger.view(),
            arbor_protocol::AccountView {
                grant: 1000,
                spent: 400,
                held: 0
            }
        );
        assert!(
            ledger.plan_call(600, 10).is_err(),
            "a prompt that cannot fit is budget_exhausted"
        );
    }

    #[test]
    fn inv_10_settling_charges_spent_once_and_frees_the_rest() {
        let mut ledger = Ledger::new(1000, 0.8);
        let child = JobId::new();
        ledger.held_children.insert(child, 400);
        assert_eq!(ledger.available(), 600);
        assert_eq!(ledger.settle_child(child, 150), Some(400));
        assert_eq!(
            (ledger.spent(), ledger.held(), ledger.available()),
            (150, 0, 850)
        );
        assert_eq!(
            ledger.settle_child(child, 150),
            None,
            "a second settle charges nothing"
        );
        assert_eq!(ledger.spent(), 150);
    }
}
