//! A retry policy: how a failed step, or a delegated job, is tried again.

use crate::ErrorClass;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `retry = { attempts = 3, wait = "15s", backoff = 2.0, max_wait = "5m",
/// on = ["model_rate_limit"] }`. The wait before retry `n` (1 for the
/// second attempt) is `wait * backoff^(n-1)`, at most `max_wait`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first one included: 1 never tries again.
    pub attempts: u32,
    /// Before the second attempt (humantime); none by default.
    #[serde(default, with = "crate::duration_str::serde_humantime")]
    #[schemars(with = "String")]
    pub wait: Duration,
    /// Each later wait is the one before times this (at least 1).
    #[serde(default = "one")]
    pub backoff: f64,
    /// The longest wait; the run's own cap bounds them all (I-59).
    #[serde(
        default,
        with = "crate::duration_str::serde_humantime_opt",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub max_wait: Option<Duration>,
    /// The error classes that are tried again; empty: every class that
    /// can be (`ErrorClass::is_retryable`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on: Vec<ErrorClass>,
}

fn one() -> f64 {
    1.0
}

/// The most attempts a policy may ask for.
pub const MAX_ATTEMPTS: u32 = 100;

impl RetryPolicy {
    /// What is refused at load, in words that name the key.
    pub fn check(&self) -> Result<(), String> {
        if self.attempts == 0 || self.attempts > MAX_ATTEMPTS {
            return Err(format!(
                "retry.attempts is {}: it counts every attempt, the first included, \
                 from 1 (never again) to {MAX_ATTEMPTS}",
                self.attempts
            ));
        }
        if !self.backoff.is_finite() || self.backoff < 1.0 {
            return Err(format!(
                "retry.backoff is {}: a wait never shrinks, so it is at least 1.0",
                self.backoff
            ));
        }
        if let Some(max) = self.max_wait
            && max < self.wait
        {
            return Err(format!(
                "retry.max_wait ({}) is below retry.wait ({})",
                humantime::format_duration(max),
                humantime::format_duration(self.wait)
            ));
        }
        if let Some(class) = self.on.iter().find(|c| !c.is_retryable()) {
            return Err(format!(
                "retry.on names `{class}`, which is never tried again: \
                 another attempt could only repeat it or waste budget (I-23)"
            ));
        }
        Ok(())
    }

    /// Whether a failed attempt `attempt` of this class gets another.
    pub fn retries(&self, attempt: u32, class: ErrorClass) -> bool {
        attempt < self.attempts
            && class.is_retryable()
            && (self.on.is_empty() || self.on.contains(&class))
    }

    /// The wait before attempt `next` (2 for the first retry).
    pub fn wait_before(&self, next: u32) -> Duration {
        let times = self.backoff.powi(next.saturating_sub(2).min(1_000) as i32);
        let cap = self.max_wait.unwrap_or(Duration::MAX);
        Duration::try_from_secs_f64(self.wait.as_secs_f64() * times)
            .unwrap_or(Duration::MAX)
            .min(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(toml_text: &str) -> Result<RetryPolicy, String> {
        #[derive(Deserialize)]
        struct Holder {
            retry: RetryPolicy,
        }
        let h: Holder = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        h.retry.check()?;
        Ok(h.retry)
    }

    #[test]
    fn waits_grow_by_backoff_up_to_max_wait() {
        let p =
            policy(r#"retry = { attempts = 5, wait = "15s", backoff = 2.0, max_wait = "50s" }"#)
                .unwrap();
        let waits: Vec<u64> = (2..=5).map(|n| p.wait_before(n).as_secs()).collect();
        assert_eq!(waits, [15, 30, 50, 50]);
        assert!(p.retries(4, ErrorClass::Task));
        assert!(!p.retries(5, ErrorClass::Task), "5 attempts in all");
        assert!(!p.retries(1, ErrorClass::BudgetExhausted));
    }

    #[test]
    fn on_limits_the_classes_and_refuses_one_never_retried() {
        let p = policy(r#"retry = { attempts = 2, on = ["model_rate_limit"] }"#).unwrap();
        assert!(p.retries(1, ErrorClass::ModelRateLimit));
        assert!(!p.retries(1, ErrorClass::Task));
        assert_eq!(p.wait_before(2), Duration::ZERO);
        let e = policy(r#"retry = { attempts = 2, on = ["budget_exhausted"] }"#).unwrap_err();
        assert!(
            e.contains("`budget_exhausted`") && e.contains("never"),
            "{e}"
        );
        let e = policy(r#"retry = { attempts = 2, on = ["budget"] }"#).unwrap_err();
        assert!(e.contains("unknown variant `budget`"), "{e}");
    }

    #[test]
    fn bad_numbers_are_refused_by_name() {
        for (text, says) in [
            ("retry = { attempts = 0 }", "retry.attempts is 0"),
            ("retry = { attempts = 2, backoff = 0.5 }", "retry.backoff"),
            (
                r#"retry = { attempts = 2, wait = "1m", max_wait = "10s" }"#,
                "retry.max_wait",
            ),
            (r#"retry = { attempts = 2, wait = "soon" }"#, "soon"),
            (
                "retry = { attempts = 2, tries = 3 }",
                "unknown field `tries`",
            ),
        ] {
            let e = policy(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
