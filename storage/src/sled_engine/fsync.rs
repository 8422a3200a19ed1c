//! What sled's `flush` leaves undone: getting what it wrote past the disk's
//! own cache, so that an acknowledged record survives power loss (I-35).
//!
//! What sled 0.34.7 does (read in its source):
//! - Its data lives in `<dir>/db`, one file of log segments
//!   (`config.rs`, `Config::db_path`, opened read+write by `open_file`).
//! - `Tree::flush` ends in `pagecache::iobuf::flush` -> `make_stable`, which
//!   writes each dirty IO buffer with `IoBufs::write_to_log`: a `pwrite` then,
//!   on Linux, `sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)` over the
//!   range. That pushes the pages to the device but issues no cache flush and
//!   writes no metadata (the file's size included), so a power cut can still
//!   lose them (sled issue 1452, "Data is not written durably"). Only on
//!   `ENOSYS`, or off Linux, does it call `sync_all` there. (`Tree::flush`'s
//!   own doc says it "calls fsync"; on Linux it does not.)
//! - A real `fsync` of `db` happens only in sled's background thread
//!   (`flusher.rs`, `run`: `config.file.sync_all()` every `flush_every_ms`,
//!   500 ms by default), when a segment is truncated (`segment.rs`), during
//!   recovery (`snapshot.rs`) and when the `Log` is dropped (`logger.rs`).
//! - `<dir>/conf` (`Config::write_config`) is written once, when the db is
//!   created, and never synced.
//! - A value too big to sit inline in a segment (a log message over
//!   `segment_size / MINIMUM_ITEMS_PER_SEGMENT - SEG_HEADER_LEN` bytes, that is
//!   131,052 with the default 512 KiB segments; a message is a whole tree
//!   node or a change to one, so a leaf of a dozen or so entries whose values
//!   add up to ~128 KiB counts too) goes to its own file `<dir>/blobs/<lsn>`
//!   (`blob_io.rs`, `write_blob`), written with `write_all` and never synced,
//!   nor is the `blobs/` directory. Its log entry only points at it.
//! - Snapshots `<dir>/snap.<lsn hex>` are written only while sled opens the
//!   db (`snapshot.rs`, `read_snapshot_or_default` -> `advance_snapshot` ->
//!   `write_snapshot`): the file is `sync_all`ed and renamed over
//!   `snap.*.generating`, but the directory is not synced.
//!
//! What this module adds, and so what a completed journal flush promises:
//! 1. At open, after sled has opened the db: `conf`, every blob file (and
//!    then `blobs/`, if there was one), `db` and the directory itself are
//!    synced, so the files' directory entries (`blobs/` included) and the
//!    snapshot sled may just have renamed are durable.
//! 2. After every `db.flush()`: each blob file not yet synced at its current
//!    length is `fsync`ed (and then `blobs/`), and then `db` is `fdatasync`ed
//!    through a read-only handle (on Linux `fdatasync` needs no write access).
//!    Blobs go first because a log entry that points at a blob must not be
//!    durable before the blob is. sled writes a blob before the log entry
//!    that points at it, so the flush that covers the entry finds the blob
//!    whole.
//!    (Seen under strace on this crate's tests: each commit shows sled's
//!    threads calling `sync_file_range` on `db`, then the flusher's
//!    `fdatasync` on the read-only handle, returning 0.)
//! 3. A failed sync fails the flush: nothing it covered is acknowledged, and
//!    the journal stops (`Journal::failed`), since after a failed fsync the
//!    kernel may have dropped the dirty pages and a retry can succeed falsely.
//!
//! Not promised: a blob written and then covered by sled's own 500 ms
//! `sync_all` of `db` before our flush synced the blob can, after a power cut,
//! leave a log entry pointing at a lost blob. That record was never
//! acknowledged, but sled then reports the page as corrupt. Most records are
//! small; only large outputs (a job's `output_json`, an event's `output`)
//! reach the blob threshold.

use crate::Error;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// sled 0.34's file names inside its directory (`config.rs`).
const DB_FILE: &str = "db";
const CONF_FILE: &str = "conf";
const BLOBS_DIR: &str = "blobs";

/// Open handles on what sled writes, owned by the flusher thread.
pub(crate) struct DiskSync {
    db_path: PathBuf,
    /// Read-only: enough for `fdatasync` on Linux.
    db: File,
    blobs_dir: PathBuf,
    /// Each blob file synced, with the length it had when it was.
    blobs_synced: HashMap<OsString, u64>,
}

impl DiskSync {
    /// Syncs everything sled has written so far (see the module docs, 1) and
    /// opens the handles `after_flush` uses. Call once sled has opened `dir`.
    pub(crate) fn open(dir: &Path) -> Result<DiskSync, Error> {
        let db_path = dir.join(DB_FILE);
        let db = File::open(&db_path).map_err(|e| sync_error(&db_path, e))?;
        let mut disk = DiskSync {
            db_path,
            db,
            blobs_dir: dir.join(BLOBS_DIR),
            blobs_synced: HashMap::new(),
        };
        let conf = dir.join(CONF_FILE);
        match File::open(&conf) {
            Ok(file) => file.sync_all().map_err(|e| sync_error(&conf, e))?,
            // sled writes `conf` when it creates the db; if a later sled
            // stops, there is nothing of it to sync.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(sync_error(&conf, e)),
        }
        disk.sync_blobs()?;
        disk.sync_db()?;
        sync_dir(dir)?;
        Ok(disk)
    }

    /// After a `db.flush()`: new blob files, then `db` (module docs, 2).
    pub(crate) fn after_flush(&mut self) -> Result<(), Error> {
        self.sync_blobs()?;
        self.sync_db()
    }

    fn sync_db(&self) -> Result<(), Error> {
        self.db
            .sync_data()
            .map_err(|e| sync_error(&self.db_path, e))
    }

    /// Syncs every blob file whose length changed since it was last synced
    /// (new ones included), then the `blobs/` directory if any was. A blob
    /// still being written is synced again at its final length by the flush
    /// that covers its log entry.
    fn sync_blobs(&mut self) -> Result<(), Error> {
        let entries = match std::fs::read_dir(&self.blobs_dir) {
            Ok(entries) => entries,
            // No `blobs/` (a sled that makes none): nothing to do.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(sync_error(&self.blobs_dir, e)),
        };
        let mut present = HashMap::new();
        let mut synced_any = false;
        for entry in entries {
            let entry = entry.map_err(|e| sync_error(&self.blobs_dir, e))?;
            let name = entry.file_name();
            let path = entry.path();
            let file = match File::open(&path) {
                Ok(file) => file,
                // Removed by sled's blob GC since the listing.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(sync_error(&path, e)),
            };
            // The length is read before the sync, so every byte it counts
            // was written before the sync began and is covered by it.
            let len = file.metadata().map_err(|e| sync_error(&path, e))?.len();
            if self.blobs_synced.get(&name) != Some(&len) {
                file.sync_all().map_err(|e| sync_error(&path, e))?;
                synced_any = true;
            }
            present.insert(name, len);
        }
        // Forget blobs sled has removed.
        self.blobs_synced = present;
        if synced_any {
            sync_dir(&self.blobs_dir)?;
        }
        Ok(())
    }
}

/// `fsync` on a directory makes the entries in it durable.
fn sync_dir(dir: &Path) -> Result<(), Error> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| sync_error(dir, e))
}

fn sync_error(path: &Path, error: io::Error) -> Error {
    Error::Sync {
        path: path.display().to_string(),
        error: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sled_writes_the_files_we_sync_and_a_read_only_handle_can_fdatasync() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::sled_engine::open_db(dir.path()).unwrap();
        db.insert(b"k", b"v").unwrap();
        db.flush().unwrap();
        for name in [DB_FILE, CONF_FILE, BLOBS_DIR] {
            assert!(dir.path().join(name).exists(), "sled 0.34 wrote no {name}");
        }
        let mut disk = DiskSync::open(dir.path()).unwrap();
        disk.after_flush().unwrap();
    }

    #[test]
    fn a_value_over_the_blob_threshold_goes_to_a_blob_file_that_gets_synced() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::sled_engine::open_db(dir.path()).unwrap();
        let mut disk = DiskSync::open(dir.path()).unwrap();
        assert!(disk.blobs_synced.is_empty());

        db.insert(b"big", vec![7u8; 200 * 1024]).unwrap();
        db.flush().unwrap();
        disk.after_flush().unwrap();
        assert_eq!(disk.blobs_synced.len(), 1, "sled wrote one blob");
        let (name, len) = disk.blobs_synced.iter().next().unwrap();
        let on_disk = std::fs::metadata(dir.path().join(BLOBS_DIR).join(name))
            .unwrap()
            .len();
        assert_eq!(*len, on_disk);
    }

    #[test]
    fn a_db_file_that_is_not_there_is_a_sync_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        match DiskSync::open(dir.path()) {
            Err(Error::Sync { path, .. }) => assert!(path.ends_with("/db"), "{path}"),
            Err(other) => panic!("expected a sync error, got {other:?}"),
            Ok(_) => panic!("expected a sync error, got a DiskSync"),
        }
    }
}
