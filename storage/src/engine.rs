//! The interface a journal's storage implements. `Journal` (journal.rs) is
//! written once over it: records, keys and epochs, typed reads, `scan`,
//! `verify` and `forget`; an engine stores bytes under keys in tables and
//! makes them durable. sled behind a write-ahead log is the one engine today
//! (`sled_engine.rs`); a second backend is a second implementation of this
//! trait, not a flag threaded through the callers.
//!
//! What every engine promises (the journal's invariants rest on them):
//! 1. `append` gives its rows consecutive seqs after every seq handed out
//!    before, across reopens too, and is atomic: all its rows or none, and a
//!    reader who sees seq N sees everything below it.
//! 2. Appended rows are readable at once; they are durable (survive a crash
//!    of the process, the kernel or the power) once `durable_seq` reaches
//!    their seq, which `wait_durable` awaits.
//! 3. After the first failed write or sync, every later append fails with
//!    `Error::Failed` naming it, and nothing more is acknowledged.
//! 4. Each open is a new epoch, durable before the open returns.
//! 5. Reads and scans hand out one row at a time, in key order, whatever the
//!    engine packs together on disk; a stored value that cannot be unpacked
//!    is `Error::Undecodable`, never skipped.

use crate::table::{Row, TableDef};
use crate::{Error, Faults};
use std::future::Future;
use std::pin::Pin;

/// Where a scan reads.
#[derive(Clone, Copy, Debug)]
pub enum Span<'a> {
    /// Every key that starts with these bytes (all of them, if empty).
    Prefix(&'a [u8]),
    /// Every key below these bytes.
    Below(&'a [u8]),
}

/// Called with each row's key and value; an error ends the scan.
pub type Visit<'v> = dyn FnMut(&[u8], &[u8]) -> Result<(), Error> + 'v;

/// Called by `walk` with each stored row, or with the stored entry that
/// could not be unpacked into rows and why.
pub type WalkVisit<'v> = dyn FnMut(&[u8], Result<&[u8], String>) + 'v;

/// A run taken over (`Engine::claim_orphans`): its key (the run's id) and
/// its new run epoch.
pub type Claimed = (Vec<u8>, u64);

/// A request sent to a run's owner: (its id, the run's key, its body).
pub type Request = (i64, Vec<u8>, Vec<u8>);

/// A node of a shared journal, as `Engine::nodes` reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLease {
    pub id: String,
    /// The epoch of the node's open that holds the id now.
    pub epoch: u64,
    /// How long its lease runs on, by the database's clock (ms; 0 once run out).
    pub lease_left_ms: u64,
    /// The runs it owns that have not ended: each one's key and run epoch.
    pub runs: Vec<Claimed>,
}

/// A row's key and value, copied out of the store.
pub type OwnedRow = (Vec<u8>, Vec<u8>);

/// What an engine has done, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Log writes that made something durable, each with its sync.
    pub flushes: u64,
    /// Syncs of the log by its writer (one per flush that synced).
    pub syncs: u64,
    /// Checkpoints completed (the engine's own housekeeping).
    pub checkpoints: u64,
}

/// `Engine::refusal` for an engine opened `read_only` whose first failure,
/// if any, is `failure` (promise 3).
pub(crate) fn refusal(read_only: bool, failure: Option<&String>) -> Option<Error> {
    if read_only {
        return Some(Error::ReadOnly);
    }
    failure.map(|first| Error::Failed(first.clone()))
}

/// The future `wait_durable` returns.
pub type Durable<'a> = Pin<Box<dyn Future<Output = Result<(), Error>> + Send + 'a>>;

pub trait Engine: Send + Sync + 'static {
    /// This open's epoch (promise 4).
    fn epoch(&self) -> u64;

    /// Why every append is refused now, if one is: the journal was opened
    /// read-only, or has failed (promise 3).
    fn refusal(&self) -> Option<Error>;

    /// Gives `rows` the next seqs, in order, and applies them (promise 1);
    /// returns the last seq. An empty list returns the last seq handed out.
    fn append(&self, rows: Vec<Row>) -> Result<u64, Error>;

    /// Resolves once `durable_seq() >= seq` (promise 2).
    fn wait_durable(&self, seq: u64) -> Durable<'_>;

    /// The last seq applied (readable); it never goes back, reopens included.
    fn applied_seq(&self) -> u64;

    /// The last seq made durable.
    fn durable_seq(&self) -> u64;

    /// The first write or sync that failed, if one has (promise 3).
    fn failed(&self) -> Option<String>;

    /// The value under `key`.
    fn get(&self, table: &'static TableDef, key: &[u8]) -> Result<Option<Vec<u8>>, Error>;

    /// Each row of `span`, in key order (promise 5).
    fn scan(
        &self,
        table: &'static TableDef,
        span: Span<'_>,
        visit: &mut Visit<'_>,
    ) -> Result<(), Error>;

    /// The last row under `prefix`, without reading the rows before it.
    fn last(&self, table: &'static TableDef, prefix: &[u8]) -> Result<Option<OwnedRow>, Error>;

    /// Removes every row under each prefix, in one append after everything
    /// appended before it; returns its seq. Once it returns, no read finds
    /// the rows. A row appended under a prefix after this call stays.
    fn remove(&self, prefixes: Vec<(&'static TableDef, Vec<u8>)>) -> Result<u64, Error>;

    /// Every stored row of `table` (for `scan` and `verify`), after every
    /// append so far has reached the store.
    fn walk(&self, table: &'static TableDef, visit: &mut WalkVisit<'_>) -> Result<(), Error>;

    /// The engine's own entries (its format, epoch, seq) that are not as
    /// they must be, as (what, key in hex, why).
    fn check_own(&self) -> Result<Vec<(String, String, String)>, Error>;

    fn counters(&self) -> Counters;

    /// The faults a test can inject (all off unless switched on).
    fn faults(&self) -> &Faults;

    /// At the close, leave to the engine's log what its store has not taken
    /// yet, for the next open (a node's shutdown: its process then ends
    /// without waiting for the store). Engines without a log ignore it.
    fn leave_unapplied_at_close(&self) {}

    /// A shared journal's: resolves to why once this node has lost its
    /// lease (it commits nothing more, and must stop its runs). `None` for
    /// a journal that is the node's alone.
    fn lost(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        None
    }

    /// A shared journal's: takes the runs whose owner's lease has run out
    /// (or whose owner opened again since), each with its new run epoch,
    /// for this node to recover and go on with. `wait`: wait for rows
    /// locked by a transaction in flight rather than leave them for the
    /// next try. `None`: the journal is the node's alone, and every run in
    /// it is its.
    fn claim_orphans(&self, _wait: bool) -> Result<Option<Vec<Claimed>>, Error> {
        Ok(None)
    }

    /// A shared journal's: marks ended runs this node claimed settled, once
    /// what a crash may have taken of their end has been told again and
    /// flushed; until then any later claimer takes them again. Nothing for
    /// a journal that is the node's alone.
    fn settle(&self, _runs: &[Vec<u8>]) -> Result<(), Error> {
        Ok(())
    }

    /// A shared journal's admission queue: takes up to `limit` queued runs
    /// (only `only`, if given), oldest first, each with its run epoch, for
    /// this node to start. `None`: the journal is the node's alone, and so
    /// is its queue.
    fn claim_queued(
        &self,
        _limit: usize,
        _only: Option<&[u8]>,
    ) -> Result<Option<Vec<Claimed>>, Error> {
        Ok(None)
    }

    /// A shared journal's queued runs, oldest first. `None`: the journal
    /// is the node's alone.
    fn queued(&self) -> Result<Option<Vec<Vec<u8>>>, Error> {
        Ok(None)
    }

    /// A shared journal's, as its node drains: writes what is queued, then
    /// refuses every write, so that the runs the node stops next are left
    /// as a crash leaves them, for another node to take and resume; the
    /// lease stays the node's until `flush_store` or the close ends it.
    /// `false`: nothing done (the journal is the node's alone).
    fn hand_over(&self) -> bool {
        false
    }

    /// A shared journal's: asks node `node` to drain (it learns it at its
    /// next renewal). `Some(false)`: no node of that id. `None`: the
    /// journal is the node's alone.
    fn ask_drain(&self, _node: &str) -> Result<Option<bool>, Error> {
        Ok(None)
    }

    /// A shared journal's: turns true once this node is asked to drain.
    fn drain_asked(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        None
    }

    /// A shared journal's: takes the lock every node of it takes in turn
    /// for `key`, held until the value returned is dropped. `None`: the
    /// journal is the node's alone (its own locks suffice).
    fn exclusive(&self, _key: &str) -> Result<Option<Box<dyn std::any::Any + Send>>, Error> {
        Ok(None)
    }

    /// A shared journal's: this node's id in it.
    fn node_id(&self) -> Option<String> {
        None
    }

    /// A shared journal's: moves on when a run is submitted, or a request
    /// sent or answered, through any node.
    fn woken(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// A shared journal's: sends a request (an API call's, `body`) to the
    /// node that owns `run`; its id. `None`: the journal is the node's alone.
    fn send_request(&self, _run: &[u8], _body: Vec<u8>) -> Result<Option<i64>, Error> {
        Ok(None)
    }

    /// A shared journal's: the requests not yet answered for runs this node
    /// owns, oldest first.
    fn take_requests(&self) -> Result<Option<Vec<Request>>, Error> {
        Ok(None)
    }

    /// Records the answer to request `id`, and tells its sender.
    fn answer_request(&self, _id: i64, _answer: Vec<u8>) -> Result<(), Error> {
        Ok(())
    }

    /// The answer to request `id`, once there is one.
    fn request_answer(&self, _id: i64) -> Result<Option<Vec<u8>>, Error> {
        Ok(None)
    }

    /// A shared journal's: which node owns the run under `key`, at which
    /// run epoch. `None`: the journal is the node's alone.
    fn owner(&self, _key: &[u8]) -> Result<Option<(String, u64)>, Error> {
        Ok(None)
    }

    /// A shared journal's nodes and the runs each owns. `None`: the
    /// journal is the node's alone.
    fn nodes(&self) -> Result<Option<Vec<NodeLease>>, Error> {
        Ok(None)
    }

    /// Writes the store's own buffers out, for a process that ends without
    /// closing the journal. Engines without buffers of their own ignore it.
    fn flush_store(&self) -> Result<(), Error> {
        Ok(())
    }
}
