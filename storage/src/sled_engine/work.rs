//! What the sled engine's applier thread is asked to do (`overlay.rs` has
//! the invariants it keeps).

use std::path::PathBuf;
use std::sync::mpsc;

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
