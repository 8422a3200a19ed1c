//! What an engine's store has not taken yet: the appends readable at once,
//! before the thread that writes them to the store (the sled engine's
//! applier, `sled_engine/applier.rs`; the PostgreSQL engine's writer,
//! `pg_engine/writer.rs`) has taken them, and its queue of them.
//!
//! For sled:
//! Each sled transaction costs far more than its bytes: sled 0.34 seals and
//! writes its current IO buffer before and after every batch it applies
//! (`pin_log`, "rolling the io buffer before AND after"), each with a
//! `sync_file_range`, on its own IO threads. Applying every append as it came
//! made that the largest cost of a delegation. So `append` puts its entries
//! here and queues them here for the applier, which applies everything
//! queued so far as one transaction, with `meta/seq` set to the last seq it
//! carries. The applier sleeps while the queue is empty; the append that
//! fills it first wakes it, and it waits `APPLY_EVERY` for the rest.
//!
//! # Invariants
//! 1. The overlay holds, per tree and key, the latest value appended and not
//!    yet known to be in sled, with the seq that wrote it. A read merges it
//!    over sled, holding the overlay's lock for the whole read, so an entry
//!    cannot move from the overlay to sled unseen.
//! 2. The applier takes queued entries in seq order (queued under the lock
//!    that hands out seqs, taken whole from the front) and applies each batch
//!    in one sled transaction that also writes `meta/seq`: after a crash sled
//!    holds a prefix of the appends, whole, and says how far it goes
//!    (`wal.rs`, invariant 4).
//! 3. An entry leaves the overlay only once a transaction that carried its
//!    seq (or a later one for the same key) has been applied.
//! 4. A checkpoint is asked for after every append its segments carry was
//!    queued, and the applier takes the queue before it acts on any request,
//!    so it has applied them before it flushes sled.

use crate::table::{JOURNAL_TABLES, Shape, table_index};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// One row of an append as the store takes it: table, key, value. The
/// value is shared, not copied, between the overlay's read index and the
/// queue of whoever writes it out.
pub(crate) type Entry = (&'static str, Vec<u8>, Arc<[u8]>);

/// The value of a removal: every key under the entry's key, as a prefix, is
/// removed from its table (`Journal::forget`). No record's value is empty
/// (each starts with its format byte), so an empty one cannot be mistaken
/// for one.
pub(crate) fn removal() -> Arc<[u8]> {
    Arc::from(&[][..])
}

pub(crate) fn is_removal(value: &[u8]) -> bool {
    value.is_empty()
}

/// The entries appended and not yet applied to sled, by tree, and those
/// of them the applier has not taken yet, in seq order.
pub(crate) struct Overlay {
    /// Each table's, in `JOURNAL_TABLES` order.
    tables: Vec<Slot>,
    /// Not yet taken by the applier: whole appends, seq after seq, each
    /// with the seq of its first entry (shared with the log's flusher).
    queued: VecDeque<(u64, Arc<[Entry]>)>,
    /// How many entries `queued` holds.
    queued_len: usize,
}

/// Appends the applier may leave queued before it is woken to take them
/// early (`applier.rs` applies at most this many in one transaction).
pub(crate) const QUEUED_WAKE: usize = 32768;

/// What the overlay holds of one table.
enum Slot {
    /// A state table (runs, jobs, ...): a key may be written again.
    State(Latest),
    /// A history table (events, the ledger): every key is new.
    History(History),
}

/// One tree's keys, each with the seq that last wrote it and the value.
type Latest = BTreeMap<Vec<u8>, (u64, Arc<[u8]>)>;

/// A history tree's entries by owner (a key's first bytes: the run of an
/// event, the account of a ledger entry), each owner's in seq order: a
/// queue, pushed at the back and applied from the front (the applier takes
/// appends in seq order). Reads sort what they take. A sorted map of every
/// key cost an append more than anything else it did.
struct History {
    owners: HashMap<Vec<u8>, VecDeque<Pending>>,
    /// How many bytes of a key name its owner.
    owner_bytes: usize,
}

/// One entry of an append, by its seq: the append it is in (shared with
/// the applier's queue and the log's flusher, not copied) and its place in it.
struct Pending {
    seq: u64,
    append: Arc<[Entry]>,
    at: usize,
}

impl Pending {
    fn key(&self) -> &[u8] {
        &self.append[self.at].1
    }

    fn value(&self) -> &[u8] {
        &self.append[self.at].2
    }
}

impl History {
    fn of(owner_bytes: usize) -> Self {
        Self {
            owners: HashMap::new(),
            owner_bytes,
        }
    }

    fn owner<'k>(&self, key: &'k [u8]) -> &'k [u8] {
        &key[..key.len().min(self.owner_bytes)]
    }

    fn insert(&mut self, seq: u64, append: &Arc<[Entry]>, at: usize) {
        let key = &append[at].1;
        let queue = match self.owners.get_mut(self.owner(key)) {
            Some(queue) => queue,
            None => self.owners.entry(self.owner(key).to_vec()).or_default(),
        };
        queue.push_back(Pending {
            seq,
            append: Arc::clone(append),
            at,
        });
    }

    /// Drops the front of `key`'s owner's queue up to `applied_seq`.
    fn applied(&mut self, key: &[u8], applied_seq: u64) {
        let owner = self.owner(key);
        if let Some(queue) = self.owners.get_mut(owner) {
            while queue.front().is_some_and(|p| p.seq <= applied_seq) {
                queue.pop_front();
            }
            if queue.is_empty() {
                self.owners.remove(owner);
            }
        }
    }

    /// Point reads of history are rare (reads take an owner's whole
    /// history): a walk of the owner's queue, newest first.
    fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.owners
            .get(self.owner(key))?
            .iter()
            .rev()
            .find(|p| p.key() == key)
            .map(Pending::value)
    }

    /// Every entry under `prefix`, in key order, with its seq.
    fn prefixed<'a>(&'a self, prefix: &[u8]) -> Vec<(&'a [u8], u64, &'a [u8])> {
        let pick = |queue: &'a VecDeque<Pending>| {
            queue
                .iter()
                .filter(|p| p.key().starts_with(prefix))
                .map(|p| (p.key(), p.seq, p.value()))
                .collect::<Vec<_>>()
        };
        if prefix.len() >= self.owner_bytes {
            return self
                .owners
                .get(&prefix[..self.owner_bytes])
                .map(pick)
                .unwrap_or_default();
        }
        // Shorter than an owner: every owner it starts, merged.
        let mut all: Vec<_> = self
            .owners
            .iter()
            .filter(|(owner, _)| owner.starts_with(prefix))
            .flat_map(|(_, queue)| pick(queue))
            .collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        all
    }

    fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

impl Overlay {
    pub(crate) fn new() -> Self {
        let tables = JOURNAL_TABLES
            .iter()
            .map(|table| match table.def().shape {
                Shape::State => Slot::State(Latest::new()),
                Shape::History { owner_bytes } => Slot::History(History::of(owner_bytes)),
            })
            .collect();
        Self {
            tables,
            queued: VecDeque::new(),
            queued_len: 0,
        }
    }

    fn slot(&self, tree: &str) -> &Slot {
        &self.tables[index(tree)]
    }

    /// Records one append's entries, which took the seqs from `first_seq` on,
    /// and queues them for the applier. Says whether the applier must be
    /// woken: the queue was empty (it sleeps until told otherwise), or it has
    /// just grown past `QUEUED_WAKE`. Otherwise it is woken already, and
    /// waking it once per append was a tenth of a fan-out's CPU.
    pub(crate) fn insert(&mut self, first_seq: u64, entries: Arc<[Entry]>) -> bool {
        for (at, ((tree, key, value), seq)) in entries.iter().zip(first_seq..).enumerate() {
            if is_removal(value) {
                // Only queued: reads find the removed records in sled until
                // the applier takes the removal (`Journal::forget`).
                continue;
            }
            match &mut self.tables[index(tree)] {
                Slot::History(history) => history.insert(seq, &entries, at),
                Slot::State(latest) => {
                    latest.insert(key.clone(), (seq, Arc::clone(value)));
                }
            }
        }
        let before = self.queued_len;
        self.queued_len += entries.len();
        self.queued.push_back((first_seq, entries));
        before == 0 || (before < QUEUED_WAKE && self.queued_len >= QUEUED_WAKE)
    }

    /// Whole appends from the front of the queue, until they hold `most`
    /// entries or more (one append at least), with the seq of their first
    /// entry (their entries, in order, took the seqs from it on), for the
    /// applier. Whole, so a transaction never ends inside an append
    /// (invariant 2).
    pub(crate) fn take_queued(&mut self, most: usize) -> (u64, Vec<Arc<[Entry]>>) {
        let first = self.queued.front().map_or(0, |(seq, _)| *seq);
        let (mut taken, mut count) = (Vec::new(), 0);
        while count < most
            && let Some((_, entries)) = self.queued.pop_front()
        {
            count += entries.len();
            taken.push(entries);
        }
        self.queued_len -= count;
        (first, taken)
    }

    /// Forgets what a transaction up to `applied_seq` put in sled
    /// (invariant 3): an entry a later append overwrote stays.
    pub(crate) fn applied(&mut self, entries: &[&Entry], applied_seq: u64) {
        for (tree, key, _) in entries {
            match &mut self.tables[index(tree)] {
                Slot::History(history) => history.applied(key, applied_seq),
                Slot::State(latest) => {
                    if latest.get(key).is_some_and(|(seq, _)| *seq <= applied_seq) {
                        latest.remove(key);
                    }
                }
            }
        }
    }

    /// The value under `key`, if an append not yet applied wrote one.
    pub(crate) fn get(&self, tree: &str, key: &[u8]) -> Option<&[u8]> {
        match self.slot(tree) {
            Slot::History(history) => history.get(key),
            Slot::State(latest) => latest.get(key).map(|(_, value)| &value[..]),
        }
    }

    /// The store's entries under `prefix`, in key order, with the overlay's
    /// laid over them.
    pub(crate) fn merge_prefix<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &self,
        tree: &str,
        prefix: &[u8],
        stored: Vec<(K, V)>,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = stored
            .into_iter()
            .map(|(key, value)| (key.as_ref().to_vec(), value.as_ref().to_vec()))
            .collect();
        for (key, _, value) in self.pending(tree, prefix) {
            merged.insert(key, value);
        }
        merged.into_iter().collect()
    }

    /// Every entry under `prefix` not yet applied, with the seq that wrote
    /// it, in key order: for a store read outside the overlay's lock, which
    /// lays these over what it read where their seq is the later.
    pub(crate) fn pending(&self, tree: &str, prefix: &[u8]) -> Vec<(Vec<u8>, u64, Vec<u8>)> {
        match self.slot(tree) {
            Slot::History(history) => history
                .prefixed(prefix)
                .into_iter()
                .map(|(key, seq, value)| (key.to_vec(), seq, value.to_vec()))
                .collect(),
            Slot::State(latest) => latest
                .range(prefix.to_vec()..)
                .take_while(|(key, _)| key.starts_with(prefix))
                .map(|(key, (seq, value))| (key.clone(), *seq, value.to_vec()))
                .collect(),
        }
    }

    /// Whether anything waits for the applier (or writer) to take it.
    pub(crate) fn has_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tables.iter().all(|slot| match slot {
            Slot::State(latest) => latest.is_empty(),
            Slot::History(history) => history.is_empty(),
        }) && self.queued.is_empty()
    }
}

fn index(tree: &str) -> usize {
    table_index(tree).unwrap_or_else(|| unreachable!("no record tree {tree:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    const JOBS: &str = "jobs";
    const LEDGER: &str = "ledger";
    const STEERING: &str = "steering";
    const LEDGER_OWNER_BYTES: usize = 17;

    fn entry(tree: &'static str, key: &[u8], value: &[u8]) -> Entry {
        (tree, key.to_vec(), value.into())
    }

    #[test]
    fn an_entry_a_later_append_overwrote_stays_when_the_earlier_one_is_applied() {
        let mut overlay = Overlay::new();
        assert!(
            overlay.insert(1, [entry(JOBS, b"k", b"old")].into()),
            "wakes"
        );
        assert!(
            !overlay.insert(2, [entry(JOBS, b"k", b"new")].into()),
            "woken"
        );
        let (first, queued) = overlay.take_queued(usize::MAX);
        assert_eq!((first, queued.len()), (1, 2), "two appends");
        overlay.applied(&[&entry(JOBS, b"k", b"old")], 1);
        assert_eq!(overlay.get(JOBS, b"k"), Some(&b"new"[..]));
        overlay.applied(&[&entry(JOBS, b"k", b"new")], 2);
        assert_eq!(overlay.get(JOBS, b"k"), None);
        assert!(overlay.is_empty());
    }

    /// History (here the ledger, 17-byte owners) is read by owner or by a
    /// shorter prefix, in key order, and leaves as the applier applies it.
    #[test]
    fn history_is_read_by_owner_in_key_order_and_leaves_once_applied() {
        let key = |owner: u8, seq: u64| {
            let mut key = vec![owner; LEDGER_OWNER_BYTES];
            key.extend_from_slice(&seq.to_be_bytes());
            key
        };
        let (a, b) = (1, 2);
        let mut overlay = Overlay::new();
        overlay.insert(
            1,
            [
                (LEDGER, key(b, 1), b"b1"[..].into()),
                (LEDGER, key(a, 2), b"a2"[..].into()),
                (JOBS, b"j".to_vec(), b"job"[..].into()),
            ]
            .into(),
        );
        overlay.insert(4, [(LEDGER, key(a, 4), b"a4"[..].into())].into());
        let values = |overlay: &Overlay, prefix: &[u8]| -> Vec<Vec<u8>> {
            overlay
                .merge_prefix::<Vec<u8>, Vec<u8>>(LEDGER, prefix, vec![])
                .into_iter()
                .map(|(_, v)| v)
                .collect()
        };
        assert_eq!(
            values(&overlay, &key(a, 0)[..LEDGER_OWNER_BYTES]),
            [b"a2", b"a4"]
        );
        assert_eq!(
            values(&overlay, &[]),
            [b"a2".to_vec(), b"a4".to_vec(), b"b1".to_vec()]
        );
        assert_eq!(overlay.get(LEDGER, &key(a, 4)), Some(&b"a4"[..]));
        assert_eq!(overlay.get(LEDGER, &key(a, 3)), None);

        let (first, queued) = overlay.take_queued(3);
        assert_eq!((first, queued.len()), (1, 1), "the first append, whole");
        let (next, rest) = overlay.take_queued(3);
        assert_eq!((next, rest.len()), (4, 1));
        let queued: Vec<&Entry> = queued.iter().chain(&rest).flat_map(|a| a.iter()).collect();
        overlay.applied(&queued[..3], 3);
        assert_eq!(values(&overlay, &[]), [b"a4"], "applied up to seq 3");
        overlay.applied(&queued[3..], 4);
        assert!(overlay.is_empty());
    }

    #[test]
    fn a_prefix_read_lays_the_overlay_over_sleds_entries_in_key_order() {
        let mut overlay = Overlay::new();
        overlay.insert(
            7,
            [
                entry(STEERING, b"a2", b"newer"),
                entry(STEERING, b"a3", b"added"),
                entry(STEERING, b"b1", b"other prefix"),
                entry(JOBS, b"a1", b"other tree"),
            ]
            .into(),
        );
        let sled = vec![
            (
                sled::IVec::from(&b"a1"[..]),
                sled::IVec::from(&b"stored"[..]),
            ),
            (
                sled::IVec::from(&b"a2"[..]),
                sled::IVec::from(&b"older"[..]),
            ),
        ];
        let merged = overlay.merge_prefix(STEERING, b"a", sled);
        let values: Vec<&[u8]> = merged.iter().map(|(_, v)| v.as_slice()).collect();
        assert_eq!(values, vec![&b"stored"[..], b"newer", b"added"]);
    }
}
