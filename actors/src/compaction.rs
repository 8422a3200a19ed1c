//! Keeping a job's history inside its model's context window, by a stated
//! policy, in order:
//!
//! 1. Tool results are elided, oldest first, until the prompt fits: each is
//!    replaced by a line saying how many bytes it had. The call that made it
//!    stays, so the model knows what it did.
//! 2. If that is not enough, the oldest turns (everything after the job's
//!    request, up to its last `KEEP_TURNS` turns) are replaced by a summary
//!    the model writes in a metered call of its own, under fixed headings
//!    (`SUMMARY_HEADINGS`). A later compaction hands the model the earlier
//!    summary as one to update, never as text to summarize again.
//! 3. If it still does not fit, the job ends with `context_too_long`.
//!
//! Pure, but for the summary call, which the agent loop makes.
//!
//! Invariants:
//! 1. The job's request (the first message) is never elided or summarized.
//! 2. A summary never splits a turn: an assistant's tool calls and their
//!    results go together, so every result still follows its call.

use crate::model::Message;
use std::ops::Range;

/// Turns kept word for word when older ones are summarized.
pub const KEEP_TURNS: usize = 2;

/// The sections of every summary, in order.
pub const SUMMARY_HEADINGS: [&str; 5] = [
    "Goal",
    "Constraints",
    "Progress",
    "Open questions",
    "Critical context",
];

/// What a summary message in the history begins with.
const SUMMARY_HEADER: &str =
    "Summary of the earlier part of this conversation (made to fit the context window):\n";

/// Elides tool results, oldest first, until `fits` holds of the history (or
/// none is left). Returns how many were elided.
pub fn elide_tool_results(history: &mut [Message], fits: impl Fn(&[Message]) -> bool) -> u32 {
    let mut elided = 0;
    for i in 0..history.len() {
        if fits(history) {
            break;
        }
        if let Message::ToolResult { content, .. } = &mut history[i]
            && !is_elided(content)
        {
            *content = format!(
                "[elided to fit the context window: {} bytes of tool output]",
                content.len()
            );
            elided += 1;
        }
    }
    elided
}

fn is_elided(content: &str) -> bool {
    content.starts_with("[elided to fit the context window")
}

/// The messages a summary would replace: from after the request to the start
/// of the last `keep` turns (a turn starts at an assistant message). None if
/// there is nothing older than that to summarize.
pub fn summary_span(history: &[Message], keep: usize) -> Option<Range<usize>> {
    let turn_starts: Vec<usize> = history
        .iter()
        .enumerate()
        .filter(|(_, m)| matches!(m, Message::Assistant { .. }))
        .map(|(i, _)| i)
        .collect();
    if turn_starts.len() <= keep {
        return None;
    }
    let end = turn_starts[turn_starts.len() - keep];
    (end > 1).then_some(1..end)
}

/// The messages as a plain transcript, for the model to summarize.
pub fn transcript(messages: &[Message]) -> String {
    let mut out = String::new();
    for message in messages {
        match message {
            Message::User(text) => match text.strip_prefix(SUMMARY_HEADER) {
                // An earlier compaction's summary: to be updated, not retold.
                Some(summary) => out.push_str(&format!("PREVIOUS SUMMARY:\n{summary}\n")),
                None => out.push_str(&format!("USER: {text}\n")),
            },
            Message::Assistant { text, calls, .. } => {
                if let Some(text) = text {
                    out.push_str(&format!("ASSISTANT: {text}\n"));
                }
                for call in calls {
                    out.push_str(&format!("ASSISTANT CALLED {}({})\n", call.tool, call.args));
                }
            }
            Message::ToolResult {
                content, is_error, ..
            } => {
                let word = if *is_error {
                    "TOOL ERROR"
                } else {
                    "TOOL RESULT"
                };
                out.push_str(&format!("{word}: {content}\n"));
            }
        }
    }
    out
}

/// Replaces `span` of the history by one message carrying the summary,
/// with every section of `SUMMARY_HEADINGS`.
pub fn apply_summary(history: &mut Vec<Message>, span: Range<usize>, summary: &str) {
    history.splice(
        span,
        [Message::User(format!(
            "{SUMMARY_HEADER}{}",
            sectioned(summary)
        ))],
    );
}

/// The summary laid out under `SUMMARY_HEADINGS`, in order: each
/// section in the model's words, `(not said)` where it wrote none (the next
/// compaction has a place to fill it), and words under no heading kept as
/// critical context.
fn sectioned(summary: &str) -> String {
    let mut sections: [Vec<&str>; SUMMARY_HEADINGS.len()] = Default::default();
    let last = SUMMARY_HEADINGS.len() - 1;
    let mut current = None;
    for line in summary.lines() {
        let heading = line.trim().strip_prefix("## ").and_then(|h| {
            SUMMARY_HEADINGS
                .iter()
                .position(|known| known.eq_ignore_ascii_case(h.trim()))
        });
        match heading {
            Some(at) => current = Some(at),
            None => sections[current.unwrap_or(last)].push(line),
        }
    }
    SUMMARY_HEADINGS
        .iter()
        .zip(sections)
        .map(|(heading, lines)| {
            let text = lines.join("\n");
            let text = text.trim();
            let text = if text.is_empty() { "(not said)" } else { text };
            format!("## {heading}\n{text}")
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ToolCall;

    fn call(id: &str) -> Message {
        Message::Assistant {
            text: None,
            thinking: vec![],
            calls: vec![ToolCall {
                id: id.into(),
                tool: "exec".into(),
                args: serde_json::json!({"command": "ls"}),
            }],
        }
    }

    fn result(id: &str, bytes: usize) -> Message {
        Message::ToolResult {
            call_id: id.into(),
            content: "x".repeat(bytes),
            is_error: false,
        }
    }

    fn size(history: &[Message]) -> usize {
        history.iter().map(Message::text_len).sum()
    }

    #[test]
    fn tool_results_go_oldest_first_and_only_as_many_as_needed() {
        let mut history = vec![
            Message::User("go".into()),
            call("a"),
            result("a", 1000),
            call("b"),
            result("b", 1000),
            call("c"),
            result("c", 1000),
        ];
        let elided = elide_tool_results(&mut history, |h| size(h) < 2200);
        assert_eq!(elided, 1);
        assert!(
            matches!(&history[2], Message::ToolResult { content, .. } if content.contains("1000 bytes"))
        );
        assert!(
            matches!(&history[4], Message::ToolResult { content, .. } if content.len() == 1000)
        );
        assert_eq!(
            elide_tool_results(&mut history, |_| false),
            2,
            "the rest, if it must"
        );
        assert_eq!(
            elide_tool_results(&mut history, |_| false),
            0,
            "never twice"
        );
        assert_eq!(history[0], Message::User("go".into()), "the request stays");
    }

    #[test]
    fn a_summary_keeps_the_request_and_the_last_turns_whole() {
        let history = vec![
            Message::User("go".into()),
            call("a"),
            result("a", 10),
            Message::User("Message from your parent: hurry".into()),
            call("b"),
            result("b", 10),
            call("c"),
            result("c", 10),
        ];
        assert_eq!(summary_span(&history, 2), Some(1..4));
        assert_eq!(summary_span(&history, 3), None);
        let mut h = history.clone();
        apply_summary(&mut h, 1..4, "did a");
        assert_eq!(h.len(), 6);
        assert!(
            matches!(&h[1], Message::User(t) if t.contains("## Goal\n(not said)") && t.ends_with("## Critical context\ndid a"))
        );
        assert_eq!(h[2], call("b"), "a call still precedes its result");
        assert!(transcript(&history[1..4]).contains("ASSISTANT CALLED exec"));
    }

    /// A summary has every section, in the model's words where it gave
    /// them; the next compaction hands it back as one to update.
    #[test]
    fn a_summary_has_its_sections_and_is_updated_not_summarized_again() {
        let written = "## Goal\nfour files\n## Progress\nwrote a";
        let mut history = vec![
            Message::User("go".into()),
            call("a"),
            result("a", 10),
            call("b"),
            result("b", 10),
        ];
        apply_summary(&mut history, 1..3, written);
        let Message::User(summary) = &history[1] else {
            panic!("{history:?}")
        };
        let mut at = 0;
        for heading in SUMMARY_HEADINGS {
            let found = summary[at..]
                .find(&format!("## {heading}"))
                .unwrap_or_else(|| panic!("{heading} missing or out of order in {summary}"));
            at += found;
        }
        assert!(
            summary.contains("## Goal\nfour files"),
            "the model's words kept"
        );
        assert_eq!(summary.matches("## Goal").count(), 1);
        let next = transcript(&history[1..]);
        assert!(
            next.starts_with("PREVIOUS SUMMARY:\n## Goal\nfour files"),
            "{next}"
        );
        assert!(
            !next.contains("USER: Summary of the earlier part"),
            "{next}"
        );
    }
}
