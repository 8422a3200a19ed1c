//! `arbor run` on a real provider (the harness's mock, on loopback): the
//! key reaches the provider's header and no output of arbor's, and an unset
//! key variable refuses the run before anything is sent.

use arbor_testkit::mock_provider::{Format, MockProvider, openai};
use serde_json::json;
use std::path::Path;

/// A key no output may contain.
const PLANTED: &str = "sk-planted-7f3a9c1e5b2d4068";
const KEY_VAR: &str = "ARBOR_TEST_PLANTED_KEY";

fn workspace(dir: &Path, mock: &MockProvider) {
    let toml = mock
        .arbor_toml(Format::Openai, &format!("api_key_env = \"{KEY_VAR}\""))
        .replace(
            "id = \"mock-small\"",
            "id = \"mock-small\"\nusd_per_mtok_input = 0.15\nusd_per_mtok_output = 0.6",
        );
    std::fs::write(dir.join("arbor.toml"), toml).unwrap();
    for (name, front) in [
        ("planner", "model: mock/small\nsubagents: [researcher]"),
        ("researcher", "model: mock/small\ndescription: finds facts"),
    ] {
        std::fs::create_dir_all(dir.join("agents").join(name)).unwrap();
        std::fs::write(
            dir.join("agents").join(name).join("agent.md"),
            format!("---\n{front}\n---\nYou are the {name}.\n"),
        )
        .unwrap();
    }
}

/// `arbor run DIR --agent planner --input Report. --json --data-dir DATA`
/// plus `extra`, with trace logs on and the key variable set to `key` (or unset).
async fn arbor(dir: &Path, data: &Path, key: Option<&str>, extra: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_arbor"));
    command
        .args([
            "run",
            dir.to_str().unwrap(),
            "--agent",
            "planner",
            "--input",
            "Report.",
        ])
        .args(["--json", "--data-dir", data.to_str().unwrap()])
        .args(extra)
        .env("ARBOR_LOG", "trace")
        .env_remove(KEY_VAR);
    if let Some(key) = key {
        command.env(KEY_VAR, key);
    }
    command.output().await.expect("arbor runs")
}

fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap().flatten() {
                stack.push(entry.path());
            }
        } else if let Ok(bytes) = std::fs::read(&path)
            && bytes.windows(needle.len()).any(|w| w == needle)
        {
            found.push(path.display().to_string());
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn the_key_reaches_the_header_and_no_output() {
    let mock = MockProvider::start().await;
    let delegate = (
        "delegate",
        json!({"jobs": [{"agent": "researcher", "request": "Find one."}]}),
    );
    mock.push_for(
        Format::Openai,
        "You are the planner.",
        openai::stream("", &[delegate], Some((120, 30))),
    );
    mock.push_for(
        Format::Openai,
        "You are the researcher.",
        openai::stream("Tide pools hold anemones.", &[], Some((80, 12))),
    );
    mock.push_for(
        Format::Openai,
        "You are the planner.",
        openai::stream(
            "",
            &[("submit_output", json!({"output": "Report."}))],
            Some((300, 9)),
        ),
    );
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    workspace(ws.path(), &mock);
    let out = arbor(ws.path(), data.path(), Some(PLANTED), &[]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["run"]["output"], "Report.");
    assert!(
        stderr.contains("job started"),
        "trace logs were on: {stderr}"
    );
    for request in mock.received() {
        assert_eq!(
            request.headers["authorization"],
            format!("Bearer {PLANTED}")
        );
    }
    assert!(!stdout.contains(PLANTED), "the key is in --json");
    assert!(!stderr.contains(PLANTED), "the key is in the logs");
    assert_eq!(
        files_containing(data.path(), PLANTED.as_bytes()),
        Vec::<String>::new(),
        "the key is in the data dir"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unset_key_variable_refuses_the_run_naming_the_variable() {
    let mock = MockProvider::start().await;
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    workspace(ws.path(), &mock);
    let out = arbor(ws.path(), data.path(), None, &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the environment variable {KEY_VAR} (api_key_env) is not set"
        )),
        "{stderr}"
    );
    assert!(mock.received().is_empty(), "nothing was sent");
}

#[tokio::test(flavor = "multi_thread")]
async fn budget_usd_puts_micro_dollars_in_the_run_document_and_it_is_valid() {
    let mock = MockProvider::start().await;
    mock.push_for(
        Format::Openai,
        "You are the planner.",
        openai::tool_calls(
            &[("submit_output", json!({"output": "Report."}))],
            1_000,
            100,
        ),
    );
    let ws = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    workspace(ws.path(), &mock);
    std::fs::write(
        ws.path().join("arbor.toml"),
        std::fs::read_to_string(ws.path().join("arbor.toml"))
            .unwrap()
            .replace("api_key_env", "stream = false\napi_key_env"),
    )
    .unwrap();
    let out = arbor(
        ws.path(),
        data.path(),
        Some(PLANTED),
        &["--budget-usd", "0.50"],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // $0.15 and $0.60 per million tokens: 1,000 in and 100 out is 150 + 60.
    assert_eq!(
        doc["run"]["usd"],
        json!({"grant": 500_000, "spent": 210, "held": 0})
    );
    assert_eq!(doc["run"]["children"][0]["usd"]["spent"], 210);
    let schema_text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/contract/run-output.schema.json"),
    )
    .unwrap();
    let schema = jsonschema::validator_for(&serde_json::from_str(&schema_text).unwrap()).unwrap();
    let errors: Vec<String> = schema.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");

    for bad in ["0", "-1", "abc", "nan"] {
        let flag = format!("--budget-usd={bad}");
        let out = arbor(ws.path(), data.path(), Some(PLANTED), &[flag.as_str()]).await;
        assert_eq!(out.status.code(), Some(2), "--budget-usd {bad}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--budget-usd"),
            "--budget-usd {bad}"
        );
    }
}
