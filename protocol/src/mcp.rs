//! MCP tools as arbor.toml and agent.md name them: a server's declaration,
//! the patterns `tools:`, `deny` and `limits` use, and the names a model sees.
//!
//! A server's tool has three names. Its **own** (what `tools/list` says and
//! `tools/call` takes, any string); its **canonical** name,
//! `mcp__SERVER__TOOL` with the tool's name cut to `[A-Za-z0-9_-]`, which
//! agent.md, policies, limits, events and the journal use; and its **model**
//! name, the canonical one unless that is longer than a provider takes
//! (`MODEL_NAME_MAX`), then cut with a hash of the whole after it.
//!
//! Invariant: a server's name never holds `__`, so `mcp__SERVER__TOOL` splits
//! one way only.

use crate::Network;
use crate::tools::ToolName;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// What every MCP tool's canonical and model name starts with.
pub const MCP_PREFIX: &str = "mcp__";
/// The longest tool name arbor shows a model (OpenAI's limit, the shortest).
pub const MODEL_NAME_MAX: usize = 64;
/// The key of `limits` that counts every call of a job.
pub const ALL_CALLS: &str = "calls";
/// A server's call timeout unless arbor.toml says otherwise.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a server may take to start and answer `initialize`.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(10);

/// `[mcp.servers.NAME]` of arbor.toml, checked and resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct McpServerSpec {
    pub name: String,
    pub transport: McpTransport,
    /// Secret names: their values reach the server's environment (stdio)
    /// or its headers (HTTP) only (I-27).
    pub secrets: Vec<String>,
    pub call_timeout: Duration,
    pub start_timeout: Duration,
}

/// How a server is reached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum McpTransport {
    /// A program a job's sandbox starts, sealed, and speaks to over its
    /// stdin and stdout.
    Stdio(StdioServer),
    /// A streamable HTTP endpoint someone else runs, reached from the node.
    Http(HttpServer),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdioServer {
    /// The program, found on the sandbox's PATH unless it holds a `/`.
    pub command: String,
    pub args: Vec<String>,
    /// Variables beyond the sandbox's allowlist.
    pub env: BTreeMap<String, String>,
    pub network: Network,
    /// Host folders the server sees, read-only, at the same path (its
    /// program's own files, where they are not below `/usr`).
    pub read_only: Vec<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpServer {
    /// `http://` or `https://`: the endpoint of its streamable HTTP transport.
    pub url: String,
    /// Sent with every request; `${NAME}` in a value stands for the
    /// declared secret NAME's value.
    pub headers: BTreeMap<String, String>,
}

impl HttpServer {
    /// The headers with each `${NAME}` replaced by `value(NAME)`; `Err`
    /// names the first secret without a value.
    pub fn headers_with(
        &self,
        value: impl Fn(&str) -> Option<String>,
    ) -> Result<Vec<(String, String)>, String> {
        let mut out = Vec::with_capacity(self.headers.len());
        for (name, template) in &self.headers {
            let mut text = String::new();
            for piece in placeholders(template)? {
                match piece {
                    Piece::Text(t) => text.push_str(t),
                    Piece::Secret(secret) => text.push_str(&value(secret).ok_or_else(|| {
                        format!("the secret {secret} (header {name}) has no value on this node")
                    })?),
                }
            }
            out.push((name.clone(), text));
        }
        Ok(out)
    }
}

/// Headers the transport sets itself, which a declaration may not.
pub const RESERVED_HEADERS: [&str; 5] = [
    "accept",
    "content-type",
    "mcp-session-id",
    "mcp-protocol-version",
    "last-event-id",
];

/// A header value's parts: text as it is, and `${NAME}` secrets.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    Text(&'a str),
    Secret(&'a str),
}

/// `template` cut into its parts; an unclosed `${` is an error (a value
/// meant to hold a secret must not go out holding its name instead).
pub fn placeholders(template: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = vec![];
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            pieces.push(Piece::Text(&rest[..start]));
        }
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("{template:?}: a `${{` is never closed"))?;
        pieces.push(Piece::Secret(&after[..end]));
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// `mcp__SERVER__TOOL`, or `mcp__SERVER__*` (every tool of the server).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct McpPattern {
    pub server: String,
    /// A canonical tool name (without the prefix); None: all of them.
    pub tool: Option<String>,
}

impl McpPattern {
    pub fn all(server: &str) -> Self {
        Self {
            server: server.to_string(),
            tool: None,
        }
    }

    /// None when `text` is not an MCP name at all; else the pattern, or
    /// why it is not one.
    pub fn parse(text: &str) -> Option<Result<Self, String>> {
        let rest = text.strip_prefix(MCP_PREFIX)?;
        let bad = |why: &str| {
            Some(Err(format!(
                "{text:?} is not an MCP tool name: {why} (mcp__SERVER__TOOL or mcp__SERVER__*)"
            )))
        };
        let Some((server, tool)) = rest.split_once("__") else {
            return bad("it names no tool");
        };
        if let Err(why) = check_server_name(server) {
            return bad(&why);
        }
        if tool == "*" {
            return Some(Ok(Self::all(server)));
        }
        if tool.is_empty() || !is_name(tool) {
            return bad("a tool's name is letters, digits, '_' and '-'");
        }
        Some(Ok(Self {
            server: server.to_string(),
            tool: Some(tool.to_string()),
        }))
    }

    /// Whether it covers the server's tool of this canonical name.
    pub fn covers(&self, server: &str, tool: &str) -> bool {
        self.server == server && self.tool.as_deref().is_none_or(|t| t == tool)
    }

    /// What both patterns cover, if anything.
    pub fn intersect(&self, other: &Self) -> Option<Self> {
        if self.server != other.server {
            return None;
        }
        match (&self.tool, &other.tool) {
            (None, _) => Some(other.clone()),
            (_, None) => Some(self.clone()),
            (Some(a), Some(b)) if a == b => Some(self.clone()),
            _ => None,
        }
    }
}

impl fmt::Display for McpPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tool = self.tool.as_deref().unwrap_or("*");
        write!(f, "{MCP_PREFIX}{}__{tool}", self.server)
    }
}

impl<'de> Deserialize<'de> for McpPattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        match McpPattern::parse(&text) {
            Some(pattern) => pattern.map_err(serde::de::Error::custom),
            None => Err(serde::de::Error::custom(format!(
                "{text:?} is not an MCP tool name (mcp__SERVER__TOOL or mcp__SERVER__*)"
            ))),
        }
    }
}

impl Serialize for McpPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A tool agent.md's `tools:` names: a sandbox tool, or MCP tools.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ToolRef {
    Builtin(ToolName),
    Mcp(McpPattern),
}

impl std::str::FromStr for ToolRef {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match McpPattern::parse(text) {
            Some(pattern) => pattern.map(ToolRef::Mcp),
            None => text.parse::<ToolName>().map(ToolRef::Builtin),
        }
    }
}

impl fmt::Display for ToolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolRef::Builtin(tool) => tool.fmt(f),
            ToolRef::Mcp(pattern) => pattern.fmt(f),
        }
    }
}

impl<'de> Deserialize<'de> for ToolRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for ToolRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A server's name: letters, digits, `_` and `-`, and never `__`.
pub fn check_server_name(name: &str) -> Result<(), String> {
    if name.is_empty() || !is_name(name) {
        return Err(format!(
            "{name:?}: a server's name is letters, digits, '_' and '-'"
        ));
    }
    if name.contains("__") {
        return Err(format!(
            "{name:?}: a server's name may not hold \"__\", which separates it from a tool's in mcp__SERVER__TOOL"
        ));
    }
    Ok(())
}

fn is_name(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A server's tool as agent.md names it: every other byte becomes `_`.
pub fn canonical_name(server: &str, tool: &str) -> String {
    let tool: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{MCP_PREFIX}{server}__{tool}")
}

/// The name a model is shown: the canonical one if it fits, else its first
/// bytes, `_`, and eight hex digits of the whole's SHA-256, so that two long
/// names that share a beginning stay apart, the same on every node.
pub fn model_name(canonical: &str) -> String {
    if canonical.len() <= MODEL_NAME_MAX {
        return canonical.to_string();
    }
    let digest = sha2::Sha256::digest(canonical.as_bytes());
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    // Canonical names are ASCII, so any cut is a char boundary.
    format!("{}_{hex}", &canonical[..MODEL_NAME_MAX - 9])
}

/// Whether a `deny` or `limits` entry covers a tool's (canonical) name: the
/// same name, or a prefix ending in `*` (`mcp__fs__*`, `mcp__*`).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

/// `limits:` of agent.md, and `[limits.tools]` of arbor.toml: the most calls
/// one job attempt may make of a tool (or of the tools a pattern covers),
/// and of all tools (`calls`). `submit_output` is never counted: a job must
/// always be able to answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ToolLimits(pub BTreeMap<String, u64>);

impl ToolLimits {
    /// Checks each key and value: a tool a job could be offered, a pattern,
    /// or `calls`; at least 1 (0 never means unlimited; deny a tool instead).
    /// `prefix` names where they were written (`limits.`, `limits.tools.`).
    pub fn check(&self, prefix: &str) -> Result<(), String> {
        for (key, limit) in &self.0 {
            if *limit == 0 {
                return Err(format!(
                    "{prefix}{key}: at least 1 (0 never means unlimited; to forbid a tool, deny it)"
                ));
            }
            let known = key == ALL_CALLS
                || key.ends_with('*')
                || matches!(key.parse::<ToolRef>(), Ok(ToolRef::Mcp(_)))
                || key
                    .parse::<ToolName>()
                    .is_ok_and(|t| t != ToolName::SubmitOutput);
            if !known {
                return Err(format!(
                    "{prefix}{key}: not a tool (exec, read_file, write_file, delegate, collect, stop_child, send_message, mcp__SERVER__TOOL, a pattern ending in '*') nor `calls`"
                ));
            }
        }
        Ok(())
    }

    /// The tighter of two: every key of either, at the lower value.
    pub fn tighter(&self, other: &ToolLimits) -> ToolLimits {
        let mut out = self.0.clone();
        for (key, limit) in &other.0 {
            out.entry(key.clone())
                .and_modify(|l| *l = (*l).min(*limit))
                .or_insert(*limit);
        }
        ToolLimits(out)
    }

    /// The limits a call of `tool` counts against.
    pub fn covering<'a>(&'a self, tool: &'a str) -> impl Iterator<Item = (&'a str, u64)> + 'a {
        self.0
            .iter()
            .filter(move |(key, _)| {
                tool != ToolName::SubmitOutput.as_str()
                    && (key.as_str() == ALL_CALLS || name_matches(key, tool))
            })
            .map(|(key, limit)| (key.as_str(), *limit))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_takes_its_secrets_values_and_refuses_a_missing_one() {
        let server = HttpServer {
            url: "http://127.0.0.1:9/mcp".into(),
            headers: BTreeMap::from([
                ("Authorization".into(), "Bearer ${TOKEN}".into()),
                ("X-Pair".into(), "${A}:${B}".into()),
                ("X-Plain".into(), "as is".into()),
            ]),
        };
        let values = BTreeMap::from([("TOKEN", "t0k"), ("A", "a"), ("B", "b")]);
        let got = server
            .headers_with(|n| values.get(n).map(|v| v.to_string()))
            .unwrap();
        assert_eq!(
            got,
            vec![
                ("Authorization".to_string(), "Bearer t0k".to_string()),
                ("X-Pair".into(), "a:b".into()),
                ("X-Plain".into(), "as is".into()),
            ]
        );
        let missing = server.headers_with(|n| (n != "B").then(|| "v".to_string()));
        assert_eq!(
            missing,
            Err("the secret B (header X-Pair) has no value on this node".into())
        );
        assert!(placeholders("Bearer ${TOKEN").is_err());
    }

    #[test]
    fn tool_refs_read_as_agent_md_writes_them() {
        assert_eq!(
            "exec".parse::<ToolRef>(),
            Ok(ToolRef::Builtin(ToolName::Exec))
        );
        assert_eq!(
            "mcp__fs__read_file".parse::<ToolRef>(),
            Ok(ToolRef::Mcp(McpPattern {
                server: "fs".into(),
                tool: Some("read_file".into())
            }))
        );
        assert_eq!(
            "mcp__fs__*".parse::<ToolRef>(),
            Ok(ToolRef::Mcp(McpPattern::all("fs")))
        );
        for bad in [
            "mcp__fs",
            "mcp____x",
            "mcp__f s__x",
            "mcp__fs__a.b",
            "mcp__fs__",
        ] {
            let err = bad.parse::<ToolRef>().unwrap_err();
            assert!(err.contains("not an MCP tool name"), "{bad}: {err}");
        }
        assert!(
            "fetch"
                .parse::<ToolRef>()
                .unwrap_err()
                .contains("unknown tool")
        );
        // A tool's own name may hold `__`: the server's never does.
        let p = McpPattern::parse("mcp__gh__list__all").unwrap().unwrap();
        assert_eq!(
            (p.server.as_str(), p.tool.as_deref()),
            ("gh", Some("list__all"))
        );
    }

    #[test]
    fn patterns_intersect_to_what_both_cover() {
        let all = McpPattern::all("fs");
        let one = McpPattern::parse("mcp__fs__read").unwrap().unwrap();
        let other = McpPattern::parse("mcp__fs__write").unwrap().unwrap();
        assert_eq!(all.intersect(&one), Some(one.clone()));
        assert_eq!(one.intersect(&all), Some(one.clone()));
        assert_eq!(one.intersect(&other), None);
        assert_eq!(all.intersect(&McpPattern::all("gh")), None);
        assert!(all.covers("fs", "anything"));
        assert!(!one.covers("fs", "write"));
    }

    #[test]
    fn model_names_fit_the_shortest_provider_limit_and_stay_apart() {
        assert_eq!(
            canonical_name("fs", "read.file/v2"),
            "mcp__fs__read_file_v2"
        );
        assert_eq!(model_name("mcp__fs__read"), "mcp__fs__read");
        let long_a = canonical_name("fs", &"a".repeat(80));
        let long_b = canonical_name("fs", &("a".repeat(79) + "b"));
        let (a, b) = (model_name(&long_a), model_name(&long_b));
        assert_eq!(a.len(), MODEL_NAME_MAX);
        assert_eq!(b.len(), MODEL_NAME_MAX);
        assert_ne!(a, b);
        assert_eq!(a, model_name(&long_a), "the same on every call");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        );
    }

    #[test]
    fn server_names_never_hold_the_separator() {
        assert!(check_server_name("fs").is_ok());
        assert!(check_server_name("my-fs_2").is_ok());
        assert!(check_server_name("a__b").unwrap_err().contains("__"));
        assert!(check_server_name("").is_err());
        assert!(check_server_name("a.b").is_err());
    }

    #[test]
    fn limits_are_checked_tightened_and_matched() {
        let mine = ToolLimits(BTreeMap::from([
            ("exec".to_string(), 40),
            ("mcp__fs__*".to_string(), 5),
            ("calls".to_string(), 300),
        ]));
        assert_eq!(mine.check("limits."), Ok(()));
        let zero = ToolLimits(BTreeMap::from([("exec".to_string(), 0)]));
        assert!(
            zero.check("limits.")
                .unwrap_err()
                .contains("0 never means unlimited")
        );
        let unknown = ToolLimits(BTreeMap::from([("fetch".to_string(), 3)]));
        assert!(
            unknown
                .check("limits.")
                .unwrap_err()
                .contains("limits.fetch")
        );
        let parent = ToolLimits(BTreeMap::from([
            ("exec".to_string(), 10),
            ("read_file".to_string(), 2),
        ]));
        let both = mine.tighter(&parent);
        assert_eq!(both.0["exec"], 10);
        assert_eq!(both.0["read_file"], 2);
        assert_eq!(both.0["calls"], 300);
        let keys: Vec<&str> = both.covering("mcp__fs__write").map(|(k, _)| k).collect();
        assert_eq!(keys, vec!["calls", "mcp__fs__*"]);
        assert_eq!(both.covering("submit_output").count(), 0);
    }
}
