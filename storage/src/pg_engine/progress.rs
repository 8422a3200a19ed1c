//! What the engine, its writer and its lease keeper share: how far the
//! journal is durable, and its first failure.

use crate::Error;
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;
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
}
