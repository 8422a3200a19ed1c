//! `arbor run` from the outside: the README's command, its JSON contract, its
//! exit codes and its errors on bad input.

use std::process::{Command, Output};

mod common;
use common::{arbor, repo};

fn schema(name: &str) -> jsonschema::Validator {
    let text = std::fs::read_to_string(repo().join("docs/contract").join(name)).unwrap();
    jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
}

fn example_json(extra: &[&str]) -> (Output, serde_json::Value) {
    let data = tempfile::tempdir().unwrap();
    let example = repo().join("examples/research");
    let mut args = vec![
        "run",
        example.to_str().unwrap(),
        "--json",
        "--data-dir",
        data.path().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = arbor(&args);
    let doc = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is one JSON document ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out, doc)
}

/// Checks every node: grant = spent + held + available (available >= 0),
/// and spent covers the settled children's spent.
fn check_numbers(node: &serde_json::Value) {
    let acct = &node["account"];
    let (grant, spent, held) = (
        acct["grant"].as_u64().unwrap(),
        acct["spent"].as_u64().unwrap(),
        acct["held"].as_u64().unwrap(),
    );
    assert!(
        spent + held <= grant,
        "{}: spent {spent} + held {held} > grant {grant}",
        node["id"]
    );
    let children_spent: u64 = node["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["account"]["spent"].as_u64().unwrap())
        .sum();
    assert!(
        spent >= children_spent,
        "{}: spent {spent} < children's {children_spent}",
        node["id"]
    );
    if node["kind"] == "run" {
        assert_eq!(spent, children_spent, "a run spends only through its steps");
    }
    for child in node["children"].as_array().unwrap() {
        check_numbers(child);
    }
}

fn find<'a>(node: &'a serde_json::Value, label: &str) -> Option<&'a serde_json::Value> {
    if node["label"] == label {
        return Some(node);
    }
    node["children"]
        .as_array()?
        .iter()
        .find_map(|c| find(c, label))
}

#[test]
fn the_example_prints_one_valid_document_whose_numbers_add_up() {
    let (out, doc) = example_json(&[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let validator = schema("run-output.schema.json");
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let run = &doc["run"];
    assert_eq!(
        (run["kind"].as_str(), run["status"].as_str()),
        (Some("run"), Some("done"))
    );
    check_numbers(run);
    // The story the example tells.
    let status = |label: &str| {
        let n = find(run, label).unwrap_or_else(|| panic!("no {label}"));
        (
            n["status"].as_str().unwrap().to_string(),
            n["task_status"].as_str().map(String::from),
        )
    };
    assert_eq!(
        status("deep"),
        ("done".into(), Some("partial".into())),
        "reached its own ceiling"
    );
    assert_eq!(status("crawler").0, "stopped");
    assert_eq!(status("writer"), ("done".into(), Some("completed".into())));
    assert_eq!(
        find(run, "numbers").unwrap()["artifacts"],
        serde_json::json!(["shares.csv"])
    );
    assert_eq!(
        find(run, "writer").unwrap()["artifacts"],
        serde_json::json!(["report.md"])
    );
    assert!(find(run, "crawler").unwrap()["output"].is_null());
}

#[test]
fn a_failed_run_exits_1_and_still_prints_its_tree() {
    let (out, doc) = example_json(&["--budget-tokens", "100"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(doc["run"]["status"], "failed");
    assert!(schema("run-output.schema.json").is_valid(&doc));
    check_numbers(&doc["run"]);
}

#[test]
fn bad_usage_and_bad_input_exit_2_with_one_line_that_says_why() {
    let example = repo().join("examples/research");
    let example = example.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "/no/such/workspace"], "not a directory"),
        (vec!["run", example, "--flow", "nope"], "no such flow"),
        (
            vec!["run", example, "--budget-tokens", "0"],
            "budget-tokens",
        ),
        (
            vec!["run", example, "--agent", "ghost", "--input", "x"],
            "no such agent",
        ),
        (vec!["run", example, "--agent", "planner"], "--input"),
        (
            vec!["run", example, "--flow", "research", "--input", "x"],
            "takes no input",
        ),
        (vec!["fly"], "unrecognized subcommand"),
    ];
    for (args, says) in cases {
        let out = arbor(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
    }
}

#[test]
fn a_workspace_with_an_unknown_key_is_refused_naming_the_key_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("agents/solo");
    std::fs::create_dir_all(&agent).unwrap();
    std::fs::write(
        agent.join("agent.md"),
        "---\nscript: []\nbudgget: {tokens: 5}\n---\nhi\n",
    )
    .unwrap();
    let out = arbor(&[
        "run",
        dir.path().to_str().unwrap(),
        "--agent",
        "solo",
        "--input",
        "x",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("budgget") && stderr.contains("agents/solo/agent.md"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        !dir.path().join(".arbor").exists(),
        "bad input changes nothing"
    );
}

#[test]
fn without_a_terminal_progress_is_plain_lines() {
    let data = tempfile::tempdir().unwrap();
    let example = repo().join("examples/research");
    let out = arbor(&[
        "run",
        example.to_str().unwrap(),
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains('\x1b'),
        "no escape codes when not a terminal"
    );
    assert!(
        stdout.contains("crawler (crawler) [stopped]") || stdout.contains("crawler [stopped]"),
        "{stdout}"
    );
    assert!(stdout.contains("output:"));
}

#[test]
fn every_example_agent_is_valid_against_the_agent_schema() {
    let validator = schema("agent.schema.json");
    let agents = repo().join("examples/research/agents");
    let mut checked = 0;
    for entry in std::fs::read_dir(agents).unwrap() {
        let path = entry.unwrap().path().join("agent.md");
        let text = std::fs::read_to_string(&path).unwrap();
        let front = text.split("---").nth(1).unwrap();
        let value: serde_json::Value = serde_saphyr::from_str(front).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
        checked += 1;
    }
    assert_eq!(checked, 7);
}

/// examples/peers, offline: the reviewer's message to its sibling is
/// queued while the writer drafts and read at the writer's next turn; the
/// tree shows it on the writer's node.
#[test]
fn the_peers_example_delivers_the_reviewers_message_at_the_writers_next_turn() {
    let data = tempfile::tempdir().unwrap();
    let example = repo().join("examples/peers");
    let out = arbor(&[
        "run",
        example.to_str().unwrap(),
        "--json",
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let steps = doc["run"]["children"].as_array().unwrap();
    let draft = steps.iter().find(|c| c["label"] == "draft").unwrap();
    assert_eq!(draft["status"], "done");
    let messages = draft["peer_messages"].as_array().unwrap();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0]["from"], "review");
    assert!(
        messages[0]["turn"].as_u64().is_some_and(|t| t >= 1),
        "read at a turn after the first: {messages:?}"
    );
}

/// examples/checked, offline: a test-driven loop whose scripted coder gets
/// add.sh wrong on its first iteration and, told what the test printed,
/// right on its second, in the same workdir; then its reviewer accepts.
#[test]
fn the_checked_example_loops_until_its_test_passes_and_is_reviewed() {
    let data = tempfile::tempdir().unwrap();
    let example = repo().join("examples/checked");
    let run = |json: bool| {
        let mut args = vec!["run", example.to_str().unwrap(), "--data-dir"];
        args.push(data.path().to_str().unwrap());
        if json {
            args.push("--json");
        }
        arbor(&args)
    };
    let out = run(true);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let steps = doc["run"]["children"].as_array().unwrap();
    let adds: Vec<_> = steps.iter().filter(|c| c["label"] == "add").collect();
    assert_eq!(adds.len(), 2, "two iterations: {steps:?}");
    let iterations = adds[1]["iterations"].as_array().unwrap();
    let said: Vec<(u64, bool)> = iterations
        .iter()
        .map(|i| {
            (
                i["iteration"].as_u64().unwrap(),
                i["passed"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(said, [(1, false), (2, true)]);
    assert!(
        iterations[0]["issues"][1]
            .as_str()
            .is_some_and(|i| i.contains("printed -1, not 5")),
        "{iterations:?}"
    );
    assert_eq!(adds[0]["workdir"], adds[1]["workdir"]);
    let add = std::path::Path::new(adds[1]["workdir"].as_str().unwrap()).join("add.sh");
    assert!(std::fs::read_to_string(add).unwrap().contains("$1 + $2"));
    assert_eq!(doc["run"]["review"]["accept"], true);
    let out = run(false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("add: iteration 1 did not pass: it printed: sh add.sh 2 3 printed -1, not 5; iteration 2 passed")
            && text.contains("review: accepted"),
        "{text}"
    );
}

/// examples/recovery, offline: its first step fails each of its two
/// attempts (the second after its wait) and its rescuer's answer stands in;
/// its optional step fails and the run ends done but partial, naming it;
/// its writer's model is walled on its usage cap, and the report is
/// written on its fallback, on another supply.
#[test]
fn the_recovery_example_retries_rescues_falls_back_and_ends_partial() {
    let data = tempfile::tempdir().unwrap();
    let example = repo().join("examples/recovery");
    let out = arbor(&[
        "run",
        example.to_str().unwrap(),
        "--json",
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let run = &doc["run"];
    assert_eq!(
        (&run["status"], &run["task_status"]),
        (&"done".into(), &"partial".into())
    );
    assert_eq!(
        run["limitations"][0],
        "optional step scout failed: the answer is empty"
    );
    let prices: Vec<(String, u64, String)> = run["children"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["label"] == "prices")
        .map(|c| {
            (
                c["agent"].as_str().unwrap().to_string(),
                c["attempt"].as_u64().unwrap(),
                c["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        prices,
        [
            ("fetcher".into(), 1, "failed".into()),
            ("fetcher".into(), 2, "failed".into()),
            ("fixer".into(), 3, "done".into()),
        ]
    );
    let writer = run["children"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["agent"] == "writer")
        .unwrap();
    assert_eq!(
        (&writer["status"], &writer["model"]),
        (&"done".into(), &"backup/m".into()),
        "the writer answered on its fallback"
    );
}

/// docs/contract/flow.schema.json is what the flow types generate, and
/// every flow file of the examples and the CI workspaces is valid by it.
#[test]
fn the_flow_schema_is_the_types_and_every_flow_file_is_valid_by_it() {
    let path = repo().join("docs/contract/flow.schema.json");
    let generated =
        serde_json::to_string_pretty(&arbor_protocol::FlowSpec::schema()).unwrap() + "\n";
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/contract/flow.schema.json is not what the types generate; \
         run `BLESS=1 cargo test -p arbor-bin --test cli the_flow_schema` and commit it"
    );
    let validator = schema("flow.schema.json");
    let mut checked = 0;
    for root in ["examples", "tests/fakellm"] {
        for workspace in std::fs::read_dir(repo().join(root)).unwrap() {
            let flows = workspace.unwrap().path().join("flows");
            for flow in std::fs::read_dir(&flows).into_iter().flatten() {
                let path = flow.unwrap().path();
                let text = std::fs::read_to_string(&path).unwrap();
                let value: serde_json::Value = toml::from_str(&text).unwrap();
                let errors: Vec<String> = validator
                    .iter_errors(&value)
                    .map(|e| e.to_string())
                    .collect();
                assert!(errors.is_empty(), "{}: {errors:?}", path.display());
                checked += 1;
            }
        }
    }
    assert!(checked >= 4, "{checked} flow files");
    // And one the loader refuses is refused by the schema too.
    let bad: serde_json::Value = toml::from_str(
        "[[group]]\nsteps = [{ agent = \"a\", instruction = \"x\", retry = { tries = 2 } }]\n",
    )
    .unwrap();
    assert!(!validator.is_valid(&bad));
}

#[test]
fn the_contract_copies_match_the_shared_originals_when_present() {
    let shared = repo().join("../shared/contract");
    if !shared.exists() {
        return; // A clone on its own carries the copies only.
    }
    for name in ["agent.schema.json", "run-output.schema.json"] {
        let ours = std::fs::read(repo().join("docs/contract").join(name)).unwrap();
        let theirs = std::fs::read(shared.join(name)).unwrap();
        assert_eq!(
            ours, theirs,
            "docs/contract/{name} differs from the shared contract"
        );
    }
}

#[test]
fn journal_verify_passes_a_clean_journal_and_catches_one_edited_to_break_conservation() {
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap();
    let example = repo().join("examples/research");
    let out = arbor(&[
        "run",
        example.to_str().unwrap(),
        "--json",
        "--data-dir",
        data_dir,
    ]);
    assert_eq!(out.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    let verify = arbor(&["journal", "verify", "--data-dir", data_dir]);
    let text = String::from_utf8_lossy(&verify.stdout);
    assert_eq!(verify.status.code(), Some(0), "{text}");
    assert!(text.contains(": ok"), "{text}");

    // Edit the journal: charge the writer's account far past its grant.
    let writer: arbor_protocol::JobId = find(&doc["run"], "writer").unwrap()["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    {
        let journal = arbor_storage::Journal::open(&data.path().join("journal")).unwrap();
        let epoch = journal.epoch();
        journal
            .append(vec![arbor_storage::Record::Ledger(
                arbor_storage::LedgerRecord {
                    owner: arbor_protocol::ParentRef::Job(writer),
                    unit: arbor_storage::Unit::Tokens,
                    op: arbor_storage::LedgerOp::CallSettle {
                        reserved: 0,
                        spent: 1_000_000_000,
                    },
                    epoch,
                },
            )])
            .unwrap();
    }
    let verify = arbor(&["journal", "verify", "--data-dir", data_dir]);
    let text = String::from_utf8_lossy(&verify.stdout);
    assert_eq!(verify.status.code(), Some(1), "{text}");
    assert!(
        text.contains("breach") && text.contains(&writer.to_string()),
        "{text}"
    );

    let inspect = arbor(&["journal", "inspect", "--data-dir", data_dir, "--json"]);
    assert_eq!(inspect.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert_eq!(doc["runs"].as_array().unwrap().len(), 1);
}

#[test]
fn arbor_check_is_clean_on_the_examples_and_lists_every_problem_of_a_broken_workspace() {
    for example in ["research", "local-model"] {
        let dir = repo().join("examples").join(example);
        let out = arbor(&["check", dir.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(0), "{example}");
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, front) in [("a", "subagents: [b, zed]"), ("b", "tools: [exec]")] {
        std::fs::create_dir_all(dir.path().join("agents").join(name)).unwrap();
        std::fs::write(
            dir.path().join("agents").join(name).join("agent.md"),
            format!("---\n{front}\n---\nYou work.\n"),
        )
        .unwrap();
    }
    let out = arbor(&["check", dir.path().to_str().unwrap(), "-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "errors exit 1");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["errors"], 2, "{doc}");
    assert_eq!(doc["warnings"], 1, "{doc}");
    assert_eq!(doc["findings"][0]["level"], "error");
    let out = arbor(&["check", "/nonexistent-workspace"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("not a directory"));
}

/// A reader that goes away (`arbor run ... | head -1`) ends arbor's
/// printing, not the process: no panic, the run goes on to its end, its
/// exit status is the run's, and its journal is whole.
#[test]
fn a_reader_that_goes_away_ends_the_printing_not_the_run() {
    use std::io::BufRead;
    let data = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["run"])
        .arg(repo().join("examples/research"))
        .arg("--data-dir")
        .arg(data.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("run "), "{first:?}");
    // The reader is gone: every later write to stdout fails.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let verify = arbor(&[
        "journal",
        "verify",
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert!(verify.status.success(), "{verify:?}");
}

/// The verbs clap gives `arbor` (and its groups' verbs, as `journal verify`),
/// from its own help: what the docs' verb lists are checked against.
fn cli_verbs() -> Vec<String> {
    let commands = |args: &[&str]| -> Vec<String> {
        let out = arbor(&[args, &["--help"]].concat());
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout).to_string();
        help.split("Commands:")
            .nth(1)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .take_while(|line| line.starts_with("  "))
            .filter_map(|line| line.split_whitespace().next())
            .filter(|verb| *verb != "help")
            .map(str::to_string)
            .collect()
    };
    let mut verbs = vec![];
    for verb in commands(&[]) {
        let inner = commands(&[verb.as_str()]);
        if inner.is_empty() {
            verbs.push(verb);
        } else {
            verbs.extend(inner.iter().map(|v| format!("{verb} {v}")));
        }
    }
    verbs
}

/// README, ARCHITECTURE and the operations guide each name every verb of
/// the CLI as clap has it (`arbor VERB`), so a new verb left out of one
/// fails here, naming the file.
#[test]
fn the_docs_name_every_verb_of_the_cli() {
    let verbs = cli_verbs();
    assert!(verbs.len() > 15, "{verbs:?}");
    assert!(verbs.contains(&"node drain".to_string()), "{verbs:?}");
    for doc in ["README.md", "docs/ARCHITECTURE.md", "docs/operations.md"] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        let missing: Vec<&String> = verbs
            .iter()
            .filter(|verb| !text.contains(&format!("arbor {verb}")))
            .collect();
        assert!(missing.is_empty(), "{doc} never names `arbor` {missing:?}");
    }
}

/// `arbor prompt`: the planner's first request body in each wire format,
/// its provider's key set and never shown.
#[test]
fn arbor_prompt_prints_the_first_request_body_of_each_wire_format() {
    // The bodies themselves are pinned by goldens in arbor-tests (with an
    // MCP server, whose path only that crate's tests know); here, the
    // command: each wire's shape, and never the key.
    let ws = repo().join("tests/prompt");
    for (wire, system_at) in [("openai", "/messages/0/content"), ("anthropic", "/system")] {
        let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(["prompt", ws.to_str().unwrap(), "planner"])
            .args([
                "--input",
                "Compare two suppliers.",
                "--wire",
                wire,
                "-o",
                "json",
            ])
            .env("HOSTED_API_KEY", "sk-never-shown-4417")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(!text.contains("sk-never-shown-4417"));
        let body: serde_json::Value = serde_json::from_str(&text).unwrap();
        let system = body.pointer(system_at).and_then(|s| s.as_str());
        assert!(
            system.is_some_and(|s| s.starts_with("You are the planner.")),
            "{wire}: {body:#}"
        );
    }
    // The text form names the roster and each tool; a wrong agent is a usage error.
    let out = arbor(&["prompt", ws.to_str().unwrap(), "planner"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("- `coder`: Writes and runs a small program"),
        "{text}"
    );
    assert!(text.contains("\ndelegate: "), "{text}");
    let out = arbor(&["prompt", ws.to_str().unwrap(), "ghost"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no agent \"ghost\" in this workspace (it has: coder, planner, researcher)")
    );
}

/// The keys of the agent contract arbor does not read yet (their issues
/// are open): `arbor new agent` leaves them out, and a file naming one is
/// refused.
const NOT_READ_YET: &[&str] = &["fallback", "memory", "env", "hooks", "expose"];

/// `arbor new agent` and `arbor new skill`: a file that loads and runs as
/// it is, every key the agent contract has (and arbor reads) commented,
/// and nothing overwritten.
#[test]
fn arbor_new_writes_an_agent_with_every_key_and_a_skill_that_load_as_they_are() {
    let ws = tempfile::tempdir().unwrap();
    let dir = ws.path().to_str().unwrap();
    let out = arbor(&["new", "agent", "helper", "--workspace", dir]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = ws.path().join("agents/helper/agent.md");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        path.display().to_string()
    );
    let text = std::fs::read_to_string(&path).unwrap();

    // Every key of the contract is in it, commented unless it is set.
    let contract: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("docs/contract/agent.schema.json")).unwrap(),
    )
    .unwrap();
    let keys: Vec<&String> = contract["properties"].as_object().unwrap().keys().collect();
    for key in keys {
        let named = text
            .lines()
            .any(|l| l.starts_with(&format!("# {key}:")) || l.starts_with(&format!("{key}:")));
        if NOT_READ_YET.contains(&key.as_str()) {
            assert!(!named, "{key} is not read yet, so not offered");
            let other = tempfile::tempdir().unwrap();
            let agent = other.path().join("agents/a/agent.md");
            std::fs::create_dir_all(agent.parent().unwrap()).unwrap();
            std::fs::write(&agent, format!("---\n{key}: x\n---\nA.\n")).unwrap();
            let out = arbor(&["check", other.path().to_str().unwrap()]);
            assert_eq!(out.status.code(), Some(1), "{key} should be refused today");
        } else {
            assert!(named, "the template lacks `{key}`:\n{text}");
        }
    }

    // It loads, and runs offline on the scripted model as it is.
    let out = arbor(&["check", dir]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let data = tempfile::tempdir().unwrap();
    let out = arbor(&[
        "run",
        dir,
        "--agent",
        "helper",
        "--input",
        "hi",
        "--json",
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A skill, and an agent that names it.
    let out = arbor(&["new", "skill", "deploy", "--workspace", dir]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&path, text.replace("# skills: [SKILL]", "skills: [deploy]")).unwrap();
    let out = arbor(&["prompt", dir, "helper"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("- `deploy`: What deploy is for"), "{shown}");

    // Nothing is overwritten; a bad name is a usage error; both change nothing.
    let before = std::fs::read_to_string(&path).unwrap();
    let out = arbor(&["new", "agent", "helper", "--workspace", dir]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists; nothing was written"));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
    let out = arbor(&["new", "skill", "Bad Name", "--workspace", dir]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!ws.path().join("skills/Bad Name").exists());
}

/// The README's `arbor prompt` line, run as written (its args after
/// `cargo run -q -p arbor-bin --`), from the repository's root.
#[test]
fn the_readmes_arbor_prompt_line_runs_as_written() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let marker = "cargo run -q -p arbor-bin -- prompt ";
    let at = readme
        .find(marker)
        .expect("the README shows `arbor prompt`");
    let line = &readme[at + "cargo run -q -p arbor-bin -- ".len()..];
    let line = &line[..line.find('`').unwrap()];
    let args: Vec<&str> = line.split_whitespace().collect();
    let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(&args)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("## Sub-agents you may delegate to"), "{text}");
    assert!(text.contains("- `researcher`: "), "{text}");
}

/// I-57 from the outside: `arbor run` killed with SIGKILL while a step
/// whose commands have the network runs. Run again, it does not run the
/// step again: it exits 3, naming the step and the command that goes on,
/// and leaves the run waiting in the journal; `arbor continue JOB` runs
/// the step's next attempt to its end, even when the kill took the step's
/// spawn event (its request is then its instruction in the run's spec).
#[test]
fn inv_57_arbor_run_exits_3_on_an_interrupted_outward_step_and_continue_finishes_it() {
    use std::io::BufRead;
    let ws = tempfile::tempdir().unwrap();
    let agent = ws.path().join("agents/payer");
    std::fs::create_dir_all(&agent).unwrap();
    std::fs::write(
        agent.join("agent.md"),
        "---\ndescription: pays\ntools: [exec]\nnetwork: open\nscript:\n  - say: paying\n    delay: 3s\n  - call: {tool: submit_output, args: {output: paid}}\n---\nYou pay.\n",
    )
    .unwrap();
    std::fs::create_dir_all(ws.path().join("flows")).unwrap();
    std::fs::write(
        ws.path().join("flows/pay.toml"),
        "[[group]]\nsteps = [{ agent = \"payer\", instruction = \"pay\" }]\n",
    )
    .unwrap();
    let data = ws.path().join("data");
    let (ws_arg, data_arg) = (ws.path().to_str().unwrap(), data.to_str().unwrap());
    let mut first = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["run", ws_arg, "--data-dir", data_arg])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(first.stdout.take().unwrap()).lines();
    let running = lines.any(|l| {
        let l = l.unwrap();
        l.contains("payer") && l.contains("[running]")
    });
    assert!(running, "the step was seen running");
    first.kill().unwrap();
    first.wait().unwrap();

    let again = arbor(&["run", ws_arg, "--data-dir", data_arg]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("step payer was interrupted"), "{stderr}");
    assert!(
        stderr.contains("payer: its commands have the network"),
        "{stderr}"
    );
    let job = stderr
        .split("`arbor continue ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no continue command in: {stderr}"));

    let out = arbor(&["continue", job, "--data-dir", data_arg, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let run = &doc["run"];
    assert_eq!(run["status"], "done", "{doc}");
    // The same run went on: its step's second attempt, and no other.
    let attempts: Vec<(u64, String)> = run["children"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] != "failed")
        .map(|c| {
            (
                c["attempt"].as_u64().unwrap(),
                c["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(attempts, [(2, "done".into())], "{doc}");
}

/// Runs `command` with a terminal on its stdin (a pty: util-linux's
/// `script`), `typed` typed ahead; its output is the terminal's.
fn in_a_terminal(command: &str, typed: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new("script")
        .args(["-qfec", command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(typed).unwrap();
    let out = child.wait_with_output().unwrap();
    drop(stdin);
    out
}

/// I-60: `arbor run` with a terminal on stdin asks the run's question
/// there: an answer off its choices is refused and asked again, one of
/// them is the answer, and the run goes on to its end. Run through a pty
/// (`script`), the answers typed ahead.
#[test]
fn arbor_run_in_a_terminal_asks_its_question_there() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("agents/asker")).unwrap();
    std::fs::write(
        ws.path().join("agents/asker/agent.md"),
        "---\ntools: [ask_person]\nscript:\n  - call: {tool: ask_person, args: {question: Which colour?, choices: [red, blue]}}\n  - call: {tool: submit_output, args: {output: asked}}\n---\nYou ask.\n",
    )
    .unwrap();
    // Were the question not answered here, it would expire and the run
    // end all the same: the card's state below is what tells.
    std::fs::write(
        ws.path().join("arbor.toml"),
        "[approvals]\ntimeout = \"60s\"\n",
    )
    .unwrap();
    let data = ws.path().join("data");
    let command = format!(
        "{} run {} --agent asker --input go --json --data-dir {}",
        env!("CARGO_BIN_EXE_arbor"),
        ws.path().display(),
        data.display()
    );
    let out = in_a_terminal(&command, b"green\nblue\n");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("asks: Which colour?"), "{text}");
    assert!(
        text.contains("\"green\" is not one of the question's choices: red, blue"),
        "{text}"
    );
    assert!(text.contains("answered: blue"), "{text}");
}

/// I-58: `arbor run` pauses at its run's ceiling only when a person at a
/// terminal can top it up: through a pty, a line that is not an amount is
/// refused and asked again, then the top-up lets the run finish; with no
/// terminal on stdin the same run ends at its ceiling, as without a pause.
#[test]
fn arbor_run_pauses_at_its_ceiling_only_at_a_terminal_and_asks_for_the_top_up_there() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ws.path().join("agents/spender")).unwrap();
    std::fs::create_dir_all(ws.path().join("flows")).unwrap();
    std::fs::write(
        ws.path().join("agents/spender/agent.md"),
        "---\nscript:\n  - usage: {input: 100, output: 900}\n    call: {tool: collect, args: {}}\n  - usage: {input: 10, output: 10}\n    call: {tool: submit_output, args: {output: spent}}\n---\nYou spend.\n",
    )
    .unwrap();
    std::fs::write(
        ws.path().join("flows/spend.toml"),
        "budget = { tokens = 1000 }\non_ceiling = \"pause\"\n[[group]]\nsteps = [{ agent = \"spender\", instruction = \"spend\" }]\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["run", ws.path().to_str().unwrap(), "--json", "--data-dir"])
        .arg(ws.path().join("piped"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert_eq!(doc["run"]["status"], "failed", "{doc}");
    assert_eq!(doc["run"]["error_class"], "budget_exhausted", "{doc}");

    let command = format!(
        "{} run {} --json --data-dir {}",
        env!("CARGO_BIN_EXE_arbor"),
        ws.path().display(),
        ws.path().join("terminal").display()
    );
    let out = in_a_terminal(&command, b"lots\n50000\n");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("the run paused at its ceiling"), "{text}");
    assert!(text.contains("`lots` is not a number of tokens"), "{text}");
    assert!(
        text.contains("topped up: the run's grant is 51000 tokens"),
        "{text}"
    );
    assert!(text.contains("\"status\": \"done\""), "{text}");
}

/// `arbor run --flow F --input` and `--input-file`: an input that fails
/// the flow's schema exits 2 naming the path that failed; one read from a
/// file that meets it runs the flow.
#[test]
fn a_flows_input_from_the_command_line_is_checked_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let agent = "---\ndescription: answers\nscript:\n  - call: {tool: submit_output, args: {output: ok}}\n---\nYou answer.\n";
    std::fs::create_dir_all(dir.path().join("agents/quick")).unwrap();
    std::fs::write(dir.path().join("agents/quick/agent.md"), agent).unwrap();
    std::fs::create_dir_all(dir.path().join("flows")).unwrap();
    std::fs::write(
        dir.path().join("flows/topical.toml"),
        "input = { type = \"object\", required = [\"topic\"], properties = { topic = { type = \"string\" } } }\n\
         [[group]]\nsteps = [{ agent = \"quick\", instruction = \"About {{ input.topic }}\" }]\n",
    )
    .unwrap();
    let ws = dir.path().to_str().unwrap();
    let out = arbor(&["run", ws, "--flow", "topical", "--input", r#"{"topic": 7}"#]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("/topic"), "{stderr}");
    let file = dir.path().join("input.json");
    std::fs::write(&file, r#"{"topic": "tides"}"#).unwrap();
    let out = arbor(&[
        "run",
        ws,
        "--flow",
        "topical",
        "--input-file",
        file.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["run"]["status"], "done");
}
