//! Human gates (I-46, I-47): a gated call waits on a card that is durable
//! before anyone sees it, runs only after a committed approval, and has one
//! outcome whatever races; a pending card survives a kill with its deadline.

use arbor_protocol::{CardState, EventKind, RunId, Status, Verdict};
use arbor_runtime::DecideError;
use arbor_testkit::{TestNode, agent_md};
use serde_json::json;

/// An agent that writes `out.txt` (gated), then answers.
fn writer(extra: &str) -> String {
    agent_md(&format!(
        "tools: [write_file]\napprove: [write_file]\n{extra}script:\n  - call: {{tool: write_file, args: {{path: out.txt, content: hello}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ))
}

/// What the step (its last attempt) wrote, if anything.
fn written(node: &TestNode, run: RunId) -> Option<String> {
    let root = node.tree(run).root();
    let step = root
        .children
        .iter()
        .rev()
        .find(|s| s.agent.as_deref() == Some("writer"))?;
    let dir = node.workdir(run, step.id.parse().ok()?);
    std::fs::read_to_string(dir.join("out.txt")).ok()
}

/// The events of one card, in order, as (kind, state).
fn card_events(node: &TestNode, run: RunId) -> Vec<(&'static str, Option<CardState>)> {
    node.events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ApprovalRequested { .. } => Some(("requested", None)),
            EventKind::ApprovalExpiring { .. } => Some(("expiring", None)),
            EventKind::ApprovalDecided { state, .. } => Some(("decided", Some(state))),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn inv_46_an_approved_call_runs_only_after_its_approval_is_committed() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(card.tool, "write_file");
    assert_eq!(card.lineage, ["writer"]);
    assert_eq!(card.args, json!({"path": "out.txt", "content": "hello"}));
    assert!(card.deadline_ms > card.asked_at_ms);
    // The job waits: its node is marked (the card was durable first), and
    // nothing was written.
    let tree = node
        .wait_until(run, |t| t.root().children[0].waiting.is_some())
        .await;
    let step = &tree.root().children[0];
    assert_eq!(step.waiting.as_ref().and_then(|w| w.card()), Some(card.id));
    assert_eq!(written(&node, run), None);

    let decided = node
        .decide(card.id, Verdict::Approve, Some("looks right"), None)
        .await
        .expect("a pending card takes a decision");
    assert_eq!(decided.state, CardState::Approved);
    let decision = decided.decision.as_ref().unwrap();
    assert_eq!(
        (decision.by.as_str(), decision.reason.as_deref()),
        ("tester", Some("looks right"))
    );
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(written(&node, run).as_deref(), Some("hello"));
    assert_eq!(
        node.cards(run),
        std::slice::from_ref(&decided),
        "one card, as decided"
    );
    assert!(tree.root().children[0].waiting.is_none());
    // The decision is in the journal before the tool's result.
    let events = node.events(run);
    let at = |f: &dyn Fn(&EventKind) -> bool| events.iter().position(|e| f(&e.kind)).unwrap();
    let decided_at = at(&|k| matches!(k, EventKind::ApprovalDecided { .. }));
    let called_at =
        at(&|k| matches!(k, EventKind::ToolCalled { tool, .. } if tool == "write_file"));
    assert!(decided_at < called_at);
    // A second decision finds it closed.
    let again = node
        .decide(card.id, Verdict::Reject, Some("no"), None)
        .await;
    assert_eq!(
        again,
        Err(DecideError::Closed {
            id: card.id,
            state: CardState::Approved
        })
    );
}

#[tokio::test]
async fn inv_46_a_rejected_call_never_runs_and_the_model_reads_why() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    let refused = node
        .decide(card.id, Verdict::Reject, Some("  "), None)
        .await;
    assert!(
        matches!(&refused, Err(DecideError::Invalid(m)) if m.contains("reason")),
        "{refused:?}"
    );
    assert_eq!(
        node.cards(run)[0].state,
        CardState::Pending,
        "nothing changed"
    );
    node.decide(card.id, Verdict::Reject, Some("not on a Friday"), None)
        .await
        .unwrap();
    node.wait_run(run).await;
    assert_eq!(written(&node, run), None);
    let failed = node.failed_calls(run, "write_file");
    assert_eq!(failed.len(), 1);
    assert!(failed[0].contains("rejected") && failed[0].contains("not on a Friday"));
    assert_eq!(
        card_events(&node, run),
        [("requested", None), ("decided", Some(CardState::Rejected))]
    );
}

#[tokio::test]
async fn inv_46_an_edit_runs_with_the_edited_arguments_and_bad_ones_change_nothing() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    for bad in [
        json!({"path": 5}),
        json!({"path": "a", "content": "b", "mode": 1}),
    ] {
        let refused = node
            .decide(card.id, Verdict::Edit, None, Some(bad.clone()))
            .await;
        assert!(
            matches!(&refused, Err(DecideError::Invalid(m)) if m.contains("edited arguments")),
            "{bad}: {refused:?}"
        );
    }
    let no_args = node.decide(card.id, Verdict::Edit, None, None).await;
    assert!(matches!(no_args, Err(DecideError::Invalid(_))));
    assert_eq!(node.cards(run)[0].state, CardState::Pending);
    let edited = json!({"path": "out.txt", "content": "edited"});
    let card = node
        .decide(card.id, Verdict::Edit, None, Some(edited.clone()))
        .await
        .unwrap();
    assert_eq!((card.state, &card.args), (CardState::Approved, &edited));
    assert!(card.decision.unwrap().edited);
    node.wait_run(run).await;
    assert_eq!(written(&node, run).as_deref(), Some("edited"));
}

#[tokio::test]
async fn inv_46_an_unanswered_card_warns_then_expires_and_that_is_not_a_rejection() {
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"300ms\"\nwarn_at = 0.5\n",
        &[("writer", &writer(""))],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(
        tree.run_status(),
        Status::Done,
        "the agent goes on without it"
    );
    assert_eq!(written(&node, run), None);
    assert_eq!(
        card_events(&node, run),
        [
            ("requested", None),
            ("expiring", None),
            ("decided", Some(CardState::Expired))
        ]
    );
    let failed = node.failed_calls(run, "write_file");
    assert!(failed[0].contains("not a rejection"), "{failed:?}");
    let card = &node.cards(run)[0];
    assert_eq!(card.decision.as_ref().unwrap().by, "arbor");
    let late = node.decide(card.id, Verdict::Approve, None, None).await;
    assert!(matches!(
        late,
        Err(DecideError::Closed {
            state: CardState::Expired,
            ..
        })
    ));
}

#[tokio::test]
async fn inv_46_a_stop_while_pending_cancels_the_card_and_the_tool_never_runs() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Stopped);
    let after = node.decide(card.id, Verdict::Approve, None, None).await;
    assert!(
        matches!(
            after,
            Err(DecideError::Closed {
                state: CardState::Cancelled,
                ..
            })
        ),
        "{after:?}"
    );
    assert_eq!(node.cards(run)[0].state, CardState::Cancelled);
    assert_eq!(written(&node, run), None);
    assert!(
        node.tool_calls(run)
            .iter()
            .all(|c| c.tool != "write_file" || !c.ok),
        "no output from the stopped call"
    );
}

#[tokio::test]
async fn inv_46_two_concurrent_decisions_have_one_winner_and_the_other_gets_a_conflict() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    let (a, b) = tokio::join!(
        node.decide(card.id, Verdict::Approve, None, None),
        node.decide(card.id, Verdict::Reject, Some("no"), None),
    );
    let (won, lost) = match (a, b) {
        (Ok(won), Err(lost)) | (Err(lost), Ok(won)) => (won, lost),
        other => panic!("exactly one decision wins: {other:?}"),
    };
    assert_eq!(
        lost,
        DecideError::Closed {
            id: card.id,
            state: won.state
        }
    );
    node.wait_run(run).await;
    assert_eq!(node.cards(run)[0].state, won.state);
    assert_eq!(
        written(&node, run).is_some(),
        won.state == CardState::Approved
    );
    let decided = card_events(&node, run)
        .into_iter()
        .filter(|(k, _)| *k == "decided")
        .count();
    assert_eq!(decided, 1);
}

#[tokio::test]
async fn inv_46_a_decision_racing_the_deadline_gets_one_outcome() {
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"200ms\"\nwarn_at = 0.9\n",
        &[("writer", &writer(""))],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    // Decide as the deadline comes: whichever the gate takes first wins.
    node.wait_event(run, |k| matches!(k, EventKind::ApprovalExpiring { .. }))
        .await;
    let decision = node.decide(card.id, Verdict::Approve, None, None).await;
    node.wait_run(run).await;
    let outcome = node.cards(run)[0].state;
    match decision {
        Ok(card) => assert_eq!(
            (card.state, outcome),
            (CardState::Approved, CardState::Approved)
        ),
        Err(e) => assert_eq!(
            (e, outcome),
            (
                DecideError::Closed {
                    id: card.id,
                    state: CardState::Expired
                },
                CardState::Expired
            )
        ),
    }
    assert_eq!(
        written(&node, run).is_some(),
        outcome == CardState::Approved
    );
    let decided: Vec<_> = card_events(&node, run)
        .into_iter()
        .filter(|(k, _)| *k == "decided")
        .collect();
    assert_eq!(decided, [("decided", Some(outcome))]);
}

#[tokio::test]
async fn inv_46_a_card_from_a_delegated_child_is_in_the_one_queue_with_its_lineage() {
    // The step asks about write_file; its child inherits the ask.
    let boss = agent_md(
        "tools: [write_file]\napprove: [write_file]\nsubagents: [scribe]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: scribe, request: write, label: notes}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let scribe = agent_md(
        "description: writes\ntools: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: n.txt, content: x}}\n  - call: {tool: submit_output, args: {output: written}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("scribe", &scribe)]).await;
    let run = node.run_agent("boss", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(card.lineage, ["boss", "notes"]);
    assert_eq!(card.agent, "scribe");
    let all = node.node().approvals(None, None).unwrap();
    assert_eq!(all, std::slice::from_ref(&card));
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    let notes = tree.find("notes").unwrap();
    assert!(node.workdir(run, notes).join("n.txt").is_file());
}

#[tokio::test]
async fn inv_46_a_waiting_job_holds_nothing_and_its_wall_timeout_is_paused() {
    // The card waits longer than the job's own timeout: were the timeout
    // running, the job would fail as timed out before the card expired.
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"900ms\"\n",
        &[("writer", &writer("timeout: 300ms\n"))],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    node.wait_card(run).await;
    let step = &node.tree(run).root().children[0];
    assert_eq!(
        step.account.held, 0,
        "no model call reserved while it waits"
    );
    let tree = node.wait_run(run).await;
    let step = &tree.root().children[0];
    assert_eq!(
        (step.status, step.error_class),
        (Status::Done, None),
        "{:?}",
        step.reason
    );
    assert_eq!(node.cards(run)[0].state, CardState::Expired);
}

#[tokio::test]
async fn inv_47_a_pending_card_survives_a_kill_with_its_deadline_and_is_not_asked_again() {
    let node = TestNode::start(&[("writer", &writer(""))]).await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    let node = node.crash_and_restart().await;
    // The same card, pending, with its deadline: the resumed step waits on it.
    let again = node.wait_card(run).await;
    assert_eq!(
        (again.id, again.deadline_ms, again.asked_at_ms),
        (card.id, card.deadline_ms, card.asked_at_ms)
    );
    node.wait_until(run, |t| {
        t.root().children.iter().any(|s| {
            s.status == Status::Running
                && s.waiting.as_ref().and_then(|w| w.card()) == Some(card.id)
        })
    })
    .await;
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(node.cards(run).len(), 1, "not asked again");
    assert_eq!(written(&node, run).as_deref(), Some("hello"));
}

#[tokio::test]
async fn inv_47_an_expiry_that_fell_due_while_the_node_was_down_is_applied_at_recovery() {
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"400ms\"\n",
        &[("writer", &writer(""))],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    let workspace = node.workspace.clone();
    let models = node.models();
    let dir = node.crash().await;
    // Down past the card's deadline: the condition, not a synchronisation.
    let deadline = std::time::UNIX_EPOCH + std::time::Duration::from_millis(card.deadline_ms + 1);
    if let Ok(left) = deadline.duration_since(std::time::SystemTime::now()) {
        tokio::time::sleep(left).await;
    }
    let node = TestNode::open(workspace, &dir.path().join("data"), models)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    let cards = node.cards(run);
    assert_eq!(cards.len(), 1, "not asked again");
    assert_eq!(cards[0].state, CardState::Expired);
    let reason = cards[0].decision.as_ref().unwrap().reason.clone().unwrap();
    assert!(reason.contains("while the node was down"), "{reason}");
    assert_eq!(written(&node, run), None);
    assert!(
        node.failed_calls(run, "write_file")
            .iter()
            .any(|f| f.contains("not a rejection"))
    );
}

#[tokio::test]
async fn inv_27_a_card_shows_no_secrets_value_and_clips_long_arguments() {
    let secrets = tempfile::tempdir().unwrap();
    let value = "tok-card-5e6f7a8b";
    let config =
        arbor_testkit::secrets_file(secrets.path(), &format!("API_TOKEN={value}\n"), 0o600);
    let long = "x".repeat(5000);
    let leaker = agent_md(&format!(
        "tools: [write_file]\nsecrets: [API_TOKEN]\napprove: [write_file]\nscript:\n  - call: {{tool: write_file, args: {{path: \"key-{value}.txt\", content: \"{value} {long}\"}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let node = TestNode::start_with_config(&config, &[("leaker", &leaker)]).await;
    let run = node.run_agent("leaker", "go").await;
    let card = node.wait_card(run).await;
    let shown = card.args.to_string();
    assert!(!shown.contains(value), "{shown}");
    let content = card.args["content"].as_str().unwrap();
    assert!(content.len() < 2100, "clipped: {} bytes", content.len());
    // Nor is it in the journal's record or the events.
    let events = serde_json::to_string(&node.events(run)).unwrap();
    assert!(!events.contains(value));
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    node.wait_run(run).await;
    // The call ran with the model's own arguments, not the card's.
    let root = node.tree(run).root();
    let dir = node.workdir(run, root.children[0].id.parse().unwrap());
    let written = std::fs::read_to_string(dir.join(format!("key-{value}.txt"))).unwrap();
    assert_eq!(written, format!("{value} {long}"));
}

// ---------------------------------------------------------------- questions

/// An agent that asks which colour, from two choices, then answers with
/// what it read.
fn asker(extra: &str) -> String {
    agent_md(&format!(
        "tools: [ask_person]\n{extra}script:\n  - call: {{tool: ask_person, args: {{question: Which colour?, choices: [red, blue]}}}}\n  - call: {{tool: submit_output, args: {{output: asked}}}}"
    ))
}

/// What the asker's model read back from its question: (text, is_error).
fn heard(node: &TestNode, run: RunId) -> (String, bool) {
    let call = node
        .tool_calls(run)
        .into_iter()
        .find(|c| c.tool == "ask_person")
        .expect("the question was asked");
    (call.detail, !call.ok)
}

/// I-60: a question is a card of kind `question`, durable before it is
/// listed; its answer (one of its choices) is the tool's result, once;
/// answering it as a call, or off its choices, changes nothing.
#[tokio::test]
async fn inv_60_a_question_is_a_card_and_its_answer_is_the_result() {
    use arbor_protocol::CardKind;
    let node = TestNode::start(&[("asker", &asker(""))]).await;
    let run = node.run_agent("asker", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(
        (card.kind, card.tool.as_str()),
        (CardKind::Question, "ask_person")
    );
    assert_eq!(
        card.args,
        json!({"question": "Which colour?", "choices": ["red", "blue"]})
    );
    node.wait_until(run, |t| t.root().children[0].waiting.is_some())
        .await;

    let wrong = node.decide(card.id, Verdict::Approve, None, None).await;
    assert!(
        matches!(&wrong, Err(DecideError::Invalid(e)) if e.contains("is a question")),
        "{wrong:?}"
    );
    let off = node.answer(card.id, "green").await;
    assert!(
        matches!(&off, Err(DecideError::Invalid(e)) if e.contains("red, blue")),
        "{off:?}"
    );
    assert_eq!(
        node.cards(run)[0].state,
        CardState::Pending,
        "nothing changed"
    );

    let answered = node.answer(card.id, " blue ").await.unwrap();
    assert_eq!(answered.state, CardState::Answered);
    assert_eq!(
        answered.decision.as_ref().and_then(|d| d.answer.as_deref()),
        Some("blue")
    );
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    let (text, error) = heard(&node, run);
    assert!(
        !error && text.contains("The person answered: blue"),
        "{text}"
    );
    assert_eq!(
        card_events(&node, run),
        [("requested", None), ("decided", Some(CardState::Answered))]
    );
    let again = node.answer(card.id, "red").await;
    assert!(matches!(
        again,
        Err(DecideError::Closed {
            state: CardState::Answered,
            ..
        })
    ));
    // A question's card is read back from the journal as it was written.
    let stored = &node.cards(run)[0];
    assert_eq!(
        (stored.kind, stored.state),
        (CardKind::Question, CardState::Answered)
    );
}

/// I-60: an unanswered question expires as "no answer" (the agent goes
/// on); a stop while it waits cancels it; a bad question makes no card.
#[tokio::test]
async fn inv_60_a_question_expires_as_no_answer_and_a_stop_cancels_it() {
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"300ms\"\n",
        &[("asker", &asker(""))],
    )
    .await;
    let run = node.run_agent("asker", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "it goes on without one");
    let (text, error) = heard(&node, run);
    assert!(error && text.contains("no answer"), "{text}");
    assert_eq!(node.cards(run)[0].state, CardState::Expired);

    let node = TestNode::start(&[("asker", &asker(""))]).await;
    let run = node.run_agent("asker", "go").await;
    let card = node.wait_card(run).await;
    node.stop_run(run).await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Stopped);
    assert_eq!(node.cards(run)[0].state, CardState::Cancelled);
    let late = node.answer(card.id, "red").await;
    assert!(matches!(
        late,
        Err(DecideError::Closed {
            state: CardState::Cancelled,
            ..
        })
    ));

    let bad = agent_md(
        "tools: [ask_person]\nscript:\n  - call: {tool: ask_person, args: {question: \"  \"}}\n  - call: {tool: ask_person, args: {question: Which?, choices: [a, a]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = TestNode::start(&[("bad", &bad)]).await;
    let run = node.run_agent("bad", "go").await;
    node.wait_run(run).await;
    let failed = node.failed_calls(run, "ask_person");
    assert!(failed[0].contains("question is empty"), "{failed:?}");
    assert!(failed[1].contains("given twice"), "{failed:?}");
    assert!(node.cards(run).is_empty(), "no card for a bad question");
}

/// I-60: a question pending across a kill -9 keeps its card and deadline;
/// the resumed step waits on it, is not asked again, and reads the answer.
#[tokio::test]
async fn inv_60_a_pending_question_survives_a_kill_and_is_answered_once() {
    let node = TestNode::start(&[("asker", &asker(""))]).await;
    let run = node.run_agent("asker", "go").await;
    let card = node.wait_card(run).await;
    let node = node.crash_and_restart().await;
    let again = node.wait_card(run).await;
    assert_eq!((again.id, again.deadline_ms), (card.id, card.deadline_ms));
    node.wait_until(run, |t| {
        t.root().children.iter().any(|s| {
            s.status == Status::Running
                && s.waiting.as_ref().and_then(|w| w.card()) == Some(card.id)
        })
    })
    .await;
    node.answer(card.id, "red").await.unwrap();
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    assert_eq!(node.cards(run).len(), 1, "not asked again");
    let (text, error) = heard(&node, run);
    assert!(!error && text.contains("answered: red"), "{text}");
}

// ---------------------------------------------------------------- step gates

const SHIP: &str = "---\ndescription: ships\nscript:\n  - call: {tool: submit_output, args: {output: shipped}}\n---\nYou ship.\n";
const CHECK: &str = "---\ndescription: checks\nscript:\n  - call: {tool: submit_output, args: {output: checked}}\n---\nYou check.\n";
/// A check, then a deploy that waits for a person's go-ahead.
const GATED: &str = "[[group]]\nsteps = [{ agent = \"check\", instruction = \"Check.\" }]\n\
    [[group]]\nsteps = [{ agent = \"ship\", instruction = \"Ship v2.\", label = \"deploy\", approve = true }]\n";

/// I-60: a gated step does not start until its card (kind `step`, showing
/// the step, its agent and its instruction) is approved; the run waits
/// meanwhile, and a rejection ends the step failed with the reason.
#[tokio::test]
async fn inv_60_a_step_gate_lets_the_step_start_only_once_approved_and_a_rejection_fails_it() {
    use arbor_protocol::CardKind;
    let node =
        TestNode::start_with_flows("", &[("ship", SHIP), ("check", CHECK)], &[("gated", GATED)])
            .await;
    let run = node.run_flow("gated").await;
    let card = node.wait_card(run).await;
    assert_eq!((card.kind, card.tool.as_str()), (CardKind::Step, "step"));
    assert_eq!(
        card.args,
        json!({"label": "deploy", "agent": "ship", "instruction": "Ship v2."})
    );
    let tree = node.wait_until(run, |t| t.root().waiting.is_some()).await;
    assert!(tree.find("check").is_some(), "the group before ran");
    assert!(tree.find("deploy").is_none(), "nothing of the step started");
    let edit = node
        .decide(card.id, Verdict::Edit, None, Some(json!({})))
        .await;
    assert!(matches!(&edit, Err(DecideError::Invalid(e)) if e.contains("no arguments")));
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(tree.root().output, "shipped");
    assert_eq!(tree.root().waiting, None);

    let run = node.run_flow("gated").await;
    let card = node.wait_card(run).await;
    node.decide(card.id, Verdict::Reject, Some("freeze until Monday"), None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    let reason = tree.root().reason.clone().unwrap_or_default();
    assert!(
        reason.contains("step deploy failed") && reason.contains("freeze until Monday"),
        "{reason}"
    );
    assert!(tree.find("deploy").is_none(), "it never started");
    node.assert_conserved(run);
}

/// I-60: a step's go-ahead pending across a kill -9 keeps its card and
/// deadline; once approved after the restart, the step runs once.
#[tokio::test]
async fn inv_60_a_pending_step_gate_survives_a_kill() {
    let node =
        TestNode::start_with_flows("", &[("ship", SHIP), ("check", CHECK)], &[("gated", GATED)])
            .await;
    let run = node.run_flow("gated").await;
    let card = node.wait_card(run).await;
    let node = node.crash_and_restart().await;
    let again = node.wait_card(run).await;
    assert_eq!((again.id, again.deadline_ms), (card.id, card.deadline_ms));
    node.wait_until(run, |t| t.root().waiting.is_some()).await;
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
    assert_eq!(node.cards(run).len(), 1, "not asked again");
    let checks = node
        .jobs(run)
        .iter()
        .filter(|j| j.agent.as_deref() == Some("check"))
        .count();
    assert_eq!(checks, 1, "the finished group is not run again");
}

/// An agent whose `write_file` runs at once and is recorded (notify mode),
/// with a secret in what it writes.
fn notifier(approve: &str) -> String {
    agent_md(&format!(
        "description: writes\ntools: [write_file]\nsecrets: [API_TOKEN]\napprove: [{approve}]\nscript:\n  - call: {{tool: write_file, args: {{path: out.txt, content: \"hello s3cr3t-v4lue\"}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ))
}

/// I-60: a notify-mode call runs at once, nobody asked; its card, decided
/// `ran` as it is made, records the tool, the arguments (the secret
/// redacted), the result and the undo hint, is durable and listed like any
/// other card, and is told as a decision.
#[tokio::test]
async fn inv_60_a_notify_mode_call_runs_at_once_and_its_record_card_is_decided_ran() {
    let secrets = tempfile::tempdir().unwrap();
    let config = arbor_testkit::secrets_file(secrets.path(), "API_TOKEN=s3cr3t-v4lue\n", 0o600);
    let node = TestNode::start_with_config(
        &config,
        &[(
            "writer",
            &notifier("{tool: write_file, mode: notify, undo: \"delete out.txt\"}"),
        )],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(written(&node, run).as_deref(), Some("hello s3cr3t-v4lue"));
    let cards = node.cards(run);
    assert_eq!(cards.len(), 1, "{cards:#?}");
    let card = &cards[0];
    assert_eq!(card.state, CardState::Ran);
    assert_eq!(card.tool, "write_file");
    assert_eq!(card.undo.as_deref(), Some("delete out.txt"));
    assert!(!card.args.to_string().contains("s3cr3t"), "{}", card.args);
    let result = card.result.as_deref().unwrap();
    assert!(!result.is_empty() && !result.contains("s3cr3t"), "{result}");
    assert_eq!(card.decision.as_ref().unwrap().by, "notify");
    assert_eq!(card_events(&node, run), [("decided", Some(CardState::Ran))]);
    // Durable: the journal's record reads back as the same card.
    let stored = node
        .node()
        .approvals(Some(run), Some(CardState::Ran))
        .unwrap();
    assert_eq!(stored, cards);
}

/// An `approve:` entry's own wait replaces `[approvals] timeout` for its
/// tool; a child's notify entry cannot loosen its parent's ask.
#[tokio::test]
async fn an_entrys_own_wait_holds_and_a_child_cannot_loosen_its_parents_ask() {
    let node = TestNode::start_with_config(
        "[approvals]\ntimeout = \"1h\"\n",
        &[(
            "writer",
            &writer("").replace(
                "approve: [write_file]",
                "approve: [{tool: write_file, timeout: 250ms}]",
            ),
        )],
    )
    .await;
    let run = node.run_agent("writer", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(card.deadline_ms - card.asked_at_ms, 250);
    node.wait_run(run).await;
    assert_eq!(node.cards(run)[0].state, CardState::Expired);

    let parent = agent_md(
        "tools: [write_file]\napprove: [write_file]\nsubagents: [writer]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: writer, request: write, label: w}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let child = notifier("{tool: write_file, mode: notify}");
    let secrets = tempfile::tempdir().unwrap();
    let config = arbor_testkit::secrets_file(secrets.path(), "API_TOKEN=s3cr3t-v4lue\n", 0o600);
    let node =
        TestNode::start_with_config(&config, &[("parent", &parent), ("writer", &child)]).await;
    let run = node.run_agent("parent", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(card.state, CardState::Pending, "asked, not run at once");
    assert_eq!(card.lineage, ["parent", "w"]);
}
