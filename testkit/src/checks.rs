//! The checks every recovered journal must pass, whoever crashed it: the
//! crash driver's random kills and `explore_crashes`' commit points.

use arbor_protocol::{ErrorClass, JobId, ParentRef, RunId, Status};
use arbor_storage::{JobRecord, Journal, LedgerOp, Unit, ledger_totals};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// What was durable at the last check of a journal: it must all still be
/// there at the next one.
#[derive(Default)]
pub struct Seen {
    terminal_jobs: HashMap<JobId, JobRecord>,
    ledger_lengths: HashMap<ParentRef, usize>,
}

/// What one check read, and what it found wrong (empty: all holds).
#[derive(Debug, Default)]
pub struct Checked {
    pub accounts: u64,
    pub records: u64,
    pub violations: Vec<String>,
}

/// Every process of a sandbox the journal records that is still alive
/// (each group given 2 s to go, I-17), named by group and job: none once
/// the node that started them has stopped.
pub fn processes_left(journal: &Journal) -> Result<Vec<String>, String> {
    let jobs = journal.all_jobs().map_err(|e| e.to_string())?;
    let mut left = Vec::new();
    for job in jobs {
        for g in journal.sandboxes(job.id).map_err(|e| e.to_string())? {
            let alive = still_alive(&g);
            if !alive.is_empty() {
                left.push(format!(
                    "process group {} of job {} is alive: {alive:?}",
                    g.pgid, job.id
                ));
            }
        }
    }
    Ok(left)
}

/// The members of a recorded process group still alive after up to 2 s
/// (I-17: a killed process is gone within 2 s).
fn still_alive(g: &arbor_storage::SandboxRecord) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut alive = arbor_sandbox::group_members(g.pgid, g.start_ticks, &g.boot_id);
    while !alive.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        alive = arbor_sandbox::group_members(g.pgid, g.start_ticks, &g.boot_id);
    }
    alive
}

/// Checks a recovered, quiescent journal:
///
/// - it reads back whole, nothing undecodable (I-35), every account
///   balances (I-14);
/// - no sandbox recorded live, and no process of any recorded group alive
///   2 s later (I-17, I-30);
/// - every job ended, and an ended job holds nothing;
/// - a job failed as interrupted has no output; a job seen ended at an
///   earlier check (`seen`) has not changed or vanished;
/// - no job spawned by two delegations; no child released (charged) twice;
/// - no ledger shorter than at the earlier check.
///
/// ```
/// # #[tokio::main] async fn main() {
/// use arbor_testkit::{TestNode, agent_md, checks};
/// let solo = agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}");
/// let node = TestNode::start(&[("solo", &solo)]).await;
/// let run = node.run_agent("solo", "go").await;
/// node.wait_run(run).await;
/// // Quiescent: the runs the journal holds have ended (resumed ones too).
/// let node = node.crash_and_restart().await;
/// let checked = checks::recovered(node.journal(), &mut checks::Seen::default());
/// assert!(checked.violations.is_empty(), "{:?}", checked.violations);
/// # }
/// ```
pub fn recovered(journal: &Journal, seen: &mut Seen) -> Checked {
    let mut checked = Checked::default();
    let mut fail = |what: String| checked.violations.push(what);
    let report = match journal.verify() {
        Ok(r) => r,
        Err(e) => {
            fail(format!("the journal cannot be read: {e}"));
            return checked;
        }
    };
    for u in &report.undecodable {
        fail(format!(
            "undecodable record in {} at {}: {}",
            u.tree, u.key_hex, u.error
        ));
    }
    for b in &report.breaches {
        fail(format!("conservation: {b}"));
    }
    let accounts = report.accounts;
    let records = report.records;
    // No sandbox process alive, none recorded live.
    match journal.live_sandboxes() {
        Ok(live) => {
            for s in live {
                fail(format!(
                    "process group {} of job {} still recorded live",
                    s.pgid, s.job
                ));
            }
        }
        Err(e) => fail(format!("sandboxes unreadable: {e}")),
    }
    let jobs = match journal.all_jobs() {
        Ok(j) => j,
        Err(e) => {
            fail(format!("jobs unreadable: {e}"));
            return checked;
        }
    };
    let runs: Vec<RunId> = journal
        .runs()
        .map(|r| r.into_iter().map(|r| r.id).collect())
        .unwrap_or_default();
    for job in &jobs {
        if !job.status.is_terminal() {
            fail(format!(
                "job {} ({}, attempt {}, epoch {}) left {}",
                job.id, job.agent, job.attempt, job.epoch, job.status
            ));
        }
        if let Ok(groups) = journal.sandboxes(job.id) {
            for g in groups {
                let alive = still_alive(&g);
                if !alive.is_empty() {
                    fail(format!(
                        "process group {} of ended job {} is alive: {alive:?}",
                        g.pgid, job.id
                    ));
                }
            }
        }
        // No late output: interrupted stays interrupted, with nothing to show.
        if let Some(before) = seen.terminal_jobs.get(&job.id)
            && before != job
        {
            fail(format!(
                "job {} changed after it ended: {:?} -> {:?}",
                job.id, before.status, job.status
            ));
        }
        if job.error_class == Some(ErrorClass::Interrupted) && job.output_json != "null" {
            fail(format!(
                "interrupted job {} has output {}",
                job.id, job.output_json
            ));
        }
        let owner = ParentRef::Job(job.id);
        let totals = journal
            .ledger(owner)
            .map(|l| ledger_totals(&l, Unit::Tokens));
        if let Ok(t) = totals
            && t.held != 0
        {
            fail(format!("ended job {} still holds {}", job.id, t.held));
        }
    }
    // One spawn per delegation key; no child charged twice.
    let mut spawned: HashSet<JobId> = HashSet::new();
    let mut released: HashMap<(ParentRef, Unit), HashSet<JobId>> = HashMap::new();
    let mut owners: Vec<ParentRef> = runs.iter().map(|r| ParentRef::Run(*r)).collect();
    owners.extend(jobs.iter().map(|j| ParentRef::Job(j.id)));
    for owner in &owners {
        if let ParentRef::Job(parent) = owner
            && let Ok(delegations) = journal.delegations(*parent)
        {
            for d in delegations {
                for child in d.children {
                    if !spawned.insert(child) {
                        fail(format!("job {child} spawned by two delegations"));
                    }
                }
            }
        }
        let ledger = journal.ledger(*owner).unwrap_or_default();
        for entry in &ledger {
            if let LedgerOp::Release { child, .. } = entry.op
                && !released
                    .entry((*owner, entry.unit))
                    .or_default()
                    .insert(child)
            {
                fail(format!(
                    "{owner:?} released (charged) {child} twice in {:?}",
                    entry.unit
                ));
            }
        }
        // Durable before, durable after: a ledger never shrinks.
        let before = seen.ledger_lengths.get(owner).copied().unwrap_or(0);
        if ledger.len() < before {
            fail(format!(
                "{owner:?}: ledger shrank from {before} to {} entries",
                ledger.len()
            ));
        }
        seen.ledger_lengths.insert(*owner, ledger.len());
    }
    for (id, before) in &seen.terminal_jobs {
        if !jobs.iter().any(|j| j.id == *id) {
            fail(format!("job {id} ({:?}) vanished", before.status));
        }
    }
    for job in jobs {
        if job.status.is_terminal() && job.status != Status::Pending {
            seen.terminal_jobs.insert(job.id, job);
        }
    }
    checked.accounts = accounts;
    checked.records = records;
    checked
}
