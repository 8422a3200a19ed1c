//! Recovery: a node killed at any moment comes back knowing what died, what it
//! spent and what it owes (I-05 across restarts, I-30 to I-35, I-41).

use arbor_protocol::{ErrorClass, EventKind, ParentRef, Status};
use arbor_runtime::RunOutcome;
use arbor_testkit::{TestNode, agent_md};
use std::sync::Arc;

const SLOW: &str = "description: slow\nscript:\n  - usage: {input: 30, output: 12}\n    call: {tool: collect, args: {}}\n  - say: working\n    delay: 1h";

fn boss(children: &str) -> String {
    agent_md(&format!(
        "subagents: [slow, quick]\nscript:\n  - call: {{tool: delegate, args: {{wait: false, jobs: [{children}]}}}}\n  - call: {{tool: collect, args: {{}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ))
}

fn flow(retries: u32) -> String {
    format!(
        "budget = {{ tokens = 100000 }}\n[[group]]\nsteps = [{{ agent = \"boss\", instruction = \"go\", retries = {retries} }}]\n"
    )
}

async fn node_with(boss_md: &str, flow_toml: &str, config: Option<&str>) -> TestNode {
    let quick = agent_md(
        "description: quick\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    TestNode::start_workspace(
        config,
        &[
            ("boss", boss_md),
            ("slow", &agent_md(SLOW)),
            ("quick", &quick),
        ],
        &[("work", flow_toml)],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await
}

#[tokio::test]
async fn inv_30_a_restart_fails_every_orphan_and_releases_its_holds() {
    let node = node_with(
        &boss("{agent: slow, request: a, label: a}, {agent: slow, request: b, label: b}"),
        &flow(0),
        None,
    )
    .await;
    let run = node.run_flow("work").await;
    node.wait_until(run, |t| {
        ["a", "b"].iter().all(|l| {
            t.find(l)
                .and_then(|id| t.node(id))
                .is_some_and(|n| n.account.spent == 42)
        })
    })
    .await;

    let node = node.crash_and_restart().await;

    let report = node.node().recovery();
    assert_eq!(report.jobs_failed.len(), 3, "the step and its two jobs");
    assert!(report.breaches.is_empty(), "{:?}", report.breaches);
    let tree = node.wait_run(run).await;
    for (_, job) in tree.nodes() {
        assert_eq!(job.status, Status::Failed);
        assert_eq!(job.error_class, Some(ErrorClass::Interrupted));
        assert_eq!(job.reason.as_deref(), Some("interrupted: node restarted"));
        assert_eq!(job.account.held, 0);
    }
    // The step may not run again (retries = 0): the run fails, class interrupted.
    assert_eq!(tree.run_status(), Status::Failed);
    assert_eq!(tree.root().error_class, Some(ErrorClass::Interrupted));
    assert!(
        node.events(run)
            .iter()
            .any(|e| matches!(e.kind, EventKind::Recovered { jobs_failed: 3, .. }))
    );
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_31_budgets_reconcile_at_journaled_spend_and_nothing_is_charged_twice() {
    let node = node_with(&boss("{agent: slow, request: a, label: a}"), &flow(0), None).await;
    let run = node.run_flow("work").await;
    node.wait_until(run, |t| {
        t.find("a")
            .and_then(|id| t.node(id))
            .is_some_and(|n| n.account.spent == 42)
    })
    .await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    let a = tree.node(tree.find("a").unwrap()).unwrap().clone();
    let boss = tree.node(tree.find("boss").unwrap()).unwrap().clone();
    assert_eq!(a.account.spent, 42, "settled at what it had journaled");
    assert!(boss.account.spent >= 42, "the parent's spent includes it");
    assert_eq!(tree.root().account.spent, boss.account.spent);
    assert_eq!((boss.account.held, tree.root().account.held), (0, 0));
    node.assert_conserved(run);

    // A second restart finds nothing left to do and charges nothing again.
    let before = node.ledger(ParentRef::Run(run)).len();
    let node = node.crash_and_restart().await;
    assert!(node.node().recovery().jobs_failed.is_empty());
    assert_eq!(
        node.ledger(ParentRef::Run(run)).len(),
        before,
        "{:#?}",
        node.ledger(ParentRef::Run(run))
    );
    assert_eq!(node.tree(run).root().account.spent, boss.account.spent);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_34_a_run_resumes_at_step_granularity() {
    let (node, run) = arbor_tests::scenarios::two_groups_crashed_in_the_second().await;

    assert!(matches!(
        node.node().recovery().runs[0].outcome,
        RunOutcome::Resume { ref resume, .. } if resume.group == 1
    ));
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(tree.root().output, "SECOND");
    let attempts = |label: &str| {
        let mut a: Vec<(u32, Status)> = tree
            .nodes()
            .filter(|(_, n)| n.label.as_deref() == Some(label))
            .map(|(_, n)| (n.attempt, n.status))
            .collect();
        a.sort_by_key(|x| x.0);
        a
    };
    assert_eq!(
        attempts("first"),
        [(1, Status::Done)],
        "a finished step keeps its result"
    );
    assert_eq!(
        attempts("second"),
        [(1, Status::Failed), (2, Status::Done)],
        "an interrupted one runs again"
    );
    node.assert_conserved(run);
}

/// A step run again after a restart works in a workdir of its own attempt,
/// the one its records name, not in what the interrupted attempt left.
#[tokio::test]
async fn a_resumed_step_works_in_the_workdir_its_attempt_records_name() {
    let (node, run) = arbor_tests::scenarios::two_groups_crashed_in_the_second().await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    let mut second: Vec<(u32, String)> = node
        .journal()
        .jobs(run)
        .unwrap()
        .into_iter()
        .filter(|j| j.label.as_deref() == Some("second"))
        .map(|j| (j.attempt, j.workdir))
        .collect();
    second.sort();
    assert_eq!(second.len(), 2, "{second:?}");
    assert!(second[0].1.ends_with("/second"), "{second:?}");
    assert!(second[1].1.ends_with("/second-2"), "{second:?}");
}

#[tokio::test]
async fn inv_05_the_spawn_count_survives_a_restart() {
    let node = node_with(
        &boss("{agent: slow, request: a, label: a}, {agent: slow, request: b, label: b}"),
        &flow(1),
        Some("[limits]\nspawn_cap = 3"),
    )
    .await;
    let run = node.run_flow("work").await;
    node.wait_until(run, |t| ["a", "b"].iter().all(|l| t.find(l).is_some()))
        .await;
    let node = node.crash_and_restart().await;
    // The resumed step asks for two more; one is left under the cap.
    refused_past_the_cap(node, run, "2 spawned + 2 asked > 3").await;
}

/// Waits for the resumed step's delegate call that the spawn cap refuses,
/// checks it says `counted` (spawned + asked > cap), and stops the run.
async fn refused_past_the_cap(node: TestNode, run: arbor_protocol::RunId, counted: &str) {
    let refused = node
        .wait_event(
            run,
            |e| matches!(e, EventKind::ToolCalled { tool, ok: false, .. } if tool == "delegate"),
        )
        .await;
    let EventKind::ToolCalled { detail, .. } = refused.kind else {
        unreachable!()
    };
    assert!(
        detail.contains(&format!("run spawn cap: {counted}")),
        "{detail}"
    );
    node.stop_run(run).await;
    node.wait_run(run).await;
}

/// A job that started and then failed (here: its MCP server could not list
/// its tools, after its actor had started) spent a spawn: a restart counts
/// it, so the resumed step cannot spawn past the cap on it. Only a job whose
/// actor never started (class `start`) gives its count back.
#[tokio::test]
async fn inv_05_a_job_that_failed_after_it_started_stays_counted_across_a_restart() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = format!(
        "[limits]\nspawn_cap = 3\n[mcp.servers.w]\nurl = \"http://127.0.0.1:{port}/mcp\"\nstart_timeout = \"5s\"\n"
    );
    let boss = agent_md(
        "subagents: [lost, slow]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: lost, request: x, label: l}]}}\n  - call: {tool: delegate, args: {wait: false, jobs: [{agent: slow, request: a, label: a}]}}\n  - call: {tool: collect, args: {}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let lost = agent_md(
        "description: lost\nsandbox: own\nmcp: [w]\nscript:\n  - call: {tool: submit_output, args: {output: never}}",
    );
    let node = TestNode::start_workspace(
        Some(&config),
        &[("boss", &boss), ("lost", &lost), ("slow", &agent_md(SLOW))],
        // `lost` reaches an MCP server over HTTP: re-run it without asking (I-57).
        &[("work", &format!("rerun_interrupted = true\n{}", flow(1)))],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await;
    let run = node.run_flow("work").await;
    let tree = node.wait_until(run, |t| t.find("a").is_some()).await;
    let l = &tree
        .nodes()
        .find(|(_, n)| n.label.as_deref() == Some("l"))
        .unwrap()
        .1;
    assert_eq!(l.status, Status::Failed, "{l:?}");
    assert_eq!(l.error_class, Some(ErrorClass::ToolsUnavailable), "{l:?}");

    let node = node.crash_and_restart().await;
    // Two counted (l and a); the resumed step's first delegation takes the
    // last one, and its second is refused.
    refused_past_the_cap(node, run, "3 spawned + 1 asked > 3").await;
}

#[tokio::test]
async fn inv_35_an_undecodable_record_is_reported_by_key_never_skipped() {
    if arbor_testkit::backend::on_postgres() {
        // It edits sled's files; the PostgreSQL journal's own test edits
        // its rows (storage/tests/postgres.rs).
        return;
    }
    let quick = agent_md("script:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("solo", &quick)]).await;
    let run = node.run_agent("solo", "go").await;
    node.wait_run(run).await;
    let step = node.tree(run).find("solo").unwrap();
    let dir = node.crash().await;
    let data = dir.path().join("data");

    // Corrupt the step's record behind the journal's back.
    let key = [run.0.as_bytes().as_slice(), step.0.as_bytes()].concat();
    {
        let db = arbor_storage::open_db(&data.join("journal")).unwrap();
        let jobs = db.open_tree("jobs").unwrap();
        let mut value = jobs.get(&key).unwrap().unwrap().to_vec();
        value[0] = 77;
        jobs.insert(&key, value).unwrap();
        db.flush().unwrap();
    }
    let journal = arbor_storage::Journal::open(&data.join("journal")).unwrap();
    let report = journal.scan().unwrap();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        report
            .undecodable
            .iter()
            .any(|u| u.tree == "jobs" && u.key_hex == hex),
        "{:?}",
        report.undecodable
    );
    assert!(!journal.verify().unwrap().is_clean());
}

#[tokio::test]
async fn inv_41_each_start_is_a_new_epoch_and_a_late_write_from_an_earlier_one_is_refused() {
    let node = node_with(&boss("{agent: slow, request: a, label: a}"), &flow(0), None).await;
    let first = node.journal().epoch();
    let run = node.run_flow("work").await;
    node.wait_for(run, "a").await;
    let stale = node
        .journal()
        .job(run, node.tree(run).find("a").unwrap())
        .unwrap()
        .unwrap();
    let node = node.crash_and_restart().await;
    assert_eq!(node.journal().epoch(), first + 1);
    // The job's last word from before the crash arrives late: refused, nothing changes.
    let late = arbor_storage::JobRecord {
        status: Status::Done,
        output_json: "\"late\"".into(),
        ..stale.clone()
    };
    assert!(matches!(
        node.journal()
            .append(vec![arbor_storage::Record::Job(late)]),
        Err(arbor_storage::Error::StaleEpoch { .. })
    ));
    let now = node.journal().job(run, stale.id).unwrap().unwrap();
    assert_eq!(now.error_class, Some(ErrorClass::Interrupted));
}

#[tokio::test]
async fn a_journal_that_cannot_write_takes_no_new_work_and_loses_nothing_acknowledged() {
    let quick = agent_md("script:\n  - call: {tool: submit_output, args: {output: ok}}");
    let node = TestNode::start(&[("solo", &quick)]).await;
    let done = node.run_agent("solo", "first").await;
    node.wait_run(done).await;
    let acknowledged = node.journal().durable_seq();

    node.journal().faults().fail_writes(true);
    let spec = node.workspace.agent_run("solo", "second", None).unwrap();
    let refused = node
        .node()
        .start_run(spec.clone())
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("journal"), "{refused}");
    // Once failed it stays failed, even with the fault lifted: it says why.
    node.journal().faults().fail_writes(false);
    let refused = node.node().start_run(spec).await.unwrap_err().to_string();
    assert!(refused.contains("the journal has failed"), "{refused}");

    let dir = node.crash().await;
    let journal = arbor_testkit::backend::open_journal(&dir.path().join("data")).unwrap();
    assert!(
        journal.applied_seq() >= acknowledged,
        "every acknowledged record is there"
    );
    assert_eq!(journal.run(done).unwrap().unwrap().status, Status::Done);
}

#[tokio::test]
async fn inv_32_the_same_key_and_request_return_the_existing_job_and_another_request_conflicts() {
    let call = "{tool: delegate, args: {key: survey, wait: false, jobs: [{agent: quick, request: count, label: q}]}}";
    let other = "{tool: delegate, args: {key: survey, wait: false, jobs: [{agent: quick, request: recount, label: r}]}}";
    let boss = agent_md(&format!(
        "subagents: [quick]\nscript:\n  - call: {call}\n  - call: {call}\n  - call: {other}\n  - call: {{tool: collect, args: {{}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let quick = agent_md(
        "description: quick\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("quick", &quick)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let boss_id = tree.find("boss").unwrap();

    // One job, one hold: the repeat spawned and charged nothing.
    assert_eq!(tree.children_of(boss_id).len(), 1);
    let holds = node
        .ledger(ParentRef::Job(boss_id))
        .iter()
        .filter(|r| matches!(r.op, arbor_storage::LedgerOp::Hold { .. }))
        .count();
    assert_eq!(holds, 1);
    let calls: Vec<(bool, String)> = node
        .events(run)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::ToolCalled {
                tool, ok, detail, ..
            } if tool == "delegate" => Some((ok, detail)),
            _ => None,
        })
        .collect();
    let q = tree.find("q").unwrap().to_string();
    assert!(calls[0].0 && calls[0].1.contains(&q));
    assert!(
        calls[1].0 && calls[1].1.contains(&q),
        "the same job came back: {:?}",
        calls[1]
    );
    assert!(
        !calls[2].0 && calls[2].1.contains("conflict"),
        "{:?}",
        calls[2]
    );
    assert_eq!(node.journal().delegations(boss_id).unwrap().len(), 1);
    node.assert_conserved(run);
}

#[tokio::test]
async fn inv_33_an_interrupted_job_stays_failed_until_continued_as_a_new_attempt() {
    let node = node_with(
        &boss("{agent: slow, request: dig deeper, label: a}"),
        &flow(0),
        None,
    )
    .await;
    let run = node.run_flow("work").await;
    let a = node.wait_for(run, "a").await;
    node.wait_status(run, "a", Status::Running).await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    assert_eq!(
        tree.node(a).unwrap().error_class,
        Some(ErrorClass::Interrupted)
    );
    // Nothing resumes it by itself: a second restart leaves it failed.
    let node = node.crash_and_restart().await;
    assert_eq!(
        node.journal().job(run, a).unwrap().unwrap().status,
        Status::Failed
    );

    let continued = node.node().continue_job(a).await.unwrap();
    assert_eq!(
        node.node().continue_job(a).await.unwrap(),
        continued,
        "continuing twice starts one attempt"
    );
    let step = node.wait_status(continued, "a", Status::Running).await;
    assert_eq!(step.attempt, 2, "the next attempt under the same key");
    let requests: Vec<String> = node
        .events(continued)
        .into_iter()
        .filter_map(|e| match e.kind {
            EventKind::JobSpawned { request, .. } => Some(request),
            _ => None,
        })
        .collect();
    assert!(requests[0].starts_with("dig deeper"), "{requests:?}");
    // A job that was not interrupted cannot be continued.
    node.stop_run(continued).await;
    node.wait_run(continued).await;
    let refused = node
        .node()
        .continue_job(step.id.parse().unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("only a job a restart interrupted"),
        "{refused}"
    );
}

#[tokio::test]
async fn inv_31_micro_dollar_holds_reconcile_too() {
    let flow = "budget = { tokens = 100000, usd = 1.0 }\n[[group]]\nsteps = [{ agent = \"boss\", instruction = \"go\", retries = 0 }]\n";
    let node = node_with(
        &boss("{agent: slow, request: a, label: a, budget: {usd: 0.25}}"),
        flow,
        None,
    )
    .await;
    let run = node.run_flow("work").await;
    let tree = node
        .wait_until(run, |t| {
            t.find("a")
                .and_then(|id| t.node(id))
                .is_some_and(|n| n.account.spent == 42)
        })
        .await;
    let a = tree.node(tree.find("a").unwrap()).unwrap().clone();
    assert_eq!(a.usd.unwrap().grant, 250_000, "it asked for a quarter");
    let boss_usd = tree.node(tree.find("boss").unwrap()).unwrap().usd.unwrap();
    assert!(
        boss_usd.held >= 250_000,
        "the grant is held in its parent's micro-dollars"
    );

    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    for (_, n) in tree.nodes() {
        let usd = n.usd.expect("every account of the run has micro-dollars");
        assert_eq!(usd.held, 0, "{:?} still holds {usd:?}", n.label);
    }
    assert_eq!(tree.root().usd.unwrap().held, 0);
    node.assert_conserved(run);
}

/// A crash between an end's commit and the events that tell it (they are
/// emitted only once the record is durable, I-29) leaves records that say
/// ended and a tree that says running; recovery tells those ends again.
#[tokio::test]
async fn ends_whose_events_a_crash_took_are_told_again_from_their_records() {
    let node = TestNode::start(&[(
        "solo",
        &agent_md("script:\n  - say: thinking\n    delay: 1h"),
    )])
    .await;
    let run = node.run_agent("solo", "go").await;
    let step = node.wait_for(run, "solo").await;
    node.wait_status(run, "solo", Status::Running).await;
    // The step's end and the run's, committed as the Run commits them, and
    // the crash before either is told.
    let journal = node.journal().clone();
    let mut record = journal.job(run, step).unwrap().expect("the step's record");
    record.status = Status::Done;
    record.task_status = Some(arbor_protocol::TaskStatus::Completed);
    record.output_json = "\"hi\"".into();
    let mut run_record = journal.run(run).unwrap().expect("the run's record");
    run_record.status = Status::Done;
    run_record.output_json = "\"hi\"".into();
    journal
        .commit(vec![
            arbor_storage::Record::Job(record),
            arbor_storage::Record::Run(run_record),
        ])
        .await
        .unwrap();
    drop(journal);
    let node = node.crash_and_restart().await;

    assert_eq!(node.node().recovery().ends_retold, 2);
    let tree = node.tree(run);
    assert_eq!(tree.run_status(), Status::Done);
    let solo = tree.node(step).expect("the step is in the tree");
    assert_eq!(
        (solo.status, solo.output.clone()),
        (Status::Done, serde_json::json!("hi"))
    );
    // Told once: a second restart finds nothing to tell.
    let node = node.crash_and_restart().await;
    assert_eq!(node.node().recovery().ends_retold, 0);
    assert_eq!(node.tree(run).run_status(), Status::Done);
}

/// I-48: a run the node keeps dying under is parked after
/// `max_recoveries` resumes: failed with class `parked` and its reason, and
/// not resumed again by any later start.
#[tokio::test]
async fn inv_48_a_run_is_parked_after_max_recoveries_resumes_the_node_died_under() {
    // Retries enough that only parking ends the run.
    let slow = agent_md("script:\n  - say: thinking\n    delay: 1h");
    let flow = "[[group]]\nsteps = [{ agent = \"slow\", instruction = \"go\", retries = 5 }]\n";
    let mut node = TestNode::start_workspace(
        Some("[limits]\nmax_recoveries = 2\n"),
        &[("slow", &slow)],
        &[("work", flow)],
        Arc::new(arbor_testkit::DefaultModels),
    )
    .await;
    let run = node.run_flow("work").await;
    for attempt in 1..=3u32 {
        node.wait_until(run, |t| {
            t.root()
                .children
                .iter()
                .any(|s| s.attempt == attempt && s.status == Status::Running)
        })
        .await;
        node = node.crash_and_restart().await;
        let resumed = node.node().resumed().iter().any(|(id, _)| *id == run);
        assert_eq!(resumed, attempt < 3, "resumed after crash {attempt}");
    }
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    let root = tree.root();
    assert_eq!(root.error_class, Some(ErrorClass::Parked));
    let reason = root.reason.clone().unwrap();
    assert!(
        reason.contains("parked") && reason.contains("max_recoveries = 2"),
        "{reason}"
    );
    let record = node.journal().run(run).unwrap().unwrap();
    assert_eq!(
        (record.status, record.error_class),
        (Status::Failed, Some(ErrorClass::Parked))
    );
    node.assert_conserved(run);
    // Parked stays parked.
    let node = node.crash_and_restart().await;
    assert!(node.node().resumed().is_empty());
    assert_eq!(node.tree(run).root().error_class, Some(ErrorClass::Parked));
}

/// `optional = true`: a step whose failure does not fail its run. The run
/// goes on to its next group and completes `partial`, the step named in
/// its limitations, and still so when a restart resumes it after that
/// failure; a step that is not optional fails its run as before.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_an_optional_step_that_fails_leaves_its_run_partial_across_a_restart() {
    let flaky = agent_md("script:\n  - say: \"\"");
    let steady = agent_md("script:\n  - call: {tool: submit_output, args: {output: steady}}");
    let last = agent_md(
        "script:\n  - say: writing\n    delay: 3s\n    call: {tool: submit_output, args: {output: report}}",
    );
    let flow = |optional: bool| {
        format!(
            "[[group]]\nsteps = [{{ agent = \"flaky\", instruction = \"try\", optional = {optional} }}, {{ agent = \"steady\", instruction = \"do\" }}]\n\n[[group]]\nsteps = [{{ agent = \"last\", instruction = \"write\" }}]\n"
        )
    };
    let agents = [
        ("flaky", flaky.as_str()),
        ("steady", steady.as_str()),
        ("last", last.as_str()),
    ];
    let (optional, required) = (flow(true), flow(false));
    let node = TestNode::start_workspace(
        None,
        &agents,
        &[
            ("optional", optional.as_str()),
            ("required", required.as_str()),
        ],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await;

    let run = node.run_flow("optional").await;
    // The last group started (its step running, so the crash below does not
    // race its start): the optional step's failure did not end the run.
    node.wait_status(run, "last", Status::Running).await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    let root = tree.root();
    assert_eq!(root.status, Status::Done, "{:?}", root.reason);
    assert_eq!(root.task_status, Some(arbor_protocol::TaskStatus::Partial));
    assert_eq!(root.limitations.len(), 1, "{:?}", root.limitations);
    assert!(
        root.limitations[0].starts_with("optional step flaky failed: "),
        "{:?}",
        root.limitations
    );
    // The last step's attempt the restart cut, and the one that finished.
    let mut last: Vec<(u32, Status)> = tree
        .nodes()
        .filter(|(_, n)| n.label.as_deref() == Some("last"))
        .map(|(_, n)| (n.attempt, n.status))
        .collect();
    last.sort_by_key(|(attempt, _)| *attempt);
    assert_eq!(last, [(1, Status::Failed), (2, Status::Done)]);
    node.assert_conserved(run);

    let run = node.run_flow("required").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed);
    assert!(tree.find("last").is_none(), "the next group never started");
}

mod retries {
    use super::*;
    use arbor_testkit::mock_provider::{Format, MockProvider, openai};
    use arbor_testkit::protocol::WaitingView;

    const WORKER: &str = "You are the worker.";

    async fn node(mock: &MockProvider, retry: &str) -> TestNode {
        let worker = format!("---\nmodel: mock/small\n---\n{WORKER}\n");
        let flow = format!(
            "budget = {{ tokens = 100000 }}\n[[group]]\nsteps = [{{ agent = \"worker\", instruction = \"work\", retry = {retry} }}]\n"
        );
        TestNode::start_with_flows(
            &mock.arbor_toml(Format::Openai, ""),
            &[("worker", &worker)],
            &[("work", &flow)],
        )
        .await
    }

    fn bad_request() -> arbor_testkit::mock_provider::Answer {
        openai::error(400, "invalid_request_error", "bad", "no such parameter")
    }

    /// The step's attempts in the tree, in order: (attempt, status).
    fn attempts(tree: &arbor_protocol::Tree) -> Vec<(u32, Status)> {
        let mut found: Vec<(u32, Status)> = tree
            .nodes()
            .filter(|(_, n)| n.label.as_deref() == Some("worker"))
            .map(|(_, n)| (n.attempt, n.status))
            .collect();
        found.sort_by_key(|(attempt, _)| *attempt);
        found
    }

    /// A failed step is tried again after its wait, told why the attempt
    /// before failed, in a node of its own; a class its policy does not
    /// name fails the run at once.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_failed_step_is_tried_again_after_its_wait_and_only_for_the_classes_named() {
        let mock = MockProvider::start().await;
        mock.push_for(Format::Openai, WORKER, bad_request());
        let submit = [("submit_output", serde_json::json!({"output": "all done"}))];
        let answer = openai::stream("", &submit, Some((20, 5)));
        mock.push_for(Format::Openai, WORKER, answer);
        let node = node(&mock, "{ attempts = 3, wait = \"300ms\" }").await;
        let run = node.run_flow("work").await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
        assert_eq!(attempts(&tree), [(1, Status::Failed), (2, Status::Done)]);
        let events = node.events(run);
        let (waited_at, until) = events
            .iter()
            .find_map(|e| match &e.kind {
                EventKind::RetryWaiting {
                    attempt: 2,
                    class: ErrorClass::ModelBadRequest,
                    until_ms,
                    ..
                } => Some((e.at_ms, *until_ms)),
                _ => None,
            })
            .expect("a RetryWaiting for attempt 2");
        assert!(until >= waited_at + 300, "{until} < {waited_at} + 300");
        let second = events
            .iter()
            .find(|e| matches!(&e.kind, EventKind::JobSpawned { attempt: 2, .. }))
            .expect("attempt 2 spawned");
        assert!(
            second.at_ms >= until,
            "attempt 2 started before its wait ended"
        );
        let asked = mock.received_for(WORKER);
        assert_eq!(asked.len(), 2);
        assert!(
            asked[1]
                .body
                .to_string()
                .contains("A previous attempt failed"),
            "{}",
            asked[1].body
        );
        node.assert_conserved(run);

        // Only the classes named: a bad request is not a rate limit.
        let mock = MockProvider::start().await;
        mock.push_for(Format::Openai, WORKER, bad_request());
        let node =
            super::retries::node(&mock, "{ attempts = 3, on = [\"model_rate_limit\"] }").await;
        let run = node.run_flow("work").await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.run_status(), Status::Failed);
        assert_eq!(tree.root().error_class, Some(ErrorClass::ModelBadRequest));
        assert_eq!(attempts(&tree), [(1, Status::Failed)]);
        assert!(
            !node
                .events(run)
                .iter()
                .any(|e| matches!(e.kind, EventKind::RetryWaiting { .. }))
        );
    }

    /// I-56: a retry's wait is journaled with when it ends. A node killed
    /// during it comes back waiting for the same moment (not a new wait,
    /// and no attempt started early or skipped); a stop during the wait
    /// ends the run at once, and the attempt never starts.
    #[tokio::test(flavor = "multi_thread")]
    async fn inv_56_a_retry_wait_survives_a_kill_and_a_stop_ends_it_at_once() {
        let mock = MockProvider::start().await;
        mock.push_for(Format::Openai, WORKER, bad_request());
        let node = node(&mock, "{ attempts = 2, wait = \"1h\" }").await;
        let run = node.run_flow("work").await;
        let waiting = node
            .wait_event(run, |k| matches!(k, EventKind::RetryWaiting { .. }))
            .await;
        let EventKind::RetryWaiting { until_ms, .. } = waiting.kind else {
            unreachable!()
        };
        // Its end is reckoned just before the event is stamped.
        assert!(until_ms + 1_000 >= waiting.at_ms + 3_600_000);
        let node = node.crash_and_restart().await;
        let tree = node
            .node()
            .wait_tree(run, |t| {
                t.head().waiting.is_some() && !node.journal().jobs(run).unwrap().is_empty()
            })
            .await;
        match &tree.head().waiting {
            Some(WaitingView::Retry {
                attempt: 2,
                until_ms: resumed,
                ..
            }) => assert_eq!(*resumed, until_ms, "the wait resumed where it was"),
            other => panic!("the run waits on {other:?}"),
        }
        assert_eq!(tree.run_status(), Status::Running);
        let waits = node
            .events(run)
            .iter()
            .filter(|e| matches!(e.kind, EventKind::RetryWaiting { .. }))
            .count();
        assert_eq!(waits, 1, "the wait was journaled once, not started over");
        node.stop_run(run).await;
        let tree = node.wait_run(run).await;
        assert_eq!(tree.run_status(), Status::Stopped);
        assert_eq!(
            attempts(&tree),
            [(1, Status::Failed)],
            "no attempt after the stop"
        );
        assert_eq!(mock.received_for(WORKER).len(), 1);
        node.assert_conserved(run);
    }
}

/// I-57: after a crash, a step that may have acted outside its workdir
/// (its commands have the network) is not run again: its run waits for a
/// person, says why in its tree and in one journaled `needs_decision`
/// (not again at the next restart), holds nothing for it and charges
/// nothing twice, while its inward sibling is re-run at once. A person's
/// continue starts its next attempt in the same run; `rerun_interrupted`
/// re-runs it without asking.
#[tokio::test(flavor = "multi_thread")]
async fn inv_57_an_outward_step_interrupted_by_a_crash_waits_for_a_person_an_inward_one_reruns() {
    use arbor_protocol::WaitingView;
    let slow = |extra: &str| agent_md(&format!("{extra}script:\n  - say: working\n    delay: 1h"));
    let (payer, reader) = (
        slow("tools: [exec]\nnetwork: open\n"),
        slow("tools: [read_file]\n"),
    );
    let flow = |rerun: &str| {
        format!(
            "{rerun}[[group]]\nsteps = [{{ agent = \"payer\", instruction = \"pay\", retries = 5 }}, {{ agent = \"reader\", instruction = \"read\", retries = 5 }}]\n"
        )
    };
    let (asks, reruns) = (flow(""), flow("rerun_interrupted = true\n"));
    let node = TestNode::start_workspace(
        None,
        &[("payer", payer.as_str()), ("reader", reader.as_str())],
        &[("asks", asks.as_str()), ("reruns", reruns.as_str())],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await;
    let run = node.run_flow("asks").await;
    let other = node.run_flow("reruns").await;
    for r in [run, other] {
        node.wait_status(r, "payer", Status::Running).await;
        node.wait_status(r, "reader", Status::Running).await;
    }
    let node = node.crash_and_restart().await;
    let attempts = |node: &TestNode, run, label: &str| {
        let mut found: Vec<u32> = node
            .journal()
            .jobs(run)
            .unwrap()
            .iter()
            .filter(|j| j.label.as_deref() == Some(label))
            .map(|j| j.attempt)
            .collect();
        found.sort_unstable();
        found
    };
    let decided = |node: &TestNode, run| {
        node.events(run)
            .iter()
            .filter(|e| matches!(e.kind, EventKind::NeedsDecision { .. }))
            .count()
    };
    // The inward step runs again at once; the outward one waits.
    node.wait_until(run, |t| {
        t.head().waiting.is_some()
            && t.nodes()
                .any(|(_, n)| n.label.as_deref() == Some("reader") && n.attempt == 2)
    })
    .await;
    let tree = node.tree(run);
    let Some(WaitingView::NeedsDecision { job, label, why }) = tree.head().waiting.clone() else {
        panic!("the run waits on {:?}", tree.head().waiting);
    };
    assert_eq!(label, "payer");
    assert!(
        why.contains("payer: its commands have the network"),
        "{why}"
    );
    assert_eq!(
        attempts(&node, run, "payer"),
        [1],
        "nothing re-run before a decision"
    );
    assert_eq!(decided(&node, run), 1);
    assert_eq!(tree.run_status(), Status::Running);
    // With rerun_interrupted, the same step runs again without asking.
    node.wait_until(other, |t| {
        t.nodes().filter(|(_, n)| n.attempt == 2).count() == 2
    })
    .await;
    assert_eq!(decided(&node, other), 0);

    // Asked once: a second restart keeps the wait, and does not ask again.
    let node = node.crash_and_restart().await;
    node.wait_until(run, |t| {
        matches!(t.head().waiting, Some(WaitingView::NeedsDecision { .. }))
            && t.nodes()
                .any(|(_, n)| n.label.as_deref() == Some("reader") && n.attempt == 3)
    })
    .await;
    assert_eq!(decided(&node, run), 1);
    assert_eq!(attempts(&node, run, "payer"), [1]);

    // A person continues it: its next attempt starts in the same run.
    assert_eq!(node.node().continue_job(job).await.unwrap(), run);
    node.wait_until(run, |t| {
        t.head().waiting.is_none()
            && t.nodes().any(|(_, n)| {
                n.label.as_deref() == Some("payer") && n.attempt == 2 && n.status == Status::Running
            })
    })
    .await;
    assert_eq!(attempts(&node, run, "payer"), [1, 2]);
    // Only once: a second continue finds its run took the step over.
    assert_eq!(node.node().continue_job(job).await.unwrap(), run);
    assert_eq!(attempts(&node, run, "payer"), [1, 2]);
    for r in [run, other] {
        node.stop_run(r).await;
        assert_eq!(node.wait_run(r).await.run_status(), Status::Stopped);
        node.assert_conserved(r);
    }
}

/// `on_fail`: a step that fails for good is taken over by its rescuer,
/// once: told what failed and given its workdir (a copy, below `failed/`);
/// its answer stands in for the step's. A crash during the rescue runs the
/// rescue again (its rescuer, not the step's agent), never a second rescue.
#[tokio::test(flavor = "multi_thread")]
async fn inv_56_a_rescuer_takes_over_a_failed_step_once_across_a_restart() {
    let flaky = agent_md(
        "tools: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: notes.txt, content: half done}}\n  - say: \"\"",
    );
    let fixer = agent_md(
        "tools: [read_file]\nscript:\n  - call: {tool: read_file, args: {path: failed/notes.txt}}\n  - say: fixing\n    delay: 2s\n    call: {tool: submit_output, args: {output: rescued}}",
    );
    let flow = "[[group]]\nsteps = [{ agent = \"flaky\", instruction = \"try\", on_fail = \"fixer\", retries = 3 }]\n";
    let node = TestNode::start_workspace(
        None,
        &[("flaky", flaky.as_str()), ("fixer", fixer.as_str())],
        &[("rescued", flow)],
        Arc::new(arbor_runtime::DefaultModels),
    )
    .await;
    let run = node.run_flow("rescued").await;
    // The rescue has read the failed step's file and works on.
    node.wait_until(run, |t| {
        t.nodes().any(|(_, n)| {
            n.agent.as_deref() == Some("fixer") && n.tools.get("read_file") == Some(&1)
        })
    })
    .await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root().reason);
    assert_eq!(tree.root().output, "rescued");
    let records = node.journal().jobs(run).unwrap();
    let mut attempts: Vec<(u32, String, Status)> = records
        .iter()
        .map(|j| (j.attempt, j.agent.clone(), j.status))
        .collect();
    attempts.sort_by_key(|(a, ..)| *a);
    assert_eq!(
        attempts,
        [
            (1, "flaky".into(), Status::Failed),
            (2, "fixer".into(), Status::Failed),
            (3, "fixer".into(), Status::Done),
        ],
        "one rescue, run again after the crash"
    );
    let read_ok = node
        .tool_calls(run)
        .iter()
        .filter(|c| c.tool == "read_file" && c.ok)
        .count();
    assert_eq!(
        read_ok, 2,
        "each rescue attempt read the failed step's file"
    );
    let asked = node
        .events(run)
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::JobSpawned {
                attempt: 3,
                request,
                ..
            } => Some(request.clone()),
            _ => None,
        })
        .unwrap();
    assert!(asked.starts_with("The step flaky failed"), "{asked}");
    node.assert_conserved(run);
}
