//! The status CLI: `arbor status`, `runs`, `show`, `watch`, `submit`, `stop`,
//! `steer`, `continue`, `events`, all over arbord's HTTP API.
//!
//! Where to: `--url` or `ARBOR_URL` (default http://127.0.0.1:7878). The
//! token: `--token` or `ARBOR_TOKEN`, else the file `ARBOR_TOKEN_FILE`
//! names, else `.arbor/token` under the current directory (where arbord
//! keeps it for a workspace started there).
//!
//! Data goes to stdout, in `-o text` (tables and trees), `json` (one
//! document) or `jsonl` (one JSON value a line); diagnostics go to stderr.

use crate::render;
use arbor_protocol::{BudgetArg, Event, NodeKind, RunId, Status, Tree, TreeNode};
use arbor_service::api::{AuditList, AuditQuery, DecisionBody, ReplayRun, StreamEvent, SubmitRun};
use arbor_service::client as api;
use arbor_service::status::NodeStatus;
use clap::{Args, ValueEnum};
use comfy_table::{Cell, Color, ContentArrangement, Table, presets};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const DEFAULT_URL: &str = "http://127.0.0.1:7878";

/// Exit codes: each one pinned by a test (bin/tests/status_cli.rs).
pub mod exit {
    /// The command did what it was asked; a run it shows or waits for is done.
    pub const OK: u8 = 0;
    /// A run it shows or waits for failed or was stopped; or the service
    /// refused what was asked as a conflict (it has ended, say).
    pub const RUN_FAILED: u8 = 1;
    /// Bad usage, or input the service refused (400, 413, 415, 422).
    pub const USAGE: u8 = 2;
    /// No such run or job (404).
    pub const NOT_FOUND: u8 = 3;
    /// The service could not be reached, or is shutting down (503).
    pub const UNREACHABLE: u8 = 4;
    /// The service refused the token (401), or its credential has not the
    /// role the request needs (403).
    pub const UNAUTHORIZED: u8 = 5;
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    #[default]
    Text,
    Json,
    Jsonl,
}

impl Conn {
    /// `-o` as a format: text when not given.
    pub fn format(&self) -> Result<Output, Failed> {
        match self.output.as_deref() {
            None => Ok(Output::Text),
            Some(text) => Output::from_str(text, true).map_err(|_| {
                Failed::new(
                    exit::USAGE,
                    format!("-o takes text, json or jsonl, not {text:?}"),
                )
            }),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ColorWhen {
    #[default]
    Auto,
    Always,
    Never,
}

/// What every client command takes.
#[derive(Args, Clone, Debug)]
pub struct Conn {
    /// arbord's address (default: $ARBOR_URL, else http://127.0.0.1:7878).
    #[arg(long, global = true)]
    pub url: Option<String>,
    /// The API token (default: $ARBOR_TOKEN, else the file $ARBOR_TOKEN_FILE, else ./.arbor/token).
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// How data is printed on stdout: text (the default), json or jsonl.
    /// For `arbor export`, the file the document is written to.
    #[arg(short = 'o', long = "output", value_name = "FORMAT", global = true)]
    pub output: Option<String>,
    /// Colour in text output (NO_COLOR is honoured under auto).
    #[arg(long, value_enum, default_value_t = ColorWhen::Auto, global = true)]
    pub color: ColorWhen,
}

/// A failure with its exit code, said on stderr.
pub struct Failed {
    pub code: u8,
    pub message: String,
}

impl Failed {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<anyhow::Error> for Failed {
    fn from(e: anyhow::Error) -> Self {
        Failed::new(exit::RUN_FAILED, format!("{e:#}"))
    }
}

pub type Outcome = Result<ExitCode, Failed>;

pub struct Client {
    pub(crate) api: api::Client,
    pub output: Output,
    colour: bool,
}

impl Client {
    pub fn new(conn: &Conn) -> Result<Self, Failed> {
        let base = conn
            .url
            .clone()
            .or_else(|| std::env::var("ARBOR_URL").ok())
            .unwrap_or_else(|| DEFAULT_URL.to_string());
        let token = conn
            .token
            .clone()
            .or_else(|| std::env::var("ARBOR_TOKEN").ok())
            .or_else(|| {
                let file = std::env::var("ARBOR_TOKEN_FILE")
                    .map(std::path::PathBuf::from)
                    .unwrap_or_else(|_| std::path::PathBuf::from(".arbor/token"));
                std::fs::read_to_string(file)
                    .ok()
                    .map(|t| t.trim().to_string())
            });
        let api =
            api::Client::new(&base, token).map_err(|e| Failed::new(exit::USAGE, e.to_string()))?;
        let colour = match conn.color {
            ColorWhen::Always => true,
            ColorWhen::Never => false,
            ColorWhen::Auto => {
                std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                    && std::io::stdout().is_terminal()
            }
        };
        anstream::ColorChoice::write_global(if colour {
            anstream::ColorChoice::Always
        } else {
            anstream::ColorChoice::Never
        });
        Ok(Self {
            api,
            output: conn.format()?,
            colour,
        })
    }

    /// Every kind of failure as its exit code.
    pub(crate) fn failed(&self, e: api::Error) -> Failed {
        let code = match &e {
            api::Error::BadUrl(_) => exit::USAGE,
            api::Error::Unreachable { .. } | api::Error::BadReply(_) | api::Error::Broken(_) => {
                exit::UNREACHABLE
            }
            api::Error::Refused {
                status: 401,
                message,
            } => {
                let why = if self.api.has_token() {
                    format!("arbord refused the token: {message}")
                } else {
                    "no token was found: give --token, set ARBOR_TOKEN or ARBOR_TOKEN_FILE, \
                     or run from the workspace arbord serves (it reads ./.arbor/token)"
                        .to_string()
                };
                return Failed::new(exit::UNAUTHORIZED, why);
            }
            api::Error::Refused { status, .. } => match status {
                403 => exit::UNAUTHORIZED,
                404 => exit::NOT_FOUND,
                409 => exit::RUN_FAILED,
                503 => exit::UNREACHABLE,
                400..=499 => exit::USAGE,
                _ => exit::UNREACHABLE,
            },
        };
        Failed::new(code, e.to_string())
    }

    fn print_json(&self, value: &impl serde::Serialize) -> Result<(), Failed> {
        let text = match self.output {
            Output::Jsonl => serde_json::to_string(value),
            _ => serde_json::to_string_pretty(value),
        }
        .map_err(|e| Failed::new(exit::RUN_FAILED, e.to_string()))?;
        outln!("{text}");
        Ok(())
    }
}

fn parse_run(text: &str) -> Result<RunId, Failed> {
    text.parse()
        .map_err(|_| Failed::new(exit::USAGE, format!("{text:?} is not a run id (a UUID)")))
}

fn run_exit(status: Status) -> ExitCode {
    match status {
        Status::Done | Status::Pending | Status::Running => ExitCode::from(exit::OK),
        Status::Failed | Status::Stopped => ExitCode::from(exit::RUN_FAILED),
    }
}

// ---- status and the tree table ----

#[derive(Args, Clone, Debug)]
pub struct StatusArgs {
    /// Show nodes in this status, but not what is below them.
    #[arg(long, value_enum)]
    pub fold: Option<FoldWhat>,
    /// Show the tree down to this many levels below each run.
    #[arg(long)]
    pub depth: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FoldWhat {
    Done,
    Failed,
    Stopped,
    Ended,
}

impl FoldWhat {
    fn folds(self, status: Status) -> bool {
        match self {
            FoldWhat::Done => status == Status::Done,
            FoldWhat::Failed => status == Status::Failed,
            FoldWhat::Stopped => status == Status::Stopped,
            FoldWhat::Ended => status.is_terminal(),
        }
    }
}

/// `arbor limits`: each rate window, its limits and what it holds now.
pub async fn limits(client: &Client) -> Outcome {
    let limits = client.api.limits().await.map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&limits)?;
        return Ok(ExitCode::SUCCESS);
    }
    if limits.models.is_empty() {
        outln!("no rate limits: no provider of arbor.toml says rpm or tpm");
    }
    let of = |used: u64, limit: Option<u64>| match limit {
        Some(limit) => format!("{used}/{limit}"),
        None => format!("{used}/-"),
    };
    for w in &limits.models {
        let closed = match w.closed_ms {
            0 => String::new(),
            ms => format!(
                " · closed by the provider for {}",
                humantime::format_duration(Duration::from_millis(ms))
            ),
        };
        let waiting = match w.waiting {
            0 => String::new(),
            n => format!(" · {n} waiting"),
        };
        outln!(
            "{} · requests {} · tokens {} (the last minute){closed}{waiting}",
            w.model,
            of(w.used.requests, w.rpm),
            of(w.used.tokens, w.tpm)
        );
    }
    for t in &limits.tenants {
        let windows: Vec<String> = t
            .quota
            .iter()
            .map(|(window, limit)| {
                let used = t.used.get(window).copied().unwrap_or(0);
                if window.starts_with("usd_") {
                    format!("{window} {}/{}", usd(used), usd(*limit))
                } else {
                    format!("{window} {used}/{limit}")
                }
            })
            .collect();
        let queued = match t.queued {
            0 => String::new(),
            n => format!(" · {n} queued for room"),
        };
        outln!(
            "tenant {} · {} (over it: {}){queued}",
            t.tenant,
            windows.join(" · "),
            t.on_quota
        );
    }
    for c in &limits.concurrency {
        outln!(
            "{} · {}/{} running · {} queued",
            c.key,
            c.running,
            c.limit,
            c.queued
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn status(client: &Client, args: StatusArgs) -> Outcome {
    let status: NodeStatus = client.api.status().await.map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&status)?;
        return Ok(ExitCode::SUCCESS);
    }
    let n = &status.node;
    outln_styled!(
        "arbord {} · epoch {} · up {} · {} running, {} queued (max {}) · journal seq {} ({} fsyncs){}",
        n.version,
        n.epoch,
        humantime::format_duration(Duration::from_secs(n.uptime_ms / 1000)),
        status.admission.running,
        status.admission.queued,
        status.admission.max_running_runs,
        status.journal.durable_seq,
        status.journal.fsyncs,
        if n.accepting { "" } else { " · DRAINING" }
    );
    if n.sandbox.sealed {
        outln_styled!("sandbox {}", n.sandbox.detail);
    } else {
        outln_styled!("WARNING: sandbox {}", n.sandbox.detail);
    }
    let r = &status.recovery;
    if !r.jobs_failed.is_empty() || !r.runs_resumed.is_empty() || !r.processes_killed.is_empty() {
        outln_styled!(
            "last recovery: {} jobs failed as interrupted, {} runs resumed, {} process groups killed, {} grants released",
            r.jobs_failed.len(),
            r.runs_resumed.len(),
            r.processes_killed.len(),
            r.grants_released
        );
    }
    // A shared journal's nodes: who holds a lease, for how long, and which
    // runs each owns at which epoch (docs/cluster.md).
    for node in status.nodes.iter().flatten() {
        let runs: Vec<String> = node
            .runs
            .iter()
            .map(|r| format!("{} (epoch {})", r.run, r.epoch))
            .collect();
        outln_styled!(
            "node {} · epoch {} · {} · owns {}",
            node.id,
            node.epoch,
            if node.lease_left_ms == 0 {
                "lease run out".to_string()
            } else {
                format!("lease {} ms more", node.lease_left_ms)
            },
            if runs.is_empty() {
                "no running runs".to_string()
            } else {
                runs.join(", ")
            }
        );
    }
    if status.runs.is_empty() {
        outln_styled!("no runs are running or queued");
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{}", tree_table(client, &status.runs, &args));
    Ok(ExitCode::SUCCESS)
}

fn icon(status: Status) -> &'static str {
    match status {
        Status::Pending => "◌",
        Status::Running => "▶",
        Status::Done => "✔",
        Status::Failed => "✖",
        Status::Stopped => "■",
    }
}

fn colour_of(status: Status) -> Color {
    match status {
        Status::Pending => Color::Grey,
        Status::Running => Color::Cyan,
        Status::Done => Color::Green,
        Status::Failed => Color::Red,
        Status::Stopped => Color::Yellow,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn age(node: &TreeNode) -> String {
    let Some(start) = node.started_at_ms else {
        return "-".into();
    };
    let end = node.ended_at_ms.unwrap_or_else(now_ms);
    let secs = end.saturating_sub(start) / 1000;
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

fn usd(micros: u64) -> String {
    format!("${}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

/// The runs as one table, a row a node, the first column drawn as a tree.
pub fn tree_table(client: &Client, runs: &[TreeNode], args: &StatusArgs) -> Table {
    let mut table = Table::new();
    table
        .load_style(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(vec![
            "TREE", "KIND", "AGENT", "STATUS", "DEPTH", "SPENT", "HELD", "GRANTED", "COST", "AGE",
            "TOOLS", "REASON",
        ]);
    if client.colour {
        table.enforce_styling();
    } else {
        table.force_no_tty();
    }
    for run in runs {
        add_rows(&mut table, run, "", "", 0, args);
    }
    table
}

/// A node's tool calls in all, and each MCP server's state and restarts:
/// `12 calls; fs running; gh killed+1` (per tool: `-o json`).
fn tools(node: &TreeNode) -> String {
    let calls: u64 = node.tools.values().sum();
    let mut parts = vec![];
    if calls > 0 {
        parts.push(format!("{calls} calls"));
    }
    for (server, view) in &node.mcp {
        let state = serde_json::to_value(view.state).unwrap_or_default();
        let state = state.as_str().unwrap_or("?").to_string();
        let restarts = if view.restarts > 0 {
            format!("+{}", view.restarts)
        } else {
            String::new()
        };
        parts.push(format!("{server} {state}{restarts}"));
    }
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join("; ")
    }
}

fn add_rows(
    table: &mut Table,
    node: &TreeNode,
    lead: &str,
    branch: &str,
    level: u32,
    args: &StatusArgs,
) {
    let name = match node.kind {
        NodeKind::Run => node.id.clone(),
        _ => node.label.clone().unwrap_or_else(|| node.id.clone()),
    };
    let status = match (node.task_status, &node.waiting) {
        (Some(ts), _) if node.status == Status::Done => format!("{} ({ts})", node.status),
        (_, Some(_)) if node.status == Status::Running => "waiting (approval)".to_string(),
        _ => node.status.to_string(),
    };
    // A waiting job says on what, where its reason would go.
    let reason = match &node.waiting {
        Some(w) if !node.status.is_terminal() => render::waiting(w),
        _ => node.reason.clone().unwrap_or_default(),
    };
    let cost = node.usd.map(|u| usd(u.spent)).unwrap_or_else(|| "-".into());
    table.add_row(vec![
        Cell::new(format!("{lead}{branch}{} {name}", icon(node.status))).fg(colour_of(node.status)),
        Cell::new(node.kind.as_str()),
        Cell::new(node.agent.clone().unwrap_or_else(|| "-".into())),
        Cell::new(status).fg(colour_of(node.status)),
        Cell::new(node.depth),
        Cell::new(node.account.spent),
        Cell::new(node.account.held),
        Cell::new(node.account.grant),
        Cell::new(cost),
        Cell::new(age(node)),
        Cell::new(tools(node)),
        Cell::new(reason),
    ]);
    if args.fold.is_some_and(|f| f.folds(node.status)) && !node.children.is_empty() {
        return;
    }
    if args.depth.is_some_and(|d| level >= d) {
        return;
    }
    let below = match branch {
        "├─ " => format!("{lead}│  "),
        "└─ " => format!("{lead}   "),
        _ => lead.to_string(),
    };
    let n = node.children.len();
    for (i, child) in node.children.iter().enumerate() {
        let branch = if i + 1 == n { "└─ " } else { "├─ " };
        add_rows(table, child, &below, branch, level + 1, args);
    }
}

// ---- runs, show ----

#[derive(Args, Clone, Debug)]
pub struct RunsArgs {
    /// Only runs in this status: pending, running, done, failed, stopped.
    #[arg(long, conflicts_with = "failed")]
    pub status: Option<String>,
    /// Only failed runs, each with the step or job its failure began at
    /// and its error class (`--status failed`).
    #[arg(long)]
    pub failed: bool,
    /// At most this many (1 to 500).
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
}

pub async fn runs(client: &Client, args: RunsArgs) -> Outcome {
    let list = client
        .api
        .runs(
            if args.failed {
                Some("failed")
            } else {
                args.status.as_deref()
            },
            args.limit,
            None,
        )
        .await
        .map_err(|e| client.failed(e))?;
    match client.output {
        Output::Json => client.print_json(&list)?,
        Output::Jsonl => {
            for run in &list.runs {
                client.print_json(run)?;
            }
        }
        Output::Text => {
            let mut table = Table::new();
            table
                .load_style(presets::NOTHING)
                .set_content_arrangement(ContentArrangement::Disabled)
                .set_header(if args.failed {
                    vec!["RUN", "FLOW", "CLASS", "FAILED FIRST", "REASON"]
                } else {
                    vec!["RUN", "FLOW", "STATUS", "TOOK", "TOKENS SPENT", "REASON"]
                });
            if client.colour {
                table.enforce_styling();
            } else {
                table.force_no_tty();
            }
            for run in list.runs.iter().filter(|_| args.failed) {
                let first = run.failed_job.as_ref();
                let class = run.error_class.or(first.and_then(|j| j.error_class));
                table.add_row(vec![
                    Cell::new(run.id),
                    Cell::new(&run.flow),
                    Cell::new(class.map(|c| c.to_string()).unwrap_or_default()),
                    Cell::new(first.map_or(String::new(), |j| {
                        let name = j.label.as_deref().or(j.agent.as_deref()).unwrap_or("?");
                        format!("{name} ({})", j.id)
                    })),
                    Cell::new(run.reason.clone().unwrap_or_default()),
                ]);
            }
            for run in list.runs.iter().filter(|_| !args.failed) {
                let status = match run.queue_position {
                    Some(p) => format!("{} (queue #{})", run.status, p + 1),
                    None => run.status.to_string(),
                };
                // The same figures the console's list shows.
                let took = run.started_at_ms.map_or(String::new(), |start| {
                    let end = run.ended_at_ms.unwrap_or_else(now_ms);
                    let ms = end.saturating_sub(start);
                    humantime::format_duration(Duration::from_millis(ms - ms % 100)).to_string()
                });
                let spent = match run.tokens {
                    Some(account) => format!("{} of {}", account.spent, account.grant),
                    None => format!("0 of {}", run.budget_tokens),
                };
                table.add_row(vec![
                    Cell::new(run.id),
                    Cell::new(&run.flow),
                    Cell::new(status).fg(colour_of(run.status)),
                    Cell::new(took),
                    Cell::new(spent),
                    Cell::new(run.reason.clone().unwrap_or_default()),
                ]);
            }
            outln!("{table}");
            if let Some(next) = list.next {
                anstream::eprintln!("(more: --limit, or the API's after={next})");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(client: &Client, run: &str, view: StatusArgs) -> Outcome {
    let run = parse_run(run)?;
    let doc = client.api.run(run).await.map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&doc)?;
    } else {
        if let (Some(owner), Some(epoch)) = (&doc.owner, doc.epoch) {
            outln!("owned by node {owner} at epoch {epoch}");
        }
        outln!(
            "{}",
            tree_table(client, std::slice::from_ref(&doc.run), &view)
        );
        render::print_output(&doc.run.output);
    }
    Ok(run_exit(doc.run.status))
}

// ---- submit, stop, steer, continue ----

#[derive(Args, Clone, Debug)]
pub struct SubmitArgs {
    /// The flow to run (flows/NAME.toml of arbord's workspace).
    #[arg(long, conflicts_with = "agent", required_unless_present = "agent")]
    pub flow: Option<String>,
    /// Run one agent on --input instead of a flow.
    #[arg(long)]
    pub agent: Option<String>,
    /// The instruction for --agent, or the flow's input (text, or JSON
    /// for a flow whose input is a schema).
    #[arg(long, conflicts_with = "input_file")]
    pub input: Option<String>,
    /// --input, read from a file.
    #[arg(long)]
    pub input_file: Option<std::path::PathBuf>,
    /// The run's budget in tokens.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub budget_tokens: Option<u64>,
    /// The run's ceiling in dollars, e.g. 0.50.
    #[arg(long)]
    pub budget_usd: Option<f64>,
    /// Makes a retry of this submission safe: the same key gives the same run.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Then follow it, as `arbor watch` does.
    #[arg(long)]
    pub watch: bool,
    /// Record its model exchanges and tool results, so it can be replayed.
    #[arg(long)]
    pub record: bool,
    /// The tenant the run is for: a token of every tenant names one
    /// (`default` if none); one of a single tenant submits for its own.
    #[arg(long)]
    pub tenant: Option<String>,
    /// At the run's ceiling: `end`, or `pause` for a top-up (`arbor budget`).
    #[arg(long, value_parser = ["end", "pause"])]
    pub on_ceiling: Option<String>,
    /// How long a pause waits for a top-up, e.g. 2h (24h if not said).
    #[arg(long)]
    pub pause_timeout: Option<String>,
    /// Its place among its tenant's queued runs: 1 starts first, 5 last
    /// (3 if not said).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub priority: Option<u8>,
}

/// `arbor replay RUN` on arbord: the replay (or rerun) queued, then
/// followed as `arbor watch` does; a dry run's plan printed as JSON.
pub async fn replay(client: &Client, run: &str, body: ReplayRun) -> Outcome {
    if body.dry_run {
        let path = format!("/v1/runs/{run}/replay");
        let value = serde_json::to_value(&body).unwrap_or_default();
        let (status, plan) = client
            .api
            .post_json(&path, &value)
            .await
            .map_err(|e| client.failed(e))?;
        if status != 200 {
            let message = plan["error"]["message"].as_str().unwrap_or("refused");
            return Err(Failed::new(exit::USAGE, message.to_string()));
        }
        client.print_json(&plan)?;
        return Ok(ExitCode::SUCCESS);
    }
    let started = client
        .api
        .replay(run, &body)
        .await
        .map_err(|e| client.failed(e))?;
    anstream::eprintln!(
        "arbor: replaying run {} as run {} (on arbord)",
        started.replay_of,
        started.id
    );
    watch(client, &started.id.to_string()).await
}

pub async fn submit(client: &Client, args: SubmitArgs) -> Outcome {
    let budget = (args.budget_tokens.is_some() || args.budget_usd.is_some()).then(|| BudgetArg {
        tokens: args.budget_tokens.map(Into::into),
        usd: args.budget_usd,
    });
    let input = match (&args.input, &args.input_file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(std::fs::read_to_string(path).map_err(|e| {
            Failed::new(exit::USAGE, format!("--input-file {}: {e}", path.display()))
        })?),
        (None, None) => None,
    };
    if args.agent.is_some() && input.is_none() {
        return Err(Failed::new(
            exit::USAGE,
            "--agent needs --input (or --input-file)",
        ));
    }
    let run = SubmitRun {
        flow: args.flow.clone(),
        agent: args.agent.clone(),
        input: input.map(serde_json::Value::String),
        budget,
        record: args.record,
        tenant: args.tenant.clone(),
        on_ceiling: args.on_ceiling.as_deref().map(|c| match c {
            "pause" => arbor_protocol::OnCeiling::Pause,
            _ => arbor_protocol::OnCeiling::End,
        }),
        pause_timeout: args.pause_timeout.clone(),
        priority: args.priority,
    };
    let created = client
        .api
        .submit(&run, args.idempotency_key.as_deref())
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&created)?;
    } else {
        outln!("{}", created.id);
        if created.replayed {
            anstream::eprintln!(
                "arbor: this key made run {} before; nothing new was queued",
                created.id
            );
        }
    }
    if args.watch {
        return watch(client, &created.id.to_string()).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// `arbor stop ID`: a run if it is one, else a step or job.
pub async fn stop(client: &Client, id: &str) -> Outcome {
    if id.parse::<RunId>().is_err() {
        return Err(Failed::new(
            exit::USAGE,
            format!("{id:?} is not a run or job id (a UUID)"),
        ));
    }
    let reply = match client.api.stop_run(id).await {
        Err(e) if e.status() == Some(404) => client.api.stop_job(id).await,
        other => other,
    }
    .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&reply)?;
    } else {
        outln!("{id}: {}", reply.state);
    }
    Ok(ExitCode::SUCCESS)
}

/// `arbor budget RUN --add-tokens N --add-usd D`.
#[derive(clap::Args, Clone, Debug)]
#[command(group = clap::ArgGroup::new("add").required(true).multiple(true))]
pub struct BudgetArgs {
    pub run: String,
    /// Tokens to add to the run's root grant.
    #[arg(long, group = "add", value_parser = clap::value_parser!(u64).range(1..))]
    pub add_tokens: Option<u64>,
    /// Dollars to add to its usd ceiling (metered in micro-dollars).
    #[arg(long, group = "add")]
    pub add_usd: Option<f64>,
}

/// `arbor budget RUN`: a top-up; prints the run's new figures.
pub async fn budget(client: &Client, args: BudgetArgs) -> Outcome {
    let usd_micros = match args.add_usd {
        None => None,
        Some(usd) => arbor_protocol::BudgetArg {
            tokens: None,
            usd: Some(usd),
        }
        .usd_micros()
        .map_err(|e| Failed::new(exit::USAGE, e.replace("budget.usd", "--add-usd")))?,
    };
    let body = arbor_service::api::TopUpBody {
        tokens: args.add_tokens,
        usd_micros,
    };
    let reply = client
        .api
        .top_up(&args.run, &body)
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&reply)?;
    } else {
        let a = reply.account;
        outln!(
            "{}: grant {} tokens, spent {}, held {}",
            reply.run,
            a.grant,
            a.spent,
            a.held
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn steer(client: &Client, job: &str, message: &str) -> Outcome {
    let reply = client
        .api
        .steer(job, message)
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&reply)?;
    } else {
        outln!("{job}: message {} queued", reply.message_id);
    }
    Ok(ExitCode::SUCCESS)
}

/// `arbor node drain ID`.
pub async fn drain_node(client: &Client, node: &str) -> Outcome {
    let reply = client
        .api
        .drain_node(node)
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&reply)?;
    } else if reply.state == "draining" {
        outln!(
            "node {}: draining (the node answering is the one asked)",
            reply.node
        );
    } else {
        outln!(
            "node {}: asked to drain; it learns it at its next lease renewal, then drains as at SIGTERM",
            reply.node
        );
    }
    Ok(ExitCode::SUCCESS)
}

// ---- approvals ----

#[derive(Args, Clone)]
pub struct AuditArgs {
    /// Only this tenant's calls.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only this caller's (a credential's name, a JWT's subject).
    #[arg(long)]
    pub subject: Option<String>,
    /// Only calls of the last DURATION (`1h`, `7d`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub since: Option<std::time::Duration>,
}

/// `arbor audit`: every page of the log, oldest first.
pub async fn audit(client: &Client, args: AuditArgs) -> Outcome {
    let since = args.since.map(|d| {
        std::time::SystemTime::now()
            .checked_sub(d)
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |t| t.as_millis() as u64)
    });
    let mut query = AuditQuery {
        tenant: args.tenant,
        subject: args.subject,
        since,
        limit: Some(1000),
        ..Default::default()
    };
    let mut entries = vec![];
    loop {
        let page = client
            .api
            .audit(&query)
            .await
            .map_err(|e| client.failed(e))?;
        entries.extend(page.entries);
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    match client.output {
        Output::Json => client.print_json(&AuditList {
            entries,
            next: None,
        })?,
        Output::Jsonl => {
            for entry in &entries {
                client.print_json(entry)?;
            }
        }
        Output::Text => {
            for e in &entries {
                let at = humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.at_ms),
                );
                outln!(
                    "{at}  {:<8} {:<3} {:<20} {:<10} {} {}  {}",
                    e.outcome.as_str(),
                    e.status,
                    e.subject,
                    e.tenant.as_deref().unwrap_or("*"),
                    e.route,
                    e.target.as_deref().unwrap_or("-"),
                    e.client.as_deref().unwrap_or("-"),
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct ApprovalsArgs {
    /// Only this run's cards.
    pub run: Option<String>,
    /// Cards in this state: pending (the default), approved, rejected,
    /// expired, cancelled, answered, ran (a notify-mode call's record), or all.
    #[arg(long, default_value = "pending")]
    pub state: String,
    /// Only the cards' ids, one a line (for scripts).
    #[arg(long)]
    pub ids: bool,
    /// With RUN: first wait until the run has a pending card (or ends).
    #[arg(long, requires = "run")]
    pub wait: bool,
}

pub async fn approvals(client: &Client, args: ApprovalsArgs) -> Outcome {
    let run = args.run.as_deref().map(parse_run).transpose()?;
    if let Some(run) = run.filter(|_| args.wait) {
        // Its event stream says when a card is asked: no polling.
        let pending = client
            .api
            .approvals(args.run.as_deref(), Some("pending"))
            .await
            .map_err(|e| client.failed(e))?;
        if pending.approvals.is_empty() {
            let mut events = client
                .api
                .events(run, true, None)
                .await
                .map_err(|e| client.failed(e))?;
            while let Some(event) = events.next_json().await {
                let (_, data) = event.map_err(|e| client.failed(e))?;
                if data["kind"]["type"] == "approval_requested" {
                    break;
                }
            }
        }
    }
    let state = (args.state != "all").then_some(args.state.as_str());
    let list = client
        .api
        .approvals(args.run.as_deref(), state)
        .await
        .map_err(|e| client.failed(e))?;
    if args.ids {
        for card in &list.approvals {
            outln!("{}", card.id);
        }
        return Ok(ExitCode::SUCCESS);
    }
    match client.output {
        Output::Json => client.print_json(&list)?,
        Output::Jsonl => {
            for card in &list.approvals {
                client.print_json(card)?;
            }
        }
        Output::Text => {
            let mut table = Table::new();
            table
                .load_style(presets::NOTHING)
                .set_content_arrangement(ContentArrangement::Disabled)
                .set_header(vec!["CARD", "STATE", "TOOL", "LINEAGE", "DEADLINE", "ARGS"]);
            if client.colour {
                table.enforce_styling();
            } else {
                table.force_no_tty();
            }
            for card in &list.approvals {
                let mut args = card.args.to_string();
                if args.len() > 60 {
                    let mut end = 57;
                    while !args.is_char_boundary(end) {
                        end -= 1;
                    }
                    args.truncate(end);
                    args.push_str("...");
                }
                table.add_row(vec![
                    Cell::new(card.id),
                    Cell::new(card.state),
                    Cell::new(&card.tool),
                    Cell::new(card.lineage.join(" > ")),
                    Cell::new(&card.deadline),
                    Cell::new(args),
                ]);
            }
            if list.approvals.is_empty() {
                anstream::eprintln!("arbor: no {} approval cards", args.state);
            } else {
                outln!("{table}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn approve(
    client: &Client,
    card: &str,
    reason: Option<String>,
    args: Option<String>,
) -> Outcome {
    let args = args
        .map(|text| {
            serde_json::from_str::<serde_json::Value>(&text)
                .map_err(|e| Failed::new(exit::USAGE, format!("--args is not JSON: {e}")))
        })
        .transpose()?;
    let body = DecisionBody {
        decision: if args.is_some() {
            arbor_protocol::Verdict::Edit
        } else {
            arbor_protocol::Verdict::Approve
        },
        reason,
        args,
        answer: None,
    };
    decide(client, card, body).await
}

pub async fn reject(client: &Client, card: &str, reason: &str) -> Outcome {
    let body = DecisionBody {
        decision: arbor_protocol::Verdict::Reject,
        reason: Some(reason.to_string()),
        args: None,
        answer: None,
    };
    decide(client, card, body).await
}

/// `arbor answer CARD TEXT`: a question's answer (I-60).
pub async fn answer(client: &Client, card: &str, text: &str) -> Outcome {
    let body = DecisionBody {
        decision: arbor_protocol::Verdict::Answer,
        reason: None,
        args: None,
        answer: Some(text.to_string()),
    };
    decide(client, card, body).await
}

async fn decide(client: &Client, card: &str, body: DecisionBody) -> Outcome {
    if card.parse::<arbor_protocol::CardId>().is_err() {
        return Err(Failed::new(
            exit::USAGE,
            format!("{card:?} is not an approval card id (a UUID; `arbor approvals` lists them)"),
        ));
    }
    let decided = client
        .api
        .decide(card, &body)
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&decided)?;
    } else {
        let by = decided.decision.as_ref().map_or("", |d| d.by.as_str());
        outln!("{card}: {} by {by}", decided.state);
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn continue_job(client: &Client, job: &str) -> Outcome {
    let reply = client
        .api
        .continue_job(job)
        .await
        .map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&reply)?;
    } else {
        outln!("{}", reply.run);
        anstream::eprintln!("arbor: {job} continues as run {}", reply.run);
    }
    Ok(ExitCode::SUCCESS)
}

// ---- events, watch ----

/// Reads the run's event stream, calling `each` for every event, resuming
/// from the last id if the connection drops. Ends when the stream does.
async fn follow_events(
    client: &Client,
    run: RunId,
    follow: bool,
    mut each: impl FnMut(&StreamEvent) -> Result<(), Failed>,
) -> Result<(), Failed> {
    let mut last: u64 = 0;
    let mut reconnects = 0;
    loop {
        let after = (last > 0).then_some(last);
        let mut stream = match client.api.events(run, follow, after).await {
            Ok(stream) => stream,
            // arbord is restarting under a watcher: try again, from the last event.
            Err(e @ api::Error::Unreachable { .. }) if reconnects > 0 && reconnects <= 20 => {
                drop(e);
                reconnects += 1;
                tokio::time::sleep(Duration::from_millis(200 * reconnects)).await;
                continue;
            }
            Err(e) => return Err(client.failed(e)),
        };
        let mut ended = false;
        let mut broken = false;
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(event) => event,
                Err(api::Error::Broken(_)) => {
                    broken = true;
                    break;
                }
                Err(e) => return Err(client.failed(e)),
            };
            last = event.index;
            ended = matches!(
                event.event.kind,
                arbor_protocol::EventKind::RunFinished { .. }
            );
            each(&event)?;
        }
        if ended || !follow {
            return Ok(());
        }
        // The stream ended early (the service dropped a slow reader, or
        // restarted): go on from the last event seen.
        reconnects += 1;
        if reconnects > 20 {
            return Err(Failed::new(
                exit::UNREACHABLE,
                format!(
                    "the event stream of {run} kept breaking{}",
                    if broken { "" } else { " off" }
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(200 * reconnects)).await;
    }
}

fn event_line(event: &Event) -> String {
    let kind = serde_json::to_value(&event.kind).unwrap_or_default();
    let name = kind["type"].as_str().unwrap_or("event").to_string();
    let who = kind["id"]
        .as_str()
        .map(|s| format!(" {s}"))
        .unwrap_or_default();
    let ended = |status: &Status, reason: &Option<String>| {
        let reason = reason.as_ref().map(|r| format!(": {r}"));
        format!(" {status}{}", reason.unwrap_or_default())
    };
    use arbor_protocol::EventKind;
    let detail = match &event.kind {
        EventKind::JobFinished { result, reason, .. } => ended(&result.status, reason),
        EventKind::RunFinished { status, reason, .. } => ended(status, reason),
        EventKind::ToolCalled { tool, ok, .. } => {
            format!(" {tool} {}", if *ok { "ok" } else { "refused or failed" })
        }
        EventKind::RetryWaiting {
            label,
            attempt,
            class,
            until_ms,
            ..
        } => format!(
            " {label} failed ({class}): attempt {attempt} at {}",
            arbor_protocol::approval::rfc3339(*until_ms)
        ),
        EventKind::ModelFallback {
            from, to, class, ..
        } => format!(" {from} walled ({class}): on to {to}"),
        EventKind::NeedsDecision { label, why, .. } => {
            format!(" {label} waits for a person: {why}")
        }
        EventKind::IterationChecked {
            label,
            iteration,
            passed,
            issues,
            ended,
            ..
        } => {
            let outcome = match (passed, ended) {
                (true, _) => "passed".to_string(),
                (false, Some(why)) => format!("did not pass; the loop ends: {why}"),
                (false, None) => format!("did not pass ({} issues); it runs again", issues.len()),
            };
            format!(" {label} iteration {iteration} {outcome}")
        }
        EventKind::Reviewed {
            accept,
            missing,
            failed,
            ..
        } => match (accept, failed) {
            (_, Some(why)) => format!(" not reviewed: {why}"),
            (true, None) => " accepted".into(),
            (false, None) => format!(" {} missing; the last group runs once more", missing.len()),
        },
        EventKind::BudgetReached {
            needs, deadline_ms, ..
        } => format!(
            " the run pauses at its ceiling: it needs {} tokens{} more (`arbor budget`), until {}",
            needs.tokens,
            match needs.usd_micros {
                0 => String::new(),
                micros => format!(" and {micros} micro-dollars"),
            },
            arbor_protocol::approval::rfc3339(*deadline_ms)
        ),
        EventKind::BudgetPauseEnded { expired: true } => {
            " its deadline passed without a top-up: the waiting steps end".into()
        }
        EventKind::BudgetPauseEnded { expired: false } => " topped up: the run goes on".into(),
        EventKind::PeerQueued { from, to, .. } => format!(" {from} -> {to}"),
        EventKind::PeerDelivered { from, turn, .. } => format!(" from {from}, read in turn {turn}"),
        EventKind::RunStarted { .. }
        | EventKind::RunResumed { .. }
        | EventKind::Recovered { .. }
        | EventKind::JobSpawned { .. }
        | EventKind::JobRunning { .. }
        | EventKind::AccountChanged { .. }
        | EventKind::WindDown { .. }
        | EventKind::ModelCalled { .. }
        | EventKind::ContextCompacted { .. }
        | EventKind::ContextPressure { .. }
        | EventKind::BudgetOverrun { .. }
        | EventKind::ToolStarted { .. }
        | EventKind::McpServer { .. }
        | EventKind::Refused { .. }
        | EventKind::SteerQueued { .. }
        | EventKind::SteerDelivered { .. }
        | EventKind::SteerDiscarded { .. }
        | EventKind::ApprovalRequested { .. }
        | EventKind::ApprovalExpiring { .. }
        | EventKind::ApprovalDecided { .. } => String::new(),
    };
    format!("{name}{who}{detail}")
}

pub async fn events(client: &Client, run: &str, follow: bool) -> Outcome {
    let run = parse_run(run)?;
    let mut all = vec![];
    let output = client.output;
    follow_events(client, run, follow, |e| {
        match output {
            Output::Json => all.push(e.clone()),
            Output::Jsonl => client.print_json(e)?,
            Output::Text => outln_styled!("{:>5}  {}", e.index, event_line(&e.event)),
        }
        Ok(())
    })
    .await?;
    if output == Output::Json {
        client.print_json(&all)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Follows the run's events, folding them into its tree: redrawn in place
/// on a terminal, one line per change otherwise. Exits by how it ended.
pub async fn watch(client: &Client, run: &str) -> Outcome {
    let run = parse_run(run)?;
    let mut tree = Tree::new(run);
    let live = client.output == Output::Text && std::io::stdout().is_terminal();
    let mut view = render::Progress::new(live);
    let output = client.output;
    // The stream is read beside a redraw timer: the tree is drawn at most
    // every REDRAW_EVERY (`render::Redraw`), and a change that came just
    // after a draw is drawn when the timer fires, not at the next event.
    let (events, mut incoming) = tokio::sync::mpsc::unbounded_channel();
    let follow = follow_events(client, run, true, move |e| {
        let _ = events.send(e.clone());
        Ok(())
    });
    tokio::pin!(follow);
    let mut redraw = render::Redraw::default();
    let take =
        |tree: &mut Tree, e: StreamEvent, redraw: &mut render::Redraw| -> Result<(), Failed> {
            tree.apply(&e.event);
            if output == Output::Jsonl {
                client.print_json(&e)?;
            }
            redraw.changed();
            Ok(())
        };
    let followed = loop {
        tokio::select! {
            followed = &mut follow => break followed,
            Some(e) = incoming.recv() => take(&mut tree, e, &mut redraw)?,
            _ = tokio::time::sleep_until(redraw.next_at()),
                if output == Output::Text && redraw.pending() => {}
        }
        if output == Output::Text && redraw.take_due() {
            view.show(&tree);
        }
    };
    // What the stream delivered before it ended.
    while let Ok(e) = incoming.try_recv() {
        take(&mut tree, e, &mut redraw)?;
    }
    followed?;
    if output == Output::Text && redraw.pending() {
        view.show(&tree);
    }
    match output {
        Output::Text => view.finish(&tree),
        Output::Json => client.print_json(&serde_json::json!({ "run": tree.root() }))?,
        Output::Jsonl => {}
    }
    Ok(run_exit(tree.run_status()))
}

#[derive(Clone, clap::Subcommand)]
pub enum ScheduleCommand {
    /// Its ticks start nothing, and are not caught up when it is unpaused.
    Pause { name: String },
    /// It starts runs again from its next tick on.
    Unpause { name: String },
    /// Start one run of it now, whatever its overlap; prints the run's id.
    Trigger { name: String },
    /// Start a run for each of its ticks from FROM to TO (RFC 3339, both
    /// included) that has not started one.
    Backfill {
        name: String,
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
    },
}

/// `arbor schedules`.
pub async fn schedules(client: &Client) -> Outcome {
    let list = client.api.schedules().await.map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&list)?;
        return Ok(ExitCode::SUCCESS);
    }
    if list.schedules.is_empty() {
        outln!("no schedules: no flow file has a [[schedule]]");
    }
    for s in &list.schedules {
        let next = match (&s.next_fire_at, s.paused) {
            (_, true) => "paused".to_string(),
            (Some(at), false) => format!("next {at}"),
            (None, false) => "never again".to_string(),
        };
        outln!(
            "{} · flow {} · {:?} {} · {next} · {} running",
            s.name,
            s.flow,
            s.cron,
            s.timezone,
            s.active.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `arbor schedule pause|unpause|trigger|backfill NAME`.
pub async fn schedule(client: &Client, command: ScheduleCommand) -> Outcome {
    let failed = |e| client.failed(e);
    match command {
        ScheduleCommand::Pause { name } => {
            let view = client
                .api
                .pause_schedule(&name, true)
                .await
                .map_err(failed)?;
            print_or(client, &view, || format!("schedule {name}: paused"))
        }
        ScheduleCommand::Unpause { name } => {
            let view = client
                .api
                .pause_schedule(&name, false)
                .await
                .map_err(failed)?;
            let next = view.next_fire_at.clone().unwrap_or_else(|| "never".into());
            print_or(client, &view, || {
                format!("schedule {name}: unpaused; next run {next}")
            })
        }
        ScheduleCommand::Trigger { name } => {
            let created = client.api.trigger_schedule(&name).await.map_err(failed)?;
            print_or(client, &created, || created.id.to_string())
        }
        ScheduleCommand::Backfill { name, from, to } => {
            let body = arbor_service::api::BackfillBody { from, to };
            let result = client
                .api
                .backfill_schedule(&name, &body)
                .await
                .map_err(failed)?;
            print_or(client, &result, || {
                let mut lines: Vec<String> = result
                    .started
                    .iter()
                    .map(|t| format!("{} started {}", t.tick, t.run))
                    .collect();
                lines.extend(
                    result
                        .already
                        .iter()
                        .map(|t| format!("{} had started {} before", t.tick, t.run)),
                );
                if lines.is_empty() {
                    lines.push(format!("schedule {name} has no tick in that span"));
                }
                lines.join("\n")
            })
        }
    }
}

/// `value` as JSON when asked, else `text`.
fn print_or(
    client: &Client,
    value: &impl serde::Serialize,
    text: impl FnOnce() -> String,
) -> Outcome {
    if client.output != Output::Text {
        client.print_json(value)?;
    } else {
        outln!("{}", text());
    }
    Ok(ExitCode::SUCCESS)
}

/// `arbor reload`.
pub async fn reload(client: &Client) -> Outcome {
    let deployed = client.api.reload().await.map_err(|e| client.failed(e))?;
    deployed_line(client, &deployed)
}

/// `arbor rollback VERSION`.
pub async fn rollback(client: &Client, version: &str) -> Outcome {
    let deployed = client
        .api
        .rollback(version)
        .await
        .map_err(|e| client.failed(e))?;
    deployed_line(client, &deployed)
}

fn deployed_line(client: &Client, d: &arbor_service::api::Deployment) -> Outcome {
    print_or(client, d, || {
        if d.changed {
            format!(
                "version {} is current (was {}): new runs take it; running runs keep theirs",
                d.version, d.previous
            )
        } else {
            format!("version {} is current already: nothing changed", d.version)
        }
    })
}

/// `arbor versions`.
pub async fn versions(client: &Client) -> Outcome {
    let list = client.api.versions().await.map_err(|e| client.failed(e))?;
    if client.output != Output::Text {
        client.print_json(&list)?;
        return Ok(ExitCode::SUCCESS);
    }
    for v in &list.versions {
        let when =
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(v.created_at_ms));
        let mark = if v.current { " (current)" } else { "" };
        outln!("{}{mark} · kept {when} · {} files", v.id, v.files.len());
    }
    Ok(ExitCode::SUCCESS)
}
