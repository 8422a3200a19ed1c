//! `arbor replay` and `arbor export` from the outside: a recorded run
//! replayed from its journal and from its export, the export's contract,
//! and every bad input refused with exit 2 before anything runs.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{arbor, repo};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A copy of examples/research, so its data dir is the test's own.
fn research() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("research");
    copy(&repo().join("examples/research"), &ws);
    (dir, ws)
}

fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == ".arbor" {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            copy(&entry.path(), &to.join(&name));
        } else {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

/// Runs the workspace (recorded, or not) and returns the run's id.
fn run(ws: &Path, record: bool) -> String {
    let mut args = vec!["run", ws.to_str().unwrap(), "--json"];
    if record {
        args.push("--record");
    }
    let out = arbor(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["run"]["id"].as_str().unwrap().to_string()
}

fn runs_in(ws: &Path) -> usize {
    let out = arbor(&[
        "journal",
        "inspect",
        "--json",
        "--data-dir",
        ws.join(".arbor").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["runs"].as_array().map_or(0, Vec::len)
}

#[test]
fn a_recorded_run_replays_from_its_journal_and_from_its_export_to_the_same_document() {
    let (dir, ws) = research();
    let recorded = run(&ws, true);
    let ws_arg = ws.to_str().unwrap();

    let out = arbor(&["replay", &recorded, "--workspace", ws_arg, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the replay equals its recording"),
        "{}",
        stderr(&out)
    );
    let replayed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(replayed["run"]["id"], recorded.as_str());
    assert_eq!(replayed["run"]["status"], "done");

    let file = dir.path().join("research.recording.json");
    let data = ws.join(".arbor");
    let out = arbor(&[
        "export",
        &recorded,
        "-o",
        file.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let export: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let schema =
        std::fs::read_to_string(repo().join("docs/contract/recording.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&serde_json::from_str(&schema).unwrap()).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&export)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "the export fails its schema: {errors:?}");
    assert_eq!(export["format"], "arbor-recording");
    assert_eq!(export["version"], 1);

    // Against a clean copy of the workspace: the export alone carries it.
    let (_other, clean) = research();
    let out = arbor(&[
        "replay",
        "--fixture",
        file.to_str().unwrap(),
        clean.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let from_export: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(from_export["run"]["account"], replayed["run"]["account"]);
    assert_eq!(from_export["run"]["output"], replayed["run"]["output"]);
    assert!(
        !clean.join(".arbor").exists(),
        "a fixture replays on a temporary data dir"
    );

    // The recording as the scripted model's answers: an offline example.
    let offline = dir.path().join("offline");
    let as_script = [
        "export",
        recorded.as_str(),
        "--as-script",
        offline.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
    ];
    let out = arbor(&as_script);
    assert!(out.status.success(), "{}", stderr(&out));
    let planner = std::fs::read_to_string(offline.join("agents/planner/agent.md")).unwrap();
    assert!(planner.contains("usage:"), "{planner}");
    let out = arbor(&["run", offline.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let example: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(example["run"]["output"], replayed["run"]["output"]);
    let out = arbor(&as_script);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a folder that exists is refused"
    );
    assert!(stderr(&out).contains("exists already"), "{}", stderr(&out));
}

#[test]
fn each_bad_input_is_refused_with_exit_2_naming_what_is_wrong_and_nothing_runs() {
    let (dir, ws) = research();
    let ws_arg = ws.to_str().unwrap().to_string();
    let plain = run(&ws, false);
    let recorded = run(&ws, true);
    let before = runs_in(&ws);
    let refused = |args: &[&str], says: &str| {
        let out = arbor(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert_eq!(out.stdout, b"", "{args:?}");
    };

    refused(
        &["replay", &plain, "--workspace", &ws_arg],
        &format!("run {plain} was not recorded"),
    );
    refused(
        &["replay", "not-an-id", "--workspace", &ws_arg],
        "is not a run id",
    );
    let nobody = "01a2444b-6ad4-775d-9233-c492bb23b48b";
    refused(
        &["replay", nobody, "--workspace", &ws_arg],
        &format!("no run {nobody} in this journal"),
    );

    let file = dir.path().join("rec.json");
    let data = ws.join(".arbor");
    let out = arbor(&[
        "export",
        &recorded,
        "-o",
        file.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&file).unwrap();
    let variant = |name: &str, content: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path.to_str().unwrap().to_string()
    };

    let truncated = variant("truncated.json", &text[..text.len() / 2]);
    refused(
        &["replay", "--fixture", &truncated, &ws_arg],
        "not a whole JSON document (truncated?)",
    );
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["tree"]["children"][0]["account"]["spent"] = serde_json::json!(1);
    let tampered = variant("tampered.json", &doc.to_string());
    refused(
        &["replay", "--fixture", &tampered, &ws_arg],
        "its digest does not match its content",
    );
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["version"] = serde_json::json!(2);
    let newer = variant("newer.json", &doc.to_string());
    refused(
        &["replay", "--fixture", &newer, &ws_arg],
        "its version is 2, newer than this arbor reads (1)",
    );
    let file_arg = file.to_str().unwrap();
    let elsewhere = repo().join("tests/fakellm/anthropic");
    refused(
        &["replay", "--fixture", file_arg, elsewhere.to_str().unwrap()],
        "was recorded in another workspace: its flow \"research\" is not in this one",
    );

    // The workspace without the crawler (and without naming it).
    let planner = ws.join("agents/planner/agent.md");
    let text = std::fs::read_to_string(&planner).unwrap();
    std::fs::write(&planner, text.replace(", crawler, writer]", ", writer]")).unwrap();
    std::fs::remove_dir_all(ws.join("agents/crawler")).unwrap();
    refused(
        &["replay", &recorded, "--workspace", &ws_arg],
        "this workspace has no agent \"crawler\", which the recording's job planner#1/crawler#1 was",
    );
    refused(
        &["replay", "--fixture", file_arg, &ws_arg],
        "this workspace has no agent \"crawler\"",
    );
    assert_eq!(runs_in(&ws), before, "nothing ran");
}

/// A gatherer and its two workers complete; the writer fails.
fn failing_report(dir: &Path) -> PathBuf {
    let ws = dir.join("report");
    let write = |path: &str, text: &str| {
        let path = ws.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write(
        "agents/gather/agent.md",
        "---\nsubagents: [worker]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: a}, {agent: worker, request: b}]}}\n  - call: {tool: submit_output, args: {output: gathered}}\n---\nGather.\n",
    );
    write(
        "agents/worker/agent.md",
        "---\ndescription: one part\nscript:\n  - call: {tool: submit_output, args: {output: part}}\n---\nWork.\n",
    );
    write(
        "agents/writer/agent.md",
        "---\nscript:\n  - call: {tool: submit_output, args: {output: \"no report\", task_status: failed}}\n---\nWrite.\n",
    );
    write(
        "flows/report.toml",
        "[[group]]\nsteps = [{ agent = \"gather\", instruction = \"gather\" }]\n\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\" }]\n",
    );
    ws
}

#[test]
fn rerun_failed_plans_first_refuses_a_changed_definition_then_reruns_only_the_failed_part() {
    let dir = tempfile::tempdir().unwrap();
    let ws = failing_report(dir.path());
    let ws_arg = ws.to_str().unwrap();
    let out = arbor(&["run", ws_arg, "--record", "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let failed = doc["run"]["id"].as_str().unwrap().to_string();
    let writer_grant = doc["run"]["children"][1]["account"]["grant"]
        .as_u64()
        .unwrap();

    let out = arbor(&[
        "replay",
        &failed,
        "--workspace",
        ws_arg,
        "--rerun-failed",
        "--dry-run",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let jobs: Vec<(String, bool)> = plan["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["lineage"].as_str().unwrap().to_string(),
                j["reuse"].as_bool().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(String, bool)> = [
        ("gather#1", true),
        ("gather#1/worker-1#1", true),
        ("gather#1/worker-2#1", true),
        ("writer#1", false),
    ]
    .iter()
    .map(|(l, r)| (l.to_string(), *r))
    .collect();
    assert_eq!(jobs, expected);
    assert_eq!(plan["worst_case_tokens"], writer_grant);
    assert_eq!(runs_in(&ws), 1, "a dry run runs nothing");

    // The writer fixed: refused until the change is allowed, and named.
    let writer = ws.join("agents/writer/agent.md");
    let text = std::fs::read_to_string(&writer).unwrap();
    std::fs::write(
        &writer,
        text.replace("\"no report\", task_status: failed", "the report"),
    )
    .unwrap();
    let out = arbor(&["replay", &failed, "--workspace", ws_arg, "--rerun-failed"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("definitions changed since run")
            && stderr(&out).contains("agents/writer/agent.md; give --allow-changed"),
        "{}",
        stderr(&out)
    );
    assert_eq!(runs_in(&ws), 1, "nothing ran");
    let out = arbor(&[
        "replay",
        &failed,
        "--workspace",
        ws_arg,
        "--rerun-failed",
        "--allow-changed",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("3 steps and jobs reused from the recording, 1 run again"),
        "{}",
        stderr(&out)
    );
    let rerun: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rerun["run"]["status"], "done");
    assert_eq!(rerun["run"]["output"], "the report");
}
