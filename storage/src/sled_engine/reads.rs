//! Reads: sled's rows with the overlay's laid over them, under the
//! overlay's lock (`overlay.rs`, invariant 1), and a history table's chunks
//! unpacked into rows (`chunk.rs`).

use super::chunk;
use super::handle::{META, META_EPOCH, META_FORMAT, META_SEQ, SledEngine};
use super::work::Work;
use crate::Error;
use crate::codec;
use crate::engine::{OwnedRow, Visit, WalkVisit};
use crate::table::{Shape, TableDef};
use std::collections::BTreeMap;
use std::sync::{PoisonError, mpsc};

/// Visits each row of one stored value (a chunk's, or the value itself).
fn visit_rows(
    table: &TableDef,
    key: &[u8],
    value: &[u8],
    visit: &mut Visit<'_>,
) -> Result<(), Error> {
    let rows = chunk::unpack(key, value).map_err(|e| codec::undecodable(table.name, key, e))?;
    for (key, value) in rows {
        visit(&key, value)?;
    }
    Ok(())
}

impl SledEngine {
    /// Every row under `prefix`, in key order.
    pub(super) fn read_prefix(
        &self,
        table: &'static TableDef,
        prefix: &[u8],
        visit: &mut Visit<'_>,
    ) -> Result<(), Error> {
        let tree = self.trees.get(table.name);
        // Copied under the lock and decoded after it, so a long read (a
        // run's whole history) holds up no append.
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = tree.scan_prefix(prefix).collect::<Result<Vec<_>, _>>()?;
        if let Shape::State = table.shape {
            if overlay.is_empty() {
                drop(overlay);
                for (key, value) in &stored {
                    visit(key, value)?;
                }
                return Ok(());
            }
            let merged = overlay.merge_prefix(table.name, prefix, stored);
            drop(overlay);
            for (key, value) in &merged {
                visit(key, value)?;
            }
            return Ok(());
        }
        let pending = overlay.merge_prefix::<Vec<u8>, Vec<u8>>(table.name, prefix, vec![]);
        drop(overlay);
        if pending.is_empty() {
            // sled's chunks alone are in key order and never overlap: an
            // owner's later chunk starts past its earlier one's last row.
            for (key, value) in &stored {
                visit_rows(table, key, value, visit)?;
            }
            return Ok(());
        }
        // By key, each row once: while a chunk is being applied its rows
        // are in both sled and the overlay.
        let mut rows: BTreeMap<Vec<u8>, &[u8]> = BTreeMap::new();
        for (key, value) in &stored {
            let unpacked =
                chunk::unpack(key, value).map_err(|e| codec::undecodable(table.name, key, e))?;
            rows.extend(unpacked);
        }
        for (key, value) in &pending {
            rows.insert(key.clone(), value);
        }
        for (key, value) in rows {
            visit(&key, value)?;
        }
        Ok(())
    }

    /// Every row below `bound`, from sled once the applier has taken every
    /// earlier append (a rare read: the service's retention pass).
    pub(super) fn read_below(
        &self,
        table: &'static TableDef,
        bound: &[u8],
        visit: &mut Visit<'_>,
    ) -> Result<(), Error> {
        self.drain();
        for stored in self.trees.get(table.name).range(..bound) {
            let (key, value) = stored?;
            visit_rows(table, &key, &value, visit)?;
        }
        Ok(())
    }

    /// The last row under `prefix`: sled's last entry there and what the
    /// applier has not taken, not the whole history.
    pub(super) fn read_last(
        &self,
        table: &'static TableDef,
        prefix: &[u8],
    ) -> Result<Option<OwnedRow>, Error> {
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = self
            .trees
            .get(table.name)
            .scan_prefix(prefix)
            .next_back()
            .transpose()?;
        let pending = overlay.merge_prefix::<Vec<u8>, Vec<u8>>(table.name, prefix, vec![]);
        drop(overlay);
        let mut last: Option<(Vec<u8>, &[u8])> = None;
        let mut consider = |key: Vec<u8>, value| {
            if last.as_ref().is_none_or(|(before, _)| *before < key) {
                last = Some((key, value));
            }
        };
        if let Some((key, value)) = &stored {
            let rows =
                chunk::unpack(key, value).map_err(|e| codec::undecodable(table.name, key, e))?;
            for (key, value) in rows {
                consider(key, value);
            }
        }
        for (key, value) in &pending {
            consider(key.clone(), value);
        }
        Ok(last.map(|(key, value)| (key, value.to_vec())))
    }

    pub(super) fn read_one(
        &self,
        table: &'static TableDef,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, Error> {
        if let Shape::History { .. } = table.shape {
            // A history's row may sit inside a chunk under an earlier key.
            let mut found = None;
            self.read_prefix(table, key, &mut |at, value| {
                if at == key {
                    found = Some(value.to_vec());
                }
                Ok(())
            })?;
            return Ok(found);
        }
        let overlay = self.overlay.lock().unwrap_or_else(PoisonError::into_inner);
        let value = match overlay.get(table.name, key) {
            Some(value) => Some(value.to_vec()),
            None => self.trees.get(table.name).get(key)?.map(|v| v.to_vec()),
        };
        Ok(value)
    }

    /// Every row sled holds of `table`, once the applier has taken every
    /// append so far, with each stored entry that does not unpack.
    pub(super) fn walk_table(
        &self,
        table: &'static TableDef,
        visit: &mut WalkVisit<'_>,
    ) -> Result<(), Error> {
        self.drain();
        for stored in self.trees.get(table.name).iter() {
            let (key, value) = stored?;
            match chunk::unpack(&key, &value) {
                Ok(rows) => {
                    for (key, value) in rows {
                        visit(&key, Ok(value));
                    }
                }
                Err(error) => visit(&key, Err(error)),
            }
        }
        Ok(())
    }

    /// Each `meta` entry that is not a known key with a value of its width.
    pub(super) fn check_meta(&self) -> Result<Vec<(String, String, String)>, Error> {
        let mut wrong = Vec::new();
        for entry in self.trees.meta.iter() {
            let (key, value) = entry?;
            let width = match &key[..] {
                META_FORMAT => 4,
                META_EPOCH | META_SEQ => 8,
                _ => {
                    wrong.push((META.into(), codec::hex(&key), "unknown meta key".into()));
                    continue;
                }
            };
            if value.len() != width {
                let error = format!("{} bytes, expected {width}", value.len());
                wrong.push((META.into(), codec::hex(&key), error));
            }
        }
        Ok(wrong)
    }

    /// Waits until the applier has put every append so far into sled, for
    /// the passes that walk sled's trees whole. A journal without an applier
    /// (read-only, or one whose applier is gone) has nothing more to wait for.
    pub(super) fn drain(&self) {
        let Some(work) = &self.work else { return };
        let (done, wait) = mpsc::channel();
        if work.send(Work::Drain(done)).is_ok() {
            let _ = wait.recv();
        }
    }
}
