//! sled applied behind the log: the appends sled has not taken yet, readable
//! meanwhile, and the work queued for the thread that applies them (the
//! applier, in `journal.rs`).
//!
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

use crate::codec::RECORD_TREES;
use crate::wal::Entry;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;

/// The entries appended and not yet applied to sled, by tree, and those
/// of them the applier has not taken yet, in seq order.
#[derive(Default)]
pub(crate) struct Overlay {
    trees: [Latest; RECORD_TREES.len()],
    /// Not yet taken by the applier: whole appends, seq after seq, the
    /// first of them at `queued_from`.
    queued: Vec<Entry>,
    queued_from: u64,
}

/// Appends the applier may leave queued before it is woken to take them
/// early (`journal.rs` applies at most this many in one transaction).
pub(crate) const QUEUED_WAKE: usize = 32768;

/// One tree's keys, each with the seq that last wrote it and the value.
type Latest = BTreeMap<Vec<u8>, (u64, Vec<u8>)>;

impl Overlay {
    /// Records one append's entries, which took the seqs from `first_seq` on,
    /// and queues them for the applier. Says whether the applier must be
    /// woken: the queue was empty (it sleeps until told otherwise), or it has
    /// just grown past `QUEUED_WAKE`. Otherwise it is woken already, and
    /// waking it once per append was a tenth of a fan-out's CPU.
    pub(crate) fn insert(&mut self, first_seq: u64, entries: Vec<Entry>) -> bool {
        for ((tree, key, value), seq) in entries.iter().zip(first_seq..) {
            self.trees[tree_index(tree)].insert(key.clone(), (seq, value.clone()));
        }
        let before = self.queued.len();
        if before == 0 {
            self.queued_from = first_seq;
        }
        self.queued.extend(entries);
        before == 0 || (before < QUEUED_WAKE && self.queued.len() >= QUEUED_WAKE)
    }

    /// Everything queued so far, with the seq of its first entry (entry `i`
    /// took seq `first + i`), for the applier.
    pub(crate) fn take_queued(&mut self) -> (u64, Vec<Entry>) {
        (self.queued_from, std::mem::take(&mut self.queued))
    }

    /// Forgets what a transaction up to `applied_seq` put in sled
    /// (invariant 3): an entry a later append overwrote stays.
    pub(crate) fn applied(&mut self, entries: &[Entry], applied_seq: u64) {
        for (tree, key, _) in entries {
            let tree = &mut self.trees[tree_index(tree)];
            if tree.get(key).is_some_and(|(seq, _)| *seq <= applied_seq) {
                tree.remove(key);
            }
        }
    }

    /// The value under `key`, if an append not yet applied wrote one.
    pub(crate) fn get(&self, tree: &str, key: &[u8]) -> Option<&[u8]> {
        self.trees[tree_index(tree)]
            .get(key)
            .map(|(_, value)| value.as_slice())
    }

    /// `sled`'s entries under `prefix`, in key order, with the overlay's laid
    /// over them.
    pub(crate) fn merge_prefix(
        &self,
        tree: &str,
        prefix: &[u8],
        sled: Vec<(sled::IVec, sled::IVec)>,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = sled
            .into_iter()
            .map(|(key, value)| (key.to_vec(), value.to_vec()))
            .collect();
        for (key, (_, value)) in self.trees[tree_index(tree)]
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
        {
            merged.insert(key.clone(), value.clone());
        }
        merged.into_iter().collect()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.trees.iter().all(BTreeMap::is_empty) && self.queued.is_empty()
    }
}

fn tree_index(tree: &str) -> usize {
    RECORD_TREES
        .iter()
        .position(|name| *name == tree)
        .unwrap_or_else(|| unreachable!("no record tree {tree:?}"))
}

/// What the applier is asked to do (invariants 2 and 4). Before it does any
/// of it, it takes and applies what is queued in the overlay.
pub(crate) enum Work {
    /// Entries are queued: take them within `APPLY_EVERY`, or at once if
    /// this is the second wake of a wait (the queue is long).
    Wake,
    /// Flush sled and sync its files, then remove these segments.
    Checkpoint(Vec<PathBuf>),
    /// Answer once everything queued before this is in sled.
    Drain(mpsc::Sender<()>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{JOBS, STEERING};

    fn entry(tree: &'static str, key: &[u8], value: &[u8]) -> Entry {
        (tree, key.to_vec(), value.to_vec())
    }

    #[test]
    fn an_entry_a_later_append_overwrote_stays_when_the_earlier_one_is_applied() {
        let mut overlay = Overlay::default();
        assert!(overlay.insert(1, vec![entry(JOBS, b"k", b"old")]), "wakes");
        assert!(!overlay.insert(2, vec![entry(JOBS, b"k", b"new")]), "woken");
        let (first, queued) = overlay.take_queued();
        assert_eq!((first, queued.len()), (1, 2));
        overlay.applied(&[entry(JOBS, b"k", b"old")], 1);
        assert_eq!(overlay.get(JOBS, b"k"), Some(&b"new"[..]));
        overlay.applied(&[entry(JOBS, b"k", b"new")], 2);
        assert_eq!(overlay.get(JOBS, b"k"), None);
        assert!(overlay.is_empty());
    }

    #[test]
    fn a_prefix_read_lays_the_overlay_over_sleds_entries_in_key_order() {
        let mut overlay = Overlay::default();
        overlay.insert(
            7,
            vec![
                entry(STEERING, b"a2", b"newer"),
                entry(STEERING, b"a3", b"added"),
                entry(STEERING, b"b1", b"other prefix"),
                entry(JOBS, b"a1", b"other tree"),
            ],
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
