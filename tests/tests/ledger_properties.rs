//! The ledger as a state machine, against a model: 1,000 cases, each an
//! Account actor (on a real node's journal) given 2 to 64 operations at once:
//! model-call reservations and their settlements, grants to children and
//! their refunds (some sent twice), and a stop (the account's close) in the
//! middle of them. Whatever order they land in:
//!
//! - no over-grant: at every point of the journaled ledger, what is held
//!   plus what is spent is within the grant (I-07, I-11);
//! - each child's refund is journaled exactly once, however often it is
//!   asked for, and each call's reservation is settled at most once (I-14);
//! - once everything has landed the account holds nothing, and what it
//!   spent is what the model says the accepted operations spent.

use arbor_actors::SpentMeter;
use arbor_actors::account::{Account, AccountArgs, AccountMsg, GrantAsk, Share};
use arbor_protocol::{Amount, JobId, ParentRef, RunId};
use arbor_storage::{LedgerOp, ledger_totals};
use arbor_testkit::{TestNode, agent_md};
use proptest::prelude::*;
use ractor::Actor;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug)]
enum Op {
    /// A model call: reserve for this input and output, then report this
    /// share (per mille) of the reservation spent.
    Call {
        input: u64,
        output: u64,
        spent_permille: u64,
    },
    /// A child: ask for a grant, then report this share of it spent, and
    /// maybe report it twice.
    Child {
        asked: Option<u64>,
        spent_permille: u64,
        twice: bool,
    },
    /// The account is closed (a stop) while the rest is in flight.
    Stop,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (1u64..2_000, 1u64..2_000, 0u64..=1000)
            .prop_map(|(input, output, spent_permille)| Op::Call { input, output, spent_permille }),
        4 => (proptest::option::of(1u64..50_000), 0u64..=1000, any::<bool>())
            .prop_map(|(asked, spent_permille, twice)| Op::Child { asked, spent_permille, twice }),
        1 => Just(Op::Stop),
    ]
}

/// What one operation did, for the model.
#[derive(Default)]
struct Done {
    spent: u64,
    /// A child granted, and what it reported spent.
    child: Option<(JobId, u64)>,
}

async fn run_case(
    ctx: &Arc<arbor_actors::NodeContext>,
    grant: u64,
    ops: Vec<Op>,
) -> Result<(), String> {
    let owner = ParentRef::Job(JobId::new());
    let (account, handle) = Actor::spawn(
        None,
        Account,
        AccountArgs {
            ctx: ctx.clone(),
            run: RunId::new(),
            owner,
            grant,
            grant_usd_micros: None,
            wind_down: 0.8,
            meter: SpentMeter::default(),
            resume_spent: None,
            first_call: None,
        },
    )
    .await
    .map_err(|e| e.to_string())?;
    let tasks: Vec<_> = ops
        .into_iter()
        .map(|op| {
            let account = account.clone();
            tokio::spawn(async move {
                let mut done = Done::default();
                match op {
                    Op::Call {
                        input,
                        output,
                        spent_permille,
                    } => {
                        let hold = ractor::call!(account, |reply| AccountMsg::ReserveCall {
                            input_estimate: input,
                            max_output_limit: output,
                            price: None,
                            billed: false,
                            reply,
                        });
                        if let Ok(Ok(hold)) = hold {
                            let spent = hold.reserved.tokens * spent_permille / 1000;
                            let settled = ractor::call!(account, |reply| AccountMsg::SettleCall {
                                reserved: hold.reserved,
                                spent: Amount {
                                    tokens: spent,
                                    usd_micros: 0
                                },
                                event: None,
                                reply,
                            });
                            if settled.is_ok() {
                                done.spent = spent;
                            }
                        }
                    }
                    Op::Child {
                        asked,
                        spent_permille,
                        twice,
                    } => {
                        let child = JobId::new();
                        let grants = ractor::call!(account, |reply| AccountMsg::Reserve {
                            asks: vec![GrantAsk {
                                child,
                                agent: "child".into(),
                                asked,
                                agent_max: None,
                                asked_usd_micros: None,
                                agent_max_usd_micros: None,
                            }],
                            share: Share::Fraction(0.5),
                            reply,
                        });
                        if let Ok(Ok(grants)) = grants {
                            let spent = grants[0].tokens * spent_permille / 1000;
                            for _ in 0..if twice { 2 } else { 1 } {
                                let _ = ractor::call!(account, |reply| AccountMsg::Settle {
                                    child,
                                    spent: Amount {
                                        tokens: spent,
                                        usd_micros: 0
                                    },
                                    reply,
                                });
                            }
                            done.spent = spent;
                            done.child = Some((child, spent));
                        }
                    }
                    Op::Stop => {
                        let _ = ractor::call!(account, |reply| AccountMsg::Close { reply });
                    }
                }
                done
            })
        })
        .collect();
    let mut spent = 0;
    let mut children: HashMap<JobId, u64> = HashMap::new();
    for task in tasks {
        let done = task.await.map_err(|e| e.to_string())?;
        spent += done.spent;
        children.extend(done.child);
    }
    let closed =
        ractor::call!(account, |reply| AccountMsg::Close { reply }).map_err(|e| e.to_string())?;
    account.stop(None);
    let _ = handle.await;

    let ledger = ctx.journal.ledger(owner).map_err(|e| e.to_string())?;
    for n in 1..=ledger.len() {
        let t = ledger_totals(&ledger[..n], arbor_storage::Unit::Tokens);
        if t.held + t.spent > t.grant {
            return Err(format!(
                "over-granted after entry {n} ({:?}): held {} + spent {} > grant {}",
                ledger[n - 1].op,
                t.held,
                t.spent,
                t.grant
            ));
        }
    }
    let mut refunds: HashMap<JobId, u32> = HashMap::new();
    let (mut reserved, mut released) = (0u64, 0u64);
    let mut closed_at = None;
    for (n, entry) in ledger.iter().enumerate() {
        match entry.op {
            LedgerOp::Release { child, spent, .. } => {
                *refunds.entry(child).or_default() += 1;
                if children.get(&child) != Some(&spent) {
                    return Err(format!(
                        "child {child} released at {spent}; it reported {:?}",
                        children.get(&child)
                    ));
                }
            }
            LedgerOp::CallReserve { amount: tokens } => reserved += tokens,
            LedgerOp::CallSettle { reserved: r, .. } => {
                released += r;
                if closed_at.is_some() {
                    return Err(format!("a call settled after the close (entry {n})"));
                }
            }
            LedgerOp::Close { .. } => closed_at = closed_at.or(Some(n)),
            _ => {}
        }
    }
    // Each reservation is refunded at most once: by its settlement, or by
    // the close that cut its call short, never by both.
    if released > reserved {
        return Err(format!(
            "calls reserved {reserved} and were refunded {released}"
        ));
    }
    if let Some((child, n)) = refunds.iter().find(|(_, n)| **n > 1) {
        return Err(format!("child {child} refunded {n} times"));
    }
    let totals = ledger_totals(&ledger, arbor_storage::Unit::Tokens);
    if totals.held != 0 || closed.tokens.held != 0 {
        return Err(format!(
            "the closed account still holds {} (journal) / {} (actor)",
            totals.held, closed.tokens.held
        ));
    }
    // What was spent is what the children reported plus what the calls
    // that settled before the close reported: never more than the model's
    // total (a call cut short by the close is charged nothing).
    if totals.spent != closed.spent.tokens || totals.spent > spent {
        return Err(format!(
            "spent {} (journal) / {} (actor), the model says at most {spent}",
            totals.spent, closed.spent.tokens
        ));
    }
    Ok(())
}

#[test]
fn the_ledger_never_over_grants_and_refunds_each_child_once() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let node = runtime.block_on(TestNode::start(&[(
        "solo",
        &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"),
    )]));
    let ctx = node.node().context().clone();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 1_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(
        &(100u64..100_000, proptest::collection::vec(op(), 2..=64)),
        |(grant, ops)| {
            runtime
                .block_on(run_case(&ctx, grant, ops))
                .map_err(TestCaseError::fail)
        },
    );
    runtime.block_on(node.shutdown());
    if let Err(e) = result {
        panic!("{e}");
    }
}
