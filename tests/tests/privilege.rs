//! Privilege down the chain (I-25): a child can narrow, never widen.

use arbor_testkit::{TestNode, agent_md};

#[tokio::test]
async fn inv_25_a_child_cannot_widen_its_parents_tools_by_naming_them() {
    let boss = agent_md(
        "tools: [read_file, write_file]\ndeny: [exec]\nsubagents: [greedy]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: greedy, request: go, label: g, deny: [write_file]}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    // It names every sandbox tool; its parent has no exec and denies it, and the job denies write_file.
    let greedy = agent_md(
        "description: wants everything\ntools: [exec, read_file, write_file]\nscript:\n  - call:\n      - {tool: exec, args: {command: id}}\n      - {tool: write_file, args: {path: a.txt, content: x}}\n      - {tool: read_file, args: {path: missing.txt}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("greedy", &greedy)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let g = tree.find("g").unwrap();
    let results: Vec<(String, bool, String)> = node
        .tool_calls(run)
        .into_iter()
        .filter(|c| c.job == g && c.tool != "submit_output")
        .map(|c| (c.tool, c.ok, c.detail))
        .collect();
    assert_eq!(results.len(), 3);
    assert!(
        results[0]
            .2
            .contains("tool exec is not offered to you: it is denied"),
        "{results:?}"
    );
    assert!(
        results[1]
            .2
            .contains("tool write_file is not offered to you: it is denied"),
        "{results:?}"
    );
    // read_file is offered (the parent has it): the error is the missing file, not the privilege.
    assert!(!results[2].2.contains("not offered"), "{results:?}");
    assert!(results[2].2.contains("missing.txt"), "{results:?}");
    assert!(!node.workdir(run, g).join("a.txt").exists());
}

/// The file tools stay beneath the workdir: `..`, absolute paths, and
/// symlinks the job made itself (to a directory or a file outside) are all
/// refused, for reading and for writing, and nothing outside is touched.
#[tokio::test]
async fn inv_28_file_tools_refuse_traversal_absolute_paths_and_symlinks_out() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("secret.txt");
    std::fs::write(&target, "host data").unwrap();
    let solo = agent_md(&format!(
        "tools: [exec, read_file, write_file]\nscript:\n  - call: {{tool: exec, args: {{command: \"ln -s {dir} outdir && ln -s {file} link.txt\"}}}}\n  - call:\n      - {{tool: read_file, args: {{path: ../secret.txt}}}}\n      - {{tool: read_file, args: {{path: {file}}}}}\n      - {{tool: read_file, args: {{path: outdir/secret.txt}}}}\n      - {{tool: read_file, args: {{path: link.txt}}}}\n      - {{tool: write_file, args: {{path: outdir/planted.txt, content: x}}}}\n      - {{tool: write_file, args: {{path: link.txt, content: overwritten}}}}\n      - {{tool: write_file, args: {{path: ok/inside.txt, content: fine}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}",
        dir = outside.path().display(),
        file = target.display(),
    ));
    let node = TestNode::start(&[("solo", &solo)]).await;
    let run = node.run_agent("solo", "go").await;
    let tree = node.wait_run(run).await;
    let reads = node.failed_calls(run, "read_file");
    let writes = node.failed_calls(run, "write_file");
    assert_eq!(reads.len(), 4, "{reads:#?}");
    assert_eq!(writes.len(), 2, "{writes:#?}");
    for detail in reads.iter().chain(&writes) {
        assert!(
            ["leaves the workdir", "absolute", "symlink"]
                .iter()
                .any(|w| detail.contains(w)),
            "{detail}"
        );
        assert!(!detail.contains("host data"), "{detail}");
    }
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "host data");
    assert!(!outside.path().join("planted.txt").exists());
    let step = tree.root().children[0].clone();
    assert_eq!(step.artifacts, ["ok/inside.txt"], "the one write inside");
}

/// Written as a file, then replaced by a symlink to a host file: it is no
/// artifact any more (an artifact is a regular file beneath the workdir).
#[tokio::test]
async fn inv_28_a_symlink_left_where_an_artifact_was_is_not_an_artifact() {
    let solo = agent_md(
        "tools: [exec, write_file]\nscript:\n  - call: {tool: write_file, args: {path: report.txt, content: draft}}\n  - call: {tool: exec, args: {command: \"rm report.txt && ln -s /etc/passwd report.txt && ln -s /etc/passwd extra.txt\"}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = TestNode::start(&[("solo", &solo)]).await;
    let run = node.run_agent("solo", "go").await;
    let tree = node.wait_run(run).await;
    let step = tree.root().children[0].clone();
    assert!(step.artifacts.is_empty(), "{:?}", step.artifacts);
}

/// I-26, the tools and the workdir: a `sandbox: own` sub-agent runs in a
/// workdir of its own (not below its parent's), keeps the tools it declares
/// though its parent lacks them, still inherits every deny, may not
/// delegate, and only its reply reaches the parent (none of its files are
/// the parent's artifacts). Its network and secrets: attacks.rs.
#[tokio::test]
async fn inv_26_an_own_sandbox_sub_agent_keeps_its_tools_and_workdir_inherits_denies_and_cannot_delegate()
 {
    let boss = agent_md(
        "tools: [read_file]\ndeny: [write_file]\nsubagents: [lone]\nscript:\n  - call: {tool: delegate, args: {wait: true, jobs: [{agent: lone, request: go, label: l}]}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let lone = agent_md(
        "description: works alone\nsandbox: own\ntools: [exec, write_file]\nscript:\n  - call:\n      - {tool: exec, args: {command: \"pwd && echo mine > made.txt\"}}\n      - {tool: write_file, args: {path: w.txt, content: x}}\n      - {tool: delegate, args: {jobs: [{agent: lone, request: again}]}}\n  - call: {tool: submit_output, args: {output: alone}}",
    );
    let node = TestNode::start(&[("boss", &boss), ("lone", &lone)]).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let step = tree.root().children[0].clone();
    let job = tree.find("l").expect("the own-sandbox job");
    let step_dir = node.workdir(run, step.id.parse().unwrap());
    let job_dir = node.workdir(run, job);
    assert!(
        !job_dir.starts_with(&step_dir),
        "{job_dir:?} is not below {step_dir:?}"
    );
    assert!(job_dir.to_string_lossy().contains("/own/"), "{job_dir:?}");
    let results: Vec<(String, bool, String)> = node
        .tool_calls(run)
        .into_iter()
        .filter(|c| c.job == job)
        .map(|c| (c.tool, c.ok, c.detail))
        .collect();
    let by_tool = |name: &str| {
        results
            .iter()
            .find(|(t, _, _)| t == name)
            .unwrap_or_else(|| panic!("{name} in {results:#?}"))
            .clone()
    };
    let exec = by_tool("exec");
    assert!(
        exec.1,
        "exec is its own though its parent has none: {exec:?}"
    );
    assert!(
        exec.2.contains(&*job_dir.to_string_lossy()),
        "it ran in its own workdir: {exec:?}"
    );
    assert!(!by_tool("write_file").1, "its parent's deny still holds");
    assert!(!by_tool("delegate").1, "it may not delegate");
    let node_l = tree.node(job).unwrap();
    assert_eq!(node_l.output, "alone", "its reply reaches the parent");
    assert_eq!(node_l.artifacts, ["made.txt"]);
    assert!(
        step.artifacts.is_empty(),
        "its files are not the parent's: {:?}",
        step.artifacts
    );
    assert!(!step_dir.join("made.txt").exists());
}

// ---------------------------------------------------------------- hooks

/// A hook that allows commands, denies writes and asks before a read.
const HOOK: &str = "hooks:\n  before_call: |\n    call=$(cat)\n    case \"$call\" in\n      *'\"tool\":\"write_file\"'*) echo '{\"decision\": \"deny\", \"reason\": \"no writes here\"}' ;;\n      *'\"tool\":\"read_file\"'*) echo '{\"decision\": \"ask\"}' ;;\n      *) echo '{\"decision\": \"allow\"}' ;;\n    esac\n";

/// I-62: a hook's allow lets a call run, its deny refuses it with the
/// reason the model reads, and its ask makes the call wait for a person;
/// `submit_output` is never asked about.
#[tokio::test]
async fn inv_62_a_hook_allows_denies_and_asks() {
    use arbor_protocol::Verdict;
    let worker = arbor_testkit::agent_md(&format!(
        "tools: [exec, write_file, read_file]\n{HOOK}script:\n  - call: {{tool: exec, args: {{command: echo ran}}}}\n  - call: {{tool: write_file, args: {{path: a.txt, content: x}}}}\n  - call: {{tool: read_file, args: {{path: a.txt}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let node = arbor_testkit::TestNode::start(&[("worker", &worker)]).await;
    let run = node.run_agent("worker", "go").await;
    let card = node.wait_card(run).await;
    assert_eq!(card.tool, "read_file", "the hook asked");
    node.decide(card.id, Verdict::Approve, None, None)
        .await
        .unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), arbor_protocol::Status::Done);
    let calls = node.tool_calls(run);
    let of = |tool: &str| calls.iter().find(|c| c.tool == tool).unwrap();
    assert!(
        of("exec").ok && of("exec").detail.contains("ran"),
        "allowed"
    );
    assert!(!of("write_file").ok, "denied");
    assert!(
        of("write_file").detail.contains("no writes here"),
        "{}",
        of("write_file").detail
    );
    let dir = node.workdir(run, tree.find("worker").unwrap());
    assert!(!dir.join("a.txt").exists(), "a denied call never ran");
    assert!(of("submit_output").ok);
}

/// I-62: a hook that fails, or answers nonsense, denies (fail closed); a
/// parent's hook holds below it, and a child cannot drop it.
#[tokio::test]
async fn inv_62_a_hook_that_crashes_or_answers_nonsense_denies_and_holds_below() {
    let crashes = arbor_testkit::agent_md(
        "tools: [exec]\nhooks: {before_call: \"exit 3\"}\nscript:\n  - call: {tool: exec, args: {command: echo ran}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let babbles = arbor_testkit::agent_md(
        "tools: [exec]\nhooks: {before_call: \"cat >/dev/null; echo maybe\"}\nscript:\n  - call: {tool: exec, args: {command: echo ran}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let boss = arbor_testkit::agent_md(&format!(
        "tools: [exec, write_file]\nsubagents: [kid]\n{HOOK}script:\n  - call: {{tool: delegate, args: {{jobs: [{{agent: kid, request: write}}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}"
    ));
    let kid = arbor_testkit::agent_md(
        "description: writes\ntools: [write_file]\nhooks: {before_call: \"cat >/dev/null; echo '{\\\"decision\\\": \\\"allow\\\"}'\"}\nscript:\n  - call: {tool: write_file, args: {path: k.txt, content: x}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = arbor_testkit::TestNode::start(&[
        ("crashes", &crashes),
        ("babbles", &babbles),
        ("boss", &boss),
        ("kid", &kid),
    ])
    .await;
    for (agent, says) in [("crashes", "exited with Some(3)"), ("babbles", "\"maybe\"")] {
        let run = node.run_agent(agent, "go").await;
        node.wait_run(run).await;
        let denied = node.failed_calls(run, "exec");
        assert!(
            denied.len() == 1
                && denied[0].contains("failed, so it is denied")
                && denied[0].contains(says),
            "{agent}: {denied:?}"
        );
        assert!(
            node.tool_calls(run)
                .iter()
                .all(|c| !c.detail.contains("ran")),
            "{agent}: the command never ran"
        );
    }
    let run = node.run_agent("boss", "go").await;
    node.wait_run(run).await;
    let denied = node.failed_calls(run, "write_file");
    assert!(
        denied.len() == 1 && denied[0].contains("no writes here"),
        "the boss's hook holds for its child, whose own allows: {denied:?}"
    );
}
