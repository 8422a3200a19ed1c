//! sled applied behind the log: the appends sled has not taken yet, readable
//! meanwhile, and the work queued for the thread that applies them (the
//! applier, in `journal.rs`).
//!
//! Each sled transaction costs far more than its bytes: sled 0.34 seals and
//! writes its current IO buffer before and after every batch it applies
//! (`pin_log`, "rolling the io buffer before AND after"), each with a
//! `sync_file_range`, on its own IO threads. Applying every append as it came
//! made that the largest cost of a delegation. So `append` puts its entries
//! here and queues them for the applier, which applies everything queued so
//! far as one transaction, with `meta/seq` set to the last seq it carries.
//!
//! # Invariants
//! 1. The overlay holds, per tree and key, the latest value appended and not
//!    yet known to be in sled, with the seq that wrote it. A read merges it
//!    over sled, holding the overlay's lock for the whole read, so an entry
//!    cannot move from the overlay to sled unseen.
//! 2. The applier takes work in seq order (one channel, sent under the lock
//!    that hands out seqs) and applies each batch in one sled transaction
//!    that also writes `meta/seq`: after a crash sled holds a prefix of the
//!    appends, whole, and says how far it goes (`wal.rs`, invariant 4).
//! 3. An entry leaves the overlay only once a transaction that carried its
//!    seq (or a later one for the same key) has been applied.
//! 4. A checkpoint is asked for on the same channel, after every append its
//!    segments carry, so the applier has applied them before it flushes sled.

use crate::codec::RECORD_TREES;
use crate::wal::Entry;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;

/// The entries appended and not yet applied to sled, by tree.
#[derive(Default)]
pub(crate) struct Overlay {
    trees: [Latest; RECORD_TREES.len()],
}

/// One tree's keys, each with the seq that last wrote it and the value.
type Latest = BTreeMap<Vec<u8>, (u64, Vec<u8>)>;

impl Overlay {
    /// Records one append's entries, which took the seqs from `first_seq` on.
    pub(crate) fn insert(&mut self, first_seq: u64, entries: &[Entry]) {
        for ((tree, key, value), seq) in entries.iter().zip(first_seq..) {
            self.trees[tree_index(tree)].insert(key.clone(), (seq, value.clone()));
        }
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
        self.trees.iter().all(BTreeMap::is_empty)
    }
}

fn tree_index(tree: &str) -> usize {
    RECORD_TREES
        .iter()
        .position(|name| *name == tree)
        .unwrap_or_else(|| unreachable!("no record tree {tree:?}"))
}

/// What the applier is asked to do, in seq order (invariants 2 and 4).
pub(crate) enum Work {
    /// One append's entries, the last of which took `last_seq`.
    Apply { last_seq: u64, entries: Vec<Entry> },
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
        overlay.insert(1, &[entry(JOBS, b"k", b"old")]);
        overlay.insert(2, &[entry(JOBS, b"k", b"new")]);
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
            &[
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
