//! Attacks on a sealed sandbox, each run by a real agent's real commands on
//! a real node. Every one must fail for the attacker; where a test could
//! pass by accident (a command that never ran), a control shows the same
//! command succeeding where it is allowed.

use arbor_protocol::Status;
use arbor_testkit::{
    RecordingModels, TestNode, agent_md, exec_script, process_exits_within, processes_in,
    secrets_file,
};
use std::io::Read;
use std::time::Duration;

/// An agent.md whose script runs `commands` with exec, then answers.
fn exec_agent(front_matter: &str, commands: &[&str]) -> String {
    let script = exec_script(commands);
    agent_md(&format!(
        "tools: [exec, read_file]\n{front_matter}\nscript:\n{script}"
    ))
}

/// Runs one agent to its end and returns each exec's result as its event
/// shows it (JSON, cut short if long).
async fn run_execs(node: &TestNode, agent: &str) -> (arbor_protocol::RunId, Vec<String>) {
    let run = node.run_agent(agent, "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    let results = node
        .tool_calls(run)
        .into_iter()
        .filter(|c| c.tool == "exec")
        .map(|c| c.detail)
        .collect();
    (run, results)
}

fn out(result: &str) -> String {
    result.to_string()
}

/// A TCP connection to a listener on the host's loopback, from bash.
fn connect_to(port: u16) -> String {
    format!("bash -c 'echo hello > /dev/tcp/127.0.0.1/{port}' && echo CONNECTED || echo REFUSED")
}

#[tokio::test]
async fn inv_28_a_sealed_sandbox_cannot_connect_to_the_hosts_loopback() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sealed = exec_agent("", &[&connect_to(port)]);
    let open = exec_agent("network: open", &[&connect_to(port)]);
    let node = TestNode::start(&[("sealed", &sealed), ("open", &open)]).await;

    let (_, results) = run_execs(&node, "sealed").await;
    let sealed_out = out(&results[0]);
    assert!(sealed_out.contains("REFUSED"), "{sealed_out}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the listener was reached from a sealed sandbox"
    );

    // The control: the same command reaches it with `network: open`.
    let (_, results) = run_execs(&node, "open").await;
    assert!(out(&results[0]).contains("CONNECTED"), "{results:?}");
    let (mut stream, _) = listener.accept().expect("the open sandbox connected");
    let mut got = String::new();
    stream.set_nonblocking(false).unwrap();
    stream.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hello\n");
}

#[tokio::test]
async fn inv_28_no_host_unix_socket_and_no_dns_from_a_sealed_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("host.sock");
    let _named = std::os::unix::net::UnixListener::bind(&path).unwrap();
    // An abstract socket: no file, reachable from the host's network namespace only.
    let abstract_name = format!("arbor-test-{}", std::process::id());
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            abstract_name.as_bytes(),
        )
        .unwrap();
    let _abstract = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let probe = |target: &str| {
        format!(
            "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect({target}); print('CONNECTED')\" 2>&1 || echo REFUSED"
        )
    };
    let named = probe(&format!("'{}'", path.display()));
    let abstract_ = probe(&format!("'\\\\0{abstract_name}'"));
    let dns = "getent hosts example.com || echo NO-DNS; python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\" 2>&1 | tail -1";
    let sealed = exec_agent("", &[&named, &abstract_, dns]);
    let open = exec_agent("network: open", &[&abstract_]);
    let node = TestNode::start(&[("sealed", &sealed), ("open", &open)]).await;

    let (_, results) = run_execs(&node, "sealed").await;
    for r in &results[..2] {
        assert!(
            out(r).contains("REFUSED") && !out(r).contains("CONNECTED"),
            "{r}"
        );
    }
    assert!(out(&results[2]).contains("NO-DNS"), "{}", results[2]);
    assert!(out(&results[2]).contains("gaierror"), "{}", results[2]);
    // The control: with the host's network namespace, the abstract socket answers.
    let (_, results) = run_execs(&node, "open").await;
    assert!(out(&results[0]).contains("CONNECTED"), "{}", results[0]);
}

#[tokio::test]
async fn inv_28_host_files_the_journal_and_everything_outside_the_workdir_are_out_of_reach() {
    let outside = tempfile::tempdir().unwrap();
    let host_file = outside.path().join("host-secret.txt");
    std::fs::write(&host_file, "host data").unwrap();
    let target = outside.path().join("planted.txt");
    // A step's workdir is <data>/work/<run>/<label>: the journal is at
    // ../../../journal on the host.
    let probe = exec_agent(
        "",
        &[
            &format!("cat {} || echo NO-HOST-FILE", host_file.display()),
            "d=$(cd ../../.. && pwd); ls $d/journal 2>&1; cat $d/journal/db 2>&1 | head -c 100; ls $d; echo END",
            "cat /etc/shadow 2>&1; ls /root /run /home 2>&1; echo END",
            &format!(
                "echo x > {} 2>&1; echo x > /usr/planted 2>&1; echo x > /etc/planted 2>&1; echo x > /planted 2>&1; echo x > mine.txt && echo WROTE-MINE",
                target.display()
            ),
        ],
    );
    let node = TestNode::start(&[("probe", &probe)]).await;
    assert!(node.data_dir().join("journal").join("db").exists());
    let (run, results) = run_execs(&node, "probe").await;

    let text: Vec<String> = results.iter().map(|r| out(r)).collect();
    assert!(
        text[0].contains("NO-HOST-FILE") && !text[0].contains("host data"),
        "{}",
        text[0]
    );
    assert!(text[1].contains("No such file"), "{}", text[1]);
    assert!(
        // Of the data dir, it sees only the empty folders that lead to its workdir.
        text[1].contains(r"No such file or directory\nwork\nEND"),
        "the data dir was seen: {}",
        text[1]
    );
    assert!(text[2].contains("No such file"), "{}", text[2]);
    assert!(!text[2].contains("root:"), "{}", text[2]);
    assert!(text[3].contains(r#""changed":["mine.txt"]"#), "{}", text[3]);
    assert!(!target.exists(), "a file was planted outside the workdir");
    for planted in ["/usr/planted", "/etc/planted", "/planted"] {
        assert!(!std::path::Path::new(planted).exists(), "{planted}");
    }
    let step = node.tree(run).find("probe").unwrap();
    assert!(node.workdir(run, step).join("mine.txt").exists());
}

#[tokio::test]
async fn a_fork_bomb_stops_at_the_process_limit_and_the_job_goes_on() {
    let bomb = exec_agent(
        "resources: {processes: 32}",
        &[
            // The subshell dies at its first refused fork; `read` is a builtin, no fork.
            "(n=0; while [ $n -lt 300 ]; do sleep 60 & n=$((n+1)); echo $n > count; done) 2>/dev/null; read c < count; echo $c",
            "echo still here",
        ],
    );
    let node = TestNode::start(&[("bomb", &bomb)]).await;
    let (run, results) = run_execs(&node, "bomb").await;
    let result: serde_json::Value = serde_json::from_str(&results[0]).unwrap();
    let count: usize = result["stdout"]
        .as_str()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("{result}"));
    assert!(
        count < 32,
        "{count} sleeps started under a limit of 32 processes"
    );
    assert!(count >= 10, "the bomb never ran: {count}");
    assert!(out(&results[1]).contains("still here"));
    // Its sleeps died with the command's namespace.
    let step = node.tree(run).find("bomb").unwrap();
    assert!(processes_in(&node.workdir(run, step)).is_empty());
}

#[tokio::test]
async fn a_process_that_setsids_does_not_outlive_its_command() {
    let escapee = exec_agent(
        "",
        &[
            "setsid sleep 310 & (setsid sleep 311 &); sleep 0.2; ps -eo pid,sid,comm | grep -c sleep",
        ],
    );
    let node = TestNode::start(&[("escapee", &escapee)]).await;
    let (run, results) = run_execs(&node, "escapee").await;
    assert!(
        results[0].contains(r#""stdout":"2\n""#),
        "both ran: {}",
        results[0]
    );
    let step = node.tree(run).find("escapee").unwrap();
    for pid in processes_in(&node.workdir(run, step)) {
        assert!(
            process_exits_within(pid, Duration::from_secs(2)).await,
            "{pid} outlived its command"
        );
    }
    let left = std::process::Command::new("pgrep")
        .args(["-f", "sleep 31[01]"])
        .output()
        .unwrap();
    assert!(left.stdout.is_empty(), "left running: {:?}", left);
}

#[tokio::test]
async fn inv_27_a_secret_reaches_the_sandbox_and_nothing_else() {
    let secrets = tempfile::tempdir().unwrap();
    let value = "tok-9f8e7d6c5b4a";
    let config = secrets_file(
        secrets.path(),
        &format!("# the node's secrets\nAPI_TOKEN={value}\n"),
        0o600,
    );
    let leaker = agent_md(
        "tools: [exec, read_file]\nsecrets: [API_TOKEN]\nscript:\n\
         - call: {tool: exec, args: {command: \"echo $API_TOKEN; echo $API_TOKEN >&2; echo $API_TOKEN > leak.txt; env | grep -c API_TOKEN=\"}}\n\
         - call: {tool: read_file, args: {path: leak.txt}}\n\
         - call: {tool: submit_output, args: {output: done}}",
    );
    let models = RecordingModels::new();
    let node = TestNode::start_full(Some(&config), &[("leaker", &leaker)], models.clone()).await;
    let run = node.run_agent("leaker", "go").await;
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);

    // It was there: in the environment and in the file it wrote.
    let calls = node.tool_calls(run);
    let exec: serde_json::Value = serde_json::from_str(&calls[0].detail).unwrap();
    assert_eq!(exec["stdout"], "[secret API_TOKEN]\n1\n", "{exec}");
    assert_eq!(exec["stderr"], "[secret API_TOKEN]\n");
    let step = tree.find("leaker").unwrap();
    let leak = std::fs::read_to_string(node.workdir(run, step).join("leak.txt")).unwrap();
    assert_eq!(leak.trim(), value, "the sandbox's own file holds it");
    assert!(
        calls[1].detail.contains("[secret API_TOKEN]"),
        "{}",
        calls[1].detail
    );

    // And nowhere else: the model's context, the events, the journal's bytes on disk.
    let context = format!("{:?}", models.requests("leaker"));
    assert!(
        context.contains("[secret API_TOKEN]"),
        "the model saw the redacted result"
    );
    assert!(!context.contains(value), "the model saw the value");
    let events = serde_json::to_string(&node.events(run)).unwrap();
    assert!(!events.contains(value), "an event holds the value");
    // The journal's bytes on disk, every file of it.
    let dir = node.crash().await;
    let mut stack = vec![dir.path().to_path_buf()];
    let mut files = 0;
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if !path.starts_with(dir.path().join("data").join("work")) {
                files += 1;
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    !bytes.windows(value.len()).any(|w| w == value.as_bytes()),
                    "{} holds the value",
                    path.display()
                );
            }
        }
    }
    assert!(files > 0, "the journal was scanned");
}

#[tokio::test]
async fn inv_27_a_missing_secret_refuses_the_run_and_a_loose_secrets_file_the_node() {
    let needs = agent_md("tools: [exec]\nsecrets: [ARBOR_TEST_NEVER_SET]\nscript:\n  - say: hi");
    let node = TestNode::start(&[("needs", &needs)]).await;
    let spec = node.workspace.agent_run("needs", "go", None).unwrap();
    let err = node.node().start_run(spec).await.unwrap_err().to_string();
    assert!(
        err.contains("agents/needs/agent.md") && err.contains("ARBOR_TEST_NEVER_SET"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let config = secrets_file(dir.path(), "ARBOR_TEST_NEVER_SET=shown-nowhere\n", 0o644);
    let ws = arbor_runtime::Workspace::from_texts(
        dir.path().to_path_buf(),
        Some(&config),
        &[("needs", &needs)],
        &[],
    )
    .unwrap();
    let Err(err) = arbor_runtime::EmbeddedNode::start(&ws, &dir.path().join("data")).await else {
        panic!("a node started on a secrets file others can read");
    };
    let err = err.to_string();
    assert!(
        err.contains("secrets.env") && err.contains("644") && !err.contains("shown-nowhere"),
        "{err}"
    );
    assert!(
        !dir.path().join("data").join("journal").exists(),
        "nothing was made"
    );
}

#[tokio::test]
async fn inv_25_a_grandchild_cannot_use_what_its_grandparent_was_denied() {
    let boss = agent_md(
        "tools: [exec]\ndeny: [exec]\nsubagents: [mid]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: mid, request: go, label: mid}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let mid = agent_md(
        "description: mid\ntools: [exec]\nsubagents: [leaf, own]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go, label: leaf}, {agent: own, request: go, label: own}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let grandchild = |sandbox: &str| {
        agent_md(&format!(
            "description: leaf\ntools: [exec]\n{sandbox}\nscript:\n  - call: {{tool: exec, args: {{command: \"echo RAN > ran.txt\"}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
        ))
    };
    let node = TestNode::start(&[
        ("boss", &boss),
        ("mid", &mid),
        ("leaf", &grandchild("")),
        ("own", &grandchild("sandbox: own")),
    ])
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    for label in ["leaf", "own"] {
        let id = tree.find(label).unwrap();
        let calls: Vec<_> = node
            .tool_calls(run)
            .into_iter()
            .filter(|c| c.job == id && c.tool == "exec")
            .collect();
        assert_eq!(calls.len(), 1, "{label}: {calls:?}");
        assert!(!calls[0].ok, "{label} ran exec: {calls:?}");
        assert!(calls[0].detail.contains("denied"), "{label}: {calls:?}");
        assert!(!node.workdir(run, id).join("ran.txt").exists(), "{label}");
    }
}

#[tokio::test]
async fn inv_26_an_own_sandbox_keeps_its_network_and_secrets_a_shared_one_is_cut_to_its_parents() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let secrets = tempfile::tempdir().unwrap();
    let config = secrets_file(secrets.path(), "CHILD_KEY=child-key-0451\n", 0o600);
    let boss = agent_md(
        "tools: [exec]\nsubagents: [own, shared]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: own, request: go, label: own}, {agent: shared, request: go, label: shared}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let child = |sandbox: &str| {
        exec_agent(
            &format!("description: a child\nnetwork: open\nsecrets: [CHILD_KEY]\n{sandbox}"),
            &[&format!(
                "echo key=${{CHILD_KEY:-none}}; {}",
                connect_to(port)
            )],
        )
    };
    let node = TestNode::start_with_config(
        &config,
        &[
            ("boss", &boss),
            ("own", &child("sandbox: own")),
            ("shared", &child("")),
        ],
    )
    .await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let result = |label: &str| {
        let id = tree.find(label).unwrap();
        node.tool_calls(run)
            .into_iter()
            .find(|c| c.job == id && c.tool == "exec")
            .unwrap_or_else(|| panic!("{label} ran no command"))
            .detail
    };
    let own = result("own");
    assert!(
        own.contains("key=[secret CHILD_KEY]") && own.contains("CONNECTED"),
        "{own}"
    );
    let shared = result("shared");
    assert!(
        shared.contains("key=none") && shared.contains("REFUSED"),
        "{shared}"
    );
    assert!(
        listener.accept().is_ok(),
        "the own sandbox's connection arrived"
    );
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "and only that one"
    );
}

/// A sealed command's root folder (its mount points, and the passwd and
/// group files of its `/etc`) is removed when it ends; what a crash leaves
/// is swept when the node starts again.
#[tokio::test]
async fn root_folders_go_when_their_commands_end_and_a_restart_sweeps_the_rest() {
    let solo = exec_agent("", &["true", "echo done"]);
    let node = TestNode::start(&[("solo", &solo)]).await;
    let roots = node.data_dir().join("roots");
    let (_, results) = run_execs(&node, "solo").await;
    assert_eq!(results.len(), 2);
    let left: Vec<_> = std::fs::read_dir(&roots).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // What a SIGKILLed node leaves.
    std::fs::create_dir_all(roots.join("stale/etc")).unwrap();
    std::fs::write(roots.join("stale/etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
    let node = node.crash_and_restart().await;
    assert!(!roots.join("stale").exists(), "a restart sweeps the roots");
    drop(node);
}

/// A node whose agents can run a command probes the kernel at start and
/// says how it seals; one whose agents cannot (no `exec`, no MCP server)
/// has nothing to seal and says it did not probe. Either way the posture
/// is sealed, and the second node's run completes.
#[tokio::test]
async fn a_node_probes_its_sandbox_only_when_an_agent_can_run_a_command() {
    let thinker = agent_md("script:\n  - call: {tool: submit_output, args: {output: done}}");
    let runner = agent_md("tools: [exec]\nscript:\n  - say: hi");

    let probing = TestNode::start(&[("thinker", &thinker), ("runner", &runner)]).await;
    let posture = probing.node().sandbox();
    assert!(posture.sealed, "{}", posture.detail);
    assert!(posture.detail.contains("namespaces"), "{}", posture.detail);

    let idle = TestNode::start(&[("thinker", &thinker)]).await;
    let posture = idle.node().sandbox();
    assert!(posture.sealed);
    assert_eq!(
        posture.detail,
        "sealed, not probed: no agent of this workspace runs commands or MCP servers"
    );
    let spec = idle.workspace.agent_run("thinker", "go", None).unwrap();
    let run = idle.node().start_run(spec).await.unwrap();
    assert_eq!(idle.wait_run(run).await.run_status(), Status::Done);
}
