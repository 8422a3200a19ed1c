//! The rate windows every node on a shared (PostgreSQL) journal takes from
//! (I-65). They live in the database, not in shares handed to each node: a
//! share must be rebalanced whenever a node comes or goes, and until the
//! nodes agree, either some of the limit goes unused or the shares add up
//! to more than it. In the database the window is exact whatever the nodes
//! do, at the cost of one locked round trip per request, which a model call
//! of seconds does not notice.
//!
//! Each request is admitted under the window's lock (a PostgreSQL advisory
//! lock), by the same rule as a node's own windows (`room_at`), just before
//! it goes out: its entry's stamp is its sending, so no span of `SPAN`
//! holds more than the limits. A node that dies leaves its entries to hold
//! their worst case until they leave; a provider's `Retry-After` is a row
//! of its own that closes the window for every node. Stamps are each
//! node's clock: nodes must agree within `SKEW`.

use super::rule::{Limits, SKEW, SPAN, Wait, room_at};
use arbor_storage::{Journal, RATES_TABLE, Record, Table, WeakJournal};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One request in one shared window, or the window's closure.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateEntry {
    /// The window's name: `provider/*` or `provider/model`.
    pub window: String,
    /// The request's, never 0; 0 is the window's closure row.
    pub id: u64,
    /// When it was admitted and sent (ms since the Unix epoch).
    pub at_ms: u64,
    /// Its worst case until settled; then what it used.
    pub tokens: u64,
    /// The closure row's: no request goes out before then.
    pub closed_until_ms: Option<u64>,
    pub epoch: u64,
}

/// The table, keyed by window, a 0 byte, and the entry's id (big-endian).
pub static RATES: Table<RateEntry> = Table::bincode(RATES_TABLE, entry_key, |e| e.epoch);

fn prefix(window: &str) -> Vec<u8> {
    let mut key = window.as_bytes().to_vec();
    key.push(0);
    key
}

fn entry_key(e: &RateEntry) -> Vec<u8> {
    let mut key = prefix(&e.window);
    key.extend_from_slice(&e.id.to_be_bytes());
    key
}

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// When an entry stamped at `at_ms` leaves its window.
fn leaves(at_ms: u64) -> u64 {
    at_ms.saturating_add(ms(SPAN + SKEW))
}

/// The windows of a shared journal: held weakly, so a node that stops
/// lets its journal (and its lease) go; a restart shares them again.
#[derive(Clone)]
pub struct SharedWindows {
    journal: WeakJournal,
}

impl std::fmt::Debug for SharedWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedWindows")
    }
}

/// What one window holds at `now_ms`, read from its rows: each live
/// request (when it leaves, its tokens), when it is closed until, and the
/// keys of the rows that have left.
struct Read {
    leaving: Vec<(u64, u64)>,
    closed_until_ms: Option<u64>,
    gone: Vec<Vec<u8>>,
}

impl SharedWindows {
    pub fn new(journal: &Journal) -> Self {
        Self {
            journal: journal.downgrade(),
        }
    }

    fn journal(&self) -> Result<Journal, arbor_storage::Error> {
        self.journal.upgrade().ok_or(arbor_storage::Error::Closed)
    }

    fn read(&self, window: &str, now_ms: u64) -> Result<Read, arbor_storage::Error> {
        let mut read = Read {
            leaving: vec![],
            closed_until_ms: None,
            gone: vec![],
        };
        for row in self.journal()?.read(&RATES, &prefix(window))? {
            let until = match row.closed_until_ms {
                Some(until) => until,
                None => leaves(row.at_ms),
            };
            if until <= now_ms {
                read.gone.push(entry_key(&row));
            } else if row.closed_until_ms.is_some() {
                read.closed_until_ms = Some(until);
            } else {
                read.leaving.push((until, row.tokens));
            }
        }
        Ok(read)
    }

    /// Takes each window's lock, in the order given (provider, then
    /// model: two requests never wait on each other's locks).
    fn lock(
        &self,
        windows: &[(String, Limits)],
    ) -> Result<Vec<arbor_storage::Exclusive>, arbor_storage::Error> {
        let journal = self.journal()?;
        windows
            .iter()
            .map(|(window, _)| journal.exclusive(&format!("rate:{window}")))
            .collect()
    }

    /// One request of `tokens` into every one of `windows` or none: its
    /// entry, committed, or when to try again.
    pub async fn admit(
        &self,
        windows: &[(String, Limits)],
        tokens: u64,
    ) -> Result<Result<RateEntry, Wait>, arbor_storage::Error> {
        for (_, limits) in windows {
            if let Some(tpm) = limits.tpm
                && tokens > tpm
            {
                return Ok(Err(Wait::TooLarge { tokens, tpm }));
            }
        }
        let journal = self.journal()?;
        let locks = self.lock(windows)?;
        let now_ms = now_ms();
        let mut until: Option<u64> = None;
        let mut gone = vec![];
        for (window, limits) in windows {
            let read = self.read(window, now_ms)?;
            gone.extend(read.gone);
            let at = [read.closed_until_ms, room_at(*limits, read.leaving, tokens)]
                .into_iter()
                .flatten()
                .max();
            until = until.max(at);
        }
        if !gone.is_empty() {
            journal.remove_keys(&RATES, gone)?;
        }
        if let Some(until) = until {
            drop(locks);
            let after = Duration::from_millis(until.saturating_sub(now_ms));
            return Ok(Err(Wait::Until(Instant::now() + after)));
        }
        // Random: ids of every node share the table.
        let id = uuid::Uuid::now_v7().as_u64_pair().1 | 1;
        let entry = |window: &str| RateEntry {
            window: window.to_string(),
            id,
            at_ms: now_ms,
            tokens,
            closed_until_ms: None,
            epoch: journal.epoch(),
        };
        let records = windows
            .iter()
            .map(|(window, _)| RATES.row(&entry(window)).map(Record::Row))
            .collect::<Result<Vec<_>, _>>()?;
        // Committed before the lock goes: the next node to take it sees it.
        journal.commit(records).await?;
        drop(locks);
        Ok(Ok(entry("")))
    }

    /// The request `entry` used `tokens`: its rows hold no more than that
    /// (never more than they did). An append: should it be lost, the rows
    /// keep their worst case until they leave.
    pub fn settle(
        &self,
        windows: &[(String, Limits)],
        entry: &RateEntry,
        tokens: u64,
    ) -> Result<(), arbor_storage::Error> {
        if tokens >= entry.tokens {
            return Ok(());
        }
        let journal = self.journal()?;
        let records = windows
            .iter()
            .map(|(window, _)| {
                let settled = RateEntry {
                    window: window.clone(),
                    tokens,
                    epoch: journal.epoch(),
                    ..entry.clone()
                };
                RATES.row(&settled).map(Record::Row)
            })
            .collect::<Result<Vec<_>, _>>()?;
        journal.append(records).map(|_| ())
    }

    /// The provider said to wait `after`: every node's requests to these
    /// windows wait until then (never earlier than a closure already says).
    pub fn close_for(
        &self,
        windows: &[(String, Limits)],
        after: Duration,
    ) -> Result<(), arbor_storage::Error> {
        let journal = self.journal()?;
        let _locks = self.lock(windows)?;
        let now_ms = now_ms();
        let mut records = vec![];
        for (window, _) in windows {
            let until = now_ms.saturating_add(ms(after));
            if self.read(window, now_ms)?.closed_until_ms >= Some(until) {
                continue;
            }
            let closure = RateEntry {
                window: window.clone(),
                id: 0,
                at_ms: now_ms,
                tokens: 0,
                closed_until_ms: Some(until),
                epoch: journal.epoch(),
            };
            records.push(RATES.row(&closure).map(Record::Row)?);
        }
        journal.append(records).map(|_| ())
    }

    /// What `window` holds now, every node's requests: requests and tokens.
    pub fn used(&self, window: &str) -> Result<(u64, u64), arbor_storage::Error> {
        let read = self.read(window, now_ms())?;
        Ok(read
            .leaving
            .iter()
            .fold((0, 0), |(n, tokens), (_, t)| (n + 1, tokens + t)))
    }
}
