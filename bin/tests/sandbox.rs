//! `arbor run` and its sandboxes from outside, as a user meets them: the
//! posture on stderr and in the run document, and a secret that reaches its
//! command but no output of arbor's, trace logs included (I-27).

use std::path::Path;

const VALUE: &str = "planted-secret-51c0ffee";

fn workspace(dir: &Path, arbor_toml: &str) {
    std::fs::write(dir.join("arbor.toml"), arbor_toml).unwrap();
    std::fs::create_dir_all(dir.join("agents/keeper")).unwrap();
    std::fs::write(
        dir.join("agents/keeper/agent.md"),
        "---\ntools: [exec]\nsecrets: [DEMO_TOKEN]\nscript:\n  \
         - call: {tool: exec, args: {command: \"echo $DEMO_TOKEN; echo $DEMO_TOKEN > token.txt\"}}\n  \
         - call: {tool: submit_output, args: {output: kept}}\n---\nYou keep a token.\n",
    )
    .unwrap();
}

async fn arbor(dir: &Path, data: &Path) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args([
            "run",
            dir.to_str().unwrap(),
            "--agent",
            "keeper",
            "--input",
            "go",
        ])
        .args(["--json", "--data-dir", data.to_str().unwrap()])
        .env("ARBOR_LOG", "trace")
        .env("DEMO_TOKEN", VALUE)
        .output()
        .await
        .expect("arbor runs")
}

#[tokio::test]
async fn inv_27_a_secret_reaches_its_command_and_no_output_of_arbors() {
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    workspace(ws.path(), "");
    let out = arbor(ws.path(), data.path()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("arbor: sandbox sealed"), "{stderr}");
    // hakoniwa logs each variable it is given at debug: the secret is not among them.
    assert!(stderr.contains("Env: PATH="), "{stderr}");
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !String::from_utf8_lossy(bytes).contains(VALUE),
            "{name} holds the value"
        );
    }
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["run"]["status"], "done");
    assert_eq!(doc["sandbox"]["sealed"], true);
    // It did reach the command: the file its command wrote holds it.
    let run = doc["run"]["id"].as_str().unwrap();
    let written = data
        .path()
        .join("work")
        .join(run)
        .join("keeper")
        .join("token.txt");
    assert_eq!(std::fs::read_to_string(written).unwrap().trim(), VALUE);
}

#[tokio::test]
async fn mode_none_runs_unsealed_and_says_so_on_every_run() {
    let ws = tempfile::tempdir().unwrap();
    workspace(ws.path(), "[sandbox]\nmode = \"none\"\n");
    for _ in 0..2 {
        let data = tempfile::tempdir().unwrap();
        let out = arbor(ws.path(), data.path()).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains("arbor: WARNING: sandbox UNSEALED"),
            "{stderr}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["sandbox"]["mode"], "none");
        assert_eq!(doc["sandbox"]["sealed"], false);
    }
}

#[tokio::test]
async fn an_unknown_sandbox_mode_is_refused_before_anything_runs() {
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    workspace(ws.path(), "[sandbox]\nmode = \"chroot\"\n");
    let out = arbor(ws.path(), data.path()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("arbor.toml") && stderr.contains("chroot"),
        "{stderr}"
    );
    assert!(!data.path().join("journal").exists(), "nothing was made");
}

#[tokio::test]
async fn inv_17_no_sandbox_process_outlives_a_killed_arbor() {
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("agents/stayer")).unwrap();
    std::fs::write(
        ws.path().join("agents/stayer/agent.md"),
        "---\ntools: [exec]\nscript:\n  \
         - call: {tool: exec, args: {command: \"sleep 320 & setsid sleep 321 & (sleep 322 &); exec sleep 323\"}}\n\
         ---\nYou stay.\n",
    )
    .unwrap();
    let mut arbor = tokio::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args([
            "run",
            ws.path().to_str().unwrap(),
            "--agent",
            "stayer",
            "--input",
            "go",
        ])
        .args(["--data-dir", data.path().to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let work = data.path().join("work");
    // Until the workdir exists, no process is found in it.
    let running = arbor_testkit::wait_processes_in(&work, 4).await;
    arbor.start_kill().unwrap();
    arbor.wait().await.unwrap();
    for pid in running {
        assert!(
            arbor_testkit::process_exits_within(pid, std::time::Duration::from_secs(2)).await,
            "process {pid} outlived a killed arbor"
        );
    }
}

/// `arbor run DIR` with DIR relative, as the README runs its example: the
/// data dir is relative too, and a sealed command still runs in its workdir.
#[tokio::test]
async fn a_relative_workspace_runs_its_commands_sealed() {
    let top = tempfile::tempdir().unwrap();
    let ws = top.path().join("ws");
    std::fs::create_dir_all(ws.join("agents/writer")).unwrap();
    std::fs::write(
        ws.join("agents/writer/agent.md"),
        "---\ntools: [exec]\nscript:\n  \
         - call: {tool: exec, args: {command: \"echo hi > out.txt\"}}\n  \
         - call: {tool: submit_output, args: {output: written}}\n---\nYou write.\n",
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["run", "ws", "--agent", "writer", "--input", "go", "--json"])
        .current_dir(top.path())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let step = &doc["run"]["children"][0];
    assert_eq!(step["artifacts"], serde_json::json!(["out.txt"]), "{doc}");
    let workdir = top.path().join(step["workdir"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(workdir.join("out.txt")).unwrap(),
        "hi\n"
    );
}
