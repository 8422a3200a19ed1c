//! arbord as a process, driven by the `arbor` status CLI over loopback:
//! SIGTERM then restart (I-40), SIGKILL mid-run then restart (I-30 to I-34),
//! the CLI's exit codes, and the same run document as `arbor run --json`.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long any wait here may take before the test fails.
const LIMIT: Duration = Duration::from_secs(30);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const QUICK: &str = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: hi, task_status: completed}}\n---\nYou answer.\n";
const SLOW: &str = "---\ndescription: blocks\ntools: [exec]\nscript:\n  - call: {tool: exec, args: {command: \"exec sleep 300\"}}\n  - call: {tool: submit_output, args: {output: late}}\n---\nYou wait.\n";

/// A workspace on disk: the quick and slow agents, a flow, `[service]` settings.
fn workspace(service: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let empty = "---\ndescription: runs out of script at once\nscript: []\n---\nYou fail.\n";
    for (name, text) in [("quick", QUICK), ("slow", SLOW), ("empty", empty)] {
        std::fs::create_dir_all(dir.path().join("agents").join(name)).unwrap();
        std::fs::write(dir.path().join("agents").join(name).join("agent.md"), text).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("flows")).unwrap();
    std::fs::write(
        dir.path().join("flows/hello.toml"),
        "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("arbor.toml"),
        format!("[service]\n{service}"),
    )
    .unwrap();
    dir
}

/// A running arbord, and where it listens.
struct Arbord {
    child: Child,
    url: String,
    data_dir: PathBuf,
    stderr: mpsc::Receiver<String>,
    /// What it said on stderr up to where it listens.
    early: Vec<String>,
}

impl Arbord {
    fn start(workspace: &Path, data_dir: &Path) -> Arbord {
        Self::start_with(workspace, data_dir, &["--listen", "127.0.0.1:0"])
    }

    fn start_with(workspace: &Path, data_dir: &Path, extra: &[&str]) -> Arbord {
        let mut child = Command::new(env!("CARGO_BIN_EXE_arbord"))
            .arg("--workspace")
            .arg(workspace)
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .env_remove("ARBOR_LOG")
            // The test harness's own, which arbord would refuse as unknown.
            .env_remove("ARBOR_TEST_DATABASE_URL")
            .env_remove("ARBOR_TEST_JOURNAL")
            // A group of its own: a test stops it with SIGSTOP, and a stopped
            // process in the harness's group gets that group a SIGHUP once
            // the group is orphaned (a CI shell that has gone on).
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("arbord starts");
        let (tx, stderr) = mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut early = vec![];
        let url = loop {
            let line = stderr.recv_timeout(LIMIT).unwrap_or_else(|e| {
                panic!(
                    "arbord says where it listens ({e}); it said:\n{}",
                    early.join("\n")
                )
            });
            if let Some(rest) = line.strip_prefix("arbord: listening on ") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
            early.push(line);
        };
        Arbord {
            child,
            url,
            data_dir: data_dir.to_path_buf(),
            stderr,
            early,
        }
    }

    /// `GET path` with the token, over plain HTTP/1.0 (no chunks); the body.
    fn get_text(&self, path: &str) -> String {
        use std::io::{Read, Write};
        let address = self.url.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.0\r\nHost: {address}\r\nAuthorization: Bearer {}\r\n\r\n",
            self.token().trim()
        )
        .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        let status = reply.lines().next().unwrap_or_default();
        assert!(status.contains(" 200 "), "{reply}");
        reply.split_once("\r\n\r\n").unwrap().1.to_string()
    }

    fn token(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("token")).unwrap()
    }

    /// `arbor ARGS` against this arbord.
    fn arbor(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(args)
            .env("ARBOR_URL", &self.url)
            .env("ARBOR_TOKEN", self.token())
            .env("NO_COLOR", "1")
            .output()
            .expect("arbor runs")
    }

    /// `arbor ARGS` run from `dir` with no token given: it reads ./.arbor/token.
    fn arbor_in(&self, dir: &Path, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(args)
            .current_dir(dir)
            .env("ARBOR_URL", &self.url)
            .env_remove("ARBOR_TOKEN")
            .env_remove("ARBOR_TOKEN_FILE")
            .env("NO_COLOR", "1")
            .output()
            .expect("arbor runs")
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.arbor(&all);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "arbor {args:?}: not JSON ({e}): {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    fn submit(&self, args: &[&str]) -> String {
        let mut all = vec!["submit"];
        all.extend_from_slice(args);
        let out = self.arbor(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// Follows the run's events (the CLI's own `events --follow`) until
    /// a step or job is running; returns its id.
    fn wait_running(&self, run: &str) -> String {
        self.wait_running_except(run, &[])
    }

    /// As `wait_running`, for a step or job that is none of `seen`.
    fn wait_running_except(&self, run: &str, seen: &[&str]) -> String {
        let mut follower = Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(["events", run, "--follow", "-o", "jsonl"])
            .env("ARBOR_URL", &self.url)
            .env("ARBOR_TOKEN", self.token())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let pipe = follower.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let id = loop {
            let line = rx.recv_timeout(LIMIT).expect("a step starts running");
            let event: serde_json::Value = serde_json::from_str(&line).unwrap();
            if event["kind"]["type"] == "job_running"
                && !seen.contains(&event["kind"]["id"].as_str().unwrap())
            {
                break event["kind"]["id"].as_str().unwrap().to_string();
            }
        };
        let _ = follower.kill();
        let _ = follower.wait();
        id
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// Waits for arbord to exit; returns its exit code (None: killed by a signal).
    fn wait(mut self) -> Option<i32> {
        let deadline = std::time::Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(std::time::Instant::now() < deadline, "arbord did not exit");
            // Polling a child's exit; nothing here waits on a state of arbor's.
            let _ = self.stderr.recv_timeout(Duration::from_millis(20));
        }
    }
}

impl Drop for Arbord {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            // A failed test shows what each arbord said.
            let said: Vec<String> = self.stderr.try_iter().collect();
            eprintln!("arbord at {} said:\n{}", self.url, said.join("\n"));
        }
    }
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("an exit code")
}

#[test]
fn inv_40_sigterm_stops_running_runs_keeps_the_queue_and_exits_0_and_the_next_start_recovers() {
    let ws = workspace("max_running_runs = 1\n");
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(ws.path(), data.path());
    let running = arbord.submit(&["--agent", "slow", "--input", "wait"]);
    let step = arbord.wait_running(&running);
    let queued = arbord.submit(&["--flow", "hello"]);
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(arbord.wait(), Some(0), "a drain exits 0");

    // The journal is consistent before anything reads it again.
    let verify = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["journal", "verify", "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    assert_eq!(
        code(&verify),
        0,
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );

    let arbord = Arbord::start(ws.path(), data.path());
    let status = arbord.json(&["status"]);
    assert_eq!(
        status["recovery"]["jobs_failed"],
        serde_json::json!([]),
        "nothing was left running"
    );
    let doc = arbord.json(&["show", &running]);
    assert_eq!(doc["run"]["status"], "stopped");
    assert_eq!(doc["run"]["children"][0]["id"], step);
    assert!(
        doc["run"]["reason"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{doc}"
    );
    // The queued run survived the restart and runs now.
    let watched = arbord.arbor(&["watch", &queued]);
    assert_eq!(
        code(&watched),
        0,
        "{}",
        String::from_utf8_lossy(&watched.stderr)
    );
    assert_eq!(arbord.json(&["show", &queued])["run"]["status"], "done");
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(arbord.wait(), Some(0));
}

#[test]
fn sigkill_mid_run_then_restart_fails_the_interrupted_step_kills_its_processes_and_resumes_the_run()
{
    let ws = workspace("max_running_runs = 1\n");
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(ws.path(), data.path());
    let run = arbord.submit(&["--agent", "slow", "--input", "wait"]);
    let step = arbord.wait_running(&run);
    let queued = arbord.submit(&["--flow", "hello"]);
    // No event says a command started: ask the node until its sandbox has one.
    let deadline = std::time::Instant::now() + LIMIT;
    let pgid = loop {
        let status = arbord.json(&["status"]);
        if let Some(pgid) = status["sandboxes"][0]["pgid"].as_i64() {
            break pgid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the step's command never started"
        );
    };
    arbord.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(arbord.wait(), None, "killed");

    let arbord = Arbord::start(ws.path(), data.path());
    let status = arbord.json(&["status"]);
    let recovery = &status["recovery"];
    assert_eq!(
        recovery["jobs_failed"],
        serde_json::json!([step]),
        "I-30: {recovery}"
    );
    // The sandbox's processes die with arbord (a parent-death signal), or
    // recovery kills them: either way none is left.
    let killed = recovery["processes_killed"].as_array().unwrap();
    assert!(
        killed.is_empty() || killed == &[serde_json::json!(pgid)],
        "I-30: {recovery}"
    );
    assert_eq!(
        recovery["runs_resumed"],
        serde_json::json!([run]),
        "I-34: {recovery}"
    );
    assert!(
        recovery["breaches"].as_array().unwrap().is_empty(),
        "I-31: {recovery}"
    );
    assert!(
        !Path::new(&format!("/proc/{pgid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pgid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true),
        "the old sandbox process is gone"
    );
    // The run goes on with the step's next attempt.
    let again = arbord.wait_running_except(&run, &[&step]);
    assert_ne!(again, step);
    let doc = arbord.json(&["show", &run]);
    assert_eq!(doc["run"]["status"], "running");
    // The queued run survived the crash, and waits: the resumed run holds the one slot.
    assert_eq!(arbord.json(&["show", &queued])["run"]["status"], "pending");
    assert_eq!(arbord.json(&["status"])["admission"]["queued"], 1);
    let stop = arbord.arbor(&["stop", &run]);
    assert_eq!(code(&stop), 0, "{}", String::from_utf8_lossy(&stop.stderr));
    assert_eq!(
        code(&arbord.arbor(&["watch", &run])),
        1,
        "a stopped run exits 1"
    );
    assert_eq!(
        code(&arbord.arbor(&["watch", &queued])),
        0,
        "then the queued one runs"
    );
    // The interrupted attempt can be continued explicitly (I-33).
    let continued = arbord.arbor(&["continue", &step]);
    assert_eq!(
        code(&continued),
        0,
        "{}",
        String::from_utf8_lossy(&continued.stderr)
    );
    let new_run = String::from_utf8(continued.stdout)
        .unwrap()
        .trim()
        .to_string();
    assert_ne!(new_run, run);
    arbord.wait_running(&new_run);
    arbord.arbor(&["stop", &new_run]);
    assert_eq!(code(&arbord.arbor(&["watch", &new_run])), 1);
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(arbord.wait(), Some(0));
}

#[test]
fn the_status_cli_exit_codes() {
    let ws = workspace("");
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(ws.path(), data.path());
    // 0: ok, and a run that is done.
    let done = arbord.submit(&["--flow", "hello"]);
    assert_eq!(code(&arbord.arbor(&["watch", &done])), 0);
    assert_eq!(code(&arbord.arbor(&["show", &done])), 0);
    let status = arbord.arbor(&["status"]);
    assert_eq!(code(&status), 0);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("\nsandbox sealed: "),
        "the posture is shown: {text}"
    );
    // A workspace whose providers set no rpm or tpm throttles nothing, and says so.
    let limits = arbord.arbor(&["limits"]);
    assert_eq!(code(&limits), 0);
    assert!(
        String::from_utf8_lossy(&limits.stdout).contains("no rate limits"),
        "{limits:?}"
    );
    assert_eq!(arbord.json(&["limits"])["models"], serde_json::json!([]));
    let runs = arbord.arbor(&["runs"]);
    assert_eq!(code(&runs), 0);
    // Its line says how long it took and what it spent of its ceiling.
    let runs = String::from_utf8_lossy(&runs.stdout);
    let line = runs
        .lines()
        .find(|l| l.contains(&done))
        .expect("the run is listed");
    assert!(line.contains("done"), "{runs}");
    assert!(
        line.split_whitespace()
            .any(|w| humantime::parse_duration(w).is_ok()),
        "a duration: {runs}"
    );
    assert!(line.contains(" of "), "spent of its ceiling: {runs}");
    // 1: a run that failed or was stopped.
    let stopped = arbord.submit(&["--agent", "slow", "--input", "wait"]);
    arbord.wait_running(&stopped);
    assert_eq!(code(&arbord.arbor(&["stop", &stopped])), 0);
    assert_eq!(code(&arbord.arbor(&["watch", &stopped])), 1);
    assert_eq!(code(&arbord.arbor(&["show", &stopped])), 1);
    let failed = arbord.submit(&["--agent", "empty", "--input", "go"]);
    assert_eq!(code(&arbord.arbor(&["watch", &failed])), 1);
    // The dead letters: only the failed run, with where it failed and why.
    let dead = arbord.arbor(&["runs", "--failed"]);
    assert_eq!(code(&dead), 0);
    let dead = String::from_utf8_lossy(&dead.stdout);
    assert!(
        dead.contains("FAILED FIRST") && dead.contains(&failed) && dead.contains("empty ("),
        "{dead}"
    );
    assert!(!dead.contains(&stopped), "{dead}");
    // 2: bad usage, and input the service refuses.
    assert_eq!(code(&arbord.arbor(&["show"])), 2);
    assert_eq!(code(&arbord.arbor(&["show", "not-a-uuid"])), 2);
    assert_eq!(code(&arbord.arbor(&["-o", "yaml", "status"])), 2);
    let refused = arbord.arbor(&["submit", "--flow", "nope"]);
    assert_eq!(code(&refused), 2);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("no such flow"));
    // 3: not found.
    let unknown = "01a00000-0000-7000-8000-000000000000";
    assert_eq!(code(&arbord.arbor(&["show", unknown])), 3);
    assert_eq!(code(&arbord.arbor(&["stop", unknown])), 3);
    assert_eq!(code(&arbord.arbor(&["steer", unknown, "hi"])), 3);
    // 4: unreachable.
    let far = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["status", "--url", "http://127.0.0.1:9"])
        .env("ARBOR_TOKEN", "x")
        .output()
        .unwrap();
    assert_eq!(code(&far), 4, "{}", String::from_utf8_lossy(&far.stderr));
    // 5: the token refused.
    let wrong = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["status", "--url", &arbord.url, "--token", "wrong"])
        .output()
        .unwrap();
    assert_eq!(code(&wrong), 5);
    // Data on stdout, diagnostics on stderr.
    let json = arbord.arbor(&["runs", "-o", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(list["runs"].as_array().unwrap().len(), 3);
    let lines = arbord.arbor(&["events", &done, "-o", "jsonl"]);
    let text = String::from_utf8(lines.stdout).unwrap();
    assert!(
        text.lines()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
    );
    assert!(text.lines().last().unwrap().contains("run_finished"));
    let table = String::from_utf8(arbord.arbor(&["show", &done]).stdout).unwrap();
    assert!(table.contains("└─ ✔ quick"), "{table}");
    assert!(
        !table.contains('\u{1b}'),
        "NO_COLOR: no escapes in {table:?}"
    );
    let coloured = arbord.arbor(&["show", &done, "--color", "always"]);
    assert!(String::from_utf8_lossy(&coloured.stdout).contains('\u{1b}'));
}

#[test]
fn the_run_document_over_http_is_the_document_arbor_run_json_prints() {
    let example = repo().join("examples/research");
    let embedded_data = tempfile::tempdir().unwrap();
    let embedded = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["run", example.to_str().unwrap(), "--json", "--data-dir"])
        .arg(embedded_data.path())
        .output()
        .unwrap();
    let embedded: serde_json::Value = serde_json::from_slice(&embedded.stdout).unwrap();
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(&example, data.path());
    let run = arbord.submit(&["--flow", "research"]);
    arbord.arbor(&["watch", &run]);
    let served = arbord.json(&["show", &run]);
    let text =
        std::fs::read_to_string(repo().join("docs/contract/run-output.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap();
    for doc in [&embedded, &served] {
        let errors: Vec<String> = validator.iter_errors(doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{errors:?}");
    }
    assert_eq!(
        shape(&embedded["run"]),
        shape(&served["run"]),
        "the same run, the same document"
    );
    // `arbor run` adds its embedded node's sandbox posture.
    assert_eq!(embedded["sandbox"]["mode"], "sealed");
    assert_eq!(embedded["sandbox"]["sealed"], true);
}

/// The document without what differs between two runs of the same flow:
/// ids, times, paths and the figures of accounts.
fn shape(doc: &serde_json::Value) -> serde_json::Value {
    match doc {
        serde_json::Value::Object(map) => map
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "id" | "workdir" | "started_at_ms" | "ended_at_ms"
                )
            })
            .map(|(k, v)| match (k.as_str(), v) {
                // What a job spends depends on when a steer reached it (the
                // example's scout is steered while it waits 300 ms), so of
                // an account only its fields are compared.
                ("account", serde_json::Value::Object(fields)) => (
                    k.clone(),
                    fields
                        .keys()
                        .map(|f| (f.clone(), serde_json::Value::Bool(true)))
                        .collect(),
                ),
                _ => (k.clone(), shape(v)),
            })
            .collect(),
        serde_json::Value::Array(items) => items.iter().map(shape).collect(),
        other => other.clone(),
    }
}

#[test]
fn arbord_refuses_bad_settings_and_a_readable_token_file() {
    let run = |ws: &Path, data: &Path, envs: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_arbord"));
        command
            .arg("--workspace")
            .arg(ws)
            .arg("--data-dir")
            .arg(data)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("ARBOR_TEST_DATABASE_URL")
            .env_remove("ARBOR_TEST_JOURNAL");
        for (k, v) in envs {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    let data = tempfile::tempdir().unwrap();
    let ws = workspace("max_runs = 3\n");
    let out = run(ws.path(), data.path(), &[]);
    assert_eq!(code(&out), 2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_runs"));
    let ws = workspace("");
    let out = run(ws.path(), data.path(), &[("ARBOR_MAX_RUNING_RUNS", "3")]);
    assert_eq!(code(&out), 2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("ARBOR_MAX_RUNING_RUNS"));
    let out = run(ws.path(), data.path(), &[("ARBOR_MAX_RUNNING_RUNS", "0")]);
    assert_eq!(code(&out), 2);
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 never means unlimited"));
    // I-37: a token file others may read is refused.
    std::fs::write(data.path().join("token"), "x".repeat(64)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        data.path().join("token"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let out = run(ws.path(), data.path(), &[]);
    assert_eq!(code(&out), 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("0600"));
}

#[test]
fn listening_beyond_loopback_is_said_loudly() {
    let ws = workspace("");
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start_with(ws.path(), data.path(), &["--listen", "0.0.0.0:0"]);
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    let mut said = arbord.early.clone();
    while let Ok(line) = arbord.stderr.recv_timeout(LIMIT) {
        said.push(line);
        if said.iter().any(|l| l.contains("stopped cleanly")) {
            break;
        }
    }
    let said = said.join("\n");
    assert!(said.contains("NOT loopback"), "{said}");
}

#[test]
fn log_format_json_makes_every_log_line_one_json_object() {
    let ws = workspace("");
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start_with(
        ws.path(),
        data.path(),
        &["--listen", "127.0.0.1:0", "--log-format", "json"],
    );
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    let mut lines = arbord.early.clone();
    while let Ok(line) = arbord.stderr.recv_timeout(LIMIT) {
        let done = line.contains("stopped cleanly");
        lines.push(line);
        if done {
            break;
        }
    }
    // The two plain lines are arbord's own words to the operator; the rest are logs.
    let logs: Vec<&String> = lines
        .iter()
        .filter(|l| !l.starts_with("arbord: "))
        .collect();
    assert!(logs.len() >= 3, "{lines:#?}");
    for line in logs {
        let log: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(
            log["level"].is_string() && log["fields"].is_object(),
            "{log}"
        );
    }
}

/// Every file below `dir`, recursively.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_below(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// A copy of examples/NAME in a temporary folder (kept while the first is
/// held), without a data dir a run in the repository may have left.
fn example_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join(name);
    let copied = Command::new("cp")
        .arg("-r")
        .arg(repo().join("examples").join(name))
        .arg(&ws)
        .status()
        .unwrap();
    assert!(copied.success());
    let _ = std::fs::remove_dir_all(ws.join(".arbor"));
    (dir, ws)
}

/// examples/approvals/README.md, line by line: submit, `approvals RUN
/// --wait`, `approvals RUN --ids`, `approve`, `watch`, from the workspace's
/// folder with the token it finds there.
#[test]
fn inv_46_the_approvals_examples_readme_lines_work_as_written() {
    let (_dir, ws) = example_copy("approvals");
    let arbord = Arbord::start(&ws, &ws.join(".arbor"));
    let ok = |out: &Output| {
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let run = ok(&arbord.arbor_in(&ws, &["submit", "--flow", "release"]))
        .trim()
        .to_string();
    let listed = ok(&arbord.arbor_in(&ws, &["approvals", &run, "--wait"]));
    assert!(listed.contains("write_file"), "{listed}");
    assert!(listed.contains("release > customers"), "{listed}");
    let ids = ok(&arbord.arbor_in(&ws, &["approvals", &run, "--ids"]));
    let card = ids.lines().next().expect("a card id").trim().to_string();
    assert_eq!(ids.lines().count(), 1, "{ids}");
    let status = ok(&arbord.arbor_in(&ws, &["status"]));
    assert!(status.contains("waiting (approval)"), "{status}");
    assert!(status.contains(&card), "{status}");
    // A rejection needs its reason; clap says so before anything is sent.
    assert_eq!(code(&arbord.arbor_in(&ws, &["reject", &card])), 2);
    let approved = ok(&arbord.arbor_in(&ws, &["approve", &card, "--reason", "text checked"]));
    assert!(approved.contains("approved by operator"), "{approved}");
    let again = arbord.arbor_in(&ws, &["approve", &card]);
    assert_eq!(code(&again), 1, "a second decision is a conflict");
    ok(&arbord.arbor_in(&ws, &["watch", &run]));
    let all = arbord.json(&["approvals", "--state", "all"]);
    let cards = all["approvals"].as_array().unwrap();
    assert_eq!(cards.len(), 1);
    assert_eq!(cards[0]["decision"]["by"], "operator");
    assert_eq!(cards[0]["decision"]["reason"], "text checked");
    let sent: Vec<PathBuf> = files_below(&ws.join(".arbor/work"))
        .into_iter()
        .filter(|p| p.ends_with("outbox/announcement.txt"))
        .collect();
    assert_eq!(sent.len(), 1, "the approved call wrote its file once");
}

/// I-47 with a real kill -9: arbord dies while a card waits; the next start
/// shows the same card, pending, with its deadline; the resumed run waits
/// on it (not asked again), and an approval finishes the run.
#[test]
fn inv_47_a_pending_card_survives_arbord_killed_with_sigkill() {
    let (_dir, ws) = example_copy("approvals");
    let data = ws.join(".arbor");
    let arbord = Arbord::start(&ws, &data);
    let run = arbord.submit(&["--flow", "release"]);
    let before = arbord.arbor(&["approvals", &run, "--wait", "-o", "json"]);
    let before: serde_json::Value = serde_json::from_slice(&before.stdout).unwrap();
    let card = before["approvals"][0].clone();
    assert_eq!(card["state"], "pending");
    arbord.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(arbord.wait(), None, "killed");

    let arbord = Arbord::start(&ws, &data);
    let after = arbord.json(&["approvals", &run, "--wait"]);
    let cards = after["approvals"].as_array().unwrap();
    assert_eq!(cards.len(), 1, "not asked again: {after}");
    for key in [
        "id", "deadline", "asked_at", "lineage", "tool", "args", "state",
    ] {
        assert_eq!(cards[0][key], card[key], "{key}");
    }
    let card_id = card["id"].as_str().unwrap();
    let approved = arbord.arbor(&["approve", card_id]);
    assert_eq!(
        code(&approved),
        0,
        "{}",
        String::from_utf8_lossy(&approved.stderr)
    );
    assert_eq!(code(&arbord.arbor(&["watch", &run])), 0);
    let all = arbord.json(&["approvals", &run, "--state", "all"]);
    assert_eq!(all["approvals"].as_array().unwrap().len(), 1);
    assert_eq!(all["approvals"][0]["state"], "approved");
}

/// A webhook receiver on a plain thread: each request's `webhook-id`, sent
/// as it arrives; the first `hold` requests are read and never answered,
/// the rest answered 204.
fn webhook_receiver(hold: usize) -> (String, mpsc::Receiver<String>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = vec![];
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = vec![];
            let mut buf = [0u8; 4096];
            // Headers and body: the body's length is in content-length.
            let id = loop {
                let Ok(n) = stream.read(&mut buf) else {
                    break None;
                };
                if n == 0 {
                    break None;
                }
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request).to_string();
                let Some((head, body)) = text.split_once("\r\n\r\n") else {
                    continue;
                };
                let header = |name: &str| {
                    head.lines().find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
                    })
                };
                let length: usize = header("content-length")
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(0);
                if body.len() >= length {
                    break header("webhook-id");
                }
            };
            let Some(id) = id else { continue };
            let _ = tx.send(id);
            if held.len() < hold {
                held.push(stream);
            } else {
                let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n");
            }
        }
    });
    (url, rx)
}

/// I-61 with a real kill -9: arbord dies while a notification's try waits
/// for its answer; the next start sends it again with the same
/// `webhook-id`, and it is delivered.
#[test]
fn inv_61_a_notification_cut_off_by_sigkill_mid_delivery_is_sent_again_with_its_id() {
    use std::os::unix::fs::PermissionsExt;
    let (url, ids) = webhook_receiver(1);
    let dir = workspace(&format!(
        "\n[sandbox]\nsecrets_file = \"secrets.env\"\n\n[notify.ops]\nurl = \"{url}\"\nevents = [\"run_finished\"]\nsecret = \"HOOK_SECRET\"\ntimeout = \"5m\"\n"
    ));
    let secrets = dir.path().join("secrets.env");
    std::fs::write(
        &secrets,
        "HOOK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
    )
    .unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join(".arbor");
    let arbord = Arbord::start(dir.path(), &data);
    let run = arbord.submit(&["--flow", "hello"]);
    assert_eq!(code(&arbord.arbor(&["watch", &run])), 0);
    let first = ids.recv_timeout(LIMIT).expect("the first try arrives");
    // The try is held unanswered: arbord dies in the middle of it.
    arbord.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(arbord.wait(), None, "killed");

    let arbord = Arbord::start(dir.path(), &data);
    let again = ids
        .recv_timeout(LIMIT)
        .expect("sent again after the restart");
    assert_eq!(again, first, "the same webhook-id");
    let deadline = std::time::Instant::now() + LIMIT;
    let delivered = loop {
        assert!(std::time::Instant::now() < deadline, "never delivered");
        let listed: serde_json::Value =
            serde_json::from_str(&arbord.get_text("/v1/notifications?state=delivered")).unwrap();
        if let Some(entry) = listed["notifications"].as_array().and_then(|a| a.first()) {
            break entry.clone();
        }
        // Polling the API for an outcome the receiver has already answered.
        assert!(
            ids.recv_timeout(Duration::from_millis(20)).is_err(),
            "sent only twice"
        );
    };
    assert_eq!(delivered["id"], first.as_str());
    assert_eq!(delivered["run"], run.as_str());
    assert!(ids.try_recv().is_err(), "delivered once after the restart");
}

/// I-63 through the binaries: a credential `arbor token add` makes works
/// on a running arbord at once, within its role (a viewer reads, and its
/// submit is refused, exit 5, naming the role); revoked, it is refused.
#[test]
fn inv_63_a_viewer_made_with_arbor_token_reads_cannot_submit_and_once_revoked_is_refused() {
    let dir = workspace("");
    let data = dir.path().join(".arbor");
    let arbord = Arbord::start(dir.path(), &data);
    let token = |args: &[&str]| {
        let mut all = vec!["token"];
        all.extend_from_slice(args);
        all.extend(["--data-dir", data.to_str().unwrap()]);
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(&all)
            .output()
            .unwrap()
    };
    let made = token(&["add", "dash", "--roles", "viewer"]);
    assert_eq!(code(&made), 0, "{}", String::from_utf8_lossy(&made.stderr));
    let secret = String::from_utf8(made.stdout).unwrap().trim().to_string();
    assert_eq!(secret.len(), 64, "the token alone on its line");
    let as_viewer = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(args)
            .env("ARBOR_URL", &arbord.url)
            .env("ARBOR_TOKEN", &secret)
            .output()
            .unwrap()
    };
    assert_eq!(code(&as_viewer(&["runs"])), 0);
    let submit = as_viewer(&["submit", "--flow", "hello"]);
    assert_eq!(code(&submit), 5);
    let said = String::from_utf8_lossy(&submit.stderr);
    assert!(said.contains("needs operator"), "{said}");
    let listed = String::from_utf8(token(&["list"]).stdout).unwrap();
    assert!(
        listed.contains("dash") && !listed.contains(&secret),
        "{listed}"
    );
    assert_eq!(code(&token(&["revoke", "dash"])), 0);
    assert_eq!(code(&as_viewer(&["runs"])), 5, "revoked");
}

/// A workspace whose journal is a fresh schema of the PostgreSQL server
/// `ARBOR_TEST_DATABASE_URL` names, with a short lease: (the workspace,
/// the URL, the schema).
fn shared_workspace() -> (tempfile::TempDir, String, String) {
    let url = std::env::var("ARBOR_TEST_DATABASE_URL").expect(
        "ARBOR_TEST_DATABASE_URL: start a server with `tests/postgres/cluster.sh start DIR`",
    );
    let schema = format!("t{}", arbor_protocol::RunId::new().0.simple());
    let ws = workspace("");
    let sleepy = "---\ndescription: thinks, then answers\nscript:\n  - say: thinking\n    delay: 3s\n  - call: {tool: submit_output, args: {output: done, task_status: completed}}\n---\nYou think.\n";
    std::fs::create_dir_all(ws.path().join("agents/sleepy")).unwrap();
    std::fs::write(ws.path().join("agents/sleepy/agent.md"), sleepy).unwrap();
    append_toml(
        ws.path(),
        &format!(
            "\n[journal]\nbackend = \"postgres\"\nurl = \"{url}\"\nschema = \"{schema}\"\nlease = \"2s\"\n"
        ),
    );
    (ws, url, schema)
}

/// Adds `text` to the workspace's arbor.toml.
fn append_toml(ws: &Path, text: &str) {
    let toml = ws.join("arbor.toml");
    let mut all = std::fs::read_to_string(&toml).unwrap();
    all.push_str(text);
    std::fs::write(&toml, all).unwrap();
}

/// Two arbords on `ws` (a shared journal), named `ids`; each node's data
/// dir is kept as long as the pair.
fn two_nodes(ws: &Path, ids: [&str; 2]) -> ([Arbord; 2], [tempfile::TempDir; 2]) {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let start = |dir: &tempfile::TempDir, id: &str| {
        Arbord::start_with(
            ws,
            dir.path(),
            &["--listen", "127.0.0.1:0", "--node-id", id],
        )
    };
    ([start(&dirs[0], ids[0]), start(&dirs[1], ids[1])], dirs)
}

/// SIGTERM to each node; each exits 0.
fn stop_all(nodes: [Arbord; 2]) {
    for node in nodes {
        node.signal(nix::sys::signal::Signal::SIGTERM);
        assert_eq!(node.wait(), Some(0));
    }
}

/// Runs `sql` on the test server and hands back its rows.
fn query(url: &str, sql: &str) -> Vec<tokio_postgres::Row> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client.query(sql, &[]).await.unwrap()
    })
}

/// Asks `arbord` for the run's document until it has ended; its status.
fn ended(arbord: &Arbord, run: &str) -> String {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let doc = arbord.json(&["show", run]);
        let status = doc["run"]["status"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if ["done", "failed", "stopped"].contains(&status.as_str()) {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "run {run} did not end: {doc}"
        );
    }
}

/// What the database says afterwards (the issue's checker): a run's epochs
/// only grow, one owner each; every account balances; no job is left
/// running.
fn check_the_database(url: &str, schema: &str, run: &str) -> Vec<(i64, String)> {
    let claims: Vec<(i64, String)> = query(
        url,
        &format!(
            "SELECT epoch, node FROM {schema}.claims WHERE encode(run, 'hex') = '{}' \
             ORDER BY claimed_at",
            run.replace('-', "")
        ),
    )
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect();
    let epochs: Vec<i64> = claims.iter().map(|c| c.0).collect();
    let mut sorted = epochs.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(epochs, sorted, "epochs only grow, each once: {claims:?}");
    // `arbor journal VERB` on the shared journal, without a node.
    let journal = |verb: &str| {
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(["journal", verb, "--database-url", url, "--schema", schema])
            .output()
            .unwrap()
    };
    let verify = journal("verify");
    assert_eq!(
        code(&verify),
        0,
        "every account balances: {}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    let inspect = journal("inspect");
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        !text.contains("[running]") && !text.contains("[pending]"),
        "no job is left running: {text}"
    );
    claims
}

/// I-51: two arbords on one PostgreSQL journal; the owner of a run is
/// killed with SIGKILL mid-run; the other takes the run at epoch 2 once the
/// lease has run out, and it completes there with every account balanced.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_51_a_run_whose_owner_is_killed_is_taken_over_and_completes_balanced() {
    let (ws, url, schema) = shared_workspace();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = ["--listen", "127.0.0.1:0", "--node-id"];
    let a = Arbord::start_with(ws.path(), data_a.path(), &[&listen[..], &["a"]].concat());
    let run = a.submit(&["--agent", "sleepy", "--input", "think"]);
    a.wait_running(&run);
    // b starts once a has the run: the queue is shared, and b would as
    // soon take it.
    let b = Arbord::start_with(ws.path(), data_b.path(), &[&listen[..], &["b"]].concat());
    a.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(a.wait(), None, "killed");

    assert_eq!(ended(&b, &run), "done");
    let doc = b.json(&["show", &run]);
    assert_eq!(
        (doc["owner"].as_str(), doc["epoch"].as_u64()),
        (Some("b"), Some(2)),
        "the run's document says who owns it at which epoch"
    );
    let nodes = b.json(&["status"])["nodes"].clone();
    let a_node = nodes
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["id"] == "a"))
        .unwrap_or_else(|| panic!("status lists node a: {nodes}"));
    assert_eq!(a_node["lease_left_ms"], 0, "a's lease ran out: {nodes}");
    let claims = check_the_database(&url, &schema, &run);
    assert_eq!(
        claims,
        [(1, "a".to_string()), (2, "b".to_string())],
        "owned by a at epoch 1, taken by b at epoch 2"
    );
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.wait(), Some(0));
}

/// I-50: an owner paused past its lease (SIGSTOP, then SIGCONT) finds it
/// lost when it wakes: it stops its runs here (its sandbox's processes
/// end), commits nothing more and exits 1; the other node goes on with
/// the run.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_50_an_owner_paused_past_its_lease_stops_its_runs_and_commits_nothing() {
    let (ws, url, schema) = shared_workspace();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = ["--listen", "127.0.0.1:0", "--node-id"];
    let a = Arbord::start_with(ws.path(), data_a.path(), &[&listen[..], &["a"]].concat());
    let run = a.submit(&["--agent", "slow", "--input", "wait"]);
    let step = a.wait_running(&run);
    let deadline = std::time::Instant::now() + LIMIT;
    let pgid = loop {
        if let Some(pgid) = a.json(&["status"])["sandboxes"][0]["pgid"].as_i64() {
            break pgid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "its command never started"
        );
    };
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let b = Arbord::start_with(ws.path(), data_b.path(), &[&listen[..], &["b"]].concat());
    // b takes the run once a's lease has run out, and runs its next attempt.
    let again = b.wait_running_except(&run, &[&step]);
    assert_ne!(again, step);
    a.signal(nix::sys::signal::Signal::SIGCONT);
    assert_eq!(a.wait(), Some(1), "a ends: its lease is gone");
    assert!(
        !Path::new(&format!("/proc/{pgid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pgid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true),
        "a's sandbox process is gone"
    );
    let stop = b.arbor(&["stop", &run]);
    assert_eq!(code(&stop), 0, "{}", String::from_utf8_lossy(&stop.stderr));
    assert_eq!(ended(&b, &run), "stopped");
    let claims = check_the_database(&url, &schema, &run);
    assert_eq!(claims, [(1, "a".to_string()), (2, "b".to_string())]);
    // Nothing a wrote after b's claim: every record of the step's first
    // attempt says it was interrupted, as b's recovery wrote it.
    let doc = b.json(&["show", &run]);
    let first = doc["tree"]["nodes"]
        .as_object()
        .map(|nodes| nodes.values().find(|n| n["id"] == step.as_str()).cloned())
        .unwrap_or_default();
    if let Some(first) = first {
        assert_eq!(first["error_class"], "interrupted", "{first}");
    }
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.wait(), Some(0));
}

/// `arbor run` on a PostgreSQL journal, twice with the same node id: the
/// first ends its lease as it exits, so the second starts at once rather
/// than waiting for it to run out, and finds the first run's records.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn arbor_run_on_postgres_ends_its_lease_as_it_exits() {
    let (ws, url, schema) = shared_workspace();
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(["run"])
            .arg(ws.path())
            .args(["--flow", "hello", "--node-id", "solo", "--json"])
            .env_remove("ARBOR_TEST_DATABASE_URL")
            .env_remove("ARBOR_TEST_JOURNAL")
            .output()
            .unwrap()
    };
    for _ in 0..2 {
        let out = run();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(code(&out), 0, "{stderr}");
        assert!(!stderr.contains("holds a lease"), "it waited: {stderr}");
    }
    let runs = query(&url, &format!("SELECT count(*) FROM {schema}.runs"));
    assert_eq!(runs[0].get::<_, i64>(0), 2, "both runs are in the journal");
}

/// I-50: two arbords share one queue; runs submitted through both race to
/// whichever has room first: each run is claimed once, at epoch 1, by one
/// node, both nodes take some, and either node serves every run's
/// document and events.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_50_two_nodes_race_for_one_queue_and_each_run_is_claimed_once_per_epoch() {
    let (ws, url, schema) = shared_workspace();
    let brief = "---\ndescription: thinks briefly\nscript:\n  - say: thinking\n    delay: 400ms\n  - call: {tool: submit_output, args: {output: done, task_status: completed}}\n---\nYou think.\n";
    std::fs::create_dir_all(ws.path().join("agents/brief")).unwrap();
    std::fs::write(ws.path().join("agents/brief/agent.md"), brief).unwrap();
    let toml = ws.path().join("arbor.toml");
    let text = std::fs::read_to_string(&toml)
        .unwrap()
        .replace("[service]\n", "[service]\nmax_running_runs = 2\n");
    std::fs::write(&toml, text).unwrap();
    let ([a, b], _dirs) = two_nodes(ws.path(), ["a", "b"]);
    let runs: Vec<String> = (0..12)
        .map(|n| [&a, &b][n % 2].submit(&["--agent", "brief", "--input", "go"]))
        .collect();
    for run in &runs {
        assert_eq!(ended(&a, run), "done", "a serves run {run} wherever it ran");
        assert_eq!(ended(&b, run), "done");
    }
    let mut ran_on = std::collections::BTreeSet::new();
    for run in &runs {
        let claims = check_the_database(&url, &schema, run);
        assert_eq!(claims.len(), 1, "run {run} claimed once: {claims:?}");
        assert_eq!(claims[0].0, 1, "at epoch 1");
        ran_on.insert(claims[0].1.clone());
        let doc = b.json(&["show", run]);
        assert_eq!(doc["owner"].as_str(), Some(claims[0].1.as_str()));
    }
    assert_eq!(
        ran_on.into_iter().collect::<Vec<_>>(),
        ["a", "b"],
        "the queue is shared: both nodes took runs"
    );
    // Each node's metrics name every node of the journal, each holding
    // the lease arbor.toml gives (2 s), not the default.
    let metrics = a.get_text("/metrics");
    for node in ["a", "b"] {
        let left: f64 = metrics
            .lines()
            .find_map(|line| {
                line.strip_prefix(&format!(
                    "arbor_node_lease_left_seconds{{node=\"{node}\"}} "
                ))
            })
            .unwrap_or_else(|| panic!("no lease for {node}: {metrics}"))
            .parse()
            .unwrap();
        assert!(left > 0.0 && left <= 2.0, "{node}'s lease left: {left} s");
        assert!(
            metrics.contains(&format!("arbor_node_owned_runs{{node=\"{node}\"}} 0")),
            "every run ended: {metrics}"
        );
    }
    // The events of a run the other node ran, streamed to their end.
    let events = a.arbor(&["events", &runs[1], "-o", "jsonl"]);
    let last = String::from_utf8_lossy(&events.stdout)
        .lines()
        .last()
        .map(str::to_string)
        .unwrap_or_default();
    assert!(last.contains("run_finished"), "{last}");
    stop_all([a, b]);
}

/// Any node's API acts on another node's run: a steering message and a
/// stop sent through b reach the run a owns, and b answers with a's answer.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn a_run_is_steered_and_stopped_through_a_node_that_does_not_own_it() {
    let (ws, url, schema) = shared_workspace();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = ["--listen", "127.0.0.1:0", "--node-id"];
    let a = Arbord::start_with(ws.path(), data_a.path(), &[&listen[..], &["a"]].concat());
    let run = a.submit(&["--agent", "slow", "--input", "wait"]);
    let step = a.wait_running(&run);
    let b = Arbord::start_with(ws.path(), data_b.path(), &[&listen[..], &["b"]].concat());

    let steer = b.arbor(&["steer", &step, "hurry up"]);
    assert_eq!(
        code(&steer),
        0,
        "{}",
        String::from_utf8_lossy(&steer.stderr)
    );
    let said = String::from_utf8_lossy(&steer.stdout).to_string();
    assert!(said.contains("message"), "a's answer, through b: {said}");
    // A message b refuses itself (empty) is never sent.
    let refused = b.arbor(&["steer", &step, "   "]);
    assert_ne!(code(&refused), 0);

    let stop = b.arbor(&["stop", &run]);
    assert_eq!(code(&stop), 0, "{}", String::from_utf8_lossy(&stop.stderr));
    assert_eq!(ended(&a, &run), "stopped", "a stopped it");
    assert_eq!(ended(&b, &run), "stopped");
    let again = b.arbor(&["stop", &run]);
    assert_ne!(code(&again), 0, "a stop of an ended run is refused");
    let claims = check_the_database(&url, &schema, &run);
    assert_eq!(claims, [(1, "a".to_string())], "it never moved");
    stop_all([a, b]);
}

/// A drained node's running runs move: SIGTERM to the owner stops its run
/// here (its processes end, nothing lost), ends its lease, and exits 0; the
/// other node takes the run at once, at the next epoch, and runs it on.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn a_drained_nodes_running_run_moves_to_another_node() {
    let (ws, url, schema) = shared_workspace();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = ["--listen", "127.0.0.1:0", "--node-id"];
    let a = Arbord::start_with(ws.path(), data_a.path(), &[&listen[..], &["a"]].concat());
    let run = a.submit(&["--agent", "slow", "--input", "wait"]);
    let step = a.wait_running(&run);
    let b = Arbord::start_with(ws.path(), data_b.path(), &[&listen[..], &["b"]].concat());
    a.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(a.wait(), Some(0), "a drains and exits 0");
    let again = b.wait_running_except(&run, &[&step]);
    assert_ne!(again, step, "b runs the step again");
    let doc = b.json(&["show", &run]);
    assert_eq!(
        (doc["owner"].as_str(), doc["epoch"].as_u64()),
        (Some("b"), Some(2))
    );
    let stop = b.arbor(&["stop", &run]);
    assert_eq!(code(&stop), 0, "{}", String::from_utf8_lossy(&stop.stderr));
    assert_eq!(ended(&b, &run), "stopped");
    let claims = check_the_database(&url, &schema, &run);
    assert_eq!(claims, [(1, "a".to_string()), (2, "b".to_string())]);
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.wait(), Some(0));
}

/// `arbor node drain ID` through another node: the node asked drains as at
/// SIGTERM (exits 0) and its running run moves to the node that asked.
/// Bad ids are refused, and a node whose journal is its own refuses a drain.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn a_node_drained_through_another_exits_and_its_run_moves() {
    let (ws, url, schema) = shared_workspace();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = ["--listen", "127.0.0.1:0", "--node-id"];
    let a = Arbord::start_with(ws.path(), data_a.path(), &[&listen[..], &["a"]].concat());
    let run = a.submit(&["--agent", "slow", "--input", "wait"]);
    let step = a.wait_running(&run);
    let b = Arbord::start_with(ws.path(), data_b.path(), &[&listen[..], &["b"]].concat());
    let unknown = b.arbor(&["node", "drain", "nobody"]);
    assert_eq!(
        code(&unknown),
        3,
        "{}",
        String::from_utf8_lossy(&unknown.stderr)
    );
    let drain = b.arbor(&["node", "drain", "a"]);
    assert_eq!(
        code(&drain),
        0,
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    assert!(String::from_utf8_lossy(&drain.stdout).contains("asked to drain"));
    assert_eq!(a.wait(), Some(0), "a drains and exits 0");
    let again = b.wait_running_except(&run, &[&step]);
    assert_ne!(again, step);
    let stop = b.arbor(&["stop", &run]);
    assert_eq!(code(&stop), 0, "{}", String::from_utf8_lossy(&stop.stderr));
    assert_eq!(ended(&b, &run), "stopped");
    let claims = check_the_database(&url, &schema, &run);
    assert_eq!(claims, [(1, "a".to_string()), (2, "b".to_string())]);
    // A node asked through itself drains at once.
    let drain = b.arbor(&["node", "drain", "b"]);
    assert_eq!(
        code(&drain),
        0,
        "{}",
        String::from_utf8_lossy(&drain.stderr)
    );
    assert_eq!(b.wait(), Some(0));

    // One node on a journal of its own: nothing to hand its runs to.
    let ws = workspace("");
    let data = tempfile::tempdir().unwrap();
    let alone = Arbord::start(ws.path(), data.path());
    let refused = alone.arbor(&["node", "drain", "anything"]);
    assert_ne!(code(&refused), 0);
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("SIGTERM"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// I-65 on a shared journal: two arbords on one PostgreSQL, a tenant's
/// `runs_per_minute = 4`, and ten submissions raced through both at once:
/// the tenant's windows are the database's, reserved under its lock, so
/// exactly four are admitted, whichever node took them, and the other six
/// are refused naming the quota. Each node's limits say four.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_65_two_nodes_on_one_journal_never_exceed_a_tenants_quota_together() {
    let (ws, _url, _schema) = shared_workspace();
    append_toml(
        ws.path(),
        "\n[tenants.team]\n[tenants.team.quota]\nruns_per_minute = 4\n",
    );
    let ([a, b], _dirs) = two_nodes(ws.path(), ["a", "b"]);
    let submissions: Vec<std::process::Child> = (0..10)
        .map(|i| {
            let node = if i % 2 == 0 { &a } else { &b };
            Command::new(env!("CARGO_BIN_EXE_arbor"))
                .args(["submit", "--flow", "hello", "--tenant", "team"])
                .env("ARBOR_URL", &node.url)
                .env("ARBOR_TOKEN", node.token())
                .env("NO_COLOR", "1")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = submissions
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let admitted = outs.iter().filter(|o| o.status.success()).count();
    assert_eq!(admitted, 4, "{outs:#?}");
    for refused in outs.iter().filter(|o| !o.status.success()) {
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("runs_per_minute"), "{stderr}");
    }
    for node in [&a, &b] {
        let limits = node.json(&["limits"]);
        assert_eq!(
            limits["tenants"][0]["used"]["runs_per_minute"], 4,
            "{limits}"
        );
    }
    stop_all([a, b]);
}

/// I-65 on a shared journal: two nodes, each told the provider's `rpm` of
/// four, send no more than four requests together, though six runs want
/// one each. The provider (a mock that counts its minute and refuses what
/// passes it) serves four and refuses none; the two others wait, each in
/// its node's window (`waiting`), and both nodes see the four.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_65_two_nodes_on_one_journal_never_exceed_a_providers_rpm_together() {
    use arbor_testkit::mock_provider::{Format, MockProvider, openai};
    const RPM: usize = 4;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mock = runtime.block_on(MockProvider::start());
    mock.limit(RPM as u64, 1_000_000);
    let submit = [("submit_output", serde_json::json!({"output": "done"}))];
    for _ in 0..6 {
        mock.push(Format::Openai, openai::tool_calls(&submit, 100, 10));
    }
    let (ws, _url, _schema) = shared_workspace();
    let config = mock.arbor_toml(
        Format::Openai,
        &format!("stream = false\nmax_retries = 0\nrpm = {RPM}\n"),
    );
    append_toml(ws.path(), &format!("\n{config}"));
    let asker = "---\ndescription: asks its model once\nmodel: mock/small\n---\nAnswer.\n";
    std::fs::create_dir_all(ws.path().join("agents/asker")).unwrap();
    std::fs::write(ws.path().join("agents/asker/agent.md"), asker).unwrap();
    std::fs::write(
        ws.path().join("flows/ask.toml"),
        "[[group]]\nsteps = [{ agent = \"asker\", instruction = \"ask\" }]\n",
    )
    .unwrap();
    let ([a, b], _dirs) = two_nodes(ws.path(), ["a", "b"]);
    for i in 0..6 {
        let node = if i % 2 == 0 { &a } else { &b };
        node.submit(&["--flow", "ask"]);
    }
    let window = |node: &Arbord| {
        let limits = node.json(&["limits"]);
        limits["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["model"] == "mock/*")
            .cloned()
            .unwrap_or_else(|| panic!("no mock/* window: {limits}"))
    };
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let (wa, wb) = (window(&a), window(&b));
        let waiting = wa["waiting"].as_u64().unwrap() + wb["waiting"].as_u64().unwrap();
        if mock.served().len() == RPM && waiting == 2 {
            assert_eq!(wa["used"]["requests"], RPM, "{wa}");
            assert_eq!(wb["used"]["requests"], RPM, "{wb}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "served {}, waiting {waiting}: {wa} {wb}",
            mock.served().len()
        );
    }
    assert_eq!(mock.refused(), 0, "the provider refused nothing");
    assert_eq!(mock.served().len(), RPM);
    stop_all([a, b]);
}

/// Fair dispatch on a shared queue: two nodes, `per_tenant = 1`. Tenant a
/// floods the queue with five runs through both nodes, then tenant b
/// submits one. a's runs never overlap, whichever node takes them (the
/// bound counts every node's runs), and b's run, last to come, starts
/// before a's third: it waits only for a free slot, not behind a's flood.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn a_shared_queue_keeps_per_tenant_across_the_nodes_and_a_flood_delays_only_its_tenant() {
    let (ws, _url, _schema) = shared_workspace();
    append_toml(
        ws.path(),
        "\n[tenants.a]\n[tenants.b]\n[limits.concurrency]\nper_tenant = 1\n",
    );
    let nap = "---\ndescription: naps, then answers\nscript:\n  - say: napping\n    delay: 1s\n  - call: {tool: submit_output, args: {output: rested, task_status: completed}}\n---\nYou nap.\n";
    std::fs::create_dir_all(ws.path().join("agents/nap")).unwrap();
    std::fs::write(ws.path().join("agents/nap/agent.md"), nap).unwrap();
    std::fs::write(
        ws.path().join("flows/nap.toml"),
        "[[group]]\nsteps = [{ agent = \"nap\", instruction = \"nap\" }]\n",
    )
    .unwrap();
    let ([one, two], _dirs) = two_nodes(ws.path(), ["one", "two"]);
    let flood: Vec<String> = (0..5)
        .map(|i| {
            let node = if i % 2 == 0 { &one } else { &two };
            node.submit(&["--flow", "nap", "--tenant", "a"])
        })
        .collect();
    let late = two.submit(&["--flow", "nap", "--tenant", "b"]);
    // (start, end) of a run, by the clock of the node that ran it.
    let span = |run: &str| {
        assert_eq!(ended(&one, run), "done");
        let doc = one.json(&["show", run]);
        let root = &doc["run"];
        (
            root["started_at_ms"]
                .as_u64()
                .unwrap_or_else(|| panic!("{doc}")),
            root["ended_at_ms"]
                .as_u64()
                .unwrap_or_else(|| panic!("{doc}")),
        )
    };
    let mut floods: Vec<(u64, u64)> = flood.iter().map(|run| span(run)).collect();
    floods.sort_unstable();
    for pair in floods.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "two of a's runs overlapped: {floods:?}"
        );
    }
    let (b_start, _) = span(&late);
    assert!(
        b_start < floods[2].0,
        "b's run started at {b_start}, after a's third ({floods:?})"
    );
    stop_all([one, two]);
}

/// `on_quota = "queue"` on a shared queue (I-65): a tenant with two runs a
/// minute submits four through two nodes. All four are accepted (202), two
/// start (each reserved under the tenant's lock before its node claims it)
/// and two wait in the queue for the window, on either node.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn a_tenant_that_queues_on_a_shared_queue_waits_for_its_window() {
    let (ws, _url, _schema) = shared_workspace();
    append_toml(
        ws.path(),
        "\n[tenants.team]\non_quota = \"queue\"\n[tenants.team.quota]\nruns_per_minute = 2\n",
    );
    let ([a, b], _dirs) = two_nodes(ws.path(), ["a", "b"]);
    let runs: Vec<String> = (0..4)
        .map(|i| {
            let node = if i % 2 == 0 { &a } else { &b };
            node.submit(&["--flow", "hello", "--tenant", "team"])
        })
        .collect();
    let status = |run: &str| {
        let doc = a.json(&["show", run]);
        doc["run"]["status"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        let statuses: Vec<String> = runs.iter().map(|r| status(r)).collect();
        let done = statuses.iter().filter(|s| *s == "done").count();
        let queued = statuses.iter().filter(|s| *s == "pending").count();
        assert!(
            done <= 2,
            "more than the window's two started: {statuses:?}"
        );
        if done == 2 && queued == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{statuses:?}");
    }
    for node in [&a, &b] {
        let limits = node.json(&["limits"]);
        assert_eq!(
            limits["tenants"][0]["used"]["runs_per_minute"], 2,
            "{limits}"
        );
    }
    stop_all([a, b]);
}

/// A flow that answers at once, started every two seconds (every tick, if
/// late by at most a minute), written into `ws`.
fn every_two_seconds(ws: &Path) {
    std::fs::write(
        ws.join("flows/beat.toml"),
        "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n\n\
         [[schedule]]\nname = \"every-two\"\ncron = \"*/2 * * * * *\"\n\
         overlap = \"allow_all\"\ncatchup_window = \"60s\"\n",
    )
    .unwrap();
}

/// Reads `arbord`'s log until a tick at or after `at_ms` started a run.
fn wait_tick(arbord: &Arbord, at_ms: u64) {
    wait_tick_on(&[arbord], at_ms);
}

/// Reads the nodes' logs until one says a tick at or after `at_ms` started
/// a run.
fn wait_tick_on(nodes: &[&Arbord], at_ms: u64) {
    let deadline = std::time::Instant::now() + LIMIT;
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no schedule's tick started a run"
        );
        let Some(line) = nodes
            .iter()
            .find_map(|n| n.stderr.recv_timeout(Duration::from_millis(50)).ok())
        else {
            continue;
        };
        let tick = line
            .contains("a schedule's tick started a run")
            .then(|| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix("tick="))
            })
            .flatten()
            .and_then(|t| arbor_runtime::schedules::parse_time(t).ok());
        if tick.is_some_and(|t| t >= at_ms) {
            return;
        }
    }
}

/// The ticks (ms) of the runs schedule `every-two` started, as the API
/// lists them, in order (a tick twice is there twice).
fn scheduled_ticks(arbord: &Arbord) -> Vec<u64> {
    let list: serde_json::Value =
        serde_json::from_str(&arbord.get_text("/v1/runs?limit=500")).unwrap();
    let mut ticks: Vec<u64> = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["schedule"]["name"] == "every-two")
        .map(|r| {
            arbor_runtime::schedules::parse_time(r["schedule"]["tick"].as_str().unwrap()).unwrap()
        })
        .collect();
    ticks.sort_unstable();
    ticks
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Every tick from the first to the last, each once: two seconds apart.
fn each_tick_once(ticks: &[u64]) {
    assert!(ticks.len() >= 2, "{ticks:?}");
    for pair in ticks.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            2000,
            "a tick missing or twice: {ticks:?}"
        );
    }
}

/// I-66, from outside: a schedule firing every 2 s, its arbord killed with
/// SIGKILL and down for 5 s: every tick from its first to after the
/// restart started exactly once (those of the outage late, within the
/// catch-up window).
#[test]
fn inv_66_a_schedule_every_two_seconds_starts_each_tick_once_across_a_sigkill() {
    let ws = workspace("");
    every_two_seconds(ws.path());
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(ws.path(), data.path());
    wait_tick(&arbord, now_ms() + 3000);
    arbord.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(arbord.wait(), None, "killed");
    // The outage itself: no node runs for five seconds.
    std::thread::sleep(Duration::from_secs(5));
    let arbord = Arbord::start(ws.path(), data.path());
    wait_tick(&arbord, now_ms() + 4000);
    let ticks = scheduled_ticks(&arbord);
    each_tick_once(&ticks);
    assert!(
        ticks.len() >= 7,
        "before, during and after the outage: {ticks:?}"
    );
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(arbord.wait(), Some(0));
}

/// I-66 on a shared journal: two arbords on one PostgreSQL look at the
/// same schedule every second; one is killed; every tick, before and
/// after, started once across the two.
#[test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
fn inv_66_two_nodes_start_each_tick_once_and_the_survivor_goes_on_when_one_is_killed() {
    let (ws, _url, _schema) = shared_workspace();
    every_two_seconds(ws.path());
    let ([a, b], _dirs) = two_nodes(ws.path(), ["a", "b"]);
    wait_tick_on(&[&a, &b], now_ms() + 4000);
    a.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(a.wait(), None, "killed");
    wait_tick(&b, now_ms() + 6000);
    let ticks = scheduled_ticks(&b);
    each_tick_once(&ticks);
    assert!(ticks.len() >= 5, "{ticks:?}");
    b.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.wait(), Some(0));
}

/// The deploy test's agent: it ships, saying which edit it is.
fn shipper(edit: &str) -> String {
    format!(
        "---\ndescription: ships\nscript:\n  - call: {{tool: submit_output, args: {{output: shipped-{edit}, task_status: completed}}}}\n---\nYou ship.\n"
    )
}

/// Submits the gated flow and waits for its card: (run, card).
fn gated_run(arbord: &Arbord) -> (String, String) {
    let run = arbord.submit(&["--flow", "ship"]);
    let cards = arbord.json(&["approvals", &run, "--wait"]);
    let card = cards["approvals"][0]["id"].as_str().unwrap().to_string();
    (run, card)
}

/// Approves the run's card and waits for its end: its document.
fn approved(arbord: &Arbord, run: &str, card: &str) -> serde_json::Value {
    let out = arbord.arbor(&["approve", card]);
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(ended(arbord, run), "done");
    arbord.json(&["show", run])
}

/// I-67: a run admitted, its agent.md edited and arbord reloaded (SIGHUP),
/// then killed with SIGKILL: the recovered run finishes on the definitions
/// it was admitted with, while a new run takes the edit; a rollback makes
/// the first version current again.
#[test]
fn inv_67_a_recovered_run_keeps_its_pinned_definitions_across_a_reload_and_a_kill() {
    let ws = workspace("");
    let agent = ws.path().join("agents/shipper/agent.md");
    std::fs::create_dir_all(agent.parent().unwrap()).unwrap();
    std::fs::write(&agent, shipper("v1")).unwrap();
    std::fs::write(
        ws.path().join("flows/ship.toml"),
        "[[group]]\nsteps = [{ agent = \"shipper\", instruction = \"Ship.\", approve = true }]\n",
    )
    .unwrap();
    let data = tempfile::tempdir().unwrap();
    let arbord = Arbord::start(ws.path(), data.path());
    let (first, first_card) = gated_run(&arbord);
    let v1 = arbord.json(&["show", &first])["run"]["version"]
        .as_str()
        .unwrap()
        .to_string();

    std::fs::write(&agent, shipper("v2")).unwrap();
    arbord.signal(nix::sys::signal::Signal::SIGHUP);
    while let Ok(line) = arbord.stderr.recv_timeout(LIMIT) {
        if line.contains("SIGHUP: the workspace was reloaded") {
            break;
        }
        assert!(!line.contains("SIGHUP: the reload was refused"), "{line}");
    }
    let (second, second_card) = gated_run(&arbord);
    let v2 = arbord.json(&["show", &second])["run"]["version"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(v1, v2, "the edit is a new version");
    arbord.signal(nix::sys::signal::Signal::SIGKILL);
    assert_eq!(arbord.wait(), None, "killed");

    let arbord = Arbord::start(ws.path(), data.path());
    let doc = approved(&arbord, &first, &first_card);
    assert_eq!(doc["run"]["output"], "shipped-v1", "{doc}");
    assert_eq!(doc["run"]["version"], v1.as_str());
    let doc = approved(&arbord, &second, &second_card);
    assert_eq!(doc["run"]["output"], "shipped-v2", "{doc}");

    let versions = arbord.json(&["versions"]);
    assert_eq!(versions["current"], v2.as_str(), "{versions}");
    let out = arbord.arbor(&["rollback", &v1]);
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    let (third, third_card) = gated_run(&arbord);
    let doc = approved(&arbord, &third, &third_card);
    assert_eq!(doc["run"]["output"], "shipped-v1", "{doc}");
    assert_eq!(doc["run"]["version"], v1.as_str());
    // A broken edit is refused whole, saying why; the version stays.
    std::fs::write(&agent, "---\ndescription: [unclosed\n---\nYou ship.\n").unwrap();
    let out = arbord.arbor(&["reload"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(code(&out), 2, "a refusal (422): {said}");
    assert!(
        said.contains("agents/shipper") && said.contains(&format!("version {v1} stays")),
        "{said}"
    );
    std::fs::write(&agent, shipper("v3")).unwrap();
    append_toml(ws.path(), "\n[approvals]\ntimeout = \"2h\"\n");
    let out = arbord.arbor(&["reload"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(code(&out) != 0 && said.contains("arbor.toml"), "{said}");
    assert_eq!(arbord.json(&["versions"])["current"], v1.as_str());
    let out = arbord.arbor(&["rollback", "0000000000000000"]);
    assert_eq!(
        code(&out),
        3,
        "an unknown version: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    arbord.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(arbord.wait(), Some(0));
}
