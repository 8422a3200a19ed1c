//! Schedules: `GET /v1/schedules`, pause, unpause, trigger and backfill,
//! and `run_due`, which moves every schedule to the clock's time (a task
//! calls it every second; a test, with its own clock). What a schedule
//! does next is `crate::schedules::next`; each step here is one commit, a
//! started tick committed with its run's submission (I-66).

use super::common::{Reply, S, accepting, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::credentials::Caller;
use crate::error::ApiError;
use crate::extract::{JsonBody, Path};
use crate::schedules::{
    self, Cause, ScheduleRecord, ScheduleState, Step, TickOutcome, paused, read_state, read_tick,
};
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use arbor_protocol::{RunId, ScheduleTick, Status};
use arbor_runtime::schedules::{Schedule, parse_time, tick_text};
use arbor_storage::Record;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

/// The bound on one backfill's ticks.
pub const MAX_BACKFILL: usize = 1000;

/// The bound on the steps one schedule takes in one `run_due`: a node far
/// behind catches up over several seconds rather than in one long lock.
const MAX_STEPS: usize = 100;

pub(super) fn schedule_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/schedules",
            get_with(list, |op| {
                errors!(
                    secured(op)
                        .id("listSchedules")
                        .summary("Every schedule of the workspace's flows")
                        .response_with::<200, Json<ScheduleList>, _>(|r| r),
                    403
                )
            }),
        )
        .api_route(
            "/v1/schedules/{name}/pause",
            post_with(pause, |op| {
                errors!(
                    secured(op)
                        .id("pauseSchedule")
                        .summary("Pause a schedule: its ticks start nothing, and are not caught up")
                        .response_with::<200, Json<ScheduleView>, _>(|r| r),
                    403,
                    404,
                    503
                )
            }),
        )
        .api_route(
            "/v1/schedules/{name}/unpause",
            post_with(unpause, |op| {
                errors!(
                    secured(op)
                        .id("unpauseSchedule")
                        .summary("Unpause a schedule from its next tick on")
                        .response_with::<200, Json<ScheduleView>, _>(|r| r),
                    403,
                    404,
                    503
                )
            }),
        )
        .api_route(
            "/v1/schedules/{name}/trigger",
            post_with(trigger, |op| {
                errors!(
                    secured(op)
                        .id("triggerSchedule")
                        .summary("Start a run of a schedule now, whatever its overlap")
                        .response_with::<201, Json<RunCreated>, _>(|r| r.description("Queued")),
                    403,
                    404,
                    422,
                    429,
                    503
                )
            }),
        )
        .api_route(
            "/v1/schedules/{name}/backfill",
            post_with(backfill, |op| {
                errors!(
                    secured(op)
                        .id("backfillSchedule")
                        .summary("Start a run for each of a schedule's ticks from `from` to `to`")
                        .description(
                            "Ticks that started a run before are left as they are; at most 1000 \
                             ticks at once. The runs start whatever the schedule's overlap.",
                        )
                        .response_with::<200, Json<BackfillResult>, _>(|r| r),
                    400,
                    403,
                    404,
                    413,
                    415,
                    422,
                    503
                )
            }),
        )
}

/// Moves every schedule to `now` (ms): what its ticks up to then do.
pub(crate) async fn run_due(shared: &Shared, now: u64) -> Result<(), ApiError> {
    if accepting(shared).is_err() {
        return Ok(());
    }
    for schedule in shared.workspace().schedules.values() {
        advance(shared, schedule, now).await?;
    }
    Ok(())
}

/// A schedule's state, read under its lock: the guards to hold while it
/// changes, and the state (a first look starts it at `now`).
async fn locked<'a>(
    shared: &'a Shared,
    name: &str,
    now: u64,
) -> Result<(Locks<'a>, ScheduleState), ApiError> {
    let local = shared.schedule_lock.lock().await;
    let journal = shared.node.journal();
    let shared_lock = journal.exclusive(&format!("schedule/{name}"))?;
    let state = match read_state(journal, name)? {
        Some(state) => state,
        None => {
            let state = ScheduleState {
                cursor_ms: now,
                ..ScheduleState::default()
            };
            commit(
                shared,
                vec![ScheduleRecord::state(name, &state, journal.epoch())?],
            )
            .await?;
            state
        }
    };
    Ok(((local, shared_lock), state))
}

type Locks<'a> = (tokio::sync::MutexGuard<'a, ()>, arbor_storage::Exclusive);

async fn commit(shared: &Shared, records: Vec<Record>) -> Result<(), ApiError> {
    shared.node.journal().commit(records).await?;
    Ok(())
}

async fn advance(shared: &Shared, schedule: &Schedule, now: u64) -> Result<(), ApiError> {
    let name = schedule.name.as_str();
    let (_locks, mut state) = locked(shared, name, now).await?;
    let epoch = shared.node.journal().epoch();
    let before = state.active.len();
    state.active.retain(|run| !ended(shared, *run));
    if state.active.len() != before {
        commit(shared, vec![ScheduleRecord::state(name, &state, epoch)?]).await?;
    }
    for _ in 0..MAX_STEPS {
        let Some(step) = schedules::next(schedule, &state, now) else {
            break;
        };
        let tick_row = |tick, outcome| ScheduleRecord::tick(name, tick, outcome, now, epoch);
        match step {
            Step::Pass { to } => {
                state.cursor_ms = to;
                commit(shared, vec![ScheduleRecord::state(name, &state, epoch)?]).await?;
            }
            Step::Missed { from, to, count } => {
                tracing::warn!(schedule = name, from = %tick_text(from), to = %tick_text(to), count,
                    "schedule ticks were missed: no node ran within their catch-up window");
                shared.metrics.schedule_ticks(name, "missed", count);
                state.cursor_ms = to;
                let missed = TickOutcome::Missed {
                    from_ms: from,
                    count,
                };
                let mut rows = vec![
                    tick_row(to, missed)?,
                    ScheduleRecord::state(name, &state, epoch)?,
                ];
                // Told to `[notify]`'s endpoints that ask for it, with the record.
                let notify = shared.node.notifications().map(|n| {
                    let data = serde_json::json!({
                        "schedule": name, "flow": schedule.flow, "from": tick_text(from),
                        "to": tick_text(to), "count": count,
                        "links": {"schedules": "/v1/schedules"},
                    });
                    n.schedule_missed(data, now)
                });
                let deliver = notify.map(|(records, deliver)| {
                    rows.extend(records);
                    deliver
                });
                let seq = shared.node.journal().commit(rows).await?;
                if let Some(deliver) = deliver {
                    deliver(seq);
                }
            }
            Step::Skip { tick, why } => {
                shared.metrics.schedule_ticks(name, "skipped", 1);
                state.cursor_ms = tick;
                let rows = vec![
                    tick_row(tick, TickOutcome::Skipped { why })?,
                    ScheduleRecord::state(name, &state, epoch)?,
                ];
                commit(shared, rows).await?;
            }
            Step::Buffer { tick } => {
                state.cursor_ms = tick;
                state.buffered.push(tick);
                let rows = vec![
                    tick_row(tick, TickOutcome::Buffered)?,
                    ScheduleRecord::state(name, &state, epoch)?,
                ];
                commit(shared, rows).await?;
            }
            Step::StartBuffered { tick } => {
                state.buffered.remove(0);
                if !start(shared, schedule, &mut state, tick, Cause::Cron, now).await? {
                    break;
                }
            }
            Step::Start { tick, cancel } => {
                for run in &cancel {
                    stop(shared, *run).await;
                }
                state.cursor_ms = tick;
                state.active.retain(|run| !cancel.contains(run));
                if !start(shared, schedule, &mut state, tick, Cause::Cron, now).await? {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Starts `tick`'s run, committing `state` (with the run among its active
/// ones) and the tick's record with its submission. A refusal (a full
/// queue, a quota) is the tick's outcome, skipped; false: the node takes no
/// work now, and nothing was committed (the tick is the next node's).
async fn start(
    shared: &Shared,
    schedule: &Schedule,
    state: &mut ScheduleState,
    tick: u64,
    cause: Cause,
    now: u64,
) -> Result<bool, ApiError> {
    let name = schedule.name.as_str();
    let epoch = shared.node.journal().epoch();
    let refused = |why: String, state: &ScheduleState| -> Result<Vec<Record>, ApiError> {
        Ok(vec![
            ScheduleRecord::tick(name, tick, TickOutcome::Skipped { why }, now, epoch)?,
            ScheduleRecord::state(name, state, epoch)?,
        ])
    };
    let tenant = schedule
        .tenant
        .clone()
        .unwrap_or_else(|| arbor_protocol::DEFAULT_TENANT.to_string());
    let submit = SubmitRun {
        flow: Some(schedule.flow.clone()),
        input: schedule.input.clone(),
        budget: schedule.budget.clone(),
        ..SubmitRun::default()
    };
    let mut spec = match super::runs::resolve(shared, &submit, &tenant) {
        Ok(spec) => spec,
        Err(e) => {
            commit(shared, refused(e.message.to_string(), state)?).await?;
            return Ok(true);
        }
    };
    spec.schedule = Some(ScheduleTick {
        name: name.to_string(),
        tick: tick_text(tick),
    });
    let key = format!("{tenant}/schedule/{name}/{tick}");
    let mut after = state.clone();
    let submitted = shared
        .admission
        .submit_with(&spec, Some(key), "schedule".into(), None, |run| {
            after.active.push(run);
            let started = TickOutcome::Started { run, cause };
            [
                ScheduleRecord::tick(name, tick, started, now, epoch),
                ScheduleRecord::state(name, &after, epoch),
            ]
            .into_iter()
            .filter_map(Result::ok)
            .collect()
        })
        .await;
    match submitted {
        Ok(crate::admission::Submitted::New(run)) => {
            tracing::info!(schedule = name, tick = %tick_text(tick), %run, "a schedule's tick started a run");
            shared.metrics.schedule_ticks(name, "started", 1);
            *state = after;
            Ok(true)
        }
        // This node started it before: the tick is done.
        Ok(crate::admission::Submitted::Replayed(_)) => {
            commit(shared, vec![ScheduleRecord::state(name, state, epoch)?]).await?;
            Ok(true)
        }
        Err(crate::admission::SubmitError::Closed) => Ok(false),
        Err(crate::admission::SubmitError::Journal(e)) => Err(e.into()),
        Err(e) => {
            let why = ApiError::from(e).message;
            tracing::warn!(schedule = name, tick = %tick_text(tick), %why, "a schedule's tick was refused");
            shared.metrics.schedule_ticks(name, "skipped", 1);
            commit(shared, refused(why, state)?).await?;
            Ok(true)
        }
    }
}

/// Whether `run` has ended (or is forgotten): a queued or running run has not.
fn ended(shared: &Shared, run: RunId) -> bool {
    let journal = shared.node.journal();
    match journal.run(run) {
        Ok(Some(record)) => record.status.is_terminal(),
        Ok(None) => match crate::submission::submission(journal, run) {
            Ok(Some(sub)) => !matches!(
                sub.state,
                crate::SubmissionState::Queued | crate::SubmissionState::Started
            ),
            Ok(None) => true,
            Err(_) => false,
        },
        Err(_) => false,
    }
}

/// Stops a run of the schedule's (`cancel_other`): queued, here, or on
/// its owner. A run that ended meanwhile is left alone.
async fn stop(shared: &Shared, run: RunId) {
    let reason = "stopped by its schedule's next tick (overlap = cancel_other)";
    let stopped = match shared.admission.cancel(run, reason, None).await {
        Ok(true) => Ok(()),
        _ => match crate::forward::elsewhere(shared, run) {
            Ok(Some(owner)) => crate::forward::send(
                shared,
                run,
                &owner,
                crate::forward::Forwarded::StopRun { run },
            )
            .await
            .map(|_| ()),
            _ => shared
                .node
                .stop_run_with(run, reason, None)
                .await
                .map_err(|e| ApiError::conflict(e.to_string())),
        },
    };
    if let Err(e) = stopped {
        tracing::info!(%run, error = %e.message, "a schedule's earlier run was not stopped");
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The schedule `name`, if the caller's tenant has it.
fn find(shared: &Shared, caller: &Caller, name: &str) -> Result<Schedule, ApiError> {
    shared
        .workspace()
        .schedules
        .get(name)
        .filter(|s| crate::tenancy::sees(caller, tenant_of(s)))
        .cloned()
        .ok_or_else(|| ApiError::not_found(format!("no schedule {name}")))
}

fn tenant_of(schedule: &Schedule) -> &str {
    schedule
        .tenant
        .as_deref()
        .unwrap_or(arbor_protocol::DEFAULT_TENANT)
}

fn view(schedule: &Schedule, state: Option<&ScheduleState>, now: u64) -> ScheduleView {
    let is_paused = state.map_or(schedule.paused, |s| paused(schedule, s));
    let next = (!is_paused)
        .then(|| schedule.next_after(now))
        .flatten()
        .map(|t| tick_text(t + schedule.jitter_ms(t)));
    ScheduleView {
        name: schedule.name.clone(),
        flow: schedule.flow.clone(),
        cron: schedule.cron.clone(),
        timezone: schedule.timezone.name().to_string(),
        paused: is_paused,
        next_fire_at: next,
        overlap: schedule.overlap,
        catchup_window_s: schedule.catchup_window.as_secs(),
        tenant: schedule.tenant.clone(),
        active: state.map(|s| s.active.clone()).unwrap_or_default(),
        buffered: state
            .map(|s| s.buffered.iter().map(|t| tick_text(*t)).collect())
            .unwrap_or_default(),
    }
}

async fn list(State(shared): S, axum::Extension(caller): axum::Extension<Caller>) -> Reply {
    let now = now_ms();
    let journal = shared.node.journal();
    let mut schedules = vec![];
    for schedule in shared.workspace().schedules.values() {
        if crate::tenancy::sees(&caller, tenant_of(schedule)) {
            let state = read_state(journal, &schedule.name)?;
            schedules.push(view(schedule, state.as_ref(), now));
        }
    }
    Ok(json(StatusCode::OK, ScheduleList { schedules }))
}

async fn pause(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(path): Path<NamePath>,
) -> Reply {
    set_paused(&shared, &caller, &path.name, true).await
}

async fn unpause(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(path): Path<NamePath>,
) -> Reply {
    set_paused(&shared, &caller, &path.name, false).await
}

async fn set_paused(shared: &Shared, caller: &Caller, name: &str, to: bool) -> Reply {
    let schedule = find(shared, caller, name)?;
    accepting(shared)?;
    let now = now_ms();
    let (_locks, mut state) = locked(shared, name, now).await?;
    state.paused = Some(to);
    // Ticks that passed while it was paused are not caught up.
    if !to {
        state.cursor_ms = state.cursor_ms.max(now);
    }
    let epoch = shared.node.journal().epoch();
    commit(shared, vec![ScheduleRecord::state(name, &state, epoch)?]).await?;
    Ok(json(StatusCode::OK, view(&schedule, Some(&state), now)))
}

async fn trigger(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(path): Path<NamePath>,
) -> Reply {
    let schedule = find(&shared, &caller, &path.name)?;
    accepting(&shared)?;
    let now = now_ms();
    let (_locks, mut state) = locked(&shared, &schedule.name, now).await?;
    // A tick of its own: the instant of the call, unless a tick has it.
    let mut tick = now;
    while read_tick(shared.node.journal(), &schedule.name, tick)?.is_some() {
        tick += 1;
    }
    let started = started_run(&shared, &schedule, &mut state, tick, Cause::Trigger, now).await?;
    Ok(json(StatusCode::CREATED, created(&shared, started).await?))
}

async fn created(shared: &Shared, run: RunId) -> Result<RunCreated, ApiError> {
    let status = super::runs::run_tree(shared, run)
        .await?
        .map(|t| t.run_status())
        .unwrap_or(Status::Pending);
    Ok(RunCreated {
        id: run,
        status,
        replayed: false,
        links: RunLinks::of(run),
    })
}

/// `start`, for a call: the run it started, or why none.
async fn started_run(
    shared: &Shared,
    schedule: &Schedule,
    state: &mut ScheduleState,
    tick: u64,
    cause: Cause,
    now: u64,
) -> Result<RunId, ApiError> {
    if !start(shared, schedule, state, tick, cause, now).await? {
        return Err(ApiError::unavailable(
            "the node is shutting down and takes no new work",
        ));
    }
    match read_tick(shared.node.journal(), &schedule.name, tick)?.map(|t| t.outcome) {
        Some(TickOutcome::Started { run, .. }) => Ok(run),
        Some(TickOutcome::Skipped { why }) => Err(ApiError::refused(why)),
        _ => Err(ApiError::internal("the tick's run was not recorded")),
    }
}

async fn backfill(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(path): Path<NamePath>,
    JsonBody(body): JsonBody<BackfillBody>,
) -> Reply {
    let schedule = find(&shared, &caller, &path.name)?;
    let from = parse_time(&body.from).map_err(|m| ApiError::bad_request(format!("from: {m}")))?;
    let to = parse_time(&body.to).map_err(|m| ApiError::bad_request(format!("to: {m}")))?;
    if from > to {
        return Err(ApiError::bad_request("`from` is after `to`"));
    }
    let ticks = schedule.ticks(from.saturating_sub(1), to, MAX_BACKFILL + 1);
    if ticks.len() > MAX_BACKFILL {
        return Err(ApiError::refused(format!(
            "more than {MAX_BACKFILL} ticks from {} to {}: backfill a shorter span at a time",
            body.from, body.to
        )));
    }
    accepting(&shared)?;
    let now = now_ms();
    let (_locks, mut state) = locked(&shared, &schedule.name, now).await?;
    let mut result = BackfillResult::default();
    for tick in ticks {
        let done = read_tick(shared.node.journal(), &schedule.name, tick)?;
        if let Some(TickOutcome::Started { run, .. }) = done.map(|t| t.outcome) {
            result.already.push(BackfilledTick {
                tick: tick_text(tick),
                run,
            });
            continue;
        }
        let run = started_run(&shared, &schedule, &mut state, tick, Cause::Backfill, now).await?;
        result.started.push(BackfilledTick {
            tick: tick_text(tick),
            run,
        });
    }
    Ok(json(StatusCode::OK, result))
}
