//! The storage crate's faults. Expected outcomes (a refused grant, a failed
//! job) are records, never errors: an `Error` here means the journal itself
//! could not do what was asked.

/// What can go wrong opening, writing or reading the journal.
#[derive(Debug, thiserror::Error)]
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
    #[error(
        "journal format version {found} is not supported (this build reads version {supported})"
    )]
    FormatVersion { found: u32, supported: u32 },
    /// The group-commit flusher is gone (it panicked, or the journal is being dropped).
    #[error("the journal's flusher has stopped")]
    Closed,
}
