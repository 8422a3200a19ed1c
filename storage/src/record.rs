//! The record types: everything the journal stores, as plain serde data.
//!
//! Owns the shape of each record and the ledger arithmetic (`ledger_totals`).
//! Where a record lives and how its bytes look is `codec`'s business.
//!
//! Invariants:
//! 1. Runs, jobs, delegations, steering messages and sandboxes are *states*: writing one
//!    again under the same key replaces it, so the journal holds the latest.
//! 2. Ledger entries and events are *history*: each write adds one, nothing
//!    rewrites them, and replaying them in key order gives back the account
//!    or the run tree.
//! 3. Every record but an event carries the boot `epoch` that wrote it, so
//!    recovery can tell what the previous life of the node left behind
//!    (I-30), and the journal refuses a write stamped with another boot's
//!    epoch (I-41).
//! 4. Sandbox records are states too: one per process group, `Live` until
//!    the group is known to have ended.

use arbor_protocol::{
    Card, CardId, CardState, Decision, ErrorClass, JobId, NodeKind, ParentRef, RunId, Status,
    TaskStatus,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The latest state of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: RunId,
    pub flow: String,
    pub budget_tokens: u64,
    pub status: Status,
    pub error_class: Option<ErrorClass>,
    pub reason: Option<String>,
    pub output_json: String,
    pub epoch: u64,
}

/// The latest state of one step or job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub run: RunId,
    pub parent: ParentRef,
    pub kind: NodeKind,
    pub agent: String,
    pub label: Option<String>,
    pub depth: u32,
    pub attempt: u32,
    pub grant_tokens: u64,
    pub workdir: String,
    pub status: Status,
    pub task_status: Option<TaskStatus>,
    pub error_class: Option<ErrorClass>,
    pub reason: Option<String>,
    pub output_json: String,
    pub tokens_spent: u64,
    pub epoch: u64,
}

/// One change to an account, in one unit. Keyed by owner and journal seq, so
/// an owner's entries come back in the order they were written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LedgerRecord {
    pub owner: ParentRef,
    pub unit: Unit,
    pub op: LedgerOp,
    pub epoch: u64,
}

/// What a ledger counts. Every account has a ledger of tokens; one opened
/// with a usd ceiling has a second, of micro-dollars, and every change to it
/// is written in the same batch as its tokens' change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Unit {
    Tokens,
    UsdMicros,
}

impl Unit {
    /// Both, in the order an account writes them.
    pub const BOTH: [Unit; 2] = [Unit::Tokens, Unit::UsdMicros];
}

/// Every amount is in the record's `unit`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LedgerOp {
    /// The account was opened with this grant.
    Open { grant: u64 },
    /// A child's grant held.
    Hold { child: JobId, amount: u64 },
    /// The child settled: `spent` charged, the rest of `granted` returned.
    Release {
        child: JobId,
        granted: u64,
        spent: u64,
    },
    /// A model call's worst case held.
    CallReserve { amount: u64 },
    /// A model call's worst case held, for a request to a provider that
    /// bills what it receives: if a crash leaves it open, recovery charges it
    /// in full (its usage is unknown, and may have been billed). Folds like
    /// `CallReserve`.
    BilledCallReserve { amount: u64 },
    /// The call's real usage charged; its reservation released.
    CallSettle { reserved: u64, spent: u64 },
    /// The account closed with this final spent.
    Close { spent: u64 },
    /// The account's grant grew by this: a run's ceiling topped up (I-58),
    /// or a paused step's grant extended from it.
    Grow { amount: u64 },
    /// A held child's grant extended by this, from what the account has
    /// available: a step that paused at the run's ceiling goes on with its
    /// share of a top-up (I-58). Folds into the child's hold.
    Extend { child: JobId, amount: u64 },
}

/// One account's entries of `unit`, in order.
pub fn ledger_of(entries: &[LedgerRecord], unit: Unit) -> Vec<LedgerRecord> {
    entries.iter().filter(|e| e.unit == unit).cloned().collect()
}

/// The micro-dollar totals of an account, if it has that ledger.
pub fn usd_totals(entries: &[LedgerRecord]) -> Option<LedgerTotals> {
    entries
        .iter()
        .any(|e| e.unit == Unit::UsdMicros && matches!(e.op, LedgerOp::Open { .. }))
        .then(|| ledger_totals(entries, Unit::UsdMicros))
}

/// A delegate call's outcome, so that a repeated call (same `key`, same
/// `digest`) after a restart finds its children instead of spawning twice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DelegationRecord {
    pub parent: JobId,
    pub key: String,
    pub digest: String,
    pub children: Vec<JobId>,
    pub epoch: u64,
}

/// A message for a running job (I-20), and how far it got.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SteerRecord {
    pub job: JobId,
    pub message_id: u64,
    pub text: String,
    pub state: SteerState,
    pub epoch: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SteerState {
    Queued,
    Delivered,
    Discarded,
}

/// One process group a job's sandbox started, so that recovery can kill what
/// the previous boot left running (I-30). A pgid alone is never enough to
/// kill: pids are reused, so recovery kills a group only if its leader still
/// has this start time in this boot (`same_process`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub run: RunId,
    pub job: JobId,
    /// The process group id, which is also its leader's pid.
    pub pgid: i32,
    /// The leader's start time: field 22 of `/proc/<pid>/stat`, in clock
    /// ticks since boot.
    pub start_ticks: u64,
    /// `/proc/sys/kernel/random/boot_id` when the group started, so that no
    /// process of a later boot ever matches.
    pub boot_id: String,
    pub state: SandboxState,
    pub epoch: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SandboxState {
    /// Started and not known to have ended: recovery must kill it.
    Live,
    /// Killed or exited; nothing left to do.
    Ended,
}

/// One entry of a run's recording (`arbor_protocol::tape::TapeEntry`),
/// written once: under its job, its kind and its number within the job. The
/// entry is JSON text: bincode cannot carry an untyped value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TapeRecord {
    pub run: RunId,
    pub job: JobId,
    /// The job's labels and attempts from the root (`plan#1/worker-2#1`).
    pub lineage: String,
    pub kind: u8,
    pub index: u32,
    pub entry_json: String,
    pub epoch: u64,
}

/// An approval card's latest state (I-46, I-47): written when it is asked,
/// and again at its one outcome, each time durable before anyone acts on it.
/// The arguments are JSON text: bincode cannot carry an untyped value.
/// A card's kind is its tool's (`CardKind::of_tool`), and a question's
/// answer is kept as its `reason`, so records written before questions
/// existed read as they were.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApprovalRecord {
    pub id: CardId,
    pub run: RunId,
    pub job: JobId,
    pub lineage: Vec<String>,
    pub agent: String,
    pub tool: String,
    pub call: String,
    pub args_json: String,
    pub state: CardState,
    pub asked_at_ms: u64,
    pub deadline_ms: u64,
    pub decided_by: Option<String>,
    pub reason: Option<String>,
    pub decided_at_ms: Option<u64>,
    pub edited: bool,
    pub epoch: u64,
}

impl ApprovalRecord {
    pub fn of(card: &Card, epoch: u64) -> Self {
        let decision = card.decision.as_ref();
        Self {
            id: card.id,
            run: card.run,
            job: card.job,
            lineage: card.lineage.clone(),
            agent: card.agent.clone(),
            tool: card.tool.clone(),
            call: card.call.clone(),
            // A `ran` card keeps what it ran and how to undo it beside its
            // arguments, in the same field: the record's layout is unchanged.
            args_json: if card.state == CardState::Ran {
                serde_json::json!({"args": card.args, "result": card.result, "undo": card.undo})
                    .to_string()
            } else {
                card.args.to_string()
            },
            state: card.state,
            asked_at_ms: card.asked_at_ms,
            deadline_ms: card.deadline_ms,
            decided_by: decision.map(|d| d.by.clone()),
            reason: decision.and_then(|d| d.answer.clone().or_else(|| d.reason.clone())),
            decided_at_ms: decision.map(|d| d.at_ms),
            edited: decision.is_some_and(|d| d.edited),
            epoch,
        }
    }

    pub fn card(&self) -> Card {
        let answered = self.state == CardState::Answered;
        let mut args: serde_json::Value =
            serde_json::from_str(&self.args_json).unwrap_or(serde_json::Value::Null);
        let (mut result, mut undo) = (None, None);
        if self.state == CardState::Ran {
            let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
            result = text(&args["result"]);
            undo = text(&args["undo"]);
            args = args["args"].take();
        }
        Card {
            id: self.id,
            kind: arbor_protocol::CardKind::of_tool(&self.tool),
            run: self.run,
            job: self.job,
            lineage: self.lineage.clone(),
            agent: self.agent.clone(),
            tool: self.tool.clone(),
            call: self.call.clone(),
            args,
            state: self.state,
            asked_at_ms: self.asked_at_ms,
            deadline_ms: self.deadline_ms,
            decision: self.decided_at_ms.map(|at_ms| Decision {
                by: self.decided_by.clone().unwrap_or_default(),
                reason: self.reason.clone().filter(|_| !answered),
                at_ms,
                edited: self.edited,
                answer: self.reason.clone().filter(|_| answered),
            }),
            result,
            undo,
        }
    }
}

/// Conservation of one account recomputed from its ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerTotals {
    /// What `Open` granted, and every `Grow` since.
    pub grant: u64,
    /// Own `CallSettle` spent plus every `Release` spent.
    pub spent: u64,
    /// `Hold`s not yet released plus `CallReserve`s not yet settled.
    pub held: u64,
}

/// Folds one account's entries of `unit`, in journal order, into its totals.
///
/// `Close` changes nothing here: its `spent` is the account's own claim, which
/// a caller checks against the recomputed `spent`. Arithmetic saturates rather
/// than panics: a ledger that would underflow is a fault to report, and the
/// caller sees it as totals that do not balance.
pub fn ledger_totals(entries: &[LedgerRecord], unit: Unit) -> LedgerTotals {
    let mut totals = LedgerTotals::default();
    // Holds are per child so that a Release frees exactly what was held for
    // that child, whatever `granted` it reports.
    let mut holds: HashMap<JobId, u64> = HashMap::new();
    let mut calls_reserved: u64 = 0;
    for entry in entries.iter().filter(|e| e.unit == unit) {
        match entry.op {
            LedgerOp::Open { grant } => totals.grant = totals.grant.saturating_add(grant),
            LedgerOp::Grow { amount } => totals.grant = totals.grant.saturating_add(amount),
            LedgerOp::Hold { child, amount } | LedgerOp::Extend { child, amount } => {
                let held = holds.entry(child).or_default();
                *held = held.saturating_add(amount);
            }
            LedgerOp::Release { child, spent, .. } => {
                holds.remove(&child);
                totals.spent = totals.spent.saturating_add(spent);
            }
            LedgerOp::CallReserve { amount } | LedgerOp::BilledCallReserve { amount } => {
                calls_reserved = calls_reserved.saturating_add(amount);
            }
            LedgerOp::CallSettle { reserved, spent } => {
                calls_reserved = calls_reserved.saturating_sub(reserved);
                totals.spent = totals.spent.saturating_add(spent);
            }
            LedgerOp::Close { .. } => {}
        }
    }
    totals.held = holds
        .values()
        .fold(calls_reserved, |sum, held| sum.saturating_add(*held));
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(op: LedgerOp) -> LedgerRecord {
        in_unit(Unit::Tokens, op)
    }

    fn in_unit(unit: Unit, op: LedgerOp) -> LedgerRecord {
        LedgerRecord {
            owner: ParentRef::Run(RunId::new()),
            unit,
            op,
            epoch: 1,
        }
    }

    fn check(ops: Vec<LedgerOp>, expected: LedgerTotals) {
        let entries: Vec<_> = ops.into_iter().map(entry).collect();
        assert_eq!(
            ledger_totals(&entries, Unit::Tokens),
            expected,
            "ledger: {entries:#?}"
        );
    }

    fn totals(grant: u64, spent: u64, held: u64) -> LedgerTotals {
        LedgerTotals { grant, spent, held }
    }

    #[test]
    fn micro_dollars_are_a_second_ledger_beside_the_tokens() {
        let child = JobId::new();
        let usd = |op| in_unit(Unit::UsdMicros, op);
        let entries: Vec<_> = vec![
            entry(LedgerOp::Open { grant: 1000 }),
            usd(LedgerOp::Open { grant: 500_000 }),
            entry(LedgerOp::Hold { child, amount: 400 }),
            usd(LedgerOp::Hold {
                child,
                amount: 200_000,
            }),
            entry(LedgerOp::CallReserve { amount: 100 }),
            usd(LedgerOp::CallReserve { amount: 90 }),
        ];
        assert_eq!(ledger_totals(&entries, Unit::Tokens), totals(1000, 0, 500));
        assert_eq!(usd_totals(&entries), Some(totals(500_000, 0, 200_090)));
        assert_eq!(
            usd_totals(&entries[..1]),
            None,
            "no usd ledger without its Open"
        );
    }

    #[test]
    fn empty_ledger_is_all_zero() {
        check(vec![], totals(0, 0, 0));
    }

    #[test]
    fn holds_count_until_their_child_is_released() {
        let (a, b) = (JobId::new(), JobId::new());
        check(
            vec![
                LedgerOp::Open { grant: 1000 },
                LedgerOp::Hold {
                    child: a,
                    amount: 300,
                },
                LedgerOp::Hold {
                    child: b,
                    amount: 200,
                },
                LedgerOp::Release {
                    child: a,
                    granted: 300,
                    spent: 120,
                },
            ],
            totals(1000, 120, 200),
        );
    }

    #[test]
    fn calls_are_held_until_settled_and_charge_their_real_usage() {
        check(
            vec![
                LedgerOp::Open { grant: 500 },
                LedgerOp::CallReserve { amount: 100 },
                LedgerOp::CallSettle {
                    reserved: 100,
                    spent: 40,
                },
                LedgerOp::CallReserve { amount: 80 },
            ],
            totals(500, 40, 80),
        );
    }

    #[test]
    fn a_whole_account_settles_to_nothing_held() {
        let child = JobId::new();
        check(
            vec![
                LedgerOp::Open { grant: 1000 },
                LedgerOp::CallReserve { amount: 100 },
                LedgerOp::CallSettle {
                    reserved: 100,
                    spent: 30,
                },
                LedgerOp::Hold { child, amount: 400 },
                LedgerOp::CallReserve { amount: 100 },
                LedgerOp::Release {
                    child,
                    granted: 400,
                    spent: 250,
                },
                LedgerOp::CallSettle {
                    reserved: 100,
                    spent: 70,
                },
                LedgerOp::Close { spent: 350 },
            ],
            totals(1000, 350, 0),
        );
    }

    #[test]
    fn a_release_without_a_hold_still_charges_and_never_underflows() {
        check(
            vec![
                LedgerOp::Open { grant: 10 },
                LedgerOp::Release {
                    child: JobId::new(),
                    granted: 5,
                    spent: 3,
                },
                LedgerOp::CallSettle {
                    reserved: 9,
                    spent: 1,
                },
            ],
            totals(10, 4, 0),
        );
    }
}
