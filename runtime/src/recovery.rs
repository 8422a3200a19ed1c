//! Recovery on boot: before anything new starts, the journal of the node's
//! previous life is made true again.
//!
//! Order (each step journaled, each visible in the run's events and tree):
//! 1. Every record is read back at the end (`verify`); undecodable ones are
//!    reported by key (I-35). One that recovery itself needs fails it, naming
//!    the key.
//! 2. Kill what is left of every sandbox process group still recorded live:
//!    the processes of that group in the same boot, started no earlier than
//!    its leader, unless the pgid's leader is now another process (never a
//!    pid alone; `group_members`); then mark it ended (I-30).
//! 3. For each run that was not finished: every step or job still pending or
//!    running is failed, class `interrupted`, deepest first; each account is
//!    settled at its journaled spend, its open call holds released
//!    uncharged, and its parent's hold released (I-31). Holds for children
//!    that never got a record (a crash between the grant and the delegation)
//!    are released at 0.
//!    Before that, ends a crash took from the events are told again from
//!    their records (an end is told only once durable, I-29).
//! 4. Each run is resumed at step granularity when its steps' retry policy
//!    allows, or ended (I-34); a run the node died under after each of its
//!    last `max_recoveries` resumes is parked instead (I-48).
//! 5. Pending approval cards are kept with their deadlines, those overdue
//!    expired now (I-47).
//! 6. Conservation is checked for every account (I-14).
//!
//! Invariant: recovery charges nothing twice. A hold is released only while
//! it is open in its parent's ledger, so running recovery again changes nothing.

use arbor_actors::EventBus;
use arbor_actors::agent_loop::Made;
use arbor_actors::run::{CheckNow, Failed, LoopState, Resume, RetryWait, Review};
use arbor_protocol::{
    Amount, Card, CardState, Decision, ErrorClass, EventKind, JobId, NodeKind, ParentRef,
    ResultEnvelope, RunId, RunSpec, Status, StepSpec,
};
use arbor_storage::{
    ApprovalRecord, JobRecord, Journal, LedgerOp, LedgerRecord, Record, RunRecord, SandboxRecord,
    SandboxState, Undecodable, Unit, ledger_of, ledger_totals, usd_totals,
};
use std::collections::{BTreeMap, HashMap};

/// What recovery found and did.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    pub epoch: u64,
    pub undecodable: Vec<Undecodable>,
    /// Process groups killed (their leaders' pids).
    pub processes_killed: Vec<i32>,
    pub jobs_failed: Vec<JobId>,
    pub grants_released: u32,
    pub runs: Vec<RunRecovery>,
    /// Accounts that do not add up after recovery (I-14); empty when all is well.
    pub breaches: Vec<String>,
    /// Ends (of steps, jobs and runs) durable in their records whose events a
    /// crash lost, told again from the records.
    pub ends_retold: u32,
    /// Approval cards of runs to resume: pending with their deadlines, or
    /// expired here; the runs' jobs adopt them instead of asking again (I-47).
    pub carried_cards: Vec<Card>,
}

#[derive(Clone, Debug)]
pub struct RunRecovery {
    pub run: RunId,
    pub outcome: RunOutcome,
}

#[derive(Clone, Debug)]
pub enum RunOutcome {
    /// To be resumed by the node, with its spec.
    Resume {
        spec: Box<RunSpec>,
        resume: Box<Resume>,
    },
    /// Ended by recovery: it cannot go on.
    Ended {
        status: Status,
        class: Option<ErrorClass>,
        reason: String,
    },
}

/// The spec a run started with, from its history (its `RunStarted`).
pub fn started_spec(history: &[arbor_protocol::Event]) -> Option<&RunSpec> {
    history.iter().find_map(|e| match &e.kind {
        EventKind::RunStarted { spec, .. } => Some(spec.as_ref()),
        _ => None,
    })
}

/// The reason every interrupted step and job gets (I-30).
pub const INTERRUPTED: &str = "interrupted: node restarted";

pub async fn recover(
    journal: &Journal,
    events: &EventBus,
    max_recoveries: u32,
) -> Result<RecoveryReport, arbor_storage::Error> {
    recover_runs(journal, events, max_recoveries, None).await
}

/// `recover`, over `runs` alone when given: the runs a node took over in a
/// journal it shares (`Journal::claim_orphans`), exactly as a restart
/// recovers all of its own (I-51). Runs other nodes own are not touched.
pub async fn recover_runs(
    journal: &Journal,
    events: &EventBus,
    max_recoveries: u32,
    runs: Option<&[RunId]>,
) -> Result<RecoveryReport, arbor_storage::Error> {
    let epoch = journal.epoch();
    let mut report = RecoveryReport {
        epoch,
        ..Default::default()
    };
    let mut killed_by_job: HashMap<JobId, u32> = HashMap::new();
    let (records, in_scope) = match runs {
        None => (journal.runs()?, None),
        Some(ids) => {
            let mut records = Vec::new();
            let mut jobs = std::collections::HashSet::new();
            for &id in ids {
                if let Some(run) = journal.run(id)? {
                    jobs.extend(journal.jobs(id)?.into_iter().map(|j| j.id));
                    records.push(run);
                }
            }
            (records, Some(jobs))
        }
    };
    let sandboxes = if sabotage::sandbox_sweep_skipped() {
        vec![]
    } else {
        journal.live_sandboxes()?
    };
    // Another node's processes are its own to end: only those of runs in
    // scope, and (by `kill_if_same`) only those of this machine's boot.
    let sandboxes = sandboxes
        .into_iter()
        .filter(|s| in_scope.as_ref().is_none_or(|jobs| jobs.contains(&s.job)));
    for sandbox in sandboxes {
        if kill_if_same(&sandbox) {
            report.processes_killed.push(sandbox.pgid);
            *killed_by_job.entry(sandbox.job).or_default() += 1;
        }
        journal.append(vec![Record::Sandbox(SandboxRecord {
            state: SandboxState::Ended,
            epoch,
            ..sandbox
        })])?;
    }
    for run in records {
        if run.status.is_terminal() {
            // Ended in the life before this one: a crash right after its end
            // was committed may have taken the events that tell it (earlier
            // lives were seen to by the recoveries after them).
            // (A run taken over in a shared journal is one such: it was
            // claimed because its owner died after its end, unsettled.)
            if (runs.is_some() || run.epoch + 1 == epoch)
                && !matches!(
                    journal.last_event(run.id)?.map(|e| e.kind),
                    Some(EventKind::RunFinished { .. })
                )
            {
                let history = journal.events(run.id)?;
                let jobs = journal.jobs(run.id)?;
                report.ends_retold += retell_lost_ends(events, &run, &history, &jobs);
            }
            continue;
        }
        let outcome = recover_run(
            journal,
            events,
            &run,
            &killed_by_job,
            max_recoveries,
            &mut report,
        )?;
        report.runs.push(RunRecovery {
            run: run.id,
            outcome,
        });
    }
    recover_cards(journal, events, runs, &mut report)?;
    journal.flush().await?;
    // Ends told again are durable: the ended runs taken over are settled,
    // and no later claimer takes them again (a death before this leaves
    // them to the next, which tells again what is still missing).
    if let Some(ids) = runs {
        journal.settle(ids)?;
    }
    // One full read at the end serves both checks: undecodable records are
    // reported by key (I-35), and every account must add up (I-14). Runs
    // taken over are checked alone: the others are live on other nodes.
    let verified = match runs {
        None => journal.verify()?,
        Some(ids) => journal.verify_runs(ids)?,
    };
    report.undecodable = verified.undecodable;
    report.breaches = verified.breaches;
    Ok(report)
}

/// A recovery broken on purpose, to show that the crash exploration
/// (`arbor-testkit`) catches a recovery that skips a step. Off unless a
/// test switches it on; process-wide, so such a test has its binary to
/// itself.
#[doc(hidden)]
pub mod sabotage {
    use std::sync::atomic::{AtomicBool, Ordering};

    static SKIP_SANDBOX_SWEEP: AtomicBool = AtomicBool::new(false);

    /// Recovery's step 2 (kill what is left of every sandbox recorded live,
    /// and mark it ended) is skipped while this is on.
    pub fn skip_sandbox_sweep(on: bool) {
        SKIP_SANDBOX_SWEEP.store(on, Ordering::Release);
    }

    pub(crate) fn sandbox_sweep_skipped() -> bool {
        SKIP_SANDBOX_SWEEP.load(Ordering::Acquire)
    }
}

/// An end is told (`JobFinished`, `RunFinished`) only after its record is
/// durable (I-29), so a crash between the two leaves a record that says
/// ended and events that say running: the run's tree would show it running
/// for ever. Tells each such end again, from its record, and returns how
/// many. What only the lost event carried (a job's artifacts and
/// limitations, its turns) is not in the record and is not told.
fn retell_lost_ends(
    events: &EventBus,
    run: &RunRecord,
    history: &[arbor_protocol::Event],
    jobs: &[JobRecord],
) -> u32 {
    let told: std::collections::HashSet<JobId> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::JobFinished { result, .. } => Some(result.job),
            _ => None,
        })
        .collect();
    let run_told = history
        .iter()
        .any(|e| matches!(e.kind, EventKind::RunFinished { .. }));
    let spawned: std::collections::HashSet<JobId> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::JobSpawned { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let mut lost: Vec<&JobRecord> = jobs
        .iter()
        .filter(|j| j.status.is_terminal() && !told.contains(&j.id) && spawned.contains(&j.id))
        .collect();
    if lost.is_empty() && (run_told || !run.status.is_terminal()) {
        return 0;
    }
    events.load_run(run.id, history);
    // Deepest first, as they ended.
    lost.sort_by_key(|j| std::cmp::Reverse(j.depth));
    let mut retold = 0;
    for job in lost {
        let spent = Amount {
            tokens: job.tokens_spent,
            usd_micros: 0,
        };
        events.emit(
            run.id,
            EventKind::job_finished(end_of(job, spent), job.reason.clone(), false),
        );
        retold += 1;
    }
    if run.status.is_terminal() && !run_told {
        // What its optional steps left undone, as the run said it.
        let limitations = started_spec(history)
            .map(|spec| optional_limitations(spec, jobs))
            .unwrap_or_default();
        events.emit(
            run.id,
            EventKind::RunFinished {
                limitations,
                status: run.status,
                error_class: run.error_class,
                reason: run.reason.clone(),
                output: serde_json::from_str(&run.output_json).unwrap_or(serde_json::Value::Null),
            },
        );
        retold += 1;
    }
    retold
}

/// Kills what is left of a recorded process group: its leader if it is
/// still the same process, and every member that outlived it.
fn kill_if_same(sandbox: &SandboxRecord) -> bool {
    use nix::sys::signal::{Signal, kill};
    let members = arbor_sandbox::group_members(sandbox.pgid, sandbox.start_ticks, &sandbox.boot_id);
    for pid in &members {
        let _ = kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGKILL);
    }
    !members.is_empty()
}

/// Open holds by child, and tokens held for calls that never settled.
fn open_holds(entries: &[LedgerRecord]) -> (BTreeMap<JobId, u64>, u64) {
    let (holds, billed, unbilled) = open_calls(entries);
    (holds, billed + unbilled)
}

/// Open holds by child, and what is held for calls that never settled, in
/// two parts: calls to a billing provider (recovery charges them in full:
/// they may have cost that) and the rest (released at 0).
fn open_calls(entries: &[LedgerRecord]) -> (BTreeMap<JobId, u64>, u64, u64) {
    let mut holds = BTreeMap::new();
    // Reservations in order; a settle releases the oldest open one (an
    // account has one loop, so one call in flight at a time).
    let mut calls: std::collections::VecDeque<(u64, bool)> = Default::default();
    for entry in entries {
        match &entry.op {
            LedgerOp::Hold {
                child,
                amount: tokens,
            } => {
                holds.insert(*child, *tokens);
            }
            LedgerOp::Extend { child, amount } => {
                *holds.entry(*child).or_default() += amount;
            }
            LedgerOp::Release { child, .. } => {
                holds.remove(child);
            }
            LedgerOp::CallReserve { amount: tokens } => calls.push_back((*tokens, false)),
            LedgerOp::BilledCallReserve { amount: tokens } => calls.push_back((*tokens, true)),
            LedgerOp::CallSettle { reserved, .. } => {
                let mut left = *reserved;
                while left > 0 {
                    let Some(front) = calls.front_mut() else {
                        break;
                    };
                    let taken = front.0.min(left);
                    front.0 -= taken;
                    left -= taken;
                    if front.0 == 0 {
                        calls.pop_front();
                    }
                }
            }
            _ => {}
        }
    }
    let billed = calls.iter().filter(|c| c.1).map(|c| c.0).sum();
    let unbilled = calls.iter().filter(|c| !c.1).map(|c| c.0).sum();
    (holds, billed, unbilled)
}

/// A job's end as its record tells it; what a record does not keep (its
/// artifacts, limitations and turns) is empty.
fn end_of(job: &JobRecord, spent: Amount) -> ResultEnvelope {
    ResultEnvelope {
        label: job.label.clone(),
        attempt: job.attempt,
        task_status: job.task_status,
        output: serde_json::from_str(&job.output_json).unwrap_or(serde_json::Value::Null),
        error: (job.status != Status::Done)
            .then(|| job.reason.clone())
            .flatten(),
        error_class: job.error_class,
        tokens_spent: spent.tokens,
        usd_micros_spent: spent.usd_micros,
        workdir: job.workdir.clone(),
        ..ResultEnvelope::bare(job.id, &job.agent, job.status)
    }
}

fn ledger(epoch: u64, owner: ParentRef, unit: Unit, op: LedgerOp) -> Record {
    Record::Ledger(LedgerRecord {
        owner,
        unit,
        op,
        epoch,
    })
}

/// The ledgers an account has: tokens, and micro-dollars if it was opened with them.
fn units(entries: &[LedgerRecord]) -> &'static [Unit] {
    if usd_totals(entries).is_some() {
        &Unit::BOTH
    } else {
        &Unit::BOTH[..1]
    }
}

/// `amount`'s figure in `unit`.
fn figure(amount: &mut Amount, unit: Unit) -> &mut u64 {
    match unit {
        Unit::Tokens => &mut amount.tokens,
        Unit::UsdMicros => &mut amount.usd_micros,
    }
}

/// Settles one account's open holds: children with no record at 0, calls
/// uncharged, in each of its ledgers. Returns how many holds it released
/// (counted once for both units).
fn release_orphans(
    journal: &Journal,
    events: &EventBus,
    run: RunId,
    epoch: u64,
    owner: ParentRef,
    known: &HashMap<JobId, JobRecord>,
) -> Result<u32, arbor_storage::Error> {
    let entries = journal.ledger(owner)?;
    let mut records = vec![];
    let mut released = 0;
    let mut charged = Amount::ZERO;
    for &unit in units(&entries) {
        let (holds, billed, unbilled) = open_calls(&ledger_of(&entries, unit));
        let calls = billed + unbilled;
        let op = |op| ledger(epoch, owner, unit, op);
        for (child, granted) in holds {
            if !known.contains_key(&child) {
                records.push(op(LedgerOp::Release {
                    child,
                    granted,
                    spent: 0,
                }));
                released += u32::from(unit == Unit::Tokens);
            }
        }
        if calls > 0 {
            // A request a billing provider may have received is charged its
            // reservation; one that bills nothing (scripted) is released at 0.
            records.push(op(LedgerOp::CallSettle {
                reserved: calls,
                spent: billed,
            }));
            released += u32::from(unit == Unit::Tokens);
            *figure(&mut charged, unit) = billed;
        }
    }
    journal.append(records)?;
    // The charge is a model call's, so the tree sees it as one.
    if let (ParentRef::Job(id), true) = (owner, charged.tokens > 0) {
        events.emit(
            run,
            EventKind::ModelCalled {
                id,
                turn: 0,
                reserved: charged.tokens,
                input_tokens: charged.tokens,
                output_tokens: 0,
                truncated: false,
                wind_down: false,
                call: arbor_protocol::CallFacts {
                    usd_micros: charged.usd_micros,
                    outcome: "interrupted".into(),
                    usage_estimated: true,
                    ..Default::default()
                },
            },
        );
    }
    Ok(released)
}

fn publish_account(
    journal: &Journal,
    events: &EventBus,
    run: RunId,
    owner: ParentRef,
) -> Result<Amount, arbor_storage::Error> {
    let entries = journal.ledger(owner)?;
    let totals = ledger_totals(&entries, Unit::Tokens);
    let usd = usd_totals(&entries);
    events.emit(
        run,
        EventKind::AccountChanged {
            owner,
            grant: totals.grant,
            spent: totals.spent,
            held: totals.held,
            usd: usd.map(|u| arbor_protocol::AccountView {
                grant: u.grant,
                spent: u.spent,
                held: u.held,
            }),
        },
    );
    Ok(Amount {
        tokens: totals.spent,
        usd_micros: usd.map_or(0, |u| u.spent),
    })
}

fn recover_run(
    journal: &Journal,
    events: &EventBus,
    run: &RunRecord,
    killed_by_job: &HashMap<JobId, u32>,
    max_recoveries: u32,
    report: &mut RecoveryReport,
) -> Result<RunOutcome, arbor_storage::Error> {
    let epoch = journal.epoch();
    let history = journal.events(run.id)?;
    events.load_run(run.id, &history);
    let records = journal.jobs(run.id)?;
    report.ends_retold += retell_lost_ends(events, run, &history, &records);
    let spec = started_spec(&history).cloned();
    let jobs: HashMap<JobId, JobRecord> = records.into_iter().map(|j| (j.id, j)).collect();
    let mut interrupted: Vec<&JobRecord> =
        jobs.values().filter(|j| !j.status.is_terminal()).collect();
    // Deepest first: a parent is settled after its children, so its spent includes theirs.
    interrupted.sort_by_key(|j| std::cmp::Reverse(j.depth));
    let mut failed = 0;
    let mut released = 0;
    let mut processes = 0;
    for job in interrupted {
        released += fail_interrupted(journal, events, run.id, job, &jobs)?;
        report.jobs_failed.push(job.id);
        processes += killed_by_job.get(&job.id).copied().unwrap_or(0);
        failed += 1;
    }
    released += release_orphans(
        journal,
        events,
        run.id,
        epoch,
        ParentRef::Run(run.id),
        &jobs,
    )?;
    let run_spent = publish_account(journal, events, run.id, ParentRef::Run(run.id))?;
    report.grants_released += released;
    events.emit(
        run.id,
        EventKind::Recovered {
            epoch,
            jobs_failed: failed,
            processes_killed: processes,
            grants_released: released,
        },
    );
    // Re-read: the steps' records now say how each ended.
    let jobs = journal.jobs(run.id)?;
    let outcome = match spec {
        None => RunOutcome::Ended {
            status: Status::Failed,
            class: Some(ErrorClass::Interrupted),
            reason: "interrupted: its spec was not journaled, so it cannot resume".into(),
        },
        Some(spec) => match plan_resume(
            spec,
            &jobs,
            run_spent,
            &tool_counts(&history),
            &retry_waits(&history),
            &checks(&history),
            reviews(&history),
        ) {
            // I-48: each resume the node died under again counts. A drain
            // or a shutdown ends its runs, so only a death resumes one.
            RunOutcome::Resume { .. } if resumes(&history) >= max_recoveries => RunOutcome::Ended {
                status: Status::Failed,
                class: Some(ErrorClass::Parked),
                reason: format!(
                    "parked: the node died under this run each of the {} times it was \
                     resumed (limits.max_recoveries = {max_recoveries}), so it is not resumed \
                     again; its steps can be continued one by one with `arbor continue JOB`",
                    resumes(&history)
                ),
            },
            outcome => outcome,
        },
    };
    let mut outcome = outcome;
    if let RunOutcome::Resume { spec, resume } = &mut outcome {
        (resume.pause_deadline_ms, resume.pause_expired) = pause_at(&history);
        // An interrupted rescue runs again as the rescue it was: its
        // rescuer, on the request it was given.
        for (label, job) in &resume.interrupted {
            let Some(record) = jobs.iter().find(|j| j.id == *job) else {
                continue;
            };
            let Some(step) = spec.step(label) else {
                continue;
            };
            if step.on_fail.as_deref() == Some(record.agent.as_str()) && record.agent != step.agent
            {
                let request = history
                    .iter()
                    .find_map(|e| match &e.kind {
                        EventKind::JobSpawned { id, request, .. } if id == job => {
                            Some(request.clone())
                        }
                        _ => None,
                    })
                    .unwrap_or_else(|| step.instruction.clone());
                // The step's own last failed attempt: what it left.
                let failed = jobs
                    .iter()
                    .filter(|j| j.label.as_deref() == Some(label.as_str()) && j.agent == step.agent)
                    .max_by_key(|j| j.attempt)
                    .map(|j| j.workdir.clone())
                    .unwrap_or_default();
                resume
                    .rescues
                    .insert(label.clone(), (record.agent.clone(), request, failed));
            }
        }
        let ledger = journal.ledger(ParentRef::Run(run.id))?;
        resume.loops = loop_states(spec, &history, &jobs, &ledger);
        // I-57: a step that waits for a person is asked once, not at each restart.
        resume.asked = history
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::NeedsDecision { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
    }
    if let RunOutcome::Ended {
        status,
        class,
        reason,
    } = &outcome
    {
        let end = (*status, *class, reason.as_str());
        end_unresumed(journal, events, run, run_spent, end)?;
    }
    Ok(outcome)
}

/// How many times the run was resumed by a recovery (I-48).
fn resumes(history: &[arbor_protocol::Event]) -> u32 {
    history
        .iter()
        .filter(|e| matches!(e.kind, EventKind::RunResumed { .. }))
        .count() as u32
}

/// Each job's counted calls (I-45), from the `ToolStarted` events that made
/// each durable before it ran, and the run of identical calls it was on,
/// from its last `ToolCalled`.
pub fn tool_counts(history: &[arbor_protocol::Event]) -> HashMap<JobId, Made> {
    let mut counts: HashMap<JobId, Made> = HashMap::new();
    for event in history {
        match &event.kind {
            EventKind::ToolStarted { id, tool, .. } => {
                *counts
                    .entry(*id)
                    .or_default()
                    .calls
                    .entry(tool.clone())
                    .or_default() += 1;
            }
            EventKind::ToolCalled {
                id, repeat, digest, ..
            } if !digest.is_empty() => {
                counts.entry(*id).or_default().streak = Some((digest.clone(), *repeat));
            }
            _ => {}
        }
    }
    counts
}

/// I-47: every pending card keeps its id and its deadline. A card whose
/// deadline fell due while the node was down is expired now; one whose run
/// will not go on is cancelled. Cards of runs to resume are carried to the
/// gate, so the job that makes the same call again waits on the same card
/// (or hears its expiry) rather than asking again.
fn recover_cards(
    journal: &Journal,
    events: &EventBus,
    runs: Option<&[RunId]>,
    report: &mut RecoveryReport,
) -> Result<(), arbor_storage::Error> {
    let resumable: std::collections::HashSet<RunId> = report
        .runs
        .iter()
        .filter(|r| matches!(r.outcome, RunOutcome::Resume { .. }))
        .map(|r| r.run)
        .collect();
    let now = arbor_actors::events::now_ms();
    let records = match runs {
        None => journal.all_approvals()?,
        Some(ids) => {
            let mut records = Vec::new();
            for &id in ids {
                records.extend(journal.approvals(id)?);
            }
            records
        }
    };
    for record in records {
        if !record.state.is_pending() {
            continue;
        }
        let mut card = record.card();
        let (state, reason) = if !resumable.contains(&card.run) {
            (CardState::Cancelled, "its run ended")
        } else if card.deadline_ms <= now {
            (
                CardState::Expired,
                "no decision by the deadline, which fell due while the node was down",
            )
        } else {
            report.carried_cards.push(card);
            continue;
        };
        card.state = state;
        card.decision = Some(Decision {
            by: arbor_actors::approvals::NODE.into(),
            reason: Some(reason.into()),
            at_ms: now,
            edited: false,
            answer: None,
        });
        journal.append(vec![Record::Approval(ApprovalRecord::of(
            &card,
            report.epoch,
        ))])?;
        events.emit(
            card.run,
            EventKind::ApprovalDecided {
                id: card.job,
                card: card.id,
                state,
                by: arbor_actors::approvals::NODE.into(),
                reason: Some(reason.into()),
                waited_ms: now.saturating_sub(card.asked_at_ms),
            },
        );
        if state == CardState::Expired {
            report.carried_cards.push(card);
        }
    }
    Ok(())
}

/// Fails one job the node died under (I-30): its account closed at what it
/// had spent, its parent's hold on it released, its record and its end
/// told. Returns how many grants it released.
fn fail_interrupted(
    journal: &Journal,
    events: &EventBus,
    run: RunId,
    job: &JobRecord,
    jobs: &HashMap<JobId, JobRecord>,
) -> Result<u32, arbor_storage::Error> {
    let epoch = journal.epoch();
    let mut released = 0;
    let owner = ParentRef::Job(job.id);
    released += release_orphans(journal, events, run, epoch, owner, jobs)?;
    let entries = journal.ledger(owner)?;
    let parent_entries = journal.ledger(job.parent)?;
    let mut records = vec![];
    let mut spent = Amount::ZERO;
    for &unit in units(&entries) {
        let unit_spent = ledger_totals(&entries, unit).spent;
        *figure(&mut spent, unit) = unit_spent;
        records.push(ledger(
            epoch,
            owner,
            unit,
            LedgerOp::Close { spent: unit_spent },
        ));
        let (parent_holds, _) = open_holds(&ledger_of(&parent_entries, unit));
        if let Some(granted) = parent_holds.get(&job.id) {
            records.push(ledger(
                epoch,
                job.parent,
                unit,
                LedgerOp::Release {
                    child: job.id,
                    granted: *granted,
                    spent: unit_spent,
                },
            ));
            released += u32::from(unit == Unit::Tokens);
        }
    }
    records.push(Record::Job(JobRecord {
        status: Status::Failed,
        task_status: Some(arbor_protocol::TaskStatus::Failed),
        error_class: Some(ErrorClass::Interrupted),
        reason: Some(INTERRUPTED.into()),
        output_json: "null".into(),
        tokens_spent: spent.tokens,
        epoch,
        ..job.clone()
    }));
    journal.append(records)?;
    publish_account(journal, events, run, owner)?;
    publish_account(journal, events, run, job.parent)?;
    events.emit(
        run,
        EventKind::job_finished(
            ResultEnvelope {
                status: Status::Failed,
                task_status: Some(arbor_protocol::TaskStatus::Failed),
                error_class: Some(ErrorClass::Interrupted),
                error: Some(INTERRUPTED.into()),
                output: serde_json::Value::Null,
                ..end_of(job, spent)
            },
            Some(INTERRUPTED.into()),
            false,
        ),
    );
    Ok(released)
}

/// Ends a run recovery does not resume: its account closed, its record and
/// its end told.
fn end_unresumed(
    journal: &Journal,
    events: &EventBus,
    run: &RunRecord,
    run_spent: Amount,
    (status, class, reason): (Status, Option<ErrorClass>, &str),
) -> Result<(), arbor_storage::Error> {
    let epoch = journal.epoch();
    let output = serde_json::Value::Null;
    let run_entries = journal.ledger(ParentRef::Run(run.id))?;
    let mut records: Vec<Record> = units(&run_entries)
        .iter()
        .map(|&unit| {
            let spent = *figure(&mut { run_spent }, unit);
            ledger(
                epoch,
                ParentRef::Run(run.id),
                unit,
                LedgerOp::Close { spent },
            )
        })
        .collect();
    records.push(Record::Run(RunRecord {
        status,
        error_class: class,
        reason: Some(reason.to_string()),
        output_json: output.to_string(),
        epoch,
        ..run.clone()
    }));
    journal.append(records)?;
    events.emit(
        run.id,
        EventKind::RunFinished {
            limitations: Vec::new(),
            status,
            error_class: class,
            reason: Some(reason.to_string()),
            output,
        },
    );
    Ok(())
}

/// The limitations of a run: each optional step whose latest attempt
/// ended, not done and not interrupted. Pure.
pub fn optional_limitations(spec: &RunSpec, jobs: &[JobRecord]) -> Vec<String> {
    let labels = spec.step_labels();
    spec.groups
        .iter()
        .zip(&labels)
        .flat_map(|(group, labels)| group.steps.iter().zip(labels))
        .filter(|(step, _)| step.optional)
        .filter_map(|(step, label)| {
            let job = latest_step(jobs, label)?;
            let class = job.error_class.unwrap_or(ErrorClass::Task);
            let retried = job.status == Status::Failed
                && step
                    .retry
                    .as_ref()
                    .is_some_and(|p| p.retries(job.attempt, class));
            let ended = job.status.is_terminal()
                && job.status != Status::Done
                && !retried
                && job.error_class != Some(ErrorClass::Interrupted);
            ended.then(|| {
                StepSpec::optional_limitation(
                    label,
                    job.status,
                    job.reason.as_deref().unwrap_or_default(),
                )
            })
        })
        .collect()
}

/// When each journaled retry wait ends, by the attempt that failed (I-56).
pub fn retry_waits(history: &[arbor_protocol::Event]) -> HashMap<JobId, u64> {
    history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::RetryWaiting { id, until_ms, .. } => Some((*id, *until_ms)),
            _ => None,
        })
        .collect()
}

/// A loop's iteration as its check found it (`iteration_checked`), and its step's label.
pub type Checked = (String, arbor_protocol::IterationView);

/// The run's review (`verify`) as journaled (`Reviewed`): its reviewer's
/// job, whether it accepted, what was missing, why it could not be made.
#[derive(Clone, Debug)]
pub struct Reviewed {
    pub job: JobId,
    pub accept: bool,
    pub missing: Vec<String>,
    pub failed: Option<String>,
}

/// The run's review, if it was made.
/// Where a run's budget pause was when it stopped (I-58): the deadline of
/// an open one (the last `budget_reached` with no `budget_pause_ended`
/// after it), and whether one expired (the run pauses no more).
pub fn pause_at(history: &[arbor_protocol::Event]) -> (Option<u64>, bool) {
    history
        .iter()
        .fold((None, false), |(open, expired), event| match &event.kind {
            EventKind::BudgetReached { deadline_ms, .. } => (Some(*deadline_ms), expired),
            EventKind::BudgetPauseEnded { expired: now } => (None, expired || *now),
            _ => (open, expired),
        })
}

pub fn reviews(history: &[arbor_protocol::Event]) -> Option<Reviewed> {
    history.iter().rev().find_map(|e| match &e.kind {
        EventKind::Reviewed {
            id,
            accept,
            missing,
            failed,
        } => Some(Reviewed {
            job: *id,
            accept: *accept,
            missing: missing.clone(),
            failed: failed.clone(),
        }),
        _ => None,
    })
}

/// Where a run's review left it: the review to resume, the reviewer's
/// answer not yet recorded, and the records to plan by (a last group a
/// review sent round again is planned by its attempts after the review).
fn review_at(
    spec: &RunSpec,
    jobs: &[JobRecord],
    review: Option<Reviewed>,
) -> (Option<Review>, Option<ResultEnvelope>, Vec<JobRecord>) {
    let Some(review) = review else {
        let answer = latest_step(jobs, RunSpec::REVIEW_LABEL)
            .filter(|j| j.status == Status::Done)
            .map(envelope_of);
        return (None, answer, jobs.to_vec());
    };
    if review.accept || review.failed.is_some() {
        return (Some(Review::Made), None, jobs.to_vec());
    }
    let labels = spec.step_labels();
    let last = labels.last().cloned().unwrap_or_default();
    let before = |j: &JobRecord| {
        j.kind == NodeKind::Step
            && j.id < review.job
            && j.label.as_ref().is_some_and(|l| last.contains(l))
    };
    let answers = last
        .iter()
        .filter_map(|label| {
            let job = jobs
                .iter()
                .filter(|j| before(j) && j.label.as_deref() == Some(label))
                .max_by_key(|j| j.attempt)?;
            let output = serde_json::from_str(&job.output_json).unwrap_or_default();
            Some((label.clone(), output))
        })
        .collect();
    let after = jobs.iter().filter(|j| !before(j)).cloned().collect();
    let rerun = Review::Rerun {
        missing: review.missing,
        answers,
    };
    (Some(rerun), None, after)
}

/// Every journaled check of a loop's iteration, by the attempt checked (I-56).
pub fn checks(history: &[arbor_protocol::Event]) -> HashMap<JobId, Checked> {
    history
        .iter()
        .filter_map(|e| arbor_protocol::IterationView::of(&e.kind))
        .map(|(label, view)| (view.job, (label.to_string(), view)))
        .collect()
}

/// I-56: each looping step's loop where it was: its iteration (one more
/// than the checks that sent it round again), when it began, what its
/// iterations and judges spent (the run's ledger, both units), and what
/// the next iteration is told.
fn loop_states(
    spec: &RunSpec,
    history: &[arbor_protocol::Event],
    jobs: &[JobRecord],
    ledger: &[LedgerRecord],
) -> HashMap<String, LoopState> {
    let checked = checks(history);
    let mut loops = HashMap::new();
    let labels = spec.step_labels();
    let steps = spec.groups.iter().flat_map(|g| g.steps.iter());
    for (step, label) in steps.zip(labels.iter().flatten()) {
        if step.until.is_none() {
            continue;
        }
        let judge = StepSpec::judge_label(label);
        let ours = |l: Option<&str>| l == Some(label.as_str()) || l == Some(judge.as_str());
        let mut rounds: Vec<(&JobId, &Checked)> = checked
            .iter()
            .filter(|(_, (l, c))| l == label && !c.passed && c.ended.is_none())
            .collect();
        rounds.sort_by_key(|(_, (_, c))| c.iteration);
        let previous = rounds.last().map(|(job, (_, c))| {
            let output = jobs
                .iter()
                .find(|j| j.id == **job)
                .and_then(|j| serde_json::from_str(&j.output_json).ok())
                .unwrap_or(serde_json::Value::Null);
            (output, c.issues.clone())
        });
        let since_ms = history
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::JobSpawned { label: l, .. } if l.as_deref() == Some(label) => {
                    Some(e.at_ms)
                }
                _ => None,
            })
            .min()
            .unwrap_or_else(arbor_actors::events::now_ms);
        let mut spent = Amount::ZERO;
        for entry in ledger {
            if let LedgerOp::Release {
                child, spent: s, ..
            } = entry.op
                && jobs
                    .iter()
                    .any(|j| j.id == child && ours(j.label.as_deref()))
            {
                *figure(&mut spent, entry.unit) += s;
            }
        }
        loops.insert(
            label.clone(),
            LoopState {
                iteration: rounds.len() as u32 + 1,
                since_ms,
                spent,
                previous,
            },
        );
    }
    loops
}

/// The latest attempt of the step `label`.
fn latest_step<'a>(jobs: &'a [JobRecord], label: &str) -> Option<&'a JobRecord> {
    jobs.iter()
        .filter(|j| j.kind == NodeKind::Step && j.label.as_deref() == Some(label))
        .max_by_key(|j| j.attempt)
}

/// I-45: a step's next attempt starts from the calls its interrupted
/// attempts made, back to the last attempt that ended otherwise, and on
/// the streak of identical calls the latest was on: a restart never
/// resets a limit or `max_repeats`.
fn carried_counts(jobs: &[JobRecord], counts: &HashMap<JobId, Made>) -> HashMap<String, Made> {
    let mut tool_counts: HashMap<String, Made> = HashMap::new();
    let mut steps: Vec<&JobRecord> = jobs.iter().filter(|j| j.kind == NodeKind::Step).collect();
    steps.sort_by_key(|j| std::cmp::Reverse(j.attempt));
    let mut closed: std::collections::HashSet<&str> = Default::default();
    for step in steps {
        let Some(label) = step.label.as_deref() else {
            continue;
        };
        if closed.contains(label) {
            continue;
        }
        if step.error_class != Some(ErrorClass::Interrupted) {
            closed.insert(label);
            continue;
        }
        let made = tool_counts.entry(label.to_string()).or_default();
        let Some(theirs) = counts.get(&step.id) else {
            continue;
        };
        for (tool, n) in &theirs.calls {
            *made.calls.entry(tool.clone()).or_default() += n;
        }
        // The latest interrupted attempt (visited first) was on the streak
        // the next attempt goes on.
        if made.streak.is_none() {
            made.streak = theirs.streak.clone();
        }
    }
    tool_counts
}

/// How many attempts of the step `label` a restart cut.
fn interruptions(jobs: &[JobRecord], label: &str) -> u32 {
    jobs.iter()
        .filter(|j| j.kind == NodeKind::Step && j.label.as_deref() == Some(label))
        .filter(|j| j.error_class == Some(ErrorClass::Interrupted) || !j.status.is_terminal())
        .count() as u32
}

/// A step's failed attempt, as its rescuer is told of it.
fn failed_of(label: &str, job: &JobRecord) -> Failed {
    Failed {
        label: label.to_string(),
        attempt: job.attempt,
        class: job.error_class.unwrap_or(ErrorClass::Task),
        error: job.reason.clone().unwrap_or_default(),
        output: serde_json::from_str(&job.output_json).unwrap_or(serde_json::Value::Null),
        workdir: job.workdir.clone(),
    }
}

/// The wait before a failed attempt's next one, its end not yet known.
fn retry_of(label: &str, job: &JobRecord) -> RetryWait {
    RetryWait {
        failed: job.id,
        label: label.to_string(),
        attempt: job.attempt + 1,
        class: job.error_class.unwrap_or(ErrorClass::Task),
        error: job.reason.clone().unwrap_or_default(),
        until_ms: None,
    }
}

/// The latest attempt of each step, by label.
fn attempts_by_label(jobs: &[JobRecord]) -> HashMap<String, u32> {
    let mut attempts: HashMap<String, u32> = HashMap::new();
    for job in jobs.iter().filter(|j| j.kind == NodeKind::Step) {
        if let Some(label) = &job.label {
            let latest = attempts.entry(label.clone()).or_insert(0);
            *latest = (*latest).max(job.attempt);
        }
    }
    attempts
}

/// Where a looping step's latest iteration left its loop, when it ended
/// done and did not pass: the next iteration is due, or its check was not
/// made (a judge that had answered is not asked again).
enum LoopAt {
    Next,
    Check(Box<CheckNow>),
}

fn loop_at(
    step: &StepSpec,
    label: &str,
    jobs: &[JobRecord],
    checks: &HashMap<JobId, Checked>,
) -> Option<LoopAt> {
    step.until.as_ref()?;
    let job = latest_step(jobs, label)?;
    if job.status != Status::Done || job.agent != step.agent {
        return None;
    }
    match checks.get(&job.id) {
        Some((_, c)) if c.passed => None,
        Some(_) => Some(LoopAt::Next),
        None => {
            let judge = StepSpec::judge_label(label);
            let judged = jobs
                .iter()
                .filter(|j| j.label.as_deref() == Some(judge.as_str()))
                .filter(|j| j.status == Status::Done && j.id > job.id)
                .max_by_key(|j| j.attempt)
                .map(envelope_of);
            Some(LoopAt::Check(Box::new(CheckNow {
                envelope: envelope_of(job),
                judged,
            })))
        }
    }
}

/// The records as recovery reads them: a loop that ended without passing
/// failed its step for good (`check_failed`), though its last iteration's
/// record says done.
fn loops_failed(jobs: &[JobRecord], checks: &HashMap<JobId, Checked>) -> Vec<JobRecord> {
    jobs.iter()
        .map(|job| match checks.get(&job.id) {
            Some((_, c)) if !c.passed && c.ended.is_some() => JobRecord {
                status: Status::Failed,
                task_status: Some(arbor_protocol::TaskStatus::Failed),
                error_class: Some(ErrorClass::CheckFailed),
                reason: Some(arbor_protocol::Until::failure(
                    c.iteration,
                    c.ended.as_deref().unwrap_or_default(),
                    c.verdict,
                    &c.issues,
                )),
                ..job.clone()
            },
            _ => job.clone(),
        })
        .collect()
}

/// One step of the group a run resumes in, as its latest attempt left
/// it: what `at` keeps, waits on or runs again; whether the step is done;
/// or why the run cannot resume.
fn step_at(
    step: &StepSpec,
    label: &str,
    jobs: &[JobRecord],
    waits: &HashMap<JobId, u64>,
    checks: &HashMap<JobId, Checked>,
    at: &mut Resume,
) -> Result<bool, RunOutcome> {
    match loop_at(step, label, jobs, checks) {
        None => {}
        Some(LoopAt::Next) => return Ok(false),
        Some(LoopAt::Check(check)) => {
            at.kept.push(check.envelope.clone());
            at.check_now.push(*check);
            return Ok(false);
        }
    }
    let mut done = true;
    match latest_step(jobs, label) {
        Some(job) if job.status == Status::Done => at.kept.push(envelope_of(job)),
        Some(job)
            if job.error_class == Some(ErrorClass::Interrupted)
                || job.status == Status::Pending
                || job.status == Status::Running =>
        {
            done = false;
            at.interrupted.insert(label.to_string(), job.id);
            if interruptions(jobs, label) > step.retries() {
                return Err(RunOutcome::Ended {
                    status: Status::Failed,
                    class: Some(ErrorClass::Interrupted),
                    reason: format!(
                        "step {label} was interrupted by a restart and its retries ({}) are used up",
                        step.retries()
                    ),
                });
            }
        }
        // A failure its retry policy tries again: the wait goes on (I-56).
        Some(job)
            if job.status == Status::Failed
                && job.agent == step.agent
                && step.retry.as_ref().is_some_and(|p| {
                    p.retries(job.attempt, job.error_class.unwrap_or(ErrorClass::Task))
                }) =>
        {
            done = false;
            at.retry_waits.push(RetryWait {
                until_ms: waits.get(&job.id).copied(),
                ..retry_of(label, job)
            });
        }
        // Failed for good, its rescuer yet to take over (a crash
        // came between): it does now, once.
        Some(job)
            if job.status == Status::Failed
                && step.on_fail.is_some()
                && job.agent == step.agent =>
        {
            done = false;
            at.rescue_now.push(failed_of(label, job));
        }
        // An optional step's end does not fail the run.
        Some(job) if step.optional && job.status.is_terminal() => {
            at.kept.push(envelope_of(job));
        }
        Some(job) => {
            return Err(RunOutcome::Ended {
                status: Status::Failed,
                class: job.error_class.or(Some(ErrorClass::Task)),
                reason: format!(
                    "step {label} {} before the restart: {}",
                    job.status,
                    job.reason.clone().unwrap_or_default()
                ),
            });
        }
        None => done = false,
    }
    Ok(done)
}

/// I-05: every job that started spent a spawn, however it ended; only a
/// job whose actor never started (class `start`) was given its count back.
fn spawns(jobs: &[JobRecord]) -> u64 {
    jobs.iter()
        .filter(|j| j.kind == NodeKind::Job && j.error_class != Some(ErrorClass::Start))
        .count() as u64
}

/// I-34: where the run picks up, or why it cannot. Pure. `waits`: when
/// each journaled retry wait ends, by the attempt that failed; `checks`:
/// each loop iteration's check, by the attempt checked (I-56).
pub fn plan_resume(
    spec: RunSpec,
    jobs: &[JobRecord],
    spent: Amount,
    counts: &HashMap<JobId, Made>,
    waits: &HashMap<JobId, u64>,
    checks: &HashMap<JobId, Checked>,
    review: Option<Reviewed>,
) -> RunOutcome {
    let looped = loops_failed(jobs, checks);
    // I-05 and attempt numbers count every attempt, those a review sent round again too.
    let attempts = attempts_by_label(&looped);
    let spawned = spawns(&looped);
    let (review, reviewed_now, planned) = review_at(&spec, &looped, review);
    let jobs = &planned[..];
    let tool_counts = carried_counts(jobs, counts);
    let labels = spec.step_labels();
    let mut previous = vec![];
    let mut before_last = vec![];
    for (g, (group, labels)) in spec.groups.iter().zip(&labels).enumerate() {
        if g + 1 == spec.groups.len() {
            before_last = previous.clone();
        }
        let mut at = Resume::default();
        let mut all_done = true;
        for (step, label) in group.steps.iter().zip(labels) {
            match step_at(step, label, jobs, waits, checks, &mut at) {
                Ok(done) => all_done &= done,
                Err(ended) => return ended,
            }
        }
        if all_done {
            // Like a running run, the next group sees the last finished group's results.
            previous = at
                .kept
                .iter()
                .map(|e| (e.label.clone().unwrap_or_default(), e.output.clone()))
                .collect();
            continue;
        }
        return RunOutcome::Resume {
            spec: Box::new(spec.clone()),
            resume: Box::new(Resume {
                group: g,
                previous,
                attempts,
                spent,
                spawned,
                tool_counts,
                limitations: optional_limitations(&spec, jobs),
                review,
                before_last,
                ..at
            }),
        };
    }
    // Every group had finished: only the run's own end was lost.
    RunOutcome::Resume {
        resume: Box::new(Resume {
            group: spec.groups.len(),
            previous,
            attempts,
            spent,
            spawned,
            tool_counts,
            limitations: optional_limitations(&spec, jobs),
            review,
            reviewed_now,
            before_last,
            ..Resume::default()
        }),
        spec: Box::new(spec),
    }
}

fn envelope_of(job: &JobRecord) -> ResultEnvelope {
    ResultEnvelope {
        job: job.id,
        label: job.label.clone(),
        attempt: job.attempt,
        agent: job.agent.clone(),
        status: job.status,
        task_status: job.task_status,
        output: serde_json::from_str(&job.output_json).unwrap_or(serde_json::Value::Null),
        error: job.reason.clone(),
        error_class: job.error_class,
        limitations: vec![],
        artifacts: vec![],
        tokens_spent: job.tokens_spent,
        usd_micros_spent: 0,
        turns: 0,
        workdir: job.workdir.clone(),
    }
}
