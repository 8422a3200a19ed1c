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
//!    entries); `check_entry` recomputes it so `scan` catches a value stored
//!    under the wrong key.

use crate::Error;
use crate::record::{
    DelegationRecord, JobRecord, LedgerRecord, RunRecord, SandboxRecord, SteerRecord,
    SubmissionRecord,
};
use arbor_protocol::{Event, EventKind, JobId, ParentRef, RunId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// The version byte that starts every record value.
pub(crate) const FORMAT_VERSION: u8 = 1;

pub(crate) const RUNS: &str = "runs";
pub(crate) const JOBS: &str = "jobs";
pub(crate) const LEDGER: &str = "ledger";
pub(crate) const DELEGATIONS: &str = "delegations";
pub(crate) const STEERING: &str = "steering";
pub(crate) const EVENTS: &str = "events";
/// An event's key begins with its run (16 bytes), a ledger entry's with its
/// owner (a tag byte and 16): history trees keep each owner's records
/// together (`encode_event_chunk`, `Overlay`).
pub(crate) const EVENT_OWNER_BYTES: usize = 16;
pub(crate) const LEDGER_OWNER_BYTES: usize = 17;
pub(crate) const SANDBOXES: &str = "sandboxes";
pub(crate) const SUBMISSIONS: &str = "submissions";
pub(crate) const META: &str = "meta";

/// The trees that hold records, in the order `scan` walks them.
pub(crate) const RECORD_TREES: [&str; 8] = [
    RUNS,
    JOBS,
    LEDGER,
    DELEGATIONS,
    STEERING,
    EVENTS,
    SANDBOXES,
    SUBMISSIONS,
];

/// Meta keys. Meta values are bare big-endian integers with no version byte:
/// `format` must be readable whatever the record format is.
pub(crate) const META_FORMAT: &[u8] = b"format"; // u32
pub(crate) const META_EPOCH: &[u8] = b"epoch"; // u64
pub(crate) const META_SEQ: &[u8] = b"seq"; // u64

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

pub(crate) fn ledger_key(owner: ParentRef, seq: u64) -> Vec<u8> {
    [ledger_prefix(owner), seq.to_be_bytes().to_vec()].concat()
}

pub(crate) fn delegation_key(parent: JobId, key: &str) -> Vec<u8> {
    [parent.0.as_bytes().as_slice(), key.as_bytes()].concat()
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

/// At most this many records go into one chunk (events, ledger entries).
pub(crate) const CHUNK_MAX: usize = 64;

/// Starts a chunk's body; a lone event's body is JSON, which starts with `{`.
const EVENT_CHUNK: u8 = 0;

/// How sled holds events: one run's events that were applied together, in
/// one value under the key of the first (`event_key(run, first seq)`).
/// Version byte ++ `EVENT_CHUNK` ++ per event, its JSON's length (u32,
/// big-endian) ++ its JSON. sled's cost is per entry far more than per byte
/// (about 5 µs an entry of 30 or 200 bytes, 7 µs at a KiB, measured), and
/// events were half a job's entries. The log and the overlay keep events one by
/// one (`encode_event`); only the applier chunks them.
///
/// `events` are `encode_event` values, all of one run, in seq order.
pub(crate) fn encode_event_chunk<'a>(events: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut bytes = vec![FORMAT_VERSION, EVENT_CHUNK];
    for event in events {
        let json = event.get(1..).unwrap_or_default();
        // An event is far below 4 GiB: the output it carries is bounded.
        bytes.extend_from_slice(&(json.len() as u32).to_be_bytes());
        bytes.extend_from_slice(json);
    }
    bytes
}

/// The events in one stored value: a chunk, or one event on its own (what
/// the overlay holds, and what journals written before chunks hold).
pub(crate) fn decode_events(value: &[u8]) -> Result<Vec<Event>, String> {
    let body = body(value)?;
    let Some((&EVENT_CHUNK, mut rest)) = body.split_first() else {
        return decode_event(value).map(|event| vec![event]);
    };
    let mut events = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| format!("event chunk cut short after {} events", events.len()))?;
        let len = u32::from_be_bytes(*len) as usize;
        if tail.len() < len {
            return Err(format!(
                "event chunk cut short inside event {}",
                events.len() + 1
            ));
        }
        let (json, tail) = tail.split_at(len);
        events.push(serde_json::from_slice(json).map_err(|e| e.to_string())?);
        rest = tail;
    }
    if events.is_empty() {
        return Err("an event chunk with no events".into());
    }
    Ok(events)
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

/// Decodes one entry of a record tree and checks it is stored under the key
/// its content implies; says how many records it holds (an event chunk
/// holds several). Unknown trees are refused: `scan` only walks ours.
pub(crate) fn check_entry(tree: &str, key: &[u8], value: &[u8]) -> Result<u64, String> {
    let expected = match tree {
        RUNS => run_key(decode_bincode::<RunRecord>(value)?.id),
        JOBS => {
            let job = decode_bincode::<JobRecord>(value)?;
            job_key(job.run, job.id)
        }
        LEDGER => return check_ledger_entry(key, value).map(|e| e.len() as u64),
        DELEGATIONS => {
            let delegation = decode_bincode::<DelegationRecord>(value)?;
            delegation_key(delegation.parent, &delegation.key)
        }
        STEERING => {
            let steer = decode_bincode::<SteerRecord>(value)?;
            steer_key(steer.job, steer.message_id)
        }
        EVENTS => return check_event_entry(key, value),
        SANDBOXES => {
            let sandbox = decode_bincode::<SandboxRecord>(value)?;
            sandbox_key(sandbox.job, sandbox.pgid)
        }
        SUBMISSIONS => run_key(decode_bincode::<SubmissionRecord>(value)?.run),
        other => return Err(format!("no record type for tree {other:?}")),
    };
    if expected != key {
        return Err(format!(
            "stored under the wrong key: its content says {}",
            hex(&expected)
        ));
    }
    Ok(1)
}

/// An event entry: under the key of its first event, every event of the
/// run the key names, in rising seq order.
fn check_event_entry(key: &[u8], value: &[u8]) -> Result<u64, String> {
    let events = decode_events(value)?;
    let first = &events[0];
    let expected = event_key(first.run, first.seq);
    if expected != key {
        return Err(format!(
            "stored under the wrong key: its content says {}",
            hex(&expected)
        ));
    }
    for pair in events.windows(2) {
        if pair[1].run != first.run || pair[1].seq <= pair[0].seq {
            return Err(format!(
                "an event chunk out of order: seq {} of run {} follows seq {} of run {}",
                pair[1].seq, pair[1].run, pair[0].seq, pair[0].run
            ));
        }
    }
    Ok(events.len() as u64)
}

/// Starts a ledger chunk's body. A lone entry's body is bincode of a
/// `LedgerRecord`, which starts with its owner's variant (0 or 1).
const LEDGER_CHUNK: u8 = 0xFF;

/// The journal seq in a ledger key (its last 8 bytes).
fn ledger_seq(key: &[u8]) -> Result<u64, String> {
    key.get(17..)
        .and_then(|tail| <[u8; 8]>::try_from(tail).ok())
        .map(u64::from_be_bytes)
        .ok_or_else(|| format!("ledger key of {} bytes, expected 25", key.len()))
}

/// How sled holds ledger entries: one account's entries that were applied
/// together, in one value under the key of the first, as events are
/// (`encode_event_chunk`): a job's account writes four or five entries in
/// a few milliseconds. Version byte ++ `LEDGER_CHUNK` ++ per entry, its
/// journal seq (u64) ++ its body's length (u32), both big-endian, ++ its
/// body (bincode).
///
/// `entries` are `(ledger_key, encode_bincode value)`, all of one account,
/// in seq order.
pub(crate) fn encode_ledger_chunk<'a>(
    entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> Vec<u8> {
    let mut bytes = vec![FORMAT_VERSION, LEDGER_CHUNK];
    for (key, value) in entries {
        bytes.extend_from_slice(key.get(17..).unwrap_or_default());
        let body = value.get(1..).unwrap_or_default();
        bytes.extend_from_slice(&(body.len() as u32).to_be_bytes());
        bytes.extend_from_slice(body);
    }
    bytes
}

/// The ledger entries in one stored value, each with its journal seq: a
/// chunk, or one entry on its own (the overlay's, an older journal's).
pub(crate) fn decode_ledger(key: &[u8], value: &[u8]) -> Result<Vec<(u64, LedgerRecord)>, String> {
    let body = body(value)?;
    let Some((&LEDGER_CHUNK, mut rest)) = body.split_first() else {
        return Ok(vec![(ledger_seq(key)?, decode_bincode(value)?)]);
    };
    let mut entries = Vec::new();
    while !rest.is_empty() {
        let cut = || format!("ledger chunk cut short after {} entries", entries.len());
        let (seq, tail) = rest.split_first_chunk::<8>().ok_or_else(cut)?;
        let (len, tail) = tail.split_first_chunk::<4>().ok_or_else(cut)?;
        let len = u32::from_be_bytes(*len) as usize;
        if tail.len() < len {
            return Err(cut());
        }
        let (record, tail) = tail.split_at(len);
        let (decoded, read) =
            bincode::serde::decode_from_slice(record, bincode::config::standard())
                .map_err(|e| e.to_string())?;
        if read != len {
            return Err(format!("{} trailing bytes in a ledger entry", len - read));
        }
        entries.push((u64::from_be_bytes(*seq), decoded));
        rest = tail;
    }
    if entries.is_empty() {
        return Err("a ledger chunk with no entries".into());
    }
    Ok(entries)
}

/// Decodes one ledger value and checks it is stored under its key: every
/// entry of the account the key names, the first at the key's seq, seqs
/// rising (a seq is in the key, or the chunk, never in a record).
pub(crate) fn check_ledger_entry(key: &[u8], value: &[u8]) -> Result<Vec<LedgerRecord>, String> {
    let entries = decode_ledger(key, value)?;
    let (first_seq, first) = &entries[0];
    let expected = ledger_key(first.owner, *first_seq);
    if expected != key {
        return Err(format!(
            "stored under the wrong key: its content says {}",
            hex(&expected)
        ));
    }
    for pair in entries.windows(2) {
        let ((before, _), (seq, entry)) = (&pair[0], &pair[1]);
        if entry.owner != first.owner || seq <= before {
            return Err(format!(
                "a ledger chunk out of order: seq {seq} follows seq {before} of {}",
                hex(key)
            ));
        }
    }
    Ok(entries.into_iter().map(|(_, entry)| entry).collect())
}

/// Checks one meta entry: a known key with a value of the right width.
pub(crate) fn check_meta(key: &[u8], value: &[u8]) -> Result<(), String> {
    let width = match key {
        META_FORMAT => 4,
        META_EPOCH | META_SEQ => 8,
        _ => return Err("unknown meta key".into()),
    };
    if value.len() != width {
        return Err(format!("{} bytes, expected {width}", value.len()));
    }
    Ok(())
}

pub(crate) fn meta_u64(key: &[u8], value: &[u8]) -> Result<u64, Error> {
    <[u8; 8]>::try_from(value)
        .map(u64::from_be_bytes)
        .map_err(|_| undecodable(META, key, format!("{} bytes, expected 8", value.len())))
}

pub(crate) fn meta_u32(key: &[u8], value: &[u8]) -> Result<u32, Error> {
    <[u8; 4]>::try_from(value)
        .map(u32::from_be_bytes)
        .map_err(|_| undecodable(META, key, format!("{} bytes, expected 4", value.len())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{LedgerOp, SandboxState, SteerState};
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
                status: Status::Done,
                error_class: None,
                reason: None,
                output: serde_json::json!({"answer": [1, 2]}),
            },
        };
        let bytes = encode_event(&event).unwrap().to_vec();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode_event(&bytes).unwrap(), event);
        assert!(check_entry(EVENTS, &event_key(event.run, 9), &bytes).is_ok());
    }

    /// An event put together from its kind's JSON, encoded before its seq
    /// was known, is byte for byte the event encoded whole.
    #[test]
    fn an_event_encoded_in_two_parts_is_the_event_encoded_whole() {
        let run = RunId::new();
        let kinds = [
            EventKind::NodeRunning { id: JobId::new() },
            EventKind::RunFinished {
                status: Status::Failed,
                error_class: None,
                reason: Some("a \"quoted\" reason\nover two lines".into()),
                output: serde_json::json!({"answer": [1, 2], "note": "é"}),
            },
            EventKind::NodeSpawned {
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
    fn an_event_chunk_holds_its_events_in_order_and_a_damaged_one_is_refused() {
        let run = RunId::new();
        let event = |seq| Event {
            seq,
            run,
            at_ms: seq,
            kind: EventKind::RunResumed {
                epoch: 1,
                group: seq as u32,
            },
        };
        let lone: Vec<Vec<u8>> = [4, 5, 7]
            .map(|s| encode_event(&event(s)).unwrap().to_vec())
            .into();
        let chunk = encode_event_chunk(lone.iter().map(Vec::as_slice));
        assert_eq!(
            decode_events(&chunk).unwrap(),
            vec![event(4), event(5), event(7)]
        );
        assert_eq!(check_entry(EVENTS, &event_key(run, 4), &chunk), Ok(3));
        assert!(
            check_entry(EVENTS, &event_key(run, 5), &chunk)
                .unwrap_err()
                .contains("wrong key")
        );
        // A lone event, as the overlay and older journals hold it.
        assert_eq!(decode_events(&lone[0]).unwrap(), vec![event(4)]);
        // Cut anywhere inside, the chunk is refused, never read short.
        for cut in [3, 6, chunk.len() - 1] {
            assert!(decode_events(&chunk[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_events(&[FORMAT_VERSION, 0]).is_err(), "empty chunk");
        let backwards = encode_event_chunk([lone[1].as_slice(), lone[0].as_slice()]);
        assert!(
            check_entry(EVENTS, &event_key(run, 5), &backwards)
                .unwrap_err()
                .contains("out of order")
        );
    }

    #[test]
    fn a_ledger_chunk_keeps_each_entrys_seq_and_a_damaged_one_is_refused() {
        let owner = ParentRef::Job(JobId::new());
        let record = |tokens| LedgerRecord {
            owner,
            op: LedgerOp::CallReserve { tokens },
            epoch: 2,
        };
        let lone: Vec<(Vec<u8>, Vec<u8>)> = [(3, 30), (8, 80), (9, 90)]
            .map(|(seq, tokens)| {
                (
                    ledger_key(owner, seq),
                    encode_bincode(&record(tokens)).unwrap().to_vec(),
                )
            })
            .into();
        let chunk = encode_ledger_chunk(lone.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        let key = ledger_key(owner, 3);
        assert_eq!(
            decode_ledger(&key, &chunk).unwrap(),
            vec![(3, record(30)), (8, record(80)), (9, record(90))]
        );
        assert_eq!(check_entry(LEDGER, &key, &chunk), Ok(3));
        assert!(check_entry(LEDGER, &ledger_key(owner, 8), &chunk).is_err());
        // A lone entry: its seq is its key's.
        assert_eq!(
            decode_ledger(&lone[1].0, &lone[1].1).unwrap(),
            vec![(8, record(80))]
        );
        for cut in [3, 11, 14, chunk.len() - 1] {
            assert!(decode_ledger(&key, &chunk[..cut]).is_err(), "cut at {cut}");
        }
        let other = ParentRef::Run(RunId::new());
        let stranger = encode_bincode(&LedgerRecord {
            owner: other,
            ..record(1)
        })
        .unwrap();
        let mixed = encode_ledger_chunk([
            (lone[0].0.as_slice(), lone[0].1.as_slice()),
            (ledger_key(other, 4).as_slice(), &stranger[..]),
        ]);
        assert!(
            check_entry(LEDGER, &key, &mixed)
                .unwrap_err()
                .contains("out of order")
        );
    }

    #[test]
    fn unknown_version_empty_value_and_trailing_bytes_are_undecodable() {
        let entry = LedgerRecord {
            owner: ParentRef::Job(JobId::new()),
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
        bytes[0] = 2;
        assert!(
            decode_bincode::<LedgerRecord>(&bytes)
                .unwrap_err()
                .contains("version 2")
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
        assert!(check_entry(JOBS, &job_key(run, job.id), &bytes).is_ok());
        let wrong = job_key(RunId::new(), job.id);
        assert!(
            check_entry(JOBS, &wrong, &bytes)
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
        assert!(check_entry(SANDBOXES, &key, &bytes).is_ok());
        let other_group = sandbox_key(sandbox.job, 4243);
        assert!(key < other_group);
        assert!(
            check_entry(SANDBOXES, &other_group, &bytes)
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
    use crate::record::{LedgerOp, SteerState};
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
            "011001890a5dac96774bbcceb302099a80580166fb2c01010101010172027b7d02",
        );
        check(
            "JobRecord",
            encode_bincode(&job).unwrap().to_vec(),
            "011001890a5dac96774bbcceb302099a80571001890a5dac96774bbcceb302099a8058001001890a5dac96\
             774bbcceb302099a805802016101016c0102fc70110100022f77020103000001310503",
        );
        check(
            "LedgerRecord",
            encode_bincode(&ledger).unwrap().to_vec(),
            "01011001890a5dac96774bbcceb302099a8057021001890a5dac96774bbcceb302099a8057fbe803fbfb0001",
        );
        check(
            "DelegationRecord",
            encode_bincode(&delegation).unwrap().to_vec(),
            "011001890a5dac96774bbcceb302099a8057016b0164011001890a5dac96774bbcceb302099a805701",
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
            "011001890a5dac96774bbcceb302099a80581001890a5dac96774bbcceb302099a8057fb2421fc06120f0001620105",
        );
        check(
            "SteerRecord",
            encode_bincode(&steer).unwrap().to_vec(),
            "011001890a5dac96774bbcceb302099a80570901740204",
        );
    }
}
