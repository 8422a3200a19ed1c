//! An agent definition: the front matter of `agents/NAME/agent.md` and its body.
//!
//! The shapes here are what the file says; `arbor-runtime` reads the file and
//! checks what the types cannot (a sub-agent needs a description, say).

use crate::mcp::{McpPattern, ToolLimits, ToolRef};
use crate::tools::{BudgetArg, ToolName};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A loaded agent: front matter plus the system prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentDef {
    pub name: String,
    pub description: Option<String>,
    /// The model a job of it runs on unless its delegate call names another.
    pub model: ModelRef,
    /// The models a job of it may run on (I-55), `model` among them; empty:
    /// `model` only.
    #[serde(default)]
    pub models: Vec<ModelRef>,
    /// Where a call goes, in order, when its model's supply is walled (a
    /// usage cap, an auth failure, a rate limit or overload that outlasted
    /// the call's retries): each among `models` (I-55).
    #[serde(default)]
    pub fallback: Vec<ModelRef>,
    /// The sandbox tools it may use (`exec`, `read_file`, `write_file`).
    pub tools: Vec<ToolName>,
    /// The MCP tools it may use: `mcp: [SERVER]` and the `mcp__` names of
    /// `tools:`, as patterns.
    #[serde(default)]
    pub mcp: Vec<McpPattern>,
    /// The most calls one of its jobs may make, per tool and in all.
    #[serde(default)]
    pub limits: ToolLimits,
    /// Tools this agent and everything below it may not use (I-25).
    pub deny: Vec<String>,
    /// Tools whose calls wait for a person, here and everywhere below
    /// (I-46), or run at once and are recorded on a card (`notify`, I-60).
    #[serde(default)]
    pub approve: Vec<crate::ApproveEntry>,
    /// Commands asked before each of its tool calls, here and everywhere
    /// below (I-62).
    #[serde(default)]
    pub hooks: Hooks,
    pub subagents: Vec<String>,
    pub sandbox: SandboxMode,
    pub network: Network,
    /// Secret names; values come from the node's secrets file or its
    /// environment, and reach only its commands' environment (I-27).
    pub secrets: Vec<String>,
    /// The most one job of this agent may be granted, in tokens.
    pub budget_tokens: Option<u64>,
    /// ... and in micro-dollars.
    #[serde(default)]
    pub budget_usd_micros: Option<u64>,
    /// `budget.per_run`: what all its jobs of one run may be granted together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_run: Option<PerRun>,
    pub max_turns: Option<u32>,
    pub timeout: Option<Duration>,
    /// Overrides `[limits] max_repeats` for its jobs.
    #[serde(default)]
    pub max_repeats: Option<u32>,
    /// The workspace's skills it may read, in the order its prompt lists
    /// them; a job's are cut to its parent's (I-25).
    #[serde(default)]
    pub skills: Vec<String>,
    /// How its model samples and reasons, over its model entry's defaults.
    #[serde(default)]
    pub settings: Settings,
    /// Shared by every job of the agent (the scripted model reads it).
    pub script: std::sync::Arc<Vec<ScriptTurn>>,
    /// The markdown body: the system prompt.
    pub prompt: String,
    /// The rlimits of its commands: its `resources:` within the node's
    /// `[sandbox]` defaults, resolved when the workspace loads.
    #[serde(default)]
    pub resources: Resources,
}

/// Limits on every process a sandbox runs (set with setrlimit before exec,
/// soft and hard alike).
/// `None`: not limited by arbor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    /// Address space, bytes (RLIMIT_AS).
    pub memory_bytes: Option<u64>,
    /// CPU time, seconds (RLIMIT_CPU).
    pub cpu_secs: Option<u64>,
    /// The largest file a process may write, bytes (RLIMIT_FSIZE).
    pub file_size_bytes: Option<u64>,
    /// Open files (RLIMIT_NOFILE).
    pub open_files: Option<u64>,
    /// Processes (RLIMIT_NPROC). Sealed, a sandbox's processes are counted
    /// apart (a uid of its own, or a user namespace); unsealed, the kernel
    /// counts every process of the node's user against it.
    pub processes: Option<u64>,
}

/// `resources:` in agent.md, and `[sandbox]` in arbor.toml, as written.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// e.g. "512MiB"
    pub memory: Option<String>,
    /// e.g. "60s"
    pub cpu: Option<String>,
    /// e.g. "64MiB"
    pub file_size: Option<String>,
    pub open_files: Option<u64>,
    pub processes: Option<u64>,
}

/// agent.md `hooks`: policy as code (I-62).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hooks {
    /// A command run sealed before each of its tool calls (the call as JSON
    /// on stdin), answering `{"decision": "allow" | "deny" | "ask",
    /// "reason": "..."}` on stdout; anything else denies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_call: Option<String>,
}

/// agent.md `budget.per_run`, checked: tokens, micro-dollars, or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerRun {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usd_micros: Option<u64>,
}

/// An agent's `budget:` as written: the most one of its jobs may be
/// granted, and `per_run`, what all its jobs of one run may spend together.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentBudget {
    pub tokens: Option<serde_json::Number>,
    pub usd: Option<f64>,
    pub per_run: Option<BudgetArg>,
}

impl AgentBudget {
    /// The most one job may be granted.
    pub fn per_job(&self) -> BudgetArg {
        BudgetArg {
            tokens: self.tokens.clone(),
            usd: self.usd,
        }
    }
}

/// The front matter exactly as written. Unknown keys are an error.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontMatter {
    pub name: Option<String>,
    pub description: Option<String>,
    pub model: Option<String>,
    #[serde(default)]
    pub tools: Vec<ToolRef>,
    /// MCP servers (arbor.toml `[mcp.servers.NAME]`) whose every tool it may use.
    #[serde(default)]
    pub mcp: Vec<String>,
    /// Tools whose calls wait for a person's approval (names or `*`
    /// patterns), each perhaps with its own wait and mode.
    #[serde(default)]
    pub approve: Vec<crate::ApproveEntry>,
    #[serde(default)]
    pub hooks: Hooks,
    pub limits: Option<ToolLimits>,
    #[serde(default)]
    pub deny: Vec<String>,
    #[serde(default)]
    pub subagents: Vec<String>,
    pub sandbox: Option<SandboxMode>,
    pub network: Option<Network>,
    #[serde(default)]
    pub secrets: Vec<String>,
    pub budget: Option<AgentBudget>,
    pub max_turns: Option<u32>,
    pub timeout: Option<String>,
    pub max_repeats: Option<u32>,
    #[serde(default)]
    pub models: Vec<String>,
    /// Where a call goes when its model's supply is walled (I-55), in order.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// Skills (`skills/NAME/SKILL.md`) its prompt lists and `read_skill` reads.
    #[serde(default)]
    pub skills: Vec<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub effort: Option<Effort>,
    #[serde(default)]
    pub script: Vec<ScriptTurnSpec>,
    pub resources: Option<ResourcesSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ModelRef {
    /// The offline, deterministic model: the agent's `script:` is its answers.
    Scripted,
    /// `provider/model` from arbor.toml.
    Provider { provider: String, model: String },
}

impl std::fmt::Display for ModelRef {
    /// As agent.md names it: `scripted` or `provider/model`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelRef::Scripted => f.write_str("scripted"),
            ModelRef::Provider { provider, model } => write!(f, "{provider}/{model}"),
        }
    }
}

impl AgentDef {
    /// The models a job of it may run on (I-55): `models`, or its `model`.
    pub fn allowed_models(&self) -> &[ModelRef] {
        if self.models.is_empty() {
            std::slice::from_ref(&self.model)
        } else {
            &self.models
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxMode {
    /// A subdirectory of the parent's workdir; tools are cut to the parent's.
    #[default]
    Shared,
    /// Its own workdir, tools and secrets; it cannot delegate further (I-26).
    Own,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Network {
    #[default]
    None,
    Open,
}

/// One scripted model response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScriptTurn {
    pub say: Option<String>,
    pub calls: Vec<ScriptCall>,
    pub usage: Option<ScriptUsage>,
    pub delay: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScriptCall {
    pub tool: String,
    /// Checked when the call is made, not when the agent loads: scripts call
    /// tools wrongly on purpose to test that.
    pub args: serde_json::Value,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptUsage {
    #[serde(default)]
    pub input: u64,
    #[serde(default)]
    pub output: u64,
}

/// A turn as written in YAML.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptTurnSpec {
    pub say: Option<String>,
    pub call: Option<OneOrMany<ScriptCallSpec>>,
    pub usage: Option<ScriptUsage>,
    pub delay: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptCallSpec {
    pub tool: String,
    #[serde(default)]
    pub args: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(one) => vec![one],
            OneOrMany::Many(many) => many,
        }
    }
}

/// How a model samples and reasons: agent.md's `temperature`, `top_p` and
/// `effort`, or a model entry's defaults for them. Kept in thousandths, so
/// a definition compares exactly (`temperature: 0.7` is 700).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Settings {
    /// 0 to 2000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_milli: Option<u16>,
    /// 1 to 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p_milli: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<Effort>,
}

impl Settings {
    /// These, each unset one taken from `defaults`.
    pub fn over(self, defaults: Settings) -> Settings {
        Settings {
            temperature_milli: self.temperature_milli.or(defaults.temperature_milli),
            top_p_milli: self.top_p_milli.or(defaults.top_p_milli),
            effort: self.effort.or(defaults.effort),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == Settings::default()
    }

    /// Checks and keeps `temperature` (0 to 2) and `top_p` (above 0, at
    /// most 1) as thousandths; the error names the key.
    pub fn from_figures(
        temperature: Option<f64>,
        top_p: Option<f64>,
        effort: Option<Effort>,
    ) -> Result<Settings, String> {
        let milli = |value: Option<f64>, key: &str, low_open: bool, high: f64| match value {
            None => Ok(None),
            Some(v)
                if v.is_finite() && (if low_open { v > 0.0 } else { v >= 0.0 }) && v <= high =>
            {
                Ok(Some((v * 1000.0).round() as u16))
            }
            Some(v) => Err(format!(
                "{key} must be {} {high}, got {v}",
                if low_open {
                    "above 0 and at most"
                } else {
                    "0 to"
                }
            )),
        };
        let settings = Settings {
            temperature_milli: milli(temperature, "temperature", false, 2.0)?,
            top_p_milli: milli(top_p, "top_p", true, 1.0)?,
            effort,
        };
        if settings.top_p_milli == Some(0) {
            return Err("top_p must be at least 0.001".into());
        }
        Ok(settings)
    }
}

/// Anthropic's extended thinking: the tokens a model may think with at
/// each `effort` (a model entry's `thinking_tokens`), counted as output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ThinkingTokens {
    pub low: u64,
    pub medium: u64,
    pub high: u64,
}

impl ThinkingTokens {
    pub fn at(&self, effort: Effort) -> u64 {
        match effort {
            Effort::Low => self.low,
            Effort::Medium => self.medium,
            Effort::High => self.high,
        }
    }
}

/// How hard a reasoning model thinks: OpenAI's `reasoning_effort`, or
/// Anthropic's extended thinking at a model entry's `thinking_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Effort {
    Low,
    Medium,
    High,
}

impl Effort {
    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
        }
    }
}

/// Why `step`, interrupted by a restart, waits for a person before it runs
/// again (I-57): what it may have done outside its workdir. None: it is
/// re-run as it is (it touches only its workdir, or its flow says
/// `rerun_interrupted`). `agent` and `server` look names up.
pub fn needs_decision<'a>(
    step: &crate::StepSpec,
    agent: impl Fn(&str) -> Option<&'a AgentDef>,
    server: impl Fn(&str) -> Option<&'a crate::McpServerSpec>,
) -> Option<String> {
    if step.rerun_interrupted == Some(true) {
        return None;
    }
    let root = agent(&step.agent)?;
    let reasons = outward_reasons(root, agent, server);
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// Why a step of `root` may act outside its workdir (I-57): `root` or a
/// sub-agent it can reach runs commands with the network open or holds a
/// secret, or uses an MCP server that can reach out (over HTTP, or with
/// the network open) or holds a secret. Each reason names its agent; none:
/// it touches only its own workdir, and a restart re-runs it as it is.
/// `agent` and `server` look names up; a name they do not know is passed
/// over (the loader refuses those).
pub fn outward_reasons<'a>(
    root: &'a AgentDef,
    agent: impl Fn(&str) -> Option<&'a AgentDef>,
    server: impl Fn(&str) -> Option<&'a crate::McpServerSpec>,
) -> Vec<String> {
    let mut reasons = vec![];
    let mut seen = std::collections::BTreeSet::new();
    let mut queue = vec![root];
    while let Some(def) = queue.pop() {
        if !seen.insert(def.name.as_str()) {
            continue;
        }
        let who = &def.name;
        if def.network == Network::Open && def.tools.contains(&crate::ToolName::Exec) {
            reasons.push(format!(
                "{who}: its commands have the network (network: open)"
            ));
        }
        if !def.secrets.is_empty() {
            reasons.push(format!("{who}: holds secrets {}", def.secrets.join(", ")));
        }
        let mut servers: Vec<&str> = def.mcp.iter().map(|p| p.server.as_str()).collect();
        servers.dedup();
        for spec in servers.into_iter().filter_map(&server) {
            let name = &spec.name;
            match &spec.transport {
                crate::McpTransport::Http(http) => reasons.push(format!(
                    "{who}: MCP server {name} is reached over HTTP ({})",
                    http.url
                )),
                crate::McpTransport::Stdio(stdio) if stdio.network == Network::Open => {
                    reasons.push(format!("{who}: MCP server {name} has the network"))
                }
                crate::McpTransport::Stdio(_) => {}
            }
            if !spec.secrets.is_empty() {
                reasons.push(format!("{who}: MCP server {name} holds secrets"));
            }
        }
        queue.extend(def.subagents.iter().filter_map(|s| agent(s)));
    }
    reasons
}
