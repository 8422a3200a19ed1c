//! Steering (I-20): queued with an id, delivered in order at a turn boundary,
//! refused once the job ended, discarded if it ends first.

use arbor_actors::model::Message;
use arbor_protocol::{EventKind, Status};
use arbor_testkit::{RecordingModels, TestNode, agent_md};

#[tokio::test]
async fn inv_20_messages_are_delivered_in_order_at_the_next_turn_and_refused_after_the_end() {
    let boss = agent_md(
        "subagents: [listener]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: listener, request: listen, label: l}]}}\n  - delay: 100ms\n    call: {tool: send_message, args: {child: l, message: first}}\n  - call: {tool: send_message, args: {child: l, message: second}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: send_message, args: {child: l, message: late}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let listener = agent_md(
        "description: listens\nscript:\n  - say: listening\n    delay: 300ms\n    call: {tool: collect, args: {}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: heard}}",
    );
    let models = RecordingModels::new();
    let node = TestNode::start_full(
        None,
        &[("boss", &boss), ("listener", &listener)],
        models.clone(),
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let l = tree.find("l").unwrap();

    // Both are delivered together, in order, at one turn boundary: the
    // request of that turn carries them, no earlier request does.
    let steering: Vec<(String, u64, Option<u32>)> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::SteerQueued { id, message_id } if id == l => {
                Some(("queued".into(), message_id, None))
            }
            EventKind::SteerDelivered {
                id,
                message_id,
                turn,
            } if id == l => Some(("delivered".into(), message_id, Some(turn))),
            _ => None,
        })
        .collect();
    let kinds: Vec<(&str, u64)> = steering.iter().map(|(k, m, _)| (k.as_str(), *m)).collect();
    assert_eq!(
        kinds,
        [
            ("queued", 1),
            ("queued", 2),
            ("delivered", 1),
            ("delivered", 2)
        ]
    );
    let turn = steering[2].2.unwrap();
    assert_eq!(steering[3].2, Some(turn), "delivered at the same boundary");

    let requests = models.requests("listener");
    let parent_messages = |turn: usize| -> Vec<String> {
        requests[turn]
            .messages
            .iter()
            .filter_map(|m| match m {
                Message::User(t) if t.starts_with("Message from your parent") => Some(t.clone()),
                _ => None,
            })
            .collect()
    };
    for earlier in 0..turn as usize {
        assert!(
            parent_messages(earlier).is_empty(),
            "nothing before its boundary"
        );
    }
    assert_eq!(
        parent_messages(turn as usize),
        [
            "Message from your parent: first",
            "Message from your parent: second"
        ]
    );

    let late = node.failed_calls(run, "send_message").pop();
    assert!(late.unwrap().contains("has already ended (done)"));
    let records = node.journal().steering(l).unwrap();
    assert_eq!(
        records.len(),
        2,
        "both are journaled with their final state"
    );
}

#[tokio::test]
async fn inv_20_a_message_still_queued_when_the_job_ends_is_discarded() {
    // The boss speaks 100ms into the ender's only turn: past its boundary,
    // so the message can only wait for a next turn that never comes.
    let boss = agent_md(
        "subagents: [ender]\nscript:\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: ender, request: go, label: e}]}}\n  - delay: 100ms\n    call: {tool: send_message, args: {child: e, message: too late}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let ender = agent_md(
        "description: ends on its first turn\nscript:\n  - say: finishing\n    delay: 300ms\n    call: {tool: submit_output, args: {output: finished}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("ender", &ender)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let e = tree.find("e").unwrap();
    assert_eq!(tree.node(e).unwrap().status, Status::Done);
    let fate: Vec<&'static str> = node
        .events(run)
        .into_iter()
        .filter_map(|ev| match ev.kind {
            EventKind::SteerQueued { id, .. } if id == e => Some("queued"),
            EventKind::SteerDelivered { id, .. } if id == e => Some("delivered"),
            EventKind::SteerDiscarded { id, .. } if id == e => Some("discarded"),
            _ => None,
        })
        .collect();
    assert_eq!(fate, ["queued", "discarded"]);
}

#[tokio::test]
async fn inv_20_an_operator_can_steer_a_running_step() {
    let worker = agent_md(
        "script:\n  - say: working\n    delay: 300ms\n    call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let models = RecordingModels::new();
    let node = TestNode::start_full(None, &[("worker", &worker)], models.clone()).await;
    let run = node.run_agent("worker", "go").await;
    let step = node.wait_status(run, "worker", Status::Running).await;
    let id = step.id.parse().unwrap();
    assert_eq!(node.steer(id, "use metric units").await, Ok(1));
    node.wait_run(run).await;
    let second = &models.requests("worker")[1];
    assert!(second.messages.contains(&Message::User(
        "Message from your parent: use metric units".into()
    )));
    // A finished step refuses, naming its status.
    let refusal = node.steer(id, "again").await.unwrap_err().to_string();
    assert!(refusal.contains("has already ended (done)"), "{refusal}");
}

// ---------------------------------------------------------------- peers

/// A group of three peers: `a` asks a person before it messages `c` (which
/// has ended by then) and `b` (which waits on its own question meanwhile).
const PEERS_FLOW: &str = "[[group]]\npeers = true\nsteps = [\n\
    { agent = \"scout\", instruction = \"Scout.\", label = \"a\" },\n\
    { agent = \"builder\", instruction = \"Build.\", label = \"b\" },\n\
    { agent = \"quick\", instruction = \"Be quick.\", label = \"c\" },\n]\n";

/// Issue 46, I-20 for peers: a step of a `peers` group is told its
/// siblings; its message is journaled, queued and read at the recipient's
/// next turn (`peer_queued`, `peer_delivered`); one to a sibling that has
/// ended is a tool error saying so, and so is one past `max_peer_messages`.
#[tokio::test]
async fn inv_20_a_peer_message_is_read_at_the_next_turn_and_one_to_an_ended_peer_is_refused() {
    use arbor_actors::agent_loop::PEERS_HEADING;
    let scout = agent_md(
        "description: finds the facts\ntools: [ask_person]\nscript:\n  - call: {tool: ask_person, args: {question: go?}}\n  - call: {tool: send_peer, args: {to: c, text: too late}}\n  - call: {tool: send_peer, args: {to: b, text: use port 8080}}\n  - call: {tool: send_peer, args: {to: b, text: and port 8081}}\n  - call: {tool: submit_output, args: {output: scouted}}",
    );
    let builder = agent_md(
        "description: builds it\ntools: [ask_person]\nscript:\n  - call: {tool: ask_person, args: {question: ready?}}\n  - call: {tool: submit_output, args: {output: built}}",
    );
    let quick = agent_md(
        "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: quick}}",
    );
    let models = RecordingModels::new();
    let node = TestNode::start_workspace(
        Some("[limits]\nmax_peer_messages = 1\n"),
        &[("scout", &scout), ("builder", &builder), ("quick", &quick)],
        &[("peers", PEERS_FLOW)],
        models.clone(),
    )
    .await;
    let run = node.run_flow("peers").await;
    // `c` has ended and both questions wait.
    node.wait_until(run, |t| {
        t.find("c")
            .and_then(|c| t.node(c))
            .is_some_and(|c| c.status == Status::Done)
    })
    .await;
    let card_of = |label: &str| {
        node.cards(run)
            .into_iter()
            .find(|c| c.lineage == [label.to_string()])
    };
    node.wait_until(run, |_| card_of("a").is_some() && card_of("b").is_some())
        .await;
    let first = &models.requests("scout")[0];
    let listing = &first.system[first.system.find(PEERS_HEADING).expect("peers listed")..];
    assert!(
        listing.contains("- `b` (builder): builds it") && listing.contains("- `c` (quick)"),
        "{listing}"
    );
    assert!(!listing.contains("`a`"), "not itself: {listing}");
    assert!(first.tools.iter().any(|t| &*t.name == "send_peer"));

    node.answer(card_of("a").unwrap().id, "go").await.unwrap();
    node.wait_until(run, |t| {
        t.find("a")
            .and_then(|a| t.node(a))
            .is_some_and(|a| a.status == Status::Done)
    })
    .await;
    let refused = node.failed_calls(run, "send_peer");
    assert!(refused[0].contains("peer c has ended"), "{refused:?}");
    assert!(refused[1].contains("max_peer_messages"), "{refused:?}");
    // Queued while `b` waited on its question: not read yet.
    assert!(
        models
            .requests("builder")
            .iter()
            .all(|r| !format!("{:?}", r.messages).contains("8080"))
    );
    node.answer(card_of("b").unwrap().id, "yes").await.unwrap();
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    let read = models.requests("builder");
    let last = format!("{:?}", read.last().unwrap().messages);
    assert!(
        last.contains("A message from your peer `a`: use port 8080"),
        "{last}"
    );
    let events = node.events(run);
    let queued = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::PeerQueued { from, to, .. } if from == "a" && to == "b"))
        .count();
    let delivered = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::PeerDelivered { from, .. } if from == "a"))
        .count();
    assert_eq!((queued, delivered), (1, 1));
}
