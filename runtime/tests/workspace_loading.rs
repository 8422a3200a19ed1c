//! Loading a user's workspace: what loads, and the one-line error for what doesn't.

use arbor_protocol::{
    AgentDef, FlowGroup, McpTransport, ModelRef, Network, SandboxMode, ScriptCall, ScriptTurn,
    ScriptUsage, StepSpec, ToolName,
};
use arbor_runtime::workspace::{LoadError, Workspace, parse_agent};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

const PLANNER: &str = "\
---
description: Splits a question into parts
model: scripted
tools: [exec, read_file]
deny: [write_file]
subagents: [researcher]
sandbox: own
network: open
budget: { tokens: 5000 }
max_turns: 7
timeout: 5m
script:
  - say: thinking
    call: { tool: delegate, args: { jobs: [{ agent: researcher, request: go }] } }
    usage: { input: 10, output: 20 }
    delay: 250ms
  - call:
      - { tool: collect }
      - { tool: read_file, args: { path: notes.md } }
  - say: done
---
You plan.
";

const RESEARCHER: &str = "---\ndescription: Finds things out\n---\nYou research.\n";

const FLOW: &str = r#"
budget = { tokens = 20000 }
timeout = "10m"
[[group]]
steps = [{ agent = "planner", instruction = "Plan it", label = "plan" }]
[[group]]
steps = [{ agent = "researcher", instruction = "Check it" }]
"#;

/// A workspace of a planner and its researcher, with one flow and no arbor.toml.
fn workspace(arbor_toml: Option<&str>, flow: &str) -> Result<Workspace, LoadError> {
    Workspace::from_texts(
        PathBuf::from("ws"),
        arbor_toml,
        &[("planner", PLANNER), ("researcher", RESEARCHER)],
        &[("research", flow)],
    )
}

/// The error of loading these agents alone.
fn agents_error(agents: &[(&str, &str)]) -> String {
    let error = Workspace::from_texts(PathBuf::from("ws"), None, agents, &[]).unwrap_err();
    let message = error.to_string();
    assert!(!message.contains('\n'), "not one line: {message}");
    message
}

/// The error of parsing one agent.md whose front matter is `yaml`.
fn front_matter_error(yaml: &str) -> String {
    let text = format!("---\n{yaml}---\nprompt\n");
    let message = parse_agent("planner", &text, Path::new("agents/planner/agent.md"))
        .unwrap_err()
        .to_string();
    assert!(!message.contains('\n'), "not one line: {message}");
    message
}

fn write(dir: &Path, path: &str, text: &str) {
    let path = dir.join(path);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

#[test]
fn a_full_workspace_loads_with_every_field_mapped() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "arbor.toml",
        "[limits]\ndepth = 3\n[budget]\ntokens = 777\n",
    );
    write(dir.path(), "agents/planner/agent.md", PLANNER);
    write(dir.path(), "agents/researcher/agent.md", RESEARCHER);
    write(dir.path(), "agents/README.md", "loose files are ignored");
    write(dir.path(), "flows/research.toml", FLOW);

    let ws = Workspace::load(dir.path()).unwrap();

    assert_eq!(ws.root, dir.path());
    assert_eq!(ws.config.limits.depth, 3);
    assert_eq!(ws.config.limits.fan_out, 16);
    assert_eq!(ws.config.budget_tokens, 777);
    let planner = AgentDef {
        budget_usd_micros: None,
        per_run: None,
        name: "planner".into(),
        description: Some("Splits a question into parts".into()),
        model: ModelRef::Scripted,
        tools: vec![ToolName::Exec, ToolName::ReadFile],
        mcp: vec![],
        limits: Default::default(),
        deny: vec!["write_file".into()],
        approve: vec![],
        hooks: Default::default(),
        subagents: vec!["researcher".into()],
        sandbox: SandboxMode::Own,
        network: Network::Open,
        secrets: vec![],
        budget_tokens: Some(5000),
        max_turns: Some(7),
        max_repeats: None,
        skills: vec![],
        settings: Default::default(),
        models: vec![],
        fallback: vec![],
        timeout: Some(Duration::from_secs(300)),
        script: vec![
            ScriptTurn {
                say: Some("thinking".into()),
                calls: vec![ScriptCall {
                    tool: "delegate".into(),
                    args: json!({ "jobs": [{ "agent": "researcher", "request": "go" }] }),
                }],
                usage: Some(ScriptUsage {
                    input: 10,
                    output: 20,
                }),
                delay: Some(Duration::from_millis(250)),
            },
            ScriptTurn {
                calls: vec![
                    ScriptCall {
                        tool: "collect".into(),
                        args: json!({}),
                    },
                    ScriptCall {
                        tool: "read_file".into(),
                        args: json!({ "path": "notes.md" }),
                    },
                ],
                ..ScriptTurn::default()
            },
            ScriptTurn {
                say: Some("done".into()),
                ..ScriptTurn::default()
            },
        ]
        .into(),
        prompt: "You plan.".into(),
        resources: arbor_runtime::workspace::DEFAULT_SANDBOX,
    };
    assert_eq!(ws.agents["planner"], planner);

    let researcher = &ws.agents["researcher"];
    assert_eq!(researcher.model, ModelRef::Scripted);
    assert_eq!(
        (researcher.sandbox, researcher.network),
        (SandboxMode::Shared, Network::None)
    );
    assert!(researcher.script.is_empty() && researcher.tools.is_empty());

    let run = ws.flow_run("research", None).unwrap();
    assert_eq!(run.flow, "research");
    assert_eq!(run.budget_tokens, 20000);
    assert_eq!(run.timeout, Some(Duration::from_secs(600)));
    assert_eq!(
        run.groups[0],
        FlowGroup {
            peers: false,
            steps: vec![StepSpec {
                agent: "planner".into(),
                instruction: "Plan it".into(),
                label: Some("plan".into()),
                retries: None,
                optional: false,
                retry: None,
                rerun_interrupted: None,
                on_fail: None,
                approve: false,
                until: None,
            }],
        }
    );
    assert_eq!(run.groups[1].steps[0].label, None);
}

#[test]
fn a_missing_directory_and_an_empty_agents_folder_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    assert_eq!(
        Workspace::load(&missing).unwrap_err().to_string(),
        format!("{}: not a directory", missing.display())
    );
    std::fs::create_dir(dir.path().join("agents")).unwrap();
    assert_eq!(
        Workspace::load(dir.path()).unwrap_err().to_string(),
        format!("{}: no agents found", dir.path().join("agents").display())
    );
}

#[test]
fn an_unknown_front_matter_key_names_the_key_and_the_file() {
    let message = front_matter_error("description: x\ndepth: 3\n");
    assert!(
        message.starts_with("agents/planner/agent.md: front matter: unknown key `depth`"),
        "{message}"
    );
    assert!(message.contains("at line 3"), "{message}");
}

#[test]
fn a_file_without_front_matter_is_refused() {
    let message = agents_error(&[("planner", "You plan.\n")]);
    assert_eq!(
        message,
        "agents/planner/agent.md: no front matter: the file must start with a `---` line"
    );
}

#[test]
fn bad_yaml_is_one_line_naming_the_file() {
    let message = front_matter_error("subagents: [researcher\n");
    assert!(
        message.starts_with("agents/planner/agent.md: front matter: "),
        "{message}"
    );
    let message = front_matter_error("max_turns: -1\n");
    assert!(
        message.contains("front matter: max_turns: invalid u32 at line 2"),
        "{message}"
    );
}

#[test]
fn an_unknown_key_in_arbor_toml_is_named() {
    let message = workspace(Some("[limits]\ndepht = 3\n"), FLOW)
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("arbor.toml: unknown key `depht`"),
        "{message}"
    );
    assert!(message.ends_with("at line 2, column 1"), "{message}");
}

#[test]
fn limits_out_of_range_are_refused() {
    let message = workspace(Some("[limits]\ngrant_fraction = 1.5\n"), FLOW).unwrap_err();
    assert_eq!(
        message.to_string(),
        "arbor.toml: limits.grant_fraction must be in (0, 1], got 1.5"
    );
    let message = workspace(Some("[limits]\nmax_recoveries = 0\n"), FLOW).unwrap_err();
    assert!(
        message
            .to_string()
            .contains("limits.max_recoveries must be at least 1"),
        "{message}"
    );
}

#[test]
fn approvals_are_read_and_a_bad_setting_is_named() {
    let ws = workspace(
        Some(
            "[approvals]\ntools = [\"exec\", \"mcp__pay__*\"]\ntimeout = \"15m\"\nwarn_at = 0.5\n",
        ),
        FLOW,
    )
    .unwrap();
    assert_eq!(ws.config.approvals.tools, ["exec", "mcp__pay__*"]);
    assert_eq!(ws.config.approvals.timeout, Duration::from_secs(900));
    assert_eq!(ws.config.approvals.warn_at, 0.5);
    let defaults = workspace(None, FLOW).unwrap().config.approvals;
    assert_eq!(
        (defaults.timeout, defaults.warn_at),
        (Duration::from_secs(3600), 0.8)
    );
    for (toml, expected) in [
        (
            "warn_at = 1.5",
            "approvals.warn_at must be a share of the wait between 0 and 1",
        ),
        ("warn_at = 0", "approvals.warn_at must be a share"),
        ("timeout = \"0s\"", "approvals.timeout: a timeout of 0"),
        ("timeout = \"soon\"", "approvals.timeout:"),
        (
            "tools = [\"submit_output\"]",
            "approvals.tools: submit_output cannot wait",
        ),
        (
            "tools = [\"depoly\"]",
            "approvals.tools: \"depoly\" is not a tool",
        ),
        ("tool = [\"exec\"]", "unknown key `tool`"),
    ] {
        let message = workspace(Some(&format!("[approvals]\n{toml}\n")), FLOW)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("arbor.toml: ") && message.contains(expected),
            "{toml}: {message}"
        );
    }
}

#[test]
fn an_unknown_key_in_a_flow_is_named() {
    let flow = FLOW.replace("label =", "lable =");
    let message = workspace(None, &flow).unwrap_err().to_string();
    assert!(
        message.starts_with("flows/research.toml: unknown key `lable`"),
        "{message}"
    );
}

#[test]
fn a_sub_agent_needs_a_description() {
    let message = agents_error(&[
        ("planner", "---\nsubagents: [researcher]\n---\n"),
        ("researcher", "---\n---\n"),
    ]);
    assert_eq!(
        message,
        "agents/researcher/agent.md: `description` is required: planner offers it as a sub-agent"
    );
}

#[test]
fn a_sub_agent_in_its_own_sandbox_that_would_delegate_is_refused() {
    let message = agents_error(&[
        ("planner", "---\nsubagents: [lead]\n---\n"),
        (
            "lead",
            "---\ndescription: leads\nsandbox: own\nsubagents: [helper]\n---\n",
        ),
        ("helper", "---\ndescription: helps\n---\n"),
    ]);
    assert_eq!(
        message,
        "agents/lead/agent.md: `sandbox: own` with `subagents`: as planner's sub-agent it may not delegate (I-26); drop one"
    );
}

#[test]
fn an_unknown_subagent_is_refused() {
    let message = agents_error(&[("planner", "---\nsubagents: [ghost]\n---\n")]);
    assert_eq!(
        message,
        "agents/planner/agent.md: subagent `ghost` is not an agent in agents/"
    );
}

#[test]
fn a_flow_naming_an_unknown_agent_is_refused() {
    let flow = FLOW.replace("\"researcher\"", "\"writr\"");
    let message = workspace(None, &flow).unwrap_err().to_string();
    assert_eq!(
        message,
        "flows/research.toml: step 1 of group 2 names unknown agent `writr`"
    );
}

#[test]
fn a_rescuer_must_be_an_agent() {
    let flow = FLOW.replace(
        "instruction = \"Check it\"",
        "instruction = \"Check it\", on_fail = \"nobody\"",
    );
    let message = workspace(None, &flow).unwrap_err().to_string();
    assert_eq!(
        message,
        "flows/research.toml: step 1 of group 2 names unknown agent `nobody` in on_fail"
    );
    let flow = FLOW.replace(
        "instruction = \"Check it\"",
        "instruction = \"Check it\", on_fail = \"planner\"",
    );
    let run = workspace(None, &flow)
        .unwrap()
        .flow_run("research", None)
        .unwrap();
    assert_eq!(run.groups[1].steps[0].on_fail.as_deref(), Some("planner"));
}

#[test]
fn a_retry_policy_is_read_and_one_that_could_not_hold_is_refused_naming_the_step() {
    let with = |retry: &str| {
        FLOW.replace(
            "instruction = \"Check it\"",
            &format!("instruction = \"Check it\", retry = {retry}"),
        )
    };
    let ws = workspace(
        None,
        &with(r#"{ attempts = 3, wait = "15s", backoff = 2.0 }"#),
    )
    .unwrap();
    let run = ws.flow_run("research", None).unwrap();
    let retry = run.groups[1].steps[0].retry.clone().expect("read");
    assert_eq!(
        (retry.attempts, retry.wait_before(3)),
        (3, Duration::from_secs(30))
    );
    for (retry, says) in [
        (
            r#"{ attempts = 2, on = ["model_auth"] }"#,
            "flows/research.toml: step 1 of group 2: retry.on names `model_auth`, which is never tried again",
        ),
        (
            "{ attempts = 0 }",
            "flows/research.toml: step 1 of group 2: retry.attempts is 0",
        ),
        (
            r#"{ attempts = 2, on = ["tiredness"] }"#,
            "unknown variant `tiredness`",
        ),
    ] {
        let message = workspace(None, &with(retry)).unwrap_err().to_string();
        assert!(message.contains(says), "{retry}: {message}");
    }
}

#[test]
fn zero_negative_and_fractional_budgets_are_refused_everywhere() {
    for tokens in ["0", "-5", "1.5"] {
        let agent = front_matter_error(&format!("budget: {{ tokens: {tokens} }}\n"));
        assert!(
            agent.starts_with("agents/planner/agent.md: budget.tokens must be"),
            "{agent}"
        );

        let flow = FLOW.replace("tokens = 20000", &format!("tokens = {tokens}"));
        let flow = workspace(None, &flow).unwrap_err().to_string();
        assert!(
            flow.starts_with("flows/research.toml: budget.tokens must be"),
            "{flow}"
        );

        let config = workspace(Some(&format!("[budget]\ntokens = {tokens}\n")), FLOW);
        let config = config.unwrap_err().to_string();
        assert!(
            config.starts_with("arbor.toml: budget.tokens must be"),
            "{config}"
        );
    }
}

const PROVIDERS: &str = r#"
[providers.local]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
api_key_env = "LOCAL_API_KEY"
[providers.local.models.small]
id = "gpt-4o-mini"
context_window = 128000
max_output_tokens = 4096
"#;

fn with_model(arbor_toml: Option<&str>, model: &str) -> Result<Workspace, LoadError> {
    let agent = format!("---\nmodel: {model}\n---\nYou plan.\n");
    Workspace::from_texts(
        PathBuf::from("ws"),
        arbor_toml,
        &[("planner", agent.as_str())],
        &[],
    )
}

#[test]
fn an_agent_names_a_provider_model_of_arbor_toml() {
    let ws = with_model(Some(PROVIDERS), "local/small").unwrap();
    assert_eq!(
        ws.agents["planner"].model,
        arbor_protocol::ModelRef::Provider {
            provider: "local".into(),
            model: "small".into()
        }
    );
    let provider = &ws.config.providers["local"];
    assert_eq!(provider.models["small"].id, "gpt-4o-mini");
    assert_eq!(provider.api_key_env.as_deref(), Some("LOCAL_API_KEY"));
}

#[test]
fn an_unknown_provider_or_model_names_the_agent_file_and_the_key() {
    let message = with_model(Some(PROVIDERS), "cloud/small")
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "agents/planner/agent.md: model: `cloud/small`: arbor.toml has no [providers.cloud] (known: local)"
    );
    let message = with_model(Some(PROVIDERS), "local/large")
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("agents/planner/agent.md: model: `local/large`"),
        "{message}"
    );
    assert!(message.contains("(known: small)"), "{message}");
    let message = with_model(None, "local/small").unwrap_err().to_string();
    assert!(message.contains("(known: none)"), "{message}");
    assert!(front_matter_error("model: gpt\n").contains("model: `gpt` is not known"));
    assert!(front_matter_error("model: a/b/c\n").contains("is not known"));
}

#[test]
fn a_malformed_provider_block_names_arbor_toml_and_the_key() {
    let cases = [
        (
            PROVIDERS.replace("kind = \"openai\"", "kind = \"gemini\""),
            "arbor.toml: unknown variant `gemini`",
        ),
        (
            PROVIDERS.replace(
                "max_output_tokens = 4096",
                "max_output_tokens = 4096\nseed = 7",
            ),
            "arbor.toml: unknown key `seed`",
        ),
        (
            PROVIDERS.replace("id = \"gpt-4o-mini\"\n", ""),
            "arbor.toml: missing field `id`",
        ),
        (
            PROVIDERS.replace("http://127.0.0.1:8000/v1", "127.0.0.1:8000"),
            "arbor.toml: providers.local.base_url",
        ),
        (
            PROVIDERS.replace("context_window = 128000", "context_window = -5"),
            "arbor.toml: providers.local.models.small.context_window: must be at least 1, got -5",
        ),
    ];
    for (text, words) in cases {
        let message = with_model(Some(&text), "local/small")
            .unwrap_err()
            .to_string();
        assert!(message.starts_with(words), "{words:?}: {message}");
        assert!(!message.contains('\n'), "not one line: {message}");
    }
}

#[test]
fn only_sandbox_tools_may_be_listed() {
    let message = front_matter_error("tools: [exec, delegate]\n");
    assert!(
        message.contains(
            "tools: `delegate` cannot be named (tools may name exec, read_file, write_file"
        ),
        "{message}"
    );
}

#[test]
fn a_name_must_match_its_folder_and_be_lowercase() {
    assert!(
        front_matter_error("name: boss\n").contains("name `boss` differs from the folder name")
    );
    let message = agents_error(&[("Planner", RESEARCHER)]);
    assert!(
        message.starts_with("agents/Planner/agent.md: agent name \"Planner\" must be"),
        "{message}"
    );
}

#[test]
fn call_is_one_mapping_or_a_list_of_them() {
    let text = "---\nscript:\n  - call: { tool: exec, args: { command: ls } }\n  - call: [{ tool: a }, { tool: b }]\n  - {}\n---\n";
    let agent = parse_agent("planner", text, Path::new("agent.md")).unwrap();
    let tools: Vec<Vec<&str>> = agent
        .script
        .iter()
        .map(|t| t.calls.iter().map(|c| c.tool.as_str()).collect())
        .collect();
    assert_eq!(tools, [vec!["exec"], vec!["a", "b"], vec![]]);
    assert_eq!(agent.script[1].calls[0].args, json!({}));
    assert_eq!(agent.script[2], ScriptTurn::default());
}

#[test]
fn a_bad_call_says_what_is_wrong_inside_it() {
    let message = front_matter_error("script:\n  - call: { tool: exec, argz: {} }\n");
    assert!(
        message.contains("script turn 1, call 1: unknown key `argz`"),
        "{message}"
    );
    let message = front_matter_error("script:\n  - call: { tool: exec, args: [ls] }\n");
    assert!(
        message.ends_with("script turn 1, call 1: args must be a mapping, got a list"),
        "{message}"
    );
}

#[test]
fn a_bad_delay_or_timeout_is_refused() {
    let message = front_matter_error("script:\n  - say: hi\n    delay: soon\n");
    assert!(
        message.contains("script turn 1: delay: bad duration \"soon\""),
        "{message}"
    );
    assert!(
        front_matter_error("timeout: 0s\n").contains("timeout: a timeout of 0 would stop at once")
    );
    assert!(front_matter_error("max_turns: 0\n").contains("max_turns must be at least 1"));
}

#[test]
fn flow_run_budget_is_override_then_flow_then_config() {
    let config = Some("[budget]\ntokens = 300\n");
    let with_budget = workspace(config, FLOW).unwrap();
    let without = workspace(config, &FLOW.replace("budget = { tokens = 20000 }", "")).unwrap();

    assert_eq!(
        with_budget
            .flow_run("research", Some(5))
            .unwrap()
            .budget_tokens,
        5
    );
    assert_eq!(
        with_budget
            .flow_run("research", None)
            .unwrap()
            .budget_tokens,
        20000
    );
    assert_eq!(
        without.flow_run("research", None).unwrap().budget_tokens,
        300
    );
    assert_eq!(
        workspace(None, FLOW).unwrap().config.budget_tokens,
        1_000_000
    );
    assert!(matches!(
        with_budget.flow_run("research", Some(0)),
        Err(LoadError::ZeroBudgetOverride)
    ));
}

#[test]
fn unknown_flows_and_agents_are_named_at_run_time() {
    let ws = workspace(None, FLOW).unwrap();
    assert_eq!(
        ws.flow_run("reserch", None).unwrap_err().to_string(),
        "flows/reserch.toml: no such flow (known: research)"
    );
    assert!(ws.agent_run("ghost", "hi", None).is_err());

    let run = ws.agent_run("researcher", "hi", Some(9)).unwrap();
    assert_eq!(
        (run.flow.as_str(), run.budget_tokens),
        ("agent:researcher", 9)
    );
    assert_eq!(run.groups[0].steps[0].instruction, "hi");
}

#[test]
fn secret_names_must_be_environment_names_and_sandbox_keys_are_checked() {
    let ok = parse_agent(
        "solo",
        "---\nsecrets: [API_KEY, _X2]\n---\nhi\n",
        Path::new("agents/solo/agent.md"),
    )
    .unwrap();
    assert_eq!(ok.secrets, ["API_KEY", "_X2"]);
    for bad in ["1KEY", "MY-KEY", "PATH", "\"\""] {
        let text = format!("---\nsecrets: [{bad}]\n---\nhi\n");
        let err = parse_agent("solo", &text, Path::new("agents/solo/agent.md"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("agents/solo/agent.md: secrets:"),
            "{bad}: {err}"
        );
    }
    let config = |toml: &str| {
        Workspace::from_texts(
            PathBuf::from("ws"),
            Some(toml),
            &[("solo", "---\n---\nhi\n")],
            &[],
        )
        .map(|w| w.config)
    };
    let c = config("[sandbox]\nmode = \"none\"\nsecrets_file = \"s.env\"\nmemory = \"1GiB\"\n")
        .unwrap();
    assert_eq!(c.isolation, arbor_sandbox::seal::SandboxIsolation::None);
    assert_eq!(c.secrets_file, Some(PathBuf::from("ws/s.env")));
    assert_eq!(c.sandbox.memory_bytes, Some(1 << 30));
    assert_eq!(
        c.sandbox.processes, None,
        "no process limit unsealed, by default"
    );
    assert_eq!(
        config("").unwrap().sandbox.processes,
        Some(512),
        "sealed: 512"
    );
    for (toml, key) in [
        ("[sandbox]\nmode = \"chroot\"\n", "chroot"),
        ("[sandbox]\nnetwork = \"open\"\n", "network"),
    ] {
        let err = config(toml).unwrap_err().to_string();
        assert!(
            err.starts_with("arbor.toml:") && err.contains(key),
            "{toml}: {err}"
        );
    }
    let err = parse_agent(
        "solo",
        "---\nnetwork: internet\n---\nhi\n",
        Path::new("agents/solo/agent.md"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("network") && err.contains("internet"), "{err}");
}

#[test]
fn usd_budgets_load_as_micro_dollars_everywhere_they_are_written() {
    let agent = "---\nbudget: { usd: 2.5 }\n---\nYou plan.\n";
    let flow = "budget = { usd = 0.25 }\n[[group]]\nsteps = [{ agent = \"planner\", instruction = \"go\" }]\n";
    let ws = Workspace::from_texts(
        PathBuf::from("ws"),
        Some("[budget]\nusd = 0.5\n"),
        &[("planner", agent)],
        &[("f", flow)],
    )
    .unwrap();
    assert_eq!(ws.agents["planner"].budget_usd_micros, Some(2_500_000));
    assert_eq!(ws.config.budget_usd_micros, Some(500_000));
    assert_eq!(
        ws.flow_run("f", None).unwrap().budget_usd_micros,
        Some(250_000)
    );
    assert_eq!(
        ws.agent_run("planner", "x", None)
            .unwrap()
            .budget_usd_micros,
        Some(500_000)
    );
    let spec = ws.agent_run("planner", "x", None).unwrap();
    assert_eq!(
        ws.with_usd_ceiling(spec, 7).unwrap().budget_usd_micros,
        Some(7)
    );
}

#[test]
fn zero_negative_and_not_a_number_dollars_are_refused() {
    for usd in ["0", "-1.5", ".nan", ".inf", "0.0000001", "nan"] {
        let message = front_matter_error(&format!("budget: {{ usd: {usd} }}\n"));
        assert!(message.contains("usd"), "{usd}: {message}");
    }
    let error = Workspace::from_texts(
        PathBuf::from("ws"),
        Some("[budget]\nusd = nan\n"),
        &[("a", "---\n---\nx\n")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.starts_with("arbor.toml: budget.usd must be more than 0"),
        "{error}"
    );
}

#[test]
fn a_usd_ceiling_over_a_model_with_no_price_is_refused_at_load() {
    let agent = "---\nmodel: local/small\nbudget: { usd: 1 }\n---\nYou plan.\n";
    let message = Workspace::from_texts(
        PathBuf::from("ws"),
        Some(PROVIDERS),
        &[("planner", agent)],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.starts_with("agents/planner/agent.md: budget.usd: model local/small has no price"),
        "{message}"
    );
    // The run's ceiling in arbor.toml covers every agent, sub-agents included.
    let planner = "---\nsubagents: [helper]\n---\nYou plan.\n";
    let helper = "---\nmodel: local/small\ndescription: helps\n---\nYou help.\n";
    let toml = format!("[budget]\nusd = 0.5\n{PROVIDERS}");
    let message = Workspace::from_texts(
        PathBuf::from("ws"),
        Some(&toml),
        &[("planner", planner), ("helper", helper)],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        message.starts_with(
            "arbor.toml: budget.usd: agent helper uses local/small, which has no price"
        ),
        "{message}"
    );
    // --budget-usd on a run that reaches it.
    let ws = Workspace::from_texts(
        PathBuf::from("ws"),
        Some(PROVIDERS),
        &[("planner", planner), ("helper", helper)],
        &[],
    )
    .unwrap();
    let spec = ws.agent_run("planner", "x", None).unwrap();
    let message = ws.with_usd_ceiling(spec, 1_000).unwrap_err().to_string();
    assert!(
        message.contains("agent helper uses local/small, which has no price"),
        "{message}"
    );
}

#[test]
fn resources_narrow_the_nodes_sandbox_and_default_to_it() {
    let ws = Workspace::from_texts(
        PathBuf::from("ws"),
        Some("[sandbox]\nmemory = \"1GiB\"\nprocesses = 100\n"),
        &[
            (
                "tight",
                "---\nresources: {memory: 512MiB, cpu: 30s, file_size: 1MiB, open_files: 64, processes: 50}\n---\n",
            ),
            ("loose", "---\n---\n"),
        ],
        &[],
    )
    .unwrap();
    let tight = ws.agents["tight"].resources;
    assert_eq!(tight.memory_bytes, Some(512 << 20));
    assert_eq!(tight.cpu_secs, Some(30));
    assert_eq!(tight.file_size_bytes, Some(1 << 20));
    assert_eq!(tight.open_files, Some(64));
    assert_eq!(tight.processes, Some(50));
    let loose = ws.agents["loose"].resources;
    assert_eq!(loose.memory_bytes, Some(1 << 30), "the node's [sandbox]");
    assert_eq!(loose.processes, Some(100));
    assert_eq!(
        loose.cpu_secs,
        arbor_runtime::workspace::DEFAULT_SANDBOX.cpu_secs,
        "what [sandbox] leaves out, the built-in default"
    );
}

#[test]
fn bad_resources_are_refused_naming_the_file_and_the_key() {
    for (front, words) in [
        (
            "resources: {open_files: 0}",
            "resources.open_files: must be at least 1",
        ),
        ("resources: {processes: -3}", "processes"),
        (
            "resources: {memory: lots}",
            "resources.memory: \"lots\" is not a size",
        ),
        (
            "resources: {memory: 0B}",
            "resources.memory: must be more than 0",
        ),
        ("resources: {cpu: 10ms}", "resources.cpu: at least 1s"),
        (
            "resources: {cpu: soon}",
            "resources.cpu: \"soon\" is not a duration",
        ),
        ("resources: {gpu: 1}", "gpu"),
        (
            "resources: {memory: 64GiB}",
            "resources.memory: 68719476736 is above the node's [sandbox] memory",
        ),
    ] {
        let message = agents_error(&[("greedy", &format!("---\n{front}\n---\n"))]);
        assert!(
            message.starts_with("agents/greedy/agent.md: ") && message.contains(words),
            "{front}: {message}"
        );
    }
    let error = Workspace::from_texts(
        PathBuf::from("ws"),
        Some("[sandbox]\nopen_files = 0\n"),
        &[("a", "---\n---\n")],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("arbor.toml") && error.contains("sandbox.open_files"),
        "{error}"
    );
}

/// Found by the parsing properties (tests/tests/parsing_properties.rs): an
/// error inside a value whose key is preceded by a character wider than a
/// byte cut the line inside that character, and panicked.
#[test]
fn an_error_after_a_wide_character_is_reported_not_a_panic() {
    for yaml in [
        "resources: {memory: 25ৗ:B, pids: 32}\n",
        "resources: {memory: 256MiBé:x}\n",
        "timeout: ৗ:2m:x\n",
    ] {
        let error = front_matter_error(yaml);
        assert!(error.contains("agent.md"), "{yaml}: {error}");
    }
}

/// arbor.toml with two MCP servers, and the agents that name them.
fn with_mcp(arbor_toml: &str, front_matter: &str) -> Result<Workspace, LoadError> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("tools")).unwrap();
    Workspace::from_texts(
        dir.path().to_path_buf(),
        Some(arbor_toml),
        &[("user", &format!("---\n{front_matter}---\nprompt\n"))],
        &[],
    )
}

const SERVERS: &str = r#"
[mcp.servers.fs]
command = "mcp-server-filesystem"
args = ["."]
env = { LOG_LEVEL = "warn" }
secrets = ["GITHUB_TOKEN"]
network = "open"
read_only = ["tools"]
call_timeout = "5s"
start_timeout = "2s"
[mcp.servers.gh]
command = "/usr/bin/gh-mcp"
[mcp.servers.web]
url = "https://mcp.example.com/mcp"
headers = { Authorization = "Bearer ${WEB_TOKEN}", X-Team = "core" }
secrets = ["WEB_TOKEN"]
[limits.tools]
calls = 100
exec = 9
"#;

#[test]
fn mcp_servers_and_the_agents_that_name_them_load_as_the_contract_describes() {
    let ws = with_mcp(
        SERVERS,
        "tools: [exec, mcp__fs__read_file, mcp__gh__*]\nmcp: [fs]\napprove: []\nlimits: {exec: 40, mcp__fs__write_file: 5, calls: 300}\n",
    )
    .unwrap();
    let fs = &ws.config.mcp["fs"];
    let McpTransport::Stdio(stdio) = &fs.transport else {
        panic!("fs is a stdio server: {fs:?}");
    };
    assert_eq!(stdio.command, "mcp-server-filesystem");
    assert_eq!(stdio.args, vec!["."]);
    assert_eq!(stdio.env["LOG_LEVEL"], "warn");
    assert_eq!(fs.secrets, vec!["GITHUB_TOKEN"]);
    assert_eq!(stdio.network, Network::Open);
    assert!(stdio.read_only[0].is_absolute() && stdio.read_only[0].ends_with("tools"));
    assert_eq!(fs.call_timeout, std::time::Duration::from_secs(5));
    assert_eq!(fs.start_timeout, std::time::Duration::from_secs(2));
    let gh = &ws.config.mcp["gh"];
    assert!(matches!(&gh.transport, McpTransport::Stdio(s) if s.network == Network::None));
    let web = &ws.config.mcp["web"];
    let McpTransport::Http(http) = &web.transport else {
        panic!("web is an HTTP server: {web:?}");
    };
    assert_eq!(http.url, "https://mcp.example.com/mcp");
    assert_eq!(http.headers["Authorization"], "Bearer ${WEB_TOKEN}");
    assert_eq!(web.secrets, vec!["WEB_TOKEN"]);
    assert_eq!(gh.call_timeout, arbor_protocol::mcp::DEFAULT_CALL_TIMEOUT);
    assert_eq!(ws.config.limits.tools.0["exec"], 9);

    let user = &ws.agents["user"];
    assert_eq!(user.tools, vec![ToolName::Exec]);
    let mcp: Vec<String> = user.mcp.iter().map(|p| p.to_string()).collect();
    assert_eq!(mcp, ["mcp__fs__read_file", "mcp__gh__*", "mcp__fs__*"]);
    assert_eq!(user.limits.0["mcp__fs__write_file"], 5);
    assert_eq!(user.limits.0["calls"], 300);
}

#[test]
fn bad_mcp_declarations_are_refused_naming_the_key() {
    let agent = "mcp: [fs]\n";
    let server = |extra: &str| format!("[mcp.servers.fs]\ncommand = \"srv\"\n{extra}\n");
    let web =
        |extra: &str| format!("[mcp.servers.fs]\nurl = \"http://127.0.0.1:9/mcp\"\n{extra}\n");
    let cases: Vec<(String, &str, &str)> = vec![
        (
            server(""),
            "mcp: [nope]\n",
            "mcp__nope__*: arbor.toml declares no [mcp.servers.nope] (declared: fs)",
        ),
        (
            server(""),
            "tools: [mcp__gh__read]\n",
            "declares no [mcp.servers.gh]",
        ),
        (
            "[mcp.servers.a__b]\ncommand = \"srv\"\n".into(),
            "",
            "mcp.servers.a__b: \"a__b\": a server's name may not hold \"__\"",
        ),
        (
            "[mcp.servers.fs]\nargs = [\"x\"]\n".into(),
            agent,
            "mcp.servers.fs: `command` (a program that serves over stdio) or `url` (a streamable HTTP endpoint) is required",
        ),
        (
            server("url = \"http://127.0.0.1:9/mcp\""),
            agent,
            "mcp.servers.fs: `command` belongs to a server arbor starts, and a `url` server runs elsewhere",
        ),
        (
            web("network = \"open\""),
            agent,
            "`network` belongs to a server arbor starts",
        ),
        (
            "[mcp.servers.fs]\nurl = \"ftp://host/mcp\"\n".into(),
            agent,
            "url: \"ftp://host/mcp\": a streamable HTTP endpoint is http:// or https://",
        ),
        (
            "[mcp.servers.fs]\nurl = \"not a url\"\n".into(),
            agent,
            "url: \"not a url\": relative URL without a base",
        ),
        (
            web("headers = { Authorization = \"Bearer ${TOKEN}\" }"),
            agent,
            "headers.Authorization: `${TOKEN}` is not in this server's secrets",
        ),
        (
            web("headers = { X = \"${TOKEN\" }\nsecrets = [\"TOKEN\"]"),
            agent,
            "headers.X: \"${TOKEN\": a `${` is never closed",
        ),
        (
            web("secrets = [\"TOKEN\"]"),
            agent,
            "secrets: `TOKEN` is in no header",
        ),
        (
            web("headers = { Mcp-Session-Id = \"x\" }"),
            agent,
            "headers: `Mcp-Session-Id` is set by the transport itself",
        ),
        (
            web("headers = { \"Bad Name\" = \"x\" }"),
            agent,
            "headers: `Bad Name` is not a header's name",
        ),
    ];
    refused_naming_the_key(cases);
}

#[test]
fn bad_mcp_settings_limits_and_names_are_refused_naming_the_key() {
    let agent = "mcp: [fs]\n";
    let server = |extra: &str| format!("[mcp.servers.fs]\ncommand = \"srv\"\n{extra}\n");
    let cases: Vec<(String, &str, &str)> = vec![
        (
            server("headers = { X = \"1\" }"),
            agent,
            "`headers` are for a `url` server",
        ),
        (
            server("transport = \"stdio\""),
            agent,
            "unknown key `transport`",
        ),
        (
            server("env = { \"BAD-NAME\" = \"x\" }"),
            agent,
            "env: `BAD-NAME` is not a variable's name",
        ),
        (
            server("secrets = [\"1X\"]"),
            agent,
            "secrets: `1X` is not a secret name",
        ),
        (
            server("env = { K = \"1\" }\nsecrets = [\"K\"]"),
            agent,
            "`K` is both in env and in secrets",
        ),
        (
            server("call_timeout = \"0s\""),
            agent,
            "call_timeout: a timeout of 0 would stop at once",
        ),
        (
            server("start_timeout = \"soon\""),
            agent,
            "start_timeout: bad duration",
        ),
        (
            server("read_only = [\"no/such/folder\"]"),
            agent,
            "read_only:",
        ),
        (
            server("network = \"some\""),
            agent,
            "unknown variant `some`, expected `none` or `open`",
        ),
        (
            format!("{}[limits.tools]\nexec = 0\n", server("")),
            agent,
            "limits.tools.exec: at least 1 (0 never means unlimited",
        ),
        (
            server(""),
            "mcp: [fs]\nlimits: {fetch: 3}\n",
            "limits.fetch: not a tool",
        ),
        (
            server(""),
            "mcp: [fs]\nlimits: {exec: 0}\n",
            "limits.exec: at least 1",
        ),
        (
            server(""),
            "mcp: [fs]\napprove: [submit_output]\n",
            "approve: submit_output cannot wait for a person",
        ),
        (
            server(""),
            "mcp: [fs]\napprove: [deploy]\n",
            "approve: \"deploy\" is not a tool",
        ),
        (
            server(""),
            "mcp: [fs]\napprove: [mcp__fs]\n",
            "approve: \"mcp__fs\" is not an MCP tool name",
        ),
        (
            server(""),
            "tools: [mcp__fs]\n",
            "\"mcp__fs\" is not an MCP tool name",
        ),
        (
            server(""),
            "tools: [mcp__fs__read.file]\n",
            "is not an MCP tool name",
        ),
        (
            server(""),
            "mcp: [\"a.b\"]\n",
            "mcp: \"a.b\": a server's name is letters",
        ),
    ];
    refused_naming_the_key(cases);
}

/// Each (arbor.toml, front matter) is refused in one line holding the words.
fn refused_naming_the_key(cases: Vec<(String, &str, &str)>) {
    for (toml, front_matter, words) in cases {
        let message = with_mcp(&toml, front_matter).unwrap_err().to_string();
        assert!(message.contains(words), "{words:?}: {message}");
        assert!(!message.contains('\n'), "not one line: {message}");
    }
}

#[test]
fn the_journal_section_is_read_and_a_bad_setting_is_named() {
    use arbor_runtime::workspace::{DEFAULT_LEASE, JournalConfig, parse_node_id};
    assert_eq!(
        workspace(None, FLOW).unwrap().config.journal,
        JournalConfig::Sled
    );
    let ws = workspace(
        Some("[journal]\nbackend = \"postgres\"\nschema = \"team_a\"\nlease = \"4s\"\n"),
        FLOW,
    )
    .unwrap();
    assert_eq!(
        ws.config.journal,
        JournalConfig::Postgres {
            url: None,
            schema: "team_a".into(),
            lease: Duration::from_secs(4),
            connect_for: Duration::from_secs(60),
            node: None,
        }
    );
    let ws = workspace(Some("[journal]\nbackend = \"postgres\"\n"), FLOW).unwrap();
    assert!(matches!(
        ws.config.journal,
        JournalConfig::Postgres { lease, ref schema, .. } if lease == DEFAULT_LEASE && schema == "arbor"
    ));
    for (toml, expected) in [
        (
            "backend = \"mysql\"",
            "journal.backend: \"mysql\" is not a journal backend",
        ),
        (
            "url = \"postgres://x/y\"",
            "journal.url is for the postgres backend",
        ),
        (
            "backend = \"postgres\"\nlease = \"500ms\"",
            "journal.lease: 500ms is too short",
        ),
        (
            "backend = \"postgres\"\nschema = \"Team; DROP\"",
            "journal.schema: \"Team; DROP\" is not a plain name",
        ),
        (
            "backend = \"postgres\"\nleese = \"5s\"",
            "unknown key `leese`",
        ),
    ] {
        let message = workspace(Some(&format!("[journal]\n{toml}\n")), FLOW)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with("arbor.toml: ") && message.contains(expected),
            "{toml}: {message}"
        );
    }
    assert_eq!(parse_node_id("node-1.eu_west"), Ok("node-1.eu_west".into()));
    assert!(parse_node_id("").is_err());
    assert!(parse_node_id("a/b").unwrap_err().contains("not a node id"));
}

/// agent.md's `temperature`, `top_p` and `effort` over its model entry's,
/// in thousandths; a value out of range, or a combination the provider
/// would refuse, is a load error naming the agent and the key.
#[test]
fn settings_are_read_over_the_models_and_a_refused_combination_is_named() {
    use arbor_protocol::{Effort, Settings};
    let toml = |kind: &str, defaults: &str| {
        format!(
            "[providers.p]\nkind = \"{kind}\"\nbase_url = \"http://127.0.0.1:9/v1\"\n[providers.p.models.m]\nid = \"m-1\"\ncontext_window = 32768\nmax_output_tokens = 8192\n{defaults}\n"
        )
    };
    let load = |toml: &str, front: &str| {
        let agent = format!("---\nmodel: p/m\n{front}\n---\nYou work.\n");
        Workspace::from_texts(
            PathBuf::from("ws"),
            Some(toml),
            &[("a", agent.as_str())],
            &[],
        )
    };
    let ws = load(
        &toml("openai", "temperature = 0.2\ntop_p = 0.5"),
        "top_p: 0.9",
    )
    .unwrap();
    assert_eq!(
        ws.agents["a"].settings,
        Settings {
            temperature_milli: None,
            top_p_milli: Some(900),
            effort: None
        }
    );
    let model = &ws.config.providers["p"].models["m"];
    assert_eq!(
        ws.agents["a"]
            .settings
            .over(model.settings)
            .temperature_milli,
        Some(200)
    );
    let ws = load(&toml("openai", ""), "effort: high").unwrap();
    assert_eq!(ws.agents["a"].settings.effort, Some(Effort::High));
    let thinks = "thinking_tokens = { low = 1024, medium = 2048, high = 4096 }";
    let ws = load(&toml("anthropic", thinks), "effort: medium").unwrap();
    let entry = &ws.config.providers["p"].models["m"];
    assert_eq!(entry.thinking_tokens.unwrap().at(Effort::Medium), 2048);

    for (kind, defaults, front, words) in [
        (
            "openai",
            "",
            "temperature: 2.5",
            "agents/a/agent.md: temperature must be 0 to 2, got 2.5",
        ),
        (
            "openai",
            "",
            "top_p: 0",
            "top_p must be above 0 and at most 1, got 0",
        ),
        ("openai", "", "effort: extreme", "effort"),
        (
            "openai",
            "temperature = 0.3",
            "effort: low",
            "agents/a/agent.md: temperature: a reasoning model (effort) refuses sampling settings",
        ),
        (
            "anthropic",
            "",
            "effort: low",
            "agents/a/agent.md: effort: on Anthropic it is extended thinking, and its model entry in arbor.toml gives no budget",
        ),
        (
            "anthropic",
            "thinking_tokens = { low = 512, medium = 2048, high = 4096 }",
            "effort: low",
            "providers.p.models.m.thinking_tokens: low = 512: Anthropic takes at least 1024",
        ),
        (
            "openai",
            "thinking_tokens = { low = 1024, medium = 2048, high = 4096 }",
            "",
            "providers.p.models.m.thinking_tokens: is Anthropic's extended thinking",
        ),
        (
            "anthropic",
            "",
            "temperature: 0.5\ntop_p: 0.9",
            "top_p: Anthropic's models take temperature or top_p, not both",
        ),
        (
            "openai",
            "temperature = 9",
            "",
            "providers.p.models.m.temperature must be 0 to 2, got 9",
        ),
    ] {
        let message = load(&toml(kind, defaults), front).unwrap_err().to_string();
        assert!(message.contains(words), "{front:?}: {message}");
        assert!(!message.contains('\n'), "not one line: {message}");
    }
}

/// I-55: `models` lists what a job of the agent may run on; its `model`
/// is among them (the first when not given), and each is declared.
#[test]
fn models_hold_the_default_and_each_is_declared() {
    use arbor_protocol::ModelRef;
    let toml = "[providers.p]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
                [providers.p.models.a]\nid = \"a\"\ncontext_window = 8192\nmax_output_tokens = 1024\n\
                [providers.p.models.b]\nid = \"b\"\ncontext_window = 8192\nmax_output_tokens = 1024\n";
    let load = |front: &str| {
        let agent = format!("---\n{front}\n---\nYou work.\n");
        Workspace::from_texts(
            PathBuf::from("ws"),
            Some(toml),
            &[("x", agent.as_str())],
            &[],
        )
    };
    let model = |m: &str| ModelRef::Provider {
        provider: "p".into(),
        model: m.into(),
    };
    let ws = load("models: [p/b, p/a]").unwrap();
    assert_eq!(ws.agents["x"].model, model("b"));
    assert_eq!(ws.agents["x"].allowed_models(), [model("b"), model("a")]);
    let ws = load("model: p/a\nmodels: [p/b, p/a]").unwrap();
    assert_eq!(ws.agents["x"].model, model("a"));
    for (front, words) in [
        (
            "model: p/a\nmodels: [p/b]",
            "agents/x/agent.md: model: `p/a` is not among its models (p/b)",
        ),
        (
            "models: [p/a, p/zzz]",
            "agents/x/agent.md: models: `p/zzz`: arbor.toml has no [providers.p.models.zzz]",
        ),
        ("models: [nope]", "models: model: `nope` is not known"),
        (
            "model: p/a\nmodels: [p/a]\nfallback: [p/b]",
            "agents/x/agent.md: fallback: `p/b` is not among its models: list it in `models:` too",
        ),
        (
            "model: p/a\nmodels: [p/a, p/b]\nfallback: [p/a]",
            "fallback: `p/a` is its own model",
        ),
    ] {
        let message = load(front).unwrap_err().to_string();
        assert!(message.contains(words), "{front:?}: {message}");
    }
    let ws = load("model: p/a\nmodels: [p/a, p/b]\nfallback: [p/b]").unwrap();
    assert_eq!(ws.agents["x"].fallback, [model("b")]);
}

/// `approve:` entries: a name, or `{tool, timeout, mode, undo}`; each bad
/// one is refused naming what is wrong.
#[test]
fn approve_entries_take_a_wait_and_a_mode_and_a_bad_one_is_named() {
    use arbor_protocol::{ApproveEntry, ApproveMode};
    let text = "---\ndescription: pays\ntools: [exec]\nmcp: [pay]\napprove: [exec, {tool: \"mcp__pay__*\", timeout: 24h}, {tool: mcp__pay__refund, mode: notify, undo: \"refund it back\"}]\n---\nprompt\n";
    let agent = parse_agent("payer", text, Path::new("agents/payer/agent.md")).unwrap();
    assert_eq!(
        agent.approve,
        [
            ApproveEntry::ask("exec"),
            ApproveEntry {
                timeout: Some(Duration::from_secs(86_400)),
                ..ApproveEntry::ask("mcp__pay__*")
            },
            ApproveEntry {
                tool: "mcp__pay__refund".into(),
                timeout: None,
                mode: ApproveMode::Notify,
                undo: Some("refund it back".into()),
            },
        ]
    );
    for (entry, expected) in [
        (
            "{tool: exec, wait: 1h}",
            "unknown key `wait`, expected one of tool, timeout, mode, undo",
        ),
        ("{tool: exec, mode: later}", "unknown variant `later`"),
        ("{tool: exec, timeout: soon}", "bad duration \"soon\""),
        ("{tool: exec, undo: x}", "undo is for mode notify"),
        (
            "{tool: exec, mode: notify, timeout: 1h}",
            "timeout is for mode ask",
        ),
        ("{tool: exec, timeout: 0s}", "timeout must be more than 0"),
        ("{tool: depoly}", "\"depoly\" is not a tool"),
        ("{mode: notify}", "missing field `tool`"),
        ("{tool: ask_person, mode: notify}", "ask_person"),
    ] {
        let error = front_matter_error(&format!(
            "description: x\ntools: [exec, ask_person]\napprove: [{entry}]\n"
        ));
        assert!(error.contains(expected), "{entry}: {error}");
    }
    // A question's own wait is the one thing an entry may say of it.
    let asker = "---\ndescription: asks\ntools: [ask_person]\napprove: [{tool: ask_person, timeout: 2h}]\n---\nprompt\n";
    parse_agent("asker", asker, Path::new("agents/asker/agent.md")).unwrap();
}

/// A loop (`until`) and a reviewer (`verify`) that could not be run as
/// written are refused at load, each naming the step and what is wrong;
/// a good one loads into the run's spec.
#[test]
fn loops_and_reviewers_are_checked_at_load() {
    let with = |until: &str| {
        FLOW.replace(
            "instruction = \"Check it\"",
            &format!("instruction = \"Check it\", until = {until}"),
        )
    };
    for (until, words) in [
        (
            "{ max_iterations = 3 }",
            "until needs exactly one of command, pattern and judge",
        ),
        (
            "{ command = \"true\", pattern = \"x\" }",
            "until needs exactly one of command, pattern and judge",
        ),
        ("{ command = \" \" }", "until.command is empty"),
        (
            "{ pattern = \"x\", max_iterations = 0 }",
            "until.max_iterations must be 1 to 100, got 0",
        ),
        (
            "{ pattern = \"x\", max_iterations = 101 }",
            "must be 1 to 100, got 101",
        ),
        (
            "{ pattern = \"x\", max_tokens = 0 }",
            "until.max_tokens must be at least 1",
        ),
        (
            "{ pattern = \"x\", max_usd = 0.0 }",
            "until.max_usd must be more than 0 dollars",
        ),
        (
            "{ pattern = \"x\", max_time = \"soon\" }",
            "until.max_time \"soon\" is not a duration",
        ),
        (
            "{ pattern = \"x\", max_time = \"0s\" }",
            "until.max_time must be more than 0s",
        ),
        (
            "{ pattern = \"(\" }",
            "until.pattern \"(\" is not a regular expression",
        ),
        (
            "{ judge = \"nobody\" }",
            "until.judge names unknown agent `nobody`",
        ),
        ("{ pattern = \"x\", when = 1 }", "unknown key `when`"),
    ] {
        let message = workspace(None, &with(until)).unwrap_err().to_string();
        assert!(message.contains(words), "{until}: {message}");
        assert!(message.starts_with("flows/research.toml: "), "{message}");
    }
    let message = workspace(None, &with("{ pattern = \"x\", max_usd = 1.0 }"))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("step researcher: until.max_usd needs a usd ceiling"),
        "{message}"
    );
    let priced = FLOW.replace("tokens = 20000", "tokens = 20000, usd = 2.0");
    let priced = priced.replace(
        "instruction = \"Check it\"",
        "instruction = \"Check it\", until = { pattern = \"x\", max_usd = 1.0 }",
    );
    assert!(
        !workspace(None, &priced)
            .err()
            .is_some_and(|e| e.to_string().contains("until.max_usd")),
        "a usd ceiling meters max_usd"
    );
    let loaded = workspace(
        None,
        &with("{ judge = \"planner\", max_iterations = 2, max_time = \"20m\" }"),
    )
    .unwrap();
    let spec = loaded.flow_run("research", None).unwrap();
    let until = spec.groups[1].steps[0].until.clone().unwrap();
    assert_eq!(until.judge.as_deref(), Some("planner"));
    assert_eq!(until.max_iterations(), 2);
    assert_eq!(until.max_time(), Some(std::time::Duration::from_secs(1200)));
    let verify = |who: &str| format!("verify = \"{who}\"\n{FLOW}");
    let message = workspace(None, &verify("nobody")).unwrap_err().to_string();
    assert_eq!(
        message,
        "flows/research.toml: verify names unknown agent `nobody`"
    );
    let labelled = verify("planner").replace("label = \"plan\"", "label = \"review\"");
    let message = workspace(None, &labelled).unwrap_err().to_string();
    assert!(message.contains("a step is labelled `review`"), "{message}");
    let spec = workspace(None, &verify("planner"))
        .unwrap()
        .flow_run("research", None)
        .unwrap();
    assert_eq!(spec.verify.as_deref(), Some("planner"));
}

#[test]
fn a_budget_pause_is_checked_at_load() {
    let with = |keys: &str| format!("{keys}\n{FLOW}");
    for (keys, words) in [
        (
            "on_ceiling = \"wait\"",
            "unknown variant `wait`, expected `end` or `pause`",
        ),
        (
            "pause_timeout = \"1h\"",
            "pause_timeout is for on_ceiling = \"pause\"",
        ),
        (
            "on_ceiling = \"end\"\npause_timeout = \"1h\"",
            "pause_timeout is for on_ceiling = \"pause\"",
        ),
        (
            "on_ceiling = \"pause\"\npause_timeout = \"soon\"",
            "pause_timeout: bad duration \"soon\"",
        ),
    ] {
        let message = workspace(None, &with(keys)).unwrap_err().to_string();
        assert!(message.contains(words), "{keys}: {message}");
        assert!(message.starts_with("flows/research.toml: "), "{message}");
    }
    let spec = |keys: &str| {
        workspace(None, &with(keys))
            .unwrap()
            .flow_run("research", None)
            .unwrap()
    };
    assert_eq!(spec("").pause, None, "a run ends at its ceiling by default");
    assert_eq!(spec("on_ceiling = \"end\"").pause, None);
    assert_eq!(
        spec("on_ceiling = \"pause\"").pause,
        Some(std::time::Duration::from_secs(24 * 3600)),
        "a pause waits 24 h unless told"
    );
    assert_eq!(
        spec("on_ceiling = \"pause\"\npause_timeout = \"90m\"").pause,
        Some(std::time::Duration::from_secs(90 * 60))
    );
}

/// A flow's `input`: text, or a JSON Schema. A run is given what it
/// declares (checked; a schema's failures named by their path) and its
/// step instructions have it filled in; a flow that declares none takes
/// none; a bad declaration or template is refused at load.
#[test]
fn a_flows_input_is_checked_and_filled_into_its_instructions() {
    let text = r#"
input = "text"
[[group]]
steps = [{ agent = "researcher", instruction = "Find out about {{ input }}." }]
"#;
    let ws = workspace(None, text).unwrap();
    let run = ws
        .flow_run_with("research", None, Some(&json!("tides")))
        .unwrap();
    assert_eq!(run.groups[0].steps[0].instruction, "Find out about tides.");
    assert_eq!(run.input, Some(json!("tides")));
    let refused = |ws: &Workspace, input: Option<serde_json::Value>| {
        ws.flow_run_with("research", None, input.as_ref())
            .unwrap_err()
            .to_string()
    };
    assert!(refused(&ws, None).contains("needs an input"));
    assert!(refused(&ws, Some(json!(" "))).contains("empty"));
    assert!(refused(&ws, Some(json!({"a": 1}))).contains("text as its input, not an object"));

    let schema = r#"
input = { type = "object", required = ["topic"], properties = { topic = { type = "string" }, depth = { type = "integer", minimum = 1 } } }
[[group]]
steps = [{ agent = "researcher", instruction = "Research {{ input.topic }}{% if input.depth is defined %} to depth {{ input.depth }}{% endif %}." }]
"#;
    let ws = workspace(None, schema).unwrap();
    let run = ws
        .flow_run_with(
            "research",
            None,
            Some(&json!({"topic": "tides", "depth": 2})),
        )
        .unwrap();
    assert_eq!(
        run.groups[0].steps[0].instruction,
        "Research tides to depth 2."
    );
    // JSON typed at a terminal comes as text, and is read as JSON.
    let typed = ws
        .flow_run_with("research", None, Some(&json!(r#"{"topic": "moons"}"#)))
        .unwrap();
    assert_eq!(typed.groups[0].steps[0].instruction, "Research moons.");
    let failed = refused(&ws, Some(json!({"depth": "two"})));
    assert!(
        failed.contains("/depth") && failed.contains("\"topic\" is a required property"),
        "{failed}"
    );

    let plain = workspace(None, FLOW).unwrap();
    assert!(refused(&plain, Some(json!("x"))).contains("takes no input"));
    assert_eq!(plain.flow_run("research", None).unwrap().input, None);

    for (flow, why) in [
        (
            "input = \"number\"\n[[group]]\nsteps = [{ agent = \"researcher\", instruction = \"x\" }]\n",
            "write input = \"text\"",
        ),
        (
            "input = { type = \"objekt\" }\n[[group]]\nsteps = [{ agent = \"researcher\", instruction = \"x\" }]\n",
            "not a valid JSON Schema",
        ),
        (
            "[[group]]\nsteps = [{ agent = \"researcher\", instruction = \"About {{ input }}\" }]\n",
            "declares no `input`",
        ),
        (
            "input = \"text\"\n[[group]]\nsteps = [{ agent = \"researcher\", instruction = \"About {{ topic }}\" }]\n",
            "names `topic`: only `input` is known",
        ),
        (
            "input = \"text\"\n[[group]]\nsteps = [{ agent = \"researcher\", instruction = \"About {{ input \" }]\n",
            "step 1 of group 1's instruction",
        ),
    ] {
        let error = workspace(None, flow).unwrap_err().to_string();
        assert!(
            error.contains("flows/research.toml") && error.contains(why),
            "{why}: {error}"
        );
    }
}
