//! `[providers.NAME]` in arbor.toml, read and checked.
//!
//! ```toml
//! [providers.local]
//! kind = "openai"                      # or "anthropic"
//! base_url = "http://127.0.0.1:8000/v1"
//! api_key_env = "LOCAL_API_KEY"        # the variable's name, never the key
//! max_concurrent = 8                   # requests in flight to this provider
//! timeout = "120s"                     # one attempt, answer streamed to the end
//! idle_timeout = "60s"                 # a stream with no byte for this long: a timeout
//! rpm = 500                            # requests and tokens in any minute, reserved
//! tpm = 200000                         # before each is sent (`rate`): the provider's
//! [providers.local.models.small]
//! id = "gpt-4o-mini"
//! context_window = 128000
//! max_output_tokens = 4096
//! usd_per_mtok_input = 0.15
//! usd_per_mtok_output = 0.60
//! ```
//!
//! `kind = "scripted"` is a provider with no wire: its models answer from
//! each agent's `script:`, offline, under its name, supply and prices; with
//! `fail_with = "CLASS"` every call fails so (a stand-in for an account past
//! its cap, to try a fallback without a network). It has no `base_url` and
//! no key.
//!
//! Invariants:
//! 1. A provider that loads has a usable http(s) base URL, at least one
//!    model, and positive limits; a price is both figures or neither.
//! 2. The API key is read from the environment when a model is made and
//!    lives only in `ApiKey`, whose `Debug` and `Display` print nothing of it.
//!    It reaches the HTTP header and nothing else: no event, log line,
//!    journal record or error message.

use arbor_actors::model::{Price, RetryPolicy};
use arbor_protocol::{Effort, ErrorClass, Settings, ThinkingTokens};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Requests in flight to one provider when arbor.toml does not say.
pub const DEFAULT_MAX_CONCURRENT: u32 = 8;
/// One attempt's limit when arbor.toml does not say.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest a streamed answer may go without a byte when arbor.toml does not say.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Retries of a transiently failed call when arbor.toml does not say.
pub const DEFAULT_MAX_RETRIES: u32 = 3;

/// The two wire formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// OpenAI's Chat Completions (also vLLM, Ollama, llama.cpp, LiteLLM, ...).
    Openai,
    /// Anthropic's Messages API.
    Anthropic,
}

/// `kind` as arbor.toml writes it: a wire format, or `scripted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum KindFile {
    Openai,
    Anthropic,
    Scripted,
}

/// A `kind = "scripted"` provider: no wire, its models answer from scripts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scripted {
    /// Every call fails with this class (a model call's: `model_...`).
    pub fail_with: Option<ErrorClass>,
}

/// One `[providers.NAME]` block, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Provider {
    pub name: String,
    /// The account it bills (`supply`, default its name): two providers on
    /// one account are one supply, so a fallback skips both (I-55).
    pub supply: String,
    /// Its wire format; a scripted provider's requests are shown in
    /// OpenAI's, as the scripted model's are.
    pub kind: ProviderKind,
    /// Some for `kind = "scripted"`: no client is made for it.
    pub scripted: Option<Scripted>,
    /// Without a trailing `/` (empty for a scripted provider). OpenAI's ends in `/v1` (the client appends
    /// `/chat/completions`); Anthropic's is the host (it appends `/v1/messages`).
    pub base_url: String,
    /// The environment variable that holds the key; None sends no key (a local server).
    pub api_key_env: Option<String>,
    pub max_concurrent: u32,
    pub timeout: Duration,
    /// A streamed answer that sends no bytes for this long fails its
    /// attempt as a retryable timeout, well before `timeout` would.
    pub idle_timeout: Duration,
    /// Ask for a streamed answer (SSE).
    pub stream: bool,
    pub retry: RetryPolicy,
    pub models: BTreeMap<String, ProviderModel>,
    /// Requests and tokens any minute may hold for all its models (`rpm`, `tpm`).
    pub limits: crate::rate::Limits,
}

/// One `[providers.NAME.models.MODEL]` block, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ProviderModel {
    /// What the provider calls it.
    pub id: String,
    /// Its defaults for an agent that does not say (`temperature`,
    /// `top_p`, `effort`).
    pub settings: Settings,
    pub context_window: u64,
    pub max_output_tokens: u64,
    pub price: Option<Price>,
    /// Anthropic's extended thinking at each `effort`.
    pub thinking_tokens: Option<ThinkingTokens>,
    /// Requests and tokens any minute may hold for it (`rpm`, `tpm`).
    pub limits: crate::rate::Limits,
}

impl Provider {
    /// What the loop knows of `model`, one of this provider's.
    pub fn model_info(&self, model: &ProviderModel) -> arbor_actors::model::ModelInfo {
        arbor_actors::model::ModelInfo {
            provider: self.name.clone(),
            supply: self.supply.clone(),
            model: model.id.clone(),
            max_output_tokens: Some(model.max_output_tokens),
            context_window: Some(model.context_window),
            price: model.price,
            retry: self.retry,
            billed: true,
            thinking_tokens: model.thinking_tokens,
            default_effort: model.settings.effort,
        }
    }

    /// The URL one request goes to.
    pub fn endpoint(&self) -> String {
        match self.kind {
            ProviderKind::Openai => format!("{}/chat/completions", self.base_url),
            ProviderKind::Anthropic => format!("{}/v1/messages", self.base_url),
        }
    }
}

/// The block as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderFile {
    kind: KindFile,
    base_url: Option<String>,
    api_key_env: Option<String>,
    max_concurrent: Option<i64>,
    timeout: Option<String>,
    idle_timeout: Option<String>,
    stream: Option<bool>,
    max_retries: Option<i64>,
    supply: Option<String>,
    fail_with: Option<ErrorClass>,
    rpm: Option<i64>,
    tpm: Option<i64>,
    #[serde(default)]
    models: BTreeMap<String, ModelFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    id: String,
    context_window: i64,
    max_output_tokens: i64,
    usd_per_mtok_input: Option<f64>,
    usd_per_mtok_output: Option<f64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    effort: Option<Effort>,
    thinking_tokens: Option<ThinkingTokens>,
    rpm: Option<i64>,
    tpm: Option<i64>,
}

/// Checks one block; the error names the key (`providers.NAME.KEY`).
pub fn check_provider(name: &str, file: ProviderFile) -> Result<Provider, String> {
    let key = |k: &str| format!("providers.{name}.{k}");
    if !is_plain_name(name) {
        return Err(format!(
            "providers.{name}: a provider name must be lowercase letters, digits, `_` and `-`"
        ));
    }
    let (kind, scripted) = match file.kind {
        KindFile::Openai => (ProviderKind::Openai, None),
        KindFile::Anthropic => (ProviderKind::Anthropic, None),
        KindFile::Scripted => (ProviderKind::Openai, Some(scripted(name, &file)?)),
    };
    if scripted.is_none() && file.fail_with.is_some() {
        return Err(format!(
            "{}: only a scripted provider fails on purpose (kind = \"scripted\")",
            key("fail_with")
        ));
    }
    let base_url = match (&file.base_url, scripted) {
        (_, Some(_)) => String::new(),
        (None, None) => return Err(format!("{}: missing", key("base_url"))),
        (Some(url), None) => url.trim().trim_end_matches('/').to_string(),
    };
    match url::Url::parse(&base_url) {
        _ if scripted.is_some() => {} // no URL: checked to be absent
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
        Ok(_) => {
            return Err(format!(
                "{}: {base_url:?} must be an http or https URL",
                key("base_url")
            ));
        }
        Err(e) => {
            return Err(format!(
                "{}: {base_url:?} is not a URL: {e}",
                key("base_url")
            ));
        }
    }
    if let Some(var) = &file.api_key_env {
        let valid = !var.is_empty()
            && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !var.as_bytes()[0].is_ascii_digit();
        if !valid {
            return Err(format!(
                "{}: {var:?} is not an environment variable name (give the variable's name, never the key)",
                key("api_key_env")
            ));
        }
    }
    let max_concurrent = positive(file.max_concurrent, &key("max_concurrent"))?
        .unwrap_or(u64::from(DEFAULT_MAX_CONCURRENT));
    let max_concurrent = u32::try_from(max_concurrent)
        .map_err(|_| format!("{}: at most {}", key("max_concurrent"), u32::MAX))?;
    let duration = |text: &Option<String>, name: &str, default: Duration| match text {
        None => Ok(default),
        Some(text) => match humantime::parse_duration(text.trim()) {
            Ok(d) if !d.is_zero() => Ok(d),
            Ok(_) => Err(format!("{}: must be more than 0", key(name))),
            Err(e) => Err(format!("{}: bad duration {text:?}: {e}", key(name))),
        },
    };
    let timeout = duration(&file.timeout, "timeout", DEFAULT_TIMEOUT)?;
    let idle_timeout = duration(&file.idle_timeout, "idle_timeout", DEFAULT_IDLE_TIMEOUT)?;
    let max_retries = match file.max_retries {
        None => DEFAULT_MAX_RETRIES,
        Some(n) if (0..=10).contains(&n) => n as u32,
        Some(n) => return Err(format!("{}: must be 0 to 10, got {n}", key("max_retries"))),
    };
    if file.models.is_empty() {
        return Err(format!(
            "providers.{name}: no models: add a [providers.{name}.models.NAME] block with its id"
        ));
    }
    let mut models = BTreeMap::new();
    for (model_name, model) in file.models {
        let mkey = |k: &str| format!("providers.{name}.models.{model_name}.{k}");
        if !is_plain_name(&model_name) {
            return Err(format!(
                "providers.{name}.models.{model_name}: a model name must be lowercase letters, digits, `_` and `-`"
            ));
        }
        if model.id.trim().is_empty() {
            return Err(format!("{}: must not be empty", mkey("id")));
        }
        let context_window =
            positive(Some(model.context_window), &mkey("context_window"))?.unwrap_or_default();
        let max_output_tokens =
            positive(Some(model.max_output_tokens), &mkey("max_output_tokens"))?
                .unwrap_or_default();
        if max_output_tokens >= context_window {
            return Err(format!(
                "{}: {max_output_tokens} leaves no room for a prompt in a context window of {context_window}",
                mkey("max_output_tokens")
            ));
        }
        let price = match (model.usd_per_mtok_input, model.usd_per_mtok_output) {
            (None, None) => None,
            (Some(input), Some(output)) => Some(Price {
                input_picos_per_token: picos_per_token(input, &mkey("usd_per_mtok_input"))?,
                output_picos_per_token: picos_per_token(output, &mkey("usd_per_mtok_output"))?,
            }),
            (Some(_), None) => {
                return Err(format!(
                    "{}: missing; a price needs both figures",
                    mkey("usd_per_mtok_output")
                ));
            }
            (None, Some(_)) => {
                return Err(format!(
                    "{}: missing; a price needs both figures",
                    mkey("usd_per_mtok_input")
                ));
            }
        };
        let settings = Settings::from_figures(model.temperature, model.top_p, model.effort)
            .map_err(|e| format!("providers.{name}.models.{model_name}.{e}"))?;
        if let Some(thinking) = model.thinking_tokens {
            check_thinking(kind, thinking, max_output_tokens)
                .map_err(|e| format!("{}: {e}", mkey("thinking_tokens")))?;
        }
        let limits = crate::rate::Limits {
            rpm: positive(model.rpm, &mkey("rpm"))?,
            tpm: positive(model.tpm, &mkey("tpm"))?,
        };
        if scripted.is_some() && limits.is_set() {
            return Err(format!(
                "{}: a scripted provider's models send nothing: they have no rate limit",
                mkey(if limits.rpm.is_some() { "rpm" } else { "tpm" })
            ));
        }
        models.insert(
            model_name,
            ProviderModel {
                limits,
                id: model.id.trim().to_string(),
                settings,
                context_window,
                max_output_tokens,
                price,
                thinking_tokens: model.thinking_tokens,
            },
        );
    }
    let supply = match file.supply.map(|s| s.trim().to_string()) {
        None => name.to_string(),
        Some(s) if is_plain_name(&s) => s,
        Some(s) => {
            return Err(format!(
                "{}: {s:?} must be lowercase letters, digits, `_` and `-`",
                key("supply")
            ));
        }
    };
    Ok(Provider {
        limits: crate::rate::Limits {
            rpm: positive(file.rpm, &key("rpm"))?,
            tpm: positive(file.tpm, &key("tpm"))?,
        },
        name: name.to_string(),
        supply,
        kind,
        scripted,
        base_url,
        api_key_env: file.api_key_env,
        max_concurrent,
        timeout,
        idle_timeout,
        stream: file.stream.unwrap_or(true),
        retry: RetryPolicy {
            max_retries,
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
        },
        models,
    })
}

/// A scripted provider's block: nothing of a wire (a URL, a key, a
/// stream), and a `fail_with` that is a model call's class.
fn scripted(name: &str, file: &ProviderFile) -> Result<Scripted, String> {
    let wire = [
        ("base_url", file.base_url.is_some()),
        ("api_key_env", file.api_key_env.is_some()),
        ("stream", file.stream.is_some()),
        ("idle_timeout", file.idle_timeout.is_some()),
        ("rpm", file.rpm.is_some()),
        ("tpm", file.tpm.is_some()),
    ];
    if let Some((k, _)) = wire.iter().find(|(_, set)| *set) {
        return Err(format!(
            "providers.{name}.{k}: a scripted provider answers from each agent's script, \
             offline: it has no {k}"
        ));
    }
    match file.fail_with {
        Some(class) if !class.as_str().starts_with("model") => Err(format!(
            "providers.{name}.fail_with: `{class}` is not a class a model call fails with \
             (use one of model_usage_cap, model_auth, model_rate_limit, model_overloaded, \
             model_server, model_timeout, model_bad_request)"
        )),
        fail_with => Ok(Scripted { fail_with }),
    }
}

/// Anthropic's least thinking budget.
pub const MIN_THINKING_TOKENS: u64 = 1024;

/// A `thinking_tokens` table Anthropic would take: each level at least
/// its least budget, below the model's `max_output_tokens` (the budget is
/// part of `max_tokens`).
fn check_thinking(kind: ProviderKind, t: ThinkingTokens, max_output: u64) -> Result<(), String> {
    if kind != ProviderKind::Anthropic {
        return Err(
            "is Anthropic's extended thinking; an openai-format model takes effort as \
             reasoning_effort, with no budget"
                .into(),
        );
    }
    for (level, n) in [("low", t.low), ("medium", t.medium), ("high", t.high)] {
        if n < MIN_THINKING_TOKENS {
            return Err(format!(
                "{level} = {n}: Anthropic takes at least {MIN_THINKING_TOKENS}"
            ));
        }
        if n >= max_output {
            return Err(format!(
                "{level} = {n}: must be below max_output_tokens ({max_output}), which holds it"
            ));
        }
    }
    Ok(())
}

fn positive(value: Option<i64>, key: &str) -> Result<Option<u64>, String> {
    match value {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(n as u64)),
        Some(n) => Err(format!("{key}: must be at least 1, got {n}")),
    }
}

/// Dollars per million tokens as pico-dollars per token (exactly: one
/// dollar per million tokens is one micro-dollar per token).
fn picos_per_token(usd_per_mtok: f64, key: &str) -> Result<u64, String> {
    if !usd_per_mtok.is_finite() || usd_per_mtok < 0.0 {
        return Err(format!(
            "{key}: must be a price of 0 or more, got {usd_per_mtok}"
        ));
    }
    if usd_per_mtok > 1_000_000.0 {
        return Err(format!(
            "{key}: {usd_per_mtok} dollars per million tokens is not a price"
        ));
    }
    let picos = (usd_per_mtok * 1e6).round();
    if (picos / 1e6 - usd_per_mtok).abs() > 1e-9 {
        return Err(format!(
            "{key}: {usd_per_mtok} has more than 6 decimal places"
        ));
    }
    Ok(picos as u64)
}

fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// The key, as read from the environment. It prints as `***`.
#[derive(Clone)]
#[cfg_attr(not(feature = "http"), allow(dead_code))]
pub struct ApiKey(String);

impl ApiKey {
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(***)")
    }
}

/// The key of `provider`, or why there is none (naming the variable, never a value).
pub fn api_key(provider: &Provider) -> Result<Option<ApiKey>, String> {
    let Some(var) = &provider.api_key_env else {
        return Ok(None);
    };
    match std::env::var(var) {
        Ok(key) if !key.trim().is_empty() => Ok(Some(ApiKey(key.trim().to_string()))),
        Ok(_) => Err(format!(
            "provider {}: the environment variable {var} (api_key_env) is empty",
            provider.name
        )),
        Err(_) => Err(format!(
            "provider {}: the environment variable {var} (api_key_env) is not set",
            provider.name
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Provider, String> {
        let file: ProviderFile = toml::from_str(text).map_err(|e| e.message().to_string())?;
        check_provider("local", file)
    }

    const GOOD: &str = r#"
kind = "openai"
base_url = "http://127.0.0.1:8000/v1/"
api_key_env = "LOCAL_API_KEY"
[models.small]
id = "gpt-4o-mini"
context_window = 128000
max_output_tokens = 4096
usd_per_mtok_input = 0.15
usd_per_mtok_output = 0.6
"#;

    #[test]
    fn rate_limits_load_per_provider_and_per_model_and_a_scripted_provider_has_none() {
        let p = load(&GOOD.replace(
            "api_key_env = \"LOCAL_API_KEY\"",
            "api_key_env = \"K\"\nrpm = 500\ntpm = 200000",
        ))
        .unwrap();
        assert_eq!(
            p.limits,
            crate::rate::Limits {
                rpm: Some(500),
                tpm: Some(200_000)
            }
        );
        assert!(!p.models["small"].limits.is_set(), "none unless said");
        let p = load(&format!("{GOOD}rpm = 7\n")).unwrap();
        assert_eq!(p.models["small"].limits.rpm, Some(7));
        assert!(!p.limits.is_set());
        let scripted = "kind = \"scripted\"\nrpm = 5\n[models.s]\nid = \"s\"\ncontext_window = 100\nmax_output_tokens = 10\n";
        let e = load(scripted).unwrap_err();
        assert!(
            e.contains("providers.local.rpm: a scripted provider"),
            "{e}"
        );
        let scripted = "kind = \"scripted\"\n[models.s]\nid = \"s\"\ncontext_window = 100\nmax_output_tokens = 10\ntpm = 5\n";
        let e = load(scripted).unwrap_err();
        assert!(
            e.contains("models.s.tpm: a scripted provider's models send nothing"),
            "{e}"
        );
    }

    #[test]
    fn a_good_block_loads_with_its_defaults() {
        let p = load(GOOD).unwrap();
        assert_eq!(p.base_url, "http://127.0.0.1:8000/v1");
        assert_eq!(p.endpoint(), "http://127.0.0.1:8000/v1/chat/completions");
        assert_eq!(p.max_concurrent, DEFAULT_MAX_CONCURRENT);
        assert_eq!(p.timeout, DEFAULT_TIMEOUT);
        assert!(p.stream);
        let m = &p.models["small"];
        assert_eq!(
            m.price,
            Some(Price {
                input_picos_per_token: 150_000,
                output_picos_per_token: 600_000
            })
        );
    }

    /// One bad block per row: (what is changed, words the error must say).
    #[test]
    fn each_bad_block_is_refused_naming_its_key() {
        let cases = [
            ("kind = \"openai\"", "kind = \"gemini\"", "gemini"),
            (
                "base_url = \"http://127.0.0.1:8000/v1/\"",
                "base_url = \"ftp://x\"",
                "providers.local.base_url",
            ),
            (
                "base_url = \"http://127.0.0.1:8000/v1/\"",
                "base_url = \"not a url\"",
                "providers.local.base_url",
            ),
            (
                "api_key_env = \"LOCAL_API_KEY\"",
                "api_key_env = \"sk-live 123\"",
                "providers.local.api_key_env",
            ),
            (
                "api_key_env = \"LOCAL_API_KEY\"",
                "api_key_env = \"K\"\nmax_concurrent = 0",
                "providers.local.max_concurrent",
            ),
            (
                "api_key_env = \"LOCAL_API_KEY\"",
                "api_key_env = \"K\"\ntimeout = \"soon\"",
                "providers.local.timeout",
            ),
            (
                "api_key_env = \"LOCAL_API_KEY\"",
                "api_key_env = \"K\"\nrpm = 0",
                "providers.local.rpm: must be at least 1, got 0",
            ),
            (
                "usd_per_mtok_input = 0.15",
                "usd_per_mtok_input = 0.15\ntpm = -5",
                "providers.local.models.small.tpm: must be at least 1, got -5",
            ),
            (
                "api_key_env = \"LOCAL_API_KEY\"",
                "api_key_env = \"K\"\ncolour = \"red\"",
                "colour",
            ),
            (
                "context_window = 128000",
                "context_window = 0",
                "providers.local.models.small.context_window",
            ),
            (
                "max_output_tokens = 4096",
                "max_output_tokens = 200000",
                "providers.local.models.small.max_output_tokens",
            ),
            (
                "usd_per_mtok_output = 0.6",
                "",
                "providers.local.models.small.usd_per_mtok_output",
            ),
            (
                "usd_per_mtok_input = 0.15",
                "usd_per_mtok_input = -1.0",
                "providers.local.models.small.usd_per_mtok_input",
            ),
            (
                "usd_per_mtok_input = 0.15",
                "usd_per_mtok_input = 0.0000001",
                "6 decimal places",
            ),
            (
                "[models.small]",
                "[models.Small]",
                "providers.local.models.Small",
            ),
        ];
        for (from, to, words) in cases {
            assert!(GOOD.contains(from), "{from}");
            let text = GOOD.replace(from, to);
            match load(&text) {
                Ok(_) => panic!("loaded: {text}"),
                Err(e) => assert!(e.contains(words), "{words:?} not in {e:?}"),
            }
        }
        let no_models = GOOD.split("[models.small]").next().unwrap();
        assert!(load(no_models).unwrap_err().contains("no models"));
    }

    /// A scripted provider has its name, supply and prices, no wire; it
    /// fails on purpose only with a model call's class, and only it does.
    #[test]
    fn a_scripted_provider_loads_without_a_wire_and_fails_only_as_a_model_call() {
        let scripted = "kind = \"scripted\"\nfail_with = \"model_usage_cap\"\nsupply = \"shared\"\n\
            [models.m]\nid = \"m\"\ncontext_window = 1000\nmax_output_tokens = 100\n";
        let p = load(scripted).unwrap();
        assert_eq!(
            (p.scripted, p.supply.as_str(), p.base_url.as_str()),
            (
                Some(Scripted {
                    fail_with: Some(ErrorClass::ModelUsageCap)
                }),
                "shared",
                ""
            )
        );
        assert_eq!(load(GOOD).unwrap().scripted, None);
        let cases = [
            (
                "supply",
                "base_url = \"http://x/v1\"\nsupply",
                "has no base_url",
            ),
            (
                "supply",
                "api_key_env = \"K\"\nsupply",
                "has no api_key_env",
            ),
            ("supply", "stream = true\nsupply", "has no stream"),
            (
                "model_usage_cap",
                "budget_exhausted",
                "not a class a model call fails with",
            ),
            ("model_usage_cap", "melted", "melted"),
        ];
        for (from, to, words) in cases {
            let text = scripted.replacen(from, to, 1);
            let e = load(&text).expect_err(&text);
            assert!(e.contains(words), "{words:?} not in {e:?}");
        }
        let wired = GOOD.replace("[models", "fail_with = \"model_auth\"\n[models");
        assert!(
            load(&wired)
                .unwrap_err()
                .contains("only a scripted provider")
        );
        let no_url = GOOD.replace("base_url = \"http://127.0.0.1:8000/v1/\"", "");
        assert!(
            load(&no_url)
                .unwrap_err()
                .contains("providers.local.base_url: missing")
        );
    }

    #[test]
    fn the_key_never_prints() {
        let key = ApiKey("sk-planted-secret".into());
        assert!(!format!("{key:?}").contains("planted"));
    }
}
