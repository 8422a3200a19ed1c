//! Statuses of runs, steps and jobs, and what the agent says of its own work.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Lifecycle of a run, step or job: pending -> running -> done | failed | stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Pending,
    Running,
    Done,
    Failed,
    Stopped,
}

impl Status {
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Stopped)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Running => "running",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Stopped => "stopped",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// I-22: what the work achieved, ordered best first. Machine checks can only lower it.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    // Declared worst first so that `Ord` and `min` mean "the lower of".
    Failed,
    Blocked,
    Partial,
    Completed,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Completed => "completed",
            TaskStatus::Partial => "partial",
            TaskStatus::Blocked => "blocked",
            TaskStatus::Failed => "failed",
        }
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a node failed, as a class a program can match on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// I-13: the root ceiling was reached.
    BudgetExhausted,
    /// I-19: the wall-clock timeout fired.
    Timeout,
    /// The model adapter failed in a way no class below names.
    Model,
    /// The provider said too many requests (429); retried with backoff.
    ModelRateLimit,
    /// The provider is overloaded (529, or 503); retried with backoff.
    ModelOverloaded,
    /// The provider failed (5xx), or the connection dropped; retried with backoff.
    ModelServer,
    /// No complete answer within the provider's timeout; retried with backoff.
    ModelTimeout,
    /// I-23: the provider's usage cap (insufficient quota); never retried.
    ModelUsageCap,
    /// I-23: the provider refused our credentials (401, 403); never retried.
    ModelAuth,
    /// The provider refused the request as malformed (400, 404, 422).
    ModelBadRequest,
    /// The prompt does not fit the model's context window, even compacted.
    ContextTooLong,
    /// The provider's answer could not be understood (not JSON, a malformed chunk).
    ModelProtocol,
    /// I-38: a panic was contained.
    Panicked,
    /// The agent's own work failed its checks or it declared failure.
    Task,
    /// The node restarted under it (I-30).
    Interrupted,
    /// I-48: the node died under it `max_recoveries` times after resuming
    /// it; it is not resumed again.
    Parked,
    /// It never started: its actor could not be spawned, so nothing ran and
    /// no spawn was counted (I-06). Recovery counts a run's spawns as its
    /// jobs of every other class (I-05).
    Start,
    /// I-49: a replay's request differed from its recording's; the reason
    /// names the job's lineage, the call and the first field that differs.
    Diverged,
    /// arbor itself failed under it mid-run: its journal could not commit,
    /// or an actor it relies on (its job, its account) was gone.
    Internal,
    /// Its tools could not be made ready before its first turn: an MCP
    /// server it was given did not start or list its tools.
    ToolsUnavailable,
    /// It made the same tool call (name and arguments) twice `max_repeats`
    /// times in a row: it is stuck. Never retried; not the provider's fault.
    NoProgress,
    /// Its loop's check did not pass within the loop's bounds (`until`), or
    /// could not be made. Never retried: the bounds said how much to try.
    CheckFailed,
}

impl ErrorClass {
    /// I-23: classes after which a retry could only waste budget or repeat the refusal.
    pub fn is_retryable(self) -> bool {
        !matches!(
            self,
            ErrorClass::BudgetExhausted
                | ErrorClass::ModelUsageCap
                | ErrorClass::ModelAuth
                | ErrorClass::Diverged
                | ErrorClass::NoProgress
                | ErrorClass::CheckFailed
        )
    }

    /// A model call that failed this way says its supply (a provider's
    /// account) will not serve it now, whatever is sent: a call that still
    /// fails so after its own retries moves to an agent's `fallback`, on
    /// another supply (I-55). A bad request is not one: it would fail anywhere.
    pub fn walls_supply(self) -> bool {
        matches!(
            self,
            ErrorClass::ModelUsageCap
                | ErrorClass::ModelAuth
                | ErrorClass::ModelRateLimit
                | ErrorClass::ModelOverloaded
        )
    }

    /// A model call that failed this way may succeed if sent again after a
    /// pause: the agent loop retries it, each attempt reserved anew.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorClass::ModelRateLimit
                | ErrorClass::ModelOverloaded
                | ErrorClass::ModelServer
                | ErrorClass::ModelTimeout
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::BudgetExhausted => "budget_exhausted",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Model => "model",
            ErrorClass::ModelRateLimit => "model_rate_limit",
            ErrorClass::ModelOverloaded => "model_overloaded",
            ErrorClass::ModelServer => "model_server",
            ErrorClass::ModelTimeout => "model_timeout",
            ErrorClass::ModelUsageCap => "model_usage_cap",
            ErrorClass::ModelAuth => "model_auth",
            ErrorClass::ModelBadRequest => "model_bad_request",
            ErrorClass::ContextTooLong => "context_too_long",
            ErrorClass::ModelProtocol => "model_protocol",
            ErrorClass::Panicked => "panicked",
            ErrorClass::Task => "task",
            ErrorClass::Interrupted => "interrupted",
            ErrorClass::Parked => "parked",
            ErrorClass::Start => "start",
            ErrorClass::Diverged => "diverged",
            ErrorClass::Internal => "internal",
            ErrorClass::ToolsUnavailable => "tools_unavailable",
            ErrorClass::NoProgress => "no_progress",
            ErrorClass::CheckFailed => "check_failed",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
