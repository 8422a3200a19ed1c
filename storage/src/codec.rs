//! Key layout and value format: where each record lives in sled and what its
//! bytes are. The layout is written out in the crate doc (`lib.rs`).
//!
//! Invariants:
//! 1. Every record value is `FORMAT_VERSION` (1 byte) followed by its body; a
//!    value whose first byte is anything else is undecodable, never guessed at.
//! 2. Integers in keys are big-endian and ids are uuid v7 bytes, so sled's
//!    byte order is time order and a prefix scan returns one owner's records
//!    in the order they were written.
//! 3. A key is a function of its record (plus the journal seq for ledger
//!    entries); `table.rs` checks it, so `scan` catches a value stored under
//!    the wrong key.

use crate::Error;
use arbor_protocol::{CardId, Event, EventKind, JobId, ParentRef, RunId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// The version byte that starts every record value. 2: a history table's
/// chunks carry each row's key and whole value (`sled_engine/chunk.rs`).
pub(crate) const FORMAT_VERSION: u8 = 3;

const OWNER_RUN: u8 = 0;
const OWNER_JOB: u8 = 1;

pub(crate) fn run_key(id: RunId) -> Vec<u8> {
    id.0.as_bytes().to_vec()
}

pub(crate) fn job_key(run: RunId, id: JobId) -> Vec<u8> {
    [run.0.as_bytes().as_slice(), id.0.as_bytes()].concat()
}

/// The 17-byte prefix of every ledger key of one account.
pub(crate) fn ledger_prefix(owner: ParentRef) -> Vec<u8> {
    let (tag, uuid) = match owner {
        ParentRef::Run(id) => (OWNER_RUN, id.0),
        ParentRef::Job(id) => (OWNER_JOB, id.0),
    };
    [[tag].as_slice(), uuid.as_bytes()].concat()
}

pub(crate) fn delegation_key(parent: JobId, key: &str) -> Vec<u8> {
    [parent.0.as_bytes().as_slice(), key.as_bytes()].concat()
}

pub(crate) fn approval_key(run: RunId, card: CardId) -> Vec<u8> {
    [run.0.as_bytes().as_slice(), card.0.as_bytes()].concat()
}

/// Run uuid ++ job uuid ++ kind ++ index u32 BE: a job's entries together,
/// each kind in its order.
pub(crate) fn tape_key(run: RunId, job: JobId, kind: u8, index: u32) -> Vec<u8> {
    [
        run.0.as_bytes().as_slice(),
        job.0.as_bytes(),
        &[kind],
        &index.to_be_bytes(),
    ]
    .concat()
}

pub(crate) fn steer_key(job: JobId, message_id: u64) -> Vec<u8> {
    [job.0.as_bytes().as_slice(), &message_id.to_be_bytes()].concat()
}

pub(crate) fn event_key(run: RunId, seq: u64) -> Vec<u8> {
    [run.0.as_bytes().as_slice(), &seq.to_be_bytes()].concat()
}

/// Job uuid ++ pgid as the big-endian bytes of its `u32` bit pattern. Pgids
/// are positive, so key order within a job is pgid order.
pub(crate) fn sandbox_key(job: JobId, pgid: i32) -> Vec<u8> {
    [job.0.as_bytes().as_slice(), &pgid.to_be_bytes()].concat()
}

/// Version byte ++ bincode (serde mode, standard config). Shared, as the
/// journal keeps a value: not copied between the overlay's read index and
/// the applier's queue.
pub(crate) fn encode_bincode<T: Serialize>(value: &T) -> Result<Arc<[u8]>, Error> {
    versioned(|bytes| {
        bincode::serde::encode_into_std_write(value, bytes, bincode::config::standard())
            .map(|_| ())
            .map_err(|e| Error::Encode(e.to_string()))
    })
}

/// The version byte and what `write` puts after it, as a value of exactly
/// its size. Written into a buffer kept per thread and copied out once: a
/// value grown from one byte took a handful of reallocations and copies,
/// which came to a twentieth of a wide fan-out's instructions.
fn versioned<O: for<'a> From<&'a [u8]>>(
    write: impl FnOnce(&mut Vec<u8>) -> Result<(), Error>,
) -> Result<O, Error> {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// A buffer grown past this by one large value is not kept.
    const KEPT: usize = 64 * 1024;
    SCRATCH.with(|scratch| {
        // Nothing that encodes calls back into here; were it to, it gets a
        // buffer of its own.
        let mut own = Vec::new();
        let mut borrowed = scratch.try_borrow_mut();
        let bytes = match borrowed.as_deref_mut() {
            Ok(bytes) => bytes,
            Err(_) => &mut own,
        };
        bytes.clear();
        bytes.push(FORMAT_VERSION);
        let written = write(bytes).map(|()| O::from(bytes.as_slice()));
        if bytes.capacity() > KEPT {
            *bytes = Vec::new();
        }
        written
    })
}

/// Version byte ++ JSON. Events go as JSON because bincode's serde mode can
/// encode neither `serde_json::Value` (their outputs) nor internally tagged
/// enums (`EventKind` is `#[serde(tag = "type")]`): both need
/// `deserialize_any`, which a non-self-describing format cannot offer.
pub(crate) fn encode_event(event: &Event) -> Result<Arc<[u8]>, Error> {
    versioned(|bytes| serde_json::to_writer(bytes, event).map_err(|e| Error::Encode(e.to_string())))
}

/// An event's JSON from its run on, `,"run":...,"at_ms":...,"kind":{...}}`:
/// all of its journal value but the seq, which an emitter encodes before it
/// takes the event bus's lock (the lock that orders events hands out the
/// seq).
#[derive(Clone, Debug, PartialEq)]
pub struct EventTail(Vec<u8>);

impl EventTail {
    pub fn new(run: RunId, at_ms: u64, kind: &EventKind) -> Result<Self, Error> {
        use std::io::Write;
        let mut tail = Vec::with_capacity(256);
        // The field order of `Event`'s own serialization.
        let _ = write!(tail, ",\"run\":\"{run}\",\"at_ms\":{at_ms},\"kind\":");
        serde_json::to_writer(&mut tail, kind).map_err(|e| Error::Encode(e.to_string()))?;
        tail.push(b'}');
        Ok(Self(tail))
    }
}

/// An event's journal value, whole: the same bytes `encode_event` makes of
/// the `Event` (a test holds them equal), put together from its seq and
/// the rest, encoded before.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodedEvent {
    pub(crate) run: RunId,
    pub(crate) seq: u64,
    pub(crate) value: Arc<[u8]>,
}

impl EncodedEvent {
    /// `run` is the one `tail` was made with.
    pub fn new(seq: u64, run: RunId, tail: &EventTail) -> Self {
        use std::io::Write;
        let mut value = Vec::with_capacity(30 + tail.0.len());
        value.push(FORMAT_VERSION);
        let _ = write!(value, "{{\"seq\":{seq}");
        value.extend_from_slice(&tail.0);
        Self {
            run,
            seq,
            value: value.into(),
        }
    }
}

/// The body after the version byte, or why there is none.
fn body(value: &[u8]) -> Result<&[u8], String> {
    match value.split_first() {
        None => Err("empty value".into()),
        Some((&FORMAT_VERSION, body)) => Ok(body),
        Some((version, _)) => Err(format!(
            "unknown format version {version} (this build reads {FORMAT_VERSION})"
        )),
    }
}

/// Checks the version byte alone, for a table whose records another crate
/// defines (`Journal::scan`).
pub(crate) fn check_version(value: &[u8]) -> Result<(), String> {
    body(value).map(|_| ())
}

pub(crate) fn decode_bincode<T: DeserializeOwned>(value: &[u8]) -> Result<T, String> {
    let body = body(value)?;
    let (decoded, read) =
        bincode::serde::decode_from_slice::<T, _>(body, bincode::config::standard())
            .map_err(|e| e.to_string())?;
    // Trailing bytes mean the value is not what we think it is.
    if read != body.len() {
        return Err(format!("{} trailing bytes", body.len() - read));
    }
    Ok(decoded)
}

pub(crate) fn decode_event(value: &[u8]) -> Result<Event, String> {
    serde_json::from_slice(body(value)?).map_err(|e| e.to_string())
}

/// Lowercase hex, for naming a key in a report.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn undecodable(tree: &str, key: &[u8], error: String) -> Error {
    Error::Undecodable {
        tree: tree.to_string(),
        key_hex: hex(key),
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{
        JobRecord, LedgerOp, LedgerRecord, SandboxRecord, SandboxState, SteerRecord, SteerState,
    };
    use crate::table::{AnyTable, EVENTS, JOBS, Key, SANDBOXES};

    /// A ledger entry's key, as its append makes it.
    fn ledger_key(owner: ParentRef, seq: u64) -> Vec<u8> {
        Key::Seq(ledger_prefix(owner)).at(seq)
    }
    use arbor_protocol::{EventKind, NodeKind, Status};

    #[test]
    fn bincode_records_round_trip_with_their_version_byte() {
        let steer = SteerRecord {
            job: JobId::new(),
            message_id: 7,
            text: "focus on the tests".into(),
            state: SteerState::Delivered,
            epoch: 3,
        };
        let bytes = encode_bincode(&steer).unwrap().to_vec();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode_bincode::<SteerRecord>(&bytes).unwrap(), steer);
    }

    #[test]
    fn events_round_trip_as_json() {
        let event = Event {
            seq: 9,
            run: RunId::new(),
            at_ms: 1,
            kind: EventKind::RunFinished {
                limitations: Vec::new(),
                status: Status::Done,
                error_class: None,
                reason: None,
                output: serde_json::json!({"answer": [1, 2]}),
            },
        };
        let bytes = encode_event(&event).unwrap().to_vec();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode_event(&bytes).unwrap(), event);
        assert!(EVENTS.check(&event_key(event.run, 9), &bytes).is_ok());
    }

    /// An event put together from its kind's JSON, encoded before its seq
    /// was known, is byte for byte the event encoded whole.
    #[test]
    fn an_event_encoded_in_two_parts_is_the_event_encoded_whole() {
        let run = RunId::new();
        let kinds = [
            EventKind::JobRunning { id: JobId::new() },
            EventKind::RunFinished {
                limitations: Vec::new(),
                status: Status::Failed,
                error_class: None,
                reason: Some("a \"quoted\" reason\nover two lines".into()),
                output: serde_json::json!({"answer": [1, 2], "note": "é"}),
            },
            EventKind::JobSpawned {
                id: JobId::new(),
                parent: ParentRef::Run(run),
                kind: NodeKind::Job,
                agent: "leaf".into(),
                label: None,
                depth: 1,
                attempt: 1,
                grant_tokens: u64::MAX,
                grant_usd_micros: Some(0),
                workdir: "/w".into(),
                record_seq: 0,
                request: String::new(),
                call: Some("call_1".into()),
                model: "p/m".into(),
            },
        ];
        for (seq, kind) in [0, 7, u64::MAX].into_iter().zip(kinds) {
            let at_ms = seq / 3;
            let tail = EventTail::new(run, at_ms, &kind).unwrap();
            let parts = EncodedEvent::new(seq, run, &tail);
            let whole = encode_event(&Event {
                seq,
                run,
                at_ms,
                kind,
            })
            .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&parts.value),
                String::from_utf8_lossy(&whole)
            );
            assert_eq!(&parts.value[..], &whole[..]);
        }
    }

    #[test]
    fn unknown_version_empty_value_and_trailing_bytes_are_undecodable() {
        let entry = LedgerRecord {
            owner: ParentRef::Job(JobId::new()),
            unit: crate::Unit::Tokens,
            op: LedgerOp::Open { grant: 5 },
            epoch: 1,
        };
        let mut bytes = encode_bincode(&entry).unwrap().to_vec();
        bytes.push(0);
        assert!(
            decode_bincode::<LedgerRecord>(&bytes)
                .unwrap_err()
                .contains("trailing")
        );
        bytes[0] = 4;
        assert!(
            decode_bincode::<LedgerRecord>(&bytes)
                .unwrap_err()
                .contains("version 4")
        );
        assert!(decode_bincode::<LedgerRecord>(&[]).is_err());
    }

    #[test]
    fn a_record_under_a_key_it_does_not_own_is_reported() {
        let run = RunId::new();
        let job = JobRecord {
            id: JobId::new(),
            run,
            parent: ParentRef::Run(run),
            kind: NodeKind::Step,
            agent: "planner".into(),
            label: None,
            depth: 0,
            attempt: 1,
            grant_tokens: 10,
            workdir: "/w".into(),
            status: Status::Pending,
            task_status: None,
            error_class: None,
            reason: None,
            output_json: "null".into(),
            tokens_spent: 0,
            epoch: 1,
        };
        let bytes = encode_bincode(&job).unwrap().to_vec();
        assert!(JOBS.check(&job_key(run, job.id), &bytes).is_ok());
        let wrong = job_key(RunId::new(), job.id);
        assert!(
            JOBS.check(&wrong, &bytes)
                .unwrap_err()
                .contains("wrong key")
        );
    }

    #[test]
    fn sandbox_records_round_trip_under_job_then_pgid() {
        let run = RunId::new();
        let sandbox = SandboxRecord {
            run,
            job: JobId::new(),
            pgid: 4242,
            start_ticks: 987_654,
            boot_id: "6f1c8a52-0f7b-4bd0-9a49-1d6ba8b0b0c1".into(),
            state: SandboxState::Live,
            epoch: 2,
        };
        let bytes = encode_bincode(&sandbox).unwrap().to_vec();
        assert_eq!(decode_bincode::<SandboxRecord>(&bytes).unwrap(), sandbox);
        let key = sandbox_key(sandbox.job, sandbox.pgid);
        assert_eq!(key.len(), 20);
        assert_eq!(&key[16..], &4242u32.to_be_bytes());
        assert!(SANDBOXES.check(&key, &bytes).is_ok());
        let other_group = sandbox_key(sandbox.job, 4243);
        assert!(key < other_group);
        assert!(
            SANDBOXES
                .check(&other_group, &bytes)
                .unwrap_err()
                .contains("wrong key")
        );
    }

    #[test]
    fn keys_sort_by_owner_then_big_endian_seq() {
        let owner = ParentRef::Run(RunId::new());
        assert_eq!(ledger_key(owner, 1).len(), 25);
        assert!(ledger_key(owner, 255) < ledger_key(owner, 256));
        assert!(ledger_key(owner, 1).starts_with(&ledger_prefix(owner)));
        let job = ParentRef::Job(JobId(match owner {
            ParentRef::Run(r) => r.0,
            ParentRef::Job(j) => j.0,
        }));
        // Same uuid, other kind of owner: the tag byte keeps the accounts apart.
        assert_ne!(ledger_prefix(owner), ledger_prefix(job));
    }
}

/// The bytes of each record as this format version lays them out, pinned:
/// journals on disk depend on them, so a change here must come with a new
/// `FORMAT_VERSION` (and a way to read the old one).
#[cfg(test)]
mod golden {
    use super::*;
    use crate::record::{
        DelegationRecord, JobRecord, LedgerOp, LedgerRecord, RunRecord, SandboxRecord, SteerRecord,
        SteerState,
    };
    use arbor_protocol::{ErrorClass, NodeKind, Status, TaskStatus};

    fn job_id() -> JobId {
        "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap()
    }

    fn run_id() -> RunId {
        "01890a5d-ac96-774b-bcce-b302099a8058".parse().unwrap()
    }

    #[test]
    fn existing_record_layouts_do_not_change() {
        let run = RunRecord {
            id: run_id(),
            flow: "f".into(),
            budget_tokens: 300,
            status: Status::Running,
            error_class: Some(ErrorClass::Timeout),
            reason: Some("r".into()),
            output_json: "{}".into(),
            epoch: 2,
        };
        let job = JobRecord {
            id: job_id(),
            run: run_id(),
            parent: ParentRef::Run(run_id()),
            kind: NodeKind::Job,
            agent: "a".into(),
            label: Some("l".into()),
            depth: 1,
            attempt: 2,
            grant_tokens: 70_000,
            workdir: "/w".into(),
            status: Status::Done,
            task_status: Some(TaskStatus::Completed),
            error_class: None,
            reason: None,
            output_json: "1".into(),
            tokens_spent: 5,
            epoch: 3,
        };
        let ledger = LedgerRecord {
            owner: ParentRef::Job(job_id()),
            unit: crate::Unit::Tokens,
            op: LedgerOp::Release {
                child: job_id(),
                granted: 1_000,
                spent: 251,
            },
            epoch: 1,
        };
        let delegation = DelegationRecord {
            parent: job_id(),
            key: "k".into(),
            digest: "d".into(),
            children: vec![job_id()],
            epoch: 1,
        };
        let steer = SteerRecord {
            job: job_id(),
            message_id: 9,
            text: "t".into(),
            state: SteerState::Discarded,
            epoch: 4,
        };
        let check = |name: &str, bytes: Vec<u8>, expected: &str| {
            assert_eq!(hex(&bytes), expected, "the layout of {name} changed");
        };
        check(
            "RunRecord",
            encode_bincode(&run).unwrap().to_vec(),
            "031001890a5dac96774bbcceb302099a80580166fb2c01010101010172027b7d02",
        );
        check(
            "JobRecord",
            encode_bincode(&job).unwrap().to_vec(),
            "031001890a5dac96774bbcceb302099a80571001890a5dac96774bbcceb302099a8058001001890a5dac96\
             774bbcceb302099a805802016101016c0102fc70110100022f77020103000001310503",
        );
        check(
            "LedgerRecord",
            encode_bincode(&ledger).unwrap().to_vec(),
            "03011001890a5dac96774bbcceb302099a805700021001890a5dac96774bbcceb302099a8057fbe803fbfb0001",
        );
        check(
            "DelegationRecord",
            encode_bincode(&delegation).unwrap().to_vec(),
            "031001890a5dac96774bbcceb302099a8057016b0164011001890a5dac96774bbcceb302099a805701",
        );
        let sandbox = SandboxRecord {
            run: run_id(),
            job: job_id(),
            pgid: 4242,
            start_ticks: 987_654,
            boot_id: "b".into(),
            state: crate::record::SandboxState::Ended,
            epoch: 5,
        };
        check(
            "SandboxRecord",
            encode_bincode(&sandbox).unwrap().to_vec(),
            "031001890a5dac96774bbcceb302099a80581001890a5dac96774bbcceb302099a8057fb2421fc06120f0001620105",
        );
        check(
            "SteerRecord",
            encode_bincode(&steer).unwrap().to_vec(),
            "031001890a5dac96774bbcceb302099a80570901740204",
        );
    }
}
