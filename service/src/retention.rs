//! Retention: a finished run is forgotten once it has been over for
//! `keep_finished` (a week unless configured; `forever` keeps everything).
//! Without it a node that serves runs day after day grows its journal on
//! disk, and sled's memory of the journal's pages with it, without end.
//!
//! A pass reads only the runs made before the cutoff (run ids are uuid v7,
//! in time order), keeps every one not finished, or finished after the
//! cutoff (the time of its last event), and forgets the rest, a batch at a
//! time (`EmbeddedNode::forget_runs`): the journal removes every record of
//! theirs in one append, the event bus drops their trees, their workdirs
//! leave the disk; then admission frees their idempotency keys.
//!
//! # Invariants
//! 1. A run that is not finished is never forgotten, however old.
//! 2. A run is forgotten whole (one append) or not at all, and once
//!    forgotten no read answers for it, after a restart as before.

use crate::Shared;
use arbor_protocol::RunId;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Why a retention pass stopped short (what it forgot before stays forgotten).
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Journal(#[from] arbor_storage::Error),
    #[error("the retention pass panicked: {0}")]
    Panicked(String),
}

/// Runs forgotten in one append.
const BATCH: usize = 256;

/// Forgets every run finished before `now - keep`; returns them, oldest
/// first. `now` is a parameter so a test can look a week ahead.
pub(crate) async fn forget_finished(
    shared: &Shared,
    keep: Duration,
    now: SystemTime,
) -> Result<Vec<RunId>, RetentionError> {
    let cutoff = now
        .checked_sub(keep)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    let node = shared.node.clone();
    let found = tokio::task::spawn_blocking(move || -> Result<_, arbor_storage::Error> {
        let journal = node.journal();
        let mut due = Vec::new();
        let mut keys = Vec::new();
        for run in journal.runs_started_before(cutoff)? {
            if !run.status.is_terminal() {
                continue;
            }
            let ended_ms = journal.last_event(run.id)?.map_or(0, |e| e.at_ms);
            if ended_ms >= cutoff {
                continue;
            }
            if let Some(key) =
                crate::submission::submission(journal, run.id)?.and_then(|s| s.idempotency_key)
            {
                keys.push(key);
            }
            due.push(run.id);
        }
        for batch in due.chunks(BATCH) {
            node.forget_runs(batch)?;
        }
        Ok((due, keys))
    })
    .await
    .map_err(|e| RetentionError::Panicked(e.to_string()))?;
    let (forgotten, keys) = found?;
    shared.admission.forget_keys(&keys).await;
    if !forgotten.is_empty() {
        tracing::info!(runs = forgotten.len(), ?keep, "forgot finished runs");
    }
    Ok(forgotten)
}

/// Passes every tenth of `keep` (at least a second apart, at most a
/// minute), until the service stops taking work.
pub(crate) async fn keep_finished(shared: Arc<Shared>, keep: Duration) {
    let every = (keep / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        tokio::select! {
            () = shared.stopped.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        if !shared.accepting.load(Ordering::SeqCst) {
            return;
        }
        if let Err(error) = forget_finished(&shared, keep, SystemTime::now()).await {
            tracing::warn!(%error, "a retention pass failed; the next one tries again");
        }
    }
}

/// Removes audit entries older than `keep` (`[retention] keep_audit`),
/// once an hour (sooner for a shorter `keep`), until the drain.
pub(crate) async fn keep_audit(shared: Arc<Shared>, keep: Duration) {
    let every = (keep / 10).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    loop {
        tokio::select! {
            () = shared.stopped.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let journal = shared.node.journal().clone();
        let pass = tokio::task::spawn_blocking(move || {
            crate::audit::forget_before(&journal, keep, SystemTime::now())
        })
        .await;
        match pass {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, "an audit retention pass failed; the next one tries again");
            }
            Err(error) => tracing::warn!(%error, "an audit retention pass panicked"),
        }
    }
}
