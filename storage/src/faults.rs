//! Fault injection, for tests: make the journal's writes or flushes fail, or
//! hold its flushes back, to show what the node does when its disk does.
//!
//! Every journal has one `Faults` (`Journal::faults`), all off. Switching a
//! fault on affects the next append or the next flush; nothing in flight.
//!
//! - `fail_writes`: `append` returns `Error::Injected("write")` and writes nothing.
//! - `fail_flushes`: the flusher fails its waiting commits with
//!   `Error::Injected("flush")` and `durable_seq` does not move.
//! - `hold_flushes`: the flusher parks before flushing, so commits wait and
//!   `durable_seq` does not move; releasing the hold lets them complete. This
//!   is "a crash between write and flush": the append is applied and readable,
//!   and never acknowledged.
//!
//! - `skip_syncs`: the flusher writes the log but does not `fdatasync` it, so
//!   a commit costs what it would on a disk with free syncs. For benchmarks
//!   that set a journal against itself without the disk; what it
//!   acknowledges can be lost in a power cut (a process crash loses nothing:
//!   the kernel has the writes).
//!
//! - `crash_at`: the process kills itself (SIGKILL, no clean-up) just before
//!   or just after the journal's k-th flush, the way a node dies at a commit
//!   point (`arbor-testkit`'s `explore_crashes`). As a power cut, it first
//!   cuts the log back to its last `fdatasync` and, from the moment it is
//!   armed, keeps sled at what its own last sync left (the applier takes
//!   nothing more in until a checkpoint or a drain, which sync sled): so
//!   every write past the last completed sync is gone at the crash, not
//!   kept by the page cache as a kill keeps it.
//! - `record_durable_to`: after every flush, the durable seq is written to a
//!   file with one `write`, so a process that crashes leaves behind what it
//!   acknowledged.
//!
//! Lease points, for a shared journal's node (`arbor-testkit`'s
//! `explore_crashes` on PostgreSQL):
//!
//! - `fence_at`: just before the k-th flush, the node's lease is taken from
//!   it, as when its id opened again elsewhere and that life ended too (a
//!   newer epoch, a deadline passed): that flush's transaction is refused
//!   for a stale epoch, and the node learns it has lost its lease.
//! - `crash_at_renewal`: at the k-th flush the node renews at once, and the
//!   process dies just before the renewal is sent or just after it is
//!   answered.
//! - `crash_at_first_claim`: the next shared journal this process opens
//!   dies just before or just after its first claim of runs commits (a node
//!   taking over a dead node's runs, dead in the middle of it).
//!
//! An injected failure counts as a real one: the journal remembers it and
//! refuses every later append (`Journal::failed`).
//!
//! Deadlock safety: the hold's mutex is taken by the flusher thread and by
//! whoever switches or watches the hold, never by `append` and never across
//! an await. The flusher waits on the condvar, never spins, and dropping the
//! journal releases it (`close`) before joining the thread.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Where a crash falls around a flush of the journal's log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// The flush's frames are not written: its commits were never durable.
    BeforeFlush,
    /// The frames are written and synced, and nobody was told: durable, not
    /// acknowledged.
    AfterFlush,
}

/// How the process dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashKind {
    /// SIGKILL: the kernel keeps every write, synced or not.
    Kill,
    /// A power cut: every write past the last completed sync is lost, then
    /// SIGKILL (see the module docs for what is simulated).
    PowerLoss,
}

/// One crash: at flush number `flush` (1 is the first flush that writes
/// frames after the journal opened), at `point`, as `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Crash {
    pub flush: u64,
    pub point: CrashPoint,
    pub kind: CrashKind,
}

/// The journal's injectable faults; see the module docs.
#[derive(Debug, Default)]
pub struct Faults {
    fail_writes: AtomicBool,
    hold_renewals: AtomicBool,
    fence: Mutex<Option<u64>>,
    renewal_crash: Mutex<Option<(u64, CrashPoint)>>,
    /// Set at the renewal crash's flush: the keeper renews now, and dies.
    renewal_due: Mutex<Option<CrashPoint>>,
    renew_now: tokio::sync::Notify,
    claim_crash: Mutex<Option<CrashPoint>>,
    fail_flushes: AtomicBool,
    skip_syncs: AtomicBool,
    crash: Mutex<Option<Crash>>,
    /// Armed as a power cut: the applier keeps sled at its last sync.
    power_loss: AtomicBool,
    durable_log: Mutex<Option<File>>,
    hold: Mutex<Hold>,
    /// Signalled whenever `hold` changes, in either direction.
    hold_changed: Condvar,
}

#[derive(Debug, Default)]
struct Hold {
    held: bool,
    /// The journal is being dropped: the flusher must not park any more.
    closing: bool,
    /// The flusher is parked on the hold with commits waiting.
    flusher_parked: bool,
}

impl Faults {
    /// While on, every `append` (and so every `commit`) fails with
    /// `Error::Injected("write")` and writes nothing.
    pub fn fail_writes(&self, on: bool) {
        self.fail_writes.store(on, Ordering::Release);
    }

    /// While on, every flush fails its waiting commits with
    /// `Error::Injected("flush")` instead of flushing.
    pub fn fail_flushes(&self, on: bool) {
        self.fail_flushes.store(on, Ordering::Release);
    }

    /// While on, a shared journal's node does not renew its lease, as a
    /// node paused or cut off from the database would not: it loses the
    /// lease by its own clock before the database's deadline passes.
    pub fn hold_renewals(&self, on: bool) {
        self.hold_renewals.store(on, Ordering::Release);
    }

    pub(crate) fn renewals_held(&self) -> bool {
        self.hold_renewals.load(Ordering::Acquire)
    }

    /// Just before flush `flush`, the node's lease is taken from it (see
    /// the module docs). A journal of its own has no lease: nothing happens.
    pub fn fence_at(&self, flush: u64) {
        *lock(&self.fence) = Some(flush);
    }

    pub(crate) fn fence_due(&self, flush: u64) -> bool {
        *lock(&self.fence) == Some(flush)
    }

    /// At flush `flush`, the node renews its lease at once and the process
    /// dies at `point` of that renewal (before it is sent, after it is
    /// answered). A journal of its own has no lease: nothing happens.
    pub fn crash_at_renewal(&self, flush: u64, point: CrashPoint) {
        *lock(&self.renewal_crash) = Some((flush, point));
    }

    /// The writer, at flush `flush`: wakes the lease's keeper if a renewal
    /// crash is armed for it.
    pub(crate) fn flush_begins(&self, flush: u64) {
        let armed = *lock(&self.renewal_crash);
        if let Some((_, point)) = armed.filter(|(at, _)| *at == flush) {
            *lock(&self.renewal_due) = Some(point);
            self.renew_now.notify_one();
        }
    }

    /// Resolves when a renewal crash comes due (the keeper renews at once).
    pub(crate) async fn renewal_forced(&self) {
        self.renew_now.notified().await
    }

    /// The keeper, at `point` of a renewal: dies if a renewal crash is due there.
    pub(crate) fn crash_if_renewal_due(&self, point: CrashPoint) {
        if *lock(&self.renewal_due) == Some(point) {
            die();
        }
    }

    /// The claimer, at `point` of a claim of runs: dies if a claim crash is
    /// armed there.
    pub(crate) fn crash_if_claim_due(&self, point: CrashPoint) {
        if *lock(&self.claim_crash) == Some(point) {
            die();
        }
    }

    /// A new journal's faults: all off, but for a claim crash armed for it
    /// (`crash_at_first_claim`).
    pub(crate) fn for_open() -> Faults {
        let faults = Faults::default();
        *lock(&faults.claim_crash) = lock(&NEXT_CLAIM_CRASH).take();
        faults
    }

    /// While on, the flusher writes the log without syncing it (see the
    /// module docs: benchmarks only).
    pub fn skip_syncs(&self, on: bool) {
        self.skip_syncs.store(on, Ordering::Release);
    }

    /// While on, the flusher does not flush: commits wait and `durable_seq`
    /// stays put. Switching it off lets the waiting commits complete.
    pub fn hold_flushes(&self, on: bool) {
        self.lock().held = on;
        self.hold_changed.notify_all();
    }

    /// Blocks until the flusher is parked on the hold with at least one commit
    /// waiting, or `limit` passes; says which. The limit is a safety net for a
    /// test that got it wrong, not a way to wait: a parked flusher is signalled.
    pub fn wait_until_flush_held(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut hold = self.lock();
        while !hold.flusher_parked {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            hold = self
                .hold_changed
                .wait_timeout(hold, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Arms one crash: the flusher kills the process at that point of that
    /// flush (see `Crash`). A flush number already past never comes.
    pub fn crash_at(&self, crash: Crash) {
        if crash.kind == CrashKind::PowerLoss {
            self.power_loss.store(true, Ordering::Release);
        }
        *self.crash.lock().unwrap_or_else(PoisonError::into_inner) = Some(crash);
    }

    /// After every flush from now on, writes the durable seq, as a line
    /// `durable <seq>`, to `file` in one `write` (not synced: a crashed process's
    /// writes stay in the page cache, which is all a test that reads it
    /// after a kill needs).
    pub fn record_durable_to(&self, file: File) {
        *self
            .durable_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(file);
    }

    /// The crash armed for flush `flush` at `point`, if any.
    pub(crate) fn crash_due(&self, flush: u64, point: CrashPoint) -> Option<CrashKind> {
        let crash = *self.crash.lock().unwrap_or_else(PoisonError::into_inner);
        crash
            .filter(|c| c.flush == flush && c.point == point)
            .map(|c| c.kind)
    }

    /// Whether the applier is to keep sled at its last sync (a power cut is armed).
    pub(crate) fn holds_sled(&self) -> bool {
        self.power_loss.load(Ordering::Acquire)
    }

    /// Writes `durable` to the file `record_durable_to` gave, if any.
    pub(crate) fn durable(&self, durable: u64) {
        if let Some(file) = self
            .durable_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            let _ = file.write_all(format!("durable {durable}\n").as_bytes());
        }
    }

    pub(crate) fn writes_fail(&self) -> bool {
        self.fail_writes.load(Ordering::Acquire)
    }

    pub(crate) fn flushes_fail(&self) -> bool {
        self.fail_flushes.load(Ordering::Acquire)
    }

    pub(crate) fn syncs_skipped(&self) -> bool {
        self.skip_syncs.load(Ordering::Acquire)
    }

    /// The flusher, about to flush: parks while flushes are held. Returns
    /// `false` if the journal is closing, so the flusher must not flush now.
    pub(crate) fn wait_while_held(&self) -> bool {
        let mut hold = self.lock();
        if hold.held && !hold.closing {
            hold.flusher_parked = true;
            self.hold_changed.notify_all();
            while hold.held && !hold.closing {
                hold = self
                    .hold_changed
                    .wait(hold)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            hold.flusher_parked = false;
        }
        !hold.closing
    }

    /// Whether a test holds flushes now.
    pub(crate) fn flushes_held(&self) -> bool {
        self.lock().held
    }

    /// The journal is being dropped: wakes a parked flusher for good.
    pub(crate) fn close(&self) {
        self.lock().closing = true;
        self.hold_changed.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, Hold> {
        self.hold.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The claim crash the next shared journal opened takes (`crash_at_first_claim`).
static NEXT_CLAIM_CRASH: Mutex<Option<CrashPoint>> = Mutex::new(None);

/// Arms the next shared journal this process opens to die just before or
/// just after its first claim of runs commits (see the module docs). For a
/// crash test's child process: the journal it opens claims at once.
pub fn crash_at_first_claim(point: CrashPoint) {
    *lock(&NEXT_CLAIM_CRASH) = Some(point);
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The process dies here: SIGKILL, no clean-up, as a crash.
pub(crate) fn die() -> ! {
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn all_faults_start_off() {
        let faults = Faults::default();
        assert!(!faults.writes_fail());
        assert!(!faults.flushes_fail());
        assert!(faults.wait_while_held());
        assert!(!faults.wait_until_flush_held(Duration::ZERO));
    }

    /// Faults holding flushes, and a thread standing for the flusher, parked
    /// on the hold.
    fn a_held_flusher() -> (Arc<Faults>, thread::JoinHandle<bool>) {
        let faults = Arc::new(Faults::default());
        faults.hold_flushes(true);
        let flusher = {
            let faults = Arc::clone(&faults);
            thread::spawn(move || faults.wait_while_held())
        };
        assert!(faults.wait_until_flush_held(Duration::from_secs(30)));
        (faults, flusher)
    }

    #[test]
    fn a_held_flusher_parks_until_released() {
        let (faults, flusher) = a_held_flusher();
        assert!(!flusher.is_finished());
        faults.hold_flushes(false);
        assert!(flusher.join().unwrap(), "released, not closing: flush");
        assert!(!faults.wait_until_flush_held(Duration::ZERO));
    }

    #[test]
    fn closing_wakes_a_held_flusher_and_tells_it_not_to_flush() {
        let (faults, flusher) = a_held_flusher();
        faults.close();
        assert!(!flusher.join().unwrap());
        // Once closing, a hold never parks again.
        assert!(!faults.wait_while_held());
    }
}
