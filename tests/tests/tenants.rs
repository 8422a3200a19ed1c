//! Many teams on one arbord (I-63): with `[tenants]`, a credential sees and
//! acts on its own tenant's work only; another tenant's run, job, card and
//! notification are a 404 on every route that names one, in the words an
//! id that never was gets, and are in none of its lists.

use arbor_service::credentials;
use arbor_testkit::service::{TestService, Texts};
use serde_json::{Value, json};
use std::os::unix::fs::PermissionsExt;

/// Asks to write a file: its card stays pending while the test looks.
const WRITER: &str = "---\ndescription: asks to write\ntools: [write_file]\napprove: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: out.txt, content: hello}}\n  - call: {tool: submit_output, args: {output: done}}\n---\nYou write.\n";
const QUICK: &str = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: hi}}\n---\nYou answer.\n";

/// Two tenants; every event is a notification to a port nothing answers on
/// (so entries wait in the outbox).
async fn two_teams() -> TestService {
    let dir = tempfile::tempdir().unwrap();
    let workspace = dir.path().join("workspace");
    std::fs::create_dir_all(&workspace).unwrap();
    let secrets = workspace.join("secrets.env");
    std::fs::write(
        &secrets,
        "HOOK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    )
    .unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let texts = Texts::new(
        &[("writer", WRITER), ("quick", QUICK)],
        &[(
            "hello",
            "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n",
        )],
    )
    .with_config(
        "[sandbox]\nsecrets_file = \"secrets.env\"\n\n\
         [notify.ops]\nurl = \"http://127.0.0.1:9/hook\"\nsecret = \"HOOK_SECRET\"\nevents = [\"*\"]\nretry_wait = \"1h\"\n\n\
         [tenants.team-a]\ninstructions = \"Cite your sources.\"\n\n\
         [tenants.team-b]\nagents = [\"quick\"]\n",
    );
    TestService::start_in(dir, texts).await
}

async fn call(svc: &TestService, token: &str, method: &str, path: &str) -> (u16, String) {
    let url = format!("{}{path}", svc.url);
    let http = reqwest::Client::new();
    // A body each route takes, so that what answers is the id.
    let body = match path.rsplit('/').next() {
        Some("messages") => json!({"text": "go on"}),
        _ if path.starts_with("/v1/approvals/") => json!({"decision": "approve"}),
        _ => json!({}),
    };
    let request = match method {
        "GET" => http.get(&url),
        _ => http.post(&url).json(&body),
    };
    let answer = request.bearer_auth(token).send().await.unwrap();
    let status = answer.status().as_u16();
    (status, answer.text().await.unwrap_or_default())
}

/// I-63: every route of the OpenAPI document that names an object answers
/// 404 to each credential of tenant b, admin or viewer, for tenant a's
/// run, step, card and notification (to its admin word for word as for an
/// id that never was); no list of b's carries a's ids; a's own viewer reads them and is
/// refused what it may not do with a 403; the main token sees both teams.
#[tokio::test]
async fn inv_63_another_tenants_objects_are_a_404_on_every_route_and_in_no_list() {
    let svc = two_teams().await;
    let data = svc.data_dir();
    let add = |name: &str, tenant: &str, roles: &str| {
        credentials::add(&data, &svc.token, name, tenant, roles)
            .unwrap()
            .1
    };
    let a_operator = add("a-op", "team-a", "operator,approver");
    let a_viewer = add("a-view", "team-a", "viewer");
    let b_admin = add("b-admin", "team-b", "admin");
    let b_viewer = add("b-view", "team-b", "viewer");

    // Team a's run, waiting on its card; its notifications queued.
    let (status, body) = {
        let answer = reqwest::Client::new()
            .post(format!("{}/v1/runs", svc.url))
            .bearer_auth(&a_operator)
            .json(&json!({"agent": "writer", "input": "write it"}))
            .send()
            .await
            .unwrap();
        (answer.status().as_u16(), answer.text().await.unwrap())
    };
    assert_eq!(status, 201, "{body}");
    let run: arbor_protocol::RunId = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let seen = svc
        .events_until(run, None, |e| e["kind"]["type"] == "approval_requested")
        .await;
    let asked = &seen.last().unwrap().1["kind"];
    let card = asked["card"].as_str().unwrap().to_string();
    let job = asked["id"].as_str().unwrap().to_string();
    let (_, listed) = svc.get_json(&format!("/v1/notifications?run={run}")).await;
    let notification = listed["notifications"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a notification of the run: {listed}"))
        .to_string();
    let (_, doc) = svc.get_json(&format!("/v1/runs/{run}")).await;
    assert_eq!(doc["run"]["tenant"], "team-a", "{doc}");

    // Every route that names an object, as the document lists them.
    let api = arbor_service::Service::openapi();
    let mut walked = 0;
    for (path, item) in api["paths"].as_object().unwrap() {
        let (id, fresh) = match path.split('/').nth(2) {
            Some("runs") => (run.to_string(), arbor_protocol::RunId::new().to_string()),
            Some("jobs") => (job.clone(), arbor_protocol::JobId::new().to_string()),
            Some("approvals") => (card.clone(), arbor_protocol::CardId::new().to_string()),
            Some("notifications") => (
                notification.clone(),
                format!("msg_{}", arbor_protocol::RunId::new().0.simple()),
            ),
            _ => continue,
        };
        if !path.contains("{id}") {
            continue;
        }
        for method in item.as_object().unwrap().keys() {
            let method = method.to_uppercase();
            for token in [&b_admin, &b_viewer] {
                let foreign = call(&svc, token, &method, &path.replace("{id}", &id)).await;
                assert_eq!(foreign.0, 404, "{method} {path}: {}", foreign.1);
            }
            // To a credential with every role, word for word an id that never was.
            let foreign = call(&svc, &b_admin, &method, &path.replace("{id}", &id)).await;
            let never = call(&svc, &b_admin, &method, &path.replace("{id}", &fresh)).await;
            assert_eq!(
                foreign.1.replace(&id, "ID"),
                never.1.replace(&fresh, "ID"),
                "{method} {path}: another tenant's id reads as one that never was"
            );
            walked += 1;
        }
    }
    assert!(walked >= 10, "{walked} routes walked");

    // No list of team b's carries an id of team a's.
    for list in [
        "/v1/runs",
        "/v1/approvals",
        "/v1/notifications",
        "/v1/status",
    ] {
        for token in [&b_admin, &b_viewer] {
            let (status, body) = call(&svc, token, "GET", list).await;
            assert_eq!(status, 200, "{list}: {body}");
            for id in [&run.to_string(), &job, &card, &notification] {
                assert!(!body.contains(id.as_str()), "{list} shows {id}: {body}");
            }
        }
    }
    // Metrics: the node's admin sees each team's runs; a team's viewer
    // sees its own team's figures and nothing of the node's.
    let (_, all) = call(&svc, &svc.token, "GET", "/metrics").await;
    assert!(
        all.contains("arbor_tenant_runs{tenant=\"team-a\",status=\"running\"} 1"),
        "{all}"
    );
    assert!(all.contains("arbor_runs{"), "{all}");
    let (status, theirs) = call(&svc, &b_viewer, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        theirs.contains("arbor_tenant_runs{tenant=\"team-b\",status=\"running\"} 0"),
        "{theirs}"
    );
    assert!(
        !theirs.contains("team-a") && !theirs.contains("arbor_runs{"),
        "{theirs}"
    );
    assert!(theirs.ends_with("# EOF\n"), "{theirs}");
    // Team b cannot submit for team a, nor run an agent its list leaves out.
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/runs", svc.url))
        .bearer_auth(&b_admin)
        .json(&json!({"flow": "hello", "tenant": "team-a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 404);
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/runs", svc.url))
        .bearer_auth(&b_admin)
        .json(&json!({"agent": "writer", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let why = refused.text().await.unwrap();
    assert!(why.contains("may not run agent writer"), "{why}");

    // Team a's viewer reads its run, and is refused its stop with a 403.
    let (status, body) = call(&svc, &a_viewer, "GET", &format!("/v1/runs/{run}")).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = call(&svc, &a_viewer, "POST", &format!("/v1/runs/{run}/stop")).await;
    assert_eq!(status, 403, "{body}");
    let (_, listed) = call(&svc, &a_viewer, "GET", "/v1/approvals").await;
    assert!(listed.contains(&card), "{listed}");

    // The main token is an admin of every tenant: it sees team a's run,
    // and decides its card.
    let (_, all) = svc.get_json("/v1/runs").await;
    assert!(all.to_string().contains(&run.to_string()), "{all}");
    let (status, decided) = svc
        .post_json(
            &format!("/v1/approvals/{card}"),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 200, "{decided}");
    let doc = svc.wait_run(run).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
}

/// A credential of a tenant arbor.toml does not name is refused, saying so.
#[tokio::test]
async fn inv_63_a_credential_of_an_unnamed_tenant_is_refused() {
    let svc = two_teams().await;
    let (_, token) =
        credentials::add(&svc.data_dir(), &svc.token, "ghost", "team-z", "viewer").unwrap();
    let (status, body) = call(&svc, &token, "GET", "/v1/runs").await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("tenant team-z"), "{body}");
}

/// Runs for a minute unless stopped: a step to stop.
const SLOW: &str = "---\ndescription: takes its time\nscript:\n  - say: thinking\n    delay: 60s\n  - call: {tool: submit_output, args: {output: late}}\n---\nYou wait.\n";

/// POSTs `body` to `path` as `token`: the status and the body.
async fn post(svc: &TestService, token: &str, path: &str, body: Value) -> (u16, Value) {
    let answer = reqwest::Client::new()
        .post(format!("{}{path}", svc.url))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

/// I-64 over HTTP: every call that changes something, and every refused
/// attempt, is one entry: who, tenant, role, route, target, outcome,
/// status, time and client; `GET /v1/audit` is an admin's, filtered, and a
/// tenant's admin reads its own tenant's entries only.
#[tokio::test]
async fn inv_64_every_change_and_every_refusal_through_the_api_is_one_audit_entry() {
    let dir = tempfile::tempdir().unwrap();
    let texts = Texts::new(&[("writer", WRITER), ("slow", SLOW)], &[])
        .with_config("[tenants.team-a]\n[tenants.team-b]\n");
    let svc = TestService::start_in(dir, texts).await;
    let data = svc.data_dir();
    let add = |name: &str, tenant: &str, roles: &str| {
        credentials::add(&data, &svc.token, name, tenant, roles)
            .unwrap()
            .1
    };
    let a_op = add("a-op", "team-a", "operator,approver");
    let b_view = add("b-view", "team-b", "viewer");
    let b_admin = add("b-admin", "team-b", "admin");

    // Submit, steer, decide: each an entry, ok, the change its target.
    let (status, made) = post(
        &svc,
        &a_op,
        "/v1/runs",
        json!({"agent": "writer", "input": "w"}),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let run = made["id"].as_str().unwrap().to_string();
    let seen = svc
        .events_until(run.parse().unwrap(), None, |e| {
            e["kind"]["type"] == "approval_requested"
        })
        .await;
    let asked = &seen.last().unwrap().1["kind"];
    let (card, job) = (
        asked["card"].as_str().unwrap().to_string(),
        asked["id"].as_str().unwrap().to_string(),
    );
    let (status, _) = post(
        &svc,
        &a_op,
        &format!("/v1/jobs/{job}/messages"),
        json!({"text": "hurry"}),
    )
    .await;
    assert_eq!(status, 202);
    let (status, _) = post(
        &svc,
        &a_op,
        &format!("/v1/approvals/{card}"),
        json!({"decision": "approve"}),
    )
    .await;
    assert_eq!(status, 200);
    svc.wait_run(run.parse().unwrap()).await;
    // A step stopped, then its run: each an entry with its end.
    let (_, slow) = post(
        &svc,
        &a_op,
        "/v1/runs",
        json!({"agent": "slow", "input": "w"}),
    )
    .await;
    let slow_run: arbor_protocol::RunId = slow["id"].as_str().unwrap().parse().unwrap();
    let step = svc.wait_running(slow_run).await;
    let (status, _) = post(&svc, &a_op, &format!("/v1/jobs/{step}/stop"), json!({})).await;
    assert_eq!(status, 202);
    svc.wait_run(slow_run).await;
    // An error (nothing to continue), and refusals: another tenant's
    // run, a role the credential lacks, no credential at all.
    let (status, _) = post(&svc, &a_op, &format!("/v1/jobs/{job}/continue"), json!({})).await;
    assert_eq!(status, 409);
    let (status, _) = post(&svc, &b_view, &format!("/v1/runs/{run}/stop"), json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = post(
        &svc,
        &b_view,
        "/v1/runs",
        json!({"agent": "slow", "input": "w"}),
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = post(
        &svc,
        "not-a-token",
        "/v1/runs",
        json!({"agent": "slow", "input": "w"}),
    )
    .await;
    assert_eq!(status, 401);
    // A console login: the session's caller is the credential's.
    let login = reqwest::Client::new()
        .post(format!("{}/v1/ui/session", svc.url))
        .json(&json!({"token": a_op}))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 204);

    let (status, log) = svc.get_json("/v1/audit").await;
    assert_eq!(status, 200, "{log}");
    let entries = log["entries"].as_array().unwrap();
    let find = |route: &str, outcome: &str| -> Vec<&Value> {
        entries
            .iter()
            .filter(|e| e["route"] == route && e["outcome"] == outcome)
            .collect()
    };
    let one = |route: &str, outcome: &str| -> &Value {
        let found = find(route, outcome);
        assert_eq!(found.len(), 1, "{route} {outcome}: {log}");
        found[0]
    };
    let submitted = find("POST /v1/runs", "ok");
    assert_eq!(submitted.len(), 2, "{log}");
    assert_eq!(submitted[0]["target"], run.as_str());
    assert_eq!(submitted[0]["subject"], "a-op");
    assert_eq!(submitted[0]["tenant"], "team-a");
    assert_eq!(submitted[0]["role"], "operator");
    assert!(
        submitted[0]["client"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:"),
        "{log}"
    );
    assert_eq!(
        one("POST /v1/jobs/{id}/messages", "ok")["target"],
        job.as_str()
    );
    assert_eq!(
        one("POST /v1/approvals/{id}", "ok")["target"],
        card.as_str()
    );
    assert_eq!(
        one("POST /v1/jobs/{id}/stop", "ok")["target"],
        step.as_str()
    );
    assert_eq!(one("POST /v1/jobs/{id}/continue", "error")["status"], 409);
    let foreign = one("POST /v1/runs/{id}/stop", "refused");
    assert_eq!(
        (&foreign["subject"], foreign["status"].as_u64()),
        (&json!("b-view"), Some(404))
    );
    assert_eq!(foreign["role"], "operator", "the role the route needs");
    let refused: Vec<(&Value, &Value, &Value)> = find("POST /v1/runs", "refused")
        .iter()
        .map(|e| (&e["subject"], &e["status"], &e["role"]))
        .collect();
    assert_eq!(
        refused,
        [
            (&json!("b-view"), &json!(403), &json!("operator")),
            (&json!("anonymous"), &json!(401), &Value::Null)
        ],
        "{log}"
    );
    assert_eq!(
        submitted[0]["status"], 201,
        "a change's entry says its answer"
    );
    assert_eq!(one("POST /v1/ui/session", "ok")["subject"], "a-op");
    // Reads are not entries.
    assert!(
        entries
            .iter()
            .all(|e| !e["route"].as_str().unwrap().starts_with("GET"))
    );

    // Filters, and who may read it.
    let (_, mine) = svc.get_json("/v1/audit?subject=b-view").await;
    assert_eq!(mine["entries"].as_array().unwrap().len(), 2, "{mine}");
    let (status, _) = call(&svc, &a_op, "GET", "/v1/audit").await;
    assert_eq!(status, 403, "an operator does not read the audit");
    let (status, theirs) = call(&svc, &b_admin, "GET", "/v1/audit").await;
    assert_eq!(status, 200);
    let theirs: Value = serde_json::from_str(&theirs).unwrap();
    assert!(
        theirs["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["tenant"] == "team-b"),
        "{theirs}"
    );
}

/// I-63 through the API: an admin of every tenant makes a credential (its
/// token shown once, and it works at once), lists and revokes it; an admin
/// of one tenant manages its own tenant's credentials only; each call is
/// an audit entry.
#[tokio::test]
async fn inv_63_an_admin_manages_credentials_through_the_api_within_its_tenant() {
    let svc = two_teams().await;
    let (status, made) = svc
        .post_json(
            "/v1/tokens",
            json!({"name": "a-lead", "tenant": "team-a", "roles": ["admin"]}),
        )
        .await;
    assert_eq!(status, 201, "{made}");
    let a_lead = made["token"].as_str().unwrap().to_string();
    assert_eq!(
        (&made["tenant"], &made["roles"]),
        (&json!("team-a"), &json!(["admin"]))
    );
    // It works at once; as team a's admin it makes team a's credentials only.
    let (status, viewer) = post(
        &svc,
        &a_lead,
        "/v1/tokens",
        json!({"name": "a-view", "roles": ["viewer"]}),
    )
    .await;
    assert_eq!(status, 201, "{viewer}");
    assert_eq!(viewer["tenant"], "team-a");
    let (status, _) = post(
        &svc,
        &a_lead,
        "/v1/tokens",
        json!({"name": "b-spy", "tenant": "team-b", "roles": ["admin"]}),
    )
    .await;
    assert_eq!(status, 404, "another tenant's is not its to make");
    let (status, _) = post(
        &svc,
        &a_lead,
        "/v1/tokens",
        json!({"name": "a-view", "roles": ["viewer"]}),
    )
    .await;
    assert_eq!(status, 409, "the name is taken");
    let (status, _) = post(
        &svc,
        &a_lead,
        "/v1/tokens",
        json!({"name": "a-root", "roles": ["root"]}),
    )
    .await;
    assert_eq!(status, 422, "not a role");
    let (_, b_made) = svc
        .post_json(
            "/v1/tokens",
            json!({"name": "b-view", "tenant": "team-b", "roles": ["viewer"]}),
        )
        .await;
    assert_eq!(b_made["tenant"], "team-b");
    // Lists: every one to the main token, team a's to team a's admin.
    let (_, all) = svc.get_json("/v1/tokens").await;
    let names = |list: &Value| -> Vec<String> {
        list["credentials"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&all), ["a-lead", "a-view", "b-view"]);
    assert!(!all.to_string().contains(&a_lead), "never a token");
    let (_, theirs) = call(&svc, &a_lead, "GET", "/v1/tokens").await;
    assert_eq!(
        names(&serde_json::from_str(&theirs).unwrap()),
        ["a-lead", "a-view"]
    );
    // Revoke: another tenant's is not there; its own is refused at once.
    let revoke = |token: String, name: &str| {
        let url = format!("{}/v1/tokens/{name}", svc.url);
        async move {
            reqwest::Client::new()
                .delete(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(revoke(a_lead.clone(), "b-view").await, 404);
    let a_view = viewer["token"].as_str().unwrap().to_string();
    assert_eq!(call(&svc, &a_view, "GET", "/v1/runs").await.0, 200);
    assert_eq!(revoke(a_lead.clone(), "a-view").await, 200);
    assert_eq!(call(&svc, &a_view, "GET", "/v1/runs").await.0, 401);
    // Each change, and the refused attempts, are in the audit log.
    let (_, log) = svc.get_json("/v1/audit?subject=a-lead").await;
    let routes: Vec<(&str, &str)> = log["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["route"].as_str().unwrap(), e["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        routes,
        [
            ("POST /v1/tokens", "ok"),
            ("POST /v1/tokens", "refused"),
            ("POST /v1/tokens", "error"),
            ("POST /v1/tokens", "error"),
            ("DELETE /v1/tokens/{id}", "refused"),
            ("DELETE /v1/tokens/{id}", "ok"),
        ],
        "{log}"
    );
}

/// I-64: no route that may change something escapes the audit. Every one
/// the OpenAPI document lists, called once (at ids that never were, with
/// bodies it may refuse), leaves an entry naming its route; reads leave none.
#[tokio::test]
async fn inv_64_every_route_that_may_change_something_leaves_an_entry() {
    let svc = two_teams().await;
    let api = arbor_service::Service::openapi();
    let mut called = vec![];
    for (path, item) in api["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let method = method.to_uppercase();
            let url = format!(
                "{}{}",
                svc.url,
                path.replace("{id}", &arbor_protocol::RunId::new().to_string())
            );
            let http = reqwest::Client::new();
            let request = match method.as_str() {
                "GET" => http.get(&url),
                "DELETE" => http.delete(&url),
                _ => http.post(&url).json(&json!({})),
            };
            let status = request
                .bearer_auth(&svc.token)
                .send()
                .await
                .unwrap()
                .status();
            assert!(status.as_u16() < 500, "{method} {path}: {status}");
            called.push((method, path.clone()));
        }
    }
    let (_, log) = svc.get_json("/v1/audit?limit=1000").await;
    let logged: std::collections::BTreeSet<String> = log["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["route"].as_str().unwrap().to_string())
        .collect();
    for (method, path) in &called {
        let route = format!("{method} {path}");
        assert_eq!(
            logged.contains(&route),
            method != "GET",
            "{route}: an entry only for a call that may change something: {log}"
        );
    }
}

// Quotas over time (I-65): a tenant's windows, reserved at admission.

/// Each of `lines` is in the node's metrics.
async fn metrics_say(svc: &TestService, lines: &[&str]) {
    let metrics = svc
        .get("/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in lines {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

/// Approves `card`, as the main token.
async fn approve(svc: &TestService, card: &str) {
    let (status, body) = svc
        .post_json(
            &format!("/v1/approvals/{card}"),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

/// The writer (its card pending) as flow `writes`, the quick agent as
/// `hello`, and this arbor.toml.
fn two_flows(arbor_toml: &str) -> Texts {
    Texts::new(
        &[("writer", WRITER), ("quick", QUICK)],
        &[
            (
                "hello",
                "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n",
            ),
            (
                "writes",
                "[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\" }]\n",
            ),
        ],
    )
    .with_config(arbor_toml)
}

/// `team-q` refuses over its quota; `team-w` queues; `team-b` has none.
async fn quota_teams() -> TestService {
    let texts = two_flows(
        "[tenants.team-q.quota]\ntokens_per_hour = 1000\nconcurrent_runs = 2\n\n\
         [tenants.team-w]\non_quota = \"queue\"\n\n[tenants.team-w.quota]\nconcurrent_runs = 1\n\n\
         [tenants.team-b]\n",
    );
    TestService::start(texts).await
}

async fn submit_for(
    svc: &TestService,
    tenant: &str,
    flow: &str,
    tokens: u64,
) -> (u16, Value, String) {
    let answer = svc
        .post("/v1/runs")
        .json(&json!({"flow": flow, "tenant": tenant, "budget": {"tokens": tokens}}))
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    let retry = answer
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, answer.json().await.unwrap_or_default(), retry)
}

async fn quota_of(svc: &TestService, tenant: &str) -> Value {
    let (status, limits) = svc.get_json("/v1/limits").await;
    assert_eq!(status, 200, "{limits}");
    limits["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == tenant)
        .cloned()
        .unwrap_or_else(|| panic!("{tenant} in {limits}"))
}

async fn wait_card(svc: &TestService, run: &str) -> String {
    let seen = svc
        .events_until(run.parse().unwrap(), None, |e| {
            e["kind"]["type"] == "approval_requested"
        })
        .await;
    seen.last().unwrap().1["kind"]["card"]
        .as_str()
        .unwrap()
        .to_string()
}

/// I-65: a run's ceiling is reserved from its tenant's windows when it is
/// submitted; a submission (or a top-up) the windows have no room for is a
/// 429 saying which window and when to try again, and changes nothing; the
/// run's end gives back what it did not spend, whose spend then counts for
/// the window's span after its end; the entries outlive a restart. Another
/// tenant is not touched.
#[tokio::test]
async fn inv_65_a_tenants_quota_is_reserved_at_admission_and_settled_at_the_end() {
    let svc = quota_teams().await;
    let (status, first, _) = submit_for(&svc, "team-q", "writes", 600).await;
    assert_eq!(status, 201, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    let card = wait_card(&svc, &first).await;

    let (status, refused, retry) = submit_for(&svc, "team-q", "hello", 600).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"], "quota");
    assert_eq!(refused["quota"], "tokens_per_hour");
    assert_eq!(refused["tenant"], "team-q");
    // Only the running run's end can make room: a short while.
    assert_eq!(refused["retry_after_s"], 10);
    assert_eq!(retry, "10");
    let (status, never, _) = submit_for(&svc, "team-q", "hello", 1001).await;
    assert_eq!(status, 422, "{never}");
    assert!(never.to_string().contains("could never start"), "{never}");
    let (status, other, _) = submit_for(&svc, "team-b", "hello", 5000).await;
    assert_eq!(status, 201, "another tenant is not touched: {other}");

    // A top-up is reserved as a run is.
    let top_up = format!("/v1/runs/{first}/budget");
    let (status, body) = svc.post_json(&top_up, json!({"tokens": 500})).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["quota"], "tokens_per_hour");
    let (status, body) = svc.post_json(&top_up, json!({"tokens": 100})).await;
    assert_eq!(status, 200, "{body}");
    let held = quota_of(&svc, "team-q").await;
    assert_eq!(
        held["quota"],
        json!({"tokens_per_hour": 1000, "concurrent_runs": 2})
    );
    assert_eq!(
        held["used"],
        json!({"tokens_per_hour": 700, "concurrent_runs": 1})
    );
    metrics_say(
        &svc,
        &[
            "arbor_quota_used{tenant=\"team-q\",quota=\"tokens_per_hour\"} 700",
            "arbor_quota_limit{tenant=\"team-q\",quota=\"tokens_per_hour\"} 1000",
            "arbor_quota_used{tenant=\"team-w\",quota=\"concurrent_runs\"} 0",
        ],
    )
    .await;
    let submissions = svc.submissions().len();

    approve(&svc, &card).await;
    let doc = svc.wait_run(first.parse().unwrap()).await;
    let spent = doc["run"]["account"]["spent"].as_u64().unwrap();
    assert!(spent > 0 && spent < 700, "{doc}");
    let held = quota_of(&svc, "team-q").await;
    assert_eq!(
        held["used"],
        json!({"tokens_per_hour": spent, "concurrent_runs": 0})
    );

    // What it spent counts for the hour after its end: a run may take the
    // rest, and the next one token waits for that hour.
    let (status, second, _) = submit_for(&svc, "team-q", "writes", 1000 - spent).await;
    assert_eq!(status, 201, "{second}");
    let second = second["id"].as_str().unwrap().to_string();
    let card = wait_card(&svc, &second).await;
    let (status, refused, _) = submit_for(&svc, "team-q", "hello", 1).await;
    assert_eq!(status, 429, "{refused}");
    let wait = refused["retry_after_s"].as_u64().unwrap();
    assert!((3590..=3600).contains(&wait), "{refused}");
    assert_eq!(
        svc.submissions().len(),
        submissions + 1,
        "a refusal queues nothing"
    );
    approve(&svc, &card).await;
    let second = svc.wait_run(second.parse().unwrap()).await;
    let both = spent + second["run"]["account"]["spent"].as_u64().unwrap();

    let svc = svc.restart().await;
    let held = quota_of(&svc, "team-q").await;
    assert_eq!(
        held["used"],
        json!({"tokens_per_hour": both, "concurrent_runs": 0})
    );
}

/// I-65: a tenant that says `on_quota = "queue"` has its run wait in the
/// queue until its windows have room, while another tenant's run passes
/// it; the run starts once a running run's end makes room.
#[tokio::test]
async fn inv_65_a_tenant_that_queues_waits_for_room_and_others_pass_it() {
    let svc = quota_teams().await;
    let (status, first, _) = submit_for(&svc, "team-w", "writes", 600).await;
    assert_eq!(status, 201, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    let card = wait_card(&svc, &first).await;
    let (status, second, _) = submit_for(&svc, "team-w", "hello", 600).await;
    assert_eq!(status, 201, "it queues: {second}");
    let second = second["id"].as_str().unwrap().to_string();
    let (status, other, _) = submit_for(&svc, "team-b", "hello", 600).await;
    assert_eq!(status, 201, "{other}");
    let other = svc
        .wait_run(other["id"].as_str().unwrap().parse().unwrap())
        .await;
    assert_eq!(
        other["run"]["status"], "done",
        "another tenant's run passed it"
    );

    let (_, waiting) = svc.get_json(&format!("/v1/runs/{second}")).await;
    assert_eq!(waiting["run"]["status"], "pending", "{waiting}");
    let held = quota_of(&svc, "team-w").await;
    assert_eq!(held["queued"], 1, "{held}");
    assert_eq!(held["on_quota"], "queue");
    assert_eq!(held["used"], json!({"concurrent_runs": 1}));

    approve(&svc, &card).await;
    let doc = svc.wait_run(second.parse().unwrap()).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    let held = quota_of(&svc, "team-w").await;
    assert_eq!(held["queued"], 0, "{held}");
    assert_eq!(held["used"], json!({"concurrent_runs": 0}));
}

// Fair dispatch: tenants take turns by weight; concurrency keys.

async fn submit_prio(svc: &TestService, tenant: &str, flow: &str, priority: Option<u8>) -> String {
    let mut body = json!({"flow": flow, "tenant": tenant});
    if let Some(priority) = priority {
        body["priority"] = json!(priority);
    }
    let (status, reply) = svc.post_json("/v1/runs", body).await;
    assert_eq!(status, 201, "{reply}");
    reply["id"].as_str().unwrap().to_string()
}

/// One slot; team a weighs 2, team b 1. While a run of a's holds the slot,
/// a queues six runs and b three, then one of priority 1: once the slot
/// frees, b's urgent run goes first (b's turn had come, and within b it is
/// first), then the tenants take turns two to one, each in arrival order.
#[tokio::test]
async fn the_queue_serves_tenants_in_turn_by_weight_and_each_by_priority() {
    let texts = two_flows(
        "[service]\nmax_running_runs = 1\n\n[tenants.team-a]\nweight = 2\n\n[tenants.team-b]\n",
    );
    let svc = TestService::start(texts).await;
    let started = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    {
        let started = started.clone();
        svc.service
            .node()
            .events()
            .observe(std::sync::Arc::new(move |e| {
                if matches!(e.kind, arbor_protocol::EventKind::RunStarted { .. }) {
                    started.lock().unwrap().push(e.run.to_string());
                }
            }));
    }
    let blocker = submit_prio(&svc, "team-a", "writes", None).await;
    let card = wait_card(&svc, &blocker).await;
    let mut name = std::collections::HashMap::new();
    for i in 1..=6 {
        name.insert(
            submit_prio(&svc, "team-a", "hello", None).await,
            format!("a{i}"),
        );
    }
    for i in 1..=3 {
        name.insert(
            submit_prio(&svc, "team-b", "hello", None).await,
            format!("b{i}"),
        );
    }
    // Out of range is refused, and changes nothing.
    let (status, refused) = svc
        .post_json(
            "/v1/runs",
            json!({"flow": "hello", "tenant": "team-b", "priority": 6}),
        )
        .await;
    assert_eq!(status, 422, "{refused}");
    let urgent = submit_prio(&svc, "team-b", "hello", Some(1)).await;
    name.insert(urgent.clone(), "b!".into());
    approve(&svc, &card).await;
    let last = name.keys().find(|id| name[*id] == "b3").unwrap().clone();
    svc.wait_run(last.parse().unwrap()).await;
    let order: Vec<String> = started
        .lock()
        .unwrap()
        .iter()
        .filter_map(|run| name.get(run).cloned())
        .collect();
    assert_eq!(
        order,
        ["b!", "a1", "a2", "b1", "a3", "a4", "b2", "a5", "a6", "b3"],
        "{order:?}"
    );
}

/// `[limits.concurrency]`: while team a's run of `writes` runs, a's next
/// run waits (per_tenant = 1) and team b's run of `writes` waits (per_flow
/// writes = 1), while b's other run passes both; GET /v1/limits says so;
/// the end of a's run lets both go.
#[tokio::test]
async fn concurrency_keys_hold_their_runs_in_the_queue_and_others_pass() {
    let texts = two_flows(
        "[limits.concurrency]\nper_tenant = 1\nper_flow = { writes = 1 }\n\n\
         [tenants.team-a]\n[tenants.team-b]\n",
    );
    let svc = TestService::start(texts).await;
    let first = submit_prio(&svc, "team-a", "writes", None).await;
    let card = wait_card(&svc, &first).await;
    let a_next = submit_prio(&svc, "team-a", "hello", None).await;
    let b_writes = submit_prio(&svc, "team-b", "writes", None).await;
    let b_hello = submit_prio(&svc, "team-b", "hello", None).await;
    let doc = svc.wait_run(b_hello.parse().unwrap()).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    for waiting in [&a_next, &b_writes] {
        let (_, doc) = svc.get_json(&format!("/v1/runs/{waiting}")).await;
        assert_eq!(doc["run"]["status"], "pending", "{doc}");
    }
    let (_, limits) = svc.get_json("/v1/limits").await;
    assert_eq!(
        limits["concurrency"],
        json!([
            {"key": "tenant:team-a", "limit": 1, "running": 1, "queued": 1},
            {"key": "tenant:team-b", "limit": 1, "running": 0, "queued": 1},
            {"key": "flow:writes", "limit": 1, "running": 1, "queued": 1},
        ]),
        "{limits}"
    );
    metrics_say(
        &svc,
        &[
            "arbor_concurrency_running{key=\"flow:writes\"} 1",
            "arbor_concurrency_queued{key=\"tenant:team-b\"} 1",
            "arbor_concurrency_limit{key=\"tenant:team-a\"} 1",
        ],
    )
    .await;
    approve(&svc, &card).await;
    let doc = svc.wait_run(a_next.parse().unwrap()).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
    let card = wait_card(&svc, &b_writes).await;
    approve(&svc, &card).await;
    let doc = svc.wait_run(b_writes.parse().unwrap()).await;
    assert_eq!(doc["run"]["status"], "done", "{doc}");
}

// A crash at every commit point of quota admissions (I-65).

/// Names the case a child of the quota crash test runs: `ROOT|count` or
/// `ROOT|K:before|after:kill|power`.
const QUOTA_CRASH: &str = "ARBOR_QUOTA_CRASH";
const QUOTA_CRASH_TEST: &str =
    "inv_65_a_crash_at_every_commit_point_of_quota_admissions_exceeds_no_window";

fn quota_crash_texts() -> Texts {
    two_flows(
        "[tenants.team-q.quota]\ntokens_per_hour = 1000\nconcurrent_runs = 2\nruns_per_minute = 4\n\n\
         [tenants.team-w]\non_quota = \"queue\"\n\n[tenants.team-w.quota]\nconcurrent_runs = 1\n",
    )
}

/// The child's calls: reservations at submission (one refused), a top-up,
/// settlements, a run that queues for its quota. Each acknowledged run's
/// id goes to `acked` as soon as its 201 is read.
async fn quota_traffic(svc: &TestService, acked: &std::path::Path) {
    use std::io::Write;
    let mut acks = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(acked)
        .unwrap();
    let mut submit = async |tenant: &str, flow: &str, tokens: u64| {
        let (status, reply, _) = submit_for(svc, tenant, flow, tokens).await;
        let id = reply["id"].as_str().map(str::to_string);
        if status == 201
            && let Some(id) = &id
        {
            writeln!(acks, "{id}").unwrap();
        }
        id
    };
    let approve = async |run: &str| {
        let card = wait_card(svc, run).await;
        svc.post_json(
            &format!("/v1/approvals/{card}"),
            json!({"decision": "approve"}),
        )
        .await;
        svc.wait_run(run.parse().unwrap()).await;
    };
    let q1 = submit("team-q", "writes", 600).await.unwrap();
    let q2 = submit("team-q", "hello", 300).await.unwrap();
    svc.wait_run(q2.parse().unwrap()).await;
    submit("team-q", "hello", 600).await;
    svc.post_json(&format!("/v1/runs/{q1}/budget"), json!({"tokens": 100}))
        .await;
    approve(&q1).await;
    let w1 = submit("team-w", "writes", 100).await.unwrap();
    let w2 = submit("team-w", "hello", 100).await.unwrap();
    approve(&w1).await;
    svc.wait_run(w2.parse().unwrap()).await;
}

/// Finishes every run the recovered service has: approves each card as it
/// is asked, and follows each run to its end.
async fn finish_everything(svc: &TestService) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    svc.service
        .node()
        .events()
        .observe(std::sync::Arc::new(move |e| {
            if let arbor_protocol::EventKind::ApprovalRequested { card, .. } = &e.kind {
                let _ = tx.send(card.to_string());
            }
        }));
    let (_, pending) = svc.get_json("/v1/approvals").await;
    let mut cards: Vec<String> = pending["approvals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["id"].as_str().map(str::to_string))
        .collect();
    let approver = async {
        loop {
            for card in cards.drain(..) {
                svc.post_json(
                    &format!("/v1/approvals/{card}"),
                    json!({"decision": "approve"}),
                )
                .await;
            }
            match rx.recv().await {
                Some(card) => cards.push(card),
                None => return,
            }
        }
    };
    let follow = async {
        let (_, runs) = svc.get_json("/v1/runs?limit=100").await;
        for run in runs["runs"].as_array().into_iter().flatten() {
            let id: arbor_protocol::RunId = run["id"].as_str().unwrap().parse().unwrap();
            svc.wait_run(id).await;
        }
    };
    tokio::select! {
        _ = approver => {}
        _ = follow => {}
    }
}

/// What the journal holds after recovery keeps every promise of I-65:
/// every acknowledged submission is there; every run of a tenant with a
/// quota that started has its entry, settled once it ended, never below
/// what it spent; and no span of any window holds more than its quota, the
/// entries' lives and amounts as the ledger kept them.
async fn quota_promises_hold(svc: &TestService, acked: &[String]) -> Result<(), String> {
    use arbor_service::quota::QUOTAS;
    // A reader settles what ended first.
    svc.get_json("/v1/limits").await;
    let journal = svc.service.node().journal();
    let subs = svc.submissions();
    for id in acked {
        if !subs.iter().any(|s| s.run.to_string() == *id) {
            return Err(format!(
                "run {id} was acknowledged and its submission is gone"
            ));
        }
    }
    let entries = journal.read(&QUOTAS, &[]).map_err(|e| e.to_string())?;
    for sub in &subs {
        let spec: arbor_protocol::RunSpec = serde_json::from_str(&sub.spec_json).unwrap();
        let started = journal.run(sub.run).map_err(|e| e.to_string())?.is_some();
        let Some(entry) = entries.iter().find(|e| e.run == sub.run) else {
            if started {
                return Err(format!(
                    "run {} of {:?} started with no reservation",
                    sub.run, spec.tenant
                ));
            }
            continue;
        };
        let Some(ended) = entry.ended_ms else {
            return Err(format!("run {}'s entry was never settled", sub.run));
        };
        if ended < entry.at_ms {
            return Err(format!("run {}'s entry ended before it began", sub.run));
        }
        let (_, doc) = svc.get_json(&format!("/v1/runs/{}", sub.run)).await;
        let spent = doc["run"]["account"]["spent"].as_u64().unwrap_or(0);
        if entry.tokens < spent {
            return Err(format!(
                "run {} spent {spent} and its entry holds {}",
                sub.run, entry.tokens
            ));
        }
    }
    for (tenant, tokens, concurrent) in [("team-q", Some(1000), 2), ("team-w", None, 1)] {
        let mine: Vec<_> = entries.iter().filter(|e| e.tenant == tenant).collect();
        if let Some(limit) = tokens {
            let sum: u64 = mine.iter().map(|e| e.tokens).sum();
            if sum > limit {
                return Err(format!("{tenant}'s hour holds {sum} tokens, over {limit}"));
            }
        }
        for e in &mine {
            let overlapping = mine
                .iter()
                // As the ledger counts: a run ended at an instant is not
                // running at it.
                .filter(|o| o.at_ms <= e.at_ms && o.ended_ms.unwrap_or(u64::MAX) > e.at_ms)
                .count();
            if overlapping > concurrent {
                return Err(format!(
                    "{tenant} had {overlapping} runs at once, over {concurrent}"
                ));
            }
        }
        if tenant == "team-q" {
            let admitted = mine
                .iter()
                .filter(|e| e.at_ms + 60_000 > mine[0].at_ms)
                .count();
            if admitted > 4 {
                return Err(format!(
                    "{tenant} admitted {admitted} runs in a minute, over 4"
                ));
            }
        }
    }
    Ok(())
}

/// I-65 across crashes: the service is killed (and its power cut) just
/// before and just after every flush of the journal while runs are
/// reserved at submission, refused, topped up, settled and queued for
/// their quota; a service started again on its data recovers, every run
/// finishes, and `quota_promises_hold`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_65_a_crash_at_every_commit_point_of_quota_admissions_exceeds_no_window() {
    use arbor_storage::{Crash, CrashKind, CrashPoint};
    if let Ok(case) = std::env::var(QUOTA_CRASH) {
        let (root, case) = case.split_once('|').unwrap();
        let root = std::path::Path::new(root);
        let svc = TestService::start_at(root, quota_crash_texts()).await;
        let journal = svc.service.node().journal();
        let base = journal.flush_count();
        if case != "count" {
            let mut parts = case.split(':');
            let k: u64 = parts.next().unwrap().parse().unwrap();
            let point = match parts.next() {
                Some("before") => CrashPoint::BeforeFlush,
                _ => CrashPoint::AfterFlush,
            };
            let kind = match parts.next() {
                Some("power") => CrashKind::PowerLoss,
                _ => CrashKind::Kill,
            };
            journal.faults().crash_at(Crash {
                flush: base + k,
                point,
                kind,
            });
        }
        quota_traffic(&svc, &root.join("acked")).await;
        let end = svc.service.node().journal().flush_count();
        std::fs::write(root.join("count"), format!("{}", end - base)).unwrap();
        std::process::exit(0);
    }
    let exe = std::env::current_exe().unwrap();
    let temp = tempfile::tempdir().unwrap();
    let child = |root: std::path::PathBuf, case: String| {
        let exe = exe.clone();
        async move {
            std::fs::create_dir_all(&root).unwrap();
            tokio::process::Command::new(exe)
                .args([QUOTA_CRASH_TEST, "--exact", "--test-threads=1"])
                .env(QUOTA_CRASH, format!("{}|{case}", root.display()))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .await
                .unwrap()
        }
    };
    let counted = temp.path().join("count");
    assert!(
        child(counted.clone(), "count".into()).await.success(),
        "the counting run failed"
    );
    let flushes: u64 = std::fs::read_to_string(counted.join("count"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(flushes > 5, "the traffic made {flushes} flushes");
    let mut cases = vec![];
    for k in 1..=flushes {
        for point in ["before", "after"] {
            for kind in ["kill", "power"] {
                cases.push(format!("{k}:{point}:{kind}"));
            }
        }
    }
    let (mut crashed, mut violations) = (0, vec![]);
    for batch in cases.chunks(4) {
        let outcomes = futures::future::join_all(batch.iter().map(|case| {
            let root = temp.path().join(case.replace(':', "-"));
            let child = &child;
            async move {
                let status = child(root.clone(), case.clone()).await;
                use std::os::unix::process::ExitStatusExt;
                let died = status.signal().is_some();
                let acked: Vec<String> = std::fs::read_to_string(root.join("acked"))
                    .unwrap_or_default()
                    .lines()
                    .map(str::to_string)
                    .collect();
                let svc = TestService::start_at(&root, quota_crash_texts()).await;
                finish_everything(&svc).await;
                let held = quota_promises_hold(&svc, &acked).await;
                svc.shut().await;
                if held.is_ok() {
                    let _ = std::fs::remove_dir_all(&root);
                }
                (case.clone(), died, held)
            }
        }))
        .await;
        for (case, died, held) in outcomes {
            crashed += u32::from(died);
            if let Err(why) = held {
                violations.push(format!("case {case}: {why}"));
            }
        }
    }
    println!(
        "{} cases over {flushes} flushes, {crashed} crashed",
        cases.len()
    );
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(
        crashed as u64 >= flushes,
        "only {crashed} of {} cases crashed",
        cases.len()
    );
}
