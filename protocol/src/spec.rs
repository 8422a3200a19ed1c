//! What a run is asked to do: a flow of groups of steps, with a budget and a timeout.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A run: a flow plus its budget, all resolved (defaults applied).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// The flow's name, or `agent:NAME` for a single-agent run.
    pub flow: String,
    pub groups: Vec<FlowGroup>,
    /// The run's root grant in tokens (I-09: never 0, never "unlimited" by accident).
    pub budget_tokens: u64,
    pub timeout: Option<Duration>,
}

impl RunSpec {
    /// A run of one agent on one input.
    pub fn single(agent: &str, input: &str, budget_tokens: u64) -> Self {
        Self {
            flow: format!("agent:{agent}"),
            groups: vec![FlowGroup {
                steps: vec![StepSpec {
                    agent: agent.to_string(),
                    instruction: input.to_string(),
                    label: None,
                }],
            }],
            budget_tokens,
            timeout: None,
        }
    }
}

/// A flow file as written (`flows/NAME.toml`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    pub budget: Option<crate::BudgetArg>,
    pub timeout: Option<String>,
    #[serde(default, rename = "group")]
    pub groups: Vec<FlowGroup>,
}

/// Groups run in order; the steps of a group run in parallel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowGroup {
    pub steps: Vec<StepSpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSpec {
    pub agent: String,
    pub instruction: String,
    pub label: Option<String>,
}
