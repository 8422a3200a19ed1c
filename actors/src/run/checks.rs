//! What a step's loop (`until`) keeps and what its checks find, as data:
//! its state by label, a check a restart found unmade, a finding from a
//! judge's answer or a command's end (`looping` acts on them); and a run's
//! budget pause, its waiters and deadline (`pause` acts on it).

use arbor_protocol::{Amount, JudgeVerdict, ResultEnvelope, Status, VerdictKind};
use std::time::Duration;

/// A looping step's state, by label.
#[derive(Clone, Debug, Default)]
pub struct LoopState {
    /// The iteration running or next (1 for the first).
    pub iteration: u32,
    /// When its first iteration started (ms since the Unix epoch): its
    /// `max_time` counts from then.
    pub since_ms: u64,
    /// What its iterations and judges have spent together.
    pub spent: Amount,
    /// The previous iteration's output and its issues: what the next is told.
    pub previous: Option<(serde_json::Value, Vec<String>)>,
}

/// A loop's iteration that ended done and whose check a restart found
/// unmade: it is made now (a judge that had answered is not asked again).
#[derive(Clone, Debug)]
pub struct CheckNow {
    pub envelope: ResultEnvelope,
    pub judged: Option<ResultEnvelope>,
}

/// What a run-level job is to its run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// An attempt of a step of the flow.
    Step,
    /// A loop's judge: the label of the step whose iteration it judges.
    Judge(String),
    /// The run's reviewer (`verify`).
    Review,
}

/// Where a run's review (`verify`) is.
#[derive(Clone, Debug, PartialEq)]
pub enum Review {
    /// Its reviewer is at work.
    Asked,
    /// It found `missing`: the last group runs once more, each step told
    /// what was missing and its answer before (`answers`, by label).
    Rerun {
        missing: Vec<String>,
        answers: Vec<(String, serde_json::Value)>,
    },
    /// Made: the run ends when its last group has.
    Made,
}

/// What a check found.
#[derive(Debug)]
pub struct Found {
    pub passed: bool,
    pub verdict: Option<VerdictKind>,
    pub issues: Vec<String>,
    /// The check could not be made, and why: the loop ends.
    pub failed: Option<String>,
}

impl Found {
    pub fn failed(why: String) -> Self {
        Found {
            passed: false,
            verdict: None,
            issues: vec![],
            failed: Some(why),
        }
    }
}

/// What a loop's bounds leave its next job: its grant's caps and its time.
#[derive(Clone, Copy, Debug, Default)]
pub struct Left {
    pub tokens: Option<u64>,
    pub usd_micros: Option<u64>,
    pub time: Option<Duration>,
}

/// The most of a failed command's output a check's issue quotes.
const OUTPUT_TAIL: usize = 2_000;

/// A judge's answer as a check's finding.
pub fn verdict_of(envelope: &ResultEnvelope) -> Found {
    match envelope.status {
        Status::Done => match serde_json::from_value::<JudgeVerdict>(envelope.output.clone()) {
            Ok(v) => Found {
                passed: v.verdict == VerdictKind::Pass,
                verdict: Some(v.verdict),
                issues: v.issues,
                failed: None,
            },
            Err(e) => Found::failed(format!("its judge's answer is not a verdict: {e}")),
        },
        status => Found::failed(format!(
            "its judge {} {status}: {}",
            envelope.agent,
            envelope.error.clone().unwrap_or_default()
        )),
    }
}

/// What a check's command found: exit 0 passes; else the issues are how
/// it ended and the tail of what it printed.
pub fn command_found(command: &str, outcome: crate::sandbox::ExecOutcome) -> Found {
    if outcome.stopped {
        return Found::failed("its check was stopped".into());
    }
    if let Some(error) = outcome.error {
        return Found::failed(format!("its check `{command}` could not run: {error}"));
    }
    if outcome.exit_code == Some(0) && !outcome.timed_out {
        return Found {
            passed: true,
            verdict: None,
            issues: vec![],
            failed: None,
        };
    }
    let how = match (outcome.timed_out, outcome.exit_code) {
        (true, _) => format!("`{command}` timed out"),
        (false, Some(code)) => format!("`{command}` exited {code}"),
        (false, None) => format!("`{command}` was killed by a signal"),
    };
    let mut issues = vec![how];
    let printed = format!("{}{}", outcome.stdout, outcome.stderr);
    let printed = printed.trim();
    if !printed.is_empty() {
        let start = printed
            .char_indices()
            .rev()
            .nth(OUTPUT_TAIL)
            .map_or(0, |(i, _)| i);
        issues.push(format!("it printed: {}", &printed[start..]));
    }
    Found {
        passed: false,
        verdict: None,
        issues,
        failed: None,
    }
}

/// A run's budget pause (`on_ceiling = "pause"`, I-58): who waits for a
/// top-up, in order, and until when. `S` is a step about to start.
pub struct Pause<S> {
    /// In the order they reached the ceiling: each goes on only after
    /// every one before it has (`pause::serve`).
    pub waiters: std::collections::VecDeque<Waiter<S>>,
    /// The open pause's deadline (ms since the Unix epoch) and its timer.
    pub open: Option<(u64, crate::timer::Timer)>,
    /// The deadline of a pause a restart found open: the next pause keeps
    /// it, until a top-up (a pause's deadline is its own, not a restart's).
    pub kept_deadline: Option<u64>,
    /// What was left of the run's wall cap when it paused (I-59: a pause
    /// is not working time; its own deadline bounds it).
    pub wall_left: Option<Duration>,
    /// When the wall cap last started counting.
    pub wall_since: Option<std::time::Instant>,
}

impl<S> Default for Pause<S> {
    fn default() -> Self {
        Self {
            waiters: Default::default(),
            open: None,
            kept_deadline: None,
            wall_left: None,
            wall_since: None,
        }
    }
}

/// One waiter of a budget pause.
pub enum Waiter<S> {
    /// A step whose next call its ceiling refused.
    Step(crate::parent::BudgetWait),
    /// Steps the run could not grant anything to start (a group, a
    /// judge, a reviewer, a retry), and at least what they need.
    Start(Vec<S>, Amount),
}

impl<S> Waiter<S> {
    /// The step that waits; none for steps not started.
    pub fn job(&self) -> Option<arbor_protocol::JobId> {
        match self {
            Waiter::Step(wait) => Some(wait.job),
            Waiter::Start(..) => None,
        }
    }
}
