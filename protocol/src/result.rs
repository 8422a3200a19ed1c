//! I-21: the result envelope a parent receives for each child.

use crate::{ErrorClass, JobId, Status, TaskStatus};
use serde::{Deserialize, Serialize};

/// Tokens spent by model calls (input + output).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// What an account spent or holds, in both units.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Amount {
    pub tokens: u64,
    pub usd_micros: u64,
}

impl Amount {
    pub const ZERO: Amount = Amount {
        tokens: 0,
        usd_micros: 0,
    };
}

impl ResultEnvelope {
    /// An end that says only whose it is and how it ended; the caller sets
    /// what else it knows (`..ResultEnvelope::bare(..)`).
    pub fn bare(job: JobId, agent: &str, status: Status) -> Self {
        Self {
            job,
            label: None,
            attempt: 1,
            agent: agent.to_string(),
            status,
            task_status: None,
            output: serde_json::Value::Null,
            error: None,
            error_class: None,
            limitations: vec![],
            artifacts: vec![],
            tokens_spent: 0,
            usd_micros_spent: 0,
            turns: 0,
            workdir: String::new(),
        }
    }

    pub fn spent(&self) -> Amount {
        Amount {
            tokens: self.tokens_spent,
            usd_micros: self.usd_micros_spent,
        }
    }
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

/// What a parent's `collect` returns for one child, and what a run reports for a step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ResultEnvelope {
    pub job: JobId,
    pub label: Option<String>,
    pub attempt: u32,
    pub agent: String,
    pub status: Status,
    pub task_status: Option<TaskStatus>,
    /// The answer; null when stopped (I-16) or none was given.
    pub output: serde_json::Value,
    pub error: Option<String>,
    pub error_class: Option<ErrorClass>,
    pub limitations: Vec<String>,
    /// Workdir-relative paths the runtime saw the job write (I-24).
    pub artifacts: Vec<String>,
    /// Tokens spent by the job and every settled descendant.
    pub tokens_spent: u64,
    /// Micro-dollars spent by the job and every settled descendant, at the
    /// prices of arbor.toml (0 on unpriced and scripted models).
    pub usd_micros_spent: u64,
    pub turns: u32,
    pub workdir: String,
}
