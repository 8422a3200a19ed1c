//! A flow's `input` (`"text"`, or a JSON Schema): checked at load, checked
//! again for each run against what it is given, and filled into the step
//! instructions (`{{ input }}`, `{{ input.field }}`) by minijinja.

use arbor_protocol::{FlowGroup, FlowInput, FlowSpec};
use serde_json::Value;

/// The environment every instruction renders in: an undefined value is
/// an error (a misspelt field is said, not rendered as nothing).
fn env() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env
}

/// At load: the declaration is `"text"` or a schema that compiles, and
/// each instruction that is a template names no value but `input`, and
/// `input` only if the flow declares one.
pub(super) fn check_declaration(flow: &FlowSpec) -> Result<(), String> {
    match &flow.input {
        Some(FlowInput::Text(text)) if text != "text" => {
            return Err(format!(
                "input = {text:?}: write input = \"text\", or a JSON Schema as a table"
            ));
        }
        Some(FlowInput::Schema(schema)) => {
            jsonschema::validator_for(&Value::Object(schema.clone()))
                .map_err(|e| format!("input is not a valid JSON Schema: {e}"))?;
        }
        _ => {}
    }
    let env = env();
    for (g, group) in flow.groups.iter().enumerate() {
        for (s, step) in group.steps.iter().enumerate() {
            let at = || format!("step {} of group {}", s + 1, g + 1);
            let template = match env.template_from_str(&step.instruction) {
                Ok(template) => template,
                // Without an input, braces are the instruction's own words.
                Err(_) if flow.input.is_none() => continue,
                Err(e) => return Err(format!("{}'s instruction: {e}", at())),
            };
            for name in template.undeclared_variables(false) {
                match (name.as_str(), &flow.input) {
                    ("input", Some(_)) => {}
                    ("input", None) => {
                        return Err(format!(
                            "{}'s instruction uses {{{{ input }}}}, but the flow declares no `input`",
                            at()
                        ));
                    }
                    (other, _) if flow.input.is_some() => {
                        return Err(format!(
                            "{}'s instruction names `{other}`: only `input` is known",
                            at()
                        ));
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// A run's `input` against flow `name`'s declaration: the value it carries,
/// or why not (naming where the input fails its schema).
pub(super) fn check(
    name: &str,
    flow: &FlowSpec,
    input: Option<&Value>,
) -> Result<Option<Value>, String> {
    match (&flow.input, input) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(format!(
            "flow {name} takes no input (its file declares no `input`)"
        )),
        (Some(FlowInput::Text(_)), None) | (Some(FlowInput::Schema(_)), None) => Err(format!(
            "flow {name} needs an input (--input TEXT, --input-file PATH, or `input` in the request)"
        )),
        (Some(FlowInput::Text(_)), Some(Value::String(text))) => {
            if text.trim().is_empty() {
                return Err(format!("flow {name}'s input is empty"));
            }
            Ok(Some(Value::String(text.clone())))
        }
        (Some(FlowInput::Text(_)), Some(other)) => Err(format!(
            "flow {name} takes text as its input, not {}",
            kind(other)
        )),
        (Some(FlowInput::Schema(schema)), Some(value)) => {
            // Typed at a terminal (`--input '{"topic": "x"}'`), JSON comes as
            // text: read it as JSON unless the schema takes a string.
            let parsed = match value {
                Value::String(text) if schema.get("type") != Some(&Value::from("string")) => {
                    serde_json::from_str(text).ok()
                }
                _ => None,
            };
            let value = parsed.as_ref().unwrap_or(value);
            let schema = Value::Object(schema.clone());
            let validator = jsonschema::validator_for(&schema)
                .map_err(|e| format!("flow {name}'s input schema: {e}"))?;
            let failures: Vec<String> = validator
                .iter_errors(value)
                .map(|e| {
                    let path = e.instance_path().to_string();
                    let at = if path.is_empty() { "/".into() } else { path };
                    format!("{at}: {e}")
                })
                .collect();
            if failures.is_empty() {
                Ok(Some(value.clone()))
            } else {
                Err(format!(
                    "flow {name}'s input does not meet its schema: {}",
                    failures.join("; ")
                ))
            }
        }
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Fills `input` into each step's instruction.
pub(super) fn render(groups: &mut [FlowGroup], input: &Value) -> Result<(), String> {
    let env = env();
    let context = minijinja::context! { input => minijinja::Value::from_serialize(input) };
    for (g, group) in groups.iter_mut().enumerate() {
        for (s, step) in group.steps.iter_mut().enumerate() {
            step.instruction = env
                .render_str(&step.instruction, &context)
                .map_err(|e| format!("step {} of group {}'s instruction: {e}", s + 1, g + 1))?;
        }
    }
    Ok(())
}
