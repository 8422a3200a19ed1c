//! Notifications that leave the node (I-61), through arbord's API, against
//! a receiver on loopback: signed as Standard Webhooks says, each committed
//! with its event, retried, dead-lettered and sent again, a 410 that
//! disables its endpoint, a redirect not followed. (A kill -9 mid-delivery
//! is `bin/tests/arbord.rs`; the independent signature check is CI's
//! `tests/webhooks/run.sh`.)

use arbor_runtime::notify::{DeliveryState, OutboxRecord, secret_key, sign};
use arbor_testkit::agent_md;
use arbor_testkit::service::{TestService, Texts};
use arbor_tests::webhooks::{Received, Receiver};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const LIMIT: Duration = Duration::from_secs(30);

/// Asks to write a file (a card), then runs out of script: the run fails.
const ASKER: &str = "---\ndescription: asks, then fails\ntools: [write_file]\napprove: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: out.txt, content: OUTPUT-TEXT}}\n---\nYou write.\n";
const QUICK: &str = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: OUTPUT-TEXT}}\n---\nYou answer.\n";

fn texts(url: &str, endpoint: &str) -> Texts {
    Texts::new(
        &[("asker", ASKER), ("quick", QUICK)],
        &[
            (
                "asks",
                "[[group]]\nsteps = [{ agent = \"asker\", instruction = \"write\" }]\n",
            ),
            (
                "quick",
                "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"answer\" }]\n",
            ),
        ],
    )
    .with_config(&format!(
        "[sandbox]\nsecrets_file = \"secrets.env\"\n\n[notify.ops]\nurl = \"{url}\"\nsecret = \"HOOK_SECRET\"\n{endpoint}"
    ))
}

/// A service whose `[notify.ops]` sends to `url`, its secret in a file.
async fn service(url: &str, endpoint: &str) -> TestService {
    TestService::start_in(with_secret(), texts(url, endpoint)).await
}

/// A directory whose workspace has `HOOK_SECRET` in its 0600 secrets file.
fn with_secret() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let workspace = dir.path().join("workspace");
    std::fs::create_dir_all(&workspace).unwrap();
    let secrets = workspace.join("secrets.env");
    std::fs::write(&secrets, format!("HOOK_SECRET={SECRET}\n")).unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    dir
}

/// Waits, on the deliverer's own changes, until the outbox satisfies `pred`.
async fn wait_outbox(
    svc: &TestService,
    pred: impl Fn(&[OutboxRecord]) -> bool,
) -> Vec<OutboxRecord> {
    let notifications = svc.service.node().notifications().expect("[notify]");
    let mut changes = notifications.changes();
    let waited = tokio::time::timeout(LIMIT, async {
        loop {
            let all = notifications.list(None).unwrap();
            if pred(&all) {
                return all;
            }
            changes.changed().await.unwrap();
        }
    })
    .await;
    waited.unwrap_or_else(|_| {
        panic!(
            "the outbox never got there: {:#?}",
            notifications.list(None)
        )
    })
}

/// Runs the quick flow; waits until a notification of it has failed.
async fn quick_run_failed(svc: &TestService) -> (arbor_protocol::RunId, Vec<OutboxRecord>) {
    let run = svc.submit(serde_json::json!({"flow": "quick"})).await;
    svc.wait_run(run).await;
    let entries = wait_outbox(svc, |all| {
        all.iter().any(|e| e.state == DeliveryState::Failed)
    })
    .await;
    (run, entries)
}

fn verified(received: &Received) {
    let key = secret_key(SECRET).unwrap();
    let timestamp: u64 = received.timestamp.parse().expect("a webhook-timestamp");
    assert_eq!(
        received.signature,
        sign(&key, &received.id, timestamp, &received.body),
        "{received:?}"
    );
    let now = arbor_actors::events::now_ms() / 1000;
    assert!(
        now.abs_diff(timestamp) < 300,
        "a timestamp of now: {timestamp}"
    );
    assert!(received.id.starts_with("msg_"), "{}", received.id);
}

/// I-61: a run that asks, is approved and fails sends each of those events,
/// signed, with ids that are its outbox entries'; each entry's event is in
/// the run's history (committed together), and no body holds the step's
/// output, its arguments or the secret.
#[tokio::test]
async fn inv_61_a_run_that_asks_is_approved_and_fails_is_notified_signed_with_its_entries_ids() {
    let receiver = Receiver::start(204).await;
    let svc = service(&receiver.url, "events = [\"*\"]\n").await;
    let run = svc.submit(serde_json::json!({"flow": "asks"})).await;
    let asked = receiver
        .wait_for(LIMIT, |seen| {
            seen.iter().any(|r| r.event_type() == "approval_requested")
        })
        .await;
    let asked = asked
        .iter()
        .find(|r| r.event_type() == "approval_requested")
        .unwrap()
        .json();
    assert_eq!(asked["data"]["run"], run.to_string());
    assert_eq!(asked["data"]["card_kind"], "call");
    assert_eq!(asked["data"]["tool"], "write_file");
    let card = asked["data"]["card"].as_str().unwrap();
    assert_eq!(
        asked["data"]["links"]["card"],
        format!("/v1/approvals/{card}")
    );
    let (status, body) = svc
        .post_json(
            &format!("/v1/approvals/{card}"),
            serde_json::json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let seen = receiver
        .wait_for(LIMIT, |seen| {
            seen.iter().any(|r| r.event_type() == "run_finished")
        })
        .await;
    let types: Vec<String> = seen.iter().map(Received::event_type).collect();
    for kind in ["approval_requested", "approval_decided", "run_finished"] {
        assert_eq!(
            types.iter().filter(|t| *t == kind).count(),
            1,
            "{kind} once: {types:?}"
        );
    }
    let finished = seen
        .iter()
        .find(|r| r.event_type() == "run_finished")
        .unwrap()
        .json();
    assert_eq!(finished["data"]["status"], "failed");
    for received in &seen {
        verified(received);
        for leak in ["OUTPUT-TEXT", "out.txt", SECRET, "MfKQ9r8"] {
            assert!(!received.body.contains(leak), "{leak} in {}", received.body);
        }
    }
    let entries = wait_outbox(&svc, |all| {
        all.len() == seen.len() && all.iter().all(|e| e.state == DeliveryState::Delivered)
    })
    .await;
    let events = svc.service.node().journal().events(run).unwrap();
    for entry in &entries {
        assert!(
            seen.iter().any(|r| r.id == entry.webhook_id()),
            "{entry:?} was sent"
        );
        let event = events
            .iter()
            .find(|e| e.seq == entry.event_seq)
            .expect("the entry's event is in the journal");
        assert!(
            serde_json::to_value(&event.kind).unwrap()["type"] == entry.event_type,
            "{event:?}"
        );
        assert_eq!(entry.attempts, 1);
    }
    let (status, listed) = svc.get_json("/v1/notifications?state=delivered").await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(
        listed["notifications"].as_array().unwrap().len(),
        entries.len()
    );
}

/// I-61: an endpoint that fails every try dead-letters the entry after
/// `max_attempts`, each try with the same id; it is listed as failed and
/// counted, and `retry` sends it again, once more with the same id. Only
/// the event types the endpoint names are sent.
#[tokio::test]
async fn inv_61_a_dead_lettered_notification_is_listed_counted_and_sent_again_with_its_id() {
    let receiver = Receiver::start(500).await;
    let svc = service(
        &receiver.url,
        "events = [\"run_finished\"]\nmax_attempts = 3\nretry_wait = \"10ms\"\nmax_wait = \"40ms\"\n",
    )
    .await;
    let (run, entries) = quick_run_failed(&svc).await;
    assert_eq!(entries.len(), 1, "only run_finished: {entries:#?}");
    let entry = &entries[0];
    assert_eq!(entry.attempts, 3);
    let seen = receiver.seen();
    assert_eq!(seen.len(), 3, "three tries");
    assert!(seen.iter().all(|r| r.id == entry.webhook_id()));
    let (_, failed) = svc.get_json("/v1/notifications?state=failed").await;
    let listed = &failed["notifications"][0];
    assert_eq!(listed["id"], entry.webhook_id());
    assert_eq!(listed["run"], run.to_string());
    assert_eq!(listed["endpoint"], "ops");
    assert_eq!(listed["event_type"], "run_finished");
    let error = listed["last_error"].as_str().unwrap();
    assert!(
        error.contains("500") && error.contains("try 3 of 3"),
        "{error}"
    );
    let metrics = svc
        .get("/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("arbor_notifications{status=\"failed\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("arbor_notification_tries_total{endpoint=\"ops\",outcome=\"failed\"} 1"),
        "{metrics}"
    );

    // Refused: not failed, unknown, malformed; nothing changes.
    let path = |id: &str| format!("/v1/notifications/{id}/retry");
    let (status, body) = svc
        .post_json(
            &path("msg_0000000000007000800000000000000a"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = svc
        .post_json(&path("nonsense"), serde_json::json!({}))
        .await;
    assert_eq!(status, 400, "{body}");

    receiver.answer(204);
    let (status, body) = svc
        .post_json(&path(&entry.webhook_id()), serde_json::json!({}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "pending");
    let seen = receiver.wait_for(LIMIT, |seen| seen.len() == 4).await;
    assert_eq!(seen[3].id, entry.webhook_id(), "the same id");
    verified(&seen[3]);
    wait_outbox(&svc, |all| all[0].state == DeliveryState::Delivered).await;
    let (status, body) = svc
        .post_json(&path(&entry.webhook_id()), serde_json::json!({}))
        .await;
    assert_eq!(status, 409, "delivered: {body}");
}

/// I-61: a 410 disables the endpoint: its entry is failed at once, and a
/// later event's entry is failed without a try (across a restart too);
/// retrying an entry enables it again.
#[tokio::test]
async fn inv_61_a_410_disables_the_endpoint_until_an_entry_is_retried() {
    let receiver = Receiver::start(410).await;
    let svc = service(
        &receiver.url,
        "events = [\"run_finished\"]\nmax_attempts = 5\nretry_wait = \"10ms\"\n",
    )
    .await;
    let (_, entries) = quick_run_failed(&svc).await;
    assert_eq!(entries[0].attempts, 1, "a 410 is not tried again");
    assert!(entries[0].last_error.as_deref().unwrap().contains("410"));
    let svc = svc.restart().await;
    let second = svc.submit(serde_json::json!({"flow": "quick"})).await;
    svc.wait_run(second).await;
    let entries = wait_outbox(&svc, |all| all.len() == 2).await;
    assert_eq!(
        entries[1].state,
        DeliveryState::Failed,
        "disabled: {entries:#?}"
    );
    assert_eq!(entries[1].attempts, 0, "never tried");
    assert_eq!(receiver.seen().len(), 1);
    let metrics = svc
        .get("/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("arbor_notification_endpoints_disabled 1"),
        "{metrics}"
    );

    receiver.answer(200);
    let (status, body) = svc
        .post_json(
            &format!("/v1/notifications/{}/retry", entries[1].webhook_id()),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let seen = receiver.wait_for(LIMIT, |seen| seen.len() == 2).await;
    assert_eq!(seen[1].id, entries[1].webhook_id());
    wait_outbox(&svc, |all| all[1].state == DeliveryState::Delivered).await;
    let third = svc.submit(serde_json::json!({"flow": "quick"})).await;
    svc.wait_run(third).await;
    receiver.wait_for(LIMIT, |seen| seen.len() == 3).await;
}

/// A redirect is a failed try, never followed.
#[tokio::test]
async fn a_redirect_is_a_failed_try_and_is_not_followed() {
    let receiver = Receiver::start(307).await;
    let svc = service(
        &receiver.url,
        "events = [\"run_finished\"]\nmax_attempts = 1\n",
    )
    .await;
    let (_, entries) = quick_run_failed(&svc).await;
    let error = entries[0].last_error.clone().unwrap();
    assert!(error.contains("redirects are not followed"), "{error}");
    let paths: Vec<String> = receiver.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/hook"]);
}

/// `POST /v1/triggers/NAME` (Standard Webhooks): a call signed with the
/// trigger's secret starts its flow, the body's pointed-at value its
/// input; the same `webhook-id` again answers with the same run; a bad
/// signature, an old timestamp, or no signature at all is a 401 that
/// queues nothing; an input that fails the flow's schema is a 422.
#[tokio::test]
async fn a_signed_trigger_starts_its_flow_once_per_webhook_id_and_a_bad_one_changes_nothing() {
    let dir = with_secret();
    let flow = "input = { type = \"object\", required = [\"topic\"], properties = { topic = { type = \"string\" } } }\n\
                [[group]]\nsteps = [{ agent = \"quick\", instruction = \"About {{ input.topic }}\" }]\n";
    let quick = agent_md(
        "description: answers\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    );
    let texts = Texts::new(&[("quick", &quick)], &[("topical", flow)]).with_config(
        "[sandbox]\nsecrets_file = \"secrets.env\"\n\n[triggers.issue]\nflow = \"topical\"\nsecret = \"HOOK_SECRET\"\ninput = \"/issue\"\n",
    );
    let svc = TestService::start_in(dir, texts).await;
    let key = secret_key(SECRET).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let fire = |id: &str, at: u64, body: &str, signature: Option<String>| {
        // With the node's token, which a trigger does not take instead.
        let mut request = svc
            .post("/v1/triggers/issue")
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", at.to_string())
            .body(body.to_string());
        if let Some(signature) = signature {
            request = request.header("webhook-signature", signature);
        }
        request.send()
    };
    let body = r#"{"issue": {"topic": "tides"}, "sender": "ci"}"#;
    let first = fire("msg_1", now, body, Some(sign(&key, "msg_1", now, body)))
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let created: serde_json::Value = first.json().await.unwrap();
    let again = fire("msg_1", now, body, Some(sign(&key, "msg_1", now, body)))
        .await
        .unwrap();
    assert_eq!(again.status(), 200, "the same webhook-id: the same run");
    let replayed: serde_json::Value = again.json().await.unwrap();
    assert_eq!(replayed["id"], created["id"]);
    let run: arbor_protocol::RunId = created["id"].as_str().unwrap().parse().unwrap();
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");

    let old = now - 10 * 60;
    for (id, at, signature) in [
        ("msg_2", now, Some(sign(&key, "msg_other", now, body))),
        ("msg_3", old, Some(sign(&key, "msg_3", old, body))),
        ("msg_4", now, None),
    ] {
        let refused = fire(id, at, body, signature).await.unwrap();
        assert_eq!(refused.status(), 401, "{id}");
    }
    let bad = r#"{"issue": {"topic": 7}}"#;
    let refused = fire("msg_5", now, bad, Some(sign(&key, "msg_5", now, bad)))
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let (_, runs) = svc.get_json("/v1/runs").await;
    assert_eq!(runs["runs"].as_array().map(Vec::len), Some(1), "{runs}");
}

/// I-66: ticks found later than the catch-up window are told to the
/// endpoints that ask for `schedule_missed`, signed, once, with the span
/// and the count; no run starts for them.
#[tokio::test]
async fn inv_66_missed_ticks_are_notified_once_with_their_span_and_count() {
    use arbor_runtime::schedules::{parse_time, tick_text};
    let receiver = Receiver::start(204).await;
    let mut texts = texts(&receiver.url, "events = [\"schedule_missed\"]\n");
    texts.flows.push((
        "beat".into(),
        "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"answer\" }]\n\n\
         [[schedule]]\nname = \"hourly\"\ncron = \"0 * * * *\"\ncatchup_window = \"30m\"\n"
            .into(),
    ));
    let svc = TestService::start_in(with_secret(), texts.with_manual_clock()).await;
    let t0 = parse_time("2030-01-01T00:00:00Z").unwrap();
    let at = |ms: u64| std::time::UNIX_EPOCH + Duration::from_millis(ms);
    svc.run_schedules(at(t0)).await;
    // Five hours with no node: 01:00 to 04:00 are too late; 05:00 starts.
    svc.run_schedules(at(t0 + 5 * 3_600_000 + 60_000)).await;
    let seen = receiver
        .wait_for(LIMIT, |seen| {
            seen.iter().any(|r| r.event_type() == "schedule_missed")
        })
        .await;
    let missed: Vec<&Received> = seen
        .iter()
        .filter(|r| r.event_type() == "schedule_missed")
        .collect();
    assert_eq!(missed.len(), 1, "{seen:?}");
    verified(missed[0]);
    let data = missed[0].json()["data"].clone();
    assert_eq!(data["schedule"], "hourly");
    assert_eq!(data["count"], 4);
    assert_eq!(data["from"], tick_text(t0 + 3_600_000));
    assert_eq!(data["to"], tick_text(t0 + 4 * 3_600_000));
    let (_, runs) = svc.get_json("/v1/runs").await;
    let ticks: Vec<&serde_json::Value> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["schedule"]["tick"])
        .collect();
    assert_eq!(ticks, [&serde_json::json!(tick_text(t0 + 5 * 3_600_000))]);
}
