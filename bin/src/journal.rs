//! `arbor journal verify` and `arbor journal inspect`: a node's journal read
//! without starting the node.

use crate::{Failure, bad};
use arbor_protocol::{ParentRef, RunId};
use arbor_storage::{Journal, PgOptions, ledger_totals, usd_totals};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Which journal: a data dir's (sled), or a PostgreSQL schema.
#[derive(clap::Args)]
#[group(skip)]
pub struct Place {
    /// A node's data dir: its sled journal.
    #[arg(
        long,
        conflicts_with = "database_url",
        required_unless_present = "database_url"
    )]
    data_dir: Option<PathBuf>,
    /// A PostgreSQL journal's database (a URL, as ARBOR_DATABASE_URL gives it).
    #[arg(long)]
    database_url: Option<String>,
    /// The PostgreSQL journal's schema.
    #[arg(long, default_value = "arbor", requires = "database_url")]
    schema: String,
}

/// A data dir's sled journal, read-only.
pub fn open_data_dir(data_dir: &Path) -> Result<Journal, Failure> {
    let dir = data_dir.join("journal");
    if !dir.is_dir() {
        return Err(bad(format!("{}: no journal here", data_dir.display())));
    }
    Journal::open_read_only(&dir).map_err(|e| bad(format!("{}: {e}", dir.display())))
}

impl Place {
    /// The data dir given, if a data dir was.
    pub fn data_dir(&self) -> Option<&Path> {
        self.data_dir.as_deref()
    }
}

pub fn open(place: &Place) -> Result<Journal, Failure> {
    if let Some(url) = &place.database_url {
        let mut options = PgOptions::new(url.clone(), "arbor-journal");
        options.schema = place.schema.clone();
        // A tool answers now or says why: no long wait for a server.
        options.connect_for = std::time::Duration::from_secs(5);
        return Journal::open_postgres_read_only(&options).map_err(|e| bad(e.to_string()));
    }
    // Read-only: verifying or inspecting a journal changes nothing, not even its epoch.
    open_data_dir(place.data_dir.as_deref().unwrap_or(Path::new(".")))
}

pub fn verify(place: &Place) -> Result<ExitCode, Failure> {
    let journal = open(place)?;
    let report = journal
        .verify_with(&[
            &arbor_service::SUBMISSIONS,
            &arbor_runtime::notify::OUTBOX,
            &arbor_service::audit::AUDIT,
            &arbor_service::quota::QUOTAS,
            &arbor_runtime::RATES,
            &arbor_service::schedules::SCHEDULES,
            &arbor_runtime::versions::VERSIONS,
        ])
        .map_err(|e| Failure::Other(anyhow::anyhow!("reading the journal: {e}")))?;
    for u in &report.undecodable {
        outln!(
            "undecodable: tree {} key {}: {}",
            u.tree,
            u.key_hex,
            u.error
        );
    }
    for b in &report.breaches {
        outln!("breach: {b}");
    }
    outln!(
        "{} records, {} accounts: {}",
        report.records,
        report.accounts,
        if report.is_clean() {
            "ok".to_string()
        } else {
            format!(
                "{} undecodable, {} breaches",
                report.undecodable.len(),
                report.breaches.len()
            )
        }
    );
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn inspect(place: &Place, run: Option<&str>, json: bool) -> Result<ExitCode, Failure> {
    let journal = open(place)?;
    let read =
        |e: arbor_storage::Error| Failure::Other(anyhow::anyhow!("reading the journal: {e}"));
    let runs = match run {
        Some(id) => {
            let id: RunId = id
                .parse()
                .map_err(|_| bad(format!("{id:?} is not a run id")))?;
            vec![
                journal
                    .run(id)
                    .map_err(read)?
                    .ok_or_else(|| bad(format!("no run {id} in this journal")))?,
            ]
        }
        None => journal.runs().map_err(read)?,
    };
    let mut docs = vec![];
    for r in &runs {
        let jobs = journal.jobs(r.id).map_err(read)?;
        let mut owners = vec![ParentRef::Run(r.id)];
        owners.extend(jobs.iter().map(|j| ParentRef::Job(j.id)));
        let mut ledgers = vec![];
        for owner in owners {
            let entries = journal.ledger(owner).map_err(read)?;
            let totals = ledger_totals(&entries, arbor_storage::Unit::Tokens);
            let usd = usd_totals(&entries);
            ledgers.push((owner, entries, totals, usd));
        }
        if json {
            // One run's document holds its events too: what each tool call
            // returned, each MCP server's life, each refusal.
            let events = match run {
                Some(_) => journal.events(r.id).map_err(read)?,
                None => vec![],
            };
            docs.push(serde_json::json!({
                "run": r,
                "jobs": jobs,
                "events": events,
                "ledger": ledgers.iter().filter(|_| run.is_some()).map(|(owner, entries, t, usd)| serde_json::json!({
                    "owner": owner, "grant": t.grant, "spent": t.spent, "held": t.held,
                    "usd": usd.map(|u| serde_json::json!({"grant": u.grant, "spent": u.spent, "held": u.held})),
                    "entries": entries,
                })).collect::<Vec<_>>(),
            }));
            continue;
        }
        outln!(
            "run {} [{}] flow {} budget {} epoch {}{}",
            r.id,
            r.status,
            r.flow,
            r.budget_tokens,
            r.epoch,
            r.reason
                .as_ref()
                .map(|x| format!(" — {x}"))
                .unwrap_or_default()
        );
        let usd_of = |owner: ParentRef| {
            ledgers
                .iter()
                .find(|l| l.0 == owner)
                .and_then(|l| l.3)
                .map(|u| format!(" usd {} of {} micro-dollars", u.spent, u.grant))
                .unwrap_or_default()
        };
        if let Some(usd) = Some(usd_of(ParentRef::Run(r.id))).filter(|u| !u.is_empty()) {
            outln!("  run account:{usd}");
        }
        for j in &jobs {
            outln!(
                "  {}{} {} ({}) [{}] attempt {} grant {} spent {}{}{}",
                "  ".repeat(j.depth as usize),
                j.kind.as_str(),
                j.label.clone().unwrap_or_default(),
                j.agent,
                j.status,
                j.attempt,
                j.grant_tokens,
                j.tokens_spent,
                usd_of(ParentRef::Job(j.id)),
                j.reason
                    .as_ref()
                    .map(|x| format!(" — {x}"))
                    .unwrap_or_default()
            );
        }
        if run.is_some() {
            outln!("  ledger:");
            for (owner, entries, t, usd) in &ledgers {
                outln!(
                    "    {owner:?}: grant {} spent {} held {}{}",
                    t.grant,
                    t.spent,
                    t.held,
                    usd.map(|u| format!(
                        "; usd grant {} spent {} held {}",
                        u.grant, u.spent, u.held
                    ))
                    .unwrap_or_default()
                );
                for e in entries {
                    outln!("      epoch {} {:?}", e.epoch, e.op);
                }
            }
        }
    }
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "runs": docs })).unwrap_or_default()
        );
    }
    Ok(ExitCode::SUCCESS)
}
