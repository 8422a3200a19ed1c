//! The journal's tables: each kind of record, the table it lives in, the key
//! it is stored under and how its value is encoded. A new kind of record is
//! one `Table` and its place in `JOURNAL_TABLES` (a `JournalTable`: the `Table` when
//! storage owns it, its `TableDef` when another crate does); reads
//! (`Journal::read`, `Journal::read_one`), `scan`, `verify` and `forget` are
//! written once over them, for every engine.
//!
//! A table may belong to another crate (the service's submission queue):
//! its record, key and reads are defined there, with `Table::bincode`, and
//! only its name and shape here, in `JOURNAL_TABLES`, since every open of a
//! journal must be able to replay every table's rows.
//!
//! Invariants:
//! 1. A record's key is a function of the record (and, for a table keyed by
//!    `Key::Seq`, of the journal seq its append gives it): `check` recomputes
//!    it, so `scan` catches a value stored under the wrong key.
//! 2. `JOURNAL_TABLES` is in a fixed order: the write-ahead log names a table
//!    by its place in it, so a table is only ever added at the end (a format
//!    bump otherwise).
//! 3. A history table's keys are its owner's bytes followed by a big-endian
//!    u64 that rises with each record of that owner: every key is written
//!    once, and an owner's records are contiguous and in order.
//! 4. Every key begins with the id its table is keyed by (`KeyedBy`), so the
//!    rows of a run are found in every table without knowing its records.

use crate::codec;
use crate::record::{
    ApprovalRecord, DelegationRecord, JobRecord, LedgerRecord, RunRecord, SandboxRecord,
    SteerRecord, TapeRecord,
};
use arbor_protocol::Event;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// What an engine must know of a table to store it, whatever its records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableDef {
    /// The table's name: a sled tree's, or a PostgreSQL table's.
    pub name: &'static str,
    pub shape: Shape,
    pub keyed_by: KeyedBy,
}

/// How a table's keys are written, which says how an engine can store it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// A record's latest state: the same key is written again as it changes.
    State,
    /// A history: every key is new, and begins with `owner_bytes` bytes
    /// naming its owner (a run, an account), followed by a rising u64
    /// (invariant 3). An engine may keep an owner's records together.
    History { owner_bytes: usize },
}

/// The id every key of a table begins with (invariant 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyedBy {
    /// The run's uuid.
    Run,
    /// A step's or job's uuid.
    Job,
    /// An account's: a tag byte (0 for a run's, 1 for a job's) and its
    /// owner's uuid (`codec::ledger_prefix`).
    Account,
    /// A time, in ms as a big-endian u64: a log of the node's own, outside
    /// every run (the audit), never removed with a run; its owner keeps it
    /// as long as it says.
    Time,
    /// A tenant's name, then a 0 byte: a tenant's own rows (its quota
    /// windows), never removed with a run; their owner removes them
    /// (`Journal::remove_keys`) once no window can count them.
    Tenant,
    /// A rate window's name, then a 0 byte: rows every node on a shared
    /// journal takes from, removed by their owner once they have left.
    Window,
    /// A schedule's name, then a 0 byte: its state and its ticks, never
    /// removed with a run (I-66); their owner removes old ticks.
    Schedule,
    /// A workspace version's id (or `current`): the definitions runs pin
    /// (I-67), never removed with a run.
    Version,
}

/// A kind of record and its table.
pub struct Table<R> {
    pub def: TableDef,
    key: KeyOf<R>,
    /// The epoch of the open that wrote a record (I-41); `None` for records
    /// that carry none (events: their run's records do).
    epoch: Option<fn(&R) -> u64>,
    encode: fn(&R) -> Result<Arc<[u8]>, crate::Error>,
    decode: fn(&[u8]) -> Result<R, String>,
}

/// How a record gives its key.
enum KeyOf<R> {
    /// The key is the record's own.
    Whole(fn(&R) -> Vec<u8>),
    /// The record names its owner; the journal seq its append takes ends
    /// the key (the ledger's entries, which carry no number of their own).
    Seq(fn(&R) -> Vec<u8>),
}

/// A record's key as it is handed to an engine: whole, or an owner's prefix
/// the engine ends with the seq it gives the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Whole(Vec<u8>),
    Seq(Vec<u8>),
}

impl Key {
    /// The key, once its record has taken `seq`.
    pub fn at(self, seq: u64) -> Vec<u8> {
        match self {
            Key::Whole(key) => key,
            Key::Seq(mut prefix) => {
                prefix.extend_from_slice(&seq.to_be_bytes());
                prefix
            }
        }
    }
}

/// One record encoded for an append: its table, key and value, and the
/// epoch of the open that wrote it (`None` for events, which carry none).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub table: &'static TableDef,
    pub key: Key,
    pub value: Arc<[u8]>,
    pub epoch: Option<u64>,
}

impl<R: Serialize + DeserializeOwned> Table<R> {
    /// A table of bincode records, each under the key `key` gives it and
    /// stamped with the epoch `epoch` reads from it (I-41).
    pub const fn bincode(def: TableDef, key: fn(&R) -> Vec<u8>, epoch: fn(&R) -> u64) -> Self {
        Table {
            def,
            key: KeyOf::Whole(key),
            epoch: Some(epoch),
            encode: codec::encode_bincode::<R>,
            decode: codec::decode_bincode::<R>,
        }
    }
}

impl<R> Table<R> {
    /// The record encoded, under its key.
    pub fn row(&'static self, record: &R) -> Result<Row, crate::Error> {
        let key = match &self.key {
            KeyOf::Whole(key) => Key::Whole(key(record)),
            KeyOf::Seq(owner) => Key::Seq(owner(record)),
        };
        let value = (self.encode)(record)?;
        // A record's shape, before it is appended (test builds): its bytes
        // decode, to a record stored under the same key.
        if cfg!(debug_assertions) {
            let back = (self.decode)(&value);
            debug_assert!(
                back.as_ref()
                    .is_ok_and(|back| self.key_bytes(back) == self.key_bytes(record)),
                "a {} record does not read back as itself: {:?}",
                self.def.name,
                back.err()
            );
        }
        Ok(Row {
            table: &self.def,
            key,
            value,
            epoch: self.epoch.map(|epoch| epoch(record)),
        })
    }

    /// The key a record is stored under (its owner's prefix, for a table
    /// keyed by seq).
    fn key_bytes(&self, record: &R) -> Vec<u8> {
        match &self.key {
            KeyOf::Whole(key) => key(record),
            KeyOf::Seq(owner) => owner(record),
        }
    }

    /// One stored value decoded.
    pub fn decode(&self, value: &[u8]) -> Result<R, String> {
        (self.decode)(value)
    }
}

/// A table whatever its records: what `scan` and `verify` check rows with.
pub trait AnyTable: Sync {
    fn def(&self) -> &TableDef;
    /// Decodes `value` and checks it is stored under `key` (invariant 1).
    fn check(&self, key: &[u8], value: &[u8]) -> Result<(), String>;
}

impl<R> AnyTable for Table<R>
where
    Table<R>: Sync,
{
    fn def(&self) -> &TableDef {
        &self.def
    }

    fn check(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.check_key(key, &self.decode(value)?)
    }
}

impl<R> Table<R> {
    /// Checks that `record` is stored under `key` (invariant 1).
    pub fn check_key(&self, key: &[u8], record: &R) -> Result<(), String> {
        let (expected, fits) = match &self.key {
            KeyOf::Whole(of) => {
                let expected = of(record);
                let fits = expected == key;
                (expected, fits)
            }
            KeyOf::Seq(owner) => {
                let owner = owner(record);
                let fits = key.len() == owner.len() + 8 && key.starts_with(&owner);
                (owner, fits)
            }
        };
        if fits {
            return Ok(());
        }
        Err(format!(
            "stored under the wrong key: its content says {}",
            codec::hex(&expected)
        ))
    }
}

const fn state(name: &'static str, keyed_by: KeyedBy) -> TableDef {
    TableDef {
        name,
        shape: Shape::State,
        keyed_by,
    }
}

const fn history(name: &'static str, owner_bytes: usize, keyed_by: KeyedBy) -> TableDef {
    TableDef {
        name,
        shape: Shape::History { owner_bytes },
        keyed_by,
    }
}

const RUNS_TABLE: TableDef = state("runs", KeyedBy::Run);
const JOBS_TABLE: TableDef = state("jobs", KeyedBy::Run);
const LEDGER_TABLE: TableDef = history("ledger", 17, KeyedBy::Account);
const DELEGATIONS_TABLE: TableDef = state("delegations", KeyedBy::Job);
const STEERING_TABLE: TableDef = state("steering", KeyedBy::Job);
const EVENTS_TABLE: TableDef = history("events", 16, KeyedBy::Run);
const SANDBOXES_TABLE: TableDef = state("sandboxes", KeyedBy::Job);
/// The service's admission queue (`arbor-service` defines its records).
pub const SUBMISSIONS_TABLE: TableDef = state("submissions", KeyedBy::Run);
/// Notifications on their way out of the node (`arbor-runtime` defines
/// its records), each committed with its event.
pub const OUTBOX_TABLE: TableDef = state("outbox", KeyedBy::Run);
/// Who changed what through the API, and when (`arbor-service` defines
/// its records), each committed with the change it made (I-64).
pub const AUDIT_TABLE: TableDef = state("audit", KeyedBy::Time);
/// What each tenant's runs reserved from its quota windows (`arbor-service`
/// defines its records, I-65), outliving the runs themselves.
pub const QUOTAS_TABLE: TableDef = state("quotas", KeyedBy::Tenant);
/// The requests in each provider's rate windows on a shared journal
/// (`arbor-providers` defines its records, I-65).
pub const RATES_TABLE: TableDef = state("rates", KeyedBy::Window);
/// Each schedule's state and the ticks it started, skipped or missed
/// (`arbor-service` defines its records, I-66).
pub const SCHEDULES_TABLE: TableDef = state("schedules", KeyedBy::Schedule);
/// Each workspace version runs were admitted with, and which is current
/// (`arbor-runtime` defines its records, I-67).
pub const VERSIONS_TABLE: TableDef = state("versions", KeyedBy::Version);
const APPROVALS_TABLE: TableDef = state("approvals", KeyedBy::Run);
const TAPES_TABLE: TableDef = state("tapes", KeyedBy::Run);

pub static RUNS: Table<RunRecord> =
    Table::bincode(RUNS_TABLE, |r| codec::run_key(r.id), |r| r.epoch);
pub static JOBS: Table<JobRecord> =
    Table::bincode(JOBS_TABLE, |j| codec::job_key(j.run, j.id), |j| j.epoch);
pub static LEDGER: Table<LedgerRecord> = Table {
    def: LEDGER_TABLE,
    key: KeyOf::Seq(|l| codec::ledger_prefix(l.owner)),
    epoch: Some(|l| l.epoch),
    encode: codec::encode_bincode::<LedgerRecord>,
    decode: codec::decode_bincode::<LedgerRecord>,
};
pub static DELEGATIONS: Table<DelegationRecord> = Table::bincode(
    DELEGATIONS_TABLE,
    |d| codec::delegation_key(d.parent, &d.key),
    |d| d.epoch,
);
pub static STEERING: Table<SteerRecord> = Table::bincode(
    STEERING_TABLE,
    |s| codec::steer_key(s.job, s.message_id),
    |s| s.epoch,
);
/// Events go as JSON (`codec::encode_event`).
pub static EVENTS: Table<Event> = Table {
    def: EVENTS_TABLE,
    key: KeyOf::Whole(|e| codec::event_key(e.run, e.seq)),
    epoch: None,
    encode: codec::encode_event,
    decode: codec::decode_event,
};
pub static SANDBOXES: Table<SandboxRecord> = Table::bincode(
    SANDBOXES_TABLE,
    |s| codec::sandbox_key(s.job, s.pgid),
    |s| s.epoch,
);

pub static APPROVALS: Table<ApprovalRecord> = Table::bincode(
    APPROVALS_TABLE,
    |a| codec::approval_key(a.run, a.id),
    |a| a.epoch,
);

pub static TAPES: Table<TapeRecord> = Table::bincode(
    TAPES_TABLE,
    |t| codec::tape_key(t.run, t.job, t.kind, t.index),
    |t| t.epoch,
);

/// One table of a journal: its `Table` when storage defines its records
/// (so `scan` and `verify` read it), or only its name and shape when another
/// crate does.
#[derive(Clone, Copy)]
pub enum JournalTable {
    Ours(&'static dyn AnyTable),
    Foreign(TableDef),
}

impl JournalTable {
    pub fn def(&self) -> &TableDef {
        match self {
            JournalTable::Ours(table) => table.def(),
            JournalTable::Foreign(def) => def,
        }
    }

    pub fn ours(&self) -> Option<&'static dyn AnyTable> {
        match *self {
            JournalTable::Ours(table) => Some(table),
            JournalTable::Foreign(_) => None,
        }
    }
}

/// Every table of a journal, whoever owns its records, in the order the log
/// numbers them (invariant 2). The one list: a table missing here is neither
/// replayed, scanned nor verified.
pub static JOURNAL_TABLES: [JournalTable; 16] = [
    JournalTable::Ours(&RUNS),
    JournalTable::Ours(&JOBS),
    JournalTable::Ours(&LEDGER),
    JournalTable::Ours(&DELEGATIONS),
    JournalTable::Ours(&STEERING),
    JournalTable::Ours(&EVENTS),
    JournalTable::Ours(&SANDBOXES),
    JournalTable::Foreign(SUBMISSIONS_TABLE),
    JournalTable::Ours(&APPROVALS),
    JournalTable::Ours(&TAPES),
    JournalTable::Foreign(OUTBOX_TABLE),
    JournalTable::Foreign(AUDIT_TABLE),
    JournalTable::Foreign(QUOTAS_TABLE),
    JournalTable::Foreign(RATES_TABLE),
    JournalTable::Foreign(SCHEDULES_TABLE),
    JournalTable::Foreign(VERSIONS_TABLE),
];

/// The tables whose records storage defines, for `scan` and `verify`.
pub fn tables() -> impl Iterator<Item = &'static dyn AnyTable> {
    JOURNAL_TABLES.iter().filter_map(JournalTable::ours)
}

/// `name`'s place in `JOURNAL_TABLES` (invariant 2).
pub fn table_index(name: &str) -> Option<usize> {
    JOURNAL_TABLES.iter().position(|t| t.def().name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_has_a_distinct_name_and_refuses_a_value_it_cannot_decode() {
        let mut names: Vec<&str> = JOURNAL_TABLES.iter().map(|t| t.def().name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), JOURNAL_TABLES.len());
        for table in tables() {
            assert!(table.check(b"key", b"").is_err(), "{}", table.def().name);
        }
    }

    /// Only the service's submissions and the runtime's outbox are another
    /// crate's (`arbor journal verify` is handed their checkers); every
    /// other table is scanned here.
    #[test]
    fn only_the_submissions_and_the_outbox_are_another_crates_tables() {
        let foreign: Vec<&str> = JOURNAL_TABLES
            .iter()
            .filter(|slot| slot.ours().is_none())
            .map(|slot| slot.def().name)
            .collect();
        assert_eq!(
            foreign,
            [
                SUBMISSIONS_TABLE.name,
                OUTBOX_TABLE.name,
                AUDIT_TABLE.name,
                QUOTAS_TABLE.name,
                RATES_TABLE.name,
                SCHEDULES_TABLE.name,
                VERSIONS_TABLE.name
            ]
        );
    }
}
