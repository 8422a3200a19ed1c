//! A loop that notices it is stuck: the same tool call (its name and
//! canonical arguments) made again and again in a row. At `max` in a row
//! the call's result carries a notice; at twice `max` the call is not run
//! and the job ends `no_progress` (never retried: the same model on the
//! same history would repeat itself again).

use crate::model::ToolCall;
use sha2::{Digest, Sha256};

/// What a call's result gets appended when it repeats (`{n}`: how many in a row).
pub const REPEAT_NOTICE: &str = "[arbor] You have made this same call, with the same arguments, {n} times in a row, and its result will not change. Do something else: another tool, other arguments, or submit_output with what you have. At {stop} in a row your job ends as stuck.";

/// The run of identical calls the job is on.
#[derive(Debug)]
pub struct Repeats {
    max: u32,
    /// The last call's digest.
    last: String,
    count: u32,
}

/// What to do with a call, by how many times in a row it has been made.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Run,
    /// Run it, and tell the model it is repeating itself.
    RunWithNotice(String),
    /// Do not run it: the job is stuck.
    Stuck(String),
}

impl Repeats {
    /// `carried`: the run of identical calls an interrupted attempt was
    /// on, which this one goes on counting.
    pub fn new(max: u32, carried: Option<(String, u32)>) -> Self {
        let (last, count) = carried.unwrap_or_default();
        Self {
            max: max.max(1),
            last,
            count,
        }
    }

    /// Counts `call` and says what to do with it.
    pub fn see(&mut self, call: &ToolCall) -> Verdict {
        let key = digest(call);
        if self.last == key {
            self.count += 1;
        } else {
            self.last = key;
            self.count = 1;
        }
        let stop = self.max.saturating_mul(2);
        if self.count >= stop {
            Verdict::Stuck(format!(
                "stuck: {} was called {} times in a row with the same arguments (max_repeats {})",
                call.tool, self.count, self.max
            ))
        } else if self.count >= self.max {
            Verdict::RunWithNotice(
                REPEAT_NOTICE
                    .replace("{n}", &self.count.to_string())
                    .replace("{stop}", &stop.to_string()),
            )
        } else {
            Verdict::Run
        }
    }

    /// How many times in a row the last call was made.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The last call's digest (journaled with it, so a restart goes on counting).
    pub fn last_digest(&self) -> &str {
        &self.last
    }
}

/// A call's identity: its tool and canonical arguments, as the first 8
/// bytes of their SHA-256 in hex. `serde_json`'s maps keep their keys
/// sorted, so arguments that differ only in key order are the same call.
pub fn digest(call: &ToolCall) -> String {
    let hash = Sha256::digest(format!("{}\n{}", call.tool, call.args).as_bytes());
    hash[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(tool: &str, args: serde_json::Value) -> ToolCall {
        ToolCall {
            id: "c".into(),
            tool: tool.into(),
            args,
        }
    }

    #[test]
    fn the_same_call_is_told_at_max_and_stopped_at_twice_max() {
        let mut repeats = Repeats::new(2, None);
        let same = || {
            call(
                "exec",
                serde_json::json!({"command": "ls", "timeout": "5s"}),
            )
        };
        assert_eq!(repeats.see(&same()), Verdict::Run);
        assert!(matches!(repeats.see(&same()), Verdict::RunWithNotice(n) if n.contains("2 times")));
        // Key order does not make it another call.
        let reordered: serde_json::Value =
            serde_json::from_str(r#"{"timeout": "5s", "command": "ls"}"#).unwrap();
        assert!(matches!(
            repeats.see(&call("exec", reordered)),
            Verdict::RunWithNotice(_)
        ));
        assert!(matches!(repeats.see(&same()), Verdict::Stuck(_)));
    }

    #[test]
    fn a_carried_streak_goes_on_counting() {
        let same = call("exec", serde_json::json!({"command": "ls"}));
        let mut repeats = Repeats::new(2, Some((digest(&same), 3)));
        assert!(matches!(repeats.see(&same), Verdict::Stuck(_)));
        let mut repeats = Repeats::new(2, Some(("another".into(), 3)));
        assert_eq!(repeats.see(&same), Verdict::Run);
    }

    #[test]
    fn another_call_in_between_starts_the_count_again() {
        let mut repeats = Repeats::new(2, None);
        let a = call("exec", serde_json::json!({"command": "ls"}));
        let b = call("exec", serde_json::json!({"command": "pwd"}));
        assert_eq!(repeats.see(&a), Verdict::Run);
        assert_eq!(repeats.see(&b), Verdict::Run);
        assert_eq!(repeats.see(&a), Verdict::Run);
        assert_eq!(repeats.count(), 1);
    }
}
