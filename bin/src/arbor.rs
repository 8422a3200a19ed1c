//! `arbor`: the command line. `arbor run DIR` runs a flow on an embedded node.
//!
//! Exit codes: 0 the run completed; 1 it failed or was stopped; 2 bad usage or
//! bad input, with a one-line reason on stderr.

mod render;

use anyhow::Context;
use arbor_protocol::{RunSpec, Status};
use arbor_runtime::{EmbeddedNode, Workspace};
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "arbor", version, about = "Run and inspect trees of AI agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a flow (or one agent) of the workspace DIR on an embedded node.
    Run(RunArgs),
}

#[derive(Args)]
struct RunArgs {
    /// The workspace: arbor.toml, agents/NAME/agent.md, flows/NAME.toml.
    dir: PathBuf,
    /// The flow to run (flows/NAME.toml). Optional when the workspace has exactly one.
    #[arg(long, conflicts_with = "agent")]
    flow: Option<String>,
    /// Run one agent on --input instead of a flow.
    #[arg(long, requires = "input")]
    agent: Option<String>,
    /// The instruction for --agent.
    #[arg(long, requires = "agent")]
    input: Option<String>,
    /// The run's budget in tokens (overrides the flow and arbor.toml).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    budget_tokens: Option<u64>,
    /// Print one JSON document (the run's tree) on stdout and nothing else there.
    #[arg(long)]
    json: bool,
    /// Where the journal and the workdirs live (default: DIR/.arbor).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// Bad usage or bad input: exit 2.
struct BadInput(String);

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
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
        }
    });
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
    }
}

enum Failure {
    Bad(BadInput),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

fn bad(reason: impl std::fmt::Display) -> Failure {
    Failure::Bad(BadInput(reason.to_string()))
}

async fn run(args: RunArgs) -> Result<ExitCode, Failure> {
    let workspace = Workspace::load(&args.dir).map_err(bad)?;
    let spec: RunSpec = match (&args.flow, &args.agent, &args.input) {
        (Some(flow), _, _) => workspace.flow_run(flow, args.budget_tokens).map_err(bad)?,
        (None, Some(agent), Some(input)) => workspace
            .agent_run(agent, input, args.budget_tokens)
            .map_err(bad)?,
        _ => match workspace.flows.keys().collect::<Vec<_>>().as_slice() {
            [only] => workspace.flow_run(only, args.budget_tokens).map_err(bad)?,
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
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| args.dir.join(".arbor"));
    let node = EmbeddedNode::start(&workspace, &data_dir)
        .await
        .map_err(|e| bad(format!("{}: {e}", data_dir.display())))?;
    let run = node.start_run(spec).await.map_err(bad)?;
    let live = !args.json && std::io::stdout().is_terminal();
    let mut view = render::Progress::new(live, run);
    let mut changes = node.events().changes();
    let mut interrupted = false;
    let tree = loop {
        let tree = node.tree(run);
        if !args.json {
            view.show(&tree);
        }
        if tree.run_status().is_terminal() {
            break tree;
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    break node.tree(run);
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
    let root = tree.root();
    if args.json {
        let doc = serde_json::json!({ "run": root });
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).context("printing the tree")?
        );
    } else {
        view.finish(&tree);
    }
    node.shutdown().await.context("shutting the node down")?;
    Ok(match root.status {
        Status::Done => ExitCode::SUCCESS,
        _ => ExitCode::from(1),
    })
}
