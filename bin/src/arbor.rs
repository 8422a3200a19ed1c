//! `arbor`: the command line. `arbor run DIR` runs a flow on an embedded
//! node; `status`, `runs`, `show`, `watch`, `submit`, `stop`, `steer`,
//! `continue`, `approvals`, `approve`, `reject`, `answer` and `events` talk to arbord
//! (`client.rs`).
//!
//! Exit codes: 0 ok (a run it ran or waited for is done); 1 a run failed or
//! was stopped, or the service refused as a conflict; 2 bad usage or bad
//! input, with a one-line reason on stderr; 3 no such run or job (for
//! `arbor run` and `arbor continue`: the run waits for a person to continue
//! a step a crash interrupted, I-57); 4 arbord unreachable or shutting
//! down; 5 the token was refused.

/// `println!` for what `arbor` prints: a reader that went away (`arbor runs
/// | head`) ends the printing, not the process with a panic, and a run
/// being followed goes on to its end and its exit status.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `outln!` through anstream, which drops the styles where they cannot show.
macro_rules! outln_styled {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(anstream::stdout().lock(), $($arg)*);
    }};
}

mod ask;
mod client;
mod journal;
mod new;
mod render;
mod replay;
mod token;

use anyhow::Context;
use arbor_protocol::WaitingView;
use arbor_protocol::{RunSpec, Status, Tree};
use arbor_runtime::{EmbeddedNode, Models, Workspace};
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "arbor", version, about = "Run and inspect trees of AI agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    conn: client::Conn,
}

#[derive(Subcommand)]
enum Command {
    /// Run a flow (or one agent) of the workspace DIR on an embedded node.
    /// On a data dir a crash left behind, it first recovers, and resumes the
    /// interrupted run of the same flow instead of starting a new one.
    Run(RunArgs),
    /// Continue a job a restart interrupted, as its next attempt: on arbord,
    /// or with --data-dir on an embedded node.
    Continue(ContinueArgs),
    /// Replay a recorded run as a new run whose model is the recording
    /// (docs/replay.md): on an embedded node of a workspace (--workspace or
    /// --data-dir; exit 0 when it equals its recording), an export
    /// (--fixture FILE DIR), or on arbord (neither). --rerun-failed reruns a
    /// failed run, keeping what worked.
    Replay(replay::ReplayArgs),
    /// Write a recorded run's recording as one JSON document (a fixture).
    Export(replay::ExportArgs),
    /// Check or read a node's journal.
    #[command(subcommand)]
    Journal(JournalCommand),
    /// The nodes of a shared journal.
    #[command(subcommand)]
    Node(NodeCommand),
    /// A node's named credentials, each with a tenant and roles: add, list,
    /// revoke (offline, on its data dir).
    #[command(subcommand)]
    Token(token::TokenCommand),
    /// Lint a workspace: every problem in one pass (exit 1 if any is an error).
    Check { dir: PathBuf },
    /// Write a new agents/NAME/agent.md (every key commented) or
    /// skills/NAME/SKILL.md in a workspace; it loads as it is.
    New {
        kind: new::Kind,
        name: String,
        /// The workspace folder.
        #[arg(long, default_value = ".")]
        workspace: PathBuf,
    },
    /// The first request a step of AGENT would send, as its provider would
    /// receive it: system prompt and roster, messages, tools with their
    /// schemas, settings (`-o json`: exactly the body). Keys are never in it.
    Prompt(PromptArgs),
    /// arbord's tree: every run running or queued, its steps and jobs, their accounts.
    Status(client::StatusArgs),
    /// Runs arbord knows, newest first.
    Runs(client::RunsArgs),
    /// One run's tree and output.
    Show {
        run: String,
        #[command(flatten)]
        view: client::StatusArgs,
    },
    /// Follow a run live until it ends (exit 0 done, 1 failed or stopped).
    Watch { run: String },
    /// Submit a run to arbord; prints its id.
    Submit(client::SubmitArgs),
    /// Stop a run (its whole tree) or one step or job (its subtree).
    Stop { id: String },
    /// Send a running step or job a message.
    Steer { job: String, message: String },
    /// Raise a running run's ceiling (a top-up): tokens, dollars or both.
    Budget(client::BudgetArgs),
    /// What arbord throttles: each provider's rate windows (rpm, tpm), their
    /// limits and what the minute ending now holds.
    Limits,
    /// Read the workspace's files again and deploy them: new runs take
    /// them, running runs keep the version they were admitted with.
    Reload,
    /// The workspace versions arbord's journal keeps, and the current one.
    Versions,
    /// Make an earlier workspace version current again (new runs take it).
    Rollback { version: String },
    /// The workspace's schedules: each one's cron, zone, whether it is
    /// paused and when it next starts a run.
    Schedules,
    /// Pause, unpause, trigger or backfill one schedule.
    #[command(subcommand)]
    Schedule(client::ScheduleCommand),
    /// Approval cards waiting for a person (of one run, or all); --state for others.
    Approvals(client::ApprovalsArgs),
    /// The audit log: who changed what, and who was refused (an admin's;
    /// -o jsonl to export it whole).
    Audit(client::AuditArgs),
    /// Approve a pending approval card: its call runs.
    Approve {
        card: String,
        /// Why (recorded with the decision).
        #[arg(long)]
        reason: Option<String>,
        /// Run the call with these arguments instead (JSON), checked against the tool's.
        #[arg(long)]
        args: Option<String>,
    },
    /// Reject a pending approval card: its call does not run, and the agent reads the reason.
    Reject {
        card: String,
        #[arg(long)]
        reason: String,
    },
    /// Answer an agent's question (a card of kind question): the agent reads the answer.
    Answer { card: String, text: String },
    /// A run's events; with --follow, until it ends.
    Events {
        run: String,
        #[arg(long)]
        follow: bool,
    },
}

#[derive(Args)]
struct ContinueArgs {
    /// The interrupted step's or job's id.
    job: String,
    /// An embedded node's data dir (holds `journal/`); without it, arbord continues the job.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The workspace the job's agent comes from (default: the data dir's parent).
    #[arg(long)]
    workspace: Option<PathBuf>,
    /// Print the continuation's tree as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum NodeCommand {
    /// Drain a node (any node of the journal answers): it takes no more
    /// runs, lets its running ones finish for its `drain` time, hands the
    /// rest to the other nodes, and exits 0.
    Drain { id: String },
}

#[derive(Subcommand)]
enum JournalCommand {
    /// Decode every record and check every account's conservation; exit 1
    /// and list what is wrong if anything is.
    Verify {
        #[command(flatten)]
        place: journal::Place,
    },
    /// Print runs, their steps and jobs, and their ledger entries.
    Inspect {
        #[command(flatten)]
        place: journal::Place,
        /// Only this run, with its jobs and ledger.
        #[arg(long)]
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct RunArgs {
    /// The workspace: arbor.toml, agents/NAME/agent.md, flows/NAME.toml.
    dir: PathBuf,
    /// The flow to run (flows/NAME.toml). Optional when the workspace has exactly one.
    #[arg(long, conflicts_with = "agent")]
    flow: Option<String>,
    /// Run one agent on --input instead of a flow.
    #[arg(long)]
    agent: Option<String>,
    /// The instruction for --agent, or the flow's input (text, or JSON
    /// for a flow whose input is a schema).
    #[arg(long, conflicts_with = "input_file")]
    input: Option<String>,
    /// --input, read from a file.
    #[arg(long)]
    input_file: Option<PathBuf>,
    /// The run's budget in tokens (overrides the flow and arbor.toml).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    budget_tokens: Option<u64>,
    /// The run's ceiling in dollars, e.g. 0.50 (overrides the flow and
    /// arbor.toml); every model it reaches needs a price.
    #[arg(long = "budget-usd", value_parser = parse_usd)]
    budget_usd_micros: Option<u64>,
    /// Print one JSON document (the run's tree) on stdout and nothing else there.
    #[arg(long)]
    json: bool,
    /// Where the journal and the workdirs live (default: DIR/.arbor).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// This node's id in a shared journal (`[journal] backend = "postgres"`;
    /// default: ARBOR_NODE_ID, else the host's name).
    #[arg(long, value_parser = arbor_runtime::workspace::parse_node_id)]
    node_id: Option<String>,
    /// Record the run's model exchanges and tool results, so it can be
    /// replayed (as `[record] models = true` does for every run).
    #[arg(long)]
    record: bool,
}

/// Bad usage or bad input: exit 2.
struct BadInput(String);

/// mimalloc, not glibc's malloc: a job's actors allocate on one thread and
/// the journal frees on another, and glibc's arena locks made that a tenth
/// of a wide fan-out's CPU (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ARBOR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Records of the `log` crate (sled's, hakoniwa's) stop at debug: sled
    // logs at trace from thread-local destructors at exit, after tracing's
    // own thread-locals are gone, and that aborts the process.
    log::set_max_level(log::max_level().min(log::LevelFilter::Debug));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("arbor: could not start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let conn = cli.conn.clone();
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Replay(args) => replay::replay(args, &conn).await,
            Command::Export(args) => replay::export(args, conn.output.as_deref()),
            Command::Continue(args) if args.data_dir.is_some() => continue_job(args).await,
            Command::Continue(args) => {
                with_client(&conn, |c| Box::pin(client::continue_job(c, &args.job))).await
            }
            Command::Prompt(args) => match conn.format() {
                Ok(output) => prompt(&args, output).await,
                Err(failed) => Err(Failure::Client(failed)),
            },
            Command::New {
                kind,
                name,
                workspace,
            } => match new::write(kind, &name, &workspace) {
                Ok(path) => {
                    outln!("{}", path.display());
                    Ok(ExitCode::SUCCESS)
                }
                Err(why) => Err(bad(why)),
            },
            Command::Token(command) if command.data_dir().is_some() => conn
                .format()
                .and_then(|output| token::run(command, output))
                .map_err(Failure::Client),
            Command::Token(command) => {
                let command = std::sync::Mutex::new(Some(command));
                with_client(&conn, |c| {
                    let command = command.lock().ok().and_then(|mut c| c.take());
                    Box::pin(async move {
                        match command {
                            Some(command) => token::remote(c, command).await,
                            None => Ok(ExitCode::SUCCESS),
                        }
                    })
                })
                .await
            }
            Command::Check { dir } => match conn.format() {
                Ok(output) => Ok(check(&dir, output).await),
                Err(failed) => Err(Failure::Client(failed)),
            },
            Command::Status(args) => {
                with_client(&conn, |c| Box::pin(client::status(c, args))).await
            }
            Command::Runs(args) => with_client(&conn, |c| Box::pin(client::runs(c, args))).await,
            Command::Show { run, view } => {
                with_client(&conn, |c| Box::pin(client::show(c, &run, view))).await
            }
            Command::Watch { run } => {
                with_client(&conn, |c| Box::pin(client::watch(c, &run))).await
            }
            Command::Submit(args) => {
                with_client(&conn, |c| Box::pin(client::submit(c, args))).await
            }
            Command::Stop { id } => with_client(&conn, |c| Box::pin(client::stop(c, &id))).await,
            Command::Steer { job, message } => {
                with_client(&conn, |c| Box::pin(client::steer(c, &job, &message))).await
            }
            Command::Budget(args) => {
                with_client(&conn, |c| Box::pin(client::budget(c, args.clone()))).await
            }
            Command::Limits => with_client(&conn, |c| Box::pin(client::limits(c))).await,
            Command::Reload => with_client(&conn, |c| Box::pin(client::reload(c))).await,
            Command::Versions => with_client(&conn, |c| Box::pin(client::versions(c))).await,
            Command::Rollback { version } => {
                with_client(&conn, |c| Box::pin(client::rollback(c, &version))).await
            }
            Command::Schedules => with_client(&conn, |c| Box::pin(client::schedules(c))).await,
            Command::Schedule(command) => {
                with_client(&conn, |c| Box::pin(client::schedule(c, command.clone()))).await
            }
            Command::Approvals(args) => {
                with_client(&conn, |c| Box::pin(client::approvals(c, args))).await
            }
            Command::Audit(args) => {
                with_client(&conn, |c| Box::pin(client::audit(c, args.clone()))).await
            }
            Command::Approve { card, reason, args } => {
                with_client(&conn, |c| {
                    Box::pin(client::approve(c, &card, reason.clone(), args.clone()))
                })
                .await
            }
            Command::Reject { card, reason } => {
                with_client(&conn, |c| Box::pin(client::reject(c, &card, &reason))).await
            }
            Command::Answer { card, text } => {
                with_client(&conn, |c| Box::pin(client::answer(c, &card, &text))).await
            }
            Command::Events { run, follow } => {
                with_client(&conn, |c| Box::pin(client::events(c, &run, follow))).await
            }
            Command::Node(NodeCommand::Drain { id }) => {
                with_client(&conn, |c| Box::pin(client::drain_node(c, &id))).await
            }
            Command::Journal(JournalCommand::Verify { place }) => journal::verify(&place),
            Command::Journal(JournalCommand::Inspect { place, run, json }) => {
                journal::inspect(&place, run.as_deref(), json)
            }
        }
    });
    if result.is_ok() {
        // The process exits next, its work done (a node it ran was shut down
        // and its journal synced): its threads and what they hold are the
        // exit's to reclaim. Taking the runtime apart first took a few ms.
        std::mem::forget(runtime);
    }
    match result {
        Ok(code) => code,
        Err(Failure::Bad(BadInput(reason))) => {
            eprintln!("arbor: {reason}");
            ExitCode::from(2)
        }
        Err(Failure::Other(e)) => {
            eprintln!("arbor: {e:#}");
            ExitCode::from(1)
        }
        Err(Failure::Client(f)) => {
            eprintln!("arbor: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

enum Failure {
    Bad(BadInput),
    Other(anyhow::Error),
    /// A status-CLI command, with its own exit code.
    Client(client::Failed),
}

/// Runs one status-CLI command with a client for arbord.
async fn with_client<'a>(
    conn: &client::Conn,
    command: impl FnOnce(
        &'a client::Client,
    )
        -> std::pin::Pin<Box<dyn std::future::Future<Output = client::Outcome> + 'a>>,
) -> Result<ExitCode, Failure> {
    let client = client::Client::new(conn).map_err(Failure::Client)?;
    // Leaked for the command's lifetime: one client per process.
    let client: &'a client::Client = Box::leak(Box::new(client));
    command(client).await.map_err(Failure::Client)
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

/// `--budget-usd`: dollars, as whole micro-dollars (I-09: more than 0).
fn parse_usd(text: &str) -> Result<u64, String> {
    let usd: f64 = text
        .trim()
        .trim_start_matches('$')
        .parse()
        .map_err(|_| format!("{text:?} is not an amount of dollars"))?;
    arbor_protocol::BudgetArg {
        tokens: None,
        usd: Some(usd),
    }
    .usd_micros()
    .map(|m| m.unwrap_or_default())
}

fn bad(reason: impl std::fmt::Display) -> Failure {
    Failure::Bad(BadInput(reason.to_string()))
}

async fn run(args: RunArgs) -> Result<ExitCode, Failure> {
    let mut workspace = Workspace::load(&args.dir).map_err(bad)?;
    workspace.config.journal.name_node(args.node_id.clone());
    let input = match (&args.input, &args.input_file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| bad(format!("--input-file {}: {e}", path.display())))?,
        ),
        (None, None) => None,
    };
    let typed = input.clone().map(serde_json::Value::String);
    let spec: RunSpec = match (&args.flow, &args.agent, &input) {
        (Some(flow), _, _) => workspace
            .flow_run_with(flow, args.budget_tokens, typed.as_ref())
            .map_err(bad)?,
        (None, Some(agent), Some(input)) => workspace
            .agent_run(agent, input, args.budget_tokens)
            .map_err(bad)?,
        (None, Some(_), None) => return Err(bad("--agent needs --input (or --input-file)")),
        (None, None, _) => match workspace.flows.keys().collect::<Vec<_>>().as_slice() {
            [only] => workspace
                .flow_run_with(only, args.budget_tokens, typed.as_ref())
                .map_err(bad)?,
            [] => {
                return Err(bad(
                    "the workspace has no flows: give --agent NAME --input TEXT",
                ));
            }
            many => {
                let names: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
                return Err(bad(format!(
                    "the workspace has several flows ({}): choose one with --flow",
                    names.join(", ")
                )));
            }
        },
    };
    let spec = match args.budget_usd_micros {
        Some(micros) => workspace.with_usd_ceiling(spec, micros).map_err(bad)?,
        None => spec,
    };
    let mut spec = if args.record {
        workspace.recording(spec, true)
    } else {
        spec
    };
    // A budget pause waits for a person's top-up: only one at this
    // terminal can give it (`ask`); without one the run ends at its ceiling.
    if !std::io::stdin().is_terminal() {
        spec.pause = None;
    }
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| args.dir.join(".arbor"));
    // Resume only the very same run: same flow, same steps and instructions
    // (an `--agent` run with a new `--input` is a new run).
    let wanted = spec.clone();
    let node = EmbeddedNode::start_resuming(
        &workspace,
        &data_dir,
        Arc::new(Models::new(&workspace.config.providers)),
        |s, _| s.flow == wanted.flow && s.groups == wanted.groups,
    )
    .await
    .map_err(|e| bad(format!("{}: {e}", data_dir.display())))?;
    report_recovery(&node);
    report_sandbox(&node);
    // A crash left this flow's run unfinished: it was resumed; follow it.
    let record = spec.record;
    let run = match node.resumed().last() {
        Some((id, _)) => {
            eprintln!("arbor: resuming run {id}, interrupted by a restart");
            *id
        }
        None => node.start_run(spec).await.map_err(bad)?,
    };
    if record {
        eprintln!(
            "arbor: recording run {run}; replay it with `arbor replay {run} --workspace {}`",
            args.dir.display()
        );
    }
    // On a shared journal, a node that loses its lease stops its runs and
    // commits nothing more: nothing of this run's end can be told here.
    let lost = node.lease_lost();
    tokio::select! {
        followed = follow(node, run, args.json) => followed,
        why = lost => {
            eprintln!("arbor: this node lost its lease and stopped run {run} here: {why}");
            Ok(ExitCode::from(1))
        }
    }
}

/// Says once per card, on stderr, that a job of an embedded run waits for
/// a person: nobody can decide it from outside this process, so it waits
/// until its deadline (the live view shows the same on the job's line).
fn tell_new_cards(
    node: &EmbeddedNode,
    run: arbor_protocol::RunId,
    told: &mut std::collections::HashSet<arbor_protocol::CardId>,
) {
    let Ok(cards) = node.approvals(Some(run), Some(arbor_protocol::CardState::Pending)) else {
        return;
    };
    for card in cards {
        if told.insert(card.id) {
            eprintln!(
                "arbor: {} waits for approval of {} (card {}); an embedded run has no one to \
                 ask, so it expires at {}: serve the workspace with arbord to decide it",
                card.lineage.join(" > "),
                card.tool,
                card.id,
                arbor_protocol::approval::rfc3339(card.deadline_ms)
            );
        }
    }
}

/// The node's sandbox posture, on every run: one line, loud when unsealed.
fn report_sandbox(node: &EmbeddedNode) {
    let posture = node.sandbox();
    if posture.sealed {
        eprintln!("arbor: sandbox {}", posture.detail);
    } else {
        eprintln!("arbor: WARNING: sandbox {}", posture.detail);
    }
}

fn report_recovery(node: &EmbeddedNode) {
    let r = node.recovery();
    if !r.jobs_failed.is_empty() || !r.processes_killed.is_empty() {
        eprintln!(
            "arbor: recovered from a crash: {} jobs failed as interrupted, {} process groups killed, {} grants released",
            r.jobs_failed.len(),
            r.processes_killed.len(),
            r.grants_released
        );
    }
    for u in &r.undecodable {
        eprintln!(
            "arbor: undecodable record in {} at {}: {}",
            u.tree, u.key_hex, u.error
        );
    }
    for b in &r.breaches {
        eprintln!("arbor: conservation breach: {b}");
    }
}

/// `arbor check DIR`: findings on stdout, errors first; exit 1 on an error.
#[derive(Args)]
struct PromptArgs {
    /// The workspace.
    dir: PathBuf,
    /// The agent whose step it is.
    agent: String,
    /// The request it is asked (the step's instruction).
    #[arg(long, default_value = "Begin.")]
    input: String,
    /// Show it in this wire format instead of its provider's.
    #[arg(long, value_enum)]
    wire: Option<WireArg>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum WireArg {
    Openai,
    Anthropic,
}

async fn prompt(args: &PromptArgs, output: client::Output) -> Result<ExitCode, Failure> {
    use arbor_runtime::ProviderKind;
    let workspace = Workspace::load(&args.dir).map_err(bad)?;
    let wire = args.wire.map(|w| match w {
        WireArg::Openai => ProviderKind::Openai,
        WireArg::Anthropic => ProviderKind::Anthropic,
    });
    let body = arbor_runtime::prompt::first_body(&workspace, &args.agent, &args.input, wire)
        .await
        .map_err(bad)?;
    match output {
        client::Output::Text => outln!("{}", render::request_body(&body)),
        client::Output::Json | client::Output::Jsonl => {
            outln!(
                "{}",
                serde_json::to_string_pretty(&body).unwrap_or_default()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn check(dir: &std::path::Path, output: client::Output) -> ExitCode {
    use arbor_runtime::check::Level;
    let findings = arbor_runtime::check::check_servers(dir).await;
    let count = |level| findings.iter().filter(|f| f.level == level).count();
    let (errors, warnings, info) = (
        count(Level::Error),
        count(Level::Warning),
        count(Level::Info),
    );
    match output {
        client::Output::Text => {
            for f in &findings {
                outln!("{}: {}: {}", f.level.as_str(), f.file, f.message);
            }
            eprintln!("arbor check: {errors} errors, {warnings} warnings, {info} notes");
        }
        client::Output::Json => outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "findings": findings, "errors": errors, "warnings": warnings, "info": info
            }))
            .unwrap_or_default()
        ),
        client::Output::Jsonl => {
            for f in &findings {
                outln!("{}", serde_json::to_string(f).unwrap_or_default());
            }
        }
    }
    if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

async fn continue_job(args: ContinueArgs) -> Result<ExitCode, Failure> {
    let job = args
        .job
        .parse()
        .map_err(|_| bad(format!("{:?} is not a job id", args.job)))?;
    let data_dir = args.data_dir.clone().unwrap_or_default();
    let dir = match args.workspace {
        Some(dir) => dir,
        None => data_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|p| p.to_path_buf())
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    let workspace = Workspace::load(&dir).map_err(bad)?;
    // Interrupted runs stay as recovery left them, but for the one whose
    // step this is, if it waits for this decision (I-57): it goes on.
    let node = EmbeddedNode::start_resuming(
        &workspace,
        &data_dir,
        Arc::new(Models::new(&workspace.config.providers)),
        |spec, plan| {
            plan.interrupted.iter().any(|(label, j)| {
                *j == job
                    && spec.step(label).is_some_and(|step| {
                        arbor_protocol::needs_decision(
                            step,
                            |name| workspace.agents.get(name),
                            |name| workspace.config.mcp.get(name).map(|s| s.as_ref()),
                        )
                        .is_some()
                    })
            })
        },
    )
    .await
    .map_err(|e| bad(format!("{}: {e}", data_dir.display())))?;
    report_recovery(&node);
    let run = node.continue_job(job).await.map_err(bad)?;
    eprintln!("arbor: continuing {job} as run {run}");
    follow(node, run, args.json).await
}

/// Shows the run until it ends, prints its tree, shuts the node down. A
/// run that waits for a person to continue an interrupted step (I-57)
/// leaves it waiting in the journal: exit 3, naming the step and the
/// command that goes on.
async fn follow(
    node: EmbeddedNode,
    run: arbor_protocol::RunId,
    json: bool,
) -> Result<ExitCode, Failure> {
    let (tree, view) = watch(&node, run, json).await;
    if let Some(WaitingView::NeedsDecision { job, label, why }) = tree.head().waiting.clone()
        && !tree.run_status().is_terminal()
    {
        let data_dir = node.data_dir().display().to_string();
        print_tree(&node, &tree, view, json)?;
        node.shutdown_for_exit()
            .await
            .context("shutting the node down")?;
        eprintln!(
            "arbor: run {run} waits for a person: step {label} was interrupted by a restart \
             and may have acted outside its workdir ({why}). Run it again with \
             `arbor continue {job} --data-dir {data_dir}`, or stop the run with \
             `arbor stop {run}` where arbord serves this workspace"
        );
        return Ok(ExitCode::from(3));
    }
    finish(node, &tree, view, json).await
}

/// Prints the run's tree (its JSON document, or the view's last frame),
/// shuts the node down, and says how the run ended: exit 0 done, else 1.
async fn finish(
    node: EmbeddedNode,
    tree: &Tree,
    view: render::Progress,
    json: bool,
) -> Result<ExitCode, Failure> {
    print_tree(&node, tree, view, json)?;
    node.shutdown_for_exit()
        .await
        .context("shutting the node down")?;
    Ok(match tree.run_status() {
        Status::Done => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}

/// The run's JSON document on stdout, or the view's last frame.
fn print_tree(
    node: &EmbeddedNode,
    tree: &Tree,
    mut view: render::Progress,
    json: bool,
) -> Result<(), Failure> {
    let root = tree.root();
    if json {
        // The sandbox posture rides along: a run document says whether its
        // commands ran sealed.
        let doc = serde_json::json!({ "run": root, "sandbox": node.sandbox() });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).context("printing the tree")?
        );
    } else {
        view.finish(tree);
    }
    Ok(())
}

/// Shows the run until it ends (Ctrl-C stops it) and returns its tree.
async fn watch(
    node: &EmbeddedNode,
    run: arbor_protocol::RunId,
    json: bool,
) -> (Tree, render::Progress) {
    let live = !json && std::io::stdout().is_terminal();
    let mut view = render::Progress::new(live);
    // Woken by runs' ends and by a clock, never by each event: a wide
    // fan-out emits thousands a second. At each tick the view is drawn if
    // anything was emitted since the last draw (`EventBus::version`).
    let mut ends = node.events().ends();
    let mut tick = tokio::time::interval(render::REDRAW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drawn = None;
    let mut interrupted = false;
    let mut cards_told = std::collections::HashSet::new();
    // A person at a terminal answers the run's cards there (I-60).
    let mut asker = std::io::stdin().is_terminal().then(ask::Asker::start);
    let tree = loop {
        // Its end, or a wait for a person no one here can answer (I-57).
        let ended = node.events().with_tree(run, |tree| {
            tree.is_some_and(|tree| {
                tree.run_status().is_terminal()
                    || matches!(tree.head().waiting, Some(WaitingView::NeedsDecision { .. }))
            })
        });
        if ended {
            break node.tree(run);
        }
        tokio::select! {
            changed = ends.changed() => {
                if changed.is_err() {
                    break node.tree(run);
                }
            }
            line = async {
                match asker.as_mut() {
                    Some(asker) => asker.line().await,
                    None => std::future::pending().await,
                }
            } => match (line, asker.as_mut()) {
                (Some(line), Some(asker)) => asker.decide(node, run, line).await,
                // stdin closed: nobody is left to answer here.
                _ => asker = None,
            },
            _ = tick.tick() => {
                if let Some(asker) = asker.as_mut() {
                    asker.prompt_next(node, run);
                    if let Some(line) = asker.typed_ahead() {
                        asker.decide(node, run, line).await;
                    }
                }
                let asking = asker.as_ref().is_some_and(|a| a.is_asking());
                let version = node.events().version();
                // Not drawn over a prompt that waits for its answer.
                if !json && !asking && drawn != Some(version) {
                    drawn = Some(version);
                    // Read under the bus's lock, written after it.
                    let frame = node.events().with_tree(run, |tree| tree.map(|t| view.frame(t)));
                    let frame = frame.unwrap_or_else(|| view.frame(&Tree::new(run)));
                    view.draw(frame);
                    if !live && asker.is_none() {
                        tell_new_cards(node, run, &mut cards_told);
                    }
                }
            }
            _ = tokio::signal::ctrl_c() => {
                if interrupted {
                    // A second Ctrl-C: leave now; the journal shows what was running.
                    eprintln!("arbor: interrupted twice: leaving without waiting");
                    std::process::exit(130);
                }
                interrupted = true;
                eprintln!("arbor: interrupted: stopping the run (Ctrl-C again to leave at once)");
                let _ = node.stop_run(run, "interrupted (SIGINT)").await;
            }
        }
    };
    (tree, view)
}
