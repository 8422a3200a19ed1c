//! `agents/NAME/agent.md`: YAML front matter between `---` lines, then the
//! system prompt; everything about one agent alone is checked here, and
//! front-matter errors are told as the key a user wrote.

use super::parse::{
    LoadError, budget_tokens, check_name, invalid, is_secret_name, one_line, plain_words, resources,
};
use arbor_protocol::agent::{FrontMatter, ScriptCallSpec, ScriptTurnSpec};
use arbor_protocol::mcp::check_server_name;
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    AgentDef, BudgetArg, McpPattern, ModelRef, Offer, ScriptCall, ScriptTurn, Settings, ToolName,
    ToolRef,
};
use std::path::Path;

/// Parses one `agent.md`: front matter between `---` lines, then the system prompt.
/// `path` only names the file in errors. Checks everything about this agent alone;
/// what needs the other agents (sub-agents exist, have descriptions) is checked by
/// `Workspace::load` and `Workspace::from_texts`.
pub fn parse_agent(folder_name: &str, text: &str, path: &Path) -> Result<AgentDef, LoadError> {
    check_name("agent", folder_name).map_err(|m| invalid(path, m))?;
    let (yaml, prompt) = split_front_matter(text).map_err(|m| invalid(path, m))?;
    let front_matter: FrontMatter = serde_saphyr::from_str(yaml)
        .map_err(|error| invalid(path, front_matter_error(yaml, &error)))?;
    agent_from_front_matter(folder_name, front_matter, prompt).map_err(|m| invalid(path, m))
}

/// The front matter's YAML and the body after it.
pub(crate) fn split_front_matter(text: &str) -> Result<(&str, &str), String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (first, mut rest) = split_line(text);
    if first.trim_end() != "---" {
        return Err("no front matter: the file must start with a `---` line".into());
    }
    let yaml_start = rest;
    loop {
        if rest.is_empty() {
            return Err(
                "the front matter is not closed: no second `---` line after the first".into(),
            );
        }
        let (line, after) = split_line(rest);
        if line.trim_end() == "---" {
            let yaml = &yaml_start[..yaml_start.len() - rest.len()];
            return Ok((yaml, after.trim()));
        }
        rest = after;
    }
}

/// The first line (without its `\n`) and everything after it.
fn split_line(text: &str) -> (&str, &str) {
    match text.split_once('\n') {
        Some((line, rest)) => (line, rest),
        None => (text, ""),
    }
}

fn agent_from_front_matter(
    folder_name: &str,
    front_matter: FrontMatter,
    prompt: &str,
) -> Result<AgentDef, String> {
    let FrontMatter {
        name,
        description,
        model,
        tools: named_tools,
        mcp: servers,
        approve,
        hooks,
        limits,
        deny,
        subagents,
        sandbox,
        network,
        secrets,
        budget,
        max_turns,
        max_repeats,
        models,
        fallback,
        skills,
        temperature,
        top_p,
        effort,
        timeout,
        script,
        resources: resources_spec,
    } = front_matter;
    let per_run = match budget.as_ref().and_then(|b| b.per_run.as_ref()) {
        None => None,
        Some(per_run) => {
            let checked = arbor_protocol::PerRun {
                tokens: per_run.tokens().map_err(|e| format!("per_run: {e}"))?,
                usd_micros: per_run.usd_micros().map_err(|e| format!("per_run: {e}"))?,
            };
            if checked == arbor_protocol::PerRun::default() {
                return Err("budget.per_run must say tokens, usd or both".into());
            }
            Some(checked)
        }
    };
    let budget = budget
        .as_ref()
        .map(arbor_protocol::agent::AgentBudget::per_job);

    // A secret reaches its sandbox as an environment variable (I-27).
    if let Some(bad) = secrets.iter().find(|n| !is_secret_name(n)) {
        return Err(format!(
            "secrets: `{bad}` is not a secret name: use letters, digits and `_` (an environment \
             variable's name, not starting with a digit), and none of PATH, HOME, LANG, TMPDIR"
        ));
    }

    if let Some(name) = name
        && name != folder_name
    {
        return Err(format!(
            "name `{name}` differs from the folder name `{folder_name}`: rename one, or leave `name` out"
        ));
    }
    let (tools, mut mcp) = named(named_tools, !skills.is_empty())?;
    for server in &servers {
        check_server_name(server).map_err(|m| format!("mcp: {m}"))?;
        mcp.push(McpPattern::all(server));
    }
    check_gates(&approve, &hooks)?;
    let limits = limits.unwrap_or_default();
    limits.check("limits.")?;
    if max_turns == Some(0) {
        return Err("max_turns must be at least 1".into());
    }
    if max_repeats == Some(0) {
        return Err("max_repeats must be at least 1".into());
    }
    let settings = Settings::from_figures(temperature, top_p, effort)?;
    let (model, models) = allowed_models(model.as_deref(), &models)?;
    let fallback = fallback_models(&model, &models, &fallback)?;
    let script = script
        .into_iter()
        .enumerate()
        .map(|(i, turn)| script_turn(i + 1, turn))
        .collect::<Result<Vec<_>, _>>()?;

    Ok(AgentDef {
        name: folder_name.to_string(),
        description,
        model,
        models,
        fallback,
        tools,
        mcp,
        limits,
        deny,
        approve,
        hooks,
        subagents,
        sandbox: sandbox.unwrap_or_default(),
        network: network.unwrap_or_default(),
        secrets,
        budget_tokens: budget_tokens(budget.as_ref())?,
        per_run,
        budget_usd_micros: budget
            .as_ref()
            .map(BudgetArg::usd_micros)
            .transpose()?
            .flatten(),
        max_turns,
        max_repeats,
        skills,
        settings,
        timeout: parse_duration_arg("timeout", timeout.as_deref())?,
        script: script.into(),
        prompt: prompt.to_string(),
        resources: resources_spec
            .as_ref()
            .map(|spec| resources(spec, "resources."))
            .transpose()?
            .unwrap_or_default(),
    })
}

/// `scripted`, or `provider/model` (checked against arbor.toml by `check_models`).
/// Its default model and the models it allows (I-55): with `models`, its
/// `model` must be among them, and is the first of them when not given.
fn allowed_models(
    model: Option<&str>,
    models: &[String],
) -> Result<(ModelRef, Vec<ModelRef>), String> {
    let allowed = models
        .iter()
        .map(|m| model_ref(Some(m)).map_err(|e| format!("models: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    if allowed.is_empty() {
        return Ok((model_ref(model)?, allowed));
    }
    let default = match model {
        None => allowed[0].clone(),
        Some(m) => model_ref(Some(m))?,
    };
    if !allowed.contains(&default) {
        return Err(format!(
            "model: `{default}` is not among its models ({})",
            models.join(", ")
        ));
    }
    Ok((default, allowed))
}

/// `tools:` as built-in tools and MCP patterns.
fn named(
    named_tools: Vec<ToolRef>,
    has_skills: bool,
) -> Result<(Vec<ToolName>, Vec<McpPattern>), String> {
    let mut tools = vec![];
    let mut mcp = vec![];
    for tool in named_tools {
        match tool {
            ToolRef::Builtin(t) if t.info().offer == Offer::Named => tools.push(t),
            // Offered with `skills:` (alone, naming it is a mistake), and
            // to the steps of a `peers` group.
            ToolRef::Builtin(ToolName::ReadSkill) if has_skills => {}
            ToolRef::Builtin(ToolName::SendPeer) => {}
            ToolRef::Builtin(ToolName::ReadSkill) => {
                return Err(
                    "tools: `read_skill` reads the skills an agent names; list them in \
                     `skills:` (it is then offered without naming it)"
                        .into(),
                );
            }
            ToolRef::Builtin(t) => {
                let nameable: Vec<&str> = ToolName::nameable().map(ToolName::as_str).collect();
                return Err(format!(
                    "tools: `{t}` cannot be named (tools may name {} and mcp__SERVER__TOOL; \
                     delegation tools are offered to agents with subagents)",
                    nameable.join(", ")
                ));
            }
            ToolRef::Mcp(pattern) => mcp.push(pattern),
        }
    }
    Ok((tools, mcp))
}

/// `approve` names tools a person may be asked about; a hook is a command.
fn check_gates(
    approve: &[arbor_protocol::ApproveEntry],
    hooks: &arbor_protocol::Hooks,
) -> Result<(), String> {
    use arbor_protocol::ApproveMode;
    for entry in approve {
        // `{tool: ask_person, timeout}` sets a question's wait, and only that.
        let question_wait =
            entry.tool == "ask_person" && entry.mode == ApproveMode::Ask && entry.timeout.is_some();
        if !question_wait {
            arbor_protocol::approval::check_approve_entry(&entry.tool)
                .map_err(|m| format!("approve: {m}"))?;
        }
        entry.check()?;
    }
    if let Some(command) = &hooks.before_call
        && command.trim().is_empty()
    {
        return Err("hooks.before_call is empty: give the command to run, or leave it out".into());
    }
    Ok(())
}

/// `fallback`: each a model it allows (I-55), none its own default.
fn fallback_models(
    model: &ModelRef,
    models: &[ModelRef],
    fallback: &[String],
) -> Result<Vec<ModelRef>, String> {
    fallback
        .iter()
        .map(|text| {
            let next = model_ref(Some(text)).map_err(|e| format!("fallback: {e}"))?;
            if next == *model {
                return Err(format!(
                    "fallback: `{next}` is its own model: a fallback is where a call goes instead"
                ));
            }
            if !models.contains(&next) {
                return Err(format!(
                    "fallback: `{next}` is not among its models: list it in `models:` too \
                     (a job runs only on a model its agent allows)"
                ));
            }
            Ok(next)
        })
        .collect()
}

fn model_ref(model: Option<&str>) -> Result<ModelRef, String> {
    match model.map(str::trim) {
        None | Some("scripted") => Ok(ModelRef::Scripted),
        Some(m) => match m.split_once('/') {
            Some((provider, model))
                if !provider.is_empty() && !model.is_empty() && !model.contains('/') =>
            {
                Ok(ModelRef::Provider {
                    provider: provider.to_string(),
                    model: model.to_string(),
                })
            }
            _ => Err(format!(
                "model: `{m}` is not known: use `scripted`, or `provider/model` with a provider of arbor.toml"
            )),
        },
    }
}

/// `number` counts from 1, as a user counts the turns in the file.
fn script_turn(number: usize, spec: ScriptTurnSpec) -> Result<ScriptTurn, String> {
    let calls = match spec.call {
        None => Vec::new(),
        Some(call) => {
            let specs = call.into_vec();
            if specs.is_empty() {
                return Err(format!(
                    "script turn {number}: `call` is an empty list (leave it out for a final answer)"
                ));
            }
            specs
                .into_iter()
                .enumerate()
                .map(|(i, call)| script_call(number, i + 1, call))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let delay = spec
        .delay
        .map(|text| {
            humantime::parse_duration(text.trim())
                .map_err(|e| format!("script turn {number}: delay: bad duration {text:?}: {e}"))
        })
        .transpose()?;
    Ok(ScriptTurn {
        say: spec.say,
        calls,
        usage: spec.usage,
        delay,
    })
}

/// Only the shape is checked here: the arguments are checked when the call is made,
/// since scripts call tools wrongly on purpose to test that.
fn script_call(turn: usize, number: usize, spec: ScriptCallSpec) -> Result<ScriptCall, String> {
    let args = match spec.args {
        None => serde_json::Value::Object(serde_json::Map::new()),
        Some(args @ serde_json::Value::Object(_)) => args,
        Some(other) => {
            return Err(format!(
                "script turn {turn}, call {number}: args must be a mapping, got {}",
                json_kind(&other)
            ));
        }
    };
    Ok(ScriptCall {
        tool: spec.tool,
        args,
    })
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "a mapping",
    }
}

/// One line for a YAML error in the front matter, with line numbers counted in the
/// whole file (the opening `---` is line 1).
fn front_matter_error(yaml: &str, error: &serde_saphyr::Error) -> String {
    const LINES_BEFORE_YAML: u64 = 1;
    let formatter = serde_saphyr::UserMessageFormatter;
    let options = serde_saphyr::render_options! {
        formatter: &formatter,
        snippets: serde_saphyr::SnippetMode::Off,
        line_offset: LINES_BEFORE_YAML,
    };
    let mut message = one_line(&error.render_with_options(options));
    // A type error ("invalid u32") names no key: name the one it sits under.
    if let Some(key) = error.location().and_then(|at| key_before(yaml, at))
        && !message.contains(&format!("`{key}`"))
    {
        message = format!("{key}: {message}");
    }
    // `call:` is one call or a list of them; serde can only say that neither
    // matched, so look again for what is wrong inside.
    if message.contains("untagged enum OneOrMany")
        && let Some(detail) = explain_script_calls(yaml)
    {
        message = match error.location() {
            Some(at) => format!(
                "{detail} at line {}, column {}",
                at.line() + LINES_BEFORE_YAML,
                at.column()
            ),
            None => detail,
        };
    }
    format!("front matter: {}", plain_words(&message))
}

/// The key whose value holds `at`: the last `key:` before it on its line.
fn key_before(yaml: &str, at: serde_saphyr::Location) -> Option<&str> {
    let line = yaml
        .lines()
        .nth(usize::try_from(at.line()).ok()?.checked_sub(1)?)?;
    let column = usize::try_from(at.column()).ok()?.checked_sub(1)?;
    let end = line
        .char_indices()
        .nth(column)
        .map_or(line.len(), |(i, _)| i);
    let before = &line[..end];
    let colon = before.rfind(':')?;
    // Past the last character that cannot be in a key, which may be wider
    // than a byte.
    let key_start = before[..colon]
        .char_indices()
        .rev()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let key = &before[key_start..colon];
    (!key.is_empty()).then_some(key)
}

/// What is wrong with the first bad `call:` in the front matter, if one is.
fn explain_script_calls(yaml: &str) -> Option<String> {
    let front_matter: serde_json::Value = serde_saphyr::from_str(yaml).ok()?;
    let turns = front_matter.get("script")?.as_array()?;
    for (t, turn) in turns.iter().enumerate() {
        let Some(call) = turn.get("call") else {
            continue;
        };
        let calls = match call {
            serde_json::Value::Array(calls) => calls.clone(),
            serde_json::Value::Object(_) => vec![call.clone()],
            other => {
                return Some(format!(
                    "script turn {}: call must be a mapping {{tool, args}} or a list of them, got {}",
                    t + 1,
                    json_kind(other)
                ));
            }
        };
        for (c, call) in calls.into_iter().enumerate() {
            if let Err(e) = serde_json::from_value::<ScriptCallSpec>(call) {
                return Some(format!("script turn {}, call {}: {e}", t + 1, c + 1));
            }
        }
    }
    None
}
