//! Account: one per run, step and job. Every token spent below it is reserved here first.
//!
//! Parent: the run, step or job it pays for (spawned linked to it).
//! Journals: every hold, release, call reservation and call settlement before
//! it replies. Only a call's reservation is committed here (the request goes
//! out as soon as the reply is back); every other entry is appended, and the
//! commit its caller makes next (the children's records, the terminal record,
//! the next call's reservation) makes it durable before anything acts on it
//! (I-29), since seq order is durability order. So a crash loses no charge (I-31).
//!
//! Invariants:
//! 1. grant == spent + held + available, available >= 0 (I-14). `available` is
//!    derived, so the check that bites is that `held` is exactly the sum of
//!    open holds and `spent` exactly own calls plus settled children.
//! 2. A reservation is all or nothing: siblings reserved in one message are
//!    admitted together or not at all, and the mailbox serializes callers (I-07).
//! 3. Zero is never a grant (I-09).

use crate::context::NodeContext;
pub use crate::grant::{Grant, GrantAsk};
use crate::model::Price;
use arbor_protocol::{AccountView, Amount, EventKind, JobId, ParentRef, Refusal, RunId};
use arbor_storage::{LedgerOp, LedgerRecord, Record, Unit};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct Account;

/// One ledger change and the unit it is in.
type Entry = (Unit, LedgerOp);

pub struct AccountArgs {
    pub ctx: Arc<NodeContext>,
    pub run: RunId,
    pub owner: ParentRef,
    pub grant: u64,
    /// The grant in micro-dollars, if the account has a usd ceiling.
    pub grant_usd_micros: Option<u64>,
    /// I-12: the share of the grant after which model requests wind down.
    pub wind_down: f64,
    pub meter: SpentMeter,
    /// A resumed run's account: it was opened before the restart and had spent
    /// this much, all of it settled. Nothing new is journaled on open.
    pub resume_spent: Option<Amount>,
    /// Opened, and its first call reserved, by its parent in the commit that
    /// admitted it (`FirstCall::plan`): nothing is journaled on open.
    pub first_call: Option<FirstCall>,
}

/// A job's first model call, reserved by its parent in the commit that
/// admits the job, beside the job's records: its first request then waits
/// for no commit of its own (a delegation's syncs in a row: two, not
/// three). It is used only if the loop's first reservation asks for
/// exactly what was planned; otherwise it is released and the call
/// reserved as any other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstCall {
    pub hold: CallHold,
    pub billed: bool,
}

impl FirstCall {
    /// The first call of a job granted `grant`, planned as its account will
    /// plan it, and the ledger records that open the account and hold it,
    /// for the admission's commit. None if the grant cannot cover it (the
    /// job's loop is refused as usual).
    pub fn plan(
        job: JobId,
        grant: crate::account::Grant,
        wind_down: f64,
        epoch: u64,
        call: &PlannedCall,
    ) -> Option<(FirstCall, Vec<Record>)> {
        let ledger = Ledger::with_usd(grant.tokens, grant.usd_micros, wind_down);
        let hold = ledger
            .plan_call(call.input_estimate, call.max_output_limit, call.price)
            .ok()?;
        let mut ops = ledger.open_ops();
        ops.extend(ledger.reserve_ops(hold.reserved, call.billed));
        let records = entry_records(ParentRef::Job(job), epoch, ops);
        Some((
            FirstCall {
                hold,
                billed: call.billed,
            },
            records,
        ))
    }
}

/// What a model call asks its account to reserve (`AccountMsg::ReserveCall`).
#[derive(Clone, Copy, Debug)]
pub struct PlannedCall {
    pub input_estimate: u64,
    pub max_output_limit: u64,
    pub price: Option<Price>,
    pub billed: bool,
}

/// The account's total spent, readable by the parent without a message, so a
/// child whose actors died abnormally is still charged what it spent (I-10).
#[derive(Clone, Debug, Default)]
pub struct SpentMeter(Arc<(AtomicU64, AtomicU64)>);

impl SpentMeter {
    /// Tokens.
    pub fn get(&self) -> u64 {
        self.0.0.load(Ordering::Acquire)
    }
    pub fn amount(&self) -> Amount {
        Amount {
            tokens: self.get(),
            usd_micros: self.0.1.load(Ordering::Acquire),
        }
    }
    fn set(&self, v: Amount) {
        self.0.1.store(v.usd_micros, Ordering::Release);
        self.0.0.store(v.tokens, Ordering::Release)
    }
}

/// What each job of `agent` in `run` holds of its `budget.per_run`, as
/// the run's tree has it: its grant while it runs, what it spent once ended.
fn jobs_holding(ctx: &NodeContext, run: RunId, agent: &str) -> Vec<(JobId, Amount)> {
    ctx.events.with_tree(run, |tree| {
        let Some(tree) = tree else {
            return vec![];
        };
        tree.nodes()
            .filter(|(_, n)| n.kind != arbor_protocol::NodeKind::Run)
            .filter(|(_, n)| n.agent.as_deref() == Some(agent))
            .map(|(job, n)| {
                let usd = n.usd.unwrap_or_default();
                let held = match n.status.is_terminal() {
                    true => Amount {
                        tokens: n.account.spent,
                        usd_micros: usd.spent,
                    },
                    false => Amount {
                        tokens: n.account.grant,
                        usd_micros: usd.grant,
                    },
                };
                (job, held)
            })
            .collect()
    })
}

/// How a reservation divides the available budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Share {
    /// I-08: a delegate call grants together at most this share of available.
    Fraction(f64),
    /// The steps of a flow group share what is available evenly, with
    /// `held_back` more of them that start later (a retry's or a person's
    /// wait): their shares stay in the account for them.
    Even { held_back: usize },
}

/// A model call's reservation (I-11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHold {
    /// The call's worst case: its tokens, and its cost in micro-dollars (0
    /// on an unpriced model when the account has no usd ceiling).
    pub reserved: Amount,
    pub max_output: u64,
    /// I-12: spend had crossed the wind-down share when the call was reserved.
    pub wind_down: bool,
}

pub enum AccountMsg {
    /// Hold grants for children; refused whole if any part can't be met.
    Reserve {
        asks: Vec<GrantAsk>,
        share: Share,
        reply: RpcReplyPort<Result<Vec<Grant>, Refusal>>,
    },
    /// Hold the worst case of one model call before it is sent.
    ReserveCall {
        input_estimate: u64,
        max_output_limit: u64,
        /// The model's price; None: unpriced (refused under a usd ceiling).
        price: Option<Price>,
        /// The request goes to a provider that bills what it receives.
        billed: bool,
        reply: RpcReplyPort<Result<CallHold, Refusal>>,
    },
    /// The call came back: release its hold, charge what it used.
    SettleCall {
        reserved: Amount,
        spent: Amount,
        /// The call's `ModelCalled` event, emitted with the charge so that no
        /// stop can land between them (the tree checks spent = its calls).
        /// Boxed: the largest field of any message the account takes.
        event: Option<Box<EventKind>>,
        reply: RpcReplyPort<()>,
    },
    /// The child is done: charge what it spent, return the rest (I-10).
    Settle {
        child: JobId,
        spent: Amount,
        reply: RpcReplyPort<()>,
    },
    /// Final figures; the account takes no more reservations.
    Close {
        reply: RpcReplyPort<Closed>,
    },
    Snapshot {
        reply: RpcReplyPort<AccountView>,
    },
    /// A run's root grant raised (a top-up, I-58): journaled with `with`
    /// (its audit entry) before it is told; the new figures, or why not.
    Grow {
        amount: Amount,
        with: Vec<Record>,
        reply: RpcReplyPort<Result<AccountView, String>>,
    },
    /// A held child's grant extended from what is available (a paused
    /// step's share of a top-up, I-58): at least `at_least`, else a
    /// 1/`among` share of what is available, whichever is more; appended
    /// (the child's `Grow`, committed next, makes it durable). What was
    /// given, or None if what is available is short of `at_least`.
    Extend {
        child: JobId,
        at_least: Amount,
        among: u64,
        reply: RpcReplyPort<Option<Amount>>,
    },
    /// What is available: tokens, and micro-dollars if it has a usd ceiling.
    Available {
        reply: RpcReplyPort<(u64, Option<u64>)>,
    },
}

/// An account's final figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Closed {
    pub tokens: AccountView,
    pub usd: Option<AccountView>,
    /// What it spent, in both units (micro-dollars metered even without a ceiling).
    pub spent: Amount,
}

impl Closed {
    pub fn spent(&self) -> Amount {
        self.spent
    }
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
        let first_call = args.first_call;
        let mut state = AccountState::new(args);
        if let Some(first) = first_call {
            // Opened and held in its admission's commit, durable already.
            state.ledger.hold_call(first.hold.reserved);
            state.first_call = Some(first);
            return Ok(state);
        }
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
        let ops = state.ledger.open_ops();
        // Appended: the owner's first act outside (a model call's
        // reservation, a delegation's admission) commits after it, and so
        // makes it durable first.
        state.append_entries(ops)?;
        // No event here: the opening figures are in the owner's JobSpawned
        // (or RunStarted), which the tree folds.
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Boxed: an idle account's task holds its handler's future, sized by
        // its largest arm (a reservation's commit); boxed, it holds a pointer.
        let handled = Box::pin(handle_message(message, state)).await;
        // I-14 after every message, in every test build.
        if let Err(breach) = state.ledger.check() {
            debug_assert!(false, "{:?}: {breach}", state.owner);
        }
        handled
    }
}

async fn handle_message(
    message: AccountMsg,
    state: &mut AccountState,
) -> Result<(), ActorProcessingErr> {
    match message {
        AccountMsg::Reserve { asks, share, reply } => {
            let _ = reply.send(state.reserve(&asks, share)?);
        }
        AccountMsg::ReserveCall {
            input_estimate,
            max_output_limit,
            price,
            billed,
            reply,
        } => {
            let planned = state
                .reserve_call(input_estimate, max_output_limit, price, billed)
                .await?;
            let _ = reply.send(planned);
        }
        AccountMsg::SettleCall {
            reserved,
            spent,
            event,
            reply,
        } => {
            state.settle_call(reserved, spent, event.map(|e| *e))?;
            let _ = reply.send(());
        }
        AccountMsg::Settle {
            child,
            spent,
            reply,
        } => {
            state.settle_child(child, spent)?;
            let _ = reply.send(());
        }
        AccountMsg::Close { reply } => {
            let _ = reply.send(state.close()?);
        }
        AccountMsg::Snapshot { reply } => {
            let _ = reply.send(state.ledger.view());
        }
        AccountMsg::Extend {
            child,
            at_least,
            among,
            reply,
        } => {
            let given = state
                .ledger
                .plan_extension(child, at_least, among)
                .and_then(|given| state.ctx.pools.extend(state.run, child, given, at_least));
            if let Some(amount) = given {
                let ops = state.ledger.extend(child, amount);
                state.append_and_publish(ops, None)?;
            }
            let _ = reply.send(given);
        }
        AccountMsg::Available { reply } => {
            let usd = state.ledger.usd.as_ref().map(Purse::available);
            let _ = reply.send((state.ledger.tokens.available(), usd));
        }
        AccountMsg::Grow {
            amount,
            with,
            reply,
        } => {
            let grown = match state.ledger.grow_ops(amount) {
                Err(why) => Err(why),
                Ok(ops) => {
                    let mut records = state.records(ops);
                    records.extend(with);
                    state.ctx.journal.commit(records).await?;
                    state.ledger.grow(amount);
                    state.publish();
                    Ok(state.ledger.view())
                }
            };
            let _ = reply.send(grown);
        }
    }
    Ok(())
}

pub struct AccountState {
    ctx: Arc<NodeContext>,
    run: RunId,
    owner: ParentRef,
    ledger: Ledger,
    wind_down_emitted: bool,
    meter: SpentMeter,
    /// The first call its parent reserved, until the loop's first asks.
    first_call: Option<FirstCall>,
}

impl AccountState {
    pub fn new(args: AccountArgs) -> Self {
        Self {
            ctx: args.ctx,
            run: args.run,
            owner: args.owner,
            ledger: Ledger::resumed(
                args.grant,
                args.grant_usd_micros,
                args.wind_down,
                args.resume_spent.unwrap_or_default(),
            ),
            wind_down_emitted: false,
            meter: args.meter,
            first_call: None,
        }
    }

    /// Appends the account's entries; the next commit of anything makes
    /// them durable (seq order is durability order).
    fn append_entries(&self, ops: Vec<Entry>) -> Result<(), ActorProcessingErr> {
        self.ctx.journal.append(self.records(ops))?;
        Ok(())
    }

    /// Commits the account's entries: back only once they are durable.
    async fn commit_entries(&self, ops: Vec<Entry>) -> Result<(), ActorProcessingErr> {
        self.ctx.journal.commit(self.records(ops)).await?;
        Ok(())
    }

    fn records(&self, ops: Vec<Entry>) -> Vec<Record> {
        entry_records(self.owner, self.ctx.journal.epoch(), ops)
    }

    /// Emits the figures after a change, and the wind-down crossing once.
    fn publish(&mut self) {
        let changed = self.changed();
        if let Err(error) = self.ctx.events.emit_with(self.run, vec![], changed) {
            tracing::error!(%error, "could not journal an event");
        }
    }

    /// Appends `ops` and, in the same append, emits `first` (the event the
    /// handler tells of, if any) and the account's new figures.
    /// `Reserve`: holds grants for children, all or none (I-08, I-09).
    fn reserve(
        &mut self,
        asks: &[GrantAsk],
        share: Share,
    ) -> Result<Result<Vec<Grant>, Refusal>, ActorProcessingErr> {
        // An agent's `budget.per_run` cuts and holds its children's grants.
        let (ctx, run, ledger) = (&self.ctx, self.run, &self.ledger);
        let holds = |agent: &str| jobs_holding(ctx, run, agent);
        let result = ctx.pools.reserve(run, asks, &ctx.agents, &holds, |asks| {
            ledger.plan_grants(asks, share)
        });
        if let Ok(grants) = &result {
            let usd = self.ledger.usd.is_some();
            let mut ops = vec![];
            for (ask, grant) in asks.iter().zip(grants) {
                let hold = |amount| LedgerOp::Hold {
                    child: ask.child,
                    amount,
                };
                ops.push((Unit::Tokens, hold(grant.tokens)));
                if let (true, Some(micros)) = (usd, grant.usd_micros) {
                    ops.push((Unit::UsdMicros, hold(micros)));
                }
                self.ledger.hold_child(ask.child, *grant);
            }
            // Appended: every caller commits its children's records after
            // this reply and before any child starts (I-29), and that commit
            // makes these holds durable first.
            self.append_and_publish(ops, None)?;
        }
        Ok(result)
    }

    /// `ReserveCall`: the worst case of one model call, durable before it
    /// is sent (I-11, I-31).
    async fn reserve_call(
        &mut self,
        input_estimate: u64,
        max_output_limit: u64,
        price: Option<Price>,
        billed: bool,
    ) -> Result<Result<CallHold, Refusal>, ActorProcessingErr> {
        // The first call its parent reserved: planned again from the same
        // figures, it is used if it is the same call.
        let first = self.first_call.take();
        if let Some(first) = first {
            self.ledger.settle_call(first.hold.reserved, Amount::ZERO);
        }
        let result = self
            .ledger
            .plan_call(input_estimate, max_output_limit, price);
        if let Some(first) = first {
            if result.as_ref().ok() == Some(&first.hold) && billed == first.billed {
                // Durable since the admission (I-11, I-31).
                self.ledger.hold_call(first.hold.reserved);
                self.publish();
                return Ok(result);
            }
            // Another call than planned: the parent's hold is released,
            // durable with the reservation that follows or with the owner's
            // next commit.
            let ops = self
                .ledger
                .ops_pair(first.hold.reserved, Amount::ZERO, |reserved, spent| {
                    LedgerOp::CallSettle { reserved, spent }
                });
            self.append_entries(ops)?;
        }
        if let Ok(hold) = &result {
            let reserved = hold.reserved;
            let ops = self.ledger.reserve_ops(reserved, billed);
            // Durable before the request goes out: a crash after it must
            // find the call reserved (I-11, I-31).
            self.commit_entries(ops).await?;
            self.ledger.hold_call(reserved);
            self.publish();
        }
        Ok(result)
    }

    /// `SettleCall`: the call came back; its hold released, its use charged.
    fn settle_call(
        &mut self,
        reserved: Amount,
        spent: Amount,
        event: Option<EventKind>,
    ) -> Result<(), ActorProcessingErr> {
        if self.ledger.closed {
            // The close released this call's hold uncharged (its loop was
            // stopped mid-call); settling it again would refund it twice and
            // charge a closed account.
            tracing::warn!(owner = ?self.owner, "a model call settled after its account closed; its hold was already released");
            return Ok(());
        }
        self.ledger.settle_call(reserved, spent);
        let ops = self
            .ledger
            .ops_pair(reserved, spent, |reserved, spent| LedgerOp::CallSettle {
                reserved,
                spent,
            });
        // Appended: the job's next commit (its next call's reservation, a
        // delegation's admission, its settlement) makes it durable before
        // anything acts on it. A crash before that finds the call still
        // reserved, which recovery charges in full if it was billed (never
        // less than it cost, I-31).
        self.append_and_publish(ops, event)
    }

    /// `Settle`: a child is done; its spend charged, the rest freed (I-10).
    fn settle_child(&mut self, child: JobId, spent: Amount) -> Result<(), ActorProcessingErr> {
        let Some(granted) = self.ledger.settle_child(child, spent) else {
            return Ok(());
        };
        self.ctx.pools.settle(self.run, child, spent);
        let ops = self
            .ledger
            .ops_pair(granted, spent, |granted, spent| LedgerOp::Release {
                child,
                granted,
                spent,
            });
        // Appended: the caller commits the child's terminal record next,
        // which makes this durable with it.
        self.append_and_publish(ops, None)
    }

    /// `Close`: the final figures; no more reservations.
    fn close(&mut self) -> Result<Closed, ActorProcessingErr> {
        // A call whose loop was stopped mid-flight never reported usage: its
        // hold is released uncharged, so a closed account holds nothing.
        let outstanding = self.ledger.held_calls();
        if outstanding != Amount::ZERO {
            self.ledger.settle_call(outstanding, Amount::ZERO);
            let ops = self
                .ledger
                .ops_pair(outstanding, Amount::ZERO, |reserved, spent| {
                    LedgerOp::CallSettle { reserved, spent }
                });
            self.append_and_publish(ops, None)?;
        }
        self.ledger.closed = true;
        let ops = self
            .ledger
            .ops(self.ledger.spent_amount(), |spent| LedgerOp::Close {
                spent,
            });
        // Appended: the owner's parent commits the owner's terminal record
        // (the run its own) once it hears of this, and that commit makes it
        // durable first.
        self.append_entries(ops)?;
        Ok(self.ledger.closed_view())
    }

    fn append_and_publish(
        &mut self,
        ops: Vec<Entry>,
        first: Option<EventKind>,
    ) -> Result<(), ActorProcessingErr> {
        let changed = self.changed();
        let records = self.records(ops);
        self.ctx
            .events
            .emit_with(self.run, records, first.into_iter().chain(changed))?;
        Ok(())
    }

    /// The events that tell of the figures as they are now: `AccountChanged`,
    /// and `WindDown` the first time spend is past the wind-down share (I-12).
    fn changed(&mut self) -> Vec<EventKind> {
        self.meter.set(self.ledger.spent_amount());
        let view = self.ledger.view();
        let mut events = vec![EventKind::AccountChanged {
            owner: self.owner,
            grant: view.grant,
            spent: view.spent,
            held: view.held,
            usd: self.ledger.usd_view(),
        }];
        if !self.wind_down_emitted && self.ledger.past_wind_down() {
            self.wind_down_emitted = true;
            events.push(EventKind::WindDown {
                owner: self.owner,
                spent: view.spent,
                grant: view.grant,
            });
        }
        events
    }
}

/// `owner`'s ledger entries as journal records.
fn entry_records(owner: ParentRef, epoch: u64, ops: Vec<Entry>) -> Vec<Record> {
    ops.into_iter()
        .map(|(unit, op)| {
            Record::Ledger(LedgerRecord {
                owner,
                unit,
                op,
                epoch,
            })
        })
        .collect()
}

/// The account's arithmetic, pure so that every rule is unit-tested without
/// actors. Two units, one rule book: tokens always, micro-dollars when the
/// account has a usd grant.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    pub grant: u64,
    tokens: Purse,
    usd: Option<Purse>,
    /// Micro-dollars spent by an account without a usd ceiling: metered for
    /// its envelope, not held or journaled (there is no ceiling to keep).
    usd_metered: u64,
    closed: bool,
}

/// One unit's figures.
#[derive(Clone, Debug, Default)]
struct Purse {
    grant: u64,
    own_spent: u64,
    children_spent: u64,
    held_children: BTreeMap<JobId, u64>,
    held_calls: u64,
    wind_down_at: u64,
    /// What was charged past its hold: a provider that reported more than
    /// its call reserved, or a child that spent more than its grant (each
    /// an `BudgetOverrun` event). The one way spent and held pass the grant.
    overrun: u64,
}

impl Purse {
    fn new(grant: u64, wind_down: f64) -> Self {
        Self {
            grant,
            wind_down_at: ((grant as f64) * wind_down).ceil() as u64,
            ..Self::default()
        }
    }

    fn grow(&mut self, amount: u64) {
        if amount == 0 {
            return;
        }
        let share = self.wind_down_at as f64 / self.grant.max(1) as f64;
        self.grant = self.grant.saturating_add(amount);
        self.wind_down_at = ((self.grant as f64) * share).ceil() as u64;
    }
    fn spent(&self) -> u64 {
        self.own_spent + self.children_spent
    }
    fn held(&self) -> u64 {
        self.held_children.values().sum::<u64>() + self.held_calls
    }
    /// Saturates: a provider that reports more than was reserved is charged
    /// the truth, and then nothing more is available.
    fn available(&self) -> u64 {
        self.grant.saturating_sub(self.spent() + self.held())
    }
    fn view(&self) -> AccountView {
        AccountView {
            grant: self.grant,
            spent: self.spent(),
            held: self.held(),
        }
    }
    /// I-14: spent and held within the grant, but for what was overrun.
    fn check(&self, unit: &str) -> Result<(), String> {
        if self.spent() + self.held() > self.grant + self.overrun {
            return Err(format!(
                "{unit}: spent {} + held {} exceed grant {} (+ overrun {})",
                self.spent(),
                self.held(),
                self.grant,
                self.overrun
            ));
        }
        Ok(())
    }
    /// Releases a call's hold and charges what it cost: never more hold
    /// than is held (a second settlement of one call would be caught here).
    fn settle_call(&mut self, reserved: u64, spent: u64) {
        debug_assert!(
            reserved <= self.held_calls,
            "a call settles {reserved} but {} is held for calls",
            self.held_calls
        );
        self.held_calls = self.held_calls.saturating_sub(reserved);
        self.own_spent += spent;
        self.overrun += spent.saturating_sub(reserved);
    }
    /// I-08, I-09 in one unit: the grants, or why none (in this unit's words).
    fn plan(
        &self,
        asks: &[(Option<u64>, Option<u64>)],
        share: Share,
        unit: &str,
        agents: &[&str],
    ) -> Result<Vec<u64>, Refusal> {
        let refuse = |message: String| Err(Refusal::Budget { message });
        let available = self.available();
        for ((asked, max), agent) in asks.iter().zip(agents) {
            if let (Some(asked), Some(max)) = (asked, max)
                && asked > max
            {
                return refuse(format!(
                    "a job of {agent} asks {asked} {unit}, more than the {max} its agent may be granted"
                ));
            }
        }
        let cap = match share {
            Share::Fraction(f) => (((available as f64) * f).floor() as u64).min(available),
            Share::Even { .. } => available,
        };
        let asked_total: u64 = asks.iter().filter_map(|a| a.0).sum();
        if asked_total > cap {
            return refuse(match share {
                Share::Fraction(f) => format!(
                    "the jobs ask {asked_total} {unit} together; one delegate call may grant at most {cap} ({f} of the {available} available)"
                ),
                Share::Even { .. } => {
                    format!("the steps ask {asked_total} {unit}; {available} are available")
                }
            });
        }
        let unasked = asks.iter().filter(|a| a.0.is_none()).count() as u64;
        let held_back = match share {
            Share::Even { held_back } => held_back as u64,
            Share::Fraction(_) => 0,
        };
        let each = (cap - asked_total)
            .checked_div(unasked + held_back)
            .unwrap_or(0);
        let mut grants = Vec::with_capacity(asks.len());
        for ((asked, max), agent) in asks.iter().zip(agents) {
            let grant = match asked {
                Some(asked) => *asked,
                None => each.min(max.unwrap_or(u64::MAX)),
            };
            if grant == 0 {
                return refuse(format!(
                    "a job of {agent} would be granted 0 {unit} ({} left of the cap {cap} for {unasked} jobs without a budget); 0 never means unlimited",
                    cap - asked_total
                ));
            }
            grants.push(grant);
        }
        debug_assert!(grants.iter().sum::<u64>() <= available);
        Ok(grants)
    }
}

impl Ledger {
    /// An account reopened after a restart: what it spent before is settled
    /// spend of its (ended) children; nothing is held.
    pub fn resumed(
        grant: u64,
        grant_usd_micros: Option<u64>,
        wind_down: f64,
        spent: Amount,
    ) -> Self {
        let mut ledger = Self::with_usd(grant, grant_usd_micros, wind_down);
        ledger.tokens.children_spent = spent.tokens;
        ledger.tokens.overrun = spent.tokens.saturating_sub(grant);
        match &mut ledger.usd {
            Some(usd) => {
                usd.children_spent = spent.usd_micros;
                usd.overrun = spent.usd_micros.saturating_sub(usd.grant);
            }
            None => ledger.usd_metered = spent.usd_micros,
        }
        ledger
    }

    pub fn new(grant: u64, wind_down: f64) -> Self {
        Self::with_usd(grant, None, wind_down)
    }

    pub fn with_usd(grant: u64, grant_usd_micros: Option<u64>, wind_down: f64) -> Self {
        Self {
            grant,
            tokens: Purse::new(grant, wind_down),
            usd: grant_usd_micros.map(|g| Purse::new(g, wind_down)),
            usd_metered: 0,
            closed: false,
        }
    }

    pub fn grant_usd_micros(&self) -> Option<u64> {
        self.usd.as_ref().map(|u| u.grant)
    }

    pub fn spent(&self) -> u64 {
        self.tokens.spent()
    }

    pub fn held(&self) -> u64 {
        self.tokens.held()
    }

    /// Tokens: grant - spent - held.
    pub fn available(&self) -> u64 {
        self.tokens.available()
    }

    pub fn spent_amount(&self) -> Amount {
        Amount {
            tokens: self.tokens.spent(),
            usd_micros: self.usd.as_ref().map_or(self.usd_metered, Purse::spent),
        }
    }

    fn held_calls(&self) -> Amount {
        Amount {
            tokens: self.tokens.held_calls,
            usd_micros: self.usd.as_ref().map_or(0, |u| u.held_calls),
        }
    }

    pub fn view(&self) -> AccountView {
        self.tokens.view()
    }

    pub fn usd_view(&self) -> Option<AccountView> {
        self.usd.as_ref().map(Purse::view)
    }

    fn closed_view(&self) -> Closed {
        Closed {
            tokens: self.view(),
            usd: self.usd_view(),
            spent: self.spent_amount(),
        }
    }

    /// I-12: spend crossed the wind-down share of either grant.
    pub fn past_wind_down(&self) -> bool {
        let crossed = |p: &Purse| p.spent() >= p.wind_down_at && p.spent() > 0;
        crossed(&self.tokens) || self.usd.as_ref().is_some_and(crossed)
    }

    /// The ledger entries of one change, in both units where the account has them.
    fn ops(&self, amount: Amount, op: impl Fn(u64) -> LedgerOp) -> Vec<Entry> {
        let mut ops = vec![(Unit::Tokens, op(amount.tokens))];
        if self.usd.is_some() {
            ops.push((Unit::UsdMicros, op(amount.usd_micros)));
        }
        ops
    }

    /// The entries that raise its grant by `amount` (I-58), or why it cannot be.
    pub fn grow_ops(&self, amount: Amount) -> Result<Vec<Entry>, String> {
        if self.closed {
            return Err("its account is closed: the run has ended".into());
        }
        if amount.tokens == 0 && amount.usd_micros == 0 {
            return Err("a top-up adds at least 1 token or 1 micro-dollar".into());
        }
        if amount.usd_micros > 0 && self.usd.is_none() {
            return Err("the run has no usd ceiling to raise".into());
        }
        let mut ops = vec![];
        if amount.tokens > 0 {
            ops.push((
                Unit::Tokens,
                LedgerOp::Grow {
                    amount: amount.tokens,
                },
            ));
        }
        if amount.usd_micros > 0 {
            ops.push((
                Unit::UsdMicros,
                LedgerOp::Grow {
                    amount: amount.usd_micros,
                },
            ));
        }
        Ok(ops)
    }

    /// What `AccountMsg::Extend` gives `child`: per unit, `at_least`, or a
    /// 1/`among` share of what is available if that is more. None if
    /// `child` is not held, what is available is short of `at_least`, or
    /// there is nothing to give.
    pub fn plan_extension(&self, child: JobId, at_least: Amount, among: u64) -> Option<Amount> {
        let among = among.max(1);
        let share = |purse: &Purse, least: u64| {
            let available = purse.available();
            (available >= least).then(|| least.max(available / among))
        };
        if !self.tokens.held_children.contains_key(&child) {
            return None;
        }
        let tokens = share(&self.tokens, at_least.tokens)?;
        let usd_micros = match &self.usd {
            Some(purse) if purse.held_children.contains_key(&child) => {
                share(purse, at_least.usd_micros)?
            }
            Some(_) if at_least.usd_micros > 0 => return None,
            _ => 0,
        };
        let given = Amount { tokens, usd_micros };
        (given != Amount::ZERO).then_some(given)
    }

    /// Holds `amount` more for `child` (`plan_extension` gave it): the
    /// entries that say so.
    pub fn extend(&mut self, child: JobId, amount: Amount) -> Vec<Entry> {
        let mut ops = vec![];
        if amount.tokens > 0 {
            *self.tokens.held_children.entry(child).or_default() += amount.tokens;
            let extend = LedgerOp::Extend {
                child,
                amount: amount.tokens,
            };
            ops.push((Unit::Tokens, extend));
        }
        if let Some(purse) = &mut self.usd
            && amount.usd_micros > 0
        {
            *purse.held_children.entry(child).or_default() += amount.usd_micros;
            let extend = LedgerOp::Extend {
                child,
                amount: amount.usd_micros,
            };
            ops.push((Unit::UsdMicros, extend));
        }
        ops
    }

    /// Raises its grant by `amount` (`grow_ops` said it may): what is
    /// available grows by as much, and the wind-down mark keeps its share.
    pub fn grow(&mut self, amount: Amount) {
        self.grant = self.grant.saturating_add(amount.tokens);
        self.tokens.grow(amount.tokens);
        if let Some(usd) = &mut self.usd {
            usd.grow(amount.usd_micros);
        }
    }

    /// The entries that open the account: its grant in each unit.
    fn open_ops(&self) -> Vec<Entry> {
        let mut ops = vec![(Unit::Tokens, LedgerOp::Open { grant: self.grant })];
        if let Some(grant) = self.grant_usd_micros() {
            ops.push((Unit::UsdMicros, LedgerOp::Open { grant }));
        }
        ops
    }

    /// The entries that reserve a model call's worst case.
    fn reserve_ops(&self, reserved: Amount, billed: bool) -> Vec<Entry> {
        self.ops(reserved, |amount| {
            if billed {
                LedgerOp::BilledCallReserve { amount }
            } else {
                LedgerOp::CallReserve { amount }
            }
        })
    }

    fn ops_pair(&self, a: Amount, b: Amount, op: impl Fn(u64, u64) -> LedgerOp) -> Vec<Entry> {
        let mut ops = vec![(Unit::Tokens, op(a.tokens, b.tokens))];
        if self.usd.is_some() {
            ops.push((Unit::UsdMicros, op(a.usd_micros, b.usd_micros)));
        }
        ops
    }

    /// I-07, I-08, I-09: the grants for `asks`, measured against what is
    /// available now, or why none can be made, in both units. Pure.
    pub fn plan_grants(&self, asks: &[GrantAsk], share: Share) -> Result<Vec<Grant>, Refusal> {
        if self.closed {
            return Err(Refusal::Budget {
                message: "the account is closed; nothing new can be granted".into(),
            });
        }
        if asks.is_empty() {
            return Ok(vec![]);
        }
        let agents: Vec<&str> = asks.iter().map(|a| a.agent.as_str()).collect();
        let token_asks: Vec<_> = asks.iter().map(|a| (a.asked, a.agent_max)).collect();
        let tokens = self.tokens.plan(&token_asks, share, "tokens", &agents)?;
        let usd: Vec<Option<u64>> = match &self.usd {
            Some(purse) => {
                let usd_asks: Vec<_> = asks
                    .iter()
                    .map(|a| (a.asked_usd_micros, a.agent_max_usd_micros))
                    .collect();
                purse
                    .plan(&usd_asks, share, "micro-dollars", &agents)?
                    .into_iter()
                    .map(Some)
                    .collect()
            }
            // No usd ceiling here: a child has one only if it is asked for
            // or its agent sets one; nothing is held for it in this unit.
            None => asks
                .iter()
                .map(|a| a.asked_usd_micros.or(a.agent_max_usd_micros))
                .collect(),
        };
        Ok(tokens
            .into_iter()
            .zip(usd)
            .map(|(tokens, usd_micros)| Grant { tokens, usd_micros })
            .collect())
    }

    fn hold_child(&mut self, child: JobId, grant: Grant) {
        self.tokens.held_children.insert(child, grant.tokens);
        if let (Some(purse), Some(micros)) = (&mut self.usd, grant.usd_micros) {
            purse.held_children.insert(child, micros);
        }
    }

    fn hold_call(&mut self, reserved: Amount) {
        self.tokens.held_calls += reserved.tokens;
        if let Some(purse) = &mut self.usd {
            purse.held_calls += reserved.usd_micros;
        }
    }

    /// I-11: the worst case of the next model call, or `budget_exhausted`.
    /// Under a usd ceiling the output is cut further, to what the price lets
    /// the remaining micro-dollars cover.
    pub fn plan_call(
        &self,
        input_estimate: u64,
        max_output_limit: u64,
        price: Option<Price>,
    ) -> Result<CallHold, Refusal> {
        let exhausted = |message: String| Err(Refusal::Budget { message });
        let available = self.available();
        if self.closed || available <= input_estimate {
            return exhausted(format!(
                "budget exhausted: the next model call needs more than {input_estimate} tokens and {available} are available"
            ));
        }
        let mut max_output = max_output_limit.min(available - input_estimate);
        if let Some(purse) = &self.usd {
            let Some(price) = price else {
                return exhausted(
                    "this model has no price, and the account has a usd ceiling it could not keep"
                        .into(),
                );
            };
            let available_usd = purse.available();
            let input_cost = price.micros(input_estimate, 0);
            if input_cost >= available_usd {
                return exhausted(format!(
                    "budget exhausted: the next model call's prompt may cost {input_cost} micro-dollars and {available_usd} are available"
                ));
            }
            max_output = max_output.min(price.max_output_within(input_estimate, available_usd));
            if max_output == 0 {
                return exhausted(format!(
                    "budget exhausted: {available_usd} micro-dollars cannot pay for one output token"
                ));
            }
        }
        Ok(CallHold {
            reserved: Amount {
                tokens: input_estimate + max_output,
                usd_micros: price.map_or(0, |p| p.micros(input_estimate, max_output)),
            },
            max_output,
            wind_down: self.past_wind_down(),
        })
    }

    pub fn settle_call(&mut self, reserved: Amount, spent: Amount) {
        self.tokens.settle_call(reserved.tokens, spent.tokens);
        match &mut self.usd {
            Some(purse) => purse.settle_call(reserved.usd_micros, spent.usd_micros),
            None => self.usd_metered += spent.usd_micros,
        }
    }

    /// I-14 in each unit (`Purse::check`).
    pub fn check(&self) -> Result<(), String> {
        self.tokens.check("tokens")?;
        match &self.usd {
            Some(purse) => purse.check("micro-dollars"),
            None => Ok(()),
        }
    }

    /// Returns the grant that was held for `child`, or None if it was not held
    /// (settled already: a second settle must not charge twice).
    pub fn settle_child(&mut self, child: JobId, spent: Amount) -> Option<Amount> {
        let tokens = self.tokens.held_children.remove(&child)?;
        self.tokens.children_spent += spent.tokens;
        self.tokens.overrun += spent.tokens.saturating_sub(tokens);
        let mut usd_micros = 0;
        match &mut self.usd {
            Some(purse) => {
                usd_micros = purse.held_children.remove(&child).unwrap_or(0);
                purse.children_spent += spent.usd_micros;
                purse.overrun += spent.usd_micros.saturating_sub(usd_micros);
            }
            None => self.usd_metered += spent.usd_micros,
        }
        Some(Amount { tokens, usd_micros })
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
            asked_usd_micros: None,
            agent_max_usd_micros: None,
        }
    }

    /// One rule per row: (grant, already spent, asks, share) -> grants or the refusal's words.
    fn check(case: (u64, u64, Vec<GrantAsk>, Share), expected: Result<Vec<u64>, &str>) {
        let (grant, spent, asks, share) = case;
        let mut ledger = Ledger::new(grant, 0.8);
        ledger.settle_call(Amount::ZERO, tokens(spent));
        match (ledger.plan_grants(&asks, share), expected) {
            (Ok(got), Ok(want)) => {
                assert_eq!(got.iter().map(|g| g.tokens).collect::<Vec<_>>(), want);
                assert!(got.iter().all(|g| g.usd_micros.is_none()));
            }
            (Err(got), Err(words)) => assert!(got.to_string().contains(words), "{got}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    fn tokens(n: u64) -> Amount {
        Amount {
            tokens: n,
            usd_micros: 0,
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
                Share::Even { held_back: 0 },
            ),
            Ok(vec![333, 333, 333]),
        );
    }

    /// Steps that start later (a retry's wait, a person's) keep their even
    /// share in the account: those starting now take theirs only.
    #[test]
    fn steps_held_back_keep_their_even_share() {
        check(
            (
                900,
                0,
                vec![ask(None, None), ask(None, None)],
                Share::Even { held_back: 1 },
            ),
            Ok(vec![300, 300]),
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
            (
                100,
                100,
                vec![ask(None, None)],
                Share::Even { held_back: 0 },
            ),
            Err("would be granted 0 tokens"),
        );
    }

    #[test]
    fn inv_11_a_call_reserves_its_worst_case_or_is_refused() {
        let mut ledger = Ledger::new(1000, 0.8);
        let hold = ledger.plan_call(300, 4096, None).unwrap();
        assert_eq!(
            (hold.reserved.tokens, hold.max_output),
            (1000, 700),
            "output cut to what is left"
        );
        ledger.hold_call(hold.reserved);
        assert!(
            ledger.plan_call(1, 10, None).is_err(),
            "nothing left while the call is out"
        );
        ledger.settle_call(hold.reserved, tokens(400));
        assert_eq!(
            ledger.view(),
            arbor_protocol::AccountView {
                grant: 1000,
                spent: 400,
                held: 0
            }
        );
        assert!(
            ledger.plan_call(600, 10, None).is_err(),
            "a prompt that cannot fit is budget_exhausted"
        );
    }

    #[test]
    fn inv_10_settling_charges_spent_once_and_frees_the_rest() {
        let mut ledger = Ledger::new(1000, 0.8);
        let child = JobId::new();
        ledger.hold_child(
            child,
            Grant {
                tokens: 400,
                usd_micros: None,
            },
        );
        assert_eq!(ledger.available(), 600);
        assert_eq!(ledger.settle_child(child, tokens(150)), Some(tokens(400)));
        assert_eq!(
            (ledger.spent(), ledger.held(), ledger.available()),
            (150, 0, 850)
        );
        assert_eq!(
            ledger.settle_child(child, tokens(150)),
            None,
            "a second settle charges nothing"
        );
        assert_eq!(ledger.spent(), 150);
    }

    /// I-14 checked as it runs: an overrun is the one way past the grant,
    /// and a call settled twice is caught, never saturated away.
    #[test]
    fn inv_14_the_ledger_check_allows_an_overrun_and_catches_a_double_settlement() {
        let mut ledger = Ledger::new(100, 0.8);
        ledger.hold_call(tokens(90));
        assert_eq!(ledger.check(), Ok(()));
        ledger.settle_call(tokens(90), tokens(130));
        assert_eq!(ledger.check(), Ok(()), "a reported overrun is charged");
        ledger.tokens.own_spent += 11;
        assert!(ledger.check().is_err(), "spent past grant and overrun");
        let twice = std::panic::catch_unwind(move || {
            let mut ledger = Ledger::new(100, 0.8);
            ledger.hold_call(tokens(40));
            ledger.settle_call(tokens(40), tokens(10));
            ledger.settle_call(tokens(40), tokens(10));
        });
        assert!(twice.is_err(), "a second settlement of one call is caught");
    }
}

#[cfg(test)]
mod usd_tests {
    use super::*;

    /// $0.15 and $0.60 per million tokens: 0.15 and 0.6 micro-dollars a token.
    const PRICE: Price = Price {
        input_picos_per_token: 150_000,
        output_picos_per_token: 600_000,
    };

    fn ask(asked_usd_micros: Option<u64>, agent_max_usd_micros: Option<u64>) -> GrantAsk {
        GrantAsk {
            child: JobId::new(),
            agent: "a".into(),
            asked: None,
            agent_max: None,
            asked_usd_micros,
            agent_max_usd_micros,
        }
    }

    #[test]
    fn inv_08_micro_dollars_follow_the_same_fraction_rule_as_tokens() {
        let ledger = Ledger::with_usd(1_000_000, Some(500_000), 0.8);
        let half = Share::Fraction(0.5);
        let grants = ledger
            .plan_grants(&[ask(None, None), ask(Some(50_000), None)], half)
            .unwrap();
        assert_eq!(grants[0].usd_micros, Some(200_000));
        assert_eq!(grants[1].usd_micros, Some(50_000));
        let refused = ledger
            .plan_grants(&[ask(Some(250_001), None)], half)
            .unwrap_err();
        assert!(refused.to_string().contains("at most 250000"), "{refused}");
        let refused = ledger
            .plan_grants(&[ask(Some(10), Some(5))], half)
            .unwrap_err();
        assert!(refused.to_string().contains("more than the 5"), "{refused}");
        // Without a usd ceiling, a child has one only if asked or its agent says.
        let plain = Ledger::new(1000, 0.8);
        let grants = plain
            .plan_grants(&[ask(None, None), ask(None, Some(7))], half)
            .unwrap();
        assert_eq!(
            (grants[0].usd_micros, grants[1].usd_micros),
            (None, Some(7))
        );
    }

    #[test]
    fn inv_11_under_a_usd_ceiling_a_call_reserves_its_worst_cost_and_output_is_cut_to_it() {
        // 1,000 micro-dollars; a prompt of 2,000 tokens costs 300 of them.
        let mut ledger = Ledger::with_usd(1_000_000, Some(1_000), 0.8);
        let hold = ledger.plan_call(2_000, 4_096, Some(PRICE)).unwrap();
        // (1,000 - 300) / 0.6 = 1,166 output tokens.
        assert_eq!(hold.max_output, 1_166);
        assert_eq!(hold.reserved.usd_micros, PRICE.micros(2_000, 1_166));
        assert!(hold.reserved.usd_micros <= 1_000);
        ledger.hold_call(Amount {
            tokens: hold.reserved.tokens,
            usd_micros: hold.reserved.usd_micros,
        });
        ledger.settle_call(
            Amount {
                tokens: hold.reserved.tokens,
                usd_micros: hold.reserved.usd_micros,
            },
            Amount {
                tokens: 2_500,
                usd_micros: PRICE.micros(2_000, 500),
            },
        );
        assert_eq!(ledger.usd_view().unwrap().spent, 600);
        assert_eq!(ledger.usd_view().unwrap().held, 0);
        let refused = ledger.plan_call(3_000, 10, Some(PRICE)).unwrap_err();
        assert!(refused.to_string().contains("micro-dollars"), "{refused}");
        assert!(
            ledger.plan_call(10, 10, None).is_err(),
            "an unpriced model under a usd ceiling"
        );
        assert!(
            Ledger::new(1000, 0.8).plan_call(10, 10, None).is_ok(),
            "without a ceiling, no price is needed"
        );
    }

    #[test]
    fn without_a_ceiling_micro_dollars_are_metered_for_the_envelope() {
        let mut ledger = Ledger::new(1000, 0.8);
        let cost = |usd_micros| Amount {
            tokens: 10,
            usd_micros,
        };
        ledger.settle_call(Amount::ZERO, cost(7));
        let child = JobId::new();
        ledger.hold_child(
            child,
            Grant {
                tokens: 100,
                usd_micros: None,
            },
        );
        ledger.settle_child(child, cost(5));
        assert_eq!(
            ledger.spent_amount(),
            Amount {
                tokens: 20,
                usd_micros: 12
            }
        );
        assert_eq!(ledger.usd_view(), None, "nothing held or shown: no ceiling");
    }

    #[test]
    fn wind_down_crosses_on_either_unit() {
        let mut ledger = Ledger::with_usd(1_000_000, Some(100), 0.8);
        assert!(!ledger.past_wind_down());
        ledger.settle_call(
            Amount::ZERO,
            Amount {
                tokens: 10,
                usd_micros: 80,
            },
        );
        assert!(ledger.past_wind_down());
    }
}
