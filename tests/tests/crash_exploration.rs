//! A crash at every commit point of a fan-out with retries and a steer, a
//! gated delegation and a retried step, as a kill and as a power cut
//! (`explore_crashes`). The README's example is
//! explored by the user-side example crate, `examples/testing`.

use arbor_protocol::Status;
use arbor_testkit::explore_crashes;

/// Ok when the run ended done, else how it ended.
fn ended_done(node: &arbor_testkit::TestNode, run: arbor_protocol::RunId) -> Result<(), String> {
    let tree = node.tree(run);
    match tree.run_status() {
        Status::Done => Ok(()),
        other => Err(format!(
            "the run ended {other}: {}",
            tree.root().reason.clone().unwrap_or_default()
        )),
    }
}

/// The run ended done and none of its cards is left pending: its cards.
fn done_with_cards_closed(
    node: &arbor_testkit::TestNode,
    run: arbor_protocol::RunId,
) -> Result<Vec<arbor_protocol::Card>, String> {
    ended_done(node, run)?;
    let cards = node.cards(run);
    match cards
        .iter()
        .find(|c| c.state == arbor_protocol::CardState::Pending)
    {
        Some(card) => Err(format!("card {} is still pending after the run", card.id)),
        None => Ok(cards),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_point_of_a_fan_out_with_retries_and_a_steer_recovers() {
    let scenario = arbor_tests::scenarios::fan_out_with_retries_and_steer();
    let report = explore_crashes(&scenario, |node, run| {
        // Retried as often as a crash interrupts it, the run ends done.
        let tree = node.tree(run);
        match tree.run_status() {
            Status::Done => Ok(()),
            other => Err(format!(
                "the run ended {other}: {}",
                tree.root().reason.clone().unwrap_or_default()
            )),
        }
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
    if arbor_testkit::backend::on_postgres() {
        assert!(report.fenced > 0, "no case was fenced: {report}");
    }
}

/// I-56 at every commit point of a retried step, killed and powered off:
/// the run ends done, and every journaled wait was followed by its
/// attempt, started no earlier than the wait's end and once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_56_every_commit_point_of_a_retried_step_keeps_its_wait() {
    use arbor_protocol::EventKind;
    let scenario = arbor_tests::scenarios::retried_step();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let events = node.events(run);
        let mut waits = std::collections::HashMap::new();
        for event in &events {
            if let EventKind::RetryWaiting {
                id,
                attempt,
                until_ms,
                ..
            } = &event.kind
                && waits.insert(*id, (*attempt, *until_ms)).is_some()
            {
                return Err(format!("the wait after {id} was journaled twice"));
            }
        }
        if waits.is_empty() {
            return Err("no retry waited".into());
        }
        // Each wait is followed by its attempt, once (admitted: its record
        // is journaled, whether or not a later crash cut it), and never
        // started before the wait's end.
        let records = node.journal().jobs(run).map_err(|e| e.to_string())?;
        for (failed, (attempt, until_ms)) in waits {
            let admitted = records.iter().filter(|j| j.attempt == attempt).count();
            if admitted != 1 {
                return Err(format!(
                    "the wait after {failed} was followed by {admitted} attempts {attempt}"
                ));
            }
            if let Some(early) = events.iter().find(|e| {
                matches!(&e.kind, EventKind::JobSpawned { attempt: a, .. } if *a == attempt)
                    && e.at_ms < until_ms
            }) {
                return Err(format!(
                    "attempt {attempt} started {} ms before its wait ended",
                    until_ms - early.at_ms
                ));
            }
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// I-56 at every commit point of a rescue, killed and powered off: the run
/// ends done on the rescuer's answer, and the failure was rescued once:
/// one rescue ended, any other a crash cut, and none after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_56_every_commit_point_of_a_rescue_rescues_once() {
    use arbor_protocol::ErrorClass;
    let scenario = arbor_tests::scenarios::rescued_step();
    let report = explore_crashes(&scenario, |node, run| {
        let tree = node.tree(run);
        if tree.run_status() != Status::Done || tree.root().output != "rescued" {
            return Err(format!(
                "the run ended {} with {}: {}",
                tree.run_status(),
                tree.root().output,
                tree.root().reason.clone().unwrap_or_default()
            ));
        }
        let records = node.journal().jobs(run).map_err(|e| e.to_string())?;
        let mut rescues: Vec<_> = records.iter().filter(|j| j.agent == "fixer").collect();
        rescues.sort_by_key(|j| j.attempt);
        let ended: Vec<_> = rescues
            .iter()
            .filter(|j| j.error_class != Some(ErrorClass::Interrupted))
            .collect();
        if ended.len() != 1 || rescues.last().map(|j| j.id) != ended.first().map(|j| j.id) {
            return Err(format!(
                "{} rescues ended, the last of {} attempts {}",
                ended.len(),
                rescues.len(),
                rescues
                    .last()
                    .map(|j| j.status.to_string())
                    .unwrap_or_default()
            ));
        }
        if let Some(late) = records
            .iter()
            .find(|j| j.agent == "flaky" && j.attempt > rescues[0].attempt)
        {
            return Err(format!(
                "the step's own agent ran again after its rescue: {}",
                late.attempt
            ));
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// I-57 at every commit point of a step that may act outside its workdir,
/// beside one that may not, killed and powered off: the run ends done; an
/// outward attempt a crash cut is followed by another only after its
/// `needs_decision` (a person's continue), while the inward one is simply
/// run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_57_every_commit_point_of_an_outward_step_waits_for_a_person() {
    use arbor_protocol::EventKind;
    let scenario = arbor_tests::scenarios::outward_step();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let asked: std::collections::HashSet<_> = node
            .events(run)
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::NeedsDecision { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        let records = node.journal().jobs(run).map_err(|e| e.to_string())?;
        let mut payer: Vec<_> = records
            .iter()
            .filter(|j| j.label.as_deref() == Some("payer"))
            .collect();
        payer.sort_by_key(|j| j.attempt);
        for pair in payer.windows(2) {
            if !asked.contains(&pair[0].id) {
                return Err(format!(
                    "payer's attempt {} ran after attempt {} without a person's decision",
                    pair[1].attempt, pair[0].attempt
                ));
            }
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// I-46 and I-47 at every commit point (the card's, the decision's, and all
/// around them), killed and powered off: the run ends done, no card is left
/// pending, and every gated call that ran has a committed approval of its
/// own job's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_commit_point_of_a_gated_delegation_keeps_its_cards() {
    use arbor_protocol::{CardState, EventKind};
    let scenario = arbor_tests::scenarios::gated_delegation();
    let report = explore_crashes(&scenario, |node, run| {
        let cards = done_with_cards_closed(node, run)?;
        for event in node.events(run) {
            if let EventKind::ToolCalled {
                id, tool, ok: true, ..
            } = &event.kind
                && tool == "write_file"
                && !cards
                    .iter()
                    .any(|c| c.job == *id && c.state == CardState::Approved)
            {
                return Err(format!("{id} wrote a file without a committed approval"));
            }
        }
        if cards.is_empty() {
            return Err("no card was asked".into());
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
    if arbor_testkit::backend::on_postgres() {
        assert!(report.fenced > 0, "no case was fenced: {report}");
    }
}

/// I-60 at every commit point of a question and a step's go-ahead, killed
/// and powered off: the run ends done; no card is left pending or closed
/// twice; every question the agent read back was answered, and the gated
/// step never started before its card's approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_60_every_commit_point_of_a_question_and_a_step_gate_has_one_outcome() {
    use arbor_protocol::{CardKind, CardState, EventKind};
    // Every notification goes to a receiver here (at a fixed address: each
    // crash child builds the same scenario), signed with a secret each
    // process writes to a file of its own.
    const RECEIVER: &str = "127.0.0.1:18994";
    let receiver = match arbor_testkit::explore::is_crash_child() {
        false => Some(arbor_tests::webhooks::Receiver::start_at(RECEIVER, 204).await),
        true => None,
    };
    let secrets = tempfile::tempdir().unwrap();
    let secrets_file = secrets.path().join("secrets.env");
    std::fs::write(
        &secrets_file,
        "HOOK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &secrets_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let scenario = arbor_tests::scenarios::people_and_peers(&format!(
        "[sandbox]\nsecrets_file = \"{}\"\n[notify.ops]\nurl = \"http://{RECEIVER}/hook\"\nevents = [\"*\"]\nsecret = \"HOOK_SECRET\"\nretry_wait = \"50ms\"\nmax_wait = \"200ms\"\nmax_attempts = 50\n",
        secrets_file.display(),
    ));
    let report = explore_crashes(&scenario, |node, run| {
        let cards = done_with_cards_closed(node, run)?;
        for kind in [CardKind::Question, CardKind::Step] {
            if !cards.iter().any(|c| c.kind == kind) {
                return Err(format!("no {} card was asked", kind.as_str()));
            }
        }
        let events = node.events(run);
        let mut closed = std::collections::HashMap::new();
        let mut approved_at = None;
        for event in &events {
            match &event.kind {
                EventKind::ApprovalDecided { card, state, .. } => {
                    if closed.insert(*card, *state).is_some() {
                        return Err(format!("card {card} was closed twice"));
                    }
                    let step = cards
                        .iter()
                        .any(|c| c.id == *card && c.kind == CardKind::Step);
                    if step && *state == CardState::Approved {
                        approved_at.get_or_insert(event.at_ms);
                    }
                }
                EventKind::JobSpawned { agent, .. } if agent == "ship" => match approved_at {
                    Some(at) if at <= event.at_ms => {}
                    _ => return Err("the gated step started before its go-ahead".into()),
                },
                EventKind::ToolCalled { tool, ok, .. } if tool == "ask_person" && !ok => {
                    return Err("a question was read back without its answer".into());
                }
                _ => {}
            }
        }
        peers_told_once(&events)?;
        let seen = receiver.as_ref().map(|r| r.seen()).unwrap_or_default();
        notified(node, run, &events, &seen)
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// I-20 for peers: each message read once, and only a message queued.
fn peers_told_once(events: &[arbor_protocol::Event]) -> Result<(), String> {
    use arbor_protocol::EventKind;
    let mut queued = std::collections::HashSet::new();
    let mut read = std::collections::HashSet::new();
    for event in events {
        match &event.kind {
            EventKind::PeerQueued { id, message_id, .. } => {
                queued.insert((*id, *message_id));
            }
            EventKind::PeerDelivered { id, message_id, .. } => {
                if !queued.contains(&(*id, *message_id)) {
                    return Err(format!(
                        "peer message {message_id} to {id} read, never queued"
                    ));
                }
                if !read.insert((*id, *message_id)) {
                    return Err(format!("peer message {message_id} to {id} read twice"));
                }
            }
            _ => {}
        }
    }
    if queued.is_empty() {
        return Err("the reviewer's message was never queued".into());
    }
    Ok(())
}

/// I-61: every outbox entry of the run is for an event in its history
/// (committed together), every notified event has its entry, and every
/// entry was delivered, its id seen by the receiver.
fn notified(
    node: &arbor_testkit::TestNode,
    run: arbor_protocol::RunId,
    events: &[arbor_protocol::Event],
    seen: &[arbor_tests::webhooks::Received],
) -> Result<(), String> {
    use arbor_runtime::notify::{DeliveryState, payload};
    let Some(notifications) = node.node().notifications() else {
        return Err("the node has no [notify]".into());
    };
    let entries: Vec<_> = notifications
        .list(None)
        .map_err(|e| format!("the outbox does not read: {e}"))?
        .into_iter()
        .filter(|e| e.run == run)
        .collect();
    for entry in &entries {
        let Some(event) = events.iter().find(|e| e.seq == entry.event_seq) else {
            return Err(format!(
                "{} is for event {}, not in the journal",
                entry.webhook_id(),
                entry.event_seq
            ));
        };
        if payload(event).map(|(kind, _)| kind) != Some(entry.event_type.as_str()) {
            return Err(format!(
                "{} is a {}, its event is {:?}",
                entry.webhook_id(),
                entry.event_type,
                event.kind
            ));
        }
        if entry.state != DeliveryState::Delivered {
            return Err(format!(
                "{} is {} after recovery: {:?}",
                entry.webhook_id(),
                entry.state.as_str(),
                entry.last_error
            ));
        }
        let id = entry.webhook_id();
        if !seen.iter().any(|r| r.id == id) {
            return Err(format!("{id} is delivered, and the receiver never saw it"));
        }
    }
    for event in events.iter().filter(|e| payload(e).is_some()) {
        if !entries.iter().any(|e| e.event_seq == event.seq) {
            return Err(format!(
                "event {} ({:?}) has no notification",
                event.seq, event.kind
            ));
        }
    }
    Ok(())
}

/// I-64 at every commit point of operators' calls (a steer, a decision, a
/// stop), killed and powered off: each change an operator asked for has
/// its audit entry, and each entry its change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_64_every_commit_point_of_an_audited_call_keeps_change_and_entry_together() {
    let scenario = arbor_tests::scenarios::audited_calls();
    let report = explore_crashes(&scenario, |node, run| {
        let tree = node.node().tree(run);
        if !tree.run_status().is_terminal() {
            return Err(format!("the run did not end: {}", tree.run_status()));
        }
        let entries = arbor_tests::scenarios::audit_matches_changes(node, run)?;
        if entries == 0 {
            return Err("no operator's call was audited".into());
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// I-56 at every commit point of two loops (an iteration's end, a command's
/// check, a judge's verdict), killed and powered off: the run ends done
/// (the judge loop is optional); each loop's checks are its iterations
/// 1, 2, ... once each, in order, with nothing checked after the one that
/// passed or ended it; every iteration that ended done was checked once;
/// the judge loop ends at its `max_iterations`, never past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_56_every_commit_point_of_a_loop_keeps_its_iteration() {
    use arbor_protocol::EventKind;
    let scenario = arbor_tests::scenarios::looped_steps();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let events = node.events(run);
        let records = node.journal().jobs(run).map_err(|e| e.to_string())?;
        for (label, most) in [("counter", None), ("writer", Some(2))] {
            let checks: Vec<(arbor_protocol::JobId, u32, bool, bool)> = events
                .iter()
                .filter_map(|e| match &e.kind {
                    EventKind::IterationChecked {
                        id,
                        label: l,
                        iteration,
                        passed,
                        ended,
                        ..
                    } if l == label => Some((*id, *iteration, *passed, ended.is_some())),
                    _ => None,
                })
                .collect();
            let numbers: Vec<u32> = checks.iter().map(|c| c.1).collect();
            let expected: Vec<u32> = (1..=checks.len() as u32).collect();
            if numbers != expected {
                return Err(format!("{label}'s checks were of iterations {numbers:?}"));
            }
            let Some(last) = checks.last() else {
                // What happened instead, an event a line.
                let seen: Vec<String> = events
                    .iter()
                    .map(|e| format!("{:?}", e.kind).chars().take(120).collect())
                    .collect();
                return Err(format!("{label} was never checked: {seen:#?}"));
            };
            if !(last.2 || last.3) || checks[..checks.len() - 1].iter().any(|c| c.2 || c.3) {
                return Err(format!(
                    "{label}'s loop did not end at its last check: {checks:?}"
                ));
            }
            if let Some(most) = most
                && (checks.len() != most || !last.3)
            {
                return Err(format!(
                    "{label} was checked {} times, not {most}",
                    checks.len()
                ));
            }
            let done = records
                .iter()
                .filter(|j| j.label.as_deref() == Some(label) && j.status == Status::Done)
                .count();
            if done != checks.len() {
                return Err(format!(
                    "{label}: {done} iterations ended done and {} were checked",
                    checks.len()
                ));
            }
            if checks.iter().any(|c| {
                !records
                    .iter()
                    .any(|j| j.id == c.0 && j.status == Status::Done)
            }) {
                return Err(format!(
                    "{label}: a check of an iteration that did not end done"
                ));
            }
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// A review at every commit point, killed and powered off: the run ends
/// done with its review recorded once; the last group ran once more
/// after it, never twice, and its second round ended done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_56_every_commit_point_of_a_review_sends_the_last_group_back_once() {
    use arbor_protocol::EventKind;
    let scenario = arbor_tests::scenarios::reviewed_run();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let reviews: Vec<arbor_protocol::JobId> = node
            .events(run)
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Reviewed { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        let [reviewer] = reviews.as_slice() else {
            return Err(format!("{} reviews were journaled", reviews.len()));
        };
        let records = node.journal().jobs(run).map_err(|e| e.to_string())?;
        let after: Vec<_> = records
            .iter()
            .filter(|j| j.label.as_deref() == Some("writer") && j.id > *reviewer)
            .collect();
        let done = after.iter().filter(|j| j.status == Status::Done).count();
        if done != 1 {
            return Err(format!(
                "the last group's second round ended done {done} times"
            ));
        }
        if node
            .tree(run)
            .root()
            .review
            .as_ref()
            .is_none_or(|r| r.accept)
        {
            return Err("the run's document lacks its review".into());
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}

/// The top-ups the run's root ledger holds (its `Grow` entries, in tokens).
fn top_ups(node: &arbor_testkit::TestNode, run: arbor_protocol::RunId) -> u64 {
    node.ledger(arbor_protocol::ParentRef::Run(run))
        .iter()
        .filter(|e| e.unit == arbor_storage::Unit::Tokens)
        .filter(|e| matches!(e.op, arbor_storage::LedgerOp::Grow { .. }))
        .count() as u64
}

/// I-58 at every commit point of a top-up, killed and powered off: the
/// run ends done, its grant journaled at most once and its root grant
/// what its ledger adds up to (the checks balance every account).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_58_every_commit_point_of_a_top_up_keeps_the_grant_once() {
    static TOPPED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let scenario = arbor_tests::scenarios::topped_up_run();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let grows = top_ups(node, run);
        if grows > 1 {
            return Err(format!("the top-up was journaled {grows} times"));
        }
        let grant = node.tree(run).root().account.grant;
        if grant != 100_000 + 50_000 * grows {
            return Err(format!("the root grant is {grant} after {grows} top-ups"));
        }
        TOPPED.fetch_add(grows as usize, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
    assert!(
        TOPPED.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no case kept its top-up: {report}"
    );
}

/// I-56 and I-58 at every commit point of a budget pause and its top-up,
/// killed and powered off: the run ends done, paused at most where it
/// was, its root grant what its ledger's top-ups add up to (the checks
/// balance every account), and no pause left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_58_every_commit_point_of_a_pause_keeps_it_until_a_top_up() {
    static PAUSED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let scenario = arbor_tests::scenarios::paused_run();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let grows = top_ups(node, run);
        let grant = node.tree(run).root().account.grant;
        if grows == 0 || grant != 1_000 + 20_000 * grows {
            return Err(format!("the root grant is {grant} after {grows} top-ups"));
        }
        let deadlines: std::collections::BTreeSet<u64> = node
            .events(run)
            .iter()
            .filter_map(|e| match e.kind {
                arbor_protocol::EventKind::BudgetReached { deadline_ms, .. } => Some(deadline_ms),
                _ => None,
            })
            .collect();
        if deadlines.len() > 1 {
            return Err(format!(
                "a restart moved the pause's deadline: {deadlines:?}"
            ));
        }
        PAUSED.fetch_add(deadlines.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
    assert!(
        PAUSED.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no case paused: {report}"
    );
}

/// I-67 at every commit point of a deploy during a run (the new version's
/// snapshot among them), killed and powered off: the run ends done with
/// the definitions it was admitted with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_67_every_commit_point_of_a_deploy_mid_run_keeps_the_runs_version() {
    let scenario = arbor_tests::scenarios::deployed_mid_run();
    let report = explore_crashes(&scenario, |node, run| {
        ended_done(node, run)?;
        let tree = node.tree(run);
        let root = tree.root();
        if root.version.as_deref() != Some(node.workspace.version.as_str()) {
            return Err(format!("the run's version is {:?}", root.version));
        }
        let done = root
            .children
            .iter()
            .filter(|s| s.status == arbor_protocol::Status::Done);
        for step in done {
            if step.output != "said-v1" {
                return Err(format!("step {:?} said {:?}", step.label, step.output));
            }
        }
        Ok(())
    })
    .await;
    println!("{report}");
    assert!(report.crashed > 0, "no case crashed: {report}");
}
