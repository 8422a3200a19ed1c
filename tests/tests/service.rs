//! arbord over real HTTP on loopback: every route, every bad input of I-36,
//! the token of I-37, the event stream and its resume, the admission queue
//! across a restart, and the drain of I-40 (in-process; the process-level
//! SIGTERM and SIGKILL are in bin/tests/arbord.rs).

use arbor_protocol::{RunId, Status};
use arbor_service::Service;
use arbor_testkit::agent_md;
use arbor_testkit::service::{TestService, Texts, status_of};
use serde_json::json;
use std::path::Path;

#[path = "service/schedules.rs"]
mod schedules;

fn quick() -> String {
    agent_md(
        "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: hi, task_status: completed}}",
    )
}

/// Blocks in a command until it is stopped.
fn slow() -> String {
    agent_md(
        "description: blocks\ntools: [exec]\nscript:\n  - call: {tool: exec, args: {command: \"exec sleep 300\"}}\n  - call: {tool: submit_output, args: {output: late}}",
    )
}

fn texts() -> Texts {
    Texts::new(
        &[("quick", &quick()), ("slow", &slow())],
        &[(
            "hello",
            "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n",
        )],
    )
}

/// `GET /metrics`, its text.
async fn metrics_text(svc: &TestService) -> String {
    svc.get("/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn schema(name: &str) -> jsonschema::Validator {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/contract")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
}

fn assert_valid(validator: &jsonschema::Validator, doc: &serde_json::Value) {
    let errors: Vec<String> = validator.iter_errors(doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?} in {doc}");
}

#[tokio::test]
async fn a_submitted_flow_runs_and_reads_back_as_the_run_document() {
    let svc = TestService::start(texts()).await;
    let response = svc
        .post("/v1/runs")
        .json(&json!({"flow": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let location = response.headers()["location"].to_str().unwrap().to_string();
    let created: serde_json::Value = response.json().await.unwrap();
    let run: arbor_protocol::RunId = created["id"].as_str().unwrap().parse().unwrap();
    assert_eq!(location, format!("/v1/runs/{run}"));
    assert_eq!(created["links"]["events"], format!("/v1/runs/{run}/events"));
    assert_eq!(created["replayed"], false);

    let doc = svc.wait_run(run).await;
    assert_eq!(status_of(&doc), Status::Done);
    assert_eq!(doc["run"]["children"][0]["output"], "hi");
    assert_valid(&schema("run-output.schema.json"), &doc);

    // The list has it, filtered and paged.
    let other = svc
        .submit(json!({"agent": "quick", "input": "again", "budget": {"tokens": 5000}}))
        .await;
    svc.wait_run(other).await;
    let (_, list) = svc.get_json("/v1/runs?status=done").await;
    let ids: Vec<&str> = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [other.to_string(), run.to_string()], "newest first");
    assert_eq!(list["runs"][0]["budget_tokens"], 5000);
    // Each line has its times and its spend, the run document's own.
    let line = &list["runs"][1];
    let created = line["created_at_ms"].as_u64().expect("created_at_ms");
    let (started, ended) = (&doc["run"]["started_at_ms"], &doc["run"]["ended_at_ms"]);
    assert_eq!(&line["started_at_ms"], started, "{line}");
    assert_eq!(&line["ended_at_ms"], ended, "{line}");
    assert!(
        created <= started.as_u64().unwrap(),
        "made before it started: {line}"
    );
    assert_eq!(line["tokens"], doc["run"]["account"], "{line}");
    assert!(line["tokens"]["spent"].as_u64().unwrap() > 0, "{line}");
    assert!(line.get("usd").is_none(), "no usd ceiling: {line}");
    let (_, page) = svc.get_json("/v1/runs?limit=1").await;
    assert_eq!(page["runs"].as_array().unwrap().len(), 1);
    let next = page["next"].as_str().expect("a next page");
    let (_, rest) = svc
        .get_json(&format!("/v1/runs?limit=1&after={next}"))
        .await;
    assert_eq!(rest["runs"][0]["id"], run.to_string());
    assert!(rest.get("next").is_none(), "{rest}");
    let (_, none) = svc.get_json("/v1/runs?status=failed").await;
    assert_eq!(none["runs"], json!([]));

    // A step reads back as a job, with its run.
    let step = doc["run"]["children"][0]["id"].as_str().unwrap();
    let (status, job) = svc.get_json(&format!("/v1/jobs/{step}")).await;
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["run"], run.to_string());
    assert_eq!(job["job"]["status"], "done");
    svc.stop().await;
}

#[tokio::test]
async fn inv_36_bad_input_gets_a_clear_4xx_and_changes_nothing() {
    let svc = TestService::start(texts().with_config("[service]\nmax_body_bytes = 4096\n")).await;
    let unknown = arbor_protocol::RunId::new();
    // (method, path, body, content type, expected status, words the message has)
    let cases: Vec<(&str, String, String, &str, u16, &str)> = vec![
        (
            "POST",
            "/v1/runs".into(),
            "{not json".into(),
            "application/json",
            400,
            "not what this route takes",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": 3}"#.into(),
            "application/json",
            400,
            "invalid type",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "depth": 9}"#.into(),
            "application/json",
            400,
            "unknown field",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello"}"#.into(),
            "text/plain",
            415,
            "application/json",
        ),
        (
            "POST",
            "/v1/runs".into(),
            format!(r#"{{"agent": "quick", "input": "{}"}}"#, "y".repeat(5000)),
            "application/json",
            413,
            "larger",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "nope"}"#.into(),
            "application/json",
            422,
            "no such flow",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"agent": "nobody", "input": "x"}"#.into(),
            "application/json",
            422,
            "no such agent",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"agent": "quick"}"#.into(),
            "application/json",
            400,
            "needs an `input`",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"input": "x"}"#.into(),
            "application/json",
            400,
            "needs an `agent`",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "agent": "quick", "input": "x"}"#.into(),
            "application/json",
            400,
            "not both",
        ),
        (
            "POST",
            "/v1/runs".into(),
            "{}".into(),
            "application/json",
            400,
            "give `flow`",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"agent": "quick", "input": "  "}"#.into(),
            "application/json",
            422,
            "empty",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": -5}}"#.into(),
            "application/json",
            422,
            "positive whole number",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": 0}}"#.into(),
            "application/json",
            422,
            "0 never means unlimited",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": 2.5}}"#.into(),
            "application/json",
            422,
            "positive whole number",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": 1e30}}"#.into(),
            "application/json",
            422,
            "positive whole number",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": 18446744073709551615}}"#.into(),
            "application/json",
            422,
            "max_run_tokens",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"usd": NaN}}"#.into(),
            "application/json",
            400,
            "not what this route takes",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"usd": -1}}"#.into(),
            "application/json",
            422,
            "more than 0",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"usd": 0}}"#.into(),
            "application/json",
            422,
            "more than 0",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"usd": 1e300}}"#.into(),
            "application/json",
            422,
            "not a budget",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"usd": 5000}}"#.into(),
            "application/json",
            422,
            "max_run_usd",
        ),
        (
            "POST",
            "/v1/runs".into(),
            r#"{"flow": "hello", "budget": {"tokens": 10, "cents": 1}}"#.into(),
            "application/json",
            400,
            "unknown field",
        ),
        (
            "GET",
            format!("/v1/runs/{unknown}"),
            String::new(),
            "",
            404,
            "no run",
        ),
        (
            "GET",
            "/v1/runs/not-an-id".into(),
            String::new(),
            "",
            400,
            "not a run id",
        ),
        (
            "GET",
            "/v1/runs?limit=0".into(),
            String::new(),
            "",
            400,
            "limit",
        ),
        (
            "GET",
            "/v1/runs?status=sleeping".into(),
            String::new(),
            "",
            400,
            "bad query",
        ),
        (
            "GET",
            "/v1/runs?after=yesterday".into(),
            String::new(),
            "",
            400,
            "bad query",
        ),
        (
            "GET",
            "/v1/runs?colour=red".into(),
            String::new(),
            "",
            400,
            "unknown field",
        ),
        (
            "POST",
            format!("/v1/runs/{unknown}/stop"),
            String::new(),
            "",
            404,
            "no run",
        ),
        (
            "GET",
            format!("/v1/runs/{unknown}/events"),
            String::new(),
            "",
            404,
            "no run",
        ),
        (
            "GET",
            format!("/v1/jobs/{unknown}"),
            String::new(),
            "",
            404,
            "no step or job",
        ),
        (
            "GET",
            "/v1/jobs/42".into(),
            String::new(),
            "",
            400,
            "not a job id",
        ),
        (
            "POST",
            format!("/v1/jobs/{unknown}/stop"),
            String::new(),
            "",
            404,
            "no step or job",
        ),
        (
            "POST",
            format!("/v1/jobs/{unknown}/continue"),
            String::new(),
            "",
            404,
            "no step or job",
        ),
        (
            "POST",
            format!("/v1/jobs/{unknown}/messages"),
            r#"{"text": "hi"}"#.into(),
            "application/json",
            404,
            "no step or job",
        ),
        (
            "POST",
            format!("/v1/jobs/{unknown}/messages"),
            r#"{"words": "hi"}"#.into(),
            "application/json",
            400,
            "unknown field",
        ),
        (
            "POST",
            format!("/v1/jobs/{unknown}/messages"),
            r#"{"text": ""}"#.into(),
            "application/json",
            422,
            "empty",
        ),
        (
            "GET",
            "/v1/nowhere".into(),
            String::new(),
            "",
            404,
            "no such route",
        ),
    ];
    for (method, path, body, content_type, want, words) in &cases {
        let mut request = match *method {
            "POST" => svc.post(path),
            "DELETE" => svc
                .http()
                .delete(format!("{}{path}", svc.url))
                .bearer_auth(&svc.token),
            _ => svc.get(path),
        };
        if !content_type.is_empty() {
            request = request.header("content-type", *content_type);
        }
        let response = request.body(body.clone()).send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        let reply: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|_| {
            panic!("{method} {path}: {status} with a body that is not JSON: {text}")
        });
        assert_eq!(status, *want, "{method} {path} {body:.80}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(words),
            "{method} {path} {body:.80}: {message:?} should say {words:?}"
        );
        assert!(reply["error"]["code"].is_string(), "{reply}");
    }
    // A bad idempotency key.
    let response = svc
        .post("/v1/runs")
        .header("Idempotency-Key", "a key with spaces")
        .json(&json!({"flow": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);

    // Nothing of it was queued, started or journaled.
    let (_, list) = svc.get_json("/v1/runs").await;
    assert_eq!(list["runs"], json!([]), "{list}");
    assert!(svc.submissions().is_empty());
    assert!(svc.service.node().journal().runs().unwrap().is_empty());
    svc.stop().await;
}

#[tokio::test]
async fn inv_36_an_input_over_the_cap_is_refused() {
    let svc = TestService::start(texts().with_config("[service]\nmax_input_bytes = 100\n")).await;
    let (status, reply) = svc
        .post_json(
            "/v1/runs",
            json!({"agent": "quick", "input": "z".repeat(101)}),
        )
        .await;
    assert_eq!(status, 422, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_input_bytes")
    );
    assert!(svc.submissions().is_empty());
    svc.stop().await;
}

#[tokio::test]
async fn inv_36_a_reused_idempotency_key_with_another_body_is_a_conflict_that_changes_nothing() {
    let svc = TestService::start(texts()).await;
    let send = |body: serde_json::Value| {
        svc.post("/v1/runs")
            .header("Idempotency-Key", "order-17")
            .json(&body)
            .send()
    };
    let first = send(json!({"flow": "hello"})).await.unwrap();
    assert_eq!(first.status(), 201);
    let first: serde_json::Value = first.json().await.unwrap();
    let again = send(json!({"flow": "hello"})).await.unwrap();
    assert_eq!(again.status(), 200, "a retry is answered, not queued again");
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);
    assert_eq!(again["replayed"], true);
    let other = send(json!({"agent": "quick", "input": "other"}))
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let other: serde_json::Value = other.json().await.unwrap();
    assert_eq!(other["error"]["code"], "conflict");
    assert_eq!(svc.submissions().len(), 1);
    // The key outlives a restart.
    let svc = svc.restart().await;
    let again = svc
        .post("/v1/runs")
        .header("Idempotency-Key", "order-17")
        .json(&json!({"flow": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);
    svc.stop().await;
}

/// I-53: the console logs in with the token and gets a session cookie,
/// HttpOnly and SameSite=Strict, that holds no token; the cookie opens the
/// API (an event stream too) in place of the header, but not from another
/// site; logging out ends it.
#[tokio::test]
async fn inv_53_a_console_session_is_a_strict_httponly_cookie_refused_across_sites_until_logout() {
    let svc = TestService::start(texts()).await;
    let session = format!("{}/v1/ui/session", svc.url);
    let login = |body: String| {
        svc.http()
            .post(&session)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // A wrong token or a bad body: refused, and no cookie.
    for (body, status) in [
        (json!({"token": "not the token"}).to_string(), 401),
        (json!({"token": svc.token, "extra": 1}).to_string(), 400),
        ("{".to_string(), 400),
    ] {
        let refused = login(body.clone()).await.unwrap();
        assert_eq!(refused.status(), status, "{body}");
        assert!(refused.headers().get("set-cookie").is_none(), "{body}");
    }
    let logged_in = login(json!({"token": svc.token}).to_string())
        .await
        .unwrap();
    assert_eq!(logged_in.status(), 204);
    let set = logged_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_string();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=43200"] {
        assert!(set.contains(attribute), "{set} has {attribute}");
    }
    assert!(
        !set.contains(&svc.token),
        "the cookie is not the token: {set}"
    );
    let cookie = set.split(';').next().unwrap().to_string();
    assert!(
        cookie.starts_with("arbor_session=") && cookie.len() > 40,
        "{cookie}"
    );

    let run = svc.submit(json!({"flow": "hello"})).await;
    svc.wait_run(run).await;
    let get = |path: String, headers: &[(&str, &str)]| {
        let mut request = svc
            .http()
            .get(format!("{}{path}", svc.url))
            .header("cookie", &cookie);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.send()
    };
    // The cookie in place of the header: a document, and an event stream.
    let status = get("/v1/status".into(), &[("sec-fetch-site", "same-origin")])
        .await
        .unwrap();
    assert_eq!(status.status(), 200);
    let events = get(format!("/v1/runs/{run}/events?follow=false"), &[])
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    assert!(events.text().await.unwrap().contains("run_finished"));
    // From another site, with the cookie: refused, saying why.
    for cross in [
        [("sec-fetch-site", "cross-site")],
        [("sec-fetch-site", "same-site")],
        [("origin", "http://elsewhere.example")],
    ] {
        let refused = get("/v1/status".into(), &cross).await.unwrap();
        assert_eq!(refused.status(), 403, "{cross:?}");
        let body: serde_json::Value = refused.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("another site")
                || body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("elsewhere"),
            "{body}"
        );
    }
    let forced = svc
        .http()
        .post(&session)
        .header("content-type", "application/json")
        .header("sec-fetch-site", "cross-site")
        .body(json!({"token": svc.token}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(forced.status(), 403, "a login from another site");
    // Logged out: the cookie is cleared and opens nothing more.
    let out = svc
        .http()
        .delete(&session)
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(out.status(), 204);
    assert!(
        out.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    let after = get("/v1/status".into(), &[]).await.unwrap();
    assert_eq!(after.status(), 401);
    svc.stop().await;
}

/// The console's files: served without a token (they hold no data) with
/// a Content-Security-Policy that allows this origin's own files only, an
/// ETag that answers 304, and their content types; the page has no inline
/// script, and reads only routes of the API's own document.
#[tokio::test]
async fn the_console_is_served_with_a_strict_csp_etags_and_its_content_types() {
    let svc = TestService::start(texts()).await;
    let get = |path: &str, etag: Option<&str>| {
        let mut request = svc.http().get(format!("{}{path}", svc.url));
        if let Some(etag) = etag {
            request = request.header("if-none-match", etag);
        }
        request.send()
    };
    let mut bodies = std::collections::HashMap::new();
    for (path, content_type) in [
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/app.js", "text/javascript; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
    ] {
        let page = get(path, None).await.unwrap();
        assert_eq!(page.status(), 200, "{path}");
        let headers = page.headers().clone();
        assert_eq!(headers["content-type"], content_type, "{path}");
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'self'"), "{path}: {csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{path}: {csp}");
        assert!(!csp.contains("unsafe"), "{path}: {csp}");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        let etag = headers["etag"].to_str().unwrap().to_string();
        bodies.insert(path, page.text().await.unwrap());
        let again = get(path, Some(&etag)).await.unwrap();
        assert_eq!(again.status(), 304, "{path}");
        assert_eq!(again.headers()["etag"].to_str().unwrap(), etag);
        assert!(again.text().await.unwrap().is_empty());
        let stale = get(path, Some("\"not-this-one\"")).await.unwrap();
        assert_eq!(stale.status(), 200, "{path}: another ETag gets the file");
    }
    assert_eq!(get("/ui/nothing.js", None).await.unwrap().status(), 404);
    let html = &bodies["/ui"];
    for tag in html.split("<script").skip(1) {
        assert!(
            tag.split('>').next().unwrap().contains("src="),
            "no inline script: <script{tag}"
        );
    }
    // No inline handler (` onclick=` and the like).
    for (at, _) in html.match_indices(" on") {
        let name: String = html[at + 1..]
            .chars()
            .take_while(|c| c.is_ascii_alphabetic())
            .collect();
        assert!(
            !html[at + 1 + name.len()..].starts_with('='),
            "no inline handler: {name}"
        );
    }
    // The page reads the API's own routes, and never a token in a URL.
    let app = &bodies["/ui/app.js"];
    let (_, api) = svc.get_json("/v1/openapi.json").await;
    for path in ["/v1/status", "/v1/runs", "/v1/ui/session"] {
        assert!(app.contains(path), "the page reads {path}");
        assert!(api["paths"][path].is_object(), "{path} is the API's");
    }
    assert!(
        !app.contains("token=") && !app.contains("Authorization"),
        "{app}"
    );
    svc.stop().await;
}

/// Every route of the OpenAPI document as (METHOD, path with a fresh id in
/// each `{id}`), those that need the token, then "METHOD /path" of those
/// that do not (no security requirement), sorted.
fn documented_routes() -> (Vec<(String, String)>, Vec<String>) {
    let api = Service::openapi();
    let id = arbor_protocol::RunId::new().to_string();
    let (mut routes, mut public) = (vec![], vec![]);
    for (path, item) in api["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let method = method.to_uppercase();
            match op["security"].as_array().is_some_and(|s| !s.is_empty()) {
                true => routes.push((method, path.replace("{id}", &id))),
                false => public.push(format!("{method} {path}")),
            }
        }
    }
    public.sort();
    (routes, public)
}

/// docs/operations.md's table of the API names every route the OpenAPI
/// document has, and no other (a route added to the API and not to the
/// guide fails here).
#[test]
fn the_operations_guide_lists_every_route_the_api_documents() {
    let api = Service::openapi();
    let mut documented = std::collections::BTreeSet::new();
    for (path, item) in api["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            documented.insert(format!("{} {path}", method.to_uppercase()));
        }
    }
    let guide = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md"),
    )
    .unwrap();
    let table = guide
        .split("## The API")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").nth(2))
        .expect("docs/operations.md has its API table");
    let mut listed = std::collections::BTreeSet::new();
    for row in table.lines() {
        let first_cell = row
            .trim_start_matches('|')
            .split(" | ")
            .next()
            .unwrap_or_default();
        for span in first_cell.split('`').skip(1).step_by(2) {
            let (method, path) = span.split_once(' ').unwrap_or(("GET", span));
            let path = path.split('?').next().unwrap_or_default();
            listed.insert(format!("{method} {path}"));
        }
    }
    assert_eq!(
        listed, documented,
        "docs/operations.md's API table and the OpenAPI document differ"
    );
}

#[tokio::test]
async fn inv_37_every_route_but_the_health_checks_refuses_a_missing_or_wrong_token() {
    let svc = TestService::start(texts()).await;
    // Every route the API documents, but the public ones, which are named.
    let (routes, public) = documented_routes();
    assert_eq!(
        public,
        [
            "DELETE /v1/ui/session",
            "GET /healthz",
            "GET /readyz",
            "POST /v1/triggers/{name}",
            "POST /v1/ui/session",
        ],
        "only the health checks, the console's login and logout, and the signed triggers are public"
    );
    // The document itself is served beside the routes it describes.
    let mut routes = routes;
    routes.push(("GET".into(), "/v1/openapi.json".into()));
    assert!(routes.len() >= 16, "{routes:?}");
    // The real token with its last character changed.
    let (head, last) = svc.token.split_at(svc.token.len() - 1);
    let wrong = format!("{head}{}", if last == "0" { "1" } else { "0" });
    assert_ne!(wrong, svc.token);
    for (method, path) in &routes {
        for token in [None, Some(wrong.as_str()), Some(""), Some("Bearer")] {
            let url = format!("{}{path}", svc.url);
            let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
            let mut request = svc.http().request(method.clone(), &url);
            if let Some(token) = token {
                request = request.header("authorization", format!("Bearer {token}"));
            }
            let response = request
                .header("content-type", "application/json")
                .body(r#"{"flow": "hello"}"#)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 401, "{method} {path} with {token:?}");
            assert_eq!(response.headers()["www-authenticate"], "Bearer");
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(body["error"]["code"], "unauthorized");
        }
    }
    // Basic auth with the right token is not a bearer token either.
    let response = svc
        .http()
        .get(format!("{}/v1/status", svc.url))
        .basic_auth("arbor", Some(&svc.token))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    for path in ["/healthz", "/readyz"] {
        let response = svc
            .http()
            .get(format!("{}{path}", svc.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
    }
    // Nothing was submitted by any of it.
    assert!(svc.submissions().is_empty());
    svc.stop().await;
}

#[tokio::test]
async fn the_event_stream_resumes_after_the_last_event_id_and_ends_with_the_run() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"flow": "hello"})).await;
    let all = svc.events(run, None).await;
    assert!(all.len() > 3, "{all:?}");
    let ids: Vec<u64> = all.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        ids,
        (1..=all.len() as u64).collect::<Vec<_>>(),
        "ids count the run's events"
    );
    assert_eq!(all.last().unwrap().1["kind"]["type"], "run_finished");
    assert_eq!(all[0].1["kind"]["type"], "run_started");
    let validator = schema("event.schema.json");
    for (id, data) in &all {
        assert_eq!(data["index"], *id);
        assert_eq!(data["run"], run.to_string());
        assert_valid(&validator, data);
    }
    // Resumed from the third: exactly the rest, the same events.
    let rest = svc.events(run, Some(3)).await;
    assert_eq!(rest, all[3..].to_vec());
    // Resumed from the end: nothing more, and the stream still ends.
    let none = svc.events(run, Some(all.len() as u64)).await;
    assert!(none.is_empty(), "{none:?}");
    // `?after=` is the same for a client that cannot set the header (a
    // browser's EventSource after a reload); the header wins over it.
    let path = format!("/v1/runs/{run}/events");
    let rest: Vec<u64> = (4..=all.len() as u64).collect();
    assert_eq!(
        sse_ids(&svc, &format!("{path}?after=3"), None).await,
        (200, rest)
    );
    let later: Vec<u64> = (6..=all.len() as u64).collect();
    assert_eq!(
        sse_ids(&svc, &format!("{path}?after=1"), Some("5")).await,
        (200, later)
    );
    let (status, _) = sse_ids(&svc, &format!("{path}?after=-1"), None).await;
    assert_eq!(status, 400, "after is a whole number");
    // `?job=`: that step's events (its account's among them) and the run's
    // end, at the run's own indices.
    let step = all
        .iter()
        .find_map(|(_, e)| (e["kind"]["type"] == "job_spawned").then(|| e["kind"]["id"].clone()))
        .expect("a step");
    let step = step.as_str().unwrap();
    let about = |e: &serde_json::Value| {
        let k = &e["kind"];
        k["id"] == step || k["owner"]["job"] == step || k["type"] == "run_finished"
    };
    let expected: Vec<u64> = all
        .iter()
        .filter(|(_, e)| about(e))
        .map(|(i, _)| *i)
        .collect();
    assert!(
        expected.len() > 3 && expected.len() < all.len(),
        "{expected:?}"
    );
    assert_eq!(
        sse_ids(&svc, &format!("{path}?job={step}"), None).await,
        (200, expected.clone())
    );
    let later: Vec<u64> = expected
        .iter()
        .copied()
        .filter(|i| *i > expected[1])
        .collect();
    let resumed = format!("{path}?job={step}&after={}", expected[1]);
    assert_eq!(sse_ids(&svc, &resumed, None).await, (200, later));
    let stranger = arbor_protocol::JobId::new();
    let (status, _) = sse_ids(&svc, &format!("{path}?job={stranger}"), None).await;
    assert_eq!(status, 404, "a job of no such run");
    // A Last-Event-ID that is not a number is refused.
    let response = svc
        .get(&format!("/v1/runs/{run}/events"))
        .header("Last-Event-ID", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    svc.stop().await;
}

/// The `id:` of every message of the event stream at `path`.
async fn sse_ids(svc: &TestService, path: &str, last_event_id: Option<&str>) -> (u16, Vec<u64>) {
    let mut request = svc.get(path);
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    let ids = body
        .lines()
        .filter_map(|line| line.strip_prefix("id:"))
        .map(|id| id.trim().parse().unwrap())
        .collect();
    (status, ids)
}

#[test]
fn the_event_schema_in_docs_contract_is_the_one_the_types_generate() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/contract/event.schema.json");
    let generated = serde_json::to_string_pretty(&Service::event_schema()).unwrap() + "\n";
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/contract/event.schema.json is not what the types generate; \
         run `BLESS=1 cargo test -p arbor-tests --test service the_event_schema` and commit it"
    );
}

/// The console places every event kind: `EVENT_KINDS` in service/ui/app.js
/// holds exactly the kinds the types generate, so a new kind fails here,
/// naming where it goes.
#[test]
fn the_console_places_every_event_kind_there_is() {
    let schema = Service::event_schema();
    let kinds: std::collections::BTreeSet<String> = schema["$defs"]["EventKind"]["oneOf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|kind| {
            kind["properties"]["type"]["const"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(kinds.len() > 20, "{kinds:?}");
    let app =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../service/ui/app.js"))
            .unwrap();
    let table = app
        .split("const EVENT_KINDS = {")
        .nth(1)
        .and_then(|rest| rest.split("};").next())
        .expect("service/ui/app.js has its EVENT_KINDS");
    let placed: std::collections::BTreeSet<String> = table
        .split(',')
        .filter_map(|entry| entry.split(':').next())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .collect();
    assert_eq!(
        placed, kinds,
        "service/ui/app.js's EVENT_KINDS must place every event kind, and no other"
    );
}

#[tokio::test]
async fn stop_steer_and_read_a_running_step_over_http() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    let step = svc.wait_running(run).await;

    let (status, job) = svc.get_json(&format!("/v1/jobs/{step}")).await;
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["job"]["status"], "running");
    // What its agent may do, from the workspace.
    assert_eq!(job["setup"]["model"], "scripted", "{job}");
    assert_eq!(job["setup"]["network"], "none");
    assert_eq!(job["steering"], json!([]));
    let (status, queued) = svc
        .post_json(
            &format!("/v1/jobs/{step}/messages"),
            json!({"text": "hurry up"}),
        )
        .await;
    assert_eq!(status, 202, "{queued}");
    assert_eq!(queued["job"], step);
    assert!(queued["message_id"].is_u64());
    // The job's document has the message, with what became of it.
    let (_, job) = svc.get_json(&format!("/v1/jobs/{step}")).await;
    assert_eq!(job["steering"][0]["text"], "hurry up", "{job}");
    assert_eq!(job["steering"][0]["message_id"], queued["message_id"]);
    assert!(
        ["queued", "delivered"].contains(&job["steering"][0]["state"].as_str().unwrap()),
        "{job}"
    );

    let (status, stopping) = svc
        .post_json(&format!("/v1/jobs/{step}/stop"), json!({}))
        .await;
    assert_eq!(status, 202, "{stopping}");
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["children"][0]["status"], "stopped");
    let events = svc.events(run, None).await;
    assert!(
        events
            .iter()
            .any(|(_, e)| e["kind"]["type"] == "steer_queued"),
        "the message was queued as an event"
    );
    // Ended: a second stop, a message, and a continue are conflicts.
    let (status, _) = svc
        .post_json(&format!("/v1/jobs/{step}/stop"), json!({}))
        .await;
    assert_eq!(status, 409);
    let (status, _) = svc
        .post_json(
            &format!("/v1/jobs/{step}/messages"),
            json!({"text": "late"}),
        )
        .await;
    assert_eq!(status, 409);
    let (status, reply) = svc
        .post_json(&format!("/v1/jobs/{step}/continue"), json!({}))
        .await;
    assert_eq!(status, 409, "only an interrupted job continues: {reply}");
    let (status, _) = svc
        .post_json(&format!("/v1/runs/{run}/stop"), json!({}))
        .await;
    assert_eq!(status, 409);

    // A run stopped as a whole ends stopped.
    let run = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    svc.wait_running(run).await;
    let (status, stopping) = svc
        .post_json(&format!("/v1/runs/{run}/stop"), json!({}))
        .await;
    assert_eq!(status, 202, "{stopping}");
    assert_eq!(stopping["state"], "stopping");
    let doc = svc.wait_run(run).await;
    assert_eq!(status_of(&doc), Status::Stopped);
    svc.stop().await;
}

#[tokio::test]
async fn the_admission_queue_runs_in_order_and_survives_a_restart() {
    let svc = TestService::start(texts().with_config("[service]\nmax_running_runs = 1\n")).await;
    let blocker = svc
        .submit(json!({"agent": "slow", "input": "hold the slot"}))
        .await;
    svc.wait_running(blocker).await;
    let first = svc.submit(json!({"agent": "quick", "input": "one"})).await;
    let second = svc.submit(json!({"agent": "quick", "input": "two"})).await;
    let (_, doc) = svc.get_json(&format!("/v1/runs/{first}")).await;
    assert_eq!(status_of(&doc), Status::Pending);
    let (_, list) = svc.get_json("/v1/runs?status=pending").await;
    let positions: Vec<(String, u64)> = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_string(),
                r["queue_position"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        positions,
        [(second.to_string(), 1), (first.to_string(), 0)],
        "newest first, each with its place"
    );
    let (_, status) = svc.get_json("/v1/status").await;
    assert_eq!(status["admission"]["queued"], 2);
    assert_eq!(status["admission"]["running"], 1);

    // A drain stops the running run and leaves the queue in the journal.
    let svc = svc.restart().await;
    let (_, doc) = svc.get_json(&format!("/v1/runs/{blocker}")).await;
    assert_eq!(status_of(&doc), Status::Stopped, "{doc}");
    svc.wait_run(first).await;
    let doc = svc.wait_run(second).await;
    assert_eq!(status_of(&doc), Status::Done);
    // In order: the second started only after the first had ended.
    let ended_first = svc
        .events(first, None)
        .await
        .last()
        .map(|(_, e)| e["seq"].as_u64().unwrap())
        .unwrap();
    let started_second = svc.events(second, None).await[0].1["seq"].as_u64().unwrap();
    assert!(
        ended_first < started_second,
        "{ended_first} < {started_second}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn a_queued_run_that_is_stopped_never_starts() {
    let svc = TestService::start(texts().with_config("[service]\nmax_running_runs = 1\n")).await;
    let blocker = svc.submit(json!({"agent": "slow", "input": "hold"})).await;
    svc.wait_running(blocker).await;
    let waiting = svc.submit(json!({"flow": "hello"})).await;
    let (status, reply) = svc
        .post_json(&format!("/v1/runs/{waiting}/stop"), json!({}))
        .await;
    assert_eq!(status, 202, "{reply}");
    assert_eq!(reply["state"], "stopped");
    let doc = svc.wait_run(waiting).await;
    assert_eq!(status_of(&doc), Status::Stopped);
    assert!(doc["run"]["children"].as_array().unwrap().is_empty());
    svc.post_json(&format!("/v1/runs/{blocker}/stop"), json!({}))
        .await;
    svc.wait_run(blocker).await;
    // The slot is free, and the stopped run still did not start.
    let after = svc.submit(json!({"flow": "hello"})).await;
    svc.wait_run(after).await;
    let (_, doc) = svc.get_json(&format!("/v1/runs/{waiting}")).await;
    assert!(
        doc["run"]["children"].as_array().unwrap().is_empty(),
        "{doc}"
    );
    svc.stop().await;
}

#[tokio::test]
async fn inv_40_a_drain_refuses_new_work_and_leaves_a_consistent_journal() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    svc.wait_running(run).await;
    let probe = svc.http().clone();
    let url = svc.url.clone();
    let service = svc.service.clone();
    let draining = tokio::spawn(async move { service.drain().await });
    draining.await.unwrap();
    let ready = probe.get(format!("{url}/readyz")).send().await;
    // The server may already be gone; if it answers, it says it is not ready.
    if let Ok(response) = ready {
        assert_eq!(response.status(), 503);
    }
    let dir = svc.stop().await;
    let journal = arbor_storage::Journal::open_read_only(&dir.path().join("data/journal")).unwrap();
    let report = journal.verify().unwrap();
    assert!(report.is_clean(), "{report:?}");
    let record = journal.run(run).unwrap().unwrap();
    assert_eq!(record.status, Status::Stopped);
    drop(journal);
    // The next start has nothing to recover: the drain left nothing running.
    let svc = TestService::start_in(dir, texts()).await;
    let (_, status) = svc.get_json("/v1/status").await;
    assert_eq!(status["recovery"]["jobs_failed"], json!([]), "{status}");
    assert_eq!(status["node"]["epoch"], 2);
    svc.stop().await;
}

#[tokio::test]
async fn status_metrics_and_the_openapi_document_describe_the_node() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    let step = svc.wait_running(run).await;
    // No event says a command started: ask until the sandbox has one.
    let (status, node) = tokio::time::timeout(arbor_testkit::WAIT_LIMIT, async {
        loop {
            let (status, node) = svc.get_json("/v1/status").await;
            if status != 200 || node["sandboxes"][0].is_object() {
                return (status, node);
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the step's command starts");
    assert_eq!(status, 200);
    assert_eq!(node["node"]["accepting"], true);
    assert_eq!(node["node"]["sandbox"]["mode"], "sealed", "{node}");
    assert_eq!(node["node"]["sandbox"]["sealed"], true, "{node}");
    let live = &node["runs"][0];
    assert_eq!(live["id"], run.to_string());
    assert_eq!(live["children"][0]["id"], step);
    assert!(live["children"][0]["account"]["grant"].as_u64().unwrap() > 0);
    let names = node["actors"].to_string();
    assert!(names.contains(&format!("arbor-run-{run}")), "{names}");
    assert!(names.contains(&format!("arbor-job-{step}")), "{names}");
    assert_eq!(node["sandboxes"][0]["job"], step, "{node}");

    let response = svc.get("/metrics").send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = response.text().await.unwrap();
    for needle in [
        "arbor_runs{status=\"running\"} 1",
        "arbor_running_jobs 1",
        "arbor_model_calls_total{provider=\"scripted\",outcome=\"ok\"}",
        "arbor_journal_commit_seconds_bucket",
        "arbor_journal_fsyncs_total",
        "arbor_tokens_spent_total",
    ] {
        assert!(text.contains(needle), "{needle} in\n{text}");
    }
    assert!(
        !text.contains(&run.to_string()) && !text.contains(&step),
        "no ids in labels"
    );

    let (status, api) = svc.get_json("/v1/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(
        api,
        Service::openapi(),
        "the served document is the generated one"
    );
    // Each operation that needs the token documents its 401; the health
    // checks need none and document none (the console's login documents
    // the 401 of a wrong token).
    for (path, item) in api["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let protected = op["security"].as_array().is_some_and(|s| !s.is_empty());
            let documented = op["responses"].get("401").is_some();
            if protected || path.ends_with('z') {
                assert_eq!(documented, protected, "{method} {path}: its 401");
            }
        }
    }
    assert!(api["paths"]["/v1/runs/{id}/replay"].is_object());
    assert!(api["paths"]["/v1/nodes/{id}/drain"].is_object());
    svc.post_json(&format!("/v1/runs/{run}/stop"), json!({}))
        .await;
    svc.wait_run(run).await;
    svc.stop().await;
}

#[tokio::test]
async fn inv_36_a_full_queue_refuses_with_429_and_changes_nothing() {
    let svc = TestService::start(
        texts().with_config("[service]\nmax_running_runs = 1\nmax_queued_runs = 1\n"),
    )
    .await;
    let blocker = svc.submit(json!({"agent": "slow", "input": "hold"})).await;
    svc.wait_running(blocker).await;
    let waiting = svc.submit(json!({"flow": "hello"})).await;
    let (status, reply) = svc.post_json("/v1/runs", json!({"flow": "hello"})).await;
    assert_eq!(status, 429, "{reply}");
    assert_eq!(reply["error"]["code"], "queue_full");
    assert_eq!(svc.submissions().len(), 2);
    svc.post_json(&format!("/v1/runs/{blocker}/stop"), json!({}))
        .await;
    let doc = svc.wait_run(waiting).await;
    assert_eq!(status_of(&doc), Status::Done);
    svc.stop().await;
}

#[tokio::test]
async fn a_submission_whose_run_had_started_before_a_crash_is_not_started_again() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"flow": "hello"})).await;
    svc.wait_run(run).await;
    let starts = |events: Vec<(u64, serde_json::Value)>| {
        events
            .iter()
            .filter(|(_, e)| e["kind"]["type"] == "run_started")
            .count()
    };
    assert_eq!(starts(svc.events(run, None).await), 1);
    let dir = svc.stop().await;
    // As a crash between starting the run and marking its submission
    // started would leave it: queued, with the run's record already there.
    {
        let journal = arbor_storage::Journal::open(&dir.path().join("data/journal")).unwrap();
        let mut sub = arbor_service::submission::submission(&journal, run)
            .unwrap()
            .expect("its submission");
        assert_eq!(sub.state, arbor_service::SubmissionState::Started);
        sub.state = arbor_service::SubmissionState::Queued;
        sub.epoch = journal.epoch();
        journal.commit(vec![sub.record().unwrap()]).await.unwrap();
        assert!(journal.run(run).unwrap().is_some());
    }
    let svc = TestService::start_in(dir, texts()).await;
    let (_, status) = svc.get_json("/v1/status").await;
    assert_eq!(status["admission"]["queued"], 0, "{status}");
    assert_eq!(
        svc.submissions()[0].state,
        arbor_service::SubmissionState::Started,
        "marked started at boot"
    );
    // A later run goes through, and the old one was not run again.
    let later = svc.submit(json!({"flow": "hello"})).await;
    svc.wait_run(later).await;
    assert_eq!(starts(svc.events(run, None).await), 1, "started once, ever");
    svc.stop().await;
}

/// Bytes and files below a folder (0 if it is not there).
fn disk_use(dir: &Path) -> (u64, usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    entries.flatten().fold((0, 0), |(bytes, files), entry| {
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            let (b, f) = disk_use(&entry.path());
            (bytes + b, files + f)
        } else {
            (bytes + meta.len(), files + 1)
        }
    })
}

/// Retention takes a forgotten run's workdirs off the disk with its records:
/// a fan-out whose jobs each wrote a file leaves `work/` as it was before it
/// ran, and the run it kept keeps its own.
#[tokio::test]
async fn a_forgotten_runs_workdirs_leave_the_disk_and_a_kept_ones_stay() {
    let writer = agent_md(
        "description: writes one file\ntools: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: notes.txt, content: \"some notes of this job's\"}}\n  - call: {tool: submit_output, args: {output: written}}",
    );
    let fan = agent_md(
        "subagents: [writer]\ntools: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: plan.txt, content: plan}}\n  - call: {tool: delegate, args: {jobs: [{agent: writer, request: a, label: a}, {agent: writer, request: b, label: b}, {agent: writer, request: c, label: c}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let texts = Texts::new(
        &[("fan", &fan), ("writer", &writer), ("slow", &slow())],
        &[(
            "fan",
            "[[group]]\nsteps = [{ agent = \"fan\", instruction = \"go\" }]\n",
        )],
    )
    .with_config("[service]\nkeep_finished = \"1h\"\n");
    let svc = TestService::start(texts).await;
    let work = svc.service.node().data_dir().join("work");
    let before = disk_use(&work);

    let mut done = vec![];
    for _ in 0..3 {
        let run = svc.submit(json!({"flow": "fan"})).await;
        assert_eq!(status_of(&svc.wait_run(run).await), Status::Done);
        done.push(run);
    }
    let kept = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    svc.wait_running(kept).await;
    let with_runs = disk_use(&work);
    assert!(with_runs.1 >= before.1 + 12, "{before:?} -> {with_runs:?}");
    for run in &done {
        assert!(work.join(run.to_string()).is_dir());
    }

    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(2 * 3600);
    let mut forgotten = svc.service.forget_finished(later).await.unwrap();
    forgotten.sort();
    done.sort();
    assert_eq!(forgotten, done);
    for run in &done {
        assert!(
            !work.join(run.to_string()).exists(),
            "{run}'s workdir is still there"
        );
    }
    // What is left is the running run's, and nothing else.
    assert!(work.join(kept.to_string()).is_dir());
    let kept_use = disk_use(&work.join(kept.to_string()));
    assert_eq!(
        disk_use(&work),
        (before.0 + kept_use.0, before.1 + kept_use.1),
        "work/ is back to where it was, but for the kept run"
    );
    svc.stop().await;
}

/// A long-lived node forgets a finished run once it has been over for
/// `keep_finished`: its records, its events, its idempotency key and its
/// place in the lists, for good (a restart does not bring it back). A run
/// still running is kept however old it is, and so is one finished lately.
#[tokio::test]
async fn finished_runs_are_forgotten_after_keep_finished_and_running_ones_never() {
    let svc = TestService::start(texts().with_config("[service]\nkeep_finished = \"1h\"\n")).await;
    let send = || {
        svc.post("/v1/runs")
            .header("Idempotency-Key", "nightly-1")
            .json(&json!({"flow": "hello"}))
            .send()
    };
    let first: serde_json::Value = send().await.unwrap().json().await.unwrap();
    let done: arbor_protocol::RunId = serde_json::from_value(first["id"].clone()).unwrap();
    assert_eq!(status_of(&svc.wait_run(done).await), Status::Done);
    let running = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    svc.wait_running(running).await;
    let journal = svc.service.node().journal();
    let jobs_of_done: Vec<_> = journal.jobs(done).unwrap().iter().map(|j| j.id).collect();
    assert!(!jobs_of_done.is_empty());

    // Over for less than an hour: kept.
    let now = std::time::SystemTime::now();
    assert_eq!(svc.service.forget_finished(now).await.unwrap(), vec![]);
    assert_eq!(svc.get_json(&format!("/v1/runs/{done}")).await.0, 200);

    // Two hours on: the finished run goes, the running one stays.
    let later = now + std::time::Duration::from_secs(2 * 3600);
    assert_eq!(
        svc.service.forget_finished(later).await.unwrap(),
        vec![done]
    );
    assert_eq!(svc.get_json(&format!("/v1/runs/{done}")).await.0, 404);
    assert_eq!(svc.get_json(&format!("/v1/runs/{running}")).await.0, 200);
    let (_, list) = svc.get_json("/v1/runs").await;
    let listed: Vec<&str> = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert!(!listed.contains(&done.to_string().as_str()), "{list}");
    assert!(listed.contains(&running.to_string().as_str()), "{list}");
    assert_eq!(journal.run(done).unwrap(), None);
    assert_eq!(
        arbor_service::submission::submission(journal, done).unwrap(),
        None
    );
    assert!(journal.events(done).unwrap().is_empty());
    for job in &jobs_of_done {
        assert!(
            journal
                .ledger(arbor_protocol::ParentRef::Job(*job))
                .unwrap()
                .is_empty()
        );
    }
    let report = journal.verify().unwrap();
    assert!(report.is_clean(), "{report:?}");
    // Its idempotency key went with it: the same request is a new run.
    let again = send().await.unwrap();
    assert_eq!(again.status(), 201);
    let again: serde_json::Value = again.json().await.unwrap();
    assert_ne!(again["id"], first["id"]);

    let svc = svc.restart().await;
    assert_eq!(svc.get_json(&format!("/v1/runs/{done}")).await.0, 404);
    assert_eq!(svc.get_json(&format!("/v1/runs/{running}")).await.0, 200);
    svc.stop().await;
}

#[test]
fn keep_finished_is_a_duration_or_forever_and_never_zero() {
    let resolve = |value: &str| {
        let table: toml::Table = toml::from_str(&format!("keep_finished = {value:?}")).unwrap();
        arbor_service::config::resolve(
            &table,
            Vec::<(String, String)>::new(),
            arbor_service::Flags::default(),
            std::path::PathBuf::from("data"),
        )
    };
    let week = std::time::Duration::from_secs(7 * 24 * 3600);
    let defaults = arbor_service::config::ServiceConfig::with_data_dir(Path::new("data"));
    assert_eq!(defaults.keep_finished, Some(week));
    assert_eq!(resolve("3d").unwrap().keep_finished, Some(week / 7 * 3));
    assert_eq!(resolve("forever").unwrap().keep_finished, None);
    for bad in ["0s", "0", "soon", "500ms"] {
        let error = resolve(bad).unwrap_err();
        assert!(error.contains("keep_finished"), "{bad}: {error}");
    }
}

#[tokio::test]
async fn a_failed_run_is_listed_with_the_job_its_failure_began_at_and_counted_by_class() {
    // The worker's script runs out (it fails); its boss reads that, then
    // runs out too: the worker failed first.
    let boss = agent_md(
        "subagents: [worker]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: go, label: digger}]}}\n  - call: {tool: collect, args: {}}",
    );
    let worker = agent_md("description: fails\nscript: []");
    let svc = TestService::start(Texts::new(
        &[("boss", &boss), ("worker", &worker), ("quick", &quick())],
        &[],
    ))
    .await;
    let failed = svc.submit(json!({"agent": "boss", "input": "dig"})).await;
    assert_eq!(status_of(&svc.wait_run(failed).await), Status::Failed);
    let fine = svc.submit(json!({"agent": "quick", "input": "hi"})).await;
    svc.wait_run(fine).await;

    let (status, list) = svc.get_json("/v1/runs?status=failed").await;
    assert_eq!(status, 200, "{list}");
    let runs = list["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{list}");
    assert_eq!(runs[0]["id"], failed.to_string());
    assert!(
        runs[0]["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{list}"
    );
    let first = &runs[0]["failed_job"];
    assert_eq!(first["label"], "digger", "{list}");
    assert_eq!(first["agent"], "worker", "{list}");
    assert!(first["error_class"].is_string(), "{list}");
    // Only a failed run carries one.
    let (_, done) = svc.get_json("/v1/runs?status=done").await;
    assert!(done["runs"][0].get("failed_job").is_none(), "{done}");

    let text = metrics_text(&svc).await;
    let class = runs[0]["error_class"].as_str().unwrap_or("none");
    let needle = format!("arbor_runs_failed_total{{class=\"{class}\"}} 1");
    assert!(text.contains(&needle), "{needle} in\n{text}");
}

#[tokio::test]
async fn inv_46_approvals_over_http_one_queue_a_decision_under_the_tokens_name_and_its_events() {
    let writer = agent_md(
        "tools: [write_file]\napprove: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: out.txt, content: hello}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let dir = tempfile::tempdir().unwrap();
    // A named token beside the main one: a decision records whose it was.
    let alice = "a1".repeat(20);
    std::fs::create_dir_all(dir.path().join("data")).unwrap();
    let tokens = dir.path().join("data/tokens");
    std::fs::write(&tokens, format!("# people who decide\nalice {alice}\n")).unwrap();
    std::fs::set_permissions(&tokens, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let svc = TestService::start_in(dir, Texts::new(&[("writer", &writer)], &[])).await;
    let run = svc
        .submit(json!({"agent": "writer", "input": "write it"}))
        .await;
    let seen = svc
        .events_until(run, None, |e| e["kind"]["type"] == "approval_requested")
        .await;
    let requested = &seen.last().unwrap().1;
    let card_id = requested["kind"]["card"].as_str().unwrap().to_string();

    let (status, list) = svc.get_json("/v1/approvals?state=pending").await;
    assert_eq!(status, 200, "{list}");
    let cards = list["approvals"].as_array().unwrap();
    assert_eq!(cards.len(), 1);
    let card = &cards[0];
    for key in [
        "id", "run", "job", "lineage", "tool", "args", "state", "asked_at", "deadline",
    ] {
        assert!(!card[key].is_null(), "{key} in {card}");
    }
    assert_eq!(card["id"], card_id.as_str());
    assert_eq!(card["run"], run.to_string());
    assert_eq!(card["lineage"], json!(["writer"]));
    assert_eq!(card["tool"], "write_file");
    assert_eq!(card["state"], "pending");
    let (_, by_run) = svc.get_json(&format!("/v1/approvals?run={run}")).await;
    assert_eq!(by_run["approvals"].as_array().unwrap().len(), 1);
    let (_, none) = svc.get_json("/v1/approvals?state=approved").await;
    assert_eq!(none["approvals"], json!([]));

    // Bad input changes nothing.
    let (status, _) = svc.get_json("/v1/approvals?state=maybe").await;
    assert_eq!(status, 400);
    let (status, _) = svc.get_json("/v1/approvals?run=nope").await;
    assert_eq!(status, 400);
    let path = format!("/v1/approvals/{card_id}");
    for (body, code) in [
        (json!({"decision": "reject"}), 422),
        (json!({"decision": "edit", "args": {"path": 5}}), 422),
        (json!({"decision": "approve", "args": {"path": "x"}}), 422),
        (json!({"decision": "perhaps"}), 400),
        (json!({"decision": "approve", "extra": 1}), 400),
    ] {
        let (status, reply) = svc.post_json(&path, body.clone()).await;
        assert_eq!(status, code, "{body}: {reply}");
    }
    let (status, _) = svc
        .post_json(
            &format!("/v1/approvals/{}", arbor_protocol::CardId::new()),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = svc
        .post_json("/v1/approvals/not-a-card", json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 400);
    let (_, still) = svc.get_json("/v1/approvals?state=pending").await;
    assert_eq!(still["approvals"].as_array().unwrap().len(), 1);

    // Alice approves; a second decision is a conflict.
    let response = svc
        .http()
        .post(format!("{}{path}", svc.url))
        .bearer_auth(&alice)
        .json(&json!({"decision": "approve", "reason": "checked the text"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let decided: serde_json::Value = response.json().await.unwrap();
    assert_eq!(decided["state"], "approved");
    assert_eq!(decided["decision"]["by"], "alice");
    assert_eq!(decided["decision"]["reason"], "checked the text");
    let (status, again) = svc
        .post_json(&path, json!({"decision": "reject", "reason": "too late"}))
        .await;
    assert_eq!(status, 409, "{again}");

    let doc = svc.wait_run(run).await;
    assert_eq!(status_of(&doc), Status::Done);
    let events = svc.events(run, None).await;
    let kinds: Vec<&str> = events
        .iter()
        .filter_map(|(_, e)| e["kind"]["type"].as_str())
        .filter(|t| t.starts_with("approval_"))
        .collect();
    assert_eq!(kinds, ["approval_requested", "approval_decided"]);
    let decided_event = &events
        .iter()
        .find(|(_, e)| e["kind"]["type"] == "approval_decided")
        .unwrap()
        .1;
    assert_eq!(
        (
            &decided_event["kind"]["state"],
            &decided_event["kind"]["by"]
        ),
        (&json!("approved"), &json!("alice"))
    );
    let event_schema = schema("event.schema.json");
    for (_, event) in &events {
        assert_valid(&event_schema, event);
    }
    let metrics = metrics_text(&svc).await;
    assert!(metrics.contains("arbor_approvals_pending 0"), "{metrics}");
    assert!(
        metrics.contains("arbor_approval_decisions_total{outcome=\"approved\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("arbor_approval_wait_seconds_count{outcome=\"approved\"} 1"));
    svc.stop().await;
}

/// `record: true` on a submission, then `POST /v1/runs/{id}/replay`: the
/// replay is queued as a run, linked to its recording, and ends as it did;
/// a run that was not recorded, a rerun of a run that did not fail, and a
/// replay's options on a rerun are refused, changing nothing.
#[tokio::test]
async fn a_recorded_submission_replays_over_http_and_bad_replays_are_refused() {
    let svc = TestService::start(texts()).await;
    let recorded = svc.submit(json!({"flow": "hello", "record": true})).await;
    let original = svc.wait_run(recorded).await;
    let (code, started) = svc
        .post_json(&format!("/v1/runs/{recorded}/replay"), json!({}))
        .await;
    assert_eq!(code, 201, "{started}");
    assert_eq!(started["replay_of"], recorded.to_string());
    let replayed: RunId = started["id"].as_str().unwrap().parse().unwrap();
    let doc = svc.wait_run(replayed).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    assert_eq!(doc["run"]["account"], original["run"]["account"]);
    assert_eq!(doc["run"]["output"], original["run"]["output"]);

    let plain = svc.submit(json!({"flow": "hello"})).await;
    svc.wait_run(plain).await;
    let queued_before = svc.submissions().len();
    for (run, body, code, says) in [
        (plain, json!({}), 422, "was not recorded"),
        (
            recorded,
            json!({"rerun_failed": true}),
            422,
            "completed: there is nothing to rerun",
        ),
        (
            recorded,
            json!({"dry_run": true}),
            400,
            "go with `rerun_failed`",
        ),
        (
            recorded,
            json!({"rerun_failed": true, "tools": "live"}),
            400,
            "are a replay's",
        ),
        (
            recorded,
            json!({"tools": "sometimes"}),
            400,
            "unknown variant `sometimes`",
        ),
        (RunId::new(), json!({}), 404, "no run"),
    ] {
        let (got, error) = svc
            .post_json(&format!("/v1/runs/{run}/replay"), body.clone())
            .await;
        assert_eq!(got, code, "{body}: {error}");
        assert!(error.to_string().contains(says), "{body}: {error}");
    }
    assert_eq!(svc.submissions().len(), queued_before, "nothing was queued");
}

/// I-63, the role matrix: every route of the OpenAPI document, called by a
/// credential of each role (and by one of every role, and the main token):
/// a role without the route's is refused 403 naming what it needs, and
/// nothing else is; each route's role is pinned here.
#[tokio::test]
async fn inv_63_every_route_answers_each_role_as_the_matrix_says() {
    use arbor_service::credentials;
    let pinned: &[(&str, &str)] = &[
        ("GET /v1/runs", "viewer"),
        ("POST /v1/runs", "operator"),
        ("GET /v1/runs/{id}", "viewer"),
        ("GET /v1/runs/{id}/events", "viewer"),
        ("POST /v1/runs/{id}/stop", "operator"),
        ("POST /v1/runs/{id}/budget", "operator"),
        ("POST /v1/runs/{id}/replay", "operator"),
        ("GET /v1/jobs/{id}", "viewer"),
        ("POST /v1/jobs/{id}/stop", "operator"),
        ("POST /v1/jobs/{id}/messages", "operator"),
        ("POST /v1/jobs/{id}/continue", "operator"),
        ("GET /v1/approvals", "viewer"),
        ("POST /v1/approvals/{id}", "approver"),
        ("GET /v1/notifications", "viewer"),
        ("POST /v1/notifications/{id}/retry", "operator"),
        ("GET /v1/audit", "admin"),
        ("GET /v1/tokens", "admin"),
        ("POST /v1/tokens", "admin"),
        ("DELETE /v1/tokens/{id}", "admin"),
        ("GET /v1/status", "viewer"),
        ("GET /v1/limits", "viewer"),
        ("GET /metrics", "viewer"),
        ("POST /v1/nodes/{id}/drain", "admin"),
        ("GET /v1/schedules", "viewer"),
        ("POST /v1/schedules/{name}/pause", "operator"),
        ("POST /v1/schedules/{name}/unpause", "operator"),
        ("POST /v1/schedules/{name}/trigger", "operator"),
        ("POST /v1/schedules/{name}/backfill", "operator"),
        ("POST /v1/workspace/reload", "admin"),
        ("GET /v1/workspace/versions", "viewer"),
        ("POST /v1/workspace/rollback", "admin"),
    ];
    // Every protected route of the document is pinned (the public ones
    // take no credential).
    let public = [
        "GET /healthz",
        "GET /readyz",
        "POST /v1/ui/session",
        "DELETE /v1/ui/session",
        // Its signature is its credential (`a_signed_trigger_...`).
        "POST /v1/triggers/{name}",
    ];
    let api = Service::openapi();
    let mut documented = std::collections::BTreeSet::new();
    for (path, item) in api["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let route = format!("{} {path}", method.to_uppercase());
            if !public.contains(&route.as_str()) {
                documented.insert(route);
            }
        }
    }
    let listed: std::collections::BTreeSet<String> =
        pinned.iter().map(|(r, _)| r.to_string()).collect();
    assert_eq!(
        documented, listed,
        "every protected route has its role here"
    );

    let svc = TestService::start(texts()).await;
    let data = svc.data_dir();
    let mut holders = vec![];
    for roles in [
        "viewer",
        "operator",
        "approver",
        "admin",
        "viewer,operator,approver",
    ] {
        let name = format!("as-{}", roles.replace(',', "-"));
        let (_, token) = credentials::add(&data, &svc.token, &name, "default", roles).unwrap();
        holders.push((roles, token));
    }
    holders.push(("main", svc.token.clone()));
    let http = reqwest::Client::new();
    let unknown = RunId::new().to_string();
    for (route, need) in pinned {
        let (method, path) = route.split_once(' ').unwrap();
        let url = format!("{}{}", svc.url, path.replace("{id}", &unknown));
        for (roles, token) in &holders {
            let request = match method {
                "GET" => http.get(&url),
                "DELETE" => http.delete(&url),
                _ => http.post(&url).json(&json!({})),
            };
            let answer = request.bearer_auth(token).send().await.unwrap();
            let status = answer.status().as_u16();
            let body = answer.text().await.unwrap_or_default();
            let allowed = *roles == "main"
                || roles.split(',').any(|r| r == *need || r == "admin")
                || *need == "viewer";
            if allowed {
                assert!(
                    status != 403 && status != 401,
                    "{route} as {roles}: {status} {body}"
                );
            } else {
                assert_eq!(status, 403, "{route} as {roles}: {body}");
                assert!(body.contains(&format!("needs {need}")), "{body}");
            }
        }
    }
}

/// I-63 over HTTP: a bearer JWT of `[auth.oidc]` is taken as its subject
/// with its roles (a viewer reads; its submit is 403); an expired one is a
/// 401 saying so.
#[tokio::test]
async fn inv_63_a_jwt_from_the_oidc_provider_reads_within_its_roles_and_an_expired_one_is_refused()
{
    use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../service/tests/fixtures/oidc");
    let svc = TestService::start(texts().with_config(&format!(
        "[auth.oidc]\nissuer = \"https://login.example.com/\"\naudience = \"arbor\"\njwks_file = \"{}\"\nroles_claim = \"groups\"\n",
        fixtures.join("jwks.json").display()
    )))
    .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let jwt = |exp: u64| {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some("test-1".into());
        let key = std::fs::read(fixtures.join("test-rsa.pem")).unwrap();
        let claims = json!({"sub": "ada", "iss": "https://login.example.com/", "aud": "arbor", "exp": exp, "groups": ["viewer"]});
        encode(&header, &claims, &EncodingKey::from_rsa_pem(&key).unwrap()).unwrap()
    };
    let http = reqwest::Client::new();
    let good = jwt(now + 600);
    let read = http
        .get(format!("{}/v1/runs", svc.url))
        .bearer_auth(&good)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    let submit = http
        .post(format!("{}/v1/runs", svc.url))
        .bearer_auth(&good)
        .json(&json!({"flow": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(submit.status(), 403);
    let expired = http
        .get(format!("{}/v1/runs", svc.url))
        .bearer_auth(jwt(now - 600))
        .send()
        .await
        .unwrap();
    assert_eq!(expired.status(), 401);
    assert!(expired.text().await.unwrap().contains("expired"));
}

/// `[auth.oidc] jwks_url`: the provider's keys are fetched at start, and
/// again when a JWT names a key id they lack (the provider rotated its
/// keys): that JWT is refused, the keys are fetched, and the next one with
/// the new key is taken. The console logs in with a JWT too.
#[tokio::test]
async fn inv_63_keys_from_a_jwks_url_are_fetched_and_fetched_again_on_a_new_key_id() {
    use jsonwebtoken::{Algorithm, EncodingKey, Header, encode};
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../service/tests/fixtures/oidc");
    let served = std::sync::Arc::new(std::sync::Mutex::new(
        std::fs::read_to_string(fixtures.join("jwks.json")).unwrap(),
    ));
    let provider = {
        let served = served.clone();
        axum::Router::new().route(
            "/jwks",
            axum::routing::get(move || {
                let text = served.lock().unwrap().clone();
                async move { text }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, provider).await });
    let svc = TestService::start(texts().with_config(&format!(
        "[auth.oidc]\nissuer = \"https://login.example.com/\"\naudience = \"arbor\"\njwks_url = \"http://{at}/jwks\"\nroles_claim = \"groups\"\n"
    )))
    .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let jwt = |kid: &str, pem: &str| {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.into());
        let key = std::fs::read(fixtures.join(pem)).unwrap();
        let claims = json!({"sub": "ada", "iss": "https://login.example.com/", "aud": "arbor", "exp": now + 600, "groups": ["viewer"]});
        encode(&header, &claims, &EncodingKey::from_rsa_pem(&key).unwrap()).unwrap()
    };
    let read = |token: String| {
        let url = format!("{}/v1/runs", svc.url);
        async move {
            let answer = reqwest::Client::new()
                .get(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            (answer.status().as_u16(), answer.text().await.unwrap())
        }
    };
    assert_eq!(read(jwt("test-1", "test-rsa.pem")).await.0, 200);
    // The provider rotates: a second key, with an id of its own.
    *served.lock().unwrap() = std::fs::read_to_string(fixtures.join("jwks-rotated.json")).unwrap();
    let oidc = svc.service.oidc().expect("[auth.oidc]");
    let mut fetched = oidc.fetched();
    fetched.mark_unchanged();
    let (status, why) = read(jwt("test-2", "other-rsa.pem")).await;
    assert_eq!(status, 401);
    assert!(
        why.contains("test-2") && why.contains("is not one of the provider's keys"),
        "{why}"
    );
    tokio::time::timeout(std::time::Duration::from_secs(20), fetched.changed())
        .await
        .expect("the keys were fetched again")
        .unwrap();
    assert_eq!(read(jwt("test-2", "other-rsa.pem")).await.0, 200);
    // The console's login takes the JWT; its session reads as its caller.
    let login = reqwest::Client::new()
        .post(format!("{}/v1/ui/session", svc.url))
        .json(&json!({"token": jwt("test-2", "other-rsa.pem")}))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 204);
    let cookie = login
        .headers()
        .get("set-cookie")
        .unwrap()
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let status = reqwest::Client::new()
        .get(format!("{}/v1/runs", svc.url))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
}

/// I-58 over HTTP: `POST /v1/runs/{id}/budget` tops a running run up, its
/// grant journaled before the 200 and its audit entry with it (I-64); a
/// top-up of nothing, of 0, of a usd ceiling the run lacks, with an
/// unknown key, of an unknown or an ended run is refused, naming why, and
/// changes nothing.
#[tokio::test]
async fn inv_58_a_top_up_over_http_raises_the_ceiling_and_bad_ones_change_nothing() {
    let svc = TestService::start(texts()).await;
    let run = svc.submit(json!({"agent": "slow", "input": "wait"})).await;
    svc.wait_running(run).await;
    let path = format!("/v1/runs/{run}/budget");
    let (_, before) = svc.get_json(&format!("/v1/runs/{run}")).await;
    let grant = before["run"]["account"]["grant"].as_u64().unwrap();
    for (body, status, words) in [
        (json!({}), 422, "names `tokens`, `usd_micros` or both"),
        (json!({"tokens": 0}), 422, "at least 1"),
        (json!({"usd_micros": 5}), 422, "no usd ceiling"),
        (json!({"tokens": 5, "more": 1}), 400, "unknown field"),
        (json!({"tokens": -5}), 400, ""),
    ] {
        let (got, reply) = svc.post_json(&path, body.clone()).await;
        assert_eq!(got, status, "{body}: {reply}");
        assert!(reply.to_string().contains(words), "{body}: {reply}");
    }
    let (status, _) = svc
        .post_json(
            &format!("/v1/runs/{}/budget", arbor_protocol::RunId::new()),
            json!({"tokens": 5}),
        )
        .await;
    assert_eq!(status, 404);
    let (_, unchanged) = svc.get_json(&format!("/v1/runs/{run}")).await;
    assert_eq!(
        unchanged["run"]["account"]["grant"], grant,
        "refusals change nothing"
    );
    let (status, topped) = svc.post_json(&path, json!({"tokens": 700})).await;
    assert_eq!(status, 200, "{topped}");
    assert_eq!(topped["run"], run.to_string());
    assert_eq!(topped["account"]["grant"], grant + 700);
    let (_, audit) = svc.get_json("/v1/audit").await;
    let entries: Vec<&serde_json::Value> = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["route"] == "POST /v1/runs/{id}/budget")
        .collect();
    assert!(
        entries.iter().any(|e| e["status"] == 200),
        "the top-up has its audit entry: {audit}"
    );
    svc.post_json(&format!("/v1/runs/{run}/stop"), json!({}))
        .await;
    svc.wait_run(run).await;
    let (status, reply) = svc.post_json(&path, json!({"tokens": 5})).await;
    assert_eq!(status, 409, "{reply}");
}

#[tokio::test]
async fn inv_58_a_submission_that_pauses_at_its_ceiling_shows_it_and_a_top_up_over_http_finishes_it()
 {
    let svc = TestService::start(texts()).await;
    for (body, words) in [
        (
            json!({"agent": "quick", "input": "hi", "on_ceiling": "sometimes"}),
            "unknown variant `sometimes`",
        ),
        (
            json!({"agent": "quick", "input": "hi", "pause_timeout": "1h"}),
            "pause_timeout is for on_ceiling = \\\"pause\\\"",
        ),
        (
            json!({"agent": "quick", "input": "hi", "on_ceiling": "pause", "pause_timeout": "soon"}),
            "pause_timeout: bad duration",
        ),
    ] {
        let (status, reply) = svc.post_json("/v1/runs", body.clone()).await;
        assert!(status == 400 || status == 422, "{body}: {status} {reply}");
        assert!(reply.to_string().contains(words), "{body}: {reply}");
    }
    let (_, listed) = svc.get_json("/v1/runs").await;
    assert_eq!(
        listed["runs"].as_array().map(Vec::len),
        Some(0),
        "refusals start nothing"
    );
    // Ten tokens cannot pay for its first call: it pauses instead of failing.
    let run = svc
        .submit(json!({"agent": "quick", "input": "hi", "budget": {"tokens": 10}, "on_ceiling": "pause"}))
        .await;
    let seen = svc
        .events_until(run, None, |e| e["kind"]["type"] == "budget_reached")
        .await;
    assert_eq!(seen.last().unwrap().1["kind"]["type"], "budget_reached");
    let (_, doc) = svc.get_json(&format!("/v1/runs/{run}")).await;
    assert_eq!(doc["run"]["status"], "running", "{doc}");
    let waiting = doc["run"]["waiting"].clone();
    assert_eq!(waiting["reason"], "budget", "{doc}");
    let needs = waiting["needs"]["tokens"].as_u64().unwrap();
    assert!(needs > 10, "{waiting}");
    let (status, topped) = svc
        .post_json(&format!("/v1/runs/{run}/budget"), json!({"tokens": needs}))
        .await;
    assert_eq!(status, 200, "{topped}");
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    assert_eq!(doc["run"]["account"]["grant"], 10 + needs);
    assert!(doc["run"]["waiting"].is_null(), "{doc}");
}

/// I-65, seen: `GET /v1/limits` lists each rate window with its limits and
/// what the minute ending now holds: the provider's (`mock/*`) after one
/// answered call holds one request and the tokens it used (its worst case
/// given back).
#[tokio::test]
async fn inv_65_the_limits_route_shows_each_window_and_what_it_holds() {
    use arbor_testkit::mock_provider::{Format, MockProvider, openai};
    let mock = MockProvider::start().await;
    mock.push(Format::Openai, openai::text("A fact.", 30, 7));
    let config = mock.arbor_toml(Format::Openai, "stream = false\nrpm = 100\ntpm = 50000");
    let caller = "---\nmodel: mock/small\ndescription: asks once\n---\nYou answer.\n";
    let svc = TestService::start(
        Texts::new(&[("caller", caller), ("quick", &quick())], &[]).with_config(&config),
    )
    .await;
    let (status, before) = svc.get_json("/v1/limits").await;
    assert_eq!(status, 200, "{before}");
    assert_eq!(
        before["models"],
        json!([{"model": "mock/*", "rpm": 100, "tpm": 50000, "used": {"requests": 0, "tokens": 0}, "closed_ms": 0, "waiting": 0}])
    );
    let run = svc.submit(json!({"agent": "caller", "input": "go"})).await;
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    let (_, after) = svc.get_json("/v1/limits").await;
    assert_eq!(
        after["models"][0]["used"],
        json!({"requests": 1, "tokens": 37})
    );
    // The same in the metrics.
    let metrics = metrics_text(&svc).await;
    for line in [
        "arbor_rate_window_used{window=\"mock/*\",unit=\"requests\"} 1",
        "arbor_rate_window_used{window=\"mock/*\",unit=\"tokens\"} 37",
        "arbor_rate_window_limit{window=\"mock/*\",unit=\"requests\"} 100",
        "arbor_rate_window_limit{window=\"mock/*\",unit=\"tokens\"} 50000",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
}

/// `POST /v1/runs {flow, input}`: an input that fails the flow's schema is
/// a 422 naming the path that failed, and queues nothing; one that meets
/// it starts a run whose step was told it (and whose spec keeps it).
#[tokio::test]
async fn a_flows_input_is_checked_at_submission_and_reaches_its_step() {
    let flow = "input = { type = \"object\", required = [\"topic\"], properties = { topic = { type = \"string\", minLength = 2 } } }\n\
                [[group]]\nsteps = [{ agent = \"quick\", instruction = \"Say hi about {{ input.topic }}\" }]\n";
    let svc = TestService::start(Texts::new(&[("quick", &quick())], &[("topical", flow)])).await;
    let (status, refused) = svc
        .post_json(
            "/v1/runs",
            json!({"flow": "topical", "input": {"topic": 7}}),
        )
        .await;
    assert_eq!(status, 422, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("/topic"), "{message}");
    let (status, refused) = svc.post_json("/v1/runs", json!({"flow": "topical"})).await;
    assert_eq!(status, 422, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("needs an input")
    );
    let (_, runs) = svc.get_json("/v1/runs").await;
    assert_eq!(runs["runs"].as_array().map(Vec::len), Some(0), "{runs}");

    let run = svc
        .submit(json!({"flow": "topical", "input": {"topic": "tides"}}))
        .await;
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    let started = svc
        .service
        .node()
        .journal()
        .events(run)
        .unwrap()
        .into_iter()
        .find_map(|e| match e.kind {
            arbor_protocol::EventKind::RunStarted { spec, .. } => Some(spec),
            _ => None,
        })
        .expect("the run started");
    assert_eq!(started.groups[0].steps[0].instruction, "Say hi about tides");
    assert_eq!(started.input, Some(json!({"topic": "tides"})));
}
