//! arbord's settings: `[service]` in arbor.toml, then `ARBOR_*` variables,
//! then flags, each layer over the one before. Every layer refuses what it
//! does not know, and names itself in the error.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7878";

/// What arbord runs with, every value checked.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub listen: SocketAddr,
    /// Holds `journal/`, `work/` and `token`.
    pub data_dir: PathBuf,
    /// Runs that may run at once; more wait in the durable queue.
    pub max_running_runs: usize,
    /// Runs that may wait; past this a submission is refused (429).
    pub max_queued_runs: usize,
    /// The largest request body accepted (413 past it).
    pub max_body_bytes: usize,
    /// The largest `input` of an agent run, and the largest steering message.
    pub max_input_bytes: usize,
    /// The largest token budget one run may ask for.
    pub max_run_tokens: u64,
    /// The largest usd ceiling one run may ask for, in micro-dollars.
    pub max_run_usd_micros: u64,
    /// On SIGTERM, how long running runs may go on by themselves before
    /// they are stopped (0: stopped at once).
    pub drain: Duration,
    /// Events buffered for one SSE client; a client that falls this far
    /// behind is dropped (it may reconnect with `Last-Event-ID`).
    pub sse_buffer: usize,
    /// How long a full SSE buffer may stay full before its client is dropped.
    pub sse_stall: Duration,
    /// How long a finished run is kept (its records, events and idempotency
    /// key) before it is forgotten; `None`: forever. Never zero.
    pub keep_finished: Option<Duration>,
    /// Schedules fire by this node's clock, by themselves; off, only
    /// `Service::run_schedules` moves them (a test's injected clock).
    pub schedule_clock: bool,
}

impl ServiceConfig {
    /// Defaults for a data dir, as if nothing were configured.
    pub fn with_data_dir(data_dir: &Path) -> Self {
        Layer::default()
            .finish(data_dir.to_path_buf())
            .expect("the defaults are valid")
    }
}

/// Flags given to arbord, the last layer.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub listen: Option<String>,
    pub data_dir: Option<PathBuf>,
}

/// One layer of settings, as written.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Layer {
    listen: Option<String>,
    data_dir: Option<PathBuf>,
    max_running_runs: Option<u64>,
    max_queued_runs: Option<u64>,
    max_body_bytes: Option<u64>,
    max_input_bytes: Option<u64>,
    max_run_tokens: Option<u64>,
    max_run_usd: Option<f64>,
    drain: Option<String>,
    sse_buffer: Option<u64>,
    sse_stall: Option<String>,
    keep_finished: Option<String>,
}

/// The keys, as `[service]` spells them; `ARBOR_` + the key in capitals is
/// the variable.
const KEYS: &[&str] = &[
    "listen",
    "data_dir",
    "max_running_runs",
    "max_queued_runs",
    "max_body_bytes",
    "max_input_bytes",
    "max_run_tokens",
    "max_run_usd",
    "drain",
    "sse_buffer",
    "sse_stall",
    "keep_finished",
];

/// `ARBOR_*` variables that are not settings of arbord but are arbor's own
/// (the CLI's and the log filter), so they are not refused as unknown.
const OTHER_VARIABLES: &[&str] = &[
    "ARBOR_URL",
    "ARBOR_TOKEN",
    "ARBOR_TOKEN_FILE",
    "ARBOR_LOG",
    // The node's, not the service's: its journal's database and its id.
    "ARBOR_DATABASE_URL",
    "ARBOR_NODE_ID",
];

impl Layer {
    fn over(self, below: Layer) -> Layer {
        Layer {
            listen: self.listen.or(below.listen),
            data_dir: self.data_dir.or(below.data_dir),
            max_running_runs: self.max_running_runs.or(below.max_running_runs),
            max_queued_runs: self.max_queued_runs.or(below.max_queued_runs),
            max_body_bytes: self.max_body_bytes.or(below.max_body_bytes),
            max_input_bytes: self.max_input_bytes.or(below.max_input_bytes),
            max_run_tokens: self.max_run_tokens.or(below.max_run_tokens),
            max_run_usd: self.max_run_usd.or(below.max_run_usd),
            drain: self.drain.or(below.drain),
            sse_buffer: self.sse_buffer.or(below.sse_buffer),
            sse_stall: self.sse_stall.or(below.sse_stall),
            keep_finished: self.keep_finished.or(below.keep_finished),
        }
    }

    fn finish(self, default_data_dir: PathBuf) -> Result<ServiceConfig, String> {
        let listen_text = self.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen: SocketAddr = listen_text.parse().map_err(|_| {
            format!("listen: {listen_text:?} is not an address and port, e.g. 127.0.0.1:7878")
        })?;
        let positive = |key: &str, value: Option<u64>, default: u64| -> Result<u64, String> {
            match value {
                Some(0) => Err(format!(
                    "{key}: must be at least 1 (0 never means unlimited)"
                )),
                Some(v) => Ok(v),
                None => Ok(default),
            }
        };
        let usize_of =
            |key: &str, v: u64| usize::try_from(v).map_err(|_| format!("{key}: {v} is too large"));
        let duration = |key: &str, text: Option<&str>, default: Duration| match text {
            None => Ok(default),
            Some(t) => humantime::parse_duration(t)
                .map_err(|e| format!("{key}: {t:?} is not a duration such as \"30s\": {e}")),
        };
        let max_run_usd_micros = match self.max_run_usd {
            None => 100_000_000,
            Some(usd) if usd.is_finite() && usd > 0.0 && usd <= 1e9 => (usd * 1e6).round() as u64,
            Some(usd) => {
                return Err(format!(
                    "max_run_usd: {usd} is not a positive amount of dollars (0 never means unlimited)"
                ));
            }
        };
        Ok(ServiceConfig {
            listen,
            data_dir: self.data_dir.unwrap_or(default_data_dir),
            max_running_runs: usize_of(
                "max_running_runs",
                positive("max_running_runs", self.max_running_runs, 16)?,
            )?,
            max_queued_runs: usize_of(
                "max_queued_runs",
                positive("max_queued_runs", self.max_queued_runs, 10_000)?,
            )?,
            max_body_bytes: usize_of(
                "max_body_bytes",
                positive("max_body_bytes", self.max_body_bytes, 256 * 1024)?,
            )?,
            max_input_bytes: usize_of(
                "max_input_bytes",
                positive("max_input_bytes", self.max_input_bytes, 64 * 1024)?,
            )?,
            max_run_tokens: positive("max_run_tokens", self.max_run_tokens, 100_000_000)?,
            max_run_usd_micros,
            drain: duration("drain", self.drain.as_deref(), Duration::ZERO)?,
            sse_buffer: usize_of("sse_buffer", positive("sse_buffer", self.sse_buffer, 1024)?)?,
            sse_stall: duration(
                "sse_stall",
                self.sse_stall.as_deref(),
                Duration::from_secs(10),
            )?,
            keep_finished: keep_finished(self.keep_finished.as_deref())?,
            schedule_clock: true,
        })
    }
}

/// A week, unless told otherwise: long enough to look back at last week's
/// runs, short enough that a node serving runs day after day keeps its
/// journal (and sled's memory for it) from growing without end.
const KEEP_FINISHED: Duration = Duration::from_secs(7 * 24 * 3600);

/// `keep_finished`: a duration of a second or more, or `forever`.
fn keep_finished(text: Option<&str>) -> Result<Option<Duration>, String> {
    let Some(text) = text else {
        return Ok(Some(KEEP_FINISHED));
    };
    if text.trim() == "forever" {
        return Ok(None);
    }
    let keep = humantime::parse_duration(text).map_err(|e| {
        format!("keep_finished: {text:?} is neither a duration such as \"7d\" nor \"forever\": {e}")
    })?;
    if keep < Duration::from_secs(1) {
        return Err(format!(
            "keep_finished: {text:?} is under a second (to keep runs without end, say \"forever\"; 0 never means that)"
        ));
    }
    Ok(Some(keep))
}

/// Resolves the settings: `[service]` (as arbor.toml has it), then the
/// environment (`ARBOR_*`), then flags. `default_data_dir` is used when no
/// layer names one (arbord passes `WORKSPACE/.arbor`).
pub fn resolve(
    service_table: &toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
    flags: Flags,
    default_data_dir: PathBuf,
) -> Result<ServiceConfig, String> {
    let file = layer_of(service_table, "arbor.toml [service]")?;
    let env = env_layer(env)?;
    let flags = Layer {
        listen: flags.listen,
        data_dir: flags.data_dir,
        ..Layer::default()
    };
    flags
        .over(env.over(file))
        .finish(default_data_dir)
        .map_err(|e| format!("service settings: {e}"))
}

fn env_layer(env: impl IntoIterator<Item = (String, String)>) -> Result<Layer, String> {
    let mut table = toml::Table::new();
    for (name, value) in env {
        let Some(key) = name.strip_prefix("ARBOR_") else {
            continue;
        };
        if OTHER_VARIABLES.contains(&name.as_str()) {
            continue;
        }
        let key = key.to_ascii_lowercase();
        if !KEYS.contains(&key.as_str()) {
            return Err(format!(
                "{name}: not a setting of arbord (known: {})",
                KEYS.iter()
                    .map(|k| format!("ARBOR_{}", k.to_ascii_uppercase()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let typed = match key.as_str() {
            "listen" | "data_dir" | "drain" | "sse_stall" | "keep_finished" => {
                toml::Value::String(value)
            }
            "max_run_usd" => value
                .trim()
                .parse::<f64>()
                .map(toml::Value::Float)
                .map_err(|_| format!("{name}: {value:?} is not a number"))?,
            _ => value
                .trim()
                .parse::<i64>()
                .map(toml::Value::Integer)
                .map_err(|_| format!("{name}: {value:?} is not a whole number"))?,
        };
        table.insert(key, typed);
    }
    layer_of(&table, "ARBOR_* environment")
}

/// One key at a time, so that an error names the key it is about.
fn layer_of(table: &toml::Table, source: &str) -> Result<Layer, String> {
    let mut layer = Layer::default();
    for (key, value) in table {
        let one: Layer = toml::Table::from_iter([(key.clone(), value.clone())])
            .try_into()
            .map_err(|e: toml::de::Error| format!("{source}: `{key}`: {}", e.message()))?;
        layer = one.over(layer);
    }
    Ok(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().unwrap()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flags_beat_the_environment_which_beats_the_file() {
        let file = table("listen = \"127.0.0.1:1\"\nmax_running_runs = 3\nmax_queued_runs = 7");
        let config = resolve(
            &file,
            env(&[
                ("ARBOR_LISTEN", "127.0.0.1:2"),
                ("ARBOR_MAX_RUNNING_RUNS", "5"),
            ]),
            Flags {
                listen: Some("127.0.0.1:3".into()),
                data_dir: None,
            },
            PathBuf::from("d"),
        )
        .unwrap();
        assert_eq!(config.listen.port(), 3);
        assert_eq!(config.max_running_runs, 5);
        assert_eq!(config.max_queued_runs, 7);
        assert_eq!(config.data_dir, PathBuf::from("d"));
    }

    #[test]
    fn unknown_keys_and_variables_are_refused_by_name() {
        let err = resolve(
            &table("max_runs = 3"),
            env(&[]),
            Flags::default(),
            "d".into(),
        )
        .unwrap_err();
        assert!(
            err.contains("arbor.toml [service]") && err.contains("max_runs"),
            "{err}"
        );
        let err = resolve(
            &toml::Table::new(),
            env(&[("ARBOR_MAX_RUNING_RUNS", "3")]),
            Flags::default(),
            "d".into(),
        )
        .unwrap_err();
        assert!(err.contains("ARBOR_MAX_RUNING_RUNS"), "{err}");
        // The CLI's own variables are not arbord's business, and not refused.
        resolve(
            &toml::Table::new(),
            env(&[("ARBOR_URL", "http://x"), ("ARBOR_TOKEN", "t")]),
            Flags::default(),
            "d".into(),
        )
        .unwrap();
    }

    #[test]
    fn zero_bad_addresses_and_bad_durations_are_refused() {
        for (text, needle) in [
            ("max_running_runs = 0", "0 never means unlimited"),
            ("listen = \"localhost\"", "not an address"),
            ("drain = \"soon\"", "not a duration"),
            ("max_run_usd = -1.0", "max_run_usd"),
            ("max_body_bytes = \"big\"", "max_body_bytes"),
        ] {
            let err = resolve(&table(text), env(&[]), Flags::default(), "d".into()).unwrap_err();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
