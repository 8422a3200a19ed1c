//! Every input arbor parses, 10,000 generated cases each: agent.md front
//! matter, arbor.toml, flow files and tool arguments. Each case is either a
//! typed error or a valid value; none panics (I-36, I-38). The cases are
//! built from the formats' own keys with values of every JSON and TOML
//! type, and from valid texts cut and spliced at random, so that most get
//! past the syntax into the checks behind it.

use arbor_protocol::tools::{
    CollectArgs, DelegateArgs, ExecArgs, ReadFileArgs, SendMessageArgs, StopChildArgs,
    SubmitOutputArgs, WriteFileArgs, parse_duration_arg,
};
use arbor_runtime::Workspace;
use proptest::prelude::*;
use serde_json::Value;
use std::path::PathBuf;

const CASES: u32 = 10_000;

const AGENT_KEYS: &[&str] = &[
    "name",
    "description",
    "model",
    "tools",
    "deny",
    "subagents",
    "sandbox",
    "network",
    "secrets",
    "budget",
    "max_turns",
    "timeout",
    "script",
    "resources",
];

const VALID_AGENT: &str = "---\ndescription: writes\ntools: [exec, write_file]\nsubagents: [helper]\nmax_turns: 5\ntimeout: 2m\nbudget: {tokens: 5000}\nresources: {memory: 256MiB, pids: 32}\nscript:\n  - usage: {input: 20, output: 5}\n    delay: 10ms\n    call: {tool: exec, args: {command: \"echo hi\"}}\n  - call: {tool: submit_output, args: {output: done}}\n---\nYou write.\n";

const HELPER: &str = "---\ndescription: helps\nscript:\n  - call: {tool: submit_output, args: {output: ok}}\n---\nYou help.\n";

const VALID_CONFIG: &str = "[limits]\ndepth = 2\nfan_out = 16\nrunning_children = 16\nspawn_cap = 1000\ngrant_fraction = 0.5\nwind_down = 0.8\n\n[budget]\ntokens = 1000000\nusd = \"2.50\"\n\n[sandbox]\nmode = \"none\"\nmemory = \"512MiB\"\n\n[providers.local]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:11434/v1\"\nmax_concurrent = 4\ntimeout = \"300s\"\n\n[providers.local.models.small]\nid = \"qwen\"\ncontext_window = 32768\nmax_output_tokens = 2048\n";

const VALID_FLOW: &str = "budget = { tokens = 200000 }\ntimeout = \"2m\"\n\n[[group]]\nsteps = [{ agent = \"writer\", instruction = \"go\", retries = 2, label = \"w\" }]\n\n[[group]]\nsteps = [{ agent = \"helper\", instruction = \"then\" }]\n";

/// Words the formats use, and some they should refuse.
fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(vec![
            "exec",
            "write_file",
            "read_file",
            "delegate",
            "collect",
            "submit_output",
            "helper",
            "writer",
            "own",
            "shared",
            "open",
            "none",
            "sealed",
            "openai",
            "anthropic",
            "scripted",
            "2m",
            "10ms",
            "0s",
            "-1s",
            "1h",
            "99999999999h",
            "256MiB",
            "0B",
            "1e9",
            "tokens",
            "usd",
            "\"",
            "---",
            "",
            " ",
            "\u{0}",
            "é",
            "\u{202e}",
            "../../etc/passwd",
            "${HOME}",
        ])
        .prop_map(str::to_string),
        "[a-z_]{0,12}",
        any::<String>(),
    ]
}

/// Any JSON value, numbers at their edges included.
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        proptest::sample::select(vec![0i64, 1, -1, i64::MAX, i64::MIN, u32::MAX as i64])
            .prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        word().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((word(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A valid text with a few random cuts, splices and insertions.
fn mangled(valid: &'static str) -> impl Strategy<Value = String> {
    proptest::collection::vec((any::<prop::sample::Index>(), 0usize..8, word()), 1..4).prop_map(
        move |edits| {
            let mut text: Vec<char> = valid.chars().collect();
            for (at, cut, insert) in edits {
                let at = at.index(text.len() + 1);
                let end = (at + cut).min(text.len());
                text.splice(at..end, insert.chars());
            }
            text.into_iter().collect()
        },
    )
}

fn agent_text() -> impl Strategy<Value = String> {
    let generated = proptest::collection::vec(
        (
            prop_oneof![
                proptest::sample::select(AGENT_KEYS.to_vec()).prop_map(str::to_string),
                word()
            ],
            json(),
        ),
        0..6,
    )
    .prop_map(|pairs| {
        // JSON is YAML's flow syntax: each value goes in as written.
        let mut text = String::from("---\n");
        for (key, value) in pairs {
            text.push_str(&format!(
                "{}: {value}\n",
                serde_json::to_string(&key).unwrap()
            ));
        }
        text.push_str("---\nYou are a test agent.\n");
        text
    });
    prop_oneof![generated, mangled(VALID_AGENT), any::<String>()]
}

/// A TOML value of any type, as TOML text.
fn toml_value() -> impl Strategy<Value = toml::Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(toml::Value::Integer),
        proptest::sample::select(vec![0i64, -1, 1, i64::MAX, i64::MIN])
            .prop_map(toml::Value::Integer),
        any::<f64>().prop_map(toml::Value::Float),
        any::<bool>().prop_map(toml::Value::Boolean),
        word().prop_map(toml::Value::String),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(toml::Value::Array),
            proptest::collection::vec((word(), inner), 0..4)
                .prop_map(|kv| toml::Value::Table(kv.into_iter().collect())),
        ]
    })
}

/// A table of the format's own sections and keys with values of any type.
fn toml_text(
    sections: &'static [(&'static str, &'static [&'static str])],
) -> impl Strategy<Value = String> {
    proptest::collection::vec(
        (
            proptest::sample::select(sections.to_vec()),
            proptest::collection::vec((any::<prop::sample::Index>(), toml_value()), 0..5),
        ),
        0..4,
    )
    .prop_map(|chosen| {
        let mut root = toml::Table::new();
        for ((section, keys), values) in chosen {
            let mut table = toml::Table::new();
            for (key, value) in values {
                table.insert(key.get(keys).to_string(), value);
            }
            if section.is_empty() {
                root.extend(table);
            } else if let Some(toml::Value::Table(t)) = root.get_mut(section) {
                t.extend(table);
            } else {
                root.insert(section.to_string(), toml::Value::Table(table));
            }
        }
        toml::to_string(&root).unwrap_or_default()
    })
}

const CONFIG_SECTIONS: &[(&str, &[&str])] = &[
    (
        "limits",
        &[
            "depth",
            "fan_out",
            "running_children",
            "spawn_cap",
            "grant_fraction",
            "wind_down",
            "max_output_tokens",
            "x",
        ],
    ),
    ("budget", &["tokens", "usd", "x"]),
    (
        "sandbox",
        &["mode", "memory", "pids", "cpu", "secrets_file", "x"],
    ),
    ("providers", &["local", "openai", "x"]),
    ("service", &["listen", "max_running", "x"]),
    ("", &["x", "limits", "budget"]),
];

const FLOW_SECTIONS: &[(&str, &[&str])] = &[
    ("", &["budget", "timeout", "group", "x"]),
    ("budget", &["tokens", "usd", "x"]),
];

/// A flow's own shape (groups of steps) with each step's keys valid or of
/// any type, so that most cases reach the checks behind the syntax.
fn flow_structured() -> impl Strategy<Value = String> {
    let value = |valid: Vec<toml::Value>| prop_oneof![3 => proptest::sample::select(valid), 1 => toml_value()];
    let step = (
        value(vec!["writer".into(), "helper".into()]),
        value(vec!["go".into()]),
        proptest::option::of(value(vec![0i64.into(), 2i64.into(), 100i64.into()])),
        proptest::option::of(value(vec!["a".into(), "b".into()])),
        proptest::option::of(value(vec!["2m".into(), "10ms".into()])),
    )
        .prop_map(|(agent, instruction, retries, label, timeout)| {
            let mut t = toml::Table::new();
            t.insert("agent".into(), agent);
            t.insert("instruction".into(), instruction);
            for (k, v) in [("retries", retries), ("label", label), ("timeout", timeout)] {
                if let Some(v) = v {
                    t.insert(k.into(), v);
                }
            }
            toml::Value::Table(t)
        });
    let group = proptest::collection::vec(step, 0..4).prop_map(|steps| {
        let mut t = toml::Table::new();
        t.insert("steps".into(), toml::Value::Array(steps));
        toml::Value::Table(t)
    });
    (
        proptest::collection::vec(group, 0..4),
        proptest::option::of(value(vec!["2m".into()])),
        proptest::option::of(value(vec![1000i64.into(), 0i64.into()])),
    )
        .prop_map(|(groups, timeout, tokens)| {
            let mut root = toml::Table::new();
            root.insert("group".into(), toml::Value::Array(groups));
            if let Some(t) = timeout {
                root.insert("timeout".into(), t);
            }
            if let Some(tokens) = tokens {
                let mut budget = toml::Table::new();
                budget.insert("tokens".into(), tokens);
                root.insert("budget".into(), toml::Value::Table(budget));
            }
            toml::to_string(&root).unwrap_or_default()
        })
}

fn root() -> PathBuf {
    std::env::temp_dir().join("arbor-parsing-properties")
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// agent.md: a workspace of it and a valid helper loads, or says why.
    #[test]
    fn agent_md_is_a_typed_error_or_an_agent(text in agent_text()) {
        match Workspace::from_texts(root(), None, &[("writer", &text), ("helper", HELPER)], &[]) {
            Ok(workspace) => prop_assert!(workspace.agents.contains_key("writer")),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    /// arbor.toml: a configuration, or an error that names the file.
    #[test]
    fn arbor_toml_is_a_typed_error_or_a_config(
        text in prop_oneof![toml_text(CONFIG_SECTIONS), mangled(VALID_CONFIG), any::<String>()]
    ) {
        match Workspace::from_texts(root(), Some(&text), &[("helper", HELPER)], &[]) {
            Ok(workspace) => prop_assert!(workspace.config.limits.validate().is_ok()),
            Err(e) => prop_assert!(e.to_string().contains("arbor.toml"), "{e}"),
        }
    }

    /// A flow file: a flow, or an error that names it.
    #[test]
    fn a_flow_is_a_typed_error_or_a_flow(
        text in prop_oneof![flow_structured(), toml_text(FLOW_SECTIONS), mangled(VALID_FLOW), any::<String>()]
    ) {
        let agents = [("writer", HELPER), ("helper", HELPER)];
        match Workspace::from_texts(root(), None, &agents, &[("f", &text)]) {
            Ok(workspace) => prop_assert!(workspace.flows.contains_key("f")),
            Err(e) => prop_assert!(e.to_string().contains('f'), "{e}"),
        }
    }

    /// Every tool's arguments, as a model sends them: parsed into the tool's
    /// type and checked as the tool checks them, or refused.
    #[test]
    fn tool_arguments_are_a_typed_error_or_arguments(args in json()) {
        if let Ok(delegate) = serde_json::from_value::<DelegateArgs>(args.clone()) {
            let _ = parse_duration_arg("timeout", delegate.timeout.as_deref());
            for job in &delegate.jobs {
                let _ = parse_duration_arg("timeout", job.timeout.as_deref());
                if let Some(budget) = &job.budget {
                    let _ = budget.tokens();
                    let _ = budget.usd_micros();
                }
            }
        }
        if let Ok(collect) = serde_json::from_value::<CollectArgs>(args.clone()) {
            let _ = parse_duration_arg("timeout", collect.timeout.as_deref());
        }
        let _ = serde_json::from_value::<StopChildArgs>(args.clone());
        let _ = serde_json::from_value::<SendMessageArgs>(args.clone());
        if let Ok(exec) = serde_json::from_value::<ExecArgs>(args.clone()) {
            let _ = parse_duration_arg("timeout", exec.timeout.as_deref());
        }
        let _ = serde_json::from_value::<ReadFileArgs>(args.clone());
        let _ = serde_json::from_value::<WriteFileArgs>(args.clone());
        let _ = serde_json::from_value::<SubmitOutputArgs>(args.clone());
        if let Value::String(text) = &args {
            let _ = parse_duration_arg("timeout", Some(text.as_str()));
        }
    }
}
