//! The storage crate's faults. Expected outcomes (a refused grant, a failed
//! job) are records, never errors: an `Error` here means the journal itself
//! could not do what was asked.

/// What can go wrong opening, writing or reading the journal.
///
/// `Clone` so that one failed flush can answer every commit that waited on it.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("cannot encode a record: {0}")]
    Encode(String),
    /// A stored value that does not decode. Reads fail on it rather than skip
    /// it: a hole in the journal would silently change what recovery rebuilds.
    #[error("undecodable value in tree {tree:?} at key {key_hex}: {error}")]
    Undecodable {
        tree: String,
        key_hex: String,
        error: String,
    },
    /// The journal was written in a format this build does not read. Nothing
    /// was changed: an older journal is read by the release that wrote it.
    #[error(
        "the journal in {dir} is in format {found}, and this build reads format {supported} \
         only; nothing was changed. {}",
        if found < supported {
            "It was written by an earlier arbor: let that release finish or stop its runs, \
             or move the directory aside and start afresh"
        } else {
            "It was written by a newer arbor: run that release on it"
        }
    )]
    FormatVersion {
        dir: String,
        found: u32,
        supported: u32,
    },
    /// The group-commit flusher is gone (it panicked, or the journal is being dropped).
    #[error("the journal's flusher has stopped")]
    Closed,
    /// A record stamped with an earlier boot's epoch (I-41): a late write from
    /// something the restart already failed. The whole append was refused.
    #[error(
        "refused a write from an earlier boot of the node: the record carries epoch \
         {record_epoch}, the journal is at epoch {current}; nothing was written"
    )]
    StaleEpoch { record_epoch: u64, current: u64 },
    /// A record stamped with an epoch no boot has had yet: a bug in the caller,
    /// since nothing can come from a later boot. The whole append was refused.
    #[error(
        "refused a record from epoch {record_epoch}, ahead of the journal's epoch \
         {current}: nothing can come from a later boot; nothing was written"
    )]
    FutureEpoch { record_epoch: u64, current: u64 },
    /// Syncing a file sled wrote failed (`fdatasync`/`fsync`). What the kernel
    /// held for it may be lost, so nothing after it is acknowledged.
    #[error("cannot sync {path} to disk: {error}")]
    Sync { path: String, error: String },
    /// The write-ahead log cannot be read back as written: a damaged frame
    /// before the newest segment's tail, or frames that skip seqs. Says which
    /// segment and where.
    #[error("the journal's write-ahead log is damaged: {0}")]
    Wal(String),
    /// A fault injected through `Journal::faults` (tests only): `"write"` or `"flush"`.
    #[error("injected fault: the journal's {0} failed")]
    Injected(&'static str),
    /// An earlier write or flush failed, so the journal takes no more writes
    /// and acknowledges nothing more until it is reopened. Carries the first
    /// failure.
    #[error("the journal stopped taking writes after a failure: {0}")]
    Failed(String),
    /// The PostgreSQL journal's server refused, failed or could not be
    /// reached; says where (never with the password) and why.
    #[error("PostgreSQL: {0}")]
    Postgres(String),
    /// This node's lease on its runs is gone (a shared journal): nothing of
    /// it is committed any more; says why.
    #[error("fenced: {0}")]
    Fenced(String),
    /// The journal was opened to be read only.
    #[error("the journal was opened read-only; nothing can be written")]
    ReadOnly,
}
