//! Budgets: reserved before spent, never over-granted, settled exactly.

use arbor_actors::account::{
    Account, AccountArgs, AccountMsg, FirstCall, Grant, GrantAsk, PlannedCall, Share, SpentMeter,
};
use arbor_actors::{EventBus, NodeContext};
use arbor_protocol::{
    Amount, ErrorClass, EventKind, JobId, Limits, ParentRef, RunId, Status, TaskStatus,
};
use arbor_runtime::{DefaultModels, Workspace};
use arbor_storage::{Journal, Unit, ledger_totals};
use arbor_testkit::{RecordingModels, Seeded, TestNode, agent_md};
use std::sync::{Arc, Mutex};

async fn lone_account(dir: &std::path::Path, grant: u64) -> (ActorRefAccount, Journal, RunId) {
    let journal = Journal::open(&dir.join("journal")).unwrap();
    let run = RunId::new();
    let account = account_of(&journal, dir, run, ParentRef::Run(run), grant, None).await;
    (account, journal, run)
}

/// An Account on `journal` for `owner`, as a run, step or job opens one.
async fn account_of(
    journal: &Journal,
    dir: &std::path::Path,
    run: RunId,
    owner: ParentRef,
    grant: u64,
    first_call: Option<FirstCall>,
) -> ActorRefAccount {
    let ctx = Arc::new(NodeContext {
        journal: journal.clone(),
        events: EventBus::new(journal.clone()),
        limits: Limits::default(),
        agents: Default::default(),
        models: Arc::new(DefaultModels),
        work_root: dir.join("work"),
        sandbox_roots: dir.join("roots"),
        sandbox: Arc::new(arbor_sandbox::seal::Posture::assumed(
            arbor_sandbox::seal::SandboxIsolation::Sealed,
        )),
        secrets: Default::default(),
        skills: Default::default(),
        mcp: Arc::new(arbor_actors::mcp::McpCatalog::empty()),
        approvals: Default::default(),
        gate: Default::default(),
        slots: Default::default(),
        pools: Default::default(),
    });
    let (account, _) = ractor::Actor::spawn(
        None,
        Account,
        AccountArgs {
            grant_usd_micros: None,
            ctx,
            run,
            owner,
            grant,
            wind_down: 0.8,
            meter: SpentMeter::default(),
            resume_spent: None,
            first_call,
        },
    )
    .await
    .unwrap();
    account
}

/// I-11 for a job's first call, reserved by its parent in the commit that
/// admitted the job: the loop gets it as it is, with nothing more journaled,
/// if it asks for that very call; if it asks for another, that hold is
/// released and the call reserved as any other. The ledger balances either
/// way, and a closed account holds nothing.
#[tokio::test]
async fn inv_11_a_first_call_reserved_at_admission_serves_only_the_call_planned() {
    for (asked, as_planned) in [(100, true), (300, false)] {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(&dir.path().join("journal")).unwrap();
        let (run, job) = (RunId::new(), JobId::new());
        let owner = ParentRef::Job(job);
        let planned = PlannedCall {
            input_estimate: 100,
            max_output_limit: 500,
            price: None,
            billed: false,
        };
        let grant = Grant {
            tokens: 10_000,
            usd_micros: None,
        };
        let (first, opened) = FirstCall::plan(job, grant, 0.8, journal.epoch(), &planned)
            .expect("the grant covers the call");
        assert_eq!(first.hold.reserved.tokens, 600);
        // What the admission's commit carries.
        journal.commit(opened).await.unwrap();
        let account = account_of(&journal, dir.path(), run, owner, grant.tokens, Some(first)).await;
        let entries = || journal.ledger(owner).unwrap().len();
        let before = entries();
        let hold = ractor::call!(account, |reply| AccountMsg::ReserveCall {
            input_estimate: asked,
            max_output_limit: 500,
            price: None,
            billed: false,
            reply
        })
        .unwrap()
        .expect("reserved");
        assert_eq!(hold.reserved.tokens, asked + 500);
        if as_planned {
            assert_eq!(hold, first.hold);
            assert_eq!(
                entries(),
                before,
                "the planned call needs nothing more journaled"
            );
        } else {
            assert_eq!(
                entries(),
                before + 2,
                "the planned hold released, the asked call reserved"
            );
        }
        let view = ractor::call!(account, |reply| AccountMsg::Snapshot { reply }).unwrap();
        assert_eq!(view.held, asked + 500, "held: the one call, once");
        ractor::call!(account, |reply| AccountMsg::SettleCall {
            reserved: hold.reserved,
            spent: Amount {
                tokens: 50,
                usd_micros: 0
            },
            event: None,
            reply
        })
        .unwrap();
        let closed = ractor::call!(account, |reply| AccountMsg::Close { reply }).unwrap();
        assert_eq!((closed.tokens.spent, closed.tokens.held), (50, 0));
        journal.flush().await.unwrap();
        let totals = ledger_totals(&journal.ledger(owner).unwrap(), Unit::Tokens);
        assert_eq!((totals.grant, totals.spent, totals.held), (10_000, 50, 0));
    }
}

type ActorRefAccount = ractor::ActorRef<AccountMsg>;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inv_07_concurrent_reservations_never_overgrant() {
    for seed in 1..=40u64 {
        let mut rng = Seeded::new(seed);
        let dir = tempfile::tempdir().unwrap();
        let grant = rng.between(1_000, 100_000);
        let (account, journal, run) = lone_account(dir.path(), grant).await;
        // Many parents' worth of siblings reserve at the same moment.
        let callers = rng.between(2, 24);
        let mut tasks = vec![];
        for _ in 0..callers {
            let asks: Vec<GrantAsk> = (0..rng.between(1, 4))
                .map(|_| GrantAsk {
                    agent_max_usd_micros: None,
                    asked_usd_micros: None,
                    child: JobId::new(),
                    agent: "a".into(),
                    asked: rng
                        .next_u64()
                        .is_multiple_of(2)
                        .then(|| rng.between(1, grant / 3)),
                    agent_max: rng
                        .next_u64()
                        .is_multiple_of(3)
                        .then(|| rng.between(1, grant)),
                })
                .collect();
            let account = account.clone();
            tasks.push(tokio::spawn(async move {
                let children: Vec<JobId> = asks.iter().map(|a| a.child).collect();
                let result = ractor::call!(account, |reply| AccountMsg::Reserve {
                    asks,
                    share: Share::Fraction(0.5),
                    reply
                })
                .unwrap();
                result.map(|grants| {
                    children
                        .into_iter()
                        .zip(grants.into_iter().map(|g| g.tokens))
                        .collect::<Vec<_>>()
                })
            }));
        }
        let mut granted = vec![];
        for t in tasks {
            if let Ok(grants) = t.await.unwrap() {
                assert!(
                    grants.iter().all(|(_, g)| *g > 0),
                    "seed {seed}: a zero grant (I-09)"
                );
                granted.extend(grants);
            }
        }
        let total: u64 = granted.iter().map(|(_, g)| g).sum();
        assert!(total <= grant, "seed {seed}: granted {total} of {grant}");
        let view = ractor::call!(account, |reply| AccountMsg::Snapshot { reply }).unwrap();
        assert_eq!(view.held, total, "seed {seed}: held is exactly the grants");

        // Settle every child concurrently at a random spend within its grant.
        let mut spent_total = 0;
        let mut settles = vec![];
        for (child, g) in granted {
            let spent = rng.between(0, g);
            spent_total += spent;
            let account = account.clone();
            settles.push(tokio::spawn(async move {
                ractor::call!(account, |reply| AccountMsg::Settle {
                    child,
                    spent: arbor_protocol::Amount {
                        tokens: spent,
                        usd_micros: 0,
                    },
                    reply
                })
                .unwrap()
            }));
        }
        for s in settles {
            s.await.unwrap();
        }
        let view = ractor::call!(account, |reply| AccountMsg::Snapshot { reply }).unwrap();
        assert_eq!(
            (view.spent, view.held),
            (spent_total, 0),
            "seed {seed}: I-14 after settling"
        );
        journal.flush().await.unwrap();
        let totals = ledger_totals(
            &journal.ledger(ParentRef::Run(run)).unwrap(),
            arbor_storage::Unit::Tokens,
        );
        assert_eq!(
            (totals.grant, totals.spent, totals.held),
            (grant, spent_total, 0),
            "seed {seed}: the journal agrees"
        );
        account.stop(None);
    }
}

#[tokio::test]
async fn inv_07_no_account_ever_shows_more_than_its_grant_in_a_seeded_fan_out() {
    for seed in 1..=8u64 {
        let mut rng = Seeded::new(seed);
        let mut calls = String::new();
        for _ in 0..rng.between(2, 5) {
            let jobs: Vec<String> = (0..rng.between(1, 6))
                .map(|_| match rng.next_u64() % 3 {
                    0 => format!(
                        "{{agent: leaf, request: r, budget: {{tokens: {}}}}}",
                        rng.between(100, 5_000)
                    ),
                    _ => "{agent: leaf, request: r}".to_string(),
                })
                .collect();
            calls.push_str(&format!(
                "\n  - call: {{tool: delegate, args: {{wait: false, jobs: [{}]}}}}",
                jobs.join(", ")
            ));
        }
        calls.push_str("\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}");
        let boss = agent_md(&format!("subagents: [leaf]\nmax_turns: 20\nscript:{calls}"));
        let leaf = agent_md(&format!(
            "description: leaf\nscript:\n  - say: working\n    delay: {}ms\n    usage: {{input: 50, output: 50}}\n    call: {{tool: submit_output, args: {{output: ok}}}}",
            rng.between(0, 20)
        ));
        let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
        let breaches = Arc::new(Mutex::new(vec![]));
        let seen = breaches.clone();
        // Checked at every change, at the moment it happens.
        node.observe(move |e| {
            if let EventKind::AccountChanged {
                owner,
                grant,
                spent,
                held,
                ..
            } = &e.kind
                && spent + held > *grant
            {
                seen.lock()
                    .unwrap()
                    .push(format!("{owner:?}: {spent} + {held} > {grant}"));
            }
        });
        let run = node
            .run_agent_with_budget("boss", "go", Some(rng.between(20_000, 200_000)))
            .await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.run_status(), Status::Done, "seed {seed}");
        assert!(
            breaches.lock().unwrap().is_empty(),
            "seed {seed}: {:?}",
            breaches.lock().unwrap()
        );
        node.assert_conserved(run);
    }
}

#[tokio::test]
async fn inv_08_one_call_grants_at_most_its_fraction_and_an_over_ask_is_refused_naming_the_cap() {
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: leaf, request: a, label: asks, budget: {tokens: 10000}}, {agent: leaf, request: b, label: s1}, {agent: leaf, request: c, label: s2}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: d, label: greedy, budget: {tokens: 90000}}]}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node
        .run_agent_with_budget("boss", "go", Some(100_000))
        .await;
    let tree = node.wait_run(run).await;
    let grant = |label: &str| tree.node(tree.find(label).unwrap()).unwrap().account.grant;
    let boss_spent_before = node
        .events(run)
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::ModelCalled {
                turn: 0,
                input_tokens,
                output_tokens,
                ..
            } => Some(input_tokens + output_tokens),
            _ => None,
        })
        .unwrap();
    let available = 100_000 - boss_spent_before;
    let cap = available / 2;
    assert_eq!(grant("asks"), 10_000, "a child that asks gets what it asks");
    assert_eq!(
        grant("s1"),
        (cap - 10_000) / 2,
        "the rest share what is left of the cap"
    );
    assert_eq!(grant("s2"), grant("s1"));
    assert!(tree.find("greedy").is_none());
    let refused = node
        .failed_calls(run, "delegate")
        .pop()
        .expect("the over-ask is an error result");
    assert!(
        refused.contains("one delegate call may grant at most"),
        "{refused}"
    );
}

#[tokio::test]
async fn inv_09_zero_never_means_unlimited() {
    for (budget, says) in [
        ("{tokens: 0}", "at least 1"),
        ("{tokens: -5}", "positive whole number"),
        ("{tokens: 1.5}", "positive whole number"),
        ("{usd: 0}", "budget.usd must be more than 0"),
        ("{usd: -1.5}", "budget.usd must be more than 0"),
        ("{usd: 0.0000001}", "less than one micro-dollar"),
    ] {
        let boss = agent_md(&format!(
            "subagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{{agent: leaf, request: a, budget: {budget}}}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
        ));
        let leaf = agent_md(
            "description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
        );
        let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
        let run = node.run_agent("boss", "go").await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.nodes().count(), 1, "{budget}: nothing spawned");
        let detail = node.failed_calls(run, "delegate").remove(0);
        assert!(detail.contains(says), "{budget}: {detail}");
    }
    // A share that rounds down to zero is refused, never granted as 0.
    let boss = agent_md(
        "subagents: [leaf]\nscript:\n  - usage: {input: 5, output: 1}\n    call: {tool: delegate, args: {jobs: [{agent: leaf, request: a}, {agent: leaf, request: b}, {agent: leaf, request: c}]}}\n  - usage: {input: 1, output: 1}\n    call: {tool: submit_output, args: {output: done}}",
    );
    let leaf =
        agent_md("description: leaf\nscript:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf)]).await;
    let run = node.run_agent_with_budget("boss", "go", Some(10)).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.nodes().count(), 1);
    assert!(node.events(run).iter().any(|e| matches!(&e.kind,
        EventKind::ToolCalled { ok: false, detail, .. } if detail.contains("would be granted 0 tokens"))));
    // And a run of 0 tokens does not start.
    let ws = &node.workspace;
    assert!(ws.agent_run("boss", "go", Some(0)).is_err());
}

#[tokio::test]
async fn inv_10_a_settled_child_returns_grant_minus_spent_and_a_stopped_one_is_charged_what_it_spent()
 {
    let boss = agent_md(
        "subagents: [leaf, slow]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: a, label: done}]}}\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: slow, request: b, label: slow}]}}\n  - call: {tool: stop_child, args: {child: slow}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let leaf = agent_md(
        "description: leaf\nscript:\n  - usage: {input: 100, output: 23}\n    call: {tool: submit_output, args: {output: ok}}",
    );
    let slow = agent_md(
        "description: slow\nscript:\n  - usage: {input: 70, output: 7}\n    call: {tool: send_message, args: {child: nobody, message: x}}\n  - say: slow\n    delay: 1h",
    );
    let node = TestNode::start(&[("boss", &boss), ("leaf", &leaf), ("slow", &slow)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let done = tree.node(tree.find("done").unwrap()).unwrap();
    assert_eq!(done.account.spent, 123);
    let slow_node = tree.node(tree.find("slow").unwrap()).unwrap();
    assert_eq!(slow_node.status, Status::Stopped);
    // The stopped child may have made its first call or not; it is charged exactly that.
    let slow_calls: u64 = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ModelCalled {
                id,
                input_tokens,
                output_tokens,
                ..
            } if Some(id) == tree.find("slow") => Some(input_tokens + output_tokens),
            _ => None,
        })
        .sum();
    assert_eq!(slow_node.account.spent, slow_calls);
    let boss_node = tree.node(tree.find("boss").unwrap()).unwrap();
    assert_eq!(boss_node.account.held, 0, "every hold was released");
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_11_no_model_call_breaches_the_root_ceiling() {
    let greedy = agent_md(
        "script:\n  - usage: {input: 300, output: 5000}\n    call: {tool: collect, args: {}}\n  - usage: {input: 300, output: 5000}\n    call: {tool: collect, args: {}}\n  - usage: {input: 300, output: 5000}\n    call: {tool: submit_output, args: {output: x}}",
    );
    let node = TestNode::start(&[("greedy", &greedy)]).await;
    let run = node
        .run_agent_with_budget("greedy", "go", Some(1_000))
        .await;
    let tree = node.wait_run(run).await;
    assert!(tree.root().account.spent <= 1_000);
    let calls: Vec<(u64, u64, bool)> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ModelCalled {
                reserved,
                input_tokens,
                output_tokens,
                truncated,
                ..
            } => Some((reserved, input_tokens + output_tokens, truncated)),
            _ => None,
        })
        .collect();
    assert_eq!(
        calls,
        [(1_000, 1_000, true)],
        "the one call was cut to what the account covered"
    );
    let root = tree.root();
    assert_eq!(root.status, Status::Failed);
    assert_eq!(
        root.error_class,
        Some(ErrorClass::BudgetExhausted),
        "I-13: the step hit the root ceiling"
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_12_past_the_wind_down_share_requests_carry_a_notice_that_never_enters_the_history() {
    let turn = "  - usage: {input: 100, output: 2900}\n    call: {tool: collect, args: {}}\n";
    let agent = agent_md(&format!(
        "script:\n{turn}{turn}{turn}  - usage: {{input: 100, output: 100}}\n    call: {{tool: submit_output, args: {{output: x}}}}"
    ));
    let models = RecordingModels::new();
    let node = TestNode::start_full(None, &[("worker", &agent)], models.clone()).await;
    let run = node
        .run_agent_with_budget("worker", "go", Some(10_000))
        .await;
    node.wait_run(run).await;
    let requests = models.requests("worker");
    let notices: Vec<bool> = requests.iter().map(|r| r.wind_down.is_some()).collect();
    // Spent after each call: 3000, 6000, 9000 -> only the fourth comes past 80%.
    assert_eq!(notices, [false, false, false, true]);
    for r in &requests {
        let history = format!("{:?}", r.messages);
        assert!(
            !history.contains("Budget notice"),
            "the notice is not stored in the history"
        );
    }
    let crossings = node
        .events(run)
        .into_iter()
        .filter(|e| {
            matches!(
                &e.kind,
                EventKind::WindDown {
                    owner: ParentRef::Job(_),
                    ..
                }
            )
        })
        .count();
    assert_eq!(crossings, 1, "the crossing emits one event");
}

#[tokio::test]
async fn inv_13_a_job_at_its_ceiling_returns_partial_and_the_run_goes_on() {
    let boss = agent_md(
        "subagents: [deep]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: deep, request: all, label: deep, budget: {tokens: 3000}}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let deep = agent_md(
        "description: deep\nscript:\n  - say: first findings\n    usage: {input: 800, output: 1200}\n    call: {tool: collect, args: {}}\n  - say: more findings\n    usage: {input: 800, output: 1200}\n    call: {tool: collect, args: {}}\n  - usage: {input: 800, output: 1200}\n    call: {tool: submit_output, args: {output: everything}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("deep", &deep)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let deep = tree.node(tree.find("deep").unwrap()).unwrap();
    assert_eq!(
        (deep.status, deep.task_status),
        (Status::Done, Some(TaskStatus::Partial))
    );
    assert_eq!(deep.output, "more findings", "its partial answer");
    assert_eq!(deep.account.spent, 3_000, "its spend, exactly its ceiling");
    assert_eq!(tree.run_status(), Status::Done, "the run goes on");
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_14_conservation_holds_for_every_account_of_the_example() {
    let workspace = Workspace::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/research"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let node = arbor_runtime::EmbeddedNode::start(&workspace, dir.path())
        .await
        .unwrap();
    let run = node
        .start_run(workspace.flow_run("research", None).unwrap())
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    tree.check_conservation()
        .unwrap_or_else(|b| panic!("{b:?}"));
    let root = tree.root();
    let steps_spent: u64 = root.children.iter().map(|c| c.account.spent).sum();
    assert_eq!(
        root.account.spent, steps_spent,
        "the run's spent is its steps'"
    );
    for (id, n) in tree.nodes() {
        let totals = ledger_totals(
            &node.journal().ledger(ParentRef::Job(id)).unwrap(),
            arbor_storage::Unit::Tokens,
        );
        assert_eq!(
            (totals.grant, totals.spent, totals.held),
            (n.account.grant, n.account.spent, n.account.held)
        );
    }
    node.shutdown().await.unwrap();
}

/// I-58: a top-up raises a running run's root grant as a journaled grant
/// (`Grow`), told only once it is durable; every account balances before
/// and after it; the next group is granted from the larger ceiling; a
/// restart resumes the run with it; and a top-up that is not one, or of a
/// ceiling the run does not have, is refused and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn inv_58_a_top_up_is_a_journaled_grant_and_every_account_balances() {
    let waits = agent_md("script:\n  - say: working\n    delay: 1h");
    let flow = "budget = { tokens = 10000 }\n[[group]]\nsteps = [{ agent = \"waits\", instruction = \"wait\", retries = 5 }]\n";
    let node = TestNode::start_workspace(
        None,
        &[("waits", &waits)],
        &[("work", flow)],
        Arc::new(DefaultModels),
    )
    .await;
    let run = node.run_flow("work").await;
    // Quiescent: its step's call is reserved and waits on its model.
    node.wait_until(run, |t| t.nodes().any(|(_, n)| n.account.held > 0))
        .await;
    node.assert_conserved(run);
    let refused = |amount: Amount| {
        let node = &node;
        async move {
            node.node()
                .top_up(run, amount, None)
                .await
                .unwrap_err()
                .to_string()
        }
    };
    assert!(refused(Amount::ZERO).await.contains("at least 1 token"));
    let usd = Amount {
        tokens: 0,
        usd_micros: 5,
    };
    assert!(refused(usd).await.contains("no usd ceiling"));
    let unknown = node
        .node()
        .top_up(
            RunId::new(),
            Amount {
                tokens: 5,
                usd_micros: 0,
            },
            None,
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(unknown.contains("is not running on this node"), "{unknown}");
    assert_eq!(
        node.tree(run).root().account.grant,
        10_000,
        "refusals change nothing"
    );
    let five = Amount {
        tokens: 5_000,
        usd_micros: 0,
    };
    let view = node.node().top_up(run, five, None).await.unwrap();
    assert_eq!(view.grant, 15_000);
    let grows: Vec<u64> = node
        .ledger(ParentRef::Run(run))
        .iter()
        .filter_map(|e| match e.op {
            arbor_storage::LedgerOp::Grow { amount } => Some(amount),
            _ => None,
        })
        .collect();
    assert_eq!(grows, [5_000], "one journaled grant");
    let tree = node
        .wait_until(run, |t| t.root().account.grant == 15_000)
        .await;
    assert_eq!(
        tree.root().account.held,
        10_000,
        "the step's grant is held as it was"
    );
    node.assert_conserved(run);
    // Across a kill, the run resumes with the ceiling it was topped up to.
    let node = node.crash_and_restart().await;
    let tree = node
        .wait_until(run, |t| t.nodes().any(|(_, n)| n.attempt == 2))
        .await;
    assert_eq!(tree.root().account.grant, 15_000);
    assert_eq!(tree.run_status(), Status::Running);
    let steps: Vec<u64> = tree
        .nodes()
        .filter(|(_, n)| n.attempt == 2)
        .map(|(_, n)| n.account.grant)
        .collect();
    assert_eq!(
        steps,
        [15_000],
        "the step's next attempt is granted from the new ceiling"
    );
    node.stop_run(run).await;
    node.wait_run(run).await;
    node.assert_conserved(run);
}

/// A step that spends the whole run on its first call, then calls twice
/// more; its run pauses at its ceiling (`on_ceiling = "pause"`).
fn paused_workspace(pause_timeout: &str) -> (String, String) {
    let spender = agent_md(
        "script:\n  - usage: {input: 100, output: 900}\n    call: {tool: collect, args: {}}\n  - usage: {input: 10, output: 10}\n    call: {tool: collect, args: {}}\n  - usage: {input: 10, output: 10}\n    call: {tool: submit_output, args: {output: finished}}",
    );
    let flow = format!(
        "budget = {{ tokens = 1000 }}\non_ceiling = \"pause\"\npause_timeout = \"{pause_timeout}\"\n[[group]]\nsteps = [{{ agent = \"spender\", instruction = \"spend\" }}]\n"
    );
    (spender, flow)
}

async fn paused_node(pause_timeout: &str) -> TestNode {
    let (spender, flow) = paused_workspace(pause_timeout);
    TestNode::start_workspace(
        None,
        &[("spender", &spender)],
        &[("work", &flow)],
        Arc::new(DefaultModels),
    )
    .await
}

fn paused(tree: &arbor_protocol::Tree) -> Option<(Amount, u64)> {
    match tree.head().waiting {
        Some(arbor_protocol::WaitingView::Budget { needs, deadline_ms }) => {
            Some((needs, deadline_ms))
        }
        _ => None,
    }
}

/// A `budget_reached` event's fields: who waits, for how much, until when.
type Reached = (Option<JobId>, Amount, u64);

/// The run's `budget_reached` events, and each `budget_pause_ended`'s `expired`.
fn pause_events(node: &TestNode, run: RunId) -> (Vec<Reached>, Vec<bool>) {
    let mut reached = vec![];
    let mut ended = vec![];
    for event in node.events(run) {
        match event.kind {
            EventKind::BudgetReached {
                id,
                needs,
                deadline_ms,
            } => reached.push((id, needs, deadline_ms)),
            EventKind::BudgetPauseEnded { expired } => ended.push(expired),
            _ => {}
        }
    }
    (reached, ended)
}

#[tokio::test]
async fn inv_58_a_run_paused_at_its_ceiling_holds_nothing_and_completes_balanced_after_a_top_up() {
    let node = paused_node("1h").await;
    let run = node.run_flow("work").await;
    let tree = node.wait_until(run, |t| paused(t).is_some()).await;
    let (needs, deadline_ms) = paused(&tree).unwrap();
    let step = tree.nodes().map(|(id, _)| id).next().unwrap();
    let step_node = tree.nodes().next().unwrap().1;
    assert_eq!(
        step_node.status,
        Status::Running,
        "the step waits, not ended"
    );
    assert_eq!(step_node.account.held, 0, "a paused step holds nothing");
    assert_eq!(tree.root().account.spent + step_node.account.spent, 1_000);
    assert!(
        needs.tokens > 0,
        "it says what the next call needs: {needs:?}"
    );
    let now = arbor_actors::events::now_ms();
    assert!(deadline_ms > now + 3_500_000 && deadline_ms <= now + 3_600_000);
    let (reached, ended) = pause_events(&node, run);
    assert_eq!(reached, [(Some(step), needs, deadline_ms)]);
    assert!(ended.is_empty());
    node.assert_conserved(run);

    // Less than it needs lets nothing go on: it waits, in balance.
    let short = Amount {
        tokens: needs.tokens - 1,
        usd_micros: 0,
    };
    node.node().top_up(run, short, None).await.unwrap();
    let tree = node
        .wait_until(run, |t| t.root().account.grant == 1_000 + short.tokens)
        .await;
    assert!(paused(&tree).is_some(), "still paused: {:?}", tree.head());
    node.assert_conserved(run);

    let rest = Amount {
        tokens: 5_000,
        usd_micros: 0,
    };
    node.node().top_up(run, rest, None).await.unwrap();
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Done, "{:?}", root.reason);
    assert_eq!(root.output, serde_json::json!("finished"));
    assert_eq!(root.account.grant, 1_000 + short.tokens + rest.tokens);
    assert!(root.account.spent <= root.account.grant);
    assert!(tree.head().waiting.is_none());
    let (reached, ended) = pause_events(&node, run);
    assert_eq!(reached.len(), 1);
    assert_eq!(ended, [false], "the pause ended with the top-up");
    // The step's grant was extended from the root, by a journaled entry on each side.
    let extended: u64 = node
        .ledger(ParentRef::Run(run))
        .iter()
        .filter_map(|e| match e.op {
            arbor_storage::LedgerOp::Extend { child, amount } if child == step => Some(amount),
            _ => None,
        })
        .sum();
    assert_eq!(
        extended,
        short.tokens + rest.tokens,
        "all it had went to the one waiter"
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_58_a_pause_that_expires_ends_the_run_as_it_would_have_without_it() {
    let node = paused_node("300ms").await;
    let run = node.run_flow("work").await;
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Failed);
    assert_eq!(root.error_class, Some(ErrorClass::BudgetExhausted), "I-13");
    let (reached, ended) = pause_events(&node, run);
    assert_eq!(reached.len(), 1, "it did pause");
    assert_eq!(ended, [true], "and its deadline ended the pause");
    assert_eq!(root.account.grant, 1_000, "nothing was added");
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_58_a_stop_during_a_pause_ends_the_run_at_once() {
    let node = paused_node("1h").await;
    let run = node.run_flow("work").await;
    node.wait_until(run, |t| paused(t).is_some()).await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.root().status, Status::Stopped);
    assert!(tree.head().waiting.is_none());
    assert!(tree.nodes().all(|(_, n)| n.status.is_terminal()));
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_58_a_pause_and_its_deadline_survive_a_kill_and_a_top_up_then_completes_it() {
    let node = paused_node("1h").await;
    let run = node.run_flow("work").await;
    let tree = node.wait_until(run, |t| paused(t).is_some()).await;
    let (_, deadline_ms) = paused(&tree).unwrap();
    let node = node.crash_and_restart().await;
    // Resumed, it pauses again where it was: its step (run again) cannot
    // start on what is left, and the deadline is the one it had.
    let tree = node.wait_until(run, |t| paused(t).is_some()).await;
    assert_eq!(
        paused(&tree).unwrap().1,
        deadline_ms,
        "the deadline survived"
    );
    let (reached, _) = pause_events(&node, run);
    assert!(reached.iter().all(|(_, _, d)| *d == deadline_ms));
    node.assert_conserved(run);
    let more = Amount {
        tokens: 20_000,
        usd_micros: 0,
    };
    node.node().top_up(run, more, None).await.unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.root().status, Status::Done, "{:?}", tree.root().reason);
    assert_eq!(tree.root().account.grant, 21_000);
    node.assert_conserved(run);
}
