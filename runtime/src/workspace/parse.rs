//! What the readers of every format share: the load error, and the checks
//! and error texts of values that appear in more than one file.

use arbor_protocol::{BudgetArg, Resources, ResourcesSpec};
use std::path::{Path, PathBuf};

/// A run's root grant when neither the flow, arbor.toml nor the caller gives one.
pub const DEFAULT_BUDGET_TOKENS: u64 = 1_000_000;

/// Why a workspace can't be used. Each message is one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: not a directory", path.display())]
    NotADirectory { path: PathBuf },
    #[error("{}: no agents found", path.display())]
    NoAgents { path: PathBuf },
    /// The file could not be read (the io error is part of the message, not a source,
    /// so that printing the chain does not say it twice).
    #[error("{}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The file was read, but what it says is wrong: bad syntax, an unknown key, a
    /// value out of range, a name that does not resolve.
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("flows/{name}.toml: no such flow (known: {known})")]
    UnknownFlow { name: String, known: String },
    #[error("agents/{name}/agent.md: no such agent (known: {known})")]
    UnknownAgent { name: String, known: String },
    #[error("budget override: must be more than 0 (0 never means unlimited)")]
    ZeroBudgetOverride,
    /// A run this workspace cannot keep its promises on.
    #[error("{message}")]
    Refused { message: String },
    /// What a run of a flow was given does not meet the flow's `input`.
    #[error("{0}")]
    Input(String),
}

/// A name a secret can have: an environment variable's, not one the sandbox sets.
pub(super) fn is_secret_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !["PATH", "HOME", "LANG", "TMPDIR"].contains(&name)
}

/// `resources:` or `[sandbox]` as numbers, each checked: sizes like
/// "512MiB", a cpu time of at least a second, counts of at least 1.
pub(super) fn resources(spec: &ResourcesSpec, prefix: &str) -> Result<Resources, String> {
    let size = |key: &str, text: &Option<String>| -> Result<Option<u64>, String> {
        let Some(text) = text else { return Ok(None) };
        let bytes = text
            .trim()
            .parse::<bytesize::ByteSize>()
            .map_err(|_| format!("{prefix}{key}: {text:?} is not a size such as \"512MiB\""))?
            .as_u64();
        if bytes == 0 {
            return Err(format!(
                "{prefix}{key}: must be more than 0 (0 never means unlimited)"
            ));
        }
        Ok(Some(bytes))
    };
    let count = |key: &str, n: Option<u64>| match n {
        Some(0) => Err(format!(
            "{prefix}{key}: must be at least 1 (0 never means unlimited)"
        )),
        other => Ok(other),
    };
    let cpu_secs = match &spec.cpu {
        None => None,
        Some(text) => {
            let d = humantime::parse_duration(text.trim())
                .map_err(|_| format!("{prefix}cpu: {text:?} is not a duration such as \"60s\""))?;
            if d < std::time::Duration::from_secs(1) {
                return Err(format!(
                    "{prefix}cpu: at least 1s (the kernel counts whole seconds)"
                ));
            }
            Some(d.as_secs() + u64::from(d.subsec_nanos() > 0))
        }
    };
    Ok(Resources {
        memory_bytes: size("memory", &spec.memory)?,
        cpu_secs,
        file_size_bytes: size("file_size", &spec.file_size)?,
        open_files: count("open_files", spec.open_files)?,
        processes: count("processes", spec.processes)?,
    })
}

/// Each limit of `mine`, else the one of `defaults`.
pub(super) fn over(mine: Resources, defaults: Resources) -> Resources {
    Resources {
        memory_bytes: mine.memory_bytes.or(defaults.memory_bytes),
        cpu_secs: mine.cpu_secs.or(defaults.cpu_secs),
        file_size_bytes: mine.file_size_bytes.or(defaults.file_size_bytes),
        open_files: mine.open_files.or(defaults.open_files),
        processes: mine.processes.or(defaults.processes),
    }
}

/// I-09 for a budget as written: `Ok(None)` when it gives no tokens.
pub(super) fn budget_tokens(budget: Option<&BudgetArg>) -> Result<Option<u64>, String> {
    Ok(budget.map(BudgetArg::tokens).transpose()?.flatten())
}

pub fn check_name(kind: &str, name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{kind} name {name:?} must be lowercase letters, digits, `_` and `-`"
        ))
    }
}

/// One line for a TOML error: its message and where it is.
pub(super) fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = plain_words(&one_line(error.message()));
    match error.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before[line_start..].chars().count() + 1;
            format!("{message} at line {line}, column {column}")
        }
        None => message,
    }
}

/// Users write keys, not fields.
pub(super) fn plain_words(message: &str) -> String {
    message.replace("unknown field", "unknown key")
}

pub(super) fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn invalid(path: &Path, message: impl Into<String>) -> LoadError {
    LoadError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}
