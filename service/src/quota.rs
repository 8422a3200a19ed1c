//! Tenant quotas over time (I-65): `[tenants.NAME.quota]`'s sliding windows,
//! enforced by reservation. A run's ceiling (its tokens, its dollars, one
//! run) is reserved from its tenant's windows when it is admitted, and the
//! entry is committed with its submission (or, for a tenant that queues,
//! before it starts); its end settles the entry down to what it spent.
//!
//! The counting rule, which makes every window exact however runs overlap:
//! an entry counts in every span of a window's length that meets its life
//! (from its reservation to its end; a running run's life has no end yet).
//! So when a run is admitted, every entry that could share a span with it
//! is one that is running or ended within the last span, and it is admitted
//! only if those and its own ceiling fit the quota. What a run spends falls
//! inside its life, so no span ever holds more spend than the quota.
//! `runs_per_minute` counts admissions, an instant each; `concurrent_runs`
//! counts the runs whose lives have not ended.
//!
//! Entries are the service's records in the journal's `quotas` table, keyed
//! by tenant, and outlive the runs (retention forgets runs, not these); one
//! is removed once no window can count it.

use arbor_protocol::RunId;
use arbor_runtime::workspace::Quota;
use arbor_storage::{Journal, QUOTAS_TABLE, Record, Table};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// When only a running run's end can make room, a refused submission is
/// told to try again this much later (the clock alone cannot say).
pub const RETRY_WHEN_RUNNING_S: u64 = 10;

const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 60 * MINUTE_MS;
const DAY_MS: u64 = 24 * HOUR_MS;
/// `usd_per_month`: a sliding 30 days.
const MONTH_MS: u64 = 30 * DAY_MS;

/// What one admitted run reserved from its tenant's windows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuotaEntry {
    pub tenant: String,
    pub run: RunId,
    /// When it was reserved: its life's start.
    pub at_ms: u64,
    /// When its run ended; `None` while it may still spend.
    pub ended_ms: Option<u64>,
    /// Its ceiling while it runs; what it spent once settled.
    pub tokens: u64,
    pub usd_micros: u64,
    pub epoch: u64,
}

/// The table, keyed by tenant, a 0 byte, and the run's id.
pub static QUOTAS: Table<QuotaEntry> = Table::bincode(QUOTAS_TABLE, entry_key, |e| e.epoch);

fn entry_key(e: &QuotaEntry) -> Vec<u8> {
    let mut key = tenant_prefix(&e.tenant);
    key.extend_from_slice(e.run.0.as_bytes());
    key
}

fn tenant_prefix(tenant: &str) -> Vec<u8> {
    let mut key = tenant.as_bytes().to_vec();
    key.push(0);
    key
}

impl QuotaEntry {
    pub fn record(&self) -> Result<Record, arbor_storage::Error> {
        QUOTAS.row(self).map(Record::Row)
    }
}

/// One of a quota's windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    TokensPerHour,
    UsdPerDay,
    UsdPerMonth,
    RunsPerMinute,
    ConcurrentRuns,
}

impl Window {
    pub const ALL: [Window; 5] = [
        Window::TokensPerHour,
        Window::UsdPerDay,
        Window::UsdPerMonth,
        Window::RunsPerMinute,
        Window::ConcurrentRuns,
    ];

    /// Its name in arbor.toml, the 429's body and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            Window::TokensPerHour => "tokens_per_hour",
            Window::UsdPerDay => "usd_per_day",
            Window::UsdPerMonth => "usd_per_month",
            Window::RunsPerMinute => "runs_per_minute",
            Window::ConcurrentRuns => "concurrent_runs",
        }
    }

    /// Its limit in `quota` (micro-dollars for a usd window), if it sets one.
    pub fn limit(self, quota: &Quota) -> Option<u64> {
        match self {
            Window::TokensPerHour => quota.tokens_per_hour,
            Window::UsdPerDay => quota.usd_micros_per_day,
            Window::UsdPerMonth => quota.usd_micros_per_month,
            Window::RunsPerMinute => quota.runs_per_minute,
            Window::ConcurrentRuns => quota.concurrent_runs,
        }
    }

    /// Its span; `None` for `concurrent_runs`, which counts the present.
    fn span_ms(self) -> Option<u64> {
        match self {
            Window::TokensPerHour => Some(HOUR_MS),
            Window::UsdPerDay => Some(DAY_MS),
            Window::UsdPerMonth => Some(MONTH_MS),
            Window::RunsPerMinute => Some(MINUTE_MS),
            Window::ConcurrentRuns => None,
        }
    }

    fn amount(self, tokens: u64, usd_micros: u64) -> u64 {
        match self {
            Window::TokensPerHour => tokens,
            Window::UsdPerDay | Window::UsdPerMonth => usd_micros,
            Window::RunsPerMinute | Window::ConcurrentRuns => 1,
        }
    }

    /// When `entry` stops counting in this window: `None` while it counts
    /// for as long as its run may live.
    fn expiry(self, entry: &QuotaEntry) -> Option<u64> {
        let span = self.span_ms();
        match self {
            Window::RunsPerMinute => span.map(|s| entry.at_ms + s),
            _ => entry.ended_ms.map(|end| end + span.unwrap_or(0)),
        }
    }

    fn counts(self, entry: &QuotaEntry, now_ms: u64) -> bool {
        self.expiry(entry).is_none_or(|until| until > now_ms)
    }
}

/// What a run asks of its tenant's windows: its ceilings (or a top-up's
/// amounts, which start no run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    pub tokens: u64,
    pub usd_micros: u64,
    /// A run's admission (counts in `runs_per_minute` and `concurrent_runs`).
    pub run: bool,
}

impl Demand {
    fn of(self, window: Window) -> u64 {
        match window {
            Window::RunsPerMinute | Window::ConcurrentRuns => u64::from(self.run),
            _ => window.amount(self.tokens, self.usd_micros),
        }
    }
}

/// A demand a window has no room for now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Over {
    pub window: Window,
    /// How long until the clock alone makes room; `None`: a running run
    /// must end first.
    pub retry_after_ms: Option<u64>,
}

impl Over {
    /// Whole seconds to say in `Retry-After` (at least 1).
    pub fn retry_after_s(&self) -> u64 {
        self.retry_after_ms
            .map_or(RETRY_WHEN_RUNNING_S, |ms| ms.div_ceil(1000).max(1))
    }
}

/// Why a demand can never be admitted, whatever the windows hold.
pub fn never(quota: &Quota, demand: Demand, has_usd_ceiling: bool) -> Option<String> {
    for window in Window::ALL {
        let Some(limit) = window.limit(quota) else {
            continue;
        };
        if matches!(window, Window::UsdPerDay | Window::UsdPerMonth) && !has_usd_ceiling {
            return Some(format!(
                "its tenant's {} quota reserves each run's dollar ceiling, and this run has \
                 none: give it one (`usd`, the flow's budget, or arbor.toml's [budget] usd)",
                window.name()
            ));
        }
        let want = demand.of(window);
        if want > limit {
            return Some(format!(
                "it would reserve {want} of its tenant's {} quota of {limit}: it could never start",
                window.name()
            ));
        }
    }
    None
}

/// Every tenant's entries that a window may still count, in memory; the
/// journal's `quotas` table is the truth it is read from at boot.
#[derive(Default)]
pub struct Ledger {
    tenants: HashMap<String, BTreeMap<RunId, QuotaEntry>>,
}

impl Ledger {
    pub fn load(journal: &Journal) -> Result<Self, arbor_storage::Error> {
        let mut ledger = Ledger::default();
        for entry in journal.read(&QUOTAS, &[])? {
            ledger.put(entry);
        }
        Ok(ledger)
    }

    fn put(&mut self, entry: QuotaEntry) {
        self.tenants
            .entry(entry.tenant.clone())
            .or_default()
            .insert(entry.run, entry);
    }

    /// `tenant`'s entries as the journal has them now: on a shared
    /// journal, every node's (read under the tenant's lock).
    pub fn reload(&mut self, journal: &Journal, tenant: &str) -> Result<(), arbor_storage::Error> {
        let entries = journal.read(&QUOTAS, &tenant_prefix(tenant))?;
        let mine = self.tenants.entry(tenant.to_string()).or_default();
        mine.clear();
        mine.extend(entries.into_iter().map(|e| (e.run, e)));
        Ok(())
    }

    pub fn entry(&self, tenant: &str, run: RunId) -> Option<&QuotaEntry> {
        self.tenants.get(tenant)?.get(&run)
    }

    /// The entries whose runs have not ended.
    pub fn open_entries(&self) -> Vec<QuotaEntry> {
        self.tenants
            .values()
            .flat_map(|entries| entries.values())
            .filter(|e| e.ended_ms.is_none())
            .cloned()
            .collect()
    }

    /// What `window` of `tenant` holds at `now_ms`.
    pub fn used(&self, tenant: &str, window: Window, now_ms: u64) -> u64 {
        self.tenants.get(tenant).map_or(0, |entries| {
            entries
                .values()
                .filter(|e| window.counts(e, now_ms))
                .map(|e| window.amount(e.tokens, e.usd_micros))
                .sum()
        })
    }

    /// Whether `demand` fits every window of `quota` at `now_ms`; the first
    /// that has no room, and when it will, if not.
    pub fn room(
        &self,
        tenant: &str,
        quota: &Quota,
        demand: Demand,
        now_ms: u64,
    ) -> Result<(), Over> {
        for window in Window::ALL {
            let Some(limit) = window.limit(quota) else {
                continue;
            };
            let want = demand.of(window);
            if want == 0 {
                continue;
            }
            let used = self.used(tenant, window, now_ms);
            if used.saturating_add(want) <= limit {
                continue;
            }
            return Err(Over {
                window,
                retry_after_ms: self.room_at(tenant, window, limit, want, now_ms),
            });
        }
        Ok(())
    }

    /// How long until the entries the clock retires leave `want` room.
    fn room_at(
        &self,
        tenant: &str,
        window: Window,
        limit: u64,
        want: u64,
        now_ms: u64,
    ) -> Option<u64> {
        let entries = self.tenants.get(tenant)?;
        let mut used = self.used(tenant, window, now_ms);
        let mut leaving: Vec<(u64, u64)> = entries
            .values()
            .filter_map(|e| {
                let until = window.expiry(e)?;
                (until > now_ms).then(|| (until, window.amount(e.tokens, e.usd_micros)))
            })
            .collect();
        leaving.sort_unstable();
        for (until, amount) in leaving {
            used -= amount;
            if used.saturating_add(want) <= limit {
                return Some(until - now_ms);
            }
        }
        None
    }

    /// The entry a new reservation makes; `put` it once it is committed.
    pub fn reservation(
        tenant: &str,
        run: RunId,
        demand: Demand,
        now_ms: u64,
        epoch: u64,
    ) -> QuotaEntry {
        QuotaEntry {
            tenant: tenant.to_string(),
            run,
            at_ms: now_ms,
            ended_ms: None,
            tokens: demand.tokens,
            usd_micros: demand.usd_micros,
            epoch,
        }
    }

    /// Takes a committed entry in.
    pub fn committed(&mut self, entry: QuotaEntry) {
        self.put(entry);
    }

    /// The entries no window counts any more, removed from memory: their
    /// keys, for the journal.
    pub fn prune(&mut self, now_ms: u64) -> Vec<Vec<u8>> {
        let mut keys = vec![];
        for entries in self.tenants.values_mut() {
            entries.retain(|_, e| {
                let counts = Window::ALL
                    .into_iter()
                    .any(|w| w.counts(e, now_ms) && w.amount(e.tokens, e.usd_micros) > 0);
                if !counts {
                    keys.push(entry_key(e));
                }
                counts
            });
        }
        self.tenants.retain(|_, entries| !entries.is_empty());
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota() -> Quota {
        Quota {
            tokens_per_hour: Some(1_000),
            runs_per_minute: Some(3),
            concurrent_runs: Some(2),
            ..Quota::default()
        }
    }

    fn run(tokens: u64) -> Demand {
        Demand {
            tokens,
            usd_micros: 0,
            run: true,
        }
    }

    fn admit(ledger: &mut Ledger, demand: Demand, now: u64) -> Result<RunId, Over> {
        ledger.room("t", &quota(), demand, now)?;
        let id = RunId::new();
        ledger.committed(Ledger::reservation("t", id, demand, now, 1));
        Ok(id)
    }

    fn end(ledger: &mut Ledger, run: RunId, spent: u64, now: u64) {
        let mut e = ledger.entry("t", run).cloned().unwrap();
        e.ended_ms = Some(now);
        e.tokens = spent;
        ledger.committed(e);
    }

    #[test]
    fn inv_65_a_running_runs_ceiling_holds_its_windows_until_it_ends_and_an_hour_after() {
        let mut ledger = Ledger::default();
        let a = admit(&mut ledger, run(600), 0).unwrap();
        let over = admit(&mut ledger, run(600), 1_000).unwrap_err();
        assert_eq!(over.window, Window::TokensPerHour);
        // Only a's end can make room: the clock alone cannot say when.
        assert_eq!(over.retry_after_ms, None);
        // It spent 300 of its 600: the rest is back at once, and its 300
        // count for an hour after its end, not after its start.
        end(&mut ledger, a, 300, 5_000);
        admit(&mut ledger, run(600), 6_000).unwrap();
        let over = admit(&mut ledger, run(200), 7_000).unwrap_err();
        assert_eq!(over.retry_after_ms, Some(5_000 + HOUR_MS - 7_000));
        assert!(admit(&mut ledger, run(200), 5_000 + HOUR_MS - 1).is_err());
        admit(&mut ledger, run(200), 5_000 + HOUR_MS).unwrap();
    }

    #[test]
    fn inv_65_runs_per_minute_counts_admissions_and_concurrent_runs_the_running() {
        let mut ledger = Ledger::default();
        let a = admit(&mut ledger, run(1), 0).unwrap();
        admit(&mut ledger, run(1), 10).unwrap();
        let over = admit(&mut ledger, run(1), 20).unwrap_err();
        assert_eq!(over.window, Window::ConcurrentRuns);
        end(&mut ledger, a, 1, 30);
        admit(&mut ledger, run(1), 40).unwrap();
        // Two running, three admitted in the minute: the minute says when.
        let b = ledger.open_entries()[0].run;
        end(&mut ledger, b, 1, 50);
        let over = admit(&mut ledger, run(1), 60).unwrap_err();
        assert_eq!(over.window, Window::RunsPerMinute);
        assert_eq!(over.retry_after_ms, Some(MINUTE_MS - 60));
        admit(&mut ledger, run(1), MINUTE_MS).unwrap();
    }

    #[test]
    fn inv_65_an_entry_is_pruned_only_once_no_window_counts_it() {
        let mut ledger = Ledger::default();
        let a = admit(&mut ledger, run(10), 0).unwrap();
        assert!(
            ledger.prune(2 * HOUR_MS).is_empty(),
            "a running run's entry stays"
        );
        end(&mut ledger, a, 5, 2 * HOUR_MS);
        assert!(ledger.prune(3 * HOUR_MS - 1).is_empty());
        assert_eq!(ledger.prune(3 * HOUR_MS).len(), 1);
        assert_eq!(ledger.used("t", Window::TokensPerHour, 3 * HOUR_MS), 0);
    }

    #[test]
    fn a_demand_beyond_a_whole_window_or_without_a_usd_ceiling_could_never_start() {
        let q = Quota {
            usd_micros_per_day: Some(5_000_000),
            ..quota()
        };
        assert!(
            never(&q, run(1_001), true)
                .unwrap()
                .contains("tokens_per_hour")
        );
        assert!(never(&q, run(10), false).unwrap().contains("usd_per_day"));
        assert_eq!(never(&q, run(10), true), None);
    }
}
