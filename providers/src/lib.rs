//! arbor's model providers: `[providers.NAME]` of arbor.toml read and
//! checked (`config`), and, with the `http` feature (on by default), the
//! HTTP clients of OpenAI's Chat Completions and Anthropic's Messages API
//! that give an agent its `Model`. Without the feature this crate builds no
//! HTTP client at all: a workspace that names a provider still loads, and
//! its runs are refused before they start, saying why.
//!
//! Invariant: the API key lives only in `ApiKey` and reaches one HTTP header
//! and nothing else (see `config`).

pub mod config;
pub mod rate;

// The wire formats need no HTTP client: `request_body` shows a request
// (`arbor prompt`) in a build without one.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
mod anthropic;
#[cfg(feature = "http")]
mod http;
#[cfg_attr(not(feature = "http"), allow(dead_code))]
mod openai;
#[cfg_attr(not(feature = "http"), allow(dead_code))]
mod wire;

pub use config::{
    ApiKey, DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, Provider, ProviderFile,
    ProviderKind, ProviderModel, api_key, check_provider,
};
#[cfg(feature = "http")]
pub use {anthropic::API_VERSION as ANTHROPIC_VERSION, http::HttpModel, wire::classify};

use arbor_actors::model::{Model, ModelRequest};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The configured providers, each with its client made once: its connection
/// pool and its limit of requests in flight are shared by every job.
pub struct Providers {
    /// `kind = "scripted"` providers: no client, their models answer from scripts.
    scripted: BTreeMap<String, Provider>,
    #[cfg(feature = "http")]
    clients: BTreeMap<String, Arc<http::ProviderClient>>,
    #[cfg(not(feature = "http"))]
    clients: BTreeMap<String, Arc<Provider>>,
}

impl Providers {
    pub fn new(providers: &BTreeMap<String, Provider>) -> Self {
        #[cfg(feature = "http")]
        let client = |p: &Provider| Arc::new(http::ProviderClient::new(p.clone()));
        #[cfg(not(feature = "http"))]
        let client = |p: &Provider| Arc::new(p.clone());
        let (scripted, wired): (BTreeMap<_, _>, BTreeMap<_, _>) =
            providers.iter().partition(|(_, p)| p.scripted.is_some());
        Self {
            scripted: scripted
                .into_iter()
                .map(|(name, p)| (name.clone(), p.clone()))
                .collect(),
            clients: wired
                .into_iter()
                .map(|(name, p)| (name.clone(), client(p)))
                .collect(),
        }
    }

    /// The node's journal, at each start: if it is shared, its providers'
    /// rate windows are every node's (`rate::SharedWindows`): each request
    /// is admitted in the database.
    pub fn share(&self, journal: &arbor_storage::Journal) {
        #[cfg(feature = "http")]
        for client in self.clients.values() {
            client.share(
                journal
                    .is_shared()
                    .then(|| rate::SharedWindows::new(journal)),
            );
        }
        #[cfg(not(feature = "http"))]
        let _ = journal;
    }

    /// Every rate window of its providers (`rpm`, `tpm`) and what it holds.
    pub fn limits(&self) -> Vec<arbor_protocol::RateView> {
        #[cfg(feature = "http")]
        {
            self.clients.values().flat_map(|c| c.limits()).collect()
        }
        #[cfg(not(feature = "http"))]
        {
            vec![]
        }
    }

    /// `provider/model` when its provider is scripted: what the model is (its
    /// name, supply, window and prices) and the class every call fails with.
    pub fn scripted(
        &self,
        provider: &str,
        model: &str,
    ) -> Option<(
        arbor_actors::model::ModelInfo,
        Option<arbor_protocol::ErrorClass>,
    )> {
        let p = self.scripted.get(provider)?;
        let mut info = p.model_info(p.models.get(model)?);
        // Nothing is sent anywhere: a cut call costs what its script says.
        info.billed = false;
        Some((info, p.scripted.and_then(|s| s.fail_with)))
    }

    /// `provider/model`'s model for the agent named `agent` (the error names both).
    pub fn model(
        &self,
        agent: &str,
        provider: &str,
        model: &str,
    ) -> Result<Arc<dyn Model>, String> {
        let client = self.client(agent, provider, model)?;
        #[cfg(feature = "http")]
        {
            let key = api_key(&client.config)?;
            Ok(Arc::new(HttpModel::new(client.clone(), model, key)))
        }
        #[cfg(not(feature = "http"))]
        Err(no_http(agent, &client.name, model))
    }

    /// Whether `model` would be made: configured, and its key set.
    pub fn preflight(&self, agent: &str, provider: &str, model: &str) -> Result<(), String> {
        let client = self.client(agent, provider, model)?;
        #[cfg(feature = "http")]
        {
            api_key(&client.config).map(drop)
        }
        #[cfg(not(feature = "http"))]
        Err(no_http(agent, &client.name, model))
    }

    #[cfg(feature = "http")]
    fn client(
        &self,
        agent: &str,
        provider: &str,
        model: &str,
    ) -> Result<&Arc<http::ProviderClient>, String> {
        match self.clients.get(provider) {
            Some(client) if client.config.models.contains_key(model) => Ok(client),
            _ => Err(not_configured(agent, provider, model)),
        }
    }

    #[cfg(not(feature = "http"))]
    fn client(&self, agent: &str, provider: &str, model: &str) -> Result<&Arc<Provider>, String> {
        match self.clients.get(provider) {
            Some(p) if p.models.contains_key(model) => Ok(p),
            _ => Err(not_configured(agent, provider, model)),
        }
    }
}

fn not_configured(agent: &str, provider: &str, model: &str) -> String {
    format!("agent {agent}: model {provider}/{model} is not configured in arbor.toml")
}

#[cfg(not(feature = "http"))]
fn no_http(agent: &str, provider: &str, model: &str) -> String {
    format!(
        "agent {agent}: model {provider}/{model} needs an HTTP provider, and this build has none \
         (arbor-providers without its `http` feature)"
    )
}

/// The body of `request` in `kind`'s wire format, exactly as its client
/// sends it (the key is not in it: it travels in a header).
/// `defaults` are the model entry's settings, under the agent's;
/// `thinking` its `thinking_tokens` (Anthropic's).
pub fn request_body(
    kind: ProviderKind,
    model_id: &str,
    defaults: arbor_protocol::Settings,
    thinking: Option<arbor_protocol::ThinkingTokens>,
    request: &ModelRequest,
    max_tokens: u64,
    stream: bool,
) -> serde_json::Value {
    match kind {
        ProviderKind::Openai => openai::body(model_id, defaults, request, max_tokens, stream),
        ProviderKind::Anthropic => {
            anthropic::body(model_id, defaults, thinking, request, max_tokens, stream)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn providers() -> Providers {
        let file: ProviderFile = toml::from_str(
            "kind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
             [models.small]\nid = \"m\"\ncontext_window = 1000\nmax_output_tokens = 100\n",
        )
        .expect("a block");
        let local = check_provider("local", file).expect("a good block");
        Providers::new(&[("local".to_string(), local)].into())
    }

    #[test]
    fn a_model_not_in_arbor_toml_is_refused_naming_it() {
        let e = providers()
            .preflight("writer", "local", "large")
            .unwrap_err();
        assert!(
            e.contains("agent writer") && e.contains("local/large"),
            "{e}"
        );
        let e = providers()
            .preflight("writer", "other", "small")
            .unwrap_err();
        assert!(e.contains("other/small"), "{e}");
    }

    /// With the HTTP clients a configured model is made; without them the
    /// same model is refused, saying the build has no HTTP provider
    /// (`cargo test -p arbor-providers --no-default-features` runs this half).
    #[test]
    fn a_configured_model_is_made_only_by_a_build_with_http() {
        let made = providers().model("writer", "local", "small");
        #[cfg(feature = "http")]
        assert_eq!(made.expect("made").info().context_window, Some(1000));
        #[cfg(not(feature = "http"))]
        {
            let e = made.err().expect("refused");
            assert!(e.contains("this build has none"), "{e}");
            assert_eq!(
                providers()
                    .preflight("writer", "local", "small")
                    .unwrap_err(),
                e
            );
        }
    }
}
