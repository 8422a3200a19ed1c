//! `arbor journal verify`: every record decodes, and every account balances.
//!
//! The checks on accounts are pure (`account_breaches`), over ledgers the
//! journal reads back; `Journal::verify` does the reading.
//!
//! What an account must satisfy, recomputed with `ledger_totals` (I-14, I-31):
//! 1. `spent + held <= grant`: nothing spends or holds more than it was given.
//! 2. A closed account (one with a `Close`) holds nothing, and each `Close`
//!    claims exactly the spent its ledger adds up to.
//! 3. A parent's `Release { child, spent }` charges what the child's own
//!    account adds up to, when the child's ledger is in the journal.

use crate::Undecodable;
use crate::record::{LedgerOp, LedgerRecord, LedgerTotals, Unit, ledger_totals, usd_totals};
use arbor_protocol::{JobId, ParentRef};
use std::collections::HashMap;

/// What `Journal::verify` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Records that decoded and sit under the key their content implies.
    pub records: u64,
    /// Entries that do not decode, by tree and key (as `scan` reports them).
    pub undecodable: Vec<Undecodable>,
    /// Accounts checked: the distinct owners in the ledger.
    pub accounts: u64,
    /// One line per broken rule, naming the account and the numbers.
    pub breaches: Vec<String>,
}

impl VerifyReport {
    /// Nothing undecodable and no account out of balance.
    pub fn is_clean(&self) -> bool {
        self.undecodable.is_empty() && self.breaches.is_empty()
    }
}

/// Checks every account against the rules in the module docs. `accounts` is
/// each owner's decodable entries in journal order; the breaches come in the
/// order of `accounts`, each account's in the order of the rules.
/// Every breach of either ledger: tokens, then micro-dollars (named `usd`).
pub(crate) fn account_breaches(accounts: &[(ParentRef, Vec<LedgerRecord>)]) -> Vec<String> {
    let mut breaches = dimension_breaches(accounts, Unit::Tokens, "");
    let usd: Vec<&(ParentRef, Vec<LedgerRecord>)> = accounts
        .iter()
        .filter(|(_, entries)| usd_totals(entries).is_some())
        .collect();
    breaches.extend(dimension_breaches(usd, Unit::UsdMicros, "usd "));
    breaches
}

/// The breaches of one ledger: each account's entries of `unit`.
fn dimension_breaches<'a>(
    accounts: impl IntoIterator<Item = &'a (ParentRef, Vec<LedgerRecord>)> + Clone,
    unit: Unit,
    prefix: &str,
) -> Vec<String> {
    let totals: HashMap<ParentRef, LedgerTotals> = accounts
        .clone()
        .into_iter()
        .map(|(owner, entries)| (*owner, ledger_totals(entries, unit)))
        .collect();
    let mut breaches = Vec::new();
    for (owner, entries) in accounts {
        let of_unit = || entries.iter().filter(|e| e.unit == unit);
        let name = format!("{prefix}{}", owner_name(*owner));
        let LedgerTotals { grant, spent, held } = totals[owner];
        if spent.saturating_add(held) > grant {
            breaches.push(format!(
                "{name}: spent {spent} + held {held} = {} exceeds its grant {grant}",
                spent.saturating_add(held)
            ));
        }
        let closes = of_unit().filter_map(|entry| match &entry.op {
            LedgerOp::Close { spent } => Some(*spent),
            _ => None,
        });
        let mut closed = false;
        for claimed in closes {
            closed = true;
            if claimed != spent {
                breaches.push(format!(
                    "{name}: Close says spent {claimed}, its ledger adds up to {spent}"
                ));
            }
        }
        if closed && held != 0 {
            breaches.push(format!("{name}: closed with {held} still held"));
        }
        for entry in of_unit() {
            let LedgerOp::Release { child, spent, .. } = &entry.op else {
                continue;
            };
            let (child, spent) = (*child, *spent);
            if let Some(child_totals) = totals.get(&ParentRef::Job(child))
                && child_totals.spent != spent
            {
                breaches.push(format!(
                    "{name}: released child {} as spent {spent}, but the child's own ledger \
                     adds up to {}",
                    owner_name(ParentRef::Job(child)),
                    child_totals.spent
                ));
            }
        }
    }
    breaches
}

fn owner_name(owner: ParentRef) -> String {
    match owner {
        ParentRef::Run(id) => format!("run {id}"),
        ParentRef::Job(JobId(id)) => format!("job {id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::RunId;

    fn account(owner: ParentRef, ops: Vec<LedgerOp>) -> (ParentRef, Vec<LedgerRecord>) {
        let entries = ops
            .into_iter()
            .map(|op| LedgerRecord {
                owner,
                unit: Unit::Tokens,
                op,
                epoch: 1,
            })
            .collect();
        (owner, entries)
    }

    fn check(accounts: Vec<(ParentRef, Vec<LedgerOp>)>, expected: &[&str]) {
        let accounts: Vec<_> = accounts
            .into_iter()
            .map(|(owner, ops)| account(owner, ops))
            .collect();
        let breaches = account_breaches(&accounts);
        assert_eq!(breaches.len(), expected.len(), "breaches: {breaches:#?}");
        for (breach, expected) in breaches.iter().zip(expected) {
            assert!(breach.contains(expected), "{breach:?} lacks {expected:?}");
        }
    }

    /// A run that gave a child 400 and charged it `released_spent` on
    /// release, and the child's own account, which spent `child_spent`.
    fn parent_and_child(child_spent: u64, released_spent: u64) -> Vec<(ParentRef, Vec<LedgerOp>)> {
        let run = ParentRef::Run(RunId::new());
        let child = JobId::new();
        vec![
            (
                run,
                vec![
                    LedgerOp::Open { grant: 1000 },
                    LedgerOp::Hold { child, amount: 400 },
                    LedgerOp::Release {
                        child,
                        granted: 400,
                        spent: released_spent,
                    },
                    LedgerOp::Close {
                        spent: released_spent,
                    },
                ],
            ),
            (
                ParentRef::Job(child),
                vec![
                    LedgerOp::Open { grant: 400 },
                    LedgerOp::CallReserve { amount: 400 },
                    LedgerOp::CallSettle {
                        reserved: 400,
                        spent: child_spent,
                    },
                    LedgerOp::Close { spent: child_spent },
                ],
            ),
        ]
    }

    #[test]
    fn balanced_accounts_have_no_breaches() {
        check(parent_and_child(250, 250), &[]);
        check(vec![], &[]);
    }

    #[test]
    fn spending_and_holding_past_the_grant_is_a_breach() {
        let owner = ParentRef::Job(JobId::new());
        check(
            vec![(
                owner,
                vec![
                    LedgerOp::Open { grant: 100 },
                    LedgerOp::CallSettle {
                        reserved: 0,
                        spent: 80,
                    },
                    LedgerOp::CallReserve { amount: 30 },
                ],
            )],
            &[&format!(
                "{}: spent 80 + held 30 = 110 exceeds its grant 100",
                owner_name(owner)
            )],
        );
    }

    #[test]
    fn a_close_must_claim_the_recomputed_spent_and_hold_nothing() {
        let owner = ParentRef::Run(RunId::new());
        check(
            vec![(
                owner,
                vec![
                    LedgerOp::Open { grant: 100 },
                    LedgerOp::CallReserve { amount: 10 },
                    LedgerOp::CallSettle {
                        reserved: 0,
                        spent: 20,
                    },
                    LedgerOp::Close { spent: 25 },
                ],
            )],
            &[
                "Close says spent 25, its ledger adds up to 20",
                "closed with 10 still held",
            ],
        );
    }

    #[test]
    fn a_release_must_charge_what_the_child_spent() {
        check(
            parent_and_child(260, 250),
            &["as spent 250, but the child's own ledger adds up to 260"],
        );
    }

    #[test]
    fn a_release_of_a_child_without_a_ledger_is_not_checked() {
        let mut accounts = parent_and_child(260, 250);
        accounts.pop();
        check(accounts, &[]);
    }
}
