//! Workloads that `explore_crashes` runs in arbor's own suites.

use arbor_protocol::{CardState, RunId, Status, Verdict, WaitingView};
use arbor_testkit::faults::{FaultyModels, ModelFault};
use arbor_testkit::{Scenario, TestNode, agent_md};
use futures::future::BoxFuture;
use std::sync::Arc;

/// A step (retried up to 100 times) fans out to four workers in one call;
/// each meets a 429 on its first model call (retried), runs a real command
/// that leaves a background process behind, then another, then answers.
/// While it runs, the first worker is steered.
pub fn fan_out_with_retries_and_steer() -> Scenario {
    let lead = agent_md(
        "tools: [exec]\nsubagents: [worker]\nmax_turns: 10\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: a, label: w1}, {agent: worker, request: b, label: w2}, {agent: worker, request: c, label: w3}, {agent: worker, request: d, label: w4}]}}\n  - call: {tool: submit_output, args: {output: fanned}}",
    );
    let worker = agent_md(
        "description: works with real processes\ntools: [exec, write_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"sleep 5 >/dev/null 2>&1 & sleep 0.02; echo started\"}}\n  - usage: {input: 20, output: 5}\n    delay: 20ms\n    call: {tool: write_file, args: {path: out.txt, content: done}}\n  - call: {tool: submit_output, args: {output: worked}}",
    );
    Scenario::flow_texts(
        None,
        &[("lead", &lead), ("worker", &worker)],
        &[(
            "fan",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"lead\", instruction = \"go\", retries = 100 }]\n",
        )],
        "fan",
    )
    .models(|workspace| {
        let models = FaultyModels::wrapping(Arc::new(arbor_runtime::Models::new(
            &workspace.config.providers,
        )));
        models.on_every_job("worker", [ModelFault::RateLimited]);
        models
    })
    .during(|node, run| {
        Box::pin(async move {
            let worker = node.wait_for(run, "w1").await;
            // Refused once the worker has ended: the steer is part of the
            // workload, not something it must win.
            let _ = node.steer(worker, "be quick").await;
        })
    })
}

/// A step whose first attempt fails (an answer no adapter can parse) and
/// that its retry policy tries again after a wait: the retry's wait is a
/// commit point of its own (I-56).
pub fn retried_step() -> Scenario {
    let flaky = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: second time lucky}}",
    );
    Scenario::flow_texts(
        None,
        &[("flaky", &flaky)],
        &[(
            "retried",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"flaky\", instruction = \"go\", retries = 100, retry = { attempts = 100, wait = \"30ms\" } }]\n",
        )],
        "retried",
    )
    .models(|workspace| {
        let models = FaultyModels::wrapping(Arc::new(arbor_runtime::Models::new(
            &workspace.config.providers,
        )));
        models.on_job("flaky", 0, [ModelFault::Malformed]);
        models
    })
}

/// A step that fails for good and its rescuer (`on_fail`), crashed at
/// every commit point: the rescue's start among them (I-56).
pub fn rescued_step() -> Scenario {
    let flaky = agent_md("script:\n  - usage: {input: 20, output: 5}\n    say: \"\"");
    let fixer = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: rescued}}",
    );
    Scenario::flow_texts(
        None,
        &[("flaky", &flaky), ("fixer", &fixer)],
        &[(
            "rescued",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"flaky\", instruction = \"go\", retries = 100, on_fail = \"fixer\" }]\n",
        )],
        "rescued",
    )
}

/// An outward step (its commands have the network) beside an inward one,
/// crashed at every commit point: after a restart that cut the outward
/// step, its run waits for a person (I-57), who continues it.
pub fn outward_step() -> Scenario {
    let payer = agent_md(
        "tools: [exec]\nnetwork: open\nscript:\n  - usage: {input: 20, output: 5}\n    say: paying\n  - call: {tool: submit_output, args: {output: paid}}",
    );
    let reader = agent_md(
        "tools: [read_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: read}}",
    );
    Scenario::flow_texts(
        None,
        &[("payer", &payer), ("reader", &reader)],
        &[(
            "pay",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"payer\", instruction = \"pay\", retries = 100 }, { agent = \"reader\", instruction = \"read\", retries = 100 }]\n",
        )],
        "pay",
    )
    .after_restart(continue_waiting)
}

/// A person who continues each interrupted step the run waits on, as it
/// comes, until the run ends.
fn continue_waiting(node: &TestNode, run: RunId) -> BoxFuture<'_, ()> {
    Box::pin(async move {
        loop {
            let tree = node
                .node()
                .wait_tree(run, |t| {
                    t.run_status().is_terminal()
                        || matches!(t.head().waiting, Some(WaitingView::NeedsDecision { .. }))
                })
                .await;
            match &tree.head().waiting {
                Some(WaitingView::NeedsDecision { job, .. })
                    if !tree.run_status().is_terminal() =>
                {
                    // The run may end first (a stop wins); either is an outcome.
                    let _ = node.node().continue_job(*job).await;
                }
                _ => return,
            }
        }
    })
}

/// Human gates at every commit point: a step asks about its own
/// `write_file` and, inherited, its child's; a person approves each card as
/// it appears, before and after a crash. A card committed and not yet
/// decided is carried across the crash and decided after it.
pub fn gated_delegation() -> Scenario {
    let lead = agent_md(
        "tools: [write_file]\napprove: [write_file]\nsubagents: [scribe]\nmax_turns: 10\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: scribe, request: note, label: s1}]}}\n  - call: {tool: write_file, args: {path: lead.txt, content: mine}}\n  - call: {tool: submit_output, args: {output: gated}}",
    );
    let scribe = agent_md(
        "description: writes a note\ntools: [write_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: write_file, args: {path: note.txt, content: theirs}}\n  - call: {tool: submit_output, args: {output: noted}}",
    );
    Scenario::flow_texts(
        Some("[approvals]\ntimeout = \"1h\"\n"),
        &[("lead", &lead), ("scribe", &scribe)],
        &[(
            "gated",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"lead\", instruction = \"go\", retries = 100 }]\n",
        )],
        "gated",
    )
    .during(answer_all)
    .after_restart(answer_all)
}

/// People and peers at every commit point (I-60, I-61, I-20): a step asks
/// a question (two choices), then a step waits for a go-ahead, then a
/// `peers` group's reviewer messages its writer; a person answers and
/// approves each card as it appears, before and after a crash. `notify`
/// is arbor.toml text appended (a `[notify.NAME]` endpoint, say): after a
/// restart the scenario waits until nothing is left pending in the outbox.
pub fn people_and_peers(notify: &str) -> Scenario {
    let asker = agent_md(
        "tools: [ask_person]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: ask_person, args: {question: Which colour?, choices: [red, blue]}}\n  - call: {tool: submit_output, args: {output: asked}}",
    );
    let ship = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: shipped}}",
    );
    let writer = agent_md(
        "description: writes\ntools: [exec]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"true\"}}\n  - call: {tool: exec, args: {command: \"true\"}}\n  - call: {tool: submit_output, args: {output: written}}",
    );
    let reviewer = agent_md(
        "description: reviews\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: send_peer, args: {to: draft, text: mention the API}}\n  - call: {tool: submit_output, args: {output: reviewed}}",
    );
    Scenario::flow_texts(
        Some(&format!("[approvals]\ntimeout = \"1h\"\n{notify}")),
        &[
            ("asker", &asker),
            ("ship", &ship),
            ("writer", &writer),
            ("reviewer", &reviewer),
        ],
        &[(
            "people",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"asker\", instruction = \"ask\", retries = 100 }]\n[[group]]\nsteps = [{ agent = \"ship\", instruction = \"ship\", retries = 100, approve = true }]\n[[group]]\npeers = true\nsteps = [{ agent = \"writer\", label = \"draft\", instruction = \"write\", retries = 100 }, { agent = \"reviewer\", label = \"review\", instruction = \"review\", retries = 100 }]\n",
        )],
        "people",
    )
    .during(answer_all)
    .after_restart(|node, run| {
        Box::pin(async move {
            answer_all(node, run).await;
            outbox_drained(node).await;
        })
    })
}

/// Waits, on the deliverer's changes, until no notification is pending
/// (a bound only for a test gone wrong: the check then says what is left).
async fn outbox_drained(node: &TestNode) {
    use arbor_runtime::notify::DeliveryState;
    let Some(notifications) = node.node().notifications() else {
        return;
    };
    let mut changes = notifications.changes();
    let drained = async {
        while notifications
            .list(Some(DeliveryState::Pending))
            .is_ok_and(|p| !p.is_empty())
        {
            if changes.changed().await.is_err() {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(20), drained).await;
}

/// A person who answers every question (`blue`) and approves every other
/// card of the run as it appears (a step's go-ahead waits at the run's
/// node, a call's at its job's), until the run ends.
fn answer_all(node: &TestNode, run: RunId) -> BoxFuture<'_, ()> {
    Box::pin(each_card(node, run, |node, card| {
        Box::pin(async move {
            // A stop or the deadline may win; either is an outcome.
            let _ = match card.kind {
                arbor_protocol::CardKind::Question => node.answer(card.id, "blue").await,
                _ => node.decide(card.id, Verdict::Approve, None, None).await,
            };
        })
    }))
}

/// Acts on each card of the run as it is asked (`act`, once a card), until
/// the run ends.
async fn each_card<'a>(
    node: &'a TestNode,
    run: RunId,
    act: impl Fn(&'a TestNode, arbor_protocol::Card) -> BoxFuture<'a, ()>,
) {
    let mut decided = std::collections::HashSet::new();
    loop {
        let pending = |t: &arbor_protocol::Tree| {
            std::iter::once(t.head())
                .chain(t.nodes().map(|(_, n)| n))
                .filter_map(|n| n.waiting.as_ref().and_then(|w| w.card()))
                .any(|card| !decided.contains(&card))
        };
        let tree = node
            .node()
            .wait_tree(run, |t| t.run_status().is_terminal() || pending(t))
            .await;
        if tree.run_status().is_terminal() {
            return;
        }
        for card in node
            .node()
            .approvals(Some(run), Some(CardState::Pending))
            .unwrap_or_default()
        {
            decided.insert(card.id);
            act(node, card).await;
        }
    }
}

/// A flow of two groups, crashed while its second group's step runs, and
/// the node restarted on the same journal.
pub async fn two_groups_crashed_in_the_second() -> (TestNode, RunId) {
    let first = agent_md(
        "description: first\nscript:\n  - call: {tool: submit_output, args: {output: FIRST}}",
    );
    let second = agent_md(
        "description: second\nscript:\n  - say: thinking\n    delay: 300ms\n    call: {tool: submit_output, args: {output: SECOND}}",
    );
    let flow = "budget = { tokens = 100000 }\n[[group]]\nsteps = [{ agent = \"first\", instruction = \"one\" }]\n[[group]]\nsteps = [{ agent = \"second\", instruction = \"two\" }]\n";
    let node = TestNode::start_workspace(
        None,
        &[("first", &first), ("second", &second)],
        &[("two", flow)],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await;
    let run = node.run_flow("two").await;
    node.wait_status(run, "second", Status::Running).await;
    (node.crash_and_restart().await, run)
}

/// The name the audited person acts under, and what it writes.
pub const AUDITOR: &str = "auditor";
const AUDITED_STEER: &str = "audited: be brief";
const AUDITED_STOP: &str = "stopped by an operator (audited)";

/// Operators' calls at every commit point (I-64): a step asks for a
/// go-ahead on its call and is steered, then approved; a slow step beside
/// it is stopped. Each call carries its audit entry, as arbord's API hands
/// it down, to be committed with the change; after a restart the person
/// goes on approving what is pending.
pub fn audited_calls() -> Scenario {
    let writer = agent_md(
        "tools: [write_file]\napprove: [write_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: write_file, args: {path: out.txt, content: hello}}\n  - call: {tool: submit_output, args: {output: wrote}}",
    );
    let slow = agent_md(
        "script:\n  - say: thinking\n    delay: 8s\n  - call: {tool: submit_output, args: {output: late}}",
    );
    Scenario::flow_texts(
        Some("[approvals]\ntimeout = \"1h\"\n"),
        &[("writer", &writer), ("slow", &slow)],
        &[(
            "audited",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"go\", retries = 100 }, { agent = \"slow\", instruction = \"wait\", optional = true, retries = 100 }]\n",
        )],
        "audited",
    )
    .during(operator)
    .after_restart(operator)
}

/// Stops the slow step, then steers and approves the writer, each call
/// with its entry (before a crash, and again after it).
fn operator(node: &TestNode, run: RunId) -> BoxFuture<'_, ()> {
    Box::pin(async move {
        let running = |t: &arbor_protocol::Tree| {
            t.nodes()
                .find(|(_, n)| n.label.as_deref() == Some("slow") && n.status == Status::Running)
                .map(|(id, _)| id)
        };
        let stop_slow = async {
            let tree = node
                .node()
                .wait_tree(run, |t| {
                    t.run_status().is_terminal() || running(t).is_some()
                })
                .await;
            if let Some(slow) = running(&tree) {
                let entry = audit_entry(node, "POST /v1/jobs/{id}/stop", slow.to_string());
                let _ = node
                    .node()
                    .stop_job_with(run, slow, AUDITED_STOP, Some(entry))
                    .await;
            }
        };
        tokio::join!(stop_slow, audited_approvals(node, run));
    })
}

/// An audit entry of the `auditor`'s call on `route`, about `target`, as
/// `node`'s service would make it.
pub fn audit_entry(node: &TestNode, route: &str, target: String) -> arbor_storage::Record {
    let entry = arbor_service::audit::AuditRecord {
        // A uuid v7, as the service makes them.
        id: RunId::new().0,
        at_ms: arbor_actors::events::now_ms(),
        subject: AUDITOR.into(),
        tenant: None,
        role: None,
        route: route.into(),
        target: Some(target),
        outcome: arbor_service::audit::AuditOutcome::Ok,
        status: 202,
        client: None,
        epoch: node.journal().epoch(),
    };
    arbor_storage::Record::Row(arbor_service::audit::AUDIT.row(&entry).expect("it encodes"))
}

/// Each pending card: its job steered, then the card approved, each call
/// with its entry.
async fn audited_approvals(node: &TestNode, run: RunId) {
    each_card(node, run, |node, card| {
        Box::pin(async move {
            let entry = audit_entry(node, "POST /v1/jobs/{id}/messages", card.job.to_string());
            let _ = node
                .node()
                .steer_with(card.job, AUDITED_STEER, Some(entry))
                .await;
            let decide = arbor_runtime::Decide {
                verdict: Verdict::Approve,
                reason: None,
                args: None,
                answer: None,
                by: AUDITOR.into(),
                audit: Some(audit_entry(
                    node,
                    "POST /v1/approvals/{id}",
                    card.id.to_string(),
                )),
            };
            let _ = node.node().decide(card.id, decide).await;
        })
    })
    .await;
}

/// I-64's check of `audited_calls`: each change an operator asked for has
/// its entry, and each entry its change.
pub fn audit_matches_changes(node: &TestNode, run: RunId) -> Result<usize, String> {
    let journal = node.journal();
    let entries = arbor_service::audit::entries(journal).map_err(|e| e.to_string())?;
    let target = |route: &str, id: &str| {
        entries
            .iter()
            .filter(|e| e.route == route && e.target.as_deref() == Some(id))
            .count()
    };
    let cards = node
        .node()
        .approvals(Some(run), None)
        .map_err(|e| e.to_string())?;
    for card in &cards {
        let by_auditor = card.decision.as_ref().is_some_and(|d| d.by == AUDITOR);
        let logged = target("POST /v1/approvals/{id}", &card.id.to_string());
        if by_auditor != (logged == 1) {
            return Err(format!(
                "card {}: decided by the auditor {by_auditor}, {logged} entries",
                card.id
            ));
        }
    }
    let jobs = journal.jobs(run).map_err(|e| e.to_string())?;
    for job in &jobs {
        let steered = journal
            .steering(job.id)
            .map_err(|e| e.to_string())?
            .iter()
            .any(|s| s.text == AUDITED_STEER);
        let logged = target("POST /v1/jobs/{id}/messages", &job.id.to_string());
        if steered != (logged == 1) {
            return Err(format!("{}: steered {steered}, {logged} entries", job.id));
        }
        let stopped = job.reason.as_deref() == Some(AUDITED_STOP);
        let logged = target("POST /v1/jobs/{id}/stop", &job.id.to_string());
        if stopped != (logged == 1) {
            return Err(format!("{}: stopped {stopped}, {logged} entries", job.id));
        }
    }
    Ok(entries.len())
}

/// Two loops in one group, crashed at every commit point (I-56): a command
/// loop whose worker counts itself in its workdir and passes once the count
/// reaches 2, and an optional judge loop whose judge always asks for a
/// revision, ended by its `max_iterations`; each iteration's end and each
/// check (a verdict among them) is a commit point of its own.
pub fn looped_steps() -> Scenario {
    let counter = agent_md(
        "tools: [exec]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count\"}}\n  - call: {tool: submit_output, args: {output: counted}}",
    );
    let writer = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: a draft}}",
    );
    let critic = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: {verdict: revise, issues: [too short]}}}",
    );
    Scenario::flow_texts(
        None,
        &[
            ("counter", &counter),
            ("writer", &writer),
            ("critic", &critic),
        ],
        &[(
            "looped",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"counter\", instruction = \"count\", retries = 100, rerun_interrupted = true, until = { command = \"test $(cat count) -ge 2\" } }, { agent = \"writer\", instruction = \"write\", retries = 100, optional = true, until = { judge = \"critic\", max_iterations = 2 } }]\n",
        )],
        "looped",
    )
}

/// Two groups and a reviewer (`verify`) that finds something missing,
/// crashed at every commit point: the review, and the last group's second
/// round, among them.
pub fn reviewed_run() -> Scenario {
    let say = |what: &str| {
        agent_md(&format!(
            "script:\n  - usage: {{input: 20, output: 5}}\n    call: {{tool: submit_output, args: {{output: {what}}}}}"
        ))
    };
    let checker = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    call: {tool: submit_output, args: {output: {accept: false, missing: [a title]}}}",
    );
    Scenario::flow_texts(
        None,
        &[
            ("finder", &say("facts")),
            ("writer", &say("a report")),
            ("checker", &checker),
        ],
        &[(
            "reviewed",
            "budget = { tokens = 1000000 }\nverify = \"checker\"\n[[group]]\nsteps = [{ agent = \"finder\", instruction = \"find\", retries = 100 }]\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\", retries = 100 }]\n",
        )],
        "reviewed",
    )
}

/// A run topped up while its first group runs (I-58), crashed at every
/// commit point: the top-up's grant among them. Its second group is
/// granted from the larger ceiling.
pub fn topped_up_run() -> Scenario {
    let step = agent_md(
        "script:\n  - usage: {input: 20, output: 5}\n    delay: 20ms\n    call: {tool: submit_output, args: {output: done}}",
    );
    Scenario::flow_texts(
        None,
        &[("step", &step)],
        &[(
            "topped",
            "budget = { tokens = 100000 }\n[[group]]\nsteps = [{ agent = \"step\", instruction = \"one\", label = \"first\", retries = 100 }]\n[[group]]\nsteps = [{ agent = \"step\", instruction = \"two\", label = \"second\", retries = 100 }]\n",
        )],
        "topped",
    )
    .during(|node, run| {
        Box::pin(async move {
            node.wait_for(run, "first").await;
            // Refused once the run has ended: part of the workload, not a race it must win.
            let amount = arbor_protocol::Amount {
                tokens: 50_000,
                usd_micros: 0,
            };
            let _ = node.node().top_up(run, amount, None).await;
        })
    })
}

/// A run that pauses at its ceiling (I-58) and is topped up while it
/// waits, crashed at every commit point: the pause and the top-up among
/// them. A run the crash left paused is topped up on the recovered node.
pub fn paused_run() -> Scenario {
    let spender = agent_md(
        "script:\n  - usage: {input: 100, output: 900}\n    call: {tool: collect, args: {}}\n  - usage: {input: 10, output: 10}\n    call: {tool: submit_output, args: {output: finished}}",
    );
    Scenario::flow_texts(
        None,
        &[("spender", &spender)],
        &[(
            "paused",
            "budget = { tokens = 1000 }\non_ceiling = \"pause\"\n[[group]]\nsteps = [{ agent = \"spender\", instruction = \"spend\", retries = 100 }]\n",
        )],
        "paused",
    )
    .during(top_up_when_paused)
    .after_restart(top_up_when_paused)
}

/// Once the run pauses at its ceiling (or has ended), a top-up of 20,000 tokens.
fn top_up_when_paused(node: &TestNode, run: RunId) -> BoxFuture<'_, ()> {
    Box::pin(async move {
        node.wait_until(run, |t| {
            t.run_status().is_terminal()
                || matches!(t.head().waiting, Some(WaitingView::Budget { .. }))
        })
        .await;
        let amount = arbor_protocol::Amount {
            tokens: 20_000,
            usd_micros: 0,
        };
        // Refused once the run has ended: part of the workload.
        let _ = node.node().top_up(run, amount, None).await;
    })
}

/// A run whose workspace is deployed again (an edited agent) while its
/// first group runs (I-67), crashed at every commit point, the new
/// version's among them: the run keeps the version it was admitted with.
pub fn deployed_mid_run() -> Scenario {
    let step = |said: &str| {
        agent_md(&format!(
            "script:\n  - delay: 20ms\n    call: {{tool: submit_output, args: {{output: {said}}}}}"
        ))
    };
    let flow = "[[group]]\nsteps = [{ agent = \"step\", instruction = \"one\", label = \"first\" }]\n[[group]]\nsteps = [{ agent = \"step\", instruction = \"two\", label = \"second\" }]\n";
    let (v1, v2) = (step("said-v1"), step("said-v2"));
    Scenario::flow_texts(None, &[("step", &v1)], &[("pinned", flow)], "pinned").during(
        move |node, run| {
            let v2 = v2.clone();
            Box::pin(async move {
                node.wait_for(run, "first").await;
                let edited = arbor_runtime::Workspace::from_texts(
                    node.workspace.root.clone(),
                    None,
                    &[("step", &v2)],
                    &[("pinned", flow)],
                )
                .expect("the edited workspace loads");
                // Refused once the node is closing: part of the workload.
                let _ = node.node().deploy(&edited).await;
            })
        },
    )
}
