//! MCP servers as tools: a real server process (`mcp-test-server`, rmcp's
//! server over stdio) started sealed in each job's sandbox, by a real node,
//! with agents on the scripted model.

use arbor_protocol::{EventKind, McpServerState, Status};
use arbor_testkit::{
    RecordingModels, TestNode, agent_md, process_exits_within, processes_in, secrets_file,
    wait_processes_in,
};
use std::time::Duration;

/// The `[mcp.servers.t]` block that runs the test server, with `extra` keys.
fn server(extra: &str) -> String {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_mcp-test-server"));
    let folder = bin.parent().unwrap();
    format!(
        "[mcp.servers.t]\ncommand = {:?}\nread_only = [{:?}]\n{extra}\n",
        bin.display().to_string(),
        folder.display().to_string()
    )
}

/// A script line that calls `tool` with `args` (YAML flow mapping).
fn call(tool: &str, args: &str) -> String {
    format!("  - call: {{tool: {tool}, args: {args}}}\n")
}

const SUBMIT: &str = "  - call: {tool: submit_output, args: {output: done}}\n";

/// The `ToolCalled` events of `tool` in `run`, in order: (ok, detail).
fn called(node: &TestNode, run: arbor_protocol::RunId, tool: &str) -> Vec<(bool, String)> {
    node.tool_calls(run)
        .into_iter()
        .filter(|c| c.tool == tool)
        .map(|c| (c.ok, c.detail))
        .collect()
}

/// Waits until the test server has begun a call of `tool` in `workdir` (its
/// `mcp-calls.log`). Polls, bounded: nothing signals a file's line.
async fn server_began(workdir: &std::path::Path, tool: &str) {
    let deadline = tokio::time::Instant::now() + arbor_testkit::WAIT_LIMIT;
    let log = workdir.join("mcp-calls.log");
    while !std::fs::read_to_string(&log).is_ok_and(|t| t.lines().any(|l| l == tool)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server never began {tool}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn started(node: &TestNode, run: arbor_protocol::RunId, tool: &str) -> usize {
    node.events(run)
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::ToolStarted { tool: t, .. } if t == tool))
        .count()
}

#[tokio::test]
async fn an_agent_calls_an_mcp_tool_and_reads_its_answer() {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{}{SUBMIT}",
        call("mcp__t__echo", "{text: hello from arbor}"),
        call("mcp__t__echo", "{}"),
    ));
    let models = RecordingModels::new();
    let node = TestNode::start_full(Some(&server("")), &[("user", &agent)], models.clone()).await;
    let run = node.run_agent("user", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let calls = called(&node, run, "mcp__t__echo");
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls[0].0 && calls[0].1.contains("hello from arbor"),
        "{calls:?}"
    );
    // Arguments the schema refuses are a tool error, and nothing is sent.
    assert!(!calls[1].0, "{calls:?}");
    assert!(
        calls[1].1.contains("bad arguments") && calls[1].1.contains("text"),
        "{calls:?}"
    );
    assert_eq!(
        started(&node, run, "mcp__t__echo"),
        1,
        "only the good call went out"
    );

    // The model was offered the server's tools under their MCP names.
    let offered: Vec<String> = models.requests("user")[0]
        .tools
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert!(offered.contains(&"mcp__t__echo".to_string()), "{offered:?}");
    assert!(
        offered.contains(&"submit_output".to_string()),
        "{offered:?}"
    );
    // The tree shows the calls per tool and the server.
    let step = tree.node(tree.find("user").unwrap()).unwrap();
    assert_eq!(step.tools.get("mcp__t__echo"), Some(&2), "{:?}", step.tools);
    assert_eq!(
        step.mcp["t"].state,
        McpServerState::Stopped,
        "it ended with its job"
    );
    assert_eq!(step.mcp["t"].restarts, 0);
}

/// An MCP call carries its span in the run's trace to the server, in the
/// request's `_meta.traceparent` (docs/operations.md, "Traces").
#[tokio::test]
async fn an_mcp_call_tells_the_server_its_trace_context() {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{SUBMIT}",
        call("mcp__t__traceparent", "{}"),
    ));
    let node = TestNode::start_with_config(&server(""), &[("user", &agent)]).await;
    let run = node.run_agent("user", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    let step = tree.find("user").unwrap();
    let (call, detail) = node
        .events(run)
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::ToolCalled {
                tool, call, detail, ..
            } if tool == "mcp__t__traceparent" => Some((call, detail)),
            _ => None,
        })
        .expect("the call was made");
    let want = step.call_traceparent(run, &call);
    assert!(
        want.starts_with(&format!("00-{}-", run.trace_hex())),
        "{want}"
    );
    assert!(
        detail.contains(&want),
        "the server saw {detail}, not {want}"
    );
}

#[tokio::test]
async fn inv_44_a_denied_mcp_tool_is_refused_at_every_depth_below_the_deny() {
    let tries = |who: &str| {
        format!(
            "{}{}",
            call("mcp__t__echo", &format!("{{text: {who}}}")),
            call("mcp__t__pid", "{}")
        )
    };
    let boss = agent_md(&format!(
        "mcp: [t]\ndeny: [mcp__t__echo]\nsubagents: [mid]\nscript:\n{}  - call: {{tool: delegate, args: {{jobs: [{{agent: mid, request: go, label: mid}}]}}}}\n{SUBMIT}",
        tries("boss")
    ));
    let mid = agent_md(&format!(
        "description: mid\ntools: [mcp__t__echo, mcp__t__pid]\nsubagents: [leaf]\nscript:\n{}  - call: {{tool: delegate, args: {{jobs: [{{agent: leaf, request: go, label: leaf}}]}}}}\n{SUBMIT}",
        tries("mid")
    ));
    // It names the whole server: still cut to what is above it.
    let leaf = agent_md(&format!(
        "description: leaf\nmcp: [t]\nsandbox: own\nscript:\n{}{SUBMIT}",
        tries("leaf")
    ));
    let node = TestNode::start_with_config(
        &server(""),
        &[("boss", &boss), ("mid", &mid), ("leaf", &leaf)],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    for name in ["boss", "mid", "leaf"] {
        let id = tree.find(name).unwrap();
        let mine: Vec<_> = node
            .tool_calls(run)
            .into_iter()
            .filter(|c| c.job == id)
            .collect();
        // echo is refused at every depth, own sandbox or not, and never sent...
        let echo = mine.iter().find(|c| c.tool == "mcp__t__echo").unwrap();
        assert!(!echo.ok, "{name}: {echo:?}");
        assert!(echo.detail.contains("not offered"), "{name}: {echo:?}");
        // ...while the tool beside it, not denied, runs.
        let pid = mine.iter().find(|c| c.tool == "mcp__t__pid").unwrap();
        assert!(pid.ok, "{name}: {pid:?}");
    }
    assert_eq!(
        started(&node, run, "mcp__t__echo"),
        0,
        "a denied call went out"
    );
    assert_eq!(started(&node, run, "mcp__t__pid"), 3);
}

#[tokio::test]
async fn inv_16_a_stop_in_the_middle_of_an_mcp_call_keeps_nothing_of_it_and_the_server_hears_the_cancel()
 {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{SUBMIT}",
        call("mcp__t__sleep", "{ms: 600000}")
    ));
    let node = TestNode::start_with_config(&server(""), &[("sleeper", &agent)]).await;
    let run = node.run_agent("sleeper", "go").await;
    node.wait_event(run, |k| matches!(k, EventKind::ToolStarted { .. }))
        .await;
    let step = node.wait_for(run, "sleeper").await;
    let workdir = node.workdir(run, step);
    // The call is in flight once the server has begun it.
    server_began(&workdir, "sleep").await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;

    let end = tree.node(step).unwrap();
    assert_eq!(end.status, Status::Stopped);
    assert_eq!(
        end.output,
        serde_json::Value::Null,
        "no output after a stop"
    );
    assert!(
        called(&node, run, "mcp__t__sleep")
            .iter()
            .all(|(ok, _)| !ok),
        "a result came back after the stop"
    );
    // The cancel reached the server before it was killed, and nothing of it is left.
    let log = std::fs::read_to_string(workdir.join("mcp-cancelled.log")).unwrap_or_default();
    assert!(
        log.contains("cancelled"),
        "the server was not told: {log:?}"
    );
    let left = processes_in(&workdir);
    for pid in &left {
        assert!(
            process_exits_within(*pid, Duration::from_secs(2)).await,
            "process {pid} of the server outlived the stop"
        );
    }
}

#[tokio::test]
async fn inv_43_no_mcp_server_process_outlives_its_job_a_grandchild_included() {
    // It starts a detached grandchild, then thinks for a while before it answers.
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}  - say: thinking\n    delay: 3s\n{SUBMIT}",
        call("mcp__t__spawn", "{}")
    ));
    let node = TestNode::start_with_config(&server(""), &[("spawner", &agent)]).await;
    let run = node.run_agent("spawner", "go").await;
    node.wait_event(run, |k| matches!(k, EventKind::ToolCalled { ok: true, .. }))
        .await;
    let step = node.wait_for(run, "spawner").await;
    let workdir = node.workdir(run, step);
    // The server and its grandchild, both in the job's workdir.
    let running = wait_processes_in(&workdir, 2).await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    for pid in running {
        assert!(
            process_exits_within(pid, Duration::from_secs(2)).await,
            "process {pid} outlived its job"
        );
    }
    assert!(processes_in(&workdir).is_empty());
}

#[tokio::test]
async fn inv_45_a_call_past_its_limit_is_refused_never_runs_and_the_count_survives_a_restart() {
    // Two echoes allowed; the step asks three times, then thinks long
    // enough for the node to be killed under it.
    let agent = agent_md(&format!(
        "mcp: [t]\nlimits: {{mcp__t__echo: 2}}\nscript:\n{}{}{}  - say: thinking\n    delay: 1h\n{SUBMIT}",
        call("mcp__t__echo", "{text: one}"),
        call("mcp__t__echo", "{text: two}"),
        call("mcp__t__echo", "{text: three}"),
    ));
    let flow = "[[group]]\nsteps = [{ agent = \"counter\", instruction = \"go\" }]\n";
    let node = TestNode::start_workspace(
        Some(&server("")),
        &[("counter", &agent)],
        &[("count", flow)],
        std::sync::Arc::new(arbor_testkit::DefaultModels),
    )
    .await;
    let run = node.run_flow("count").await;
    node.wait_until(run, |_| called(&node, run, "mcp__t__echo").len() == 3)
        .await;
    let calls = called(&node, run, "mcp__t__echo");
    assert!(calls[0].0 && calls[1].0, "{calls:?}");
    assert!(
        !calls[2].0 && calls[2].1.contains("limit reached"),
        "{calls:?}"
    );
    assert_eq!(started(&node, run, "mcp__t__echo"), 2, "the third call ran");

    // A crash, and the step runs again as its next attempt: its first call
    // is already past the limit its interrupted attempt used up.
    let node = node.crash_and_restart().await;
    let tree = node
        .wait_until(run, |_| called(&node, run, "mcp__t__echo").len() >= 6)
        .await;
    let again: Vec<_> = called(&node, run, "mcp__t__echo").split_off(3);
    assert!(
        again
            .iter()
            .all(|(ok, d)| !ok && d.contains("limit reached")),
        "{again:?}"
    );
    assert_eq!(
        started(&node, run, "mcp__t__echo"),
        2,
        "a call past the limit ran"
    );
    let attempts: Vec<u32> = tree.root().children.iter().map(|c| c.attempt).collect();
    assert!(attempts.contains(&2), "{attempts:?}");
}

#[tokio::test]
async fn inv_27_a_secret_never_reaches_the_model_through_an_mcp_result() {
    let secrets = tempfile::tempdir().unwrap();
    let value = "mcp-tok-5150-c0ffee";
    let config = secrets_file(
        secrets.path(),
        &format!("SERVER_TOKEN={value}\nAGENT_KEY=agent-key-7777\n"),
        0o600,
    );
    let config = format!("{config}{}", server("secrets = [\"SERVER_TOKEN\"]"));
    let agent = agent_md(&format!(
        "mcp: [t]\ntools: [exec]\nsecrets: [AGENT_KEY]\nscript:\n{}{}{}{SUBMIT}",
        call("mcp__t__env", "{name: SERVER_TOKEN}"),
        call("mcp__t__env", "{name: AGENT_KEY}"),
        call("exec", "{command: \"echo [$SERVER_TOKEN]\"}"),
    ));
    let models = RecordingModels::new();
    let node = TestNode::start_full(Some(&config), &[("reader", &agent)], models.clone()).await;
    let run = node.run_agent("reader", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let env = called(&node, run, "mcp__t__env");
    // The server holds its secret (the model sees its name, not its value)...
    assert!(
        env[0].0 && env[0].1.contains("[secret SERVER_TOKEN]"),
        "{env:?}"
    );
    // ...and not the job's: a server gets only what it declares.
    assert!(env[1].0 && !env[1].1.contains("agent-key-7777"), "{env:?}");
    assert!(!env[1].1.contains("[secret AGENT_KEY]"), "{env:?}");
    // Nor does the job's own sandbox get the server's.
    let exec = called(&node, run, "exec");
    assert!(exec[0].1.contains("[]"), "{exec:?}");

    let context = format!("{:?}", models.requests("reader"));
    assert!(
        context.contains("[secret SERVER_TOKEN]"),
        "the model saw the redacted result"
    );
    assert!(!context.contains(value), "the model saw the value");
    let events = serde_json::to_string(&node.events(run)).unwrap();
    assert!(!events.contains(value), "an event holds the value");
}

#[tokio::test]
async fn a_call_past_its_timeout_is_cancelled_and_a_server_that_then_answers_nothing_is_killed_and_started_again()
 {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{}{}{}{}{SUBMIT}",
        call("mcp__t__pid", "{}"),
        call("mcp__t__sleep", "{ms: 60000}"),
        call("mcp__t__pid", "{}"),
        call("mcp__t__hang", "{}"),
        call("mcp__t__pid", "{}"),
    ));
    let node =
        TestNode::start_with_config(&server("call_timeout = \"1s\""), &[("patient", &agent)]).await;
    let run = node.run_agent("patient", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let sleep = called(&node, run, "mcp__t__sleep");
    assert!(!sleep[0].0 && sleep[0].1.contains("timed_out"), "{sleep:?}");
    let hang = called(&node, run, "mcp__t__hang");
    assert!(!hang[0].0 && hang[0].1.contains("timed_out"), "{hang:?}");
    let pids: Vec<String> = called(&node, run, "mcp__t__pid")
        .into_iter()
        .map(|(ok, d)| {
            assert!(ok, "{d}");
            d
        })
        .collect();
    // After the timed-out sleep the server still answered: the same one.
    assert_eq!(pids[0], pids[1], "a server that answered was killed");
    // After the hang it answered nothing: killed, and a new one started.
    let step = tree.node(tree.find("patient").unwrap()).unwrap();
    assert_eq!(step.mcp["t"].restarts, 1, "{:?}", step.mcp);
    let killed = node.events(run).into_iter().any(|e| {
        matches!(
            e.kind,
            EventKind::McpServer {
                state: McpServerState::Killed,
                ..
            }
        )
    });
    assert!(killed, "no event says the server was killed");
    let step_id = tree.find("patient").unwrap();
    let log = std::fs::read_to_string(node.workdir(run, step_id).join("mcp-cancelled.log"))
        .unwrap_or_default();
    assert!(
        log.contains("cancelled"),
        "the timed-out call was not cancelled: {log:?}"
    );
}

#[tokio::test]
async fn a_server_that_dies_mid_call_is_a_tool_error_and_starts_again_at_the_next_call() {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{}{}{}{SUBMIT}",
        call("mcp__t__exit", "{}"),
        call("mcp__t__echo", "{text: back}"),
        call("mcp__t__big", "{bytes: 300000}"),
        call("mcp__t__fail", "{}"),
    ));
    let node = TestNode::start_with_config(&server(""), &[("brave", &agent)]).await;
    let run = node.run_agent("brave", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let exit = called(&node, run, "mcp__t__exit");
    assert!(
        !exit[0].0 && exit[0].1.contains("ended during the call"),
        "{exit:?}"
    );
    assert!(
        called(&node, run, "mcp__t__echo")[0].0,
        "the server did not start again"
    );
    let step = tree.node(tree.find("brave").unwrap()).unwrap();
    assert_eq!(step.mcp["t"].restarts, 1, "{:?}", step.mcp);
    // A huge result is clipped, and says so.
    let big = node
        .events(run)
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::ToolCalled { tool, detail, .. } if tool == "mcp__t__big" => Some(detail),
            _ => None,
        })
        .unwrap();
    assert!(big.len() < 1000, "the event's detail is short");
    let fail = called(&node, run, "mcp__t__fail");
    assert!(
        !fail[0].0 && fail[0].1.contains("it failed, as asked"),
        "{fail:?}"
    );
}

#[tokio::test]
async fn arbor_check_starts_each_named_server_and_reports_missing_commands_and_unknown_tools() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "{}[mcp.servers.gone]\ncommand = \"no-such-mcp-server\"\n",
        server("")
    );
    std::fs::write(dir.path().join("arbor.toml"), toml).unwrap();
    let agents = dir.path().join("agents").join("user");
    std::fs::create_dir_all(&agents).unwrap();
    std::fs::write(
        agents.join("agent.md"),
        agent_md("tools: [mcp__t__echo, mcp__t__nope]\nmcp: [gone]"),
    )
    .unwrap();

    let findings = arbor_runtime::check::check_servers(dir.path()).await;
    let said: Vec<String> = findings
        .iter()
        .map(|f| format!("{}: {}", f.file, f.message))
        .collect();
    assert_eq!(findings.len(), 2, "{said:#?}");
    assert!(
        said.iter().any(|s| s.starts_with(
            "agents/user/agent.md: tools: mcp__t__nope: the server t lists no such tool"
        ) && s.contains("mcp__t__echo")),
        "{said:#?}"
    );
    assert!(
        said.iter()
            .any(|s| s.contains("mcp.servers.gone: command `no-such-mcp-server` is not found")),
        "{said:#?}"
    );
}

#[tokio::test]
async fn a_server_that_writes_what_is_not_json_to_stdout_does_not_take_the_job_down() {
    let agent = agent_md(&format!(
        "mcp: [t]\nscript:\n{}{}{SUBMIT}",
        call("mcp__t__noise", "{}"),
        call("mcp__t__echo", "{text: still here}"),
    ));
    let node = TestNode::start_with_config(&server(""), &[("noisy", &agent)]).await;
    let run = node.run_agent("noisy", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    let echo = called(&node, run, "mcp__t__echo");
    assert!(echo[0].0 && echo[0].1.contains("still here"), "{echo:?}");
    // The stray line is skipped; the call it came with still answers.
    let noise = called(&node, run, "mcp__t__noise");
    assert!(noise[0].0 && noise[0].1.contains("made noise"), "{noise:?}");
}

#[tokio::test]
async fn inv_45_a_continued_job_starts_from_the_calls_its_interrupted_attempt_made() {
    let boss = agent_md(
        "mcp: [t]\nsubagents: [counter]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: counter, request: count, label: c}]}}\n  - call: {tool: submit_output, args: {output: done}}\n",
    );
    let counter = agent_md(&format!(
        "description: counts\nmcp: [t]\nlimits: {{calls: 2}}\nscript:\n{}{}  - say: thinking\n    delay: 1h\n{}{SUBMIT}",
        call("mcp__t__pid", "{}"),
        call("mcp__t__pid", "{}"),
        call("mcp__t__pid", "{}"),
    ));
    let flow = "[[group]]\nsteps = [{ agent = \"boss\", instruction = \"go\", retries = 0 }]\n";
    let node = TestNode::start_workspace(
        Some(&server("")),
        &[("boss", &boss), ("counter", &counter)],
        &[("work", flow)],
        std::sync::Arc::new(arbor_testkit::DefaultModels),
    )
    .await;
    let run = node.run_flow("work").await;
    node.wait_until(run, |_| called(&node, run, "mcp__t__pid").len() == 2)
        .await;
    let job = node.wait_for(run, "c").await;
    let node = node.crash_and_restart().await;
    node.wait_run(run).await;

    // The same script again: its two calls, then it thinks.
    let continued = node.node().continue_job(job).await.unwrap();
    let tree = node
        .wait_until(continued, |_| {
            called(&node, continued, "mcp__t__pid").len() == 2
        })
        .await;
    // Its two calls were made before the restart: the next attempt may make none.
    let again = called(&node, continued, "mcp__t__pid");
    assert!(
        again
            .iter()
            .all(|(ok, d)| !ok && d.contains("limit reached")),
        "{again:?}"
    );
    assert_eq!(started(&node, continued, "mcp__t__pid"), 0);
    let step = tree.node(tree.find("c").unwrap()).unwrap();
    assert_eq!(step.attempt, 2);
    node.stop_run(continued).await;
}

/// The test server serving streamable HTTP on a loopback port, in a folder
/// of its own (where it logs its calls and cancels); killed when dropped.
struct HttpPeer {
    url: String,
    dir: tempfile::TempDir,
    _child: tokio::process::Child,
}

impl HttpPeer {
    async fn start() -> Self {
        use tokio::io::AsyncBufReadExt;
        let dir = tempfile::tempdir().unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-test-server"))
            .arg("--http")
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut url = String::new();
        tokio::io::BufReader::new(stdout)
            .read_line(&mut url)
            .await
            .unwrap();
        Self {
            url: url.trim().to_string(),
            dir,
            _child: child,
        }
    }

    /// The `[mcp.servers.w]` block that names it, with `extra` keys.
    fn config(&self, extra: &str) -> String {
        format!("[mcp.servers.w]\nurl = {:?}\n{extra}\n", self.url)
    }
}

#[tokio::test]
async fn inv_27_an_http_servers_secret_header_reaches_it_and_never_the_model() {
    let peer = HttpPeer::start().await;
    let secrets = tempfile::tempdir().unwrap();
    let value = "http-tok-8088-feed";
    let config = secrets_file(secrets.path(), &format!("WEB_TOKEN={value}\n"), 0o600);
    let config = format!(
        "{config}{}",
        peer.config(
            "secrets = [\"WEB_TOKEN\"]\nheaders = { Authorization = \"Bearer ${WEB_TOKEN}\", X-Team = \"core\" }"
        )
    );
    let agent = agent_md(&format!(
        "mcp: [w]\nscript:\n{}{}{}{SUBMIT}",
        call("mcp__w__echo", "{text: over http}"),
        call("mcp__w__header", "{name: authorization}"),
        call("mcp__w__header", "{name: x-team}"),
    ));
    let models = RecordingModels::new();
    let node = TestNode::start_full(Some(&config), &[("web", &agent)], models.clone()).await;
    let run = node.run_agent("web", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());

    let echo = called(&node, run, "mcp__w__echo");
    assert!(echo[0].0 && echo[0].1.contains("over http"), "{echo:?}");
    let header = called(&node, run, "mcp__w__header");
    // The server got the header with the secret's value in it; the model
    // reads its name.
    assert!(
        header[0].0 && header[0].1.contains("Bearer [secret WEB_TOKEN]"),
        "{header:?}"
    );
    assert!(header[1].0 && header[1].1.contains("core"), "{header:?}");
    let context = format!("{:?}", models.requests("web"));
    assert!(!context.contains(value), "the model saw the value");
    let events = serde_json::to_string(&node.events(run)).unwrap();
    assert!(!events.contains(value), "an event holds the value");

    let step = tree.node(tree.find("web").unwrap()).unwrap();
    assert_eq!(step.mcp["w"].state, McpServerState::Stopped);
    assert_eq!(step.tools.get("mcp__w__header"), Some(&2));
}

#[tokio::test]
async fn inv_16_a_stop_mid_call_on_an_http_server_sends_the_cancel_and_keeps_nothing() {
    let peer = HttpPeer::start().await;
    let agent = agent_md(&format!(
        "mcp: [w]\nscript:\n{}{SUBMIT}",
        call("mcp__w__sleep", "{ms: 600000}")
    ));
    let node = TestNode::start_with_config(&peer.config(""), &[("sleeper", &agent)]).await;
    let run = node.run_agent("sleeper", "go").await;
    server_began(peer.dir.path(), "sleep").await;
    node.stop_run(run).await;
    let tree = node.wait_run(run).await;

    let step = tree.node(tree.find("sleeper").unwrap()).unwrap();
    assert_eq!(step.status, Status::Stopped);
    assert_eq!(step.output, serde_json::Value::Null);
    assert!(
        called(&node, run, "mcp__w__sleep")
            .iter()
            .all(|(ok, _)| !ok),
        "a result came back after the stop"
    );
    let log =
        std::fs::read_to_string(peer.dir.path().join("mcp-cancelled.log")).unwrap_or_default();
    assert!(
        log.contains("cancelled"),
        "the server was not told: {log:?}"
    );
}

#[tokio::test]
async fn an_http_server_nobody_answers_at_fails_its_job_saying_where_and_the_node_goes_on() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config =
        format!("[mcp.servers.w]\nurl = \"http://127.0.0.1:{port}/mcp\"\nstart_timeout = \"5s\"\n");
    let lost = agent_md(&format!(
        "mcp: [w]\nscript:\n{}{SUBMIT}",
        call("mcp__w__echo", "{text: anyone}")
    ));
    let fine = agent_md(&format!("script:\n{SUBMIT}"));
    let node = TestNode::start_with_config(&config, &[("lost", &lost), ("fine", &fine)]).await;
    let run = node.run_agent("lost", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed, "{:?}", tree.root());
    let why = format!("{:?}", tree.root());
    assert!(
        why.contains("the MCP server w could not list its tools")
            && why.contains(&format!("127.0.0.1:{port}/mcp")),
        "{why}"
    );
    let run = node.run_agent("fine", "go").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
}

#[tokio::test]
async fn inv_27_a_run_whose_mcp_server_needs_a_secret_without_a_value_never_starts() {
    let config = server("secrets = [\"NOBODY_SET_THIS\"]");
    let agent = agent_md(&format!("mcp: [t]\nscript:\n{SUBMIT}"));
    let node = TestNode::start_with_config(&config, &[("needy", &agent)]).await;
    let spec = node.workspace.agent_run("needy", "go", None).unwrap();
    let refused = node.node().start_run(spec).await.unwrap_err().to_string();
    assert!(
        refused.contains("mcp.servers.t: the secret NOBODY_SET_THIS has no value")
            && refused.contains("agents/needy"),
        "{refused}"
    );
    assert!(
        node.node().journal().runs().unwrap().is_empty(),
        "a run was recorded"
    );
}

#[tokio::test]
async fn inv_27_an_http_server_that_redirects_never_gets_its_headers_carried_elsewhere() {
    use axum::http::{HeaderMap, StatusCode, header::LOCATION};
    // Where a redirect points: it keeps every X-Api-Key it is sent.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let keep = seen.clone();
    let elsewhere = axum::Router::new().fallback(move |headers: HeaderMap| {
        let keep = keep.clone();
        async move {
            if let Some(key) = headers.get("x-api-key") {
                keep.lock()
                    .unwrap()
                    .push(key.to_str().unwrap_or("").to_string());
            }
            StatusCode::NOT_FOUND
        }
    });
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target_url = format!("http://{}/mcp", target.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(target, elsewhere).await });
    // The declared server answers every request with a redirect there.
    let redirector = axum::Router::new().fallback(move || {
        let to = target_url.clone();
        async move { (StatusCode::TEMPORARY_REDIRECT, [(LOCATION, to)]) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, redirector).await });

    let secrets = tempfile::tempdir().unwrap();
    let config = secrets_file(secrets.path(), "API_KEY=redirect-me-not-42\n", 0o600);
    let config = format!(
        "{config}[mcp.servers.w]\nurl = {url:?}\nheaders = {{ X-Api-Key = \"${{API_KEY}}\" }}\nsecrets = [\"API_KEY\"]\n"
    );
    let agent = agent_md(&format!("mcp: [w]\nscript:\n{SUBMIT}"));
    let node = TestNode::start_with_config(&config, &[("web", &agent)]).await;
    let run = node.run_agent("web", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Failed, "{:?}", tree.root());
    assert!(
        format!("{:?}", tree.root()).contains("could not list its tools"),
        "{:?}",
        tree.root()
    );
    assert!(
        seen.lock().unwrap().is_empty(),
        "the header went where the redirect pointed: {:?}",
        seen.lock().unwrap()
    );
}

/// I-24: a file an MCP server wrote in the job's workdir during a call is
/// one the runtime saw written: the job's artifact, which a required
/// artifact is then met by.
#[tokio::test]
async fn inv_24_a_file_an_mcp_server_writes_in_the_workdir_is_an_artifact() {
    let boss = agent_md(
        "subagents: [scribe]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: scribe, request: write it, label: s, require_artifacts: [report.md]}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let scribe = agent_md(&format!(
        "description: writes through its server\nsandbox: own\nmcp: [t]\nscript:\n{}{SUBMIT}",
        call("mcp__t__write", "{path: report.md, text: \"# Report\"}")
    ));
    let node =
        TestNode::start_with_config(&server(""), &[("boss", &boss), ("scribe", &scribe)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let (_, s) = tree
        .nodes()
        .find(|(_, n)| n.label.as_deref() == Some("s"))
        .unwrap();
    assert!(called(&node, run, "mcp__t__write")[0].0, "{s:?}");
    assert!(s.artifacts.iter().any(|a| a == "report.md"), "{s:?}");
    assert_eq!(
        (s.status, s.task_status),
        (Status::Done, Some(arbor_protocol::TaskStatus::Completed)),
        "{s:?}"
    );
}
