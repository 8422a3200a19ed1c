//! What a model is shown: the roster of sub-agents a parent may delegate to
//! (I-54), and the tool words it acts on.

use arbor_protocol::Status;
use arbor_testkit::{RecordingModels, TestNode};

/// A planner over a researcher and a coder (own sandbox); a third agent,
/// `auditor`, is in the workspace but not the planner's.
fn roster_agents() -> Vec<(&'static str, String)> {
    vec![
        (
            "planner",
            "---\nsubagents: [researcher, coder]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: researcher, request: find}]}}\n  - call: {tool: submit_output, args: {output: planned}}\n---\nYou are the planner.\n".into(),
        ),
        (
            "researcher",
            "---\ndescription: Finds one fact about a topic.\nscript:\n  - call: {tool: submit_output, args: {output: fact}}\n---\nRESEARCHER-PROMPT-BODY\n".into(),
        ),
        (
            "coder",
            "---\ndescription: Writes and runs small programs.\nsandbox: own\ntools: [exec]\nscript:\n  - call: {tool: submit_output, args: {output: code}}\n---\nCODER-PROMPT-BODY\n".into(),
        ),
        (
            "auditor",
            "---\ndescription: AUDITOR-DESCRIPTION\nscript:\n  - call: {tool: submit_output, args: {output: audit}}\n---\nAudit.\n".into(),
        ),
    ]
}

async fn roster_node() -> (TestNode, std::sync::Arc<RecordingModels>) {
    let agents = roster_agents();
    let agents: Vec<(&str, &str)> = agents.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let models = RecordingModels::new();
    let node = TestNode::start_full(None, &agents, models.clone()).await;
    (node, models)
}

#[tokio::test(flavor = "multi_thread")]
async fn inv_54_a_parent_is_told_exactly_its_sub_agents_and_delegate_takes_only_their_names() {
    let (node, models) = roster_node().await;
    let run = node.run_agent("planner", "Plan.").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);

    let first = &models.requests("planner")[0];
    let system = &first.system;
    assert!(system.starts_with("You are the planner.\n\n"), "{system}");
    let roster = &system[system
        .find(arbor_actors::agent_loop::ROSTER_HEADING)
        .unwrap()..];
    assert!(
        roster.contains("- `researcher`: Finds one fact about a topic.\n"),
        "{roster}"
    );
    assert!(
        roster
            .contains("- `coder`: Writes and runs small programs. (Works in a sandbox of its own"),
        "{roster}"
    );
    // Nothing of a sub-agent beyond its name and description, and nothing
    // of an agent it may not delegate to.
    for absent in [
        "RESEARCHER-PROMPT-BODY",
        "CODER-PROMPT-BODY",
        "auditor",
        "AUDITOR",
        "exec",
    ] {
        assert!(!system.contains(absent), "{absent} in {system}");
    }
    let delegate = first
        .tools
        .iter()
        .find(|t| &*t.name == "delegate")
        .expect("delegate offered");
    let agent = delegate
        .parameters
        .pointer("/properties/jobs/items/properties/agent")
        .unwrap();
    assert_eq!(agent["enum"], serde_json::json!(["researcher", "coder"]));

    // Every request of the job carries the same roster.
    let second = &models.requests("planner")[1];
    assert_eq!(second.system, first.system);

    // A job with no sub-agents is told of none, and is not offered delegate.
    let researcher = &models.requests("researcher")[0];
    assert_eq!(researcher.system, "RESEARCHER-PROMPT-BODY");
    assert!(researcher.tools.iter().all(|t| &*t.name != "delegate"));
    node.shutdown().await;
}

/// A job that makes the same call (name and arguments) again and again: at
/// `max_repeats` in a row its result carries a notice, at twice as many the
/// call is not run and the job ends `no_progress`, which is not retried
/// (the job asked for two retries) and does not fail its parent's model.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_that_repeats_one_call_is_told_then_ended_no_progress_and_not_retried() {
    let same = "  - call: {tool: read_file, args: {path: notes.txt}}\n";
    let looper = format!(
        "---\ndescription: reads the same file forever\ntools: [read_file]\nmax_repeats: 2\nscript:\n{}  - call: {{tool: submit_output, args: {{output: never}}}}\n---\nLoop.\n",
        same.repeat(6)
    );
    let boss = "---\nsubagents: [looper]\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: looper, request: go, label: l, retries: 2}]}}\n  - call: {tool: submit_output, args: {output: done}}\n---\nBoss.\n";
    let models = RecordingModels::new();
    let node =
        TestNode::start_full(None, &[("boss", boss), ("looper", &looper)], models.clone()).await;
    let run = node.run_agent("boss", "go").await;
    let tree = node.wait_run(run).await;
    let l = tree.node(tree.find("l").unwrap()).unwrap();
    assert_eq!(l.status, Status::Failed, "{l:?}");
    assert_eq!(
        l.error_class,
        Some(arbor_protocol::ErrorClass::NoProgress),
        "{l:?}"
    );
    assert_eq!(l.attempt, 1, "no_progress is not retried: {l:?}");
    assert!(
        l.reason
            .as_deref()
            .unwrap_or("")
            .contains("read_file was called 4 times in a row"),
        "{l:?}"
    );
    // Three calls ran (the fourth was refused as stuck); the second and third
    // results carried the notice, the first did not.
    let calls: Vec<_> = node
        .tool_calls(run)
        .into_iter()
        .filter(|c| c.tool == "read_file")
        .collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    let requests = models.requests("looper");
    let last_result = |n: usize| match requests[n].messages.last() {
        Some(arbor_actors::model::Message::ToolResult { content, .. }) => content.clone(),
        other => panic!("request {n} ends with {other:?}"),
    };
    assert!(!last_result(1).contains("[arbor] You have made this same call"));
    assert!(
        last_result(2).contains("same arguments, 2 times in a row"),
        "{}",
        last_result(2)
    );
    assert!(last_result(3).contains("3 times in a row"));
    // The parent went on: the job's end is its result, not the boss's failure.
    assert_eq!(tree.run_status(), Status::Done);
    node.shutdown().await;
}

/// The run of identical calls survives a restart: a step that made the same
/// call twice (max_repeats 2: the second was told) is killed while it
/// thinks; its next attempt, making the same call, goes on counting from
/// two, is told at three and ends `no_progress` at four, instead of being
/// given a fresh count by every crash.
#[tokio::test(flavor = "multi_thread")]
async fn no_progress_counts_on_across_a_restart() {
    let same = "  - call: {tool: read_file, args: {path: notes.txt}}\n";
    let looper = format!(
        "---\ntools: [read_file]\nmax_repeats: 2\nscript:\n{same}{same}  - say: thinking\n    delay: 1h\n{same}{same}{same}  - call: {{tool: submit_output, args: {{output: never}}}}\n---\nLoop.\n"
    );
    let flow = "[[group]]\nsteps = [{ agent = \"looper\", instruction = \"go\" }]\n";
    let models = RecordingModels::new();
    let node = TestNode::start_workspace(
        None,
        &[("looper", &looper)],
        &[("loop", flow)],
        models.clone(),
    )
    .await;
    let run = node.run_flow("loop").await;
    // Its third call is sent only once its reservation, and the two
    // calls' events before it, are committed.
    let _thinking = models.meter("looper", 2).await;
    let node = node.crash_and_restart().await;
    let tree = node.wait_run(run).await;
    let root = tree.root();
    let step = root.children.last().unwrap();
    assert_eq!(step.attempt, 2, "{step:?}");
    assert_eq!(
        step.error_class,
        Some(arbor_protocol::ErrorClass::NoProgress),
        "{step:?}"
    );
    assert!(
        step.reason
            .as_deref()
            .unwrap_or("")
            .contains("read_file was called 4 times in a row"),
        "{step:?}"
    );
    let requests = models.requests("looper");
    // Its second attempt's second request carries the result of the third call in a row.
    let told = requests.iter().filter(|r| {
        matches!(r.messages.last(), Some(arbor_actors::model::Message::ToolResult { content, .. }) if content.contains("3 times in a row"))
    });
    assert_eq!(told.count(), 1);
}

/// `tests/prompt` copied to a temporary folder, with the test MCP server
/// as `[mcp.servers.notes]` (only a test knows its path) and the planner
/// given its `echo`.
fn prompt_workspace() -> tempfile::TempDir {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("prompt");
    let dir = tempfile::tempdir().unwrap();
    for entry in walk(&from) {
        let rel = entry.strip_prefix(&from).unwrap();
        if rel.starts_with("golden") {
            continue;
        }
        let to = dir.path().join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &to).unwrap();
    }
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_mcp-test-server"));
    let toml = dir.path().join("arbor.toml");
    let mut text = std::fs::read_to_string(&toml).unwrap();
    text += &format!(
        "\n[mcp.servers.notes]\ncommand = {:?}\nread_only = [{:?}]\n",
        bin.display().to_string(),
        bin.parent().unwrap().display().to_string()
    );
    std::fs::write(&toml, text).unwrap();
    let planner = dir.path().join("agents/planner/agent.md");
    let text = std::fs::read_to_string(&planner).unwrap().replacen(
        "subagents: [researcher, coder]\n",
        "subagents: [researcher, coder]\ntools: [mcp__notes__echo]\n",
        1,
    );
    std::fs::write(&planner, text).unwrap();
    dir
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = vec![];
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// Golden request bodies (`arbor prompt -o json` prints exactly these): a
/// parent with two sub-agents, a tool of an MCP server (listed by starting
/// it, as a job would) and settings, in both wire formats.
#[tokio::test(flavor = "multi_thread")]
async fn first_request_bodies_match_their_goldens_in_both_wire_formats() {
    let ws = prompt_workspace();
    let workspace = arbor_runtime::Workspace::load(ws.path()).unwrap();
    let golden_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("prompt/golden");
    for (wire, golden) in [
        (arbor_runtime::ProviderKind::Openai, "openai.json"),
        (arbor_runtime::ProviderKind::Anthropic, "anthropic.json"),
    ] {
        let body = arbor_runtime::prompt::first_body(
            &workspace,
            "planner",
            "Compare two suppliers.",
            Some(wire),
        )
        .await
        .unwrap();
        let text = body.to_string();
        assert!(text.contains("mcp__notes__echo"), "{text}");
        let path = golden_dir.join(golden);
        if std::env::var_os("BLESS").is_some() {
            std::fs::write(&path, serde_json::to_string_pretty(&body).unwrap() + "\n").unwrap();
        }
        let committed: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            body, committed,
            "{golden} is not what arbor prompt prints; if the change is meant, \
             run `BLESS=1 cargo test -p arbor-tests --test prompt first_request_bodies` and commit it"
        );
    }
}

/// Writes `files` (path, text) below a new temporary folder.
fn write_tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

/// The text of every tool result `agent`'s model was sent, in order.
fn tool_results(models: &RecordingModels, agent: &str) -> Vec<(String, bool)> {
    let requests = models.requests(agent);
    let last = requests.last().expect("the agent made requests");
    last.messages
        .iter()
        .filter_map(|m| match m {
            arbor_actors::model::Message::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

/// A planner that may read `deploy` over a worker that names `deploy` and
/// `style`; `style` is its parent's to give, and it is not.
const SKILLS_WORKSPACE: &[(&str, &str)] = &[
    (
        "skills/deploy/SKILL.md",
        "---\nname: deploy\ndescription: How to ship a release,\n  with its checklist.\nlicense: MIT\n---\nDEPLOY-BODY: follow checklist.md.\n",
    ),
    ("skills/deploy/checklist.md", "CHECKLIST-TEXT\n"),
    (
        "skills/style/SKILL.md",
        "---\nname: style\ndescription: The house style for reports.\n---\nSTYLE-BODY\n",
    ),
    (
        "agents/planner/agent.md",
        "---\nskills: [deploy]\nsubagents: [worker]\nscript:\n  - call: {tool: read_skill, args: {name: deploy}}\n  - call: {tool: read_skill, args: {name: deploy, file: checklist.md}}\n  - call: {tool: read_skill, args: {name: deploy, file: ../style/SKILL.md}}\n  - call: {tool: read_skill, args: {name: style}}\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: ship it}]}}\n  - call: {tool: submit_output, args: {output: shipped}}\n---\nYou are the planner.\n",
    ),
    (
        "agents/worker/agent.md",
        "---\ndescription: Ships what it is asked to.\nskills: [deploy, style]\nscript:\n  - call: {tool: read_skill, args: {name: style}}\n  - call: {tool: read_skill, args: {name: deploy}}\n  - call: {tool: submit_output, args: {output: done}}\n---\nYou are the worker.\n",
    ),
    (
        "agents/loner/agent.md",
        "---\nscript:\n  - call: {tool: submit_output, args: {output: alone}}\n---\nYou work alone.\n",
    ),
];

/// A skill listed in the prompt, read on demand (its body, a file beside
/// it, never a path out of its folder), and refused to a child whose
/// parent lacks it.
#[tokio::test(flavor = "multi_thread")]
async fn inv_25_a_child_reads_only_the_skills_its_parent_may() {
    use arbor_actors::agent_loop::SKILLS_HEADING;
    let ws = write_tree(SKILLS_WORKSPACE);
    let models = RecordingModels::new();
    let node = TestNode::start_dir_with(ws.path(), models.clone()).await;
    let run = node.run_agent("planner", "Ship.").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);

    // Listed: the planner's own skill, with its description on one line,
    // and the tool to read it.
    let first = &models.requests("planner")[0];
    let listing = &first.system[first.system.find(SKILLS_HEADING).expect("skills listed")..];
    assert!(
        listing.contains("\n- `deploy`: How to ship a release, with its checklist.\n"),
        "{listing}"
    );
    assert!(!listing.contains("style"), "{listing}");
    assert!(
        !first.system.contains("DEPLOY-BODY"),
        "the body is read on demand"
    );
    assert!(first.tools.iter().any(|t| &*t.name == "read_skill"));

    // Read on demand: the body, a file beside it; never a path out of it,
    // nor a skill the agent does not name.
    let read = tool_results(&models, "planner");
    assert_eq!(read[0], ("DEPLOY-BODY: follow checklist.md.".into(), false));
    assert_eq!(read[1], ("CHECKLIST-TEXT\n".into(), false));
    assert!(
        read[2].1 && read[2].0.contains("leaves the skill's folder"),
        "{:?}",
        read[2]
    );
    assert!(!read[2].0.contains("STYLE-BODY"));
    assert!(
        read[3].1
            && read[3]
                .0
                .contains("not among this agent's skills; read one of: deploy"),
        "{:?}",
        read[3]
    );

    // The worker names style, but its parent may not read it (I-25): not
    // listed, and refused with the reason.
    let worker = &models.requests("worker")[0];
    let listing = &worker.system[worker.system.find(SKILLS_HEADING).unwrap()..];
    assert!(
        listing.contains("`deploy`") && !listing.contains("`style`"),
        "{listing}"
    );
    let read = tool_results(&models, "worker");
    assert!(
        read[0].1 && read[0].0.contains("its parent may not read it"),
        "{:?}",
        read[0]
    );
    assert_eq!(read[1], ("DEPLOY-BODY: follow checklist.md.".into(), false));

    // An agent with no skills is shown neither the section nor the tool.
    let run = node.run_agent("loner", "Go.").await;
    assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    let alone = &models.requests("loner")[0];
    assert!(!alone.system.contains(SKILLS_HEADING));
    assert!(alone.tools.iter().all(|t| &*t.name != "read_skill"));
}

#[test]
fn a_skill_an_agent_names_must_be_in_the_workspace_and_well_formed() {
    let load = |extra: &[(&str, &str)]| {
        let mut files: Vec<(&str, &str)> = SKILLS_WORKSPACE.to_vec();
        files.extend_from_slice(extra);
        let ws = write_tree(&files);
        arbor_runtime::Workspace::load(ws.path())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(load(&[]), Ok(()));
    // A recording names the skills its agents can read (I-49): a replay
    // says which changed.
    let ws = write_tree(SKILLS_WORKSPACE);
    let workspace = arbor_runtime::Workspace::load(ws.path()).unwrap();
    let spec = workspace.agent_run("planner", "Ship.", None).unwrap();
    let digests = workspace.digests_for(&spec);
    for skill in ["deploy", "style"] {
        assert!(
            digests.contains_key(&format!("skills/{skill}/SKILL.md")),
            "{digests:?}"
        );
    }
    let spec = workspace.agent_run("loner", "Go.", None).unwrap();
    assert!(
        !workspace
            .digests_for(&spec)
            .keys()
            .any(|k| k.starts_with("skills/"))
    );
    // `arbor check` says which skills a child names that its parent lacks.
    let ws = write_tree(SKILLS_WORKSPACE);
    let findings = arbor_runtime::check::check(ws.path());
    let said: Vec<String> = findings
        .iter()
        .map(|f| format!("{}: {}", f.file, f.message))
        .collect();
    assert!(
        said.iter().any(|f| f.starts_with(
            "agents/worker/agent.md: names skills style but its parent planner may not read them"
        )),
        "{said:?}"
    );
    let ghost = write_tree(&[("agents/a/agent.md", "---\nskills: [ghost]\n---\nA.\n")]);
    let said: Vec<String> = arbor_runtime::check::check(ghost.path())
        .iter()
        .map(|f| f.message.clone())
        .collect();
    assert!(
        said.iter().any(|m| m.contains("`ghost` is not a skill")),
        "{said:?}"
    );
    let err = load(&[("agents/extra/agent.md", "---\nskills: [ghost]\n---\nX\n")]).unwrap_err();
    assert!(
        err.contains("agents/extra/agent.md")
            && err.contains("`ghost` is not a skill in skills/ (it has: deploy, style)"),
        "{err}"
    );
    let err = load(&[(
        "skills/bad/SKILL.md",
        "---\nname: other\ndescription: d\n---\n",
    )])
    .unwrap_err();
    assert!(
        err.contains("skills/bad/SKILL.md") && err.contains("not its folder's name"),
        "{err}"
    );
    let err = load(&[("skills/bare/SKILL.md", "---\nname: bare\n---\nbody\n")]).unwrap_err();
    assert!(err.contains("description: missing"), "{err}");
    let err = load(&[("skills/empty/notes.md", "x")]).unwrap_err();
    assert!(err.contains("no SKILL.md"), "{err}");
}

/// I-63: a tenant's `instructions` reach every prompt of its runs, the
/// planner's and its sub-agent's alike, after the agent's own and before
/// the roster; a run of another tenant, or of none, is not told them.
#[tokio::test(flavor = "multi_thread")]
async fn inv_63_a_tenants_instructions_reach_every_prompt_of_its_runs() {
    use arbor_actors::agent_loop::{ROSTER_HEADING, TENANT_HEADING};
    let agents = roster_agents();
    let agents: Vec<(&str, &str)> = agents.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let models = RecordingModels::new();
    let toml =
        "[tenants.team-a]\ninstructions = \"TEAM-A-RULES: cite sources.\"\n\n[tenants.team-b]\n";
    let node = TestNode::start_full(Some(toml), &agents, models.clone()).await;
    let spec = node.workspace.agent_run("planner", "Plan.", None).unwrap();
    let spec = node.workspace.for_tenant("team-a", spec).unwrap();
    let run = node.node().start_run(spec).await.unwrap();
    let tree = node.wait_run(run).await;
    assert_eq!(tree.run_status(), Status::Done);
    assert_eq!(tree.tenant(), Some("team-a"));
    let planner = &models.requests("planner")[0].system;
    let own = planner.find("You are the planner.").unwrap();
    let shared = planner.find(TENANT_HEADING).expect("the team's heading");
    let roster = planner.find(ROSTER_HEADING).unwrap();
    assert!(own < shared && shared < roster, "{planner}");
    assert!(planner.contains("TEAM-A-RULES: cite sources."), "{planner}");
    let researcher = &models.requests("researcher")[0].system;
    assert!(
        researcher.starts_with("RESEARCHER-PROMPT-BODY") && researcher.contains("TEAM-A-RULES"),
        "{researcher}"
    );
    // Team b has none: its run's prompts are the agents' own.
    let spec = node
        .workspace
        .agent_run("researcher", "Find.", None)
        .unwrap();
    let spec = node.workspace.for_tenant("team-b", spec).unwrap();
    let run = node.node().start_run(spec).await.unwrap();
    node.wait_run(run).await;
    let last = models.requests("researcher").last().unwrap().system.clone();
    assert_eq!(&*last, "RESEARCHER-PROMPT-BODY");
    node.shutdown().await;
}

/// `[tenants.NAME]` is checked at load, each mistake named; a run is
/// refused to a tenant that may not run its flow or an agent it reaches.
#[test]
fn a_tenants_block_is_checked_at_load_and_its_lists_hold_at_admission() {
    let agents = roster_agents();
    let flow = "[[group]]\nsteps = [{ agent = \"planner\", instruction = \"plan\" }]\n";
    let load = |toml: &str| {
        let mut files: Vec<(String, String)> = agents
            .iter()
            .map(|(n, t)| (format!("agents/{n}/agent.md"), t.clone()))
            .collect();
        files.push(("flows/plan.toml".into(), flow.into()));
        files.push(("arbor.toml".into(), toml.into()));
        let files: Vec<(&str, &str)> = files
            .iter()
            .map(|(p, t)| (p.as_str(), t.as_str()))
            .collect();
        let ws = write_tree(&files);
        arbor_runtime::Workspace::load(ws.path()).map_err(|e| e.to_string())
    };
    for (toml, why) in [
        ("[tenants.team-a]\nquotas = 1\n", "unknown key `quotas`"),
        (
            "[tenants.team-a.quota]\ntokens_per_hour = 0\n",
            "quota.tokens_per_hour = 0 would admit nothing",
        ),
        (
            "[tenants.team-a.quota]\nusd_per_day = -1.0\n",
            "quota.usd_per_day must be more than 0 dollars",
        ),
        ("[tenants.team-a.quota]\n", "quota: empty"),
        (
            "[tenants.team-a]\nweight = 0\n",
            "weight = 0 would never start",
        ),
        (
            "[triggers.t]\nflow = \"ghost\"\nsecret = \"S\"\n",
            "triggers.t.flow: `ghost` is not one of the workspace's flows",
        ),
        (
            "[triggers.t]\nflow = \"plan\"\nsecret = \"not a name\"\n",
            "not a secret's name",
        ),
        (
            "[triggers.t]\nflow = \"plan\"\nsecret = \"S\"\ninput = \"data\"\n",
            "not a JSON Pointer",
        ),
        (
            "[limits.concurrency]\nper_flow = { ghost = 1 }\n",
            "limits.concurrency.per_flow: `ghost`",
        ),
        (
            "[limits.concurrency]\nper_tenant = 0\n",
            "per_tenant = 0 would run nothing",
        ),
        (
            "[tenants.team-a.quota]\nruns_per_hour = 5\n",
            "unknown key `runs_per_hour`",
        ),
        (
            "[tenants.team-a]\non_quota = \"queue\"\n",
            "without a [quota] has nothing to wait for",
        ),
        (
            "[tenants.team-a]\non_quota = \"wait\"\n",
            "unknown variant `wait`",
        ),
        ("[tenants.\"team a\"]\n", "is not a tenant's name"),
        (
            "[tenants.team-a]\nflows = []\n",
            "flows = [] would let it run nothing",
        ),
        (
            "[tenants.team-a]\nflows = [\"ghost\"]\n",
            "tenants.team-a.flows: `ghost`",
        ),
        (
            "[tenants.team-a]\nagents = [\"ghost\"]\n",
            "tenants.team-a.agents: `ghost`",
        ),
        (
            "[tenants.team-a]\ninstructions = \" \"\n",
            "instructions: empty",
        ),
    ] {
        let err = load(toml).unwrap_err();
        assert!(err.contains(why), "{toml}: {err}");
    }
    let ws = load(
        "[tenants.ops]\nflows = [\"plan\"]\nagents = [\"planner\", \"researcher\"]\n\
         on_quota = \"queue\"\n[tenants.ops.quota]\nusd_per_month = 12.5\nconcurrent_runs = 3\n",
    )
    .unwrap();
    let quotas = ws.quotas();
    let (quota, on_quota) = &quotas["ops"];
    assert_eq!(quota.usd_micros_per_month, Some(12_500_000));
    assert_eq!(quota.concurrent_runs, Some(3));
    assert_eq!(quota.tokens_per_hour, None);
    assert_eq!(*on_quota, arbor_runtime::workspace::OnQuota::Queue);
    assert_eq!(ws.tenant_names(), vec!["ops".to_string()]);
    let refused = |spec, tenant: &str| ws.for_tenant(tenant, spec).unwrap_err().to_string();
    // The planner reaches the coder, which the list leaves out.
    let plan = ws.flow_run("plan", None).unwrap();
    assert!(refused(plan, "ops").contains("may not run agent coder (plan reaches it)"));
    let solo = ws.agent_run("researcher", "Find.", None).unwrap();
    assert_eq!(ws.for_tenant("ops", solo.clone()).unwrap().tenant(), "ops");
    assert!(refused(solo.clone(), "default").contains("tenant default is not configured"));
    // Without [tenants], every run is the default tenant's, unchanged.
    let plain = load("").unwrap();
    assert_eq!(plain.for_tenant("default", solo.clone()).unwrap(), solo);
    assert!(plain.for_tenant("ops", solo).is_err());
}

/// An agent's `budget.per_run` loads as tokens and micro-dollars; one
/// that says neither, or 0, or something else, is refused naming it; its
/// `budget.tokens` and `usd` load as before.
#[test]
fn an_agents_per_run_budget_loads_and_a_bad_one_is_refused_naming_it() {
    let load = |budget: &str| {
        let text = format!("---\ndescription: d\nbudget: {budget}\n---\nA.\n");
        let ws = write_tree(&[("agents/a/agent.md", text.as_str())]);
        arbor_runtime::Workspace::load(ws.path())
            .map(|ws| {
                ws.agents
                    .get("a")
                    .map(|a| (a.budget_tokens, a.budget_usd_micros, a.per_run))
            })
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        load("{tokens: 100, per_run: {tokens: 1000, usd: 0.25}}").unwrap(),
        Some((
            Some(100),
            None,
            Some(arbor_protocol::PerRun {
                tokens: Some(1_000),
                usd_micros: Some(250_000)
            })
        ))
    );
    for bad in [
        "{per_run: {}}",
        "{per_run: {tokens: 0}}",
        "{per_run: {usd: -1}}",
    ] {
        let refused = load(bad).unwrap_err();
        assert!(
            refused.contains("agents/a/agent.md") && refused.contains("per_run"),
            "{bad}: {refused}"
        );
    }
    assert_eq!(
        load("{tokens: 100, usd: 0.5}").unwrap(),
        Some((Some(100), Some(500_000), None))
    );
    assert!(
        load("{tokens: 100, weekly: 5}")
            .unwrap_err()
            .contains("weekly")
    );
}
