//! A flow's `[[schedule]]` entries, checked: the cron read in its time zone
//! (croner, chrono-tz), and the ticks it gives. Which tick starts a run,
//! and the record that makes each start once (I-66), are arbord's
//! (`service/src/schedules.rs`).
//!
//! A tick is an instant, in ms since the Unix epoch. Its wall-clock time is
//! the cron's in the schedule's zone; a time a DST change skips fires once
//! at the first instant after the gap, one it repeats fires once, at its
//! first occurrence (croner's rule, which follows Vixie cron).

use arbor_protocol::{BudgetArg, Overlap, ScheduleSpec};
use chrono::{DateTime, TimeZone, Utc};
use std::time::Duration;

/// A tick late by more than this, after a time no node ran, is missed,
/// unless the schedule says otherwise.
pub const CATCHUP_WINDOW: Duration = Duration::from_secs(60);

/// One schedule, checked.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub name: String,
    /// The flow it starts.
    pub flow: String,
    /// The cron as written.
    pub cron: String,
    pattern: croner::Cron,
    pub timezone: chrono_tz::Tz,
    pub input: Option<serde_json::Value>,
    pub overlap: Overlap,
    pub catchup_window: Duration,
    pub jitter: Duration,
    pub paused: bool,
    pub budget: Option<BudgetArg>,
    pub tenant: Option<String>,
}

impl Schedule {
    /// `spec` of flow `flow`, or why it is not a schedule (its name is the
    /// workspace's to check, with the others').
    pub fn check(flow: &str, spec: &ScheduleSpec) -> Result<Schedule, String> {
        let name = &spec.name;
        let fields = spec.cron.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(format!(
                "schedule {name}: cron {:?} has {fields} fields; it takes five (minute hour day month weekday) or six (seconds first)",
                spec.cron
            ));
        }
        let pattern = croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .build()
            .parse(&spec.cron)
            .map_err(|e| format!("schedule {name}: cron {:?}: {e}", spec.cron))?;
        let timezone = match &spec.timezone {
            None => chrono_tz::UTC,
            Some(zone) => zone.parse().map_err(|_| {
                format!("schedule {name}: timezone {zone:?} is not an IANA time zone (such as Europe/Paris)")
            })?,
        };
        let duration = |key: &str, text: &Option<String>| {
            text.as_deref()
                .map(|t| {
                    humantime::parse_duration(t)
                        .map_err(|e| format!("schedule {name}: {key} {t:?}: {e}"))
                })
                .transpose()
        };
        let catchup_window =
            duration("catchup_window", &spec.catchup_window)?.unwrap_or(CATCHUP_WINDOW);
        let jitter = duration("jitter", &spec.jitter)?.unwrap_or_default();
        if let Some(budget) = &spec.budget {
            budget
                .tokens()
                .map_err(|e| format!("schedule {name}: {e}"))?;
            budget
                .usd_micros()
                .map_err(|e| format!("schedule {name}: {e}"))?;
        }
        let schedule = Schedule {
            name: name.clone(),
            flow: flow.to_string(),
            cron: spec.cron.clone(),
            pattern,
            timezone,
            input: spec.input.clone(),
            overlap: spec.overlap.unwrap_or(Overlap::Skip),
            catchup_window,
            jitter,
            paused: spec.paused,
            budget: spec.budget.clone(),
            tenant: spec.tenant.clone(),
        };
        if schedule.next_after(0).is_none() {
            return Err(format!("schedule {name}: cron {:?} never fires", spec.cron));
        }
        Ok(schedule)
    }

    /// The first tick after `ms`, if the cron has one.
    pub fn next_after(&self, ms: u64) -> Option<u64> {
        let from = self
            .timezone
            .from_utc_datetime(&DateTime::<Utc>::from_timestamp_millis(ms as i64)?.naive_utc());
        let next = self.pattern.find_next_occurrence(&from, false).ok()?;
        u64::try_from(next.timestamp_millis()).ok()
    }

    /// The ticks after `after` up to `until` (both ms), in order, at most `max`.
    pub fn ticks(&self, after: u64, until: u64, max: usize) -> Vec<u64> {
        let mut ticks = vec![];
        let mut at = after;
        while ticks.len() < max {
            match self.next_after(at) {
                Some(next) if next <= until => {
                    ticks.push(next);
                    at = next;
                }
                _ => break,
            }
        }
        ticks
    }

    /// How long after `tick` its run starts: the same on every node (a
    /// hash of the schedule and the tick), below `jitter`.
    pub fn jitter_ms(&self, tick: u64) -> u64 {
        let bound = self.jitter.as_millis() as u64;
        if bound == 0 {
            return 0;
        }
        // FNV-1a: stable across builds and nodes, unlike std's hasher.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.name.bytes().chain(tick.to_be_bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash % bound
    }
}

/// A tick as a run's `schedule.tick` says it: RFC 3339, UTC.
pub fn tick_text(ms: u64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
        .unwrap_or_default()
}

/// An RFC 3339 time as ms since the Unix epoch.
pub fn parse_time(text: &str) -> Result<u64, String> {
    let at = DateTime::parse_from_rfc3339(text)
        .map_err(|e| format!("{text:?} is not an RFC 3339 time (2026-03-29T02:30:00Z): {e}"))?;
    u64::try_from(at.timestamp_millis()).map_err(|_| format!("{text:?} is before 1970"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, cron: &str, zone: &str) -> ScheduleSpec {
        ScheduleSpec {
            name: name.into(),
            cron: cron.into(),
            timezone: Some(zone.into()),
            input: None,
            overlap: None,
            catchup_window: None,
            jitter: None,
            paused: false,
            budget: None,
            tenant: None,
        }
    }

    fn schedule(cron: &str, zone: &str) -> Schedule {
        Schedule::check("f", &spec("s", cron, zone)).expect("a schedule")
    }

    fn at(text: &str) -> u64 {
        parse_time(text).expect("a time")
    }

    /// Europe/Paris skips 02:00-03:00 on 2026-03-29 and repeats 02:00-03:00
    /// on 2026-10-25: a daily 02:30 fires once on each day.
    #[test]
    fn a_wall_clock_time_a_dst_change_skips_or_repeats_fires_once() {
        let daily = schedule("30 2 * * *", "Europe/Paris");
        let spring = daily.ticks(at("2026-03-28T12:00:00Z"), at("2026-03-30T12:00:00Z"), 10);
        let spring: Vec<String> = spring.into_iter().map(tick_text).collect();
        // 02:30 on the 28th is 01:30Z; on the 29th it does not exist: the
        // first instant after the gap, 03:00 CEST, is 01:00Z.
        assert_eq!(spring, ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]);
        let autumn = daily.ticks(at("2026-10-24T12:00:00Z"), at("2026-10-26T12:00:00Z"), 10);
        let autumn: Vec<String> = autumn.into_iter().map(tick_text).collect();
        // 02:30 happens twice on the 25th (00:30Z in CEST, 01:30Z in CET): once.
        assert_eq!(autumn, ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]);
    }

    #[test]
    fn six_fields_take_seconds_and_a_bad_cron_or_zone_is_refused_by_name() {
        let every_two = schedule("*/2 * * * * *", "UTC");
        assert_eq!(
            every_two.ticks(at("2026-01-01T00:00:00Z"), at("2026-01-01T00:00:06Z"), 10),
            [2000, 4000, 6000].map(|d| at("2026-01-01T00:00:00Z") + d)
        );
        let spec = |cron: &str, zone: &str| spec("nightly", cron, zone);
        let why = Schedule::check("f", &spec("61 * * * *", "UTC")).unwrap_err();
        assert!(why.contains("nightly") && why.contains("61"), "{why}");
        let why = Schedule::check("f", &spec("* * *", "UTC")).unwrap_err();
        assert!(why.contains("3 fields"), "{why}");
        let why = Schedule::check("f", &spec("0 3 * * *", "Mars/Olympus")).unwrap_err();
        assert!(why.contains("Mars/Olympus"), "{why}");
        let why = Schedule::check("f", &spec("0 0 31 2 *", "UTC")).unwrap_err();
        assert!(why.contains("never fires"), "{why}");
    }

    #[test]
    fn jitter_is_the_same_for_a_tick_and_below_its_bound() {
        let mut s = schedule("* * * * *", "UTC");
        assert_eq!(s.jitter_ms(60_000), 0);
        s.jitter = Duration::from_secs(30);
        let spread: Vec<u64> = (1..50).map(|m| s.jitter_ms(m * 60_000)).collect();
        assert!(spread.iter().all(|j| *j < 30_000));
        assert_eq!(s.jitter_ms(60_000), s.jitter_ms(60_000));
        assert!(spread.iter().any(|j| *j != spread[0]));
    }
}
