//! The flusher thread: group commit. It takes every waiter and every frame
//! queued so far, writes the frames to the log with one `write` and one
//! `fdatasync`, publishes the last seq they carry as durable and wakes the
//! waiters; it starts new log segments and asks the applier for checkpoints.

use super::handle::{Pending, Progress, Waiter};
use super::wal::{self, Wal};
use super::work::Work;
use crate::Error;
use crate::faults::{CrashKind, CrashPoint, Faults};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread;

/// The flusher thread's state: the log, and what it shares with the handles.
pub(super) struct Flusher {
    pub(super) wal: Wal,
    /// The frames of the flush under way, kept to be written into again.
    pub(super) frames: Vec<u8>,
    pub(super) progress: Arc<Progress>,
    pub(super) faults: Arc<Faults>,
    pub(super) pending: Arc<Mutex<Pending>>,
    /// The applier's queue, for checkpoints.
    pub(super) checkpoints: mpsc::Sender<Work>,
}

impl Flusher {
    /// One flush per batch of queued waiters, until every handle is gone.
    pub(super) fn run(mut self, queue: mpsc::Receiver<Waiter>) {
        while let Ok(first) = queue.recv() {
            let mut waiters = vec![first];
            waiters.extend(queue.try_iter());

            // A waiter already covered (the flush that served its neighbours
            // carried its frame) needs no new flush.
            let durable = self.progress.durable.load(Ordering::Acquire);
            let (covered, mut pending): (Vec<_>, Vec<_>) =
                waiters.into_iter().partition(|w| w.seq <= durable);
            for waiter in covered {
                let _ = waiter.reply.send(Ok(()));
            }
            if pending.is_empty() {
                continue;
            }

            if !self.faults.wait_while_held() {
                // The journal is being dropped: nobody awaits these any more.
                continue;
            }
            // Commits queued while the flush was held ride on this one.
            pending.extend(queue.try_iter());

            match self.flush() {
                Ok(target) => {
                    // Each waiter was sent after its own append queued its
                    // frame, so the frames just synced cover every one.
                    debug_assert!(pending.iter().all(|w| w.seq <= target));
                    for waiter in pending {
                        // A commit whose caller went away needs no answer.
                        let _ = waiter.reply.send(Ok(()));
                    }
                }
                Err(e) => {
                    for waiter in pending {
                        let _ = waiter.reply.send(Err(e.clone()));
                    }
                }
            }
        }
        // The journal is closing. Frames appended since the last flush (no
        // commit waited for them) go to the log now, so that the log holds
        // every append, whether or not the applier takes the rest into sled
        // (`leave_unapplied_at_close`). A test holding flushes stands for a
        // crash: then, as in a crash, they are not written.
        if !self.faults.flushes_held() {
            let _ = self.flush();
        }
    }

    /// Writes and syncs every frame queued so far and publishes the last seq
    /// they carry as durable. Any failure marks the journal failed; once
    /// failed, nothing more is written or acknowledged.
    fn flush(&mut self) -> Result<u64, Error> {
        let progress = Arc::clone(&self.progress);
        let progress = &*progress;
        if let Some(first) = progress.failure.get() {
            return Err(Error::Failed(first.clone()));
        }
        if self.faults.flushes_fail() {
            return Err(progress.fail("a flush", Error::Injected("flush")));
        }
        let (appends, target) = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            pending.bytes = 0;
            (std::mem::take(&mut pending.appends), pending.last_seq)
        };
        if !appends.is_empty() {
            self.frames.clear();
            for (first_seq, entries) in &appends {
                wal::encode_frame(&mut self.frames, *first_seq, entries);
            }
            drop(appends);
            let number = progress.flushes.load(Ordering::Acquire) + 1;
            self.crash_if_due(number, CrashPoint::BeforeFlush);
            let sync = !self.faults.syncs_skipped();
            let written = self.wal.write_and_sync(&self.frames, sync);
            progress.flushes.fetch_add(1, Ordering::AcqRel);
            if sync {
                progress.syncs.fetch_add(1, Ordering::AcqRel);
            }
            written.map_err(|e| progress.fail("a flush", e))?;
            self.crash_if_due(number, CrashPoint::AfterFlush);
        }
        let before = progress.durable.fetch_max(target, Ordering::AcqRel);
        if target > before {
            self.faults.durable(target);
        }
        if self.wal.wants_checkpoint() {
            let old = self
                .wal
                .rotate(target + 1)
                .map_err(|e| progress.fail("starting a new log segment", e))?;
            // The checkpointer is gone only if it panicked; the log then
            // just keeps its old segments until the next open.
            let _ = self.checkpoints.send(Work::Checkpoint(old));
        }
        Ok(target)
    }
}

impl Flusher {
    /// Fault injection (`Faults::crash_at`): if a crash is armed for this
    /// point of this flush, the process dies here, as a power cut first
    /// losing every log write past the last sync.
    fn crash_if_due(&mut self, flush: u64, point: CrashPoint) {
        let Some(kind) = self.faults.crash_due(flush, point) else {
            return;
        };
        if kind == CrashKind::PowerLoss {
            let _ = self.wal.truncate_to_synced();
        }
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        // SIGKILL cannot be caught; nothing runs past it.
        loop {
            std::thread::park();
        }
    }
}

/// Starts one of the journal's threads and keeps its handle in `slot`, for
/// the drop to join.
pub(super) fn start_thread(
    slot: &Mutex<Option<thread::JoinHandle<()>>>,
    name: &str,
    body: impl FnOnce() + Send + 'static,
) -> Result<(), Error> {
    let handle = thread::Builder::new()
        .name(name.into())
        .spawn(body)
        // Failing to spawn a thread is an OS resource fault; sled's Io
        // variant is the closest home for it.
        .map_err(|e| Error::Sled(sled::Error::Io(e)))?;
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
    Ok(())
}
