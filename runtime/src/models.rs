//! The `ModelFactory` that gives each agent its model: the scripted one, or
//! its provider's (arbor-providers; HTTP unless built without it).

use crate::scripted::ScriptedModel;
use arbor_actors::model::{Model, ModelFactory};
use arbor_protocol::{AgentDef, ModelRef};
use arbor_providers::{Provider, Providers};
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Models {
    providers: Providers,
}

impl Models {
    pub fn new(providers: &BTreeMap<String, Provider>) -> Self {
        Self {
            providers: Providers::new(providers),
        }
    }
}

impl ModelFactory for Models {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        match &agent.model {
            ModelRef::Scripted => Ok(Arc::new(ScriptedModel::new(Arc::clone(&agent.script)))),
            ModelRef::Provider { provider, model } => {
                match self.providers.scripted(provider, model) {
                    Some((info, fail_with)) => Ok(Arc::new(ScriptedModel::as_provider(
                        Arc::clone(&agent.script),
                        info,
                        fail_with,
                    ))),
                    None => self.providers.model(&agent.name, provider, model),
                }
            }
        }
    }

    fn preflight(&self, agent: &AgentDef) -> Result<(), String> {
        // Every model a job of it may be put on (I-55), not only its default.
        for allowed in agent.allowed_models() {
            if let ModelRef::Provider { provider, model } = allowed
                && self.providers.scripted(provider, model).is_none()
            {
                self.providers.preflight(&agent.name, provider, model)?;
            }
        }
        Ok(())
    }

    fn limits(&self) -> Vec<arbor_protocol::RateView> {
        self.providers.limits()
    }

    fn share_rates(&self, journal: &arbor_storage::Journal) {
        self.providers.share(journal);
    }
}
