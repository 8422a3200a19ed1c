//! The tools an agent is offered, and their arguments as the model sends them.
//!
//! Every argument struct refuses unknown fields: a model (or a script) that
//! passes `depth` or `run` in a job gets an error naming the field, so nothing
//! in a request can reach lineage (I-02).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The built-in tools. Everything the runtime knows of one is its entry in
/// [`ToolName::info`]; the list of them is the enum itself (`ALL`, derived),
/// so a tool added here is a compile error in `info` until it is described.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(strum::VariantArray)]
pub enum ToolName {
    Delegate,
    Collect,
    StopChild,
    SendMessage,
    Exec,
    ReadFile,
    WriteFile,
    ReadSkill,
    AskPerson,
    SendPeer,
    SubmitOutput,
}

/// How a built-in tool comes to be offered to an agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// To every agent: it must always be able to answer.
    Always,
    /// To an agent with sub-agents, above the depth cap (`Policy::offered`).
    Delegation,
    /// When the agent's `tools:` names it, and no deny above it does.
    Named,
    /// To an agent with skills it may read, unless denied.
    Skills,
    /// To a step of a flow group with `peers = true`, unless denied.
    Peers,
}

/// One built-in tool, whole: its name, what the model is told, its
/// arguments' type (as the schema the model is shown), how it is offered,
/// whether it needs the job's sandbox and whether a recording keeps its
/// results.
#[derive(Clone, Copy, Debug)]
pub struct ToolInfo {
    pub name: &'static str,
    pub description: &'static str,
    pub offer: Offer,
    /// It runs in the job's sandbox: a job offered it gets a Sandbox actor.
    pub sandbox: bool,
    /// Its results read the world (a command, a file) and are recorded and
    /// replayed. The others act on the tree (delegate, collect, ...) or are
    /// the model's own words (write_file, submit_output), and run again in
    /// a replay.
    pub recorded: bool,
    /// The JSON Schema of its argument type.
    schema: fn() -> serde_json::Value,
}

impl ToolName {
    /// Every built-in tool, in declaration order (`ALL[t as usize] == t`).
    pub const ALL: &'static [ToolName] = <ToolName as strum::VariantArray>::VARIANTS;

    /// The one table of built-in tools.
    pub fn info(self) -> ToolInfo {
        match self {
            ToolName::Delegate => ToolInfo {
                name: "delegate",
                description: "Hand jobs to your sub-agents (listed in your instructions) when a part of the work fits one of them or can run beside the others. Each job names an agent and a request it can do alone; with wait (the default) the call returns when every job has ended, with one result envelope each.",
                offer: Offer::Delegation,
                sandbox: false,
                recorded: false,
                schema: schema_of::<DelegateArgs>,
            },
            ToolName::Collect => ToolInfo {
                name: "collect",
                description: "Wait for children you started with wait=false and get their result envelopes; collect them before you answer, so no child's work is lost.",
                offer: Offer::Delegation,
                sandbox: false,
                recorded: false,
                schema: schema_of::<CollectArgs>,
            },
            ToolName::StopChild => ToolInfo {
                name: "stop_child",
                description: "Stop one of your children (by label or id) and everything below it, when its work is no longer needed or it is going wrong.",
                offer: Offer::Delegation,
                sandbox: false,
                recorded: false,
                schema: schema_of::<StopChildArgs>,
            },
            ToolName::SendMessage => ToolInfo {
                name: "send_message",
                description: "Send a running child a correction or new information; it reads it at its next turn. Use it instead of stopping a child that needs only a nudge.",
                offer: Offer::Delegation,
                sandbox: false,
                recorded: false,
                schema: schema_of::<SendMessageArgs>,
            },
            ToolName::Exec => ToolInfo {
                name: "exec",
                description: "Run a shell command in your workdir when you need to build, test, search or inspect something; returns exit code, stdout and stderr.",
                offer: Offer::Named,
                sandbox: true,
                recorded: true,
                schema: schema_of::<ExecArgs>,
            },
            ToolName::ReadFile => ToolInfo {
                name: "read_file",
                description: "Read a file of your workdir (a relative path) when you need its exact content.",
                offer: Offer::Named,
                sandbox: true,
                recorded: true,
                schema: schema_of::<ReadFileArgs>,
            },
            ToolName::WriteFile => ToolInfo {
                name: "write_file",
                description: "Write a whole file in your workdir (a relative path), creating or replacing it, when your work is a file rather than an answer.",
                offer: Offer::Named,
                sandbox: true,
                recorded: false,
                schema: schema_of::<WriteFileArgs>,
            },
            ToolName::ReadSkill => ToolInfo {
                name: "read_skill",
                description: "Read one of the skills listed in your instructions before you do work it covers: its instructions, or with file, a file it names (a path inside the skill's folder).",
                offer: Offer::Skills,
                sandbox: false,
                recorded: false,
                schema: schema_of::<ReadSkillArgs>,
            },
            ToolName::AskPerson => ToolInfo {
                name: "ask_person",
                description: "Ask a person a question when you cannot go on well without their answer (a choice only they can make, a fact only they know); you wait until they answer or the question expires. Give choices when the answer is one of a few.",
                offer: Offer::Named,
                sandbox: false,
                recorded: false,
                schema: schema_of::<AskPersonArgs>,
            },
            ToolName::SendPeer => ToolInfo {
                name: "send_peer",
                description: "Send one of your peers (the sibling steps your instructions list) a message they need from you: a finding, a warning, a hand-off; they read it at their next turn. It does not wait for an answer.",
                offer: Offer::Peers,
                sandbox: false,
                recorded: false,
                schema: schema_of::<SendPeerArgs>,
            },
            ToolName::SubmitOutput => ToolInfo {
                name: "submit_output",
                description: "Submit your answer and end your work, once the request is done or you cannot go further. Say task_status partial or blocked if it is not complete, and list what is missing in limitations.",
                offer: Offer::Always,
                sandbox: false,
                recorded: false,
                schema: schema_of::<SubmitOutputArgs>,
            },
        }
    }

    pub fn as_str(self) -> &'static str {
        self.info().name
    }

    /// What the model is told the tool does.
    pub fn description(self) -> &'static str {
        self.info().description
    }

    /// The tools an agent.md `tools:` list may name.
    pub fn nameable() -> impl Iterator<Item = ToolName> {
        ToolName::ALL
            .iter()
            .copied()
            .filter(|t| t.info().offer == Offer::Named)
    }

    /// The JSON Schema of the tool's arguments, generated from the argument
    /// type itself, so what the model is told and what the loop accepts
    /// cannot drift apart. Self-contained: no `$ref`, no `$schema`.
    /// Generated once per tool and process (every request body carries them).
    pub fn parameters(self) -> &'static serde_json::Value {
        static SCHEMAS: std::sync::OnceLock<Vec<serde_json::Value>> = std::sync::OnceLock::new();
        let schemas =
            SCHEMAS.get_or_init(|| ToolName::ALL.iter().map(|t| (t.info().schema)()).collect());
        // `ALL` is the enum's own variant list, in declaration order.
        &schemas[self as usize]
    }
}

fn schema_of<T: JsonSchema>() -> serde_json::Value {
    let generator = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let mut value = generator.into_root_schema_for::<T>().to_value();
    if let Some(map) = value.as_object_mut() {
        map.remove("$schema");
        map.remove("title");
    }
    value
}

impl fmt::Display for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ToolName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ToolName::ALL
            .iter()
            .copied()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| format!("unknown tool {s:?}"))
    }
}

/// I-09: `key`'s dollars as a positive whole number of micro-dollars, or
/// a reason why not.
pub fn usd_to_micros(key: &str, usd: f64) -> Result<u64, String> {
    if !usd.is_finite() || usd <= 0.0 {
        return Err(format!(
            "{key} must be more than 0 dollars, got {usd} (0 never means unlimited)"
        ));
    }
    if usd > 1e9 {
        return Err(format!("{key} {usd} is not a budget"));
    }
    let micros = (usd * 1e6).round();
    if micros < 1.0 {
        return Err(format!(
            "{key} {usd} is less than one micro-dollar (0 never means unlimited)"
        ));
    }
    Ok(micros as u64)
}

/// A budget: a whole number of tokens, dollars (metered in micro-dollars), or both.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetArg {
    pub tokens: Option<serde_json::Number>,
    pub usd: Option<f64>,
}

impl BudgetArg {
    /// I-09: dollars as a positive whole number of micro-dollars, or a reason why not.
    pub fn usd_micros(&self) -> Result<Option<u64>, String> {
        self.usd
            .map(|usd| usd_to_micros("budget.usd", usd))
            .transpose()
    }

    /// I-09: a positive whole number of tokens, or a reason why not.
    pub fn tokens(&self) -> Result<Option<u64>, String> {
        match &self.tokens {
            None => Ok(None),
            Some(n) => match n.as_u64() {
                Some(0) => Err("budget.tokens must be at least 1 (0 never means unlimited)".into()),
                Some(v) => Ok(Some(v)),
                None => Err(format!(
                    "budget.tokens must be a positive whole number, got {n}"
                )),
            },
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// The other children finish.
    #[default]
    Continue,
    /// I-42: the first child that fails stops its still-running siblings.
    CancelSiblings,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DelegateArgs {
    /// A durable key for this delegation (I-32). Without one, the key is the
    /// parent's id and the tool call's id. The same key with the same request
    /// returns the jobs it started; with another request it is a conflict.
    pub key: Option<String>,
    pub jobs: Vec<JobArgs>,
    #[serde(default = "yes")]
    pub wait: bool,
    #[serde(default)]
    pub on_failure: OnFailure,
    pub timeout: Option<String>,
}

fn yes() -> bool {
    true
}

/// One job in a delegate call. Only `agent` and `request` are required.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobArgs {
    /// The sub-agent to run it: one of those your instructions list.
    pub agent: String,
    /// What it should do, whole: it sees nothing of your conversation.
    pub request: String,
    /// The model to run it on (`provider/model`), one of those your
    /// instructions list for its agent; its default otherwise.
    // Left out when unset, so a delegation's digest (I-32) journaled before
    // this field existed still matches after an upgrade.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A short name to collect, steer or stop it by (unique among your children).
    pub label: Option<String>,
    /// The most it may spend, taken from your own budget.
    pub budget: Option<BudgetArg>,
    /// The most model turns it may take.
    pub max_turns: Option<i64>,
    /// The longest it may run, as `90s` or `5m`.
    pub timeout: Option<String>,
    /// How many times it is started again after a transient failure (0 to 2).
    pub retries: Option<i64>,
    /// Instead of `retries`, tried again after a wait: `{attempts, wait,
    /// backoff, max_wait, on}` (attempts count the first; `on` the error
    /// classes to try again). Each attempt is a new job.
    // Left out when unset: a delegation's digest (I-32) stays as it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "job_retry_schema")]
    pub retry: Option<crate::retry::RetryPolicy>,
    /// Tools it may not use, beyond those denied to you.
    #[serde(default)]
    pub deny: Vec<String>,
    /// A JSON Schema its output must match.
    pub output_schema: Option<serde_json::Value>,
    /// Files it must leave in its workdir (relative paths).
    #[serde(default)]
    pub require_artifacts: Vec<String>,
}

/// `retry` as a model is shown it: the policy's keys in a few words, and
/// `on` only the classes that can be tried again (`ErrorClass::is_retryable`),
/// taken from the class's own schema so the two cannot drift.
fn job_retry_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let classes = crate::ErrorClass::json_schema(generator);
    let retryable: Vec<serde_json::Value> = classes
        .get("oneOf")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|variant| variant.get("const"))
        .filter(|name| {
            serde_json::from_value::<crate::ErrorClass>((*name).clone())
                .is_ok_and(|c| c.is_retryable())
        })
        .cloned()
        .collect();
    schemars::json_schema!({
        "type": ["object", "null"],
        "additionalProperties": false,
        "required": ["attempts"],
        "properties": {
            "attempts": {"type": "integer", "minimum": 1, "maximum": crate::retry::MAX_ATTEMPTS,
                "description": "Attempts in all, the first included."},
            "wait": {"type": "string", "description": "Before the second attempt, as `15s`."},
            "backoff": {"type": "number", "minimum": 1,
                "description": "Each later wait is the one before times this."},
            "max_wait": {"type": "string", "description": "The longest wait, as `5m`."},
            "on": {"type": "array", "items": {"enum": retryable},
                "description": "The error classes tried again; none named: every one here."}
        }
    })
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CollectArgs {
    /// Labels or ids; empty means every child not yet collected.
    #[serde(default)]
    pub children: Vec<String>,
    pub timeout: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopChildArgs {
    pub child: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessageArgs {
    pub child: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    pub command: String,
    pub timeout: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    pub path: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadSkillArgs {
    /// One of the skills your instructions list.
    pub name: String,
    /// A file of the skill's, relative to its folder; without it, its
    /// instructions (SKILL.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendPeerArgs {
    /// A peer's label, as your instructions list it.
    pub to: String,
    /// The message, whole: it is all they see of it.
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AskPersonArgs {
    /// The question, whole: the person sees nothing else of your work.
    pub question: String,
    /// The answers they may pick from; none: they answer in their own words.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<String>,
}

/// The most choices a question may offer, and the longest one.
pub const MAX_CHOICES: usize = 20;
pub const MAX_CHOICE_LEN: usize = 200;
/// The longest question, in bytes.
pub const MAX_QUESTION_LEN: usize = 4000;

impl AskPersonArgs {
    /// Refused before any card is made, in words the model acts on.
    pub fn check(&self) -> Result<(), String> {
        let question = self.question.trim();
        if question.is_empty() {
            return Err("question is empty: ask what you need to know".into());
        }
        if question.len() > MAX_QUESTION_LEN {
            return Err(format!(
                "question is {} bytes: ask in at most {MAX_QUESTION_LEN}",
                question.len()
            ));
        }
        if self.choices.len() > MAX_CHOICES {
            return Err(format!(
                "{} choices: give at most {MAX_CHOICES}, or none to take any answer",
                self.choices.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for choice in &self.choices {
            let c = choice.trim();
            if c.is_empty() || c.len() > MAX_CHOICE_LEN {
                return Err(format!(
                    "choice {choice:?}: each choice is 1 to {MAX_CHOICE_LEN} bytes"
                ));
            }
            if !seen.insert(c) {
                return Err(format!("choice {c:?} is given twice"));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    pub path: String,
    pub content: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitOutputArgs {
    pub output: serde_json::Value,
    pub task_status: Option<crate::TaskStatus>,
    #[serde(default)]
    pub limitations: Vec<String>,
}

/// Parses a humantime duration argument, naming the field in the error.
pub fn parse_duration_arg(
    field: &str,
    text: Option<&str>,
) -> Result<Option<std::time::Duration>, String> {
    match text {
        None => Ok(None),
        Some(t) => {
            let d = crate::duration_str::parse(t).map_err(|e| format!("{field}: {e}"))?;
            if d.is_zero() {
                return Err(format!("{field}: a timeout of 0 would stop at once"));
            }
            Ok(Some(d))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_schema_is_a_self_contained_object_that_refuses_unknown_fields() {
        for &tool in ToolName::ALL {
            let schema = tool.parameters();
            let text = schema.to_string();
            assert_eq!(schema["type"], "object", "{tool}: {text}");
            assert_eq!(schema["additionalProperties"], false, "{tool}: {text}");
            assert!(!text.contains("$ref"), "{tool}: {text}");
            assert!(!tool.description().is_empty());
        }
        let delegate = ToolName::Delegate.parameters();
        assert_eq!(delegate["required"], serde_json::json!(["jobs"]));
        let job = &delegate["properties"]["jobs"]["items"];
        assert_eq!(job["additionalProperties"], false, "{job}");
        assert!(job["required"].as_array().unwrap().len() == 2, "{job}");
    }

    /// The table's names are the wire's (serde's) names, and `ALL` indexes
    /// by discriminant, which `parameters` relies on.
    #[test]
    fn every_tool_is_named_as_serde_names_it_and_indexed_by_its_discriminant() {
        for (i, &tool) in ToolName::ALL.iter().enumerate() {
            assert_eq!(tool as usize, i);
            assert_eq!(serde_json::to_value(tool).unwrap(), tool.as_str());
            assert_eq!(tool.as_str().parse::<ToolName>(), Ok(tool));
            assert!(
                !tool.info().sandbox || tool.info().offer == Offer::Named,
                "{tool}"
            );
        }
    }
}
