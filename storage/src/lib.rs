//! arbor's journal: every record the node must not forget, in sled on disk.
//!
//! Owns the record types, the key layout, versioned encoding, group commit and
//! the recovery scan. Knows nothing of actors or HTTP: callers hand it plain
//! records and read plain records back.
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
//! | `meta`        | `format` (u32 BE), `epoch` (u64 BE), `seq` (u64 BE)          | bare integers    |
//!
//! Ids are uuid v7, so every prefix scan returns records in creation order.
//! Every record value is one format-version byte (1) followed by the bincode
//! serde encoding of the record, except events: they are the version byte
//! followed by the event's JSON, because bincode's serde mode cannot carry
//! `serde_json::Value` or internally tagged enums.
//!
//! # Invariants
//! 1. A value with an unknown version byte is undecodable: reads fail on it and
//!    `scan` lists it by tree and key; nothing is skipped silently.
//! 2. The journal seq is monotonic across the journal's whole life, reopens
//!    included; seq order is apply order.
//! 3. A record is durable once `durable_seq` reaches its seq; `commit` waits for
//!    that (I-29), `append` does not.
//! 4. Each open bumps the boot epoch by one, durably, before returning.

mod codec;
mod error;
mod journal;
mod record;

pub use error::Error;
pub use journal::{Journal, ScanReport, Undecodable, open_db};
pub use record::{
    DelegationRecord, JobRecord, LedgerOp, LedgerRecord, LedgerTotals, Record, RunRecord,
    SteerRecord, SteerState, ledger_totals,
};
