//! Opening the sled engine: arbor's lock on the directory, sled itself, the
//! format check, a new epoch, and the replay of what the log holds past
//! sled (`wal.rs`, invariant 4); then the flusher and applier threads.

use super::applier::{APPLY_STEP, Applier};
use super::flusher::{Flusher, start_thread};
use super::fsync::DiskSync;
use super::handle::{
    META, META_EPOCH, META_FORMAT, META_SEQ, Pending, Progress, SledEngine, Trees, Unstarted,
};
use super::wal::{self, Wal};
use crate::Error;
use crate::codec;
use crate::faults::Faults;
use crate::overlay::Overlay;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

impl SledEngine {
    /// Opens (creating) the sled db at `dir`, checks or writes the format
    /// version, bumps the epoch, replays the log and starts the threads.
    pub fn open(dir: &Path) -> Result<SledEngine, Error> {
        let (engine, unstarted) = Self::open_without_flusher(dir)?;
        engine.start_flusher(unstarted)?;
        Ok(engine)
    }

    /// Everything `open` does except starting the flusher, so a test can queue
    /// commits first and watch one flush serve them all.
    pub(super) fn open_without_flusher(dir: &Path) -> Result<(SledEngine, Unstarted), Error> {
        Self::open_inner(dir, false)
    }

    /// Opens the journal to read it: no new epoch, no flusher, and every
    /// write refused (`Error::ReadOnly`). For `arbor journal verify` and
    /// `inspect`, which must change nothing the journal says. What the log
    /// holds past sled is applied to sled all the same (as any open does), so
    /// that they read what the node acknowledged; the log is left in place.
    pub fn open_read_only(dir: &Path) -> Result<SledEngine, Error> {
        if !dir.join("db").is_file() {
            return Err(Error::Sled(sled::Error::Io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no journal in {}", dir.display()),
            ))));
        }
        Ok(Self::open_inner(dir, true)?.0)
    }

    fn open_inner(dir: &Path, read_only: bool) -> Result<(SledEngine, Unstarted), Error> {
        let (dir_lock, db) = open_locked(dir)?;
        // sled has opened the dir: its files exist and any snapshot is written.
        let mut disk = DiskSync::open(dir)?;
        let trees = Trees::open(&db)?;
        let meta = &trees.meta;

        let supported = u32::from(codec::FORMAT_VERSION);
        match meta.get(META_FORMAT)? {
            Some(found) => {
                let found = meta_u32(META_FORMAT, &found)?;
                if found != supported {
                    return Err(Error::FormatVersion {
                        dir: dir.display().to_string(),
                        found,
                        supported,
                    });
                }
            }
            None if !read_only => {
                meta.insert(META_FORMAT, &supported.to_be_bytes())?;
            }
            None => {}
        }
        let stored_epoch = match meta.get(META_EPOCH)? {
            Some(previous) => meta_u64(META_EPOCH, &previous)?,
            None => 0,
        };
        let epoch = if read_only {
            stored_epoch
        } else {
            stored_epoch + 1
        };
        if !read_only {
            meta.insert(META_EPOCH, &epoch.to_be_bytes())?;
        }
        let stored_seq = match meta.get(META_SEQ)? {
            Some(seq) => meta_u64(META_SEQ, &seq)?,
            None => 0,
        };
        // What sled lost in a crash and the log kept (`wal.rs`, invariant 4).
        let mut seq = stored_seq;
        let replay = wal::read(dir)?;
        // Applied in batches of whole frames, each one transaction with its
        // last seq, as the applier does.
        let mut batch: Vec<wal::Entry> = Vec::new();
        for frame in replay.frames {
            if frame.last_seq() <= seq {
                continue;
            }
            if frame.first_seq != seq + 1 {
                return Err(Error::Wal(format!(
                    "sled holds the journal up to seq {seq}, but the log goes on from seq {}",
                    frame.first_seq
                )));
            }
            seq = frame.last_seq();
            batch.extend(frame.entries);
            if batch.len() >= APPLY_STEP {
                trees.apply(&batch.iter().collect::<Vec<_>>(), seq)?;
                batch.clear();
            }
        }
        if !batch.is_empty() {
            trees.apply(&batch.iter().collect::<Vec<_>>(), seq)?;
        }
        if seq > stored_seq {
            tracing::info!(
                dir = %dir.display(),
                from = stored_seq + 1,
                to = seq,
                "journal: applied records from the write-ahead log that sled had not kept"
            );
        }
        // Durable before any record is stamped with it: two boots must never
        // share an epoch, or recovery could not tell their records apart. The
        // same flush makes what was replayed durable in sled, so the log can
        // start afresh.
        let wal = if read_only {
            None
        } else {
            db.flush()?;
            disk.after_flush()?;
            Some(Wal::restart(dir, seq + 1)?)
        };
        tracing::debug!(dir = %dir.display(), epoch, seq, "journal opened");

        // Whatever was on disk at open is durable by definition.
        let progress = Arc::new(Progress {
            applied: AtomicU64::new(seq),
            durable: AtomicU64::new(seq),
            flushes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            failure: OnceLock::new(),
        });
        let (waiters, queue) = mpsc::channel();
        let (work, work_queue) = mpsc::channel();
        let engine = SledEngine {
            db,
            _dir_lock: dir_lock,
            trees,
            epoch,
            last_seq: Mutex::new(seq),
            progress,
            faults: Arc::new(Faults::default()),
            read_only,
            pending: Arc::new(Mutex::new(Pending::default())),
            overlay: Arc::new(Mutex::new(Overlay::new())),
            work: (!read_only).then_some(work),
            waiters: Some(waiters),
            flusher: Mutex::new(None),
            applier: Mutex::new(None),
            leave_unapplied: Arc::new(AtomicBool::new(false)),
        };
        Ok((
            engine,
            Unstarted {
                queue,
                work: work_queue,
                disk,
                wal,
            },
        ))
    }

    pub(super) fn start_flusher(&self, unstarted: Unstarted) -> Result<(), Error> {
        let Unstarted {
            queue,
            work,
            disk,
            wal,
        } = unstarted;
        let (Some(wal), Some(checkpoints)) = (wal, self.work.clone()) else {
            return Ok(()); // read-only: nothing is ever written
        };
        let applier = Applier {
            db: self.db.clone(),
            trees: Trees::open(&self.db)?,
            disk,
            overlay: Arc::clone(&self.overlay),
            progress: Arc::clone(&self.progress),
            leave_unapplied: Arc::clone(&self.leave_unapplied),
            faults: Arc::clone(&self.faults),
        };
        start_thread(&self.applier, "arbor-journal-applier", move || {
            applier.run(work)
        })?;

        let flusher = Flusher {
            wal,
            frames: Vec::new(),
            progress: Arc::clone(&self.progress),
            faults: Arc::clone(&self.faults),
            pending: Arc::clone(&self.pending),
            checkpoints,
        };
        start_thread(&self.flusher, "arbor-journal-flusher", move || {
            flusher.run(queue)
        })
    }
}

/// sled's page cache. Its default, 1 GiB, is a node's memory growing with
/// its journal for as long as it runs: arbord under a steady load of small
/// runs went from 570 to 950 MiB of RSS in two minutes. Reads of recent
/// state hit the overlay, and the rest is in the kernel's page cache; at
/// 64 MiB the same load held at 117-128 MiB, and served more runs a second
/// (324 against 271). `soak` checks it (docs/reliability.md).
const SLED_CACHE_BYTES: u64 = 64 << 20;

/// How often, and how long apart, an open tries a lock another handle holds.
/// sled's own background threads hold the database for a moment after the
/// last handle is dropped, so a reopen in the same process (a restart in a
/// test, a node restarted in place) can find a lock still held.
const LOCK_ATTEMPTS: u32 = 100;
const LOCK_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// Opens the sled database. See `open_locked`; the directory lock is
/// released on return (sled's own lock on its `db` file remains).
pub fn open_db(dir: &Path) -> Result<sled::Db, Error> {
    open_locked(dir).map(|(_lock, db)| db)
}

/// Takes arbor's lock on the directory, clears what a crash left half
/// written, and opens sled, waiting a little for either lock.
///
/// sled 0.34 writes a snapshot at every open as `snap.<lsn>.generating`,
/// then renames it; a process killed in between leaves the `.generating`
/// file, and the next open reads it as the newest snapshot and fails with
/// "Read corrupted data" (sled issue 1527). A finished snapshot is always
/// renamed, so a `.generating` file is never one: with the directory locked
/// (no other arbor process is writing it), it is removed before sled looks.
pub(crate) fn open_locked(dir: &Path) -> Result<(std::fs::File, sled::Db), Error> {
    let io = |e: std::io::Error| Error::Sled(sled::Error::Io(e));
    std::fs::create_dir_all(dir).map_err(io)?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(DIR_LOCK))
        .map_err(io)?;
    let mut attempt = 0;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if attempt + 1 < LOCK_ATTEMPTS => {
                attempt += 1;
                std::thread::sleep(LOCK_PAUSE);
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!("{} is in use by another process", dir.display()),
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
    }
    for entry in std::fs::read_dir(dir).map_err(io)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(file = %name, "removing a snapshot a crash left half written");
            std::fs::remove_file(entry.path()).map_err(io)?;
        }
    }
    let mut attempt = 0;
    loop {
        // No background flush: the log makes commits durable, and sled is
        // flushed at checkpoints (`wal.rs`), so its own timer would only add
        // syncs that compete with the log's.
        match sled::Config::new()
            .path(dir)
            .flush_every_ms(None)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()
        {
            Err(sled::Error::Io(e))
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.to_string().contains("could not acquire lock") =>
            {
                attempt += 1;
                if attempt >= LOCK_ATTEMPTS {
                    return Err(sled::Error::Io(e).into());
                }
                std::thread::sleep(LOCK_PAUSE);
            }
            other => return Ok((lock, other?)),
        }
    }
}

/// The file arbor locks for as long as a journal is open on the directory.
const DIR_LOCK: &str = "arbor.lock";

pub(super) fn meta_u64(key: &[u8], value: &[u8]) -> Result<u64, Error> {
    <[u8; 8]>::try_from(value)
        .map(u64::from_be_bytes)
        .map_err(|_| codec::undecodable(META, key, format!("{} bytes, expected 8", value.len())))
}

pub(super) fn meta_u32(key: &[u8], value: &[u8]) -> Result<u32, Error> {
    <[u8; 4]>::try_from(value)
        .map(u32::from_be_bytes)
        .map_err(|_| codec::undecodable(META, key, format!("{} bytes, expected 4", value.len())))
}
