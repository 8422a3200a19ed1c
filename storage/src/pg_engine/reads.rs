//! Reads: the overlay's rows laid over the database's, each key's later
//! seq winning (`pg_engine.rs`, invariant 4).

use super::PgEngine;
use super::schema::{db_error, pool_error, successor};
use crate::Error;
use crate::engine::OwnedRow;
use crate::table::TableDef;
use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};

/// A stored row: key, seq, value.
type SeqRow = (Vec<u8>, u64, Vec<u8>);

/// `stored`, with each of `pending` laid over it where it is the later.
fn merge(stored: Vec<SeqRow>, pending: Vec<SeqRow>) -> Vec<OwnedRow> {
    let mut rows: BTreeMap<Vec<u8>, (u64, Vec<u8>)> = stored
        .into_iter()
        .map(|(key, seq, value)| (key, (seq, value)))
        .collect();
    for (key, seq, value) in pending {
        match rows.get(&key) {
            Some((stored, _)) if *stored > seq => {}
            _ => {
                rows.insert(key, (seq, value));
            }
        }
    }
    rows.into_iter()
        .map(|(key, (_, value))| (key, value))
        .collect()
}

impl PgEngine {
    /// The database's rows of `table` from `lower` (all, if empty) up to,
    /// not including, `upper`, in key order (or the last one only).
    fn stored(
        &self,
        table: &'static TableDef,
        lower: Vec<u8>,
        upper: Option<Vec<u8>>,
        last_only: bool,
    ) -> Result<Vec<SeqRow>, Error> {
        let pool = self.pool.clone();
        let sql = Arc::clone(&self.sql);
        self.block(async move {
            let client = pool.get().await.map_err(pool_error)?;
            let tail = if last_only {
                " ORDER BY key DESC LIMIT 1"
            } else {
                " ORDER BY key"
            };
            let statement = sql.range(table.name, "SELECT key, seq, value", upper.is_some(), tail);
            let statement = client.prepare_cached(&statement).await.map_err(db_error)?;
            let rows = match &upper {
                Some(upper) => client.query(&statement, &[&lower, upper]).await,
                None => client.query(&statement, &[&lower]).await,
            }
            .map_err(db_error)?;
            Ok(rows
                .into_iter()
                .map(|row| {
                    let seq: i64 = row.get(1);
                    (row.get(0), seq as u64, row.get(2))
                })
                .collect())
        })
    }

    fn pending(&self, table: &'static TableDef, prefix: &[u8]) -> Vec<SeqRow> {
        self.overlay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pending(table.name, prefix)
    }

    /// Every row under `prefix`, in key order.
    pub(super) fn read_prefix(
        &self,
        table: &'static TableDef,
        prefix: &[u8],
    ) -> Result<Vec<OwnedRow>, Error> {
        // The overlay first, then the database (invariant 4).
        let pending = self.pending(table, prefix);
        let stored = self.stored(table, prefix.to_vec(), successor(prefix), false)?;
        Ok(merge(stored, pending))
    }

    /// The database's rows between `lower` and `upper`, without the
    /// overlay: for reads that drained the writer first.
    pub(super) fn read_range(
        &self,
        table: &'static TableDef,
        lower: Option<Vec<u8>>,
        upper: Option<Vec<u8>>,
    ) -> Result<Vec<OwnedRow>, Error> {
        let rows = self.stored(table, lower.unwrap_or_default(), upper, false)?;
        Ok(rows
            .into_iter()
            .map(|(key, _, value)| (key, value))
            .collect())
    }

    /// The last row under `prefix`.
    pub(super) fn read_last(
        &self,
        table: &'static TableDef,
        prefix: &[u8],
    ) -> Result<Option<OwnedRow>, Error> {
        let pending = self.pending(table, prefix);
        let stored = self.stored(table, prefix.to_vec(), successor(prefix), true)?;
        Ok(merge(stored, pending).pop())
    }

    pub(super) fn read_one(
        &self,
        table: &'static TableDef,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, Error> {
        let pending: Vec<SeqRow> = self
            .pending(table, key)
            .into_iter()
            .filter(|(at, _, _)| at == key)
            .collect();
        // `key <= k < key ++ 0x00`: the key alone.
        let mut upper = key.to_vec();
        upper.push(0);
        let stored = self.stored(table, key.to_vec(), Some(upper), false)?;
        Ok(merge(stored, pending).pop().map(|(_, value)| value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefixs_successor_is_the_first_key_past_all_it_starts() {
        assert_eq!(successor(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(successor(&[1, 0xff]), Some(vec![2]));
        assert_eq!(successor(&[0xff, 0xff]), None);
        assert_eq!(successor(b""), None);
    }

    #[test]
    fn a_row_the_writer_moved_meanwhile_wins_over_its_older_overlay_copy() {
        let stored = vec![
            (b"a".to_vec(), 5, b"new".to_vec()),
            (b"b".to_vec(), 1, b"b".to_vec()),
        ];
        let pending = vec![
            (b"a".to_vec(), 3, b"old".to_vec()),
            (b"c".to_vec(), 4, b"c".to_vec()),
        ];
        let merged = merge(stored, pending);
        let values: Vec<&[u8]> = merged.iter().map(|(_, v)| v.as_slice()).collect();
        assert_eq!(values, [&b"new"[..], b"b", b"c"]);
        let pending = vec![(b"b".to_vec(), 2, b"later".to_vec())];
        let merged = merge(vec![(b"b".to_vec(), 1, b"b".to_vec())], pending);
        assert_eq!(merged, [(b"b".to_vec(), b"later".to_vec())]);
    }
}
