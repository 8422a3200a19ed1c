//! `arbord`: one arbor node as a service, behind an HTTP JSON API.
//!
//! Exit codes: 0 after a clean drain (SIGTERM or SIGINT); 1 when the node
//! could not start or serve; 2 bad usage or bad settings.

use arbor_runtime::Workspace;
use arbor_service::{Flags, Service, config};
use clap::{Parser, Subcommand, ValueEnum};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "arbord",
    version,
    about = "Serve one arbor node over HTTP (127.0.0.1:7878 by default)"
)]
struct Cli {
    /// The workspace: arbor.toml (with its [service] settings), agents/, flows/.
    #[arg(long, default_value = ".")]
    workspace: PathBuf,
    /// Where the journal, the workdirs and the API token live (default: WORKSPACE/.arbor).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// This node's id in a shared journal (`[journal] backend = "postgres"`;
    /// default: ARBOR_NODE_ID, else the host's name).
    #[arg(long, value_parser = arbor_runtime::workspace::parse_node_id)]
    node_id: Option<String>,
    /// The address and port to listen on (default 127.0.0.1:7878).
    #[arg(long)]
    listen: Option<String>,
    /// How log lines on stderr look.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Print the API's OpenAPI document and exit.
    Openapi,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// mimalloc, not glibc's malloc: a job's actors allocate on one thread and
/// the journal frees on another, and glibc's arena locks made that a tenth
/// of a wide fan-out's CPU (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("ARBOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    // Records of the `log` crate (sled's, hakoniwa's) stop at debug: sled
    // logs at trace from thread-local destructors at exit, after tracing's
    // own thread-locals are gone, and that aborts the process.
    log::set_max_level(log::max_level().min(log::LevelFilter::Debug));
    if let Some(Command::Openapi) = cli.command {
        match serde_json::to_string_pretty(&Service::openapi()) {
            Ok(text) => {
                println!("{text}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("arbord: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("arbord: could not start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(serve(cli))
}

async fn serve(cli: Cli) -> ExitCode {
    // Watched from the first moment: a SIGTERM that comes while the node
    // starts is a drain once it has started, never the default kill.
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("arbord: cannot watch for SIGTERM and SIGINT: {e}");
            return ExitCode::from(1);
        }
    };
    // SIGHUP reloads the workspace (once the service is up); watched from
    // here, so that an early one is not the default kill either.
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(hup) => hup,
        Err(e) => {
            eprintln!("arbord: cannot watch for SIGHUP: {e}");
            return ExitCode::from(1);
        }
    };
    let workspace = match Workspace::load(&cli.workspace) {
        Ok(mut ws) => {
            ws.config.journal.name_node(cli.node_id.clone());
            ws
        }
        Err(e) => {
            eprintln!("arbord: {e}");
            return ExitCode::from(2);
        }
    };
    let settings = config::resolve(
        &workspace.config.service,
        std::env::vars(),
        Flags {
            listen: cli.listen,
            data_dir: cli.data_dir,
        },
        cli.workspace.join(".arbor"),
    );
    let mut settings = match settings {
        Ok(s) => s,
        Err(e) => {
            eprintln!("arbord: {e}");
            return ExitCode::from(2);
        }
    };
    // Absolute, so that the workdirs a run document names mean the same to
    // a client in any directory.
    if let Ok(dir) = std::path::absolute(&settings.data_dir) {
        settings.data_dir = dir;
    }
    let listener = match tokio::net::TcpListener::bind(settings.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("arbord: cannot listen on {}: {e}", settings.listen);
            return ExitCode::from(1);
        }
    };
    let address = listener.local_addr().unwrap_or(settings.listen);
    let service = match Service::start(workspace, settings).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("arbord: {e}");
            return ExitCode::from(1);
        }
    };
    if !address.ip().is_loopback() {
        let banner = "!".repeat(72);
        eprintln!(
            "{banner}\narbord: WARNING: bound to {address}, which is NOT loopback: anyone who can \
             reach this address and has the token can run agents here.\n{banner}"
        );
        tracing::warn!(%address, "listening beyond loopback");
    }
    eprintln!(
        "arbord: listening on http://{address} (token in {})",
        service.token_path().display()
    );
    eprintln!("arbord: console at http://{address}/ui (log in with that token)");
    {
        let service = service.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match service.reload().await {
                    Ok(d) => {
                        tracing::info!(version = %d.version, previous = %d.previous, "SIGHUP: the workspace was reloaded")
                    }
                    Err(e) => tracing::error!(error = %e.message, "SIGHUP: the reload was refused"),
                }
            }
        });
    }
    // A node on a shared journal that lost its lease has stopped its runs
    // and commits nothing more: it ends, and its supervisor starts it again
    // (a new epoch, taking runs afresh).
    let fenced = Arc::new(std::sync::OnceLock::new());
    let lease_lost = service.node().lease_lost();
    let stop = {
        let fenced = fenced.clone();
        async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: draining"),
                _ = int.recv() => tracing::info!("SIGINT: draining"),
                why = lease_lost => {
                    let _ = fenced.set(why);
                }
            }
        }
    };
    let served = service.serve(listener, stop).await;
    if let Some(why) = fenced.get() {
        eprintln!("arbord: this node lost its lease and stopped its runs: {why}");
        return ExitCode::from(1);
    }
    match served {
        Ok(()) => {
            eprintln!("arbord: stopped cleanly");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("arbord: {e}");
            ExitCode::from(1)
        }
    }
}
