//! What the engine, its writer and its lease keeper share: how far the
//! journal is durable, and its first failure.

use crate::Error;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::watch;

/// What the engine and its writer share.
pub(crate) struct Progress {
    /// The last seq applied (readable).
    pub(crate) applied: AtomicU64,
    /// The last seq committed, published through `durable_tx` too.
    pub(crate) durable: AtomicU64,
    /// Woken whenever `durable` rises or the journal fails.
    pub(crate) durable_tx: watch::Sender<u64>,
    /// Transactions committed.
    pub(crate) flushes: AtomicU64,
    /// Of those, the ones whose commit waited for the server's WAL flush
    /// (all but under `Faults::skip_syncs`).
    pub(crate) syncs: AtomicU64,
    /// The first write that failed; set once, never cleared.
    pub(crate) failure: OnceLock<String>,
    /// The failed transaction's last seq and its error: its own commits
    /// are told that error, later ones that the journal has failed.
    pub(crate) failed_batch: OnceLock<(u64, Error)>,
}

impl Progress {
    /// As `fail`, for the transaction that carried the seqs up to `last`.
    pub(crate) fn fail_batch(&self, what: &str, last: u64, error: Error) {
        let _ = self.failed_batch.set((last, error.clone()));
        self.fail(what, error);
    }

    pub(crate) fn fail(&self, what: &str, error: Error) -> Error {
        tracing::error!(error = %error, "journal: {what} failed; the journal takes no more writes");
        let _ = self.failure.set(format!("{what} failed: {error}"));
        self.durable_tx.send_modify(|_| {});
        error
    }

    /// What a commit waiting for `seq` is told now, if anything yet: it is
    /// durable; or the transaction that carried it failed (its own error,
    /// as the sled engine tells a failed flush's commits; the writer runs
    /// apart, so it may have failed before the wait began); or the journal
    /// failed before it.
    pub(crate) fn outcome(&self, seq: u64) -> Option<Result<(), Error>> {
        if self.durable.load(Ordering::Acquire) >= seq {
            return Some(Ok(()));
        }
        if let Some((last, error)) = self.failed_batch.get()
            && seq <= *last
        {
            return Some(Err(error.clone()));
        }
        self.failure
            .get()
            .map(|first| Err(Error::Failed(first.clone())))
    }
}
