//! `arbor run` in a terminal asks its cards there (I-60): a question's
//! answer, a call's or a step's yes or no, one card at a time, oldest
//! first, each decided through the node's gate as the API would (by
//! `terminal`). Without a terminal on stdin nobody can answer, and each
//! card is said once on stderr (`tell_new_cards`).

use arbor_protocol::{Amount, Card, CardId, CardKind, CardState, RunId, Verdict, WaitingView};
use arbor_runtime::{Decide, EmbeddedNode};
use std::collections::HashSet;
use tokio::sync::mpsc;

/// Who decides a card answered at the terminal.
const BY: &str = "terminal";

pub struct Asker {
    lines: mpsc::UnboundedReceiver<String>,
    /// The card whose prompt is shown, waiting for a line.
    asking: Option<Card>,
    /// Cards decided here or closed meanwhile: never asked again.
    done: HashSet<CardId>,
    /// Lines typed before a prompt asked for them (typed ahead, or piped).
    early: std::collections::VecDeque<String>,
    /// The run paused at its ceiling and a top-up is asked for (I-58).
    topping: bool,
}

impl Asker {
    /// Reads stdin's lines on a thread of its own (a read blocks).
    pub fn start() -> Self {
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
                if tx.send(line.trim().to_string()).is_err() {
                    break;
                }
                line.clear();
            }
        });
        Self {
            lines,
            asking: None,
            done: HashSet::new(),
            early: Default::default(),
            topping: false,
        }
    }

    /// Whether a prompt waits for a line (the live view is not drawn over it).
    pub fn is_asking(&self) -> bool {
        self.asking.is_some() || self.topping
    }

    /// A line typed, if one came.
    pub async fn line(&mut self) -> Option<String> {
        self.lines.recv().await
    }

    /// A line typed ahead, for the prompt now shown.
    pub fn typed_ahead(&mut self) -> Option<String> {
        if !self.is_asking() {
            return None;
        }
        self.early.pop_front()
    }

    /// Shows the oldest pending card not yet asked, unless one is shown.
    pub fn prompt_next(&mut self, node: &EmbeddedNode, run: RunId) {
        if let Some(card) = &self.asking {
            // Closed meanwhile (an expiry, a stop): its prompt is void.
            let open = node
                .approvals(Some(run), Some(CardState::Pending))
                .is_ok_and(|cards| cards.iter().any(|c| c.id == card.id));
            if open {
                return;
            }
            eprintln!("\narbor: card {} was closed before an answer came", card.id);
            self.asking = None;
        }
        let Ok(cards) = node.approvals(Some(run), Some(CardState::Pending)) else {
            return;
        };
        if let Some(card) = cards.into_iter().find(|c| !self.done.contains(&c.id)) {
            eprint!("\n{}", prompt(&card));
            self.asking = Some(card);
            return;
        }
        self.prompt_top_up(node, run);
    }

    /// A run paused at its ceiling asks for a top-up, once per pause.
    fn prompt_top_up(&mut self, node: &EmbeddedNode, run: RunId) {
        let needs = node
            .events()
            .with_tree(run, |tree| match tree.map(|t| &t.head().waiting) {
                Some(Some(WaitingView::Budget { needs, .. })) => Some(*needs),
                _ => None,
            });
        match (needs, self.topping) {
            (Some(needs), false) => {
                let usd = match needs.usd_micros {
                    0 => String::new(),
                    micros => format!(" and ${:.6}", micros as f64 / 1e6),
                };
                eprint!(
                    "\narbor: the run paused at its ceiling: its next step needs {} tokens{usd} more\n  \
                     top up by `TOKENS`, `$DOLLARS`, or both (`20000 $0.50`)> ",
                    needs.tokens
                );
                self.topping = true;
            }
            (None, true) => self.topping = false,
            _ => {}
        }
    }

    /// Tops the run up by what `line` says; a line that says no amount asks again.
    async fn top_up(&mut self, node: &EmbeddedNode, run: RunId, line: &str) {
        let mut amount = Amount::ZERO;
        for word in line.split_whitespace() {
            let parsed = match word.strip_prefix('$') {
                Some(usd) => usd
                    .parse::<f64>()
                    .map_err(|_| format!("`{word}` is not an amount of dollars"))
                    .and_then(|usd| {
                        let arg = arbor_protocol::BudgetArg {
                            tokens: None,
                            usd: Some(usd),
                        };
                        arg.usd_micros()
                    })
                    .map(|micros| amount.usd_micros = micros.unwrap_or(0)),
                None => word
                    .replace('_', "")
                    .parse::<u64>()
                    .map(|tokens| amount.tokens = tokens)
                    .map_err(|_| format!("`{word}` is not a number of tokens")),
            };
            if let Err(why) = parsed {
                eprint!("arbor: {why}\n  top up by> ");
                return;
            }
        }
        match node.top_up(run, amount, None).await {
            Ok(view) => {
                eprintln!("arbor: topped up: the run's grant is {} tokens", view.grant);
                self.topping = false;
            }
            Err(e) => eprint!("arbor: {e}\n  top up by> "),
        }
    }

    /// Decides the card shown with `line`; a refused decision (an answer
    /// off its choices, a rejection without a reason) asks again.
    pub async fn decide(&mut self, node: &EmbeddedNode, run: RunId, line: String) {
        let Some(card) = self.asking.clone() else {
            if self.topping {
                return self.top_up(node, run, &line).await;
            }
            self.early.push_back(line);
            return;
        };
        let decide = match parse(&card, &line) {
            Ok(decide) => decide,
            Err(why) => {
                eprint!("arbor: {why}\n{}", prompt(&card));
                return;
            }
        };
        match node.decide(card.id, decide).await {
            Ok(decided) => {
                let answer = decided
                    .decision
                    .as_ref()
                    .and_then(|d| d.answer.clone())
                    .map(|a| format!(": {a}"))
                    .unwrap_or_default();
                eprintln!("arbor: card {} {}{answer}", card.id, decided.state);
                self.done.insert(card.id);
                self.asking = None;
            }
            Err(arbor_runtime::DecideError::Invalid(why)) => {
                eprint!("arbor: {why}\n{}", prompt(&card));
            }
            Err(e) => {
                eprintln!("arbor: {e}");
                self.done.insert(card.id);
                self.asking = None;
            }
        }
    }
}

/// What the terminal shows for a card, ending where the answer is typed.
fn prompt(card: &Card) -> String {
    let who = card.lineage.join(" > ");
    let field = |key: &str| card.args.get(key).and_then(|v| v.as_str()).unwrap_or("");
    match card.kind {
        CardKind::Question => {
            let choices = arbor_protocol::approval::question_choices(&card.args);
            let choices = if choices.is_empty() {
                String::new()
            } else {
                format!("\n  choose one of: {}", choices.join(" | "))
            };
            format!(
                "arbor: {who} asks: {}{choices}\n  answer> ",
                field("question")
            )
        }
        CardKind::Step => format!(
            "arbor: step {} ({}) waits for a go-ahead: {}\n  start it? `yes`, or `no REASON`> ",
            field("label"),
            field("agent"),
            field("instruction")
        ),
        CardKind::Call => format!(
            "arbor: {who} wants to run {} {}\n  run it? `yes`, or `no REASON`> ",
            card.tool, card.args
        ),
    }
}

/// A typed line as a decision on `card`.
fn parse(card: &Card, line: &str) -> Result<Decide, String> {
    let decide = |verdict, reason: Option<&str>, answer: Option<&str>| Decide {
        verdict,
        reason: reason.map(str::to_string),
        args: None,
        answer: answer.map(str::to_string),
        by: BY.into(),
        audit: None,
    };
    let line = line.trim();
    let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
    match (card.kind, word.to_ascii_lowercase().as_str()) {
        // A question's every line is its answer ("no" may be one).
        (CardKind::Question, _) if line.is_empty() => Err("type an answer".into()),
        (CardKind::Question, _) => Ok(decide(Verdict::Answer, None, Some(line))),
        (_, "no" | "n") if rest.trim().is_empty() => {
            Err("say why after `no`: the agent reads it".into())
        }
        (_, "no" | "n") => Ok(decide(Verdict::Reject, Some(rest.trim()), None)),
        (_, "yes" | "y") => Ok(decide(Verdict::Approve, None, None)),
        _ => Err("type `yes`, or `no REASON`".into()),
    }
}
