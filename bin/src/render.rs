//! How a run looks on a terminal: the live tree redrawn in place, or plain
//! lines (one per change of status) when stdout is not a terminal.

use arbor_protocol::{NodeKind, Status, Tree, TreeNode};
use std::collections::HashMap;
use std::io::Write;

/// The fastest a run's view is drawn, whatever the rate of events: each draw
/// copies and walks the whole tree, and a wide fan-out changes it thousands
/// of times a second.
pub const REDRAW_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// When to draw: at most once every `REDRAW_EVERY`, and never leaving the
/// last change undrawn (the caller waits for `next_at` while `pending`).
#[derive(Debug)]
pub struct Redraw {
    drawn_at: Option<tokio::time::Instant>,
    pending: bool,
}

impl Default for Redraw {
    /// Nothing drawn yet, so the first look draws.
    fn default() -> Self {
        Self {
            drawn_at: None,
            pending: true,
        }
    }
}

impl Redraw {
    /// The tree changed since it was last drawn.
    pub fn changed(&mut self) {
        self.pending = true;
    }

    /// A change waits to be drawn.
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// Whether to draw now; if so, it counts as drawn.
    pub fn take_due(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        if self.pending && self.drawn_at.is_none_or(|at| now >= at + REDRAW_EVERY) {
            self.drawn_at = Some(now);
            self.pending = false;
            true
        } else {
            false
        }
    }

    /// The soonest the next draw may be.
    pub fn next_at(&self) -> tokio::time::Instant {
        self.drawn_at
            .map_or_else(tokio::time::Instant::now, |at| at + REDRAW_EVERY)
    }
}

pub struct Progress {
    live: bool,
    drawn_lines: usize,
    /// What each node's status was when last printed, and whether it
    /// waited on an approval card, for plain mode.
    seen: HashMap<String, (Status, bool)>,
}

/// What one draw prints: read off the tree (under the event bus's lock, for
/// `arbor run`, which then lets go of it) and written after.
pub struct Frame {
    lines: Vec<String>,
}

impl Progress {
    pub fn new(live: bool) -> Self {
        Self {
            live,
            drawn_lines: 0,
            seen: HashMap::new(),
        }
    }

    /// The lines the next draw prints: on a terminal, the whole tree; else
    /// one for each node whose status changed since the last draw. Read
    /// with `Tree::walk`, with no copy of the tree: a fan-out's thousand
    /// nodes were copied at every draw.
    pub fn frame(&mut self, tree: &Tree) -> Frame {
        let mut lines = vec![];
        if self.live {
            tree.walk(|node, last| lines.push(tree_line(node, last)));
        } else {
            tree.walk(|node, _| {
                let now = (node.status, node.waiting.is_some());
                let changed = match self.seen.get_mut(&node.id) {
                    Some(seen) if *seen == now => false,
                    Some(seen) => {
                        *seen = now;
                        true
                    }
                    None => {
                        self.seen.insert(node.id.clone(), now);
                        true
                    }
                };
                if changed {
                    lines.push(describe(node, false));
                }
            });
        }
        Frame { lines }
    }

    /// Writes a frame: in place of the last one on a terminal, after it
    /// otherwise. One write either way, not one per line: stdout is
    /// line-buffered, and a fan-out's draw has a line per job.
    pub fn draw(&mut self, frame: Frame) {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        if self.live && self.drawn_lines > 0 {
            // Up to the top of what we drew, and clear it.
            let _ = write!(out, "\x1b[{}F\x1b[J", self.drawn_lines);
        }
        for line in &frame.lines {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
        if self.live {
            self.drawn_lines = frame.lines.len();
        }
    }

    /// `frame`, then `draw`.
    pub fn show(&mut self, tree: &Tree) {
        let frame = self.frame(tree);
        self.draw(frame);
    }

    pub fn finish(&mut self, tree: &Tree) {
        let mut lines = vec![];
        let mut artifacts: Vec<String> = vec![];
        let mut end = None;
        // Each loop's checks, as its latest attempt has them.
        let mut loops: std::collections::BTreeMap<String, Vec<arbor_protocol::IterationView>> =
            Default::default();
        tree.walk(|node, last| {
            if last.is_empty() {
                end = Some((node.output.clone(), node.reason.clone()));
            }
            if !self.live {
                lines.push(tree_line(node, last));
            }
            if let (Some(label), false) = (&node.label, node.iterations.is_empty()) {
                let seen = loops.entry(label.clone()).or_default();
                if node.iterations.len() > seen.len() {
                    *seen = node.iterations.clone();
                }
            }
            if let Some(workdir) = &node.workdir {
                for a in &node.artifacts {
                    let path = std::path::Path::new(workdir).join(a).display().to_string();
                    // A loop's iterations share a workdir: each file once.
                    if !artifacts.contains(&path) {
                        artifacts.push(path);
                    }
                }
            }
        });
        if !self.live {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let _ = writeln!(out);
            for line in lines {
                let _ = writeln!(out, "{line}");
            }
            let _ = out.flush();
        }
        for (label, iterations) in &loops {
            let said: Vec<String> = iterations.iter().map(iteration_line).collect();
            outln!("{label}: {}", said.join("; "));
        }
        match &tree.root().review {
            Some(review) if review.failed.is_some() => {
                outln!(
                    "review: not made: {}",
                    review.failed.clone().unwrap_or_default()
                );
            }
            Some(review) if review.accept => outln!("review: accepted"),
            Some(review) => outln!(
                "review: missing {}; the last group ran once more",
                review.missing.join("; ")
            ),
            None => {}
        }
        let (output, reason) = end.unwrap_or_default();
        print_output(&output);
        if let Some(reason) = reason {
            outln!("reason: {reason}");
        }
        if !artifacts.is_empty() {
            outln!("\nartifacts:");
            for path in artifacts {
                outln!("  {path}");
            }
        }
    }
}

/// One checked iteration of a loop, in words.
fn iteration_line(i: &arbor_protocol::IterationView) -> String {
    let outcome = if i.passed { "passed" } else { "did not pass" };
    match (i.issues.last(), &i.ended) {
        (_, Some(ended)) => format!(
            "iteration {} {outcome}, the loop ended: {ended}",
            i.iteration
        ),
        (Some(issue), None) => format!("iteration {} {outcome}: {issue}", i.iteration),
        (None, None) => format!("iteration {} {outcome}", i.iteration),
    }
}

/// The run's answer, after a blank line: text as it is, JSON pretty.
pub fn print_output(output: &serde_json::Value) {
    match output {
        serde_json::Value::Null => {}
        serde_json::Value::String(s) => outln!("\noutput:\n{s}"),
        other => outln!(
            "\noutput:\n{}",
            serde_json::to_string_pretty(other).unwrap_or_default()
        ),
    }
}

/// What a node waits on: `waiting for approval of TOOL: card CARD (expires
/// ...)`, or `waiting to try LABEL again (attempt N at ...)`.
pub fn waiting(w: &arbor_protocol::WaitingView) -> String {
    use arbor_protocol::WaitingView;
    match w {
        WaitingView::Approval {
            card,
            tool,
            deadline_ms,
            expiring,
        } => format!(
            "waiting for approval of {tool}: card {card} (expires {}{})",
            arbor_protocol::approval::rfc3339(*deadline_ms),
            if *expiring { ", soon" } else { "" }
        ),
        WaitingView::Retry {
            label,
            attempt,
            class,
            until_ms,
            ..
        } => format!(
            "waiting to try {label} again after {class} (attempt {attempt} at {})",
            arbor_protocol::approval::rfc3339(*until_ms)
        ),
        WaitingView::NeedsDecision { job, label, why } => format!(
            "waiting for a person: step {label} was interrupted and may have acted outside \
             its workdir ({why}); `arbor continue {job}` runs it again"
        ),
        WaitingView::Budget { needs, deadline_ms } => format!(
            "paused at its ceiling: needs {} tokens{} more (`arbor budget RUN --add-tokens N`), \
             until {}",
            needs.tokens,
            match needs.usd_micros {
                0 => String::new(),
                micros => format!(" and {micros} micro-dollars"),
            },
            arbor_protocol::approval::rfc3339(*deadline_ms)
        ),
    }
}

/// A node's line in the drawn tree: a branch for each level above it (from
/// `Tree::walk`'s last-of-its-siblings flags), then what `describe` says.
fn tree_line(node: &TreeNode, last: &[bool]) -> String {
    let mut line = String::new();
    if let Some((own, above)) = last.split_last() {
        for &was_last in above {
            line.push_str(if was_last { "   " } else { "│  " });
        }
        line.push_str(if *own { "└─ " } else { "├─ " });
    }
    line.push_str(&describe(node, true));
    line
}

fn describe(node: &TreeNode, in_tree: bool) -> String {
    let who = match node.kind {
        NodeKind::Run => format!("run {}", node.id),
        _ => {
            let agent = node.agent.clone().unwrap_or_default();
            match &node.label {
                Some(label) if label != &agent => format!("{label} ({agent})"),
                _ => agent,
            }
        }
    };
    let status = match node.task_status {
        Some(ts) if node.status == Status::Done => format!("{} {}", node.status, ts),
        _ => node.status.to_string(),
    };
    let acct = &node.account;
    let attempt = if node.attempt > 1 {
        format!(" attempt {}", node.attempt)
    } else {
        String::new()
    };
    // A provider's model is named: after a fallback (I-55), the one that answered.
    let model = match node.model.as_deref() {
        Some(m) if m != "scripted" => format!(" on {m}"),
        _ => String::new(),
    };
    let reason = match (&node.reason, node.status, &node.waiting) {
        (Some(r), Status::Failed | Status::Stopped, _) => format!(" — {r}"),
        (_, Status::Running, Some(w)) => format!(" — {}", waiting(w)),
        _ => String::new(),
    };
    let depth = if in_tree {
        String::new()
    } else {
        format!(" depth {}", node.depth)
    };
    format!(
        "{who} [{status}]{attempt}{model}{depth} tokens spent {} held {} of {}{reason}",
        acct.spent, acct.held, acct.grant
    )
}

/// A request body (`arbor prompt`) for a person: its settings, its system
/// prompt and messages as text, each tool with its schema. Either wire
/// format: OpenAI's system is its first message, Anthropic's a key.
pub fn request_body(body: &serde_json::Value) -> String {
    use serde_json::Value;
    let text_of = |content: &Value| match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| {
                b["text"]
                    .as_str()
                    .map_or_else(|| b.to_string(), str::to_string)
            })
            .collect::<Vec<_>>()
            .join("\n"),
        other => other.to_string(),
    };
    let mut out = String::new();
    let settings: Vec<String> = body
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, _)| !matches!(key.as_str(), "system" | "messages" | "tools"))
        .map(|(key, value)| format!("{key}: {value}"))
        .collect();
    out.push_str(&settings.join("\n"));
    let mut messages: Vec<&Value> = body["messages"].as_array().into_iter().flatten().collect();
    let system = match body.get("system") {
        Some(system) => Some(text_of(system)),
        None if messages.first().is_some_and(|m| m["role"] == "system") => {
            Some(text_of(&messages.remove(0)["content"]))
        }
        None => None,
    };
    if let Some(system) = system {
        out.push_str(&format!("\n\n--- system\n{}", system.trim_end()));
    }
    out.push_str("\n\n--- messages");
    for message in messages {
        let role = message["role"].as_str().unwrap_or("?");
        out.push_str(&format!("\n{role}: {}", text_of(&message["content"])));
    }
    let tools: Vec<&Value> = body["tools"].as_array().into_iter().flatten().collect();
    out.push_str(&format!("\n\n--- tools ({})", tools.len()));
    for tool in tools {
        // OpenAI nests a tool under `function`, with `parameters`;
        // Anthropic's is flat, with `input_schema`.
        let tool = tool.get("function").unwrap_or(tool);
        let schema = tool.get("parameters").or_else(|| tool.get("input_schema"));
        out.push_str(&format!(
            "\n{}: {}\n{}",
            tool["name"].as_str().unwrap_or("?"),
            tool["description"].as_str().unwrap_or(""),
            schema
                .map(|s| serde_json::to_string_pretty(s).unwrap_or_default())
                .unwrap_or_default()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::{Event, EventKind, JobId, ParentRef, RunId};

    /// A run with two steps, the first with two jobs.
    fn tree() -> (Tree, [JobId; 4]) {
        let run = RunId::new();
        let ids = [JobId::new(), JobId::new(), JobId::new(), JobId::new()];
        let spawned = |id, parent, label: &str| EventKind::JobSpawned {
            id,
            parent,
            kind: if matches!(parent, ParentRef::Run(_)) {
                NodeKind::Step
            } else {
                NodeKind::Job
            },
            agent: "a".into(),
            label: Some(label.into()),
            depth: 0,
            attempt: 1,
            grant_tokens: 10,
            grant_usd_micros: None,
            workdir: "/w".into(),
            record_seq: 1,
            request: "x".into(),
            call: None,
            model: String::new(),
        };
        let [s1, s2, j1, j2] = ids;
        let mut tree = Tree::new(run);
        let events = [
            spawned(s1, ParentRef::Run(run), "s1"),
            spawned(s2, ParentRef::Run(run), "s2"),
            spawned(j1, ParentRef::Job(s1), "j1"),
            spawned(j2, ParentRef::Job(s1), "j2"),
        ];
        for (seq, kind) in (1..).zip(events) {
            tree.apply(&Event {
                seq,
                run,
                at_ms: 0,
                kind,
            });
        }
        (tree, ids)
    }

    #[test]
    fn on_a_terminal_a_frame_is_the_whole_tree_with_its_branches() {
        let (tree, _) = tree();
        let lines = Progress::new(true).frame(&tree).lines;
        let starts: Vec<&str> = lines
            .iter()
            .map(|l| l.split(" [").next().unwrap_or_default())
            .collect();
        assert!(starts[0].starts_with("run "), "{lines:?}");
        assert_eq!(
            starts[1..],
            ["├─ s1 (a)", "│  ├─ j1 (a)", "│  └─ j2 (a)", "└─ s2 (a)"]
        );
    }

    #[test]
    fn plain_frames_print_each_node_once_and_again_only_when_its_status_changes() {
        let (mut tree, [s1, ..]) = tree();
        let mut view = Progress::new(false);
        assert_eq!(
            view.frame(&tree).lines.len(),
            5,
            "every node, the first time"
        );
        assert!(view.frame(&tree).lines.is_empty(), "nothing changed since");
        tree.apply(&Event {
            seq: 9,
            run: tree.run_id(),
            at_ms: 0,
            kind: EventKind::JobRunning { id: s1 },
        });
        let lines = view.frame(&tree).lines;
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("s1 (a) [running]"), "{lines:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_changes_is_drawn_once_and_its_last_change_is_not_lost() {
        let mut redraw = Redraw::default();
        assert!(redraw.take_due(), "the first look draws");
        assert!(!redraw.take_due(), "nothing changed since");
        for _ in 0..1000 {
            redraw.changed();
            assert!(!redraw.take_due(), "not again within {REDRAW_EVERY:?}");
        }
        assert!(redraw.pending());
        tokio::time::sleep_until(redraw.next_at()).await;
        assert!(redraw.take_due(), "the burst's last change is drawn");
        assert!(!redraw.pending());
        tokio::time::advance(REDRAW_EVERY * 10).await;
        assert!(!redraw.take_due(), "no change, no draw");
        redraw.changed();
        assert!(
            redraw.take_due(),
            "a change after a quiet spell is drawn at once"
        );
    }
}
