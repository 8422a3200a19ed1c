//! `arbor replay` and `arbor export`: a recorded run replayed on an embedded
//! node, or written as one document (docs/replay.md). Every refusal comes
//! before anything runs, and is bad input: exit 2.

use crate::{Failure, bad};
use anyhow::Context;
use arbor_protocol::RunId;
use arbor_protocol::tape::{AfterDivergence, Export, ToolReplay};
use arbor_runtime::replay::{self, ReplayOptions};
use arbor_runtime::{EmbeddedNode, Models, Workspace};
use clap::{Args, ValueEnum};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
pub struct ReplayArgs {
    /// The recorded run's id; with --fixture, the workspace folder to replay
    /// the export against.
    target: String,
    /// Replay this export (`arbor export RUN -o FILE`) against the workspace
    /// TARGET, on a node of its own (a temporary data dir, unless --data-dir).
    #[arg(long)]
    fixture: Option<PathBuf>,
    /// Replay on an embedded node of this data dir (its workspace is its
    /// parent, unless --workspace). Without it and --workspace, arbord
    /// replays the run.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Replay on an embedded node of this workspace (its data dir is
    /// WORKSPACE/.arbor, unless --data-dir).
    #[arg(long)]
    workspace: Option<PathBuf>,
    /// Where exec, read_file and MCP results come from.
    #[arg(long, value_enum, default_value_t = Tools::Recorded)]
    tools: Tools,
    /// At the first request that differs from the recording: fail (the
    /// default), or go on with the agents' configured models (a fork).
    #[arg(long, value_enum, default_value_t = After::Fail)]
    after_divergence: After,
    /// Record the replay too.
    #[arg(long)]
    record: bool,
    /// Replay against the workspace as it is now, not the version the
    /// recorded run was admitted with: to see what an edit changes.
    #[arg(long)]
    current: bool,
    /// Rerun a failed run, keeping what worked: the jobs that completed,
    /// whose agent and arbor.toml are unchanged, are served from the
    /// recording; the rest run live. A new run, linked to the failed one.
    #[arg(long, conflicts_with_all = ["fixture", "tools", "after_divergence"])]
    rerun_failed: bool,
    /// With --rerun-failed: print which jobs are reused and which run
    /// again, and the most the rerun part can spend; run nothing.
    #[arg(long, requires = "rerun_failed")]
    dry_run: bool,
    /// With --rerun-failed: go on although definitions changed since the
    /// recording (they are named; a changed agent's jobs run again).
    #[arg(long, requires = "rerun_failed")]
    allow_changed: bool,
    /// Print the replayed run's document, as `arbor run --json` does.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Tools {
    Recorded,
    Live,
}

#[derive(Clone, Copy, ValueEnum)]
enum After {
    Fail,
    Live,
}

#[derive(Args)]
pub struct ExportArgs {
    /// The recorded run's id.
    run: String,
    /// Instead of a document: a copy of the workspace in this new folder
    /// whose agents answer with the recording as their `script:`, an
    /// offline example that runs anywhere (`arbor run DIR`).
    #[arg(long, value_name = "DIR")]
    as_script: Option<PathBuf>,
    /// With --as-script: the workspace to copy (default: the data dir's parent).
    #[arg(long, requires = "as_script")]
    workspace: Option<PathBuf>,
    #[command(flatten)]
    place: crate::journal::Place,
}

fn run_id(text: &str) -> Result<RunId, Failure> {
    text.parse()
        .map_err(|_| bad(format!("{text:?} is not a run id")))
}

pub async fn replay(args: ReplayArgs, conn: &crate::client::Conn) -> Result<ExitCode, Failure> {
    // Neither a workspace nor a data dir nor an export: arbord replays it.
    if args.fixture.is_none() && args.workspace.is_none() && args.data_dir.is_none() {
        let run = run_id(&args.target)?.to_string();
        let body = arbor_service::api::ReplayRun {
            tools: match args.tools {
                Tools::Recorded => ToolReplay::Recorded,
                Tools::Live => ToolReplay::Live,
            },
            after_divergence: match args.after_divergence {
                After::Fail => AfterDivergence::Fail,
                After::Live => AfterDivergence::Live,
            },
            rerun_failed: args.rerun_failed,
            dry_run: args.dry_run,
            allow_changed: args.allow_changed,
            record: args.record,
            current: args.current,
        };
        return crate::with_client(conn, |c| {
            Box::pin(crate::client::replay(c, &run, body.clone()))
        })
        .await;
    }
    let options = ReplayOptions {
        tools: match args.tools {
            Tools::Recorded => ToolReplay::Recorded,
            Tools::Live => ToolReplay::Live,
        },
        after_divergence: match args.after_divergence {
            After::Fail => AfterDivergence::Fail,
            After::Live => AfterDivergence::Live,
        },
        record: args.record,
        current: args.current,
    };
    // The export, read whole and checked before any node starts.
    let export = match &args.fixture {
        Some(file) => Some(replay::read_export(file).map_err(bad)?),
        None => None,
    };
    let (dir, data_dir, _temp) = match &export {
        Some(_) => {
            let dir = PathBuf::from(&args.target);
            match &args.data_dir {
                Some(data) => (dir, data.clone(), None),
                None => {
                    let temp = tempfile::tempdir().context("making a temporary data dir")?;
                    (dir, temp.path().to_path_buf(), Some(temp))
                }
            }
        }
        None => {
            let dir = match (&args.workspace, &args.data_dir) {
                (Some(dir), _) => dir.clone(),
                (None, Some(data)) => data
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
                (None, None) => PathBuf::from("."),
            };
            let data_dir = args.data_dir.clone().unwrap_or_else(|| dir.join(".arbor"));
            (dir, data_dir, None)
        }
    };
    let workspace = Workspace::load(&dir).map_err(bad)?;
    let recorded = match &export {
        Some(_) => None,
        None => Some(run_id(&args.target)?),
    };
    if let (true, Some(run)) = (args.rerun_failed, recorded) {
        return rerun(&args, &workspace, &data_dir, run).await;
    }
    let shared = matches!(
        workspace.config.journal,
        arbor_runtime::workspace::JournalConfig::Postgres { .. }
    );
    if recorded.is_some() && !data_dir.join("journal").is_dir() && !shared {
        return Err(bad(format!(
            "{}: no journal here (give the recorded run's --data-dir or --workspace)",
            data_dir.display()
        )));
    }
    // Nothing interrupted is resumed: this node is here for the replay.
    let node = EmbeddedNode::start_resuming(
        &workspace,
        &data_dir,
        Arc::new(Models::new(&workspace.config.providers)),
        |_, _| false,
    )
    .await
    .map_err(|e| bad(format!("{}: {e}", data_dir.display())))?;
    let started = match (&export, recorded) {
        (Some(export), _) => replay::replay_export(&node, &workspace, export, options).await,
        (None, Some(run)) => replay::replay(&node, &workspace, run, options).await,
        (None, None) => Err(replay::ReplayError::Start("nothing to replay".into())),
    };
    let run = match started {
        Ok(run) => run,
        Err(refused) => {
            node.shutdown_for_exit().await.ok();
            return Err(bad(refused));
        }
    };
    let of = export
        .as_ref()
        .map_or_else(|| args.target.clone(), |e| e.run.to_string());
    eprintln!("arbor: replaying run {of} as run {run}");
    let (tree, view) = crate::watch(&node, run, args.json).await;
    let (old_tree, old_events) = match &export {
        Some(export) => (export.tree.clone(), export.events.clone()),
        None => {
            let old = replay::recorded(node.journal(), recorded.unwrap_or(run)).map_err(bad)?;
            let root = old.tree.root();
            let events = replay::job_events(&root, &old.events);
            (root, events)
        }
    };
    let root = tree.root();
    let events = node
        .journal()
        .events(run)
        .map(|events| replay::job_events(&root, &events))
        .unwrap_or_else(|_| BTreeMap::new());
    let differences = replay::differences(&old_tree, &old_events, &root, &events, 20);
    crate::print_tree(&node, &tree, view, args.json)?;
    node.shutdown_for_exit()
        .await
        .context("shutting the node down")?;
    if differences.is_empty() {
        eprintln!("arbor: the replay equals its recording (tree, statuses, accounts, events)");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("arbor: the replay differs from its recording:");
        for difference in &differences {
            eprintln!("  {difference}");
        }
        Ok(ExitCode::from(1))
    }
}

/// `file`: `-o FILE`, where the document goes (`-`: standard output).
/// `--rerun-failed` (and `--dry-run`): the plan first, refused before
/// anything runs when the run did not fail or its definitions changed.
async fn rerun(
    args: &ReplayArgs,
    workspace: &Workspace,
    data_dir: &Path,
    run: RunId,
) -> Result<ExitCode, Failure> {
    if args.dry_run {
        let journal = crate::journal::open_data_dir(data_dir)?;
        let plan = replay::plan_rerun(&journal, workspace, run, args.allow_changed).map_err(bad)?;
        print_plan(&plan, args.json);
        return Ok(ExitCode::SUCCESS);
    }
    let node = EmbeddedNode::start_resuming(
        workspace,
        data_dir,
        Arc::new(Models::new(&workspace.config.providers)),
        |_, _| false,
    )
    .await
    .map_err(|e| bad(format!("{}: {e}", data_dir.display())))?;
    let planned = replay::plan_rerun(node.journal(), workspace, run, args.allow_changed);
    let plan = match planned {
        Ok(plan) => plan,
        Err(refused) => {
            node.shutdown_for_exit().await.ok();
            return Err(bad(refused));
        }
    };
    for path in &plan.changed {
        eprintln!("arbor: changed since the recording: {path}");
    }
    let reused = plan.jobs.iter().filter(|j| j.reuse).count();
    let again = plan.jobs.len() - reused;
    let started = replay::rerun(&node, workspace, plan, args.record).await;
    let new = match started {
        Ok(new) => new,
        Err(refused) => {
            node.shutdown_for_exit().await.ok();
            return Err(bad(refused));
        }
    };
    eprintln!(
        "arbor: rerunning run {run} as run {new}: {reused} steps and jobs reused from the recording, {again} run again"
    );
    let (tree, view) = crate::watch(&node, new, args.json).await;
    crate::finish(node, &tree, view, args.json).await
}

fn print_plan(plan: &replay::RerunPlan, json: bool) {
    if json {
        outln!("{}", serde_json::to_string_pretty(plan).unwrap_or_default());
        return;
    }
    let reused = plan.jobs.iter().filter(|j| j.reuse).count();
    outln!(
        "rerun of run {} (flow {}): {reused} reused from the recording, {} run again",
        plan.replay_of,
        plan.flow,
        plan.jobs.len() - reused
    );
    for path in &plan.changed {
        outln!("changed: {path}");
    }
    for job in &plan.jobs {
        let indent = "  ".repeat(job.depth as usize + 1);
        let what = if job.reuse { "reuse" } else { "rerun" };
        let why = job
            .why
            .as_ref()
            .map(|w| format!(" ({w})"))
            .unwrap_or_default();
        outln!("{what} {indent}{} [{}]{why}", job.lineage, job.agent);
    }
    let usd = plan
        .worst_case_usd_micros
        .map(|m| format!(", ${:.6}", m as f64 / 1e6))
        .unwrap_or_default();
    outln!(
        "worst case of the rerun part: {} tokens{usd} (the grants of its topmost steps and jobs)",
        plan.worst_case_tokens
    );
}

pub fn export(args: ExportArgs, file: Option<&str>) -> Result<ExitCode, Failure> {
    let run = run_id(&args.run)?;
    if let Some(dir) = &args.as_script {
        let journal = crate::journal::open(&args.place)?;
        let from = match &args.workspace {
            Some(from) => from.clone(),
            None => args
                .place
                .data_dir()
                .and_then(Path::parent)
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        };
        let notes = replay::as_script(&journal, run, &from, dir).map_err(bad)?;
        for note in notes {
            eprintln!("arbor: {note}");
        }
        eprintln!(
            "arbor: wrote run {run} as an offline example in {0}: arbor run {0}",
            dir.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let file =
        PathBuf::from(file.ok_or_else(|| {
            bad("give the file to write with -o FILE (`-o -` for standard output)")
        })?);
    let journal = crate::journal::open(&args.place)?;
    let export: Export = replay::export(&journal, run).map_err(bad)?;
    let text = serde_json::to_string_pretty(&export).context("writing the export")? + "\n";
    if file == Path::new("-") {
        outln!("{}", text.trim_end());
    } else {
        std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
        eprintln!(
            "arbor: wrote run {run}'s recording to {} ({} jobs, {} model calls)",
            file.display(),
            export.tape.len(),
            export.tape.values().map(|t| t.calls.len()).sum::<usize>()
        );
    }
    Ok(ExitCode::SUCCESS)
}
