//! Sandbox rlimits on real processes: what `resources:` and `[sandbox]`
//! say is what every command of the job runs under, and a command that
//! goes past a limit fails; the job, the node and the host go on.

use arbor_testkit::{TestNode, agent_md, exec_script};

/// Runs one agent whose commands are `commands`, and returns each exec's
/// tool result detail, in order.
async fn execs(arbor_toml: &str, resources: &str, commands: &[&str]) -> Vec<(bool, String)> {
    let script = exec_script(commands);
    let solo = agent_md(&format!("tools: [exec]\n{resources}\nscript:\n{script}"));
    let node = TestNode::start_with_config(arbor_toml, &[("solo", &solo)]).await;
    let run = node.run_agent("solo", "go").await;
    node.wait_run(run).await;
    node.tool_calls(run)
        .into_iter()
        .filter(|c| c.tool == "exec")
        .map(|c| (c.ok, c.detail))
        .collect()
}

/// The stdout of an exec's result.
fn stdout(detail: &str) -> String {
    serde_json::from_str::<serde_json::Value>(detail)
        .ok()
        .and_then(|v| v["stdout"].as_str().map(str::to_string))
        .unwrap_or_else(|| detail.to_string())
}

#[tokio::test]
async fn every_command_runs_under_the_agents_limits_within_the_nodes() {
    // Soft/hard of each limit, as the kernel has them for the command.
    let show = "for r in 'address space' 'cpu time' 'Max file size' 'open files' 'Max processes'; do grep \"$r\" /proc/self/limits | awk '{printf \"%s/%s \", $(NF-2), $(NF-1)}'; done";
    let results = execs(
        "[sandbox]\nprocesses = 400\n",
        "resources: {memory: 256MiB, cpu: 20s, file_size: 1MiB, open_files: 64}",
        &[show],
    )
    .await;
    let (ok, detail) = &results[0];
    assert!(ok, "{detail}");
    assert_eq!(
        stdout(detail).trim(),
        "268435456/268435456 20/20 1048576/1048576 64/64 400/400"
    );
}

#[tokio::test]
async fn a_memory_hog_and_an_oversized_file_fail_and_the_job_goes_on() {
    let results = execs(
        "",
        "resources: {memory: 128MiB, file_size: 1MiB}",
        &[
            // One 512 MiB buffer: refused by the address-space limit.
            "dd if=/dev/zero of=/dev/null bs=512M count=1",
            // 4 MiB into a file: cut at 1 MiB (SIGXFSZ).
            "head -c 4194304 /dev/zero > big.bin; echo status $?; wc -c < big.bin",
            // The limits cannot be raised from inside.
            "ulimit -f unlimited && echo raised || echo refused",
        ],
    )
    .await;
    assert_eq!(results.len(), 3, "{results:#?}");
    let hog = &results[0].1;
    assert!(
        !hog.contains("1+0 records out"),
        "the hog got its memory: {hog}"
    );
    let file = &results[1].1;
    assert!(file.contains("1048576"), "{file}");
    assert!(!file.contains("status 0"), "{file}");
    assert!(results[2].1.contains("refused"), "{}", results[2].1);
}
