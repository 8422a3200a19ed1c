//! Record and replay (I-49): a replayed run equals its recording whatever
//! the schedule; where its request differs, it fails naming the first
//! divergence; a recording holds no secret's value.

use arbor_protocol::tape::ToolReplay;
use arbor_protocol::{ErrorClass, EventKind, Status};
use arbor_testkit::mock_provider::{Format, MockProvider, StreamEnd, anthropic, openai};
use arbor_testkit::replay::{Fixture, ReplayError, ReplayOptions, Shuffled};
use arbor_testkit::{DefaultModels, TestNode, agent_md, secrets_file};
use std::sync::Arc;

const RECORD: &str = "[record]\nmodels = true\n";

/// A lead that fans out to `n` workers, each of which runs a command whose
/// output is new every time (the clock, to the nanosecond) and answers.
fn fan_out(n: usize, lead_prompt: &str) -> Vec<(&'static str, String)> {
    let jobs: Vec<String> = (1..=n)
        .map(|i| format!("{{agent: worker, request: \"part {i}\"}}"))
        .collect();
    let lead = format!(
        "---\ntools: [exec]\nsubagents: [worker]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{}]}}}}\n  - call: {{tool: submit_output, args: {{output: all parts}}}}\n---\n{lead_prompt}\n",
        jobs.join(", ")
    );
    let worker = agent_md(
        "description: does one part\ntools: [exec]\nscript:\n  - call: {tool: exec, args: {command: \"date +%s%N\"}}\n  - say: the part is done\n    usage: {input: 40, output: 7}",
    );
    vec![("lead", lead), ("worker", worker)]
}

fn agents<'a>(defs: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    defs.iter().map(|(n, t)| (*n, t.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_49_a_fan_out_replayed_under_twenty_schedules_equals_its_recording() {
    let defs = fan_out(8, "You lead.");
    let models = Shuffled::new(Arc::new(DefaultModels), 0);
    let node = TestNode::start_full(Some(RECORD), &agents(&defs), models.clone()).await;
    let recorded = node.run_agent("lead", "go").await;
    let tree = node.wait_run(recorded).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    assert_eq!(tree.root().children[0].children.len(), 8);
    let live = models.live_calls();
    assert_eq!(
        live,
        2 + 8 * 2,
        "two calls of the lead's and two of each worker's"
    );

    for seed in 1..=20 {
        models.reseed(seed);
        let replayed = node
            .replay(recorded, ReplayOptions::default())
            .await
            .expect("the replay starts");
        let tree = node.wait_run(replayed).await;
        assert_eq!(
            node.replay_differences(recorded, replayed),
            Vec::<String>::new(),
            "seed {seed}: {:?}",
            tree.root()
        );
        node.assert_conserved(replayed);
    }
    assert_eq!(models.live_calls(), live, "a replay asks no model");
}

#[tokio::test]
async fn inv_49_tools_run_live_see_another_world_and_the_replay_names_where() {
    let defs = fan_out(1, "You lead.");
    let node = TestNode::start_with_config(RECORD, &agents(&defs)).await;
    let recorded = node.run_agent("lead", "go").await;
    assert_eq!(node.wait_run(recorded).await.run_status(), Status::Done);

    // The clock has moved on: the command's output is not the recording's.
    let options = ReplayOptions {
        tools: ToolReplay::Live,
        ..Default::default()
    };
    let replayed = node.replay(recorded, options).await.unwrap();
    let tree = node.wait_run(replayed).await;
    let run = tree.root();
    assert_eq!(run.status, Status::Failed);
    assert_eq!(run.error_class, Some(ErrorClass::Diverged));
    assert_eq!(
        run.reason.as_deref(),
        Some("the replay diverged at lead#1/worker-1#1: call 2: messages[2] (tool_result) differs"),
    );
}

#[tokio::test]
async fn inv_49_an_edited_prompt_is_reported_as_a_divergence_at_its_job_and_call() {
    let defs = fan_out(2, "You lead.");
    let node = TestNode::start_with_config(RECORD, &agents(&defs)).await;
    let recorded = node.run_agent("lead", "go").await;
    assert_eq!(node.wait_run(recorded).await.run_status(), Status::Done);
    let dir = node.crash().await;

    let edited = fan_out(2, "You lead, briefly.");
    let workspace = arbor_testkit::Workspace::from_texts(
        dir.path().join("workspace"),
        Some(RECORD),
        &agents(&edited),
        &[],
    )
    .unwrap();
    let node = TestNode::open(workspace, &dir.path().join("data"), Arc::new(DefaultModels))
        .await
        .unwrap();
    // Against the edit (by default a replay runs the recorded run's own
    // version, I-67, and would not diverge).
    let current = ReplayOptions {
        current: true,
        ..Default::default()
    };
    let pinned = node
        .replay(recorded, ReplayOptions::default())
        .await
        .unwrap();
    assert_eq!(node.wait_run(pinned).await.run_status(), Status::Done);
    let replayed = node.replay(recorded, current).await.unwrap();
    let tree = node.wait_run(replayed).await;
    let run = tree.root();
    assert_eq!(run.status, Status::Failed);
    assert_eq!(run.error_class, Some(ErrorClass::Diverged));
    assert_eq!(
        run.reason.as_deref(),
        Some("the replay diverged at lead#1: call 1: system differs"),
    );
    // Nothing was answered from the recording past the divergence.
    let lead = &run.children[0];
    assert!(lead.children.is_empty(), "{lead:?}");
    node.assert_conserved(replayed);
}

#[tokio::test]
async fn inv_49_a_recording_holds_no_secrets_value() {
    let secrets = tempfile::tempdir().unwrap();
    let value = "tok-5e4d3c2b1a09";
    let config = secrets_file(secrets.path(), &format!("API_TOKEN={value}\n"), 0o600);
    let config = format!("{config}\n{RECORD}");
    let teller = agent_md(&format!(
        "tools: [exec]\nsecrets: [API_TOKEN]\nscript:\n\
         - call: {{tool: exec, args: {{command: \"echo $API_TOKEN\"}}}}\n\
         - say: \"I should not say {value}\"\n  call: {{tool: submit_output, args: {{output: \"it was {value}\"}}}}",
    ));
    let node = TestNode::start_with_config(&config, &[("teller", &teller)]).await;
    let run = node.run_agent("teller", "go").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);

    let tape = node.journal().tape(run).unwrap();
    let kinds: Vec<u8> = tape.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == 0).count(),
        2,
        "two calls: {tape:?}"
    );
    assert_eq!(kinds.iter().filter(|k| **k == 2).count(), 1, "one command");
    for entry in &tape {
        assert!(!entry.entry_json.contains(value), "{}", entry.entry_json);
    }
    let all: String = tape.iter().map(|e| e.entry_json.as_str()).collect();
    assert!(all.contains("[secret API_TOKEN]"), "{all}");
    // Nor does its export.
    let export = arbor_runtime::replay::export(node.journal(), run).unwrap();
    let document = serde_json::to_string(&export).unwrap();
    assert!(!document.contains(value), "{document}");
}

#[tokio::test]
async fn a_run_that_was_not_recorded_or_is_not_there_is_refused_and_nothing_runs() {
    let defs = fan_out(1, "You lead.");
    let node = TestNode::start(&agents(&defs)).await;
    let run = node.run_agent("lead", "go").await;
    node.wait_run(run).await;
    let runs_before = node.journal().runs().unwrap().len();

    let refused = node
        .replay(run, ReplayOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(refused, ReplayError::NotRecorded(r) if r == run),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("arbor run --record"),
        "{refused}"
    );
    let nobody = arbor_protocol::RunId::new();
    let refused = node
        .replay(nobody, ReplayOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        format!("no run {nobody} in this journal")
    );
    assert_eq!(
        node.journal().runs().unwrap().len(),
        runs_before,
        "nothing ran"
    );
}

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_recording_schema_in_docs_contract_is_the_one_the_types_generate() {
    let path = repo().join("docs/contract/recording.schema.json");
    let generated =
        serde_json::to_string_pretty(&arbor_protocol::tape::Export::schema()).unwrap() + "\n";
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/contract/recording.schema.json is not what the types generate; \
         run `BLESS=1 cargo test -p arbor-tests --test replay the_recording_schema` and commit it"
    );
}

/// Each committed fixture (`arbor export`), replayed offline against the
/// workspace it was recorded in: one of the scripted model's, one of a
/// provider's (Anthropic's wire format, recorded against fakellm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_fixtures_replay_to_their_recordings() {
    let schema =
        std::fs::read_to_string(repo().join("docs/contract/recording.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&serde_json::from_str(&schema).unwrap()).unwrap();
    for (fixture, workspace) in [
        ("research.json", "examples/research"),
        ("anthropic.json", "tests/fakellm/anthropic"),
    ] {
        let path = repo().join("tests/fixtures").join(fixture);
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{fixture} fails the schema: {errors:?}");
        let tree = Fixture::load(&path)
            .unwrap_or_else(|e| panic!("{fixture}: {e}"))
            .replay(repo().join(workspace))
            .await
            .unwrap_or_else(|e| panic!("{fixture}: {e}"));
        assert_eq!(tree.run_status(), Status::Done, "{fixture}");
    }
}

/// Over each wire format, on a provider that goes away after the run: a
/// planner whose first answer's stream is cut at its fourth chunk (charged
/// what streamed, then retried), a researcher, and the planner's report.
/// The replay, offline, is the recording: the cut call charged the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_49_a_run_on_either_wire_format_replays_offline_a_cut_stream_charged_the_same() {
    const PLANNER: &str = "You are the planner.";
    const RESEARCHER: &str = "You are the researcher.";
    let planner = format!(
        "---\nmodel: mock/small\nsubagents: [researcher]\n---\n{PLANNER} Delegate, then report.\n"
    );
    let researcher =
        format!("---\nmodel: mock/small\ndescription: finds facts\n---\n{RESEARCHER}\n");
    let delegate = serde_json::json!({"jobs": [{"agent": "researcher", "request": "One fact."}]});
    for format in [Format::Openai, Format::Anthropic] {
        let mock = MockProvider::start().await;
        let (cut, delegating, fact, report) = match format {
            Format::Openai => (
                openai::stream("Let me think about where to start", &[], Some((90, 12))),
                openai::stream("", &[("delegate", delegate.clone())], Some((90, 20))),
                openai::stream("Tide pools hold anemones.", &[], Some((40, 6))),
                openai::stream("Report: tide pools hold anemones.", &[], Some((150, 9))),
            ),
            Format::Anthropic => (
                anthropic::stream("Let me think about where to start", &[], 90, 12),
                anthropic::stream("", &[("delegate", delegate.clone())], 90, 20),
                anthropic::stream("Tide pools hold anemones.", &[], 40, 6),
                anthropic::stream("Report: tide pools hold anemones.", &[], 150, 9),
            ),
        };
        mock.push_for(format, PLANNER, cut.cut_after(4, StreamEnd::Drop));
        mock.push_for(format, PLANNER, delegating);
        mock.push_for(format, RESEARCHER, fact);
        mock.push_for(format, PLANNER, report);
        let config = format!("{}\n{RECORD}", mock.arbor_toml(format, ""));
        let node = TestNode::start_with_config(
            &config,
            &[("planner", &planner), ("researcher", &researcher)],
        )
        .await;
        let recorded = node.run_agent("planner", "Go.").await;
        let tree = node.wait_run(recorded).await;
        assert_eq!(
            tree.run_status(),
            Status::Done,
            "{format:?}: {:?}",
            tree.root()
        );
        assert_eq!(mock.received().len(), 4, "{format:?}");
        drop(mock);

        let replayed = node
            .replay(recorded, ReplayOptions::default())
            .await
            .unwrap();
        let tree = node.wait_run(replayed).await;
        assert_eq!(
            node.replay_differences(recorded, replayed),
            Vec::<String>::new(),
            "{format:?}: {:?}",
            tree.root()
        );
        let first_call = |run| {
            node.events(run)
                .into_iter()
                .find_map(|e| match e.kind {
                    EventKind::ModelCalled {
                        input_tokens,
                        output_tokens,
                        call,
                        ..
                    } => Some((input_tokens, output_tokens, call.outcome)),
                    _ => None,
                })
                .unwrap()
        };
        let (input, output, outcome) = first_call(recorded);
        assert_eq!(outcome, "model_server", "{format:?}: the cut stream");
        assert!(output > 0, "{format:?}: charged what streamed");
        assert_eq!(first_call(replayed), (input, output, outcome), "{format:?}");
        node.assert_conserved(replayed);
    }
}

/// A gatherer fans out to three workers (group one), then a writer writes
/// (group two); `writer_prompt` is the writer's system prompt.
fn report_workspace(writer_prompt: &str) -> (Vec<(&'static str, String)>, &'static str) {
    let gather = "---\nsubagents: [worker]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: a}, {agent: worker, request: b}, {agent: worker, request: c}]}}\n  - call: {tool: submit_output, args: {output: gathered}}\n---\nGather.\n".to_string();
    let worker = agent_md(
        "description: one part\nscript:\n  - call: {tool: submit_output, args: {output: part}}",
    );
    let writer = format!(
        "---\nscript:\n  - call: {{tool: submit_output, args: {{output: the report}}}}\n---\n{writer_prompt}\n"
    );
    let flow = "[[group]]\nsteps = [{ agent = \"gather\", instruction = \"gather\" }]\n\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"write\" }]\n";
    (
        vec![("gather", gather), ("worker", worker), ("writer", writer)],
        flow,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_of_a_failed_run_calls_only_the_failed_part_and_changed_definitions_are_refused_then_accepted()
 {
    use arbor_testkit::faults::{FaultyModels, ModelFault};
    let (defs, flow) = report_workspace("Write.");
    let faulty = FaultyModels::new();
    faulty.on_job("writer", 0, [ModelFault::Malformed]);
    let node = TestNode::start_workspace(
        Some(RECORD),
        &agents(&defs),
        &[("report", flow)],
        faulty.clone(),
    )
    .await;
    let failed = node.run_flow("report").await;
    let tree = node.wait_run(failed).await;
    assert_eq!(tree.run_status(), Status::Failed, "{:?}", tree.root());
    let dir = node.crash().await;

    // The writer's prompt is fixed: a changed definition, named.
    let (fixed, flow) = report_workspace("Write it well.");
    let workspace = arbor_testkit::Workspace::from_texts(
        dir.path().join("workspace"),
        Some(RECORD),
        &agents(&fixed),
        &[("report", flow)],
    )
    .unwrap();
    let models = FaultyModels::new();
    let node = TestNode::open(workspace, &dir.path().join("data"), models.clone())
        .await
        .unwrap();
    let refused = arbor_runtime::replay::plan_rerun(node.journal(), &node.workspace, failed, false)
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .starts_with(&format!("definitions changed since run {failed} was recorded: agents/writer/agent.md; give --allow-changed")),
        "{refused}"
    );
    let plan =
        arbor_runtime::replay::plan_rerun(node.journal(), &node.workspace, failed, true).unwrap();
    assert_eq!(plan.changed, ["agents/writer/agent.md"]);
    let reuse: Vec<(&str, bool)> = plan
        .jobs
        .iter()
        .map(|j| (j.lineage.as_str(), j.reuse))
        .collect();
    assert_eq!(
        reuse,
        [
            ("gather#1", true),
            ("gather#1/worker-1#1", true),
            ("gather#1/worker-2#1", true),
            ("gather#1/worker-3#1", true),
            ("writer#1", false),
        ]
    );
    let writer_grant = plan.jobs[4].grant_tokens;
    assert_eq!(
        plan.worst_case_tokens, writer_grant,
        "only the writer runs again"
    );

    let rerun = arbor_runtime::replay::rerun(node.node(), &node.workspace, plan, false)
        .await
        .unwrap();
    let tree = node.wait_run(rerun).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    assert_eq!(models.calls("gather"), 0, "reused from the recording");
    assert_eq!(models.calls("worker"), 0, "reused from the recording");
    assert_eq!(models.calls("writer"), 1, "the failed part, live");
    let spec = node
        .events(rerun)
        .into_iter()
        .find_map(|e| match e.kind {
            EventKind::RunStarted { spec, .. } => Some(spec),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        spec.replay.map(|r| r.of),
        Some(failed),
        "linked to the failed run"
    );
    node.assert_conserved(rerun);
}

/// A call that waited for a person is decided once: its replay applies the
/// recorded decision (an edit included) and asks no one again.
#[tokio::test]
async fn inv_49_a_replay_applies_the_recorded_approval_and_asks_no_one() {
    let writer = agent_md(
        "tools: [write_file]\napprove: [write_file]\nscript:\n  - call: {tool: write_file, args: {path: out.txt, content: hello}}\n  - call: {tool: submit_output, args: {output: done}}",
    );
    let node = TestNode::start_with_config(RECORD, &[("writer", &writer)]).await;
    let recorded = node.run_agent("writer", "go").await;
    let card = node.wait_card(recorded).await;
    node.decide(
        card.id,
        arbor_protocol::Verdict::Edit,
        Some("shorter"),
        Some(serde_json::json!({"path": "out.txt", "content": "hi"})),
    )
    .await
    .unwrap();
    assert_eq!(node.wait_run(recorded).await.run_status(), Status::Done);

    let replayed = node
        .replay(recorded, ReplayOptions::default())
        .await
        .unwrap();
    let tree = node.wait_run(replayed).await;
    assert_eq!(
        node.replay_differences(recorded, replayed),
        Vec::<String>::new()
    );
    assert!(node.cards(replayed).is_empty(), "no one was asked");
    let step = &tree.root().children[0];
    let job = step.id.parse().unwrap();
    let written = std::fs::read_to_string(node.workdir(replayed, job).join("out.txt")).unwrap();
    assert_eq!(written, "hi", "the person's edit, applied again");
}

/// A skill is a definition a recording names (I-49): when one changed, a
/// rerun names it, and runs again the jobs of the agents that read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_names_a_changed_skill_and_runs_again_the_jobs_that_read_it() {
    use arbor_testkit::faults::{FaultyModels, ModelFault};
    let (defs, flow) = report_workspace("Write.");
    let ws = tempfile::tempdir().unwrap();
    let write = |path: &str, text: &str| {
        let path = ws.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("arbor.toml", RECORD);
    for (name, text) in &defs {
        let text = text.replace(
            "subagents: [worker]",
            "subagents: [worker]\nskills: [style]",
        );
        write(&format!("agents/{name}/agent.md"), &text);
    }
    let skill = "---\nname: style\ndescription: The house style.\n---\nBe brief.\n";
    write("skills/style/SKILL.md", skill);
    write("flows/report.toml", flow);
    let faulty = FaultyModels::new();
    faulty.on_job("writer", 0, [ModelFault::Malformed]);
    let node = TestNode::start_dir_with(ws.path(), faulty).await;
    let failed = node.run_flow("report").await;
    assert_eq!(node.wait_run(failed).await.run_status(), Status::Failed);
    let dir = node.crash().await;

    write("skills/style/SKILL.md", &skill.replace("brief", "thorough"));
    let workspace = arbor_runtime::Workspace::load(ws.path()).unwrap();
    let node = TestNode::open(workspace, &dir.path().join("data"), FaultyModels::new())
        .await
        .unwrap();
    let refused = arbor_runtime::replay::plan_rerun(node.journal(), &node.workspace, failed, false)
        .unwrap_err();
    assert!(
        refused
            .to_string()
            .contains(": skills/style/SKILL.md; give --allow-changed"),
        "{refused}"
    );
    let plan =
        arbor_runtime::replay::plan_rerun(node.journal(), &node.workspace, failed, true).unwrap();
    assert_eq!(plan.changed, ["skills/style/SKILL.md"]);
    let gather = plan.jobs.iter().find(|j| j.lineage == "gather#1").unwrap();
    assert_eq!(
        (gather.reuse, gather.why.as_deref()),
        (false, Some("skills/style/SKILL.md changed"))
    );
    let worker = plan.jobs.iter().find(|j| j.agent == "worker").unwrap();
    assert!(worker.reuse, "the worker reads no skill: {worker:?}");
}

/// Two offline providers: `primary` past its usage cap, `backup` on another
/// account answering from the scripts.
const WALLED: &str = "[record]\nmodels = true\n[budget]\ntokens = 100000\nusd = 1.0\n\
    [providers.primary]\nkind = \"scripted\"\nfail_with = \"model_usage_cap\"\n\
    [providers.primary.models.m]\nid = \"p\"\ncontext_window = 9000\nmax_output_tokens = 900\n\
    usd_per_mtok_input = 1.0\nusd_per_mtok_output = 1.0\n\
    [providers.backup]\nkind = \"scripted\"\n\
    [providers.backup.models.m]\nid = \"b\"\ncontext_window = 9000\nmax_output_tokens = 900\n\
    usd_per_mtok_input = 3.0\nusd_per_mtok_output = 3.0\n";

/// A run whose calls fell back (I-55) replays to its recording (I-49): each
/// job moves where the recorded one moved, at the same call, and is
/// charged the same; nothing is asked of a model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv_49_a_run_that_fell_back_replays_its_moves_and_charges() {
    let on = "model: primary/m\nmodels: [primary/m, backup/m]\nfallback: [backup/m]\n";
    let lead = agent_md(&format!(
        "{on}subagents: [worker]\nscript:\n  - call: {{tool: delegate, args: {{jobs: [{{agent: worker, request: one}}, {{agent: worker, request: two}}]}}}}\n  - call: {{tool: submit_output, args: {{output: both}}}}"
    ));
    let worker = agent_md(&format!(
        "description: does a part\n{on}script:\n  - say: a part\n    usage: {{input: 30, output: 5}}"
    ));
    let ws = tempfile::tempdir().unwrap();
    for (path, text) in [
        ("arbor.toml", WALLED),
        ("agents/lead/agent.md", &lead),
        ("agents/worker/agent.md", &worker),
    ] {
        let path = ws.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let providers = arbor_runtime::Workspace::load(ws.path())
        .unwrap()
        .config
        .providers;
    let models = Shuffled::new(Arc::new(arbor_runtime::Models::new(&providers)), 0);
    let node = TestNode::start_dir_with(ws.path(), models.clone()).await;
    let recorded = node.run_agent("lead", "go").await;
    let tree = node.wait_run(recorded).await;
    assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
    let moves = |run| {
        node.events(run)
            .iter()
            .filter(|e| {
                matches!(&e.kind, EventKind::ModelFallback { to, class, .. }
                if to == "backup/m" && *class == ErrorClass::ModelUsageCap)
            })
            .count()
    };
    assert_eq!(
        moves(recorded),
        3,
        "the lead's and each worker's first call"
    );
    let usd = |run| node.tree(run).root().usd.expect("a usd ceiling").spent;
    assert!(usd(recorded) > 0, "charged at backup's prices");
    let live = models.live_calls();

    for seed in 1..=3 {
        models.reseed(seed);
        let replayed = node
            .replay(recorded, ReplayOptions::default())
            .await
            .unwrap();
        let tree = node.wait_run(replayed).await;
        assert_eq!(tree.run_status(), Status::Done, "{:?}", tree.root());
        assert_eq!(
            node.replay_differences(recorded, replayed),
            Vec::<String>::new()
        );
        assert_eq!(moves(replayed), 3);
        assert_eq!(usd(replayed), usd(recorded));
        assert_eq!(
            node.tree(replayed).root().children[0].model.as_deref(),
            Some("backup/m")
        );
        node.assert_conserved(replayed);
    }
    assert_eq!(models.live_calls(), live, "a replay asks no model");
}
