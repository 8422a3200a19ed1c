//! Grading (I-22): what a loop's end earns, after the machine's checks,
//! which only ever lower what the agent declared.

use super::types::{LoopEnd, LoopOutcome};
use arbor_protocol::TaskStatus;

/// I-22: the task status a loop's end earns, lowered by the machine checks.
/// Pure: every rule is a row in the unit table below.
pub fn grade(
    outcome: &LoopOutcome,
    schema_error: Option<&str>,
    missing_artifacts: &[String],
) -> (TaskStatus, Vec<String>) {
    let mut notes = vec![];
    let mut status = match outcome.end {
        LoopEnd::Submitted | LoopEnd::FinalAnswer => {
            outcome.declared.unwrap_or(TaskStatus::Completed)
        }
        LoopEnd::TurnCap | LoopEnd::BudgetExhausted => {
            if outcome.produced {
                TaskStatus::Partial
            } else {
                TaskStatus::Failed
            }
        }
        LoopEnd::Failed | LoopEnd::Stopped => TaskStatus::Failed,
    };
    if matches!(outcome.end, LoopEnd::Submitted | LoopEnd::FinalAnswer) && is_empty(&outcome.output)
    {
        status = TaskStatus::Failed;
        notes.push("the answer is empty".to_string());
    }
    if let Some(error) = schema_error {
        status = TaskStatus::Failed;
        notes.push(format!("the output does not match its schema: {error}"));
    }
    if !missing_artifacts.is_empty() {
        status = status.min(TaskStatus::Partial);
        notes.push(format!(
            "required artifacts missing: {}",
            missing_artifacts.join(", ")
        ));
    }
    // I-22: the machine's checks only ever lower what the agent declared.
    debug_assert!(
        outcome.declared.is_none_or(|declared| status <= declared),
        "{status:?} is above the declared {:?}",
        outcome.declared
    );
    (status, notes)
}

fn is_empty(output: &serde_json::Value) -> bool {
    match output {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.trim().is_empty(),
        _ => false,
    }
}
