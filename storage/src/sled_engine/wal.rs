//! arbor's write-ahead log: what makes a commit durable.
//!
//! sled holds the journal's records and answers every read; this log is what a
//! commit waits for. Each `append` is applied to sled at once (one sled
//! transaction, as before) and also framed here, in memory. The flusher writes
//! every frame queued so far to the open segment with one `write` and one
//! `fdatasync`, and only then acknowledges the commits they cover. sled's own
//! flush (a `sync_file_range` per dirty buffer, then our `fdatasync` of its
//! file, see `fsync.rs`) is off the commit path: it runs at checkpoints, on a
//! thread of its own.
//!
//! # Files
//! `<journal>/wal/<first seq, 16 hex digits>.log`, the segments, oldest first.
//! A segment holds frames back to back:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | body length, u32 little-endian |
//! | 4 | CRC-32 (IEEE) of the body, u32 little-endian |
//! | body | first seq (u64 LE), entry count (u32 LE), then per entry: table index (u8, into `JOURNAL_TABLES`), key length (u32 LE), key, value length (u32 LE), value (empty: remove every key under this one, `removal`) |
//!
//! One frame is one `append`: its records took the seqs `first ..= first +
//! count - 1`, and sled applied them in one transaction. An entry is exactly
//! what that transaction wrote (tree, key, value), so replaying a frame is
//! writing the same bytes again.
//!
//! # Invariants
//! 1. Frames are queued in seq order, under the lock that hands out seqs, and
//!    written in the order queued: a segment's frames are consecutive, and a
//!    later segment starts where the one before it ended.
//! 2. A commit is acknowledged only once the frame that carries it has been
//!    written and `fdatasync`ed (and, for a new segment, the segment's file
//!    and the `wal` directory entry synced first).
//! 3. A segment is removed only after a checkpoint: sled flushed and its file
//!    `fdatasync`ed after every frame in it was applied. So whatever sled
//!    holds after a crash, plus the segments left, covers every acknowledged
//!    commit.
//! 4. Open replays exactly the frames past sled's stored seq (`meta/seq`,
//!    written in the same sled transaction as the records): frames sled holds
//!    are skipped whole, never replayed over newer state; the first frame past
//!    it must start at the next seq, or the open fails naming the gap.
//! 5. A frame that is cut short or fails its checksum ends the log: it is the
//!    write a crash interrupted, never acknowledged (invariant 2), and it and
//!    everything after it in that segment are dropped. Such a frame in any
//!    segment but the newest fails the open instead: those were complete and
//!    synced before the next segment began.
//! 6. A segment is zero-filled ahead of its frames (`room`), written and
//!    synced with the flush that first needs it, so most flushes overwrite
//!    zeros instead of growing the file: an `fdatasync` that has no file size
//!    to commit is about 1.5x faster (docs/benchmarks.md, P1). A frame never
//!    starts with a zero length, so a zero header with nothing but zeros after
//!    it is where a segment's frames end, in any segment.

use crate::Error;
use crate::table::{JOURNAL_TABLES, table_index};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The journal's subdirectory for segments.
pub(crate) const WAL_DIR: &str = "wal";

/// After this many bytes of frames since the last checkpoint, the flusher
/// starts a new segment and asks for a checkpoint. It bounds both the log on
/// disk and what an open after a crash reads back.
pub(crate) const CHECKPOINT_BYTES: u64 = 32 * 1024 * 1024;

/// A frame bigger than this is not one we wrote (a record is at most a few
/// MiB; see the sandbox's output caps): reading it as a length would be a
/// corrupt frame.
const MAX_FRAME_BYTES: u32 = 1 << 30;

const HEADER_BYTES: usize = 8;

/// A segment's first zero-filled room, and the most it grows by at once:
/// small at first, so that a short-lived journal (a one-job `arbor run`)
/// writes few zeros, then doubling, so a busy one grows its file rarely.
const FIRST_ROOM: u64 = 64 * 1024;
const MAX_ROOM_STEP: u64 = 1024 * 1024;

pub(crate) use crate::overlay::{Entry, is_removal, removal};

/// A frame read back from a segment.
pub(crate) struct Frame {
    pub(crate) first_seq: u64,
    pub(crate) entries: Vec<Entry>,
}

impl Frame {
    pub(crate) fn last_seq(&self) -> u64 {
        self.first_seq + self.entries.len() as u64 - 1
    }
}

/// What the open found in the log.
pub(crate) struct Replay {
    /// Every whole frame, in seq order.
    pub(crate) frames: Vec<Frame>,
    /// Bytes dropped from the newest segment's tail (invariant 5).
    pub(crate) torn_bytes: u64,
}

/// How many bytes the frame of `entries` takes.
pub(crate) fn frame_bytes(entries: &[Entry]) -> usize {
    let body: usize = entries
        .iter()
        .map(|(_, key, value)| 9 + key.len() + value.len())
        .sum();
    HEADER_BYTES + 12 + body
}

/// Appends one frame for `entries`, which took the seqs from `first_seq` on.
pub(crate) fn encode_frame(out: &mut Vec<u8>, first_seq: u64, entries: &[Entry]) {
    let start = out.len();
    out.reserve(frame_bytes(entries));
    out.extend_from_slice(&[0; HEADER_BYTES]);
    out.extend_from_slice(&first_seq.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (tree, key, value) in entries {
        out.push(tree_index(tree));
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(key);
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value);
    }
    let body = &out[start + HEADER_BYTES..];
    let length = (body.len() as u32).to_le_bytes();
    let crc = crc32fast::hash(body).to_le_bytes();
    out[start..start + 4].copy_from_slice(&length);
    out[start + 4..start + 8].copy_from_slice(&crc);
}

fn tree_index(tree: &str) -> u8 {
    table_index(tree).unwrap_or_else(|| unreachable!("no record tree {tree:?}")) as u8
}

/// The segment the flusher writes, and the ones before it not yet
/// checkpointed.
pub(crate) struct Wal {
    dir: PathBuf,
    file: File,
    /// Every segment not yet removed, the open one last.
    segments: Vec<PathBuf>,
    /// Frame bytes written since the last checkpoint was asked for.
    bytes_since_checkpoint: u64,
    /// The open segment's frames' length, and how much of it a completed
    /// `fdatasync` covers (what a power cut keeps: `Faults::crash_at`).
    len: u64,
    synced_len: u64,
    /// The open segment's file length: its frames, then zeros (invariant 6).
    room: u64,
    /// `CHECKPOINT_BYTES`, but for tests that want checkpoints sooner.
    pub(crate) checkpoint_bytes: u64,
}

impl Wal {
    /// Removes every segment (call once sled holds all they carried and has
    /// been synced) and starts an empty one for seqs from `next_seq` on.
    pub(crate) fn restart(journal_dir: &Path, next_seq: u64) -> Result<Wal, Error> {
        let dir = journal_dir.join(WAL_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| wal_error(&dir, e))?;
        let old = segments(&dir)?;
        let wal = Wal {
            file: create_segment(&dir, next_seq)?,
            segments: vec![segment_path(&dir, next_seq)],
            dir,
            bytes_since_checkpoint: 0,
            checkpoint_bytes: CHECKPOINT_BYTES,
            len: 0,
            synced_len: 0,
            room: 0,
        };
        for path in old {
            if path != wal.segments[0] {
                std::fs::remove_file(&path).map_err(|e| wal_error(&path, e))?;
            }
        }
        wal.sync_dir()?;
        Ok(wal)
    }

    /// Writes `frames` after the open segment's last frame and `fdatasync`s
    /// it (invariant 2), unless `sync` is false (`Faults::skip_syncs`). If
    /// they reach past its zero-filled room, the room grows first, in the
    /// same sync (invariant 6).
    pub(crate) fn write_and_sync(&mut self, frames: &[u8], sync: bool) -> Result<(), Error> {
        let path = self.segments.last().expect("an open segment");
        let end = self.len + frames.len() as u64;
        let grow = if end > self.room {
            let step = self.room.clamp(FIRST_ROOM, MAX_ROOM_STEP);
            Some(end.next_multiple_of(FIRST_ROOM) + step)
        } else {
            None
        };
        self.file
            .write_all_at(frames, self.len)
            .and_then(|()| match grow {
                Some(room) => zero(&self.file, end, room),
                None => Ok(()),
            })
            .and_then(|()| if sync { self.file.sync_data() } else { Ok(()) })
            .map_err(|e| wal_error(path, e))?;
        if let Some(room) = grow {
            self.room = room;
        }
        self.bytes_since_checkpoint += frames.len() as u64;
        self.len = end;
        if sync {
            self.synced_len = self.len;
        }
        Ok(())
    }

    /// Cuts the open segment back to what its last `fdatasync` covered: what
    /// a power cut leaves of it (fault injection only). Its zeros go too,
    /// which reads back the same (invariant 6).
    pub(crate) fn truncate_to_synced(&mut self) -> Result<(), Error> {
        let path = self.segments.last().expect("an open segment");
        self.file
            .set_len(self.synced_len)
            .map_err(|e| wal_error(path, e))?;
        self.len = self.synced_len;
        self.room = self.synced_len;
        Ok(())
    }

    /// Whether enough has been written since the last checkpoint to start a
    /// new segment and checkpoint the ones before it.
    pub(crate) fn wants_checkpoint(&self) -> bool {
        self.bytes_since_checkpoint >= self.checkpoint_bytes
    }

    /// Starts a new segment for seqs from `next_seq` on and hands back the
    /// ones before it: they may be removed once sled has been flushed and
    /// synced (invariant 3). Every frame in them was applied before it was
    /// queued, so a sled flush that starts after this covers them.
    pub(crate) fn rotate(&mut self, next_seq: u64) -> Result<Vec<PathBuf>, Error> {
        let file = create_segment(&self.dir, next_seq)?;
        self.sync_dir()?;
        self.file = file;
        self.bytes_since_checkpoint = 0;
        self.len = 0;
        self.synced_len = 0;
        self.room = 0;
        let open = segment_path(&self.dir, next_seq);
        Ok(std::mem::replace(&mut self.segments, vec![open]))
    }

    fn sync_dir(&self) -> Result<(), Error> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| wal_error(&self.dir, e))
    }
}

/// Removes segments a checkpoint has made redundant, then syncs the
/// directory so they stay removed.
pub(crate) fn remove_segments(paths: &[PathBuf]) -> Result<(), Error> {
    for path in paths {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(wal_error(path, e)),
        }
    }
    if let Some(dir) = paths.first().and_then(|p| p.parent()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| wal_error(dir, e))?;
    }
    Ok(())
}

/// Reads every segment under the journal's `wal` directory (none is fine:
/// a journal from before the log, or a fresh one).
pub(crate) fn read(journal_dir: &Path) -> Result<Replay, Error> {
    let dir = journal_dir.join(WAL_DIR);
    let paths = match std::fs::metadata(&dir) {
        Ok(_) => segments(&dir)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(wal_error(&dir, e)),
    };
    let mut replay = Replay {
        frames: Vec::new(),
        torn_bytes: 0,
    };
    for (n, path) in paths.iter().enumerate() {
        let newest = n + 1 == paths.len();
        let mut bytes = Vec::new();
        File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| wal_error(path, e))?;
        let mut at = 0;
        while at < bytes.len() {
            // The zero-filled room after the last frame (invariant 6). A
            // frame's header is never all zeros, so the whole rest is read
            // only where one is.
            let rest = &bytes[at..];
            let zeros = |b: &[u8]| b.iter().all(|b| *b == 0);
            if zeros(&rest[..rest.len().min(HEADER_BYTES)]) && zeros(rest) {
                break;
            }
            match decode_frame(&bytes[at..]) {
                Ok((frame, used)) => {
                    if let Some(last) = replay.frames.last()
                        && frame.first_seq != last.last_seq() + 1
                    {
                        return Err(Error::Wal(format!(
                            "{}: the frame at byte {at} starts at seq {}, but the one before it ended at {}",
                            path.display(),
                            frame.first_seq,
                            last.last_seq()
                        )));
                    }
                    replay.frames.push(frame);
                    at += used;
                }
                Err(why) if newest => {
                    tracing::warn!(
                        segment = %path.display(),
                        offset = at,
                        dropped_bytes = bytes.len() - at,
                        "journal: dropping the log's torn tail (a write a crash interrupted, never acknowledged): {why}"
                    );
                    replay.torn_bytes = (bytes.len() - at) as u64;
                    break;
                }
                Err(why) => {
                    return Err(Error::Wal(format!(
                        "{}: the frame at byte {at} is damaged ({why}), and a newer segment follows it",
                        path.display()
                    )));
                }
            }
        }
    }
    Ok(replay)
}

/// One frame from the start of `bytes`, and how many bytes it took; or why
/// there is no whole frame there.
fn decode_frame(bytes: &[u8]) -> Result<(Frame, usize), String> {
    if bytes.len() < HEADER_BYTES {
        return Err(format!("{} bytes, short of a frame header", bytes.len()));
    }
    let length = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if length > MAX_FRAME_BYTES {
        return Err(format!("a length of {length} bytes"));
    }
    let end = HEADER_BYTES + length as usize;
    let Some(body) = bytes.get(HEADER_BYTES..end) else {
        return Err(format!(
            "a {length}-byte frame with {} bytes left",
            bytes.len() - HEADER_BYTES
        ));
    };
    if crc32fast::hash(body) != crc {
        return Err("its checksum does not match".to_string());
    }
    let mut body = Cursor(body);
    let first_seq = body.u64()?;
    let count = body.u32()?;
    if count == 0 || first_seq == 0 {
        return Err(format!("{count} entries from seq {first_seq}"));
    }
    let mut entries = Vec::with_capacity(count.min(4096) as usize);
    for _ in 0..count {
        let index = body.u8()?;
        let tree = JOURNAL_TABLES
            .get(index as usize)
            .ok_or_else(|| format!("tree index {index}"))?
            .def()
            .name;
        let key = body.bytes()?;
        let value = body.bytes()?;
        entries.push((tree, key, value.into()));
    }
    if !body.0.is_empty() {
        return Err(format!("{} bytes past its last entry", body.0.len()));
    }
    Ok((Frame { first_seq, entries }, end))
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("an entry runs past the frame".to_string());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
}

/// The segments in `dir`, oldest first (their names sort as their seqs).
fn segments(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| wal_error(dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.extension().is_some_and(|ext| ext == "log")
                && path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .is_some_and(|s| s.len() == 16 && u64::from_str_radix(s, 16).is_ok())
        })
        .collect();
    paths.sort();
    Ok(paths)
}

fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:016x}.log"))
}

fn create_segment(dir: &Path, first_seq: u64) -> Result<File, Error> {
    let path = segment_path(dir, first_seq);
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .map_err(|e| wal_error(&path, e))?;
    // An empty file's entry must be durable before a frame in it is
    // acknowledged; the directory sync that follows does that, and this sync
    // makes the (empty) inode itself durable.
    file.sync_all().map_err(|e| wal_error(&path, e))?;
    Ok(file)
}

/// Writes zeros over `from..to` of `file` (nothing if it is empty).
fn zero(file: &File, from: u64, to: u64) -> io::Result<()> {
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    let mut at = from;
    while at < to {
        let n = (to - at).min(ZEROS.len() as u64) as usize;
        file.write_all_at(&ZEROS[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

fn wal_error(path: &Path, error: io::Error) -> Error {
    Error::Sync {
        path: path.display().to_string(),
        error: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(first_seq: u64, values: &[&[u8]]) -> Vec<u8> {
        let entries: Vec<Entry> = values
            .iter()
            .map(|value| {
                (
                    crate::table::STEERING.def.name,
                    b"key".to_vec(),
                    (*value).into(),
                )
            })
            .collect();
        let mut out = Vec::new();
        encode_frame(&mut out, first_seq, &entries);
        out
    }

    /// A journal folder with an empty `wal` folder in it.
    fn journal_with_wal_dir() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let wal_dir = dir.path().join(WAL_DIR);
        std::fs::create_dir_all(&wal_dir).unwrap();
        (dir, wal_dir)
    }

    #[test]
    fn a_frame_reads_back_as_written() {
        let bytes = frame(7, &[b"one", b"two"]);
        let (read, used) = decode_frame(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!((read.first_seq, read.last_seq()), (7, 8));
        assert_eq!(read.entries[1].0, crate::table::STEERING.def.name);
        assert_eq!(&read.entries[1].2[..], b"two");
    }

    #[test]
    fn a_cut_or_flipped_frame_is_refused_with_the_reason() {
        let bytes = frame(1, &[b"value"]);
        let cut = decode_frame(&bytes[..bytes.len() - 1]).err().unwrap();
        assert!(cut.contains("bytes left"), "{cut}");
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let bad = decode_frame(&flipped).err().unwrap();
        assert!(bad.contains("checksum"), "{bad}");
    }

    #[test]
    fn the_newest_segments_torn_tail_is_dropped_and_an_older_ones_is_an_error() {
        let (dir, wal_dir) = journal_with_wal_dir();
        let mut first = frame(1, &[b"a"]);
        first.extend(frame(2, &[b"b", b"c"]));
        let mut second = frame(4, &[b"d"]);
        let whole = second.len();
        second.extend(&frame(5, &[b"e"])[..5]);
        std::fs::write(segment_path(&wal_dir, 1), &first).unwrap();
        std::fs::write(segment_path(&wal_dir, 4), &second).unwrap();

        let replay = read(dir.path()).unwrap();
        let seqs: Vec<_> = replay.frames.iter().map(|f| f.first_seq).collect();
        assert_eq!(seqs, vec![1, 2, 4]);
        assert_eq!(replay.torn_bytes, (second.len() - whole) as u64);

        // The same damage in the older segment is not a crash's: refused.
        first.extend(&frame(9, &[b"x"])[..5]);
        std::fs::write(segment_path(&wal_dir, 1), &first).unwrap();
        let error = read(dir.path()).err().unwrap().to_string();
        assert!(error.contains("a newer segment follows"), "{error}");
    }

    #[test]
    fn a_segment_grows_its_zeroed_room_ahead_and_reads_back_to_its_last_frame() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = Wal::restart(dir.path(), 1).unwrap();
        let path = wal.segments[0].clone();
        let size = || std::fs::metadata(&path).unwrap().len();
        wal.write_and_sync(&frame(1, &[b"a"]), true).unwrap();
        let room = size();
        assert!(room >= 2 * FIRST_ROOM, "zeros written ahead: {room} bytes");
        // The next flushes overwrite zeros: the file does not grow.
        wal.write_and_sync(&frame(2, &[b"b"]), true).unwrap();
        wal.write_and_sync(&frame(3, &[b"c", b"d"]), true).unwrap();
        assert_eq!(size(), room);
        // Past the room, it grows by more than the frames need.
        let big = vec![7u8; room as usize];
        wal.write_and_sync(&frame(5, &[&big]), true).unwrap();
        assert!(
            size() > wal.len,
            "{} bytes for {} of frames",
            size(),
            wal.len
        );

        // An older segment's zeros end its frames as the newest's do.
        wal.rotate(6).unwrap();
        wal.write_and_sync(&frame(6, &[b"e"]), true).unwrap();
        let replay = read(dir.path()).unwrap();
        let seqs: Vec<_> = replay.frames.iter().map(|f| f.first_seq).collect();
        assert_eq!(seqs, vec![1, 2, 3, 5, 6]);
        assert_eq!(replay.torn_bytes, 0, "zeros are no torn tail");
    }

    #[test]
    fn a_torn_frame_before_the_zeros_is_dropped_and_bytes_after_them_are_damage() {
        let (dir, wal_dir) = journal_with_wal_dir();
        let mut bytes = frame(1, &[b"a"]);
        bytes.extend(&frame(2, &[b"b"])[..6]);
        bytes.resize(bytes.len() + 4096, 0);
        std::fs::write(segment_path(&wal_dir, 1), &bytes).unwrap();
        let replay = read(dir.path()).unwrap();
        assert_eq!(replay.frames.len(), 1);
        assert!(replay.torn_bytes > 4096, "{}", replay.torn_bytes);

        // Something after a zero header is not room: in an older segment, refused.
        let mut older = frame(1, &[b"a"]);
        older.resize(older.len() + 64, 0);
        older.push(1);
        std::fs::write(segment_path(&wal_dir, 1), &older).unwrap();
        std::fs::write(segment_path(&wal_dir, 2), frame(2, &[b"b"])).unwrap();
        let error = read(dir.path()).err().unwrap().to_string();
        assert!(error.contains("a newer segment follows"), "{error}");
    }

    #[test]
    fn frames_that_do_not_follow_on_are_refused() {
        let (dir, wal_dir) = journal_with_wal_dir();
        let mut bytes = frame(1, &[b"a"]);
        bytes.extend(frame(3, &[b"c"]));
        std::fs::write(segment_path(&wal_dir, 1), &bytes).unwrap();
        let error = read(dir.path()).err().unwrap().to_string();
        assert!(error.contains("starts at seq 3"), "{error}");
    }
}
