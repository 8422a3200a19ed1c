//! Schedules on a test's clock (I-66): each overlap policy, catch-up within
//! and beyond the window, a restart, pause, trigger, backfill, and both DST
//! changes of Europe/Paris.

use arbor_protocol::RunId;
use arbor_runtime::schedules::{parse_time, tick_text};
use arbor_testkit::agent_md;
use arbor_testkit::service::{TestService, Texts};
use serde_json::json;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const MIN: u64 = 60_000;

/// 2030-01-01T00:00:00Z: the tests' clock starts here.
fn t0() -> u64 {
    parse_time("2030-01-01T00:00:00Z").expect("a time")
}

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn ship() -> String {
    agent_md(
        "description: ships\nscript:\n  - call: {tool: submit_output, args: {output: shipped}}",
    )
}

/// A flow whose runs wait at a gate until stopped, run every minute.
fn gated(overlap: &str, more: &str) -> Texts {
    let flow = format!(
        "[[group]]\nsteps = [{{ agent = \"ship\", instruction = \"Ship.\", approve = true }}]\n\n\
         [[schedule]]\nname = \"minutely\"\ncron = \"* * * * *\"\noverlap = \"{overlap}\"\n{more}"
    );
    Texts::new(&[("ship", &ship())], &[("deploy", &flow)]).with_manual_clock()
}

/// The runs a schedule started, oldest tick first: (tick, run, status).
async fn scheduled(svc: &TestService) -> Vec<(String, RunId, String)> {
    let (status, list) = svc.get_json("/v1/runs?limit=500").await;
    assert_eq!(status, 200, "{list}");
    let mut runs: Vec<(String, RunId, String)> = list["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter(|r| r["schedule"]["name"] == "minutely" || r["schedule"]["name"] == "daily")
        .map(|r| {
            (
                r["schedule"]["tick"].as_str().expect("a tick").to_string(),
                r["id"].as_str().expect("an id").parse().expect("a run id"),
                r["status"].as_str().expect("a status").to_string(),
            )
        })
        .collect();
    runs.sort();
    runs
}

fn ticks(runs: &[(String, RunId, String)]) -> Vec<String> {
    runs.iter().map(|(tick, _, _)| tick.clone()).collect()
}

fn minute(n: u64) -> String {
    tick_text(t0() + n * MIN)
}

async fn end(svc: &TestService, run: RunId) {
    let (status, body) = svc
        .post_json(&format!("/v1/runs/{run}/stop"), json!({}))
        .await;
    assert!(status == 202, "{status} {body}");
    svc.wait_run(run).await;
}

#[tokio::test]
async fn inv_66_skip_starts_nothing_while_the_last_run_has_not_ended() {
    let svc = TestService::start(gated("skip", "")).await;
    svc.run_schedules(at(t0())).await;
    assert!(
        scheduled(&svc).await.is_empty(),
        "a first look starts nothing"
    );
    svc.run_schedules(at(t0() + MIN)).await;
    svc.run_schedules(at(t0() + 2 * MIN)).await;
    let runs = scheduled(&svc).await;
    assert_eq!(ticks(&runs), [minute(1)], "minute 2 was skipped");
    end(&svc, runs[0].1).await;
    svc.run_schedules(at(t0() + 3 * MIN)).await;
    assert_eq!(ticks(&scheduled(&svc).await), [minute(1), minute(3)]);
    let metrics = svc.get("/metrics").send().await.expect("metrics");
    let text = metrics.text().await.expect("a body");
    assert!(
        text.contains("arbor_schedule_ticks_total{schedule=\"minutely\",outcome=\"skipped\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn inv_66_buffer_one_keeps_one_tick_for_when_the_last_run_ends() {
    let svc = TestService::start(gated("buffer_one", "")).await;
    svc.run_schedules(at(t0())).await;
    for m in 1..=3 {
        svc.run_schedules(at(t0() + m * MIN)).await;
    }
    let runs = scheduled(&svc).await;
    assert_eq!(ticks(&runs), [minute(1)]);
    let (_, list) = svc.get_json("/v1/schedules").await;
    assert_eq!(
        list["schedules"][0]["buffered"],
        json!([minute(2)]),
        "{list}"
    );
    end(&svc, runs[0].1).await;
    svc.run_schedules(at(t0() + 3 * MIN + 1)).await;
    // Minute 2 waited and started; minute 3 was skipped.
    assert_eq!(ticks(&scheduled(&svc).await), [minute(1), minute(2)]);
}

#[tokio::test]
async fn inv_66_buffer_all_starts_every_tick_in_order_once_the_one_before_ended() {
    let svc = TestService::start(gated("buffer_all", "")).await;
    svc.run_schedules(at(t0())).await;
    for m in 1..=3 {
        svc.run_schedules(at(t0() + m * MIN)).await;
    }
    assert_eq!(ticks(&scheduled(&svc).await), [minute(1)]);
    for (m, expected) in [(1, 2), (2, 3)] {
        let runs = scheduled(&svc).await;
        end(&svc, runs[m - 1].1).await;
        svc.run_schedules(at(t0() + 3 * MIN + m as u64)).await;
        let runs = scheduled(&svc).await;
        assert_eq!(runs.len(), expected, "{runs:?}");
    }
    assert_eq!(
        ticks(&scheduled(&svc).await),
        [minute(1), minute(2), minute(3)]
    );
}

#[tokio::test]
async fn inv_66_cancel_other_stops_the_last_run_and_allow_all_runs_beside_it() {
    let svc = TestService::start(gated("cancel_other", "")).await;
    svc.run_schedules(at(t0())).await;
    svc.run_schedules(at(t0() + MIN)).await;
    let first = scheduled(&svc).await[0].1;
    // Started, and waiting at its gate.
    svc.events_until(first, None, |e| e["kind"]["type"] == "approval_requested")
        .await;
    svc.run_schedules(at(t0() + 2 * MIN)).await;
    let runs = scheduled(&svc).await;
    assert_eq!(ticks(&runs), [minute(1), minute(2)]);
    let first = svc.wait_run(runs[0].1).await;
    assert_eq!(first["run"]["status"], "stopped", "{first}");
    assert_eq!(
        first["run"]["schedule"],
        json!({"name": "minutely", "tick": minute(1)})
    );
    svc.stop().await;

    let svc = TestService::start(gated("allow_all", "")).await;
    svc.run_schedules(at(t0())).await;
    svc.run_schedules(at(t0() + MIN)).await;
    svc.run_schedules(at(t0() + 2 * MIN)).await;
    let runs = scheduled(&svc).await;
    assert_eq!(ticks(&runs), [minute(1), minute(2)]);
    assert!(
        runs.iter().all(|(_, _, status)| status != "stopped"),
        "{runs:?}"
    );
}

/// Ticks found late within the window start once each, even across a
/// restart; those beyond it are missed, counted, and never started.
#[tokio::test]
async fn inv_66_a_late_tick_starts_once_within_the_catchup_window_and_is_missed_beyond_it() {
    let texts = gated("allow_all", "catchup_window = \"150s\"\n");
    let svc = TestService::start(texts).await;
    svc.run_schedules(at(t0())).await;
    // Ten minutes with no node: 1..=7 are older than 150 s, 8..=10 are not.
    svc.run_schedules(at(t0() + 10 * MIN)).await;
    assert_eq!(
        ticks(&scheduled(&svc).await),
        [minute(8), minute(9), minute(10)]
    );
    let text = svc
        .get("/metrics")
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("a body");
    assert!(
        text.contains("arbor_schedule_ticks_total{schedule=\"minutely\",outcome=\"missed\"} 7"),
        "{text}"
    );
    // A restart looks again at the same time: nothing starts twice.
    let svc = svc.restart().await;
    svc.run_schedules(at(t0() + 10 * MIN)).await;
    svc.run_schedules(at(t0() + 11 * MIN)).await;
    assert_eq!(
        ticks(&scheduled(&svc).await),
        [minute(8), minute(9), minute(10), minute(11)]
    );
}

#[tokio::test]
async fn inv_66_a_paused_schedule_starts_nothing_and_does_not_catch_up_when_unpaused() {
    let svc = TestService::start(gated("allow_all", "")).await;
    svc.run_schedules(at(t0())).await;
    let (status, view) = svc
        .post_json("/v1/schedules/minutely/pause", json!({}))
        .await;
    assert_eq!((status, &view["paused"]), (200, &json!(true)), "{view}");
    assert_eq!(view["next_fire_at"], json!(null));
    svc.run_schedules(at(t0() + 5 * MIN)).await;
    assert!(scheduled(&svc).await.is_empty());
    let (status, view) = svc
        .post_json("/v1/schedules/minutely/unpause", json!({}))
        .await;
    assert_eq!((status, &view["paused"]), (200, &json!(false)), "{view}");
    svc.run_schedules(at(t0() + 6 * MIN)).await;
    assert_eq!(ticks(&scheduled(&svc).await), [minute(6)]);
    let (status, body) = svc
        .post_json("/v1/schedules/nightly/pause", json!({}))
        .await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test]
async fn inv_66_a_backfill_starts_each_tick_once_and_a_trigger_starts_one_now() {
    let svc = TestService::start(gated("skip", "")).await;
    let (status, body) = svc
        .post_json(
            "/v1/schedules/minutely/backfill",
            json!({"from": minute(1), "to": minute(3)}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["started"].as_array().map(Vec::len), Some(3), "{body}");
    let (_, again) = svc
        .post_json(
            "/v1/schedules/minutely/backfill",
            json!({"from": minute(0), "to": minute(3)}),
        )
        .await;
    assert_eq!(
        again["already"].as_array().map(Vec::len),
        Some(3),
        "{again}"
    );
    assert_eq!(
        again["started"].as_array().map(Vec::len),
        Some(1),
        "{again}"
    );
    assert_eq!(
        ticks(&scheduled(&svc).await),
        [minute(0), minute(1), minute(2), minute(3)]
    );
    for (body, why) in [
        (json!({"from": "yesterday", "to": minute(1)}), "RFC 3339"),
        (json!({"from": minute(3), "to": minute(1)}), "after"),
    ] {
        let (status, error) = svc.post_json("/v1/schedules/minutely/backfill", body).await;
        assert_eq!(status, 400, "{error}");
        assert!(error.to_string().contains(why), "{error}");
    }
    let (status, error) = svc
        .post_json(
            "/v1/schedules/minutely/backfill",
            json!({"from": minute(0), "to": tick_text(t0() + 2000 * MIN)}),
        )
        .await;
    assert_eq!(status, 422, "{error}");
    let (status, created) = svc
        .post_json("/v1/schedules/minutely/trigger", json!({}))
        .await;
    assert_eq!(status, 201, "{created}");
    let run: RunId = created["id"]
        .as_str()
        .expect("an id")
        .parse()
        .expect("a run id");
    let (_, doc) = svc.get_json(&format!("/v1/runs/{run}")).await;
    let (_, summary) = svc.get_json("/v1/runs?limit=1").await;
    assert_eq!(
        summary["runs"][0]["schedule"]["name"], "minutely",
        "{summary}"
    );
    let _ = doc;
}

/// A daily 02:30 in Europe/Paris: on 2026-03-29 02:30 does not exist, on
/// 2026-10-25 it happens twice; each day starts one run.
#[tokio::test]
async fn inv_66_a_time_a_dst_change_skips_or_repeats_fires_once() {
    let flow = "[[group]]\nsteps = [{ agent = \"ship\", instruction = \"Ship.\" }]\n\n\
        [[schedule]]\nname = \"daily\"\ncron = \"30 2 * * *\"\ntimezone = \"Europe/Paris\"\noverlap = \"allow_all\"\n";
    let svc = TestService::start(
        Texts::new(&[("ship", &ship())], &[("report", flow)]).with_manual_clock(),
    )
    .await;
    for (from, expected) in [
        (
            "2026-03-28T12:00:00Z",
            vec!["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"],
        ),
        (
            "2026-10-24T12:00:00Z",
            vec!["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"],
        ),
    ] {
        let from = parse_time(from).expect("a time");
        let before = scheduled(&svc).await.len();
        // Every ten minutes for two days, on the test's clock.
        for step in 0..=(2 * 24 * 6) {
            svc.run_schedules(at(from + step * 10 * MIN)).await;
        }
        let runs = scheduled(&svc).await;
        assert_eq!(ticks(&runs[before..]), expected);
    }
}
