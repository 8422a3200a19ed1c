//! The PostgreSQL engine: the journal's rows in tables of a PostgreSQL
//! schema, shared by every node that opens it (docs/cluster.md).
//!
//! Behind a `PgEngine`, a small tokio runtime of its own (callers are sync,
//! and may be on any runtime or none) with a pool of connections for reads
//! and one writer task (`pg_engine/writer.rs`) that owns every write.
//! `append` puts rows in the overlay (`overlay.rs`, readable at once) and
//! wakes the writer, which takes every append queued so far and writes it
//! in one transaction: group commit, as the sled engine's flusher does, with
//! PostgreSQL's commit as the sync. A row is durable once that transaction
//! has committed (the server's `synchronous_commit` decides what that means
//! on its disks; arbor never turns it off).
//!
//! The layout (`pg_engine/schema.rs`): one table per journal table, `key
//! bytea PRIMARY KEY, seq bigint, value bytea`, the record's bytes exactly as
//! the sled engine stores them; `meta` (`format`, `layout`, `epoch`); `seqs`,
//! the last seq each node wrote. bytea compares bytewise, so key order is the
//! journal's key order and a prefix is a range.
//!
//! Invariants:
//! 1. Seq order is write order: one mutex hands out seqs and queues the
//!    rows in the overlay, and the writer takes the queue from its front,
//!    whole appends in seq order, so every transaction carries a run of
//!    seqs after everything it follows.
//! 2. A transaction writes its rows and the node's `seqs` entry together:
//!    after a crash the database holds every append up to some seq, whole,
//!    and no part of a later one.
//! 3. `durable_seq` rises only after the transaction carrying that seq has
//!    committed; a failed transaction fails the journal (engine promise 3).
//! 4. A read takes the overlay's rows (with their seqs) first and the
//!    database's after, and keeps for each key the row with the later seq:
//!    a row the writer moves in between is found in one or the other, and
//!    no lock is held across a round trip to the server.
//! 5. Each open is a new epoch, taken from the `meta` row in one statement,
//!    so two nodes opening at once never share one; the seq goes on from the
//!    highest any node wrote.

mod lease;
mod progress;
mod queue;
mod reads;
mod schema;
mod writer;

use crate::Error;
use crate::engine::{
    Claimed, Counters, Durable, Engine, NodeLease, OwnedRow, Request, Span, Visit, WalkVisit,
};
use crate::faults::Faults;
use crate::overlay::{Entry, Overlay, removal};
use crate::table::{Key, Row, TableDef};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::time::Duration;
use tokio::sync::{mpsc as tmpsc, watch};

use progress::Progress;
pub use schema::{PG_LAYOUT, PgOptions, check_schema_name};

/// The journal's engine on PostgreSQL.
pub struct PgEngine {
    /// `None` only while dropping.
    runtime: Option<tokio::runtime::Runtime>,
    pool: deadpool_postgres::Pool,
    /// The schema's tables, quoted and qualified, and their statements.
    sql: Arc<schema::Sql>,
    /// Where the journal is, for messages: host, port, database, schema
    /// (never the URL, which may carry a password).
    place: String,
    epoch: u64,
    read_only: bool,
    /// The last seq handed out, held for the whole of an append (invariant 1).
    last_seq: Mutex<u64>,
    overlay: Arc<Mutex<Overlay>>,
    progress: Arc<Progress>,
    faults: Arc<Faults>,
    /// The writer's queue; `None` for a read-only journal, and while dropping.
    work: Option<tmpsc::UnboundedSender<writer::Work>>,
    /// This node, this open's epoch and its lease.
    holder: schema::Holder,
    /// Says why once the lease is lost (`lease.rs`).
    lost: watch::Receiver<Option<String>>,
    /// What the node means to do with its lease, for its keeper.
    intent: Arc<lease::Intent>,
    /// Told by the writer as it ends, for the drop to wait on.
    writer_done: Mutex<Option<mpsc::Receiver<()>>>,
    /// Moves on at each notification of the schema's channel: a run
    /// submitted, a request sent or answered, through any node (`queue.rs`).
    woken: watch::Receiver<u64>,
}

impl PgEngine {
    /// Connects (retrying with backoff for `connect_for` while the server
    /// does not answer), makes the schema if it is not there, checks its
    /// format, begins a new epoch and starts the writer.
    pub fn open(options: &PgOptions) -> Result<PgEngine, Error> {
        Self::open_inner(options, false)
    }

    /// Opens the journal to read it: no new epoch, no writer, every write
    /// refused (`Error::ReadOnly`); for `arbor journal verify` and `inspect`.
    pub fn open_read_only(options: &PgOptions) -> Result<PgEngine, Error> {
        Self::open_inner(options, true)
    }

    fn open_inner(options: &PgOptions, read_only: bool) -> Result<PgEngine, Error> {
        let options = options.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("arbor-journal-pg")
            .enable_all()
            .build()
            .map_err(|e| Error::Postgres(format!("cannot start the journal's threads: {e}")))?;
        let opened = run_on(&runtime, async move {
            let opened = schema::open(options, read_only).await?;
            if !read_only {
                lease::register(&opened.pool, &opened.sql, &opened.holder, &opened.place).await?;
            }
            Ok(opened)
        })
        .and_then(|r| r);
        let schema::Opened {
            pool,
            sql,
            place,
            config,
            holder,
            last_seq,
        } = match opened {
            Ok(opened) => opened,
            Err(e) => {
                // Not a blocking drop: the caller may be on a runtime's thread.
                runtime.shutdown_background();
                return Err(e);
            }
        };
        let (durable_tx, _) = watch::channel(last_seq);
        let progress = Arc::new(Progress {
            applied: AtomicU64::new(last_seq),
            durable: AtomicU64::new(last_seq),
            durable_tx,
            flushes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            failure: OnceLock::new(),
            failed_batch: OnceLock::new(),
        });
        let overlay = Arc::new(Mutex::new(Overlay::new()));
        let faults = Arc::new(Faults::for_open());
        let sql = Arc::new(sql);
        let (lost_tx, lost) = watch::channel(None);
        let intent = Arc::new(lease::Intent::default());
        let (woken_tx, woken) = watch::channel(0u64);
        let (work, writer_done) = if read_only {
            (None, None)
        } else {
            runtime.spawn(queue::listen(config.clone(), Arc::clone(&sql), woken_tx));
            runtime.spawn(lease::keep(
                config,
                Arc::clone(&sql),
                holder.clone(),
                Arc::clone(&progress),
                Arc::clone(&faults),
                Arc::clone(&intent),
                lost_tx.clone(),
            ));
            let (work, queue) = tmpsc::unbounded_channel();
            let (done_tx, done) = mpsc::channel();
            let writer = writer::Writer {
                pool: pool.clone(),
                sql: Arc::clone(&sql),
                holder: holder.clone(),
                lost: lost_tx,
                overlay: Arc::clone(&overlay),
                progress: Arc::clone(&progress),
                faults: Arc::clone(&faults),
                flush: 0,
            };
            runtime.spawn(async move {
                writer.run(queue).await;
                let _ = done_tx.send(());
            });
            (Some(work), Some(done))
        };
        Ok(PgEngine {
            runtime: Some(runtime),
            pool,
            sql,
            place,
            epoch: u64::try_from(holder.epoch).unwrap_or(0),
            holder,
            lost,
            intent,
            read_only,
            last_seq: Mutex::new(last_seq),
            overlay,
            progress,
            faults,
            work,
            writer_done: Mutex::new(writer_done),
            woken,
        })
    }

    /// Ends the lease of node `node` now (an operator who knows it is dead,
    /// or a test that killed it): its runs can be taken at once. Safe on a
    /// live node too: it is fenced at its next commit, after any commit in
    /// flight, and stops. Says whether the id held a lease.
    pub fn expire(options: &PgOptions, node: &str) -> Result<bool, Error> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Postgres(format!("cannot start a thread: {e}")))?;
        let (options, node) = (options.clone(), node.to_string());
        // Its own thread: the caller may be on a runtime's.
        std::thread::spawn(move || {
            runtime.block_on(async move { schema::expire(&options, &node).await })
        })
        .join()
        .map_err(|_| Error::Closed)?
    }

    /// Where the journal is: host, port, database and schema.
    pub fn place(&self) -> &str {
        &self.place
    }

    /// Takes seqs for `entries`, puts them in the overlay (readable at once)
    /// and wakes the writer (invariant 1).
    fn append_entries(
        &self,
        entries: impl ExactSizeIterator<Item = (&'static str, Key, Arc<[u8]>)>,
    ) -> Result<u64, Error> {
        let mut last_seq = self.last_seq.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(refusal) = self.refusal() {
            return Err(refusal);
        }
        if entries.len() == 0 {
            return Ok(*last_seq);
        }
        if self.faults.writes_fail() {
            return Err(self.progress.fail("a write", Error::Injected("write")));
        }
        let first_seq = *last_seq + 1;
        let entries: Vec<Entry> = entries
            .zip(first_seq..)
            .map(|((table, key, value), seq)| (table, key.at(seq), value))
            .collect();
        let seq = first_seq + entries.len() as u64 - 1;
        let wake = self
            .overlay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(first_seq, entries.into());
        if wake {
            let work = self.work.as_ref().ok_or(Error::Closed)?;
            work.send(writer::Work::Wake)
                .map_err(|_| self.progress.fail("a write", Error::Closed))?;
        }
        *last_seq = seq;
        self.progress.applied.store(seq, Ordering::Release);
        Ok(seq)
    }

    /// Ends this node's lease now, once (a clean close), unless it is lost
    /// already or the journal was opened to read.
    fn release(&self) {
        if self.read_only
            || self.lost.borrow().is_some()
            || self.intent.released.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let Some(runtime) = &self.runtime else { return };
        let (pool, sql, holder) = (
            self.pool.clone(),
            Arc::clone(&self.sql),
            self.holder.clone(),
        );
        let released = run_on(runtime, async move {
            lease::release(&pool, &sql, &holder).await
        });
        if let Ok(Err(e)) = released {
            tracing::warn!("journal: the node's lease was not released at its close: {e}");
        }
    }

    /// Takes seqs above `seq` from now on: what this node appends to a run
    /// it took over must sort after what the run's last owner wrote (a
    /// ledger's keys end with the seq). Everything appended before is
    /// written first, so the jump never falls inside a transaction.
    fn go_on_above(&self, seq: u64) {
        let mut last_seq = self.last_seq.lock().unwrap_or_else(PoisonError::into_inner);
        if *last_seq >= seq {
            return;
        }
        // No append can come in meanwhile: they wait for the seq lock.
        self.drain();
        let written = self.progress.durable.load(Ordering::Acquire) == *last_seq;
        *last_seq = seq;
        self.progress.applied.store(seq, Ordering::Release);
        // Nothing lies between the last seq written and `seq`; unless a
        // write failed, and then nothing more is ever durable.
        if written {
            self.progress.durable.store(seq, Ordering::Release);
            self.progress.durable_tx.send_replace(seq);
        }
    }

    /// Waits until the writer has written everything appended so far (for
    /// the passes that read the tables whole, and around a removal).
    fn drain(&self) {
        let Some(work) = &self.work else { return };
        let (done, wait) = mpsc::channel();
        if work.send(writer::Work::Drain(done)).is_ok() {
            let _ = wait.recv();
        }
    }

    /// Runs `future` on the engine's runtime and waits for it here: callers
    /// are sync, and may be on another runtime's thread.
    fn block<T: Send + 'static>(
        &self,
        future: impl Future<Output = Result<T, Error>> + Send + 'static,
    ) -> Result<T, Error> {
        let runtime = self.runtime.as_ref().ok_or(Error::Closed)?;
        run_on(runtime, future)?
    }
}

/// Spawns `future` on `runtime` and waits for its answer on this thread
/// (a std channel: tokio's own blocking waits refuse a runtime's thread).
fn run_on<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    future: impl Future<Output = T> + Send + 'static,
) -> Result<T, Error> {
    let (reply, answer) = mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = reply.send(future.await);
    });
    answer.recv().map_err(|_| Error::Closed)
}

/// A PostgreSQL advisory lock held on a connection of the pool; dropping
/// it unlocks, on the engine's runtime, before the connection goes back.
/// Should the process die, the server ends the session and the lock.
struct AdvisoryLock {
    client: Option<deadpool_postgres::Object>,
    key: String,
    runtime: tokio::runtime::Handle,
}

impl Drop for AdvisoryLock {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        let key = std::mem::take(&mut self.key);
        self.runtime.spawn(async move {
            if let Err(error) = client
                .execute(
                    "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
                    &[&key],
                )
                .await
            {
                // The session keeps it: drop the connection rather than
                // hand a locked one back to the pool.
                tracing::warn!(%error, "could not unlock an advisory lock");
                let _ = deadpool_postgres::Object::take(client);
            }
        });
    }
}

impl Engine for PgEngine {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn exclusive(&self, key: &str) -> Result<Option<Box<dyn std::any::Any + Send>>, Error> {
        let runtime = self.runtime.as_ref().ok_or(Error::Closed)?.handle().clone();
        let pool = self.pool.clone();
        // Namespaced by the journal's schema: one server may hold several.
        let key = format!("{}:{key}", self.sql.meta);
        let locked = key.clone();
        let client = self.block(async move {
            let client = pool.get().await.map_err(schema::pool_error)?;
            client
                .execute(
                    "SELECT pg_advisory_lock(hashtextextended($1, 0))",
                    &[&locked],
                )
                .await
                .map_err(schema::db_error)?;
            Ok(client)
        })?;
        Ok(Some(Box::new(AdvisoryLock {
            client: Some(client),
            key,
            runtime,
        })))
    }

    fn refusal(&self) -> Option<Error> {
        crate::engine::refusal(self.read_only, self.progress.failure.get())
    }

    fn append(&self, rows: Vec<Row>) -> Result<u64, Error> {
        self.append_entries(
            rows.into_iter()
                .map(|row| (row.table.name, row.key, row.value)),
        )
    }

    fn wait_durable(&self, seq: u64) -> Durable<'_> {
        Box::pin(async move {
            // Subscribed before the first look, so no change is missed.
            let mut durable = self.progress.durable_tx.subscribe();
            loop {
                if let Some(outcome) = self.progress.outcome(seq) {
                    return outcome;
                }
                if durable.changed().await.is_err() {
                    return Err(Error::Closed);
                }
            }
        })
    }

    fn applied_seq(&self) -> u64 {
        self.progress.applied.load(Ordering::Acquire)
    }

    fn durable_seq(&self) -> u64 {
        self.progress.durable.load(Ordering::Acquire)
    }

    fn failed(&self) -> Option<String> {
        self.progress.failure.get().cloned()
    }

    fn get(&self, table: &'static TableDef, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.read_one(table, key)
    }

    fn scan(
        &self,
        table: &'static TableDef,
        span: Span<'_>,
        visit: &mut Visit<'_>,
    ) -> Result<(), Error> {
        let rows = match span {
            Span::Prefix(prefix) => self.read_prefix(table, prefix)?,
            Span::Below(bound) => {
                self.drain();
                self.read_range(table, None, Some(bound.to_vec()))?
            }
        };
        for (key, value) in &rows {
            visit(key, value)?;
        }
        Ok(())
    }

    fn last(&self, table: &'static TableDef, prefix: &[u8]) -> Result<Option<OwnedRow>, Error> {
        self.read_last(table, prefix)
    }

    fn remove(&self, prefixes: Vec<(&'static TableDef, Vec<u8>)>) -> Result<u64, Error> {
        // As the sled engine: everything appended before the removal is
        // written first, and the removal itself before this returns, so no
        // read finds the rows once it has.
        self.drain();
        let entries = prefixes
            .into_iter()
            .map(|(table, prefix)| (table.name, Key::Whole(prefix), removal()));
        let seq = self.append_entries(entries)?;
        self.drain();
        Ok(seq)
    }

    fn walk(&self, table: &'static TableDef, visit: &mut WalkVisit<'_>) -> Result<(), Error> {
        self.drain();
        for (key, value) in self.read_range(table, None, None)? {
            visit(&key, Ok(&value));
        }
        Ok(())
    }

    fn check_own(&self) -> Result<Vec<(String, String, String)>, Error> {
        let sql = Arc::clone(&self.sql);
        let pool = self.pool.clone();
        self.block(async move { schema::check_meta(&pool, &sql).await })
    }

    fn counters(&self) -> Counters {
        let flushes = self.progress.flushes.load(Ordering::Acquire);
        Counters {
            flushes,
            syncs: self.progress.syncs.load(Ordering::Acquire),
            checkpoints: 0,
        }
    }

    fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The process ends without dropping the journal (`arbor run`): what
    /// is queued is written, and the lease ends as at a drop, so the node's
    /// id opens again at once.
    fn flush_store(&self) -> Result<(), Error> {
        self.drain();
        self.release();
        Ok(())
    }

    fn lost(&self) -> Option<watch::Receiver<Option<String>>> {
        Some(self.lost.clone())
    }

    fn owner(&self, key: &[u8]) -> Result<Option<(String, u64)>, Error> {
        let (pool, sql, key) = (self.pool.clone(), Arc::clone(&self.sql), key.to_vec());
        self.block(async move { lease::owner(&pool, &sql, key).await })
    }

    fn nodes(&self) -> Result<Option<Vec<NodeLease>>, Error> {
        let (pool, sql) = (self.pool.clone(), Arc::clone(&self.sql));
        self.block(async move { lease::nodes(&pool, &sql).await })
            .map(Some)
    }

    fn claim_orphans(&self, wait: bool) -> Result<Option<Vec<Claimed>>, Error> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let (pool, sql, holder, faults) = (
            self.pool.clone(),
            Arc::clone(&self.sql),
            self.holder.clone(),
            Arc::clone(&self.faults),
        );
        let (claimed, last_seq) =
            self.block(
                async move { lease::claim_orphans(&pool, &sql, &holder, wait, &faults).await },
            )?;
        if !claimed.is_empty() {
            self.go_on_above(last_seq);
        }
        Ok(Some(claimed))
    }

    fn settle(&self, runs: &[Vec<u8>]) -> Result<(), Error> {
        if let Some(refused) = self.refusal() {
            return Err(refused);
        }
        let (pool, sql, holder) = (
            self.pool.clone(),
            Arc::clone(&self.sql),
            self.holder.clone(),
        );
        let runs = runs.to_vec();
        self.block(async move { lease::settle(&pool, &sql, &holder, &runs).await })
    }

    fn claim_queued(
        &self,
        limit: usize,
        only: Option<&[u8]>,
    ) -> Result<Option<Vec<Claimed>>, Error> {
        if let Some(refused) = self.refusal() {
            return Err(refused);
        }
        let (pool, sql, holder) = (
            self.pool.clone(),
            Arc::clone(&self.sql),
            self.holder.clone(),
        );
        let only = only.map(<[u8]>::to_vec);
        self.block(async move { queue::claim(&pool, &sql, &holder, limit, only).await })
            .map(Some)
    }

    fn queued(&self) -> Result<Option<Vec<Vec<u8>>>, Error> {
        let (pool, sql) = (self.pool.clone(), Arc::clone(&self.sql));
        self.block(async move { queue::queued(&pool, &sql).await })
            .map(Some)
    }

    /// Writes what is queued, then takes no more writes, keeping the lease
    /// for the node to stop its runs; `flush_store` then ends it.
    fn hand_over(&self) -> bool {
        if self.read_only || self.refusal().is_some() {
            return false;
        }
        self.drain();
        self.intent.handing_over.store(true, Ordering::Release);
        self.progress.fail(
            "handing its runs to the other nodes",
            Error::Fenced(format!(
                "node {:?} drains: its runs go to the other nodes, and it commits nothing more",
                self.holder.node
            )),
        );
        true
    }

    fn ask_drain(&self, node: &str) -> Result<Option<bool>, Error> {
        if self.read_only {
            return Err(Error::ReadOnly);
        }
        let (pool, sql, node) = (self.pool.clone(), Arc::clone(&self.sql), node.to_string());
        self.block(async move { lease::ask_drain(&pool, &sql, node).await })
            .map(Some)
    }

    fn drain_asked(&self) -> Option<watch::Receiver<bool>> {
        Some(self.intent.drain.subscribe())
    }

    fn node_id(&self) -> Option<String> {
        Some(self.holder.node.clone())
    }

    fn woken(&self) -> Option<watch::Receiver<u64>> {
        Some(self.woken.clone())
    }

    fn send_request(&self, run: &[u8], body: Vec<u8>) -> Result<Option<i64>, Error> {
        if let Some(refused) = self.refusal() {
            return Err(refused);
        }
        let (pool, sql, run) = (self.pool.clone(), Arc::clone(&self.sql), run.to_vec());
        self.block(async move { queue::send_request(&pool, &sql, run, body).await })
            .map(Some)
    }

    fn take_requests(&self) -> Result<Option<Vec<Request>>, Error> {
        let (pool, sql, holder) = (
            self.pool.clone(),
            Arc::clone(&self.sql),
            self.holder.clone(),
        );
        self.block(async move { queue::take_requests(&pool, &sql, &holder).await })
            .map(Some)
    }

    fn answer_request(&self, id: i64, answer: Vec<u8>) -> Result<(), Error> {
        let (pool, sql) = (self.pool.clone(), Arc::clone(&self.sql));
        self.block(async move { queue::answer_request(&pool, &sql, id, answer).await })
    }

    fn request_answer(&self, id: i64) -> Result<Option<Vec<u8>>, Error> {
        let (pool, sql) = (self.pool.clone(), Arc::clone(&self.sql));
        self.block(async move { queue::request_answer(&pool, &sql, id).await })
    }
}

/// How long a drop waits for the writer to write what is queued.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

impl Drop for PgEngine {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it has written what is
        // queued; a parked (held) writer is woken for good first.
        self.faults.close();
        drop(self.work.take());
        let done = self
            .writer_done
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(done) = done
            && done.recv_timeout(CLOSE_WAIT).is_err()
        {
            tracing::warn!(
                "journal: the PostgreSQL writer did not finish within {CLOSE_WAIT:?}; \
                 what it had not committed was never acknowledged"
            );
        }
        // The lease ends with a clean close: the id can open again at once,
        // and what runs are left are another node's to take.
        self.release();
        // Not a blocking shutdown: the drop may be on another runtime's thread.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
