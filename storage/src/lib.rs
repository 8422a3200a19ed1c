//! arbor's journal: every record the node must not forget, on disk.
//!
//! Owns the record types, their tables and key layout, versioned encoding,
//! the `Journal` handle every caller holds, and the `Engine` interface behind
//! it, with its two engines: sled behind a write-ahead log of arbor's own with
//! group commit (the default), and PostgreSQL, which several nodes share
//! (its layout migrated forward in numbered steps at open). Knows nothing of actors, processes or HTTP: callers hand it plain
//! records and read plain records back.
//!
//! # Modules
//! - `journal.rs`: the handle: append, commit, typed reads, scan, verify, forget.
//! - `engine.rs`: what a backend implements; `sled_engine.rs` (and its folder:
//!   open, flusher, applier, work, reads, chunk, wal, fsync) is the default,
//!   `pg_engine.rs` (and its folder: schema and its migrations, writer, lease,
//!   queue, reads, progress)
//!   the PostgreSQL one; `overlay.rs` serves both.
//! - `table.rs`: each kind of record, its table and key (`JOURNAL_TABLES`).
//! - `record.rs`, `codec.rs`: the records and their bytes; `verify.rs`: the
//!   accounts' rules; `faults.rs`: fault injection for tests.
//!
//! # Key layout
//!
//! | tree          | key                                                          | value            |
//! |---------------|--------------------------------------------------------------|------------------|
//! | `runs`        | run uuid (16 bytes)                                          | `RunRecord`      |
//! | `jobs`        | run uuid ++ job uuid                                         | `JobRecord`      |
//! | `ledger`      | owner tag (0 = run, 1 = job) ++ owner uuid ++ journal seq u64 BE | `LedgerRecord` |
//! | `delegations` | parent job uuid ++ delegation key (utf-8)                     | `DelegationRecord` |
//! | `steering`    | job uuid ++ message id u64 BE                                | `SteerRecord`    |
//! | `events`      | run uuid ++ event seq u64 BE                                 | `Event`          |
//! | `sandboxes`   | job uuid ++ pgid (i32 as u32 bits, BE)                       | `SandboxRecord`  |
//! | `submissions` | run uuid                                                     | the service's `SubmissionRecord` |
//! | `approvals`   | run uuid ++ card uuid                                        | `ApprovalRecord` |
//! | `tapes`       | run uuid ++ job uuid ++ kind u8 ++ index u32 BE              | `TapeRecord`     |
//! | `meta`        | `format` (u32 BE), `epoch` (u64 BE), `seq` (u64 BE)          | bare integers (the sled engine's own) |
//!
//! Ids are uuid v7, so every prefix scan returns records in creation order.
//! Every record value is one format-version byte (3) followed by the bincode
//! serde encoding of the record, except events: they are the version byte
//! followed by the event's JSON, because bincode's serde mode cannot carry
//! `serde_json::Value` or internally tagged enums.
//!
//! # Invariants
//! 1. A value with an unknown version byte is undecodable: reads fail on it and
//!    `scan` (and `verify`) list it by tree and key; nothing is skipped silently
//!    (I-35).
//! 2. The journal seq is monotonic across the journal's whole life, reopens
//!    included; seq order is apply order.
//! 3. A record is durable once `durable_seq` reaches its seq; `commit` waits for
//!    that (I-29), `append` does not. Durable means sled flushed it *and* its
//!    `db` file was `fdatasync`ed (new blob files `fsync`ed first): sled 0.34's
//!    own flush only issues `sync_file_range`, which leaves it in the device's
//!    cache (see `fsync.rs`). So an acknowledged record survives power loss.
//! 4. Each open bumps the boot epoch by one, durably, before returning.
//! 5. Every record but an event carries the epoch of the boot that wrote it,
//!    and `append` refuses, whole and writing nothing, any batch with a record
//!    of another epoch: earlier (a late write from before a restart, I-41) or
//!    later (impossible, so a bug).
//! 6. The first failed write or flush stops the journal: every append after it
//!    fails with `Error::Failed` naming that failure, and no later flush
//!    acknowledges anything, until the journal is reopened.
//! 7. A sandbox record names a process group by pgid *and* its leader's start
//!    time and boot id; recovery kills only processes of that group in the
//!    same boot, and none if the pgid's leader now is another process
//!    (`group_members`, I-30).
//! 8. Every account in the ledger balances: spent + held <= grant; a closed
//!    account holds nothing and its `Close` claims what its ledger adds up to;
//!    a parent's `Release` charges what the child's own account spent.
//!    `verify` reports each breach by account.
//!
//! 9. `forget` removes a run whole, in one append of removal entries (an
//!    empty value: every key under a prefix), replayed in order after the
//!    writes it removes; nothing else removes a record.
//!
//! # Testing
//! `Journal::faults` injects a failed write, a failed flush, or a held flush
//! (a crash between write and flush: applied, never acknowledged).

mod codec;
mod engine;
mod error;
mod faults;
mod journal;
mod overlay;
mod pg_engine;
mod record;
mod sled_engine;
mod table;
mod verify;

pub use codec::{EncodedEvent, EventTail};
pub use engine::{Claimed, Counters, Durable, Engine, NodeLease, OwnedRow, Span, Visit, WalkVisit};
pub use error::Error;
pub use faults::{Crash, CrashKind, CrashPoint, Faults, crash_at_first_claim};
pub use journal::{Exclusive, Journal, Prepared, Record, ScanReport, Undecodable, WeakJournal};
pub use pg_engine::{PG_LAYOUT, PgEngine, PgOptions, check_schema_name};
pub use record::{
    ApprovalRecord, DelegationRecord, JobRecord, LedgerOp, LedgerRecord, LedgerTotals, RunRecord,
    SandboxRecord, SandboxState, SteerRecord, SteerState, TapeRecord, Unit, ledger_of,
    ledger_totals, usd_totals,
};
pub use sled_engine::{SledEngine, open_db};
pub use table::{
    AUDIT_TABLE, AnyTable, JOURNAL_TABLES, JournalTable, Key, KeyedBy, OUTBOX_TABLE, QUOTAS_TABLE,
    RATES_TABLE, Row, SCHEDULES_TABLE, SUBMISSIONS_TABLE, Shape, Table, TableDef, VERSIONS_TABLE,
    tables,
};
pub use verify::VerifyReport;
