//! How sled holds a history table's rows: the rows of one owner (a run's
//! events, an account's ledger entries) that were applied together go in one
//! sled value, under the key of the first. sled's cost is per entry far more
//! than per byte (about 5 µs an entry of 30 or 200 bytes, 7 µs at a KiB,
//! measured), and events and ledger entries were most of a job's entries.
//! The log and the overlay keep rows one by one; only the applier packs them.
//!
//! A chunk is `CHUNK` (one byte) ++ per row: the u64 that ends its key
//! (big-endian) ++ its value's length (u32, big-endian) ++ its value, whole
//! (its own version byte first). A row's key is its owner's bytes followed by
//! that u64 (`table.rs`, invariant 3), so a chunk is unpacked without
//! decoding a record. A value that does not start with `CHUNK` is one row on
//! its own, under its key.

use crate::codec::FORMAT_VERSION;

/// Starts a chunk: the format's version with the high bit set, so no record
/// value (which starts with the version itself) is taken for one.
const CHUNK: u8 = 0x80 | FORMAT_VERSION;

/// Rows unpacked: each one's key, and its value where it lies in the chunk.
pub(super) type Rows<'v> = Vec<(Vec<u8>, &'v [u8])>;

/// At most this many rows go into one chunk.
pub(super) const MOST_ROWS: usize = 64;

/// Packs `rows`, all of one owner, in key order.
pub(super) fn encode<'a>(rows: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Vec<u8> {
    let mut bytes = vec![CHUNK];
    for (key, value) in rows {
        bytes.extend_from_slice(&key[key.len().saturating_sub(8)..]);
        // A row is far below 4 GiB: the output a record carries is bounded.
        bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
        bytes.extend_from_slice(value);
    }
    bytes
}

/// The rows in one stored value, each with its key: a chunk's, checked to
/// sit under the key of its first and to rise, or the value itself.
pub(super) fn unpack<'v>(key: &[u8], value: &'v [u8]) -> Result<Rows<'v>, String> {
    let Some((&CHUNK, mut rest)) = value.split_first() else {
        return Ok(vec![(key.to_vec(), value)]);
    };
    let owner = key
        .len()
        .checked_sub(8)
        .map(|at| &key[..at])
        .ok_or_else(|| format!("a chunk under a key of {} bytes", key.len()))?;
    let mut rows: Vec<(Vec<u8>, &[u8])> = Vec::new();
    while !rest.is_empty() {
        let cut = || format!("chunk cut short after {} rows", rows.len());
        let (number, tail) = rest.split_first_chunk::<8>().ok_or_else(cut)?;
        let (len, tail) = tail.split_first_chunk::<4>().ok_or_else(cut)?;
        let len = u32::from_be_bytes(*len) as usize;
        if tail.len() < len {
            return Err(cut());
        }
        let (row, tail) = tail.split_at(len);
        let row_key = [owner, number.as_slice()].concat();
        match rows.last() {
            None if row_key != key => {
                return Err(format!(
                    "a chunk whose first row is {}, stored under another key",
                    crate::codec::hex(&row_key)
                ));
            }
            Some((before, _)) if *before >= row_key => {
                return Err(format!(
                    "a chunk out of order: {} follows {}",
                    crate::codec::hex(&row_key),
                    crate::codec::hex(before)
                ));
            }
            _ => {}
        }
        rows.push((row_key, row));
        rest = tail;
    }
    if rows.is_empty() {
        return Err("a chunk with no rows".into());
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(owner: u8, n: u64) -> Vec<u8> {
        [[owner; 16].as_slice(), &n.to_be_bytes()].concat()
    }

    #[test]
    fn a_chunk_unpacks_to_its_rows_and_a_lone_value_to_itself() {
        let keys = [key(7, 3), key(7, 9), key(7, 10)];
        let values: [&[u8]; 3] = [b"\x02a", b"\x02bb", b"\x02"];
        let packed = encode(keys.iter().map(Vec::as_slice).zip(values));
        let rows = unpack(&keys[0], &packed).unwrap();
        let expected: Vec<(Vec<u8>, &[u8])> = keys.iter().cloned().zip(values).collect();
        assert_eq!(rows, expected);
        assert_eq!(
            unpack(&keys[1], b"\x02lone").unwrap(),
            vec![(keys[1].clone(), &b"\x02lone"[..])]
        );
    }

    #[test]
    fn a_chunk_cut_short_out_of_order_or_misplaced_is_refused() {
        let keys = [key(1, 5), key(1, 6)];
        let packed = encode(
            keys.iter()
                .map(Vec::as_slice)
                .zip([&b"\x02x"[..], b"\x02y"]),
        );
        // Cut anywhere but where the first row ends, which is a whole chunk.
        let first_row_ends = 1 + 8 + 4 + 2;
        for cut in (1..packed.len()).filter(|&cut| cut != first_row_ends) {
            assert!(unpack(&keys[0], &packed[..cut]).is_err(), "cut at {cut}");
        }
        let backwards = encode([
            (keys[1].as_slice(), &b"\x02y"[..]),
            (keys[0].as_slice(), b"\x02x"),
        ]);
        assert!(
            unpack(&keys[1], &backwards)
                .unwrap_err()
                .contains("out of order")
        );
        assert!(
            unpack(&keys[1], &packed)
                .unwrap_err()
                .contains("another key")
        );
    }

    use crate::codec::{encode_bincode, encode_event, event_key, ledger_prefix};
    use crate::record::{LedgerOp, LedgerRecord};
    use crate::table::{AnyTable, EVENTS, LEDGER};
    use arbor_protocol::{Event, EventKind, JobId, ParentRef, RunId};

    /// Each row of a chunk, decoded by `table` and checked against its key.
    fn rows_of<R>(
        table: &'static crate::table::Table<R>,
        key: &[u8],
        chunk: &[u8],
    ) -> Result<Vec<R>, String>
    where
        crate::table::Table<R>: AnyTable,
    {
        let mut records = Vec::new();
        for (key, value) in unpack(key, chunk)? {
            table.check(&key, value)?;
            records.push(table.decode(value)?);
        }
        Ok(records)
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
        let lone: Vec<(Vec<u8>, Vec<u8>)> = [4, 5, 7]
            .map(|s| (event_key(run, s), encode_event(&event(s)).unwrap().to_vec()))
            .into();
        let chunk = encode(lone.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        assert_eq!(
            rows_of(&EVENTS, &event_key(run, 4), &chunk).unwrap(),
            vec![event(4), event(5), event(7)]
        );
        assert!(
            rows_of(&EVENTS, &event_key(run, 5), &chunk)
                .unwrap_err()
                .contains("another key")
        );
        // A lone event, as the overlay holds it.
        assert_eq!(
            rows_of(&EVENTS, &lone[0].0, &lone[0].1).unwrap(),
            vec![event(4)]
        );
        // Cut anywhere inside, the chunk is refused, never read short.
        for cut in [3, 6, chunk.len() - 1] {
            assert!(unpack(&lone[0].0, &chunk[..cut]).is_err(), "cut at {cut}");
        }
        assert!(unpack(&lone[0].0, &[CHUNK]).is_err(), "empty chunk");
        let backwards = encode([
            (lone[1].0.as_slice(), lone[1].1.as_slice()),
            (lone[0].0.as_slice(), lone[0].1.as_slice()),
        ]);
        assert!(
            rows_of(&EVENTS, &lone[1].0, &backwards)
                .unwrap_err()
                .contains("out of order")
        );
    }

    #[test]
    fn a_ledger_chunk_keeps_each_entrys_seq_and_a_damaged_one_is_refused() {
        let owner = ParentRef::Job(JobId::new());
        let key = |owner, seq: u64| [ledger_prefix(owner), seq.to_be_bytes().to_vec()].concat();
        let record = |tokens| LedgerRecord {
            owner,
            unit: crate::Unit::Tokens,
            op: LedgerOp::CallReserve { amount: tokens },
            epoch: 2,
        };
        let lone: Vec<(Vec<u8>, Vec<u8>)> = [(3, 30), (8, 80), (9, 90)]
            .map(|(seq, tokens)| {
                (
                    key(owner, seq),
                    encode_bincode(&record(tokens)).unwrap().to_vec(),
                )
            })
            .into();
        let chunk = encode(lone.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
        let first = key(owner, 3);
        let rows = unpack(&first, &chunk).unwrap();
        let keys: Vec<&[u8]> = rows.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, [key(owner, 3), key(owner, 8), key(owner, 9)]);
        assert_eq!(
            rows_of(&LEDGER, &first, &chunk).unwrap(),
            vec![record(30), record(80), record(90)]
        );
        assert!(unpack(&key(owner, 8), &chunk).is_err());
        for cut in [3, 11, 14, chunk.len() - 1] {
            assert!(unpack(&first, &chunk[..cut]).is_err(), "cut at {cut}");
        }
        // Another account's entry packed among these is not taken for theirs.
        let other = ParentRef::Run(RunId::new());
        let stranger = encode_bincode(&LedgerRecord {
            owner: other,
            unit: crate::Unit::Tokens,
            ..record(1)
        })
        .unwrap();
        let mixed = encode([
            (lone[0].0.as_slice(), lone[0].1.as_slice()),
            (key(other, 4).as_slice(), &stranger[..]),
        ]);
        assert!(
            rows_of(&LEDGER, &first, &mixed)
                .unwrap_err()
                .contains("wrong key")
        );
    }

    /// The bytes of a chunk, pinned: journals on disk depend on them.
    #[test]
    fn the_chunk_layout_does_not_change() {
        let packed = encode([
            (&key(1, 0x0102)[..], &b"\x02ab"[..]),
            (&key(1, 0x0103)[..], b"\x02"),
        ]);
        assert_eq!(
            crate::codec::hex(&packed),
            "83\
             0000000000000102000000030261\
             62\
             00000000000001030000000102"
                .replace(' ', "")
        );
    }
}
