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
    /// What each node's status was when last printed, for plain mode.
    seen: HashMap<String, Status>,
}

impl Progress {
    pub fn new(live: bool) -> Self {
        Self {
            live,
            drawn_lines: 0,
            seen: HashMap::new(),
        }
    }

    /// Draws `root`, a run's tree as `Tree::root` builds it.
    pub fn show(&mut self, root: &TreeNode) {
        if self.live {
            let lines = lines(root);
            let mut out = std::io::stdout().lock();
            if self.drawn_lines > 0 {
                // Up to the top of what we drew, and clear it.
                let _ = write!(out, "\x1b[{}F\x1b[J", self.drawn_lines);
            }
            for line in &lines {
                let _ = writeln!(out, "{line}");
            }
            let _ = out.flush();
            self.drawn_lines = lines.len();
        } else {
            // One write per draw, not one per line: stdout is line-buffered,
            // and a fan-out's draw prints a line for each of a thousand jobs.
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            self.plain(root, &mut out);
            let _ = out.flush();
        }
    }

    fn plain(&mut self, node: &TreeNode, out: &mut impl Write) {
        if self.seen.get(&node.id) != Some(&node.status) {
            self.seen.insert(node.id.clone(), node.status);
            let _ = writeln!(out, "{}", describe(node, false));
        }
        for child in &node.children {
            self.plain(child, out);
        }
    }

    pub fn finish(&mut self, tree: &Tree) {
        let root = tree.root();
        if !self.live {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let _ = writeln!(out);
            for line in lines(&root) {
                let _ = writeln!(out, "{line}");
            }
            let _ = out.flush();
        }
        print_output(&root);
        if let Some(reason) = &root.reason {
            println!("reason: {reason}");
        }
        let mut artifacts = vec![];
        collect_artifacts(&root, &mut artifacts);
        if !artifacts.is_empty() {
            println!("\nartifacts:");
            for path in artifacts {
                println!("  {path}");
            }
        }
    }
}

/// The run's answer, after a blank line: text as it is, JSON pretty.
pub fn print_output(root: &TreeNode) {
    match &root.output {
        serde_json::Value::Null => {}
        serde_json::Value::String(s) => println!("\noutput:\n{s}"),
        other => println!(
            "\noutput:\n{}",
            serde_json::to_string_pretty(other).unwrap_or_default()
        ),
    }
}

fn collect_artifacts(node: &TreeNode, out: &mut Vec<String>) {
    if let Some(workdir) = &node.workdir {
        for a in &node.artifacts {
            out.push(std::path::Path::new(workdir).join(a).display().to_string());
        }
    }
    for child in &node.children {
        collect_artifacts(child, out);
    }
}

fn lines(root: &TreeNode) -> Vec<String> {
    let mut out = vec![describe(root, true)];
    walk(root, "", &mut out);
    out
}

fn walk(node: &TreeNode, prefix: &str, out: &mut Vec<String>) {
    let n = node.children.len();
    for (i, child) in node.children.iter().enumerate() {
        let last = i + 1 == n;
        let branch = if last { "└─ " } else { "├─ " };
        out.push(format!("{prefix}{branch}{}", describe(child, true)));
        let deeper = format!("{prefix}{}", if last { "   " } else { "│  " });
        walk(child, &deeper, out);
    }
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
    let reason = match (&node.reason, node.status) {
        (Some(r), Status::Failed | Status::Stopped) => format!(" — {r}"),
        _ => String::new(),
    };
    let depth = if in_tree {
        String::new()
    } else {
        format!(" depth {}", node.depth)
    };
    format!(
        "{who} [{status}]{attempt}{depth} tokens spent {} held {} of {}{reason}",
        acct.spent, acct.held, acct.grant
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
