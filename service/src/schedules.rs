//! Schedules' state and ticks in the journal, and what a schedule does
//! next (`next`). The routes (`routes/schedules.rs`) carry it out: each
//! step is one commit, a started tick committed with its run's submission.
//!
//! Invariants (I-66):
//! 1. A tick starts at most one run: a tick is handled only past the
//!    schedule's `cursor`, read under the schedule's lock (a shared
//!    journal's advisory lock; this node's mutex), and the cursor moves in
//!    the commit that starts its run. A restart, a failover or a second
//!    node reads the cursor and goes on after it.
//! 2. A tick within the catch-up window is never lost: the cursor passes a
//!    tick only in the commit that starts, skips, buffers or records it as
//!    missed; a crash before that commit leaves it to the next node.
//! 3. A paused schedule's ticks pass without a run, and are not caught up.

use arbor_protocol::{Overlap, RunId};
use arbor_runtime::schedules::Schedule;
use arbor_storage::{Record, SCHEDULES_TABLE, Table};
use serde::{Deserialize, Serialize};

/// A row of the `schedules` table: a schedule's state, or one of its ticks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleRecord {
    pub schedule: String,
    pub row: ScheduleRow,
    pub epoch: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ScheduleRow {
    State(ScheduleState),
    Tick(TickRecord),
}

/// Where a schedule stands.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    /// Set through the API; none: the flow file's `paused`.
    pub paused: Option<bool>,
    /// The last tick handled (ms): the next is the cron's first after it.
    pub cursor_ms: u64,
    /// Runs it started that had not ended when last looked at.
    pub active: Vec<RunId>,
    /// Ticks waiting for the runs before them to end (`buffer_one`,
    /// `buffer_all`), oldest first.
    pub buffered: Vec<u64>,
}

/// What became of one tick.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TickRecord {
    pub tick_ms: u64,
    pub outcome: TickOutcome,
    /// When it was decided (ms).
    pub at_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TickOutcome {
    Started {
        run: RunId,
        cause: Cause,
    },
    /// Waits for the schedule's earlier runs to end.
    Buffered,
    /// Started nothing: why.
    Skipped {
        why: String,
    },
    /// Found late by more than the catch-up window: this tick and `count`
    /// in all from `from_ms`.
    Missed {
        from_ms: u64,
        count: u64,
    },
}

/// Who started a tick's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cause {
    /// Its time came.
    Cron,
    /// `POST /v1/schedules/{name}/trigger`.
    Trigger,
    /// `POST /v1/schedules/{name}/backfill`.
    Backfill,
}

/// The table: a schedule's name, 0, then `s` (its state) or `t` and the
/// tick (ms, big-endian).
pub static SCHEDULES: Table<ScheduleRecord> =
    Table::bincode(SCHEDULES_TABLE, record_key, |r| r.epoch);

fn record_key(r: &ScheduleRecord) -> Vec<u8> {
    match &r.row {
        ScheduleRow::State(_) => state_key(&r.schedule),
        ScheduleRow::Tick(t) => tick_key(&r.schedule, t.tick_ms),
    }
}

/// A schedule's rows' prefix.
pub fn prefix(name: &str) -> Vec<u8> {
    let mut key = name.as_bytes().to_vec();
    key.push(0);
    key
}

pub fn state_key(name: &str) -> Vec<u8> {
    let mut key = prefix(name);
    key.push(b's');
    key
}

pub fn tick_key(name: &str, tick_ms: u64) -> Vec<u8> {
    let mut key = prefix(name);
    key.push(b't');
    key.extend_from_slice(&tick_ms.to_be_bytes());
    key
}

impl ScheduleRecord {
    pub fn state(
        name: &str,
        state: &ScheduleState,
        epoch: u64,
    ) -> Result<Record, arbor_storage::Error> {
        SCHEDULES
            .row(&ScheduleRecord {
                schedule: name.to_string(),
                row: ScheduleRow::State(state.clone()),
                epoch,
            })
            .map(Record::Row)
    }

    pub fn tick(
        name: &str,
        tick_ms: u64,
        outcome: TickOutcome,
        at_ms: u64,
        epoch: u64,
    ) -> Result<Record, arbor_storage::Error> {
        SCHEDULES
            .row(&ScheduleRecord {
                schedule: name.to_string(),
                row: ScheduleRow::Tick(TickRecord {
                    tick_ms,
                    outcome,
                    at_ms,
                }),
                epoch,
            })
            .map(Record::Row)
    }
}

/// A schedule's state as the journal has it; none before its first look.
pub fn read_state(
    journal: &arbor_storage::Journal,
    name: &str,
) -> Result<Option<ScheduleState>, arbor_storage::Error> {
    Ok(journal
        .read_one(&SCHEDULES, &state_key(name))?
        .and_then(|r| match r.row {
            ScheduleRow::State(s) => Some(s),
            ScheduleRow::Tick(_) => None,
        }))
}

/// One tick's record, if it has one.
pub fn read_tick(
    journal: &arbor_storage::Journal,
    name: &str,
    tick_ms: u64,
) -> Result<Option<TickRecord>, arbor_storage::Error> {
    Ok(journal
        .read_one(&SCHEDULES, &tick_key(name, tick_ms))?
        .and_then(|r| match r.row {
            ScheduleRow::Tick(t) => Some(t),
            ScheduleRow::State(_) => None,
        }))
}

/// Whether a schedule is paused: the API's word, else its file's.
pub fn paused(schedule: &Schedule, state: &ScheduleState) -> bool {
    state.paused.unwrap_or(schedule.paused)
}

/// What a schedule does next, at `now` (ms), its `state.active` holding
/// only runs that have not ended. None: nothing until later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Paused: the ticks up to `to` pass, starting nothing.
    Pass {
        to: u64,
    },
    /// A buffered tick's turn has come.
    StartBuffered {
        tick: u64,
    },
    /// Ticks from `from` to `to` were found too late: recorded as missed.
    Missed {
        from: u64,
        to: u64,
        count: u64,
    },
    /// `tick` starts a run, after the runs in `cancel` are stopped.
    Start {
        tick: u64,
        cancel: Vec<RunId>,
    },
    Buffer {
        tick: u64,
    },
    Skip {
        tick: u64,
        why: String,
    },
}

/// The bound on the ticks one step counts as missed.
const MAX_COUNTED: usize = 1_000_000;

pub fn next(schedule: &Schedule, state: &ScheduleState, now: u64) -> Option<Step> {
    let due = schedule.next_after(state.cursor_ms).filter(|t| *t <= now);
    if paused(schedule, state) {
        let due = due?;
        let last = schedule
            .ticks(due, now, MAX_COUNTED)
            .last()
            .copied()
            .unwrap_or(due);
        return Some(Step::Pass { to: last });
    }
    if state.active.is_empty()
        && let Some(&tick) = state.buffered.first()
    {
        return Some(Step::StartBuffered { tick });
    }
    let tick = due?;
    let window = schedule.catchup_window.as_millis() as u64;
    if now.saturating_sub(tick) > window {
        let late = schedule.ticks(tick, now.saturating_sub(window), MAX_COUNTED);
        let to = late.last().copied().unwrap_or(tick);
        return Some(Step::Missed {
            from: tick,
            to,
            count: late.len() as u64 + 1,
        });
    }
    if now < tick + schedule.jitter_ms(tick) {
        return None;
    }
    let busy = !state.active.is_empty();
    Some(match schedule.overlap {
        Overlap::AllowAll => Step::Start {
            tick,
            cancel: vec![],
        },
        Overlap::Skip if busy => Step::Skip {
            tick,
            why: "the schedule's last run has not ended (overlap = skip)".into(),
        },
        Overlap::BufferOne if busy && !state.buffered.is_empty() => Step::Skip {
            tick,
            why: "a tick is buffered already (overlap = buffer_one)".into(),
        },
        Overlap::BufferOne | Overlap::BufferAll if busy || !state.buffered.is_empty() => {
            Step::Buffer { tick }
        }
        Overlap::CancelOther => Step::Start {
            tick,
            cancel: state.active.clone(),
        },
        Overlap::Skip | Overlap::BufferOne | Overlap::BufferAll => Step::Start {
            tick,
            cancel: vec![],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::ScheduleSpec;

    fn schedule(overlap: Overlap) -> Schedule {
        let spec = ScheduleSpec {
            name: "s".into(),
            cron: "* * * * *".into(),
            timezone: None,
            input: None,
            overlap: Some(overlap),
            catchup_window: Some("90s".into()),
            jitter: None,
            paused: false,
            budget: None,
            tenant: None,
        };
        Schedule::check("f", &spec).expect("a schedule")
    }

    const MIN: u64 = 60_000;

    #[test]
    fn nothing_is_due_before_the_next_tick_and_a_late_tick_is_missed_beyond_the_window() {
        let s = schedule(Overlap::Skip);
        let state = ScheduleState {
            cursor_ms: 10 * MIN,
            ..Default::default()
        };
        assert_eq!(next(&s, &state, 10 * MIN + 59_999), None);
        assert_eq!(
            next(&s, &state, 11 * MIN),
            Some(Step::Start {
                tick: 11 * MIN,
                cancel: vec![]
            })
        );
        // Ten minutes late, a 90 s window: 11..=18 are missed, 19 and 20 start.
        assert_eq!(
            next(&s, &state, 20 * MIN),
            Some(Step::Missed {
                from: 11 * MIN,
                to: 18 * MIN,
                count: 8
            })
        );
    }

    #[test]
    fn each_overlap_policy_decides_a_busy_tick() {
        let run = RunId::new();
        let busy = ScheduleState {
            cursor_ms: 10 * MIN,
            active: vec![run],
            ..Default::default()
        };
        let now = 11 * MIN;
        let tick = 11 * MIN;
        assert!(matches!(
            next(&schedule(Overlap::Skip), &busy, now),
            Some(Step::Skip { .. })
        ));
        assert_eq!(
            next(&schedule(Overlap::BufferOne), &busy, now),
            Some(Step::Buffer { tick })
        );
        let one_buffered = ScheduleState {
            buffered: vec![10 * MIN],
            ..busy.clone()
        };
        assert!(matches!(
            next(&schedule(Overlap::BufferOne), &one_buffered, now),
            Some(Step::Skip { .. })
        ));
        assert_eq!(
            next(&schedule(Overlap::BufferAll), &one_buffered, now),
            Some(Step::Buffer { tick })
        );
        assert_eq!(
            next(&schedule(Overlap::CancelOther), &busy, now),
            Some(Step::Start {
                tick,
                cancel: vec![run]
            })
        );
        assert_eq!(
            next(&schedule(Overlap::AllowAll), &busy, now),
            Some(Step::Start {
                tick,
                cancel: vec![]
            })
        );
        // Once the earlier run has ended, the buffered tick goes first.
        let ended = ScheduleState {
            active: vec![],
            ..one_buffered
        };
        assert_eq!(
            next(&schedule(Overlap::BufferAll), &ended, now),
            Some(Step::StartBuffered { tick: 10 * MIN })
        );
    }

    #[test]
    fn a_paused_schedule_passes_its_ticks() {
        let state = ScheduleState {
            cursor_ms: 10 * MIN,
            paused: Some(true),
            ..Default::default()
        };
        assert_eq!(
            next(&schedule(Overlap::Skip), &state, 13 * MIN + 5),
            Some(Step::Pass { to: 13 * MIN })
        );
    }
}
