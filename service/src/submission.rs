//! The admission queue's records: each run submitted to arbord and where it
//! is in the queue, in a journal table of the service's own (storage names
//! the table, `SUBMISSIONS_TABLE`, so that every open can replay it; its
//! records, key and reads are here).

use arbor_protocol::RunId;
use arbor_storage::{Journal, Record, SUBMISSIONS_TABLE, Table};
use serde::{Deserialize, Serialize};

/// A run submitted to the service, and where it is in the admission queue.
/// Written before the submission is acknowledged, so a queued run survives
/// a restart and an idempotency key keeps its run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SubmissionRecord {
    /// The id the run gets when it starts (fixed at submission, so a run
    /// started just before a crash is found again, never started twice).
    pub run: RunId,
    /// Arrival order: the queue is served lowest first.
    pub order: u64,
    /// The resolved `RunSpec`, as JSON.
    pub spec_json: String,
    pub idempotency_key: Option<String>,
    /// Digest of the request body, to tell a retry from another request.
    pub digest: String,
    pub submitted_ms: u64,
    pub state: SubmissionState,
    pub epoch: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SubmissionState {
    /// Waiting for a free slot.
    Queued,
    /// Handed to the node: from here on its `RunRecord` is the truth.
    Started,
    /// Stopped before it started; it never will.
    Cancelled { reason: String },
}

/// The table, keyed by the run's id.
pub static SUBMISSIONS: Table<SubmissionRecord> = Table::bincode(
    SUBMISSIONS_TABLE,
    |s| s.run.0.as_bytes().to_vec(),
    |s| s.epoch,
);

impl SubmissionRecord {
    /// This submission as a journal record.
    pub fn record(&self) -> Result<Record, arbor_storage::Error> {
        SUBMISSIONS.row(self).map(Record::Row)
    }
}

/// Every run submitted to the service, in arrival order.
pub fn submissions(journal: &Journal) -> Result<Vec<SubmissionRecord>, arbor_storage::Error> {
    let mut all = journal.read(&SUBMISSIONS, &[])?;
    all.sort_by_key(|s| s.order);
    Ok(all)
}

/// The submission of `run`, if the service queued it.
pub fn submission(
    journal: &Journal,
    run: RunId,
) -> Result<Option<SubmissionRecord>, arbor_storage::Error> {
    journal.read_one(&SUBMISSIONS, run.0.as_bytes())
}
