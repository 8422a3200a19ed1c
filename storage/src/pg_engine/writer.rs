//! The writer task: takes what is queued in the overlay, whole appends in
//! seq order, and writes it in one transaction with the node's `seqs` row
//! (`pg_engine.rs`, invariants 1 to 3). Commits that arrive while one
//! transaction is under way are served together by the next.

use super::lease;
use super::progress::Progress;
use super::queue;
use super::schema::{Holder, Sql, db_error, pool_error, successor};
use crate::Error;
use crate::faults::{CrashPoint, Faults};
use crate::overlay::{Entry, Overlay, is_removal};
use deadpool_postgres::Pool;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use tokio::sync::mpsc as tmpsc;
use tokio_postgres::Statement;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

/// At most this many rows go into one transaction, so a backlog is written
/// in steps rather than held as one huge statement.
const WRITE_STEP: usize = 8192;

/// How many written rows leave the overlay in one hold of its lock.
const APPLIED_AT_ONCE: usize = 256;

/// What the writer is asked to do. Before anything, it writes what is queued.
pub(crate) enum Work {
    /// Rows are queued.
    Wake,
    /// Answer once everything queued before this is written.
    Drain(mpsc::Sender<()>),
}

/// A table's rows in one statement: each key's latest seq and value.
type Latest<'a> = HashMap<&'a [u8], (u64, &'a [u8])>;

/// A statement's parameter, owned by its step (or borrowed from the batch).
type Param<'a> = Box<dyn ToSql + Sync + Send + 'a>;

/// One statement of a transaction's pipeline.
struct Step<'a> {
    sends: Sends<'a>,
    /// If this statement raises (`lease.rs`: a division by zero), the
    /// node may not commit: why.
    refused: Option<String>,
}

/// What a step sends.
enum Sends<'a> {
    /// A simple query: BEGIN, COMMIT, a setting.
    Simple(&'static str),
    /// A statement prepared on the connection, with its parameters.
    Prepared(Statement, Vec<Param<'a>>),
}

impl<'a> Step<'a> {
    fn simple(sql: &'static str) -> Step<'a> {
        Step {
            sends: Sends::Simple(sql),
            refused: None,
        }
    }

    fn statement(statement: Statement, params: Vec<Param<'a>>) -> Step<'a> {
        Step {
            sends: Sends::Prepared(statement, params),
            refused: None,
        }
    }

    /// A statement that raises when the node may not commit, saying `why`.
    fn refusable(statement: Statement, params: Vec<Param<'a>>, why: String) -> Step<'a> {
        Step {
            sends: Sends::Prepared(statement, params),
            refused: Some(why),
        }
    }

    /// Sends the step (at the first poll, before any await) and waits for
    /// its answer.
    async fn run(&self, client: &deadpool_postgres::Client) -> Result<(), tokio_postgres::Error> {
        match &self.sends {
            Sends::Simple(sql) => client.batch_execute(sql).await,
            Sends::Prepared(statement, params) => {
                let params: Vec<&(dyn ToSql + Sync)> = params
                    .iter()
                    .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                    .collect();
                client.execute(statement, &params).await.map(|_| ())
            }
        }
    }
}

/// A statement prepared on this connection (a round trip its first time).
async fn prepare(client: &deadpool_postgres::Client, sql: &str) -> Result<Statement, Error> {
    client.prepare_cached(sql).await.map_err(db_error)
}

pub(crate) struct Writer {
    pub(crate) pool: Pool,
    pub(crate) sql: Arc<Sql>,
    pub(crate) holder: Holder,
    /// Told why if a transaction finds the lease gone.
    pub(crate) lost: tokio::sync::watch::Sender<Option<String>>,
    pub(crate) overlay: Arc<Mutex<Overlay>>,
    pub(crate) progress: Arc<Progress>,
    pub(crate) faults: Arc<Faults>,
    /// Transactions begun (the count `Faults::crash_at` names).
    pub(crate) flush: u64,
}

impl Writer {
    /// Until the queue closes (the engine is dropped), then once more.
    pub(crate) async fn run(mut self, mut queue: tmpsc::UnboundedReceiver<Work>) {
        while let Some(first) = queue.recv().await {
            let mut drains = Vec::new();
            for work in std::iter::once(first).chain(std::iter::from_fn(|| queue.try_recv().ok())) {
                if let Work::Drain(done) = work {
                    drains.push(done);
                }
            }
            self.write_queued().await;
            for done in drains {
                let _ = done.send(());
            }
        }
        self.write_queued().await;
    }

    /// Writes what is queued, `WRITE_STEP` rows to a transaction, until the
    /// queue is empty or the journal has failed.
    async fn write_queued(&mut self) {
        loop {
            let queued = self
                .overlay
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .has_queued();
            if !queued || self.progress.failure.get().is_some() {
                return;
            }
            self.flush += 1;
            let faults = Arc::clone(&self.faults);
            // A held flush parks this thread, not the runtime; what is
            // appended meanwhile goes into the same transaction.
            if faults.flushes_held() && !tokio::task::block_in_place(|| faults.wait_while_held()) {
                return; // closing: what was held was never acknowledged
            }
            let (first_seq, appends) = self
                .overlay
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take_queued(WRITE_STEP);
            let batch: Vec<&Entry> = appends.iter().flat_map(|a| a.iter()).collect();
            let last_seq = first_seq + batch.len() as u64 - 1;
            if self.faults.flushes_fail() {
                self.progress
                    .fail_batch("a flush", last_seq, Error::Injected("flush"));
                return;
            }
            self.crash_if_due(CrashPoint::BeforeFlush);
            self.faults.flush_begins(self.flush);
            if self.faults.fence_due(self.flush)
                && let Err(e) = lease::take_away(&self.pool, &self.sql, &self.holder).await
            {
                tracing::warn!("journal: the injected fence did not take: {e}");
            }
            if let Err(e) = self.write(&batch, last_seq).await {
                if let Error::Fenced(why) = &e {
                    self.lost.send_replace(Some(why.clone()));
                }
                self.progress
                    .fail_batch("writing to PostgreSQL", last_seq, e);
                return;
            }
            self.crash_if_due(CrashPoint::AfterFlush);
            for some in batch.chunks(APPLIED_AT_ONCE) {
                self.overlay
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .applied(some, last_seq);
            }
            self.progress.flushes.fetch_add(1, Ordering::AcqRel);
            if !self.faults.syncs_skipped() {
                self.progress.syncs.fetch_add(1, Ordering::AcqRel);
            }
            // The fault log first: a test reads it as what was told, and a
            // commit may return (and the test go on) once the seq is out.
            self.faults.durable(last_seq);
            self.progress.durable.store(last_seq, Ordering::Release);
            self.progress.durable_tx.send_replace(last_seq);
        }
    }

    /// One transaction: the lease's fence, the rows in seq order (a
    /// removal between the rows before it and those after), the runs it
    /// owns or ends, the runs it queues, and the node's last seq. Sent as
    /// one pipeline, BEGIN to COMMIT, once its statements are prepared
    /// (each once a connection): one round trip, not one a statement. A
    /// statement that fails aborts the transaction on the server, which
    /// then ends it at the COMMIT without committing; the fence and the
    /// ownership fail by raising (`lease.rs`), so a node without its lease
    /// commits nothing even though its COMMIT was already sent.
    async fn write(&self, batch: &[&Entry], last_seq: u64) -> Result<(), Error> {
        let client = self.pool.get().await.map_err(pool_error)?;
        let holder = &self.holder;
        let mut steps: Vec<Step<'_>> = vec![Step::simple("BEGIN")];
        if self.faults.syncs_skipped() {
            // A benchmark's baseline: the commit does not wait for the
            // server's WAL flush, as a disk with free syncs would not.
            steps.push(Step::simple("SET LOCAL synchronous_commit = off"));
        }
        // The lease first, held for the whole transaction (`lease.rs`).
        steps.push(Step::refusable(
            prepare(&client, &lease::fence_or_abort_sql(&self.sql)).await?,
            vec![Box::new(holder.node.as_str()), Box::new(holder.epoch)],
            format!(
                "node {:?}'s lease has run out: it commits nothing more",
                holder.node
            ),
        ));
        let mut rows: Vec<(&Entry, u64)> = Vec::new();
        let first_seq = last_seq + 1 - batch.len() as u64;
        for (entry, seq) in batch.iter().zip(first_seq..) {
            if is_removal(&entry.2) {
                self.upsert(&client, &rows, &mut steps).await?;
                rows.clear();
                steps.push(self.remove(&client, entry).await?);
            } else {
                rows.push((entry, seq));
            }
        }
        self.upsert(&client, &rows, &mut steps).await?;
        self.own_runs(&client, batch, &mut steps).await?;
        let submitted: Vec<&[u8]> = batch
            .iter()
            .filter(|(table, _, value)| {
                *table == crate::SUBMISSIONS_TABLE.name && !is_removal(value)
            })
            .map(|(_, key, _)| key.as_slice())
            .collect();
        if !submitted.is_empty() {
            steps.push(Step::statement(
                prepare(&client, &queue::enqueue_sql(&self.sql)).await?,
                vec![Box::new(submitted), Box::new(self.sql.channel.as_str())],
            ));
        }
        let seq = i64::try_from(last_seq).map_err(|_| Error::Postgres("seq past i64".into()))?;
        steps.push(Step::statement(
            prepare(&client, &self.sql.set_seq()).await?,
            vec![Box::new(holder.node.as_str()), Box::new(seq)],
        ));
        steps.push(Step::simple("COMMIT"));
        // Polled in order, each sends its messages at its first poll: the
        // server gets them in this order, back to back.
        let answers = futures::future::join_all(steps.iter().map(|step| step.run(&client))).await;
        for (step, answer) in steps.iter().zip(answers) {
            if let Err(e) = answer {
                // The first failure is the cause; those after it were
                // refused because the transaction had aborted.
                return Err(match (&step.refused, e.code()) {
                    (Some(why), Some(code)) if *code == SqlState::DIVISION_BY_ZERO => {
                        Error::Fenced(why.clone())
                    }
                    _ => db_error(e),
                });
            }
        }
        Ok(())
    }

    /// Each table's rows in one statement, each key once (its latest row:
    /// a statement may not touch one row twice).
    async fn upsert<'a>(
        &self,
        client: &deadpool_postgres::Client,
        rows: &[(&'a Entry, u64)],
        steps: &mut Vec<Step<'a>>,
    ) -> Result<(), Error> {
        let mut by_table: Vec<(&'static str, Latest<'a>)> = Vec::new();
        for ((table, key, value), seq) in rows.iter().map(|(e, s)| (*e, *s)) {
            let at = match by_table.iter().position(|(name, _)| name == table) {
                Some(at) => at,
                None => {
                    by_table.push((table, HashMap::new()));
                    by_table.len() - 1
                }
            };
            by_table[at].1.insert(key, (seq, value));
        }
        for (table, latest) in by_table {
            let mut keys = Vec::with_capacity(latest.len());
            let mut seqs = Vec::with_capacity(latest.len());
            let mut values = Vec::with_capacity(latest.len());
            for (key, (seq, value)) in latest {
                keys.push(key);
                seqs.push(seq as i64);
                values.push(value);
            }
            steps.push(Step::statement(
                prepare(client, &self.sql.upsert(table)).await?,
                vec![Box::new(keys), Box::new(seqs), Box::new(values)],
            ));
        }
        Ok(())
    }

    /// A run's records make it this node's (its first) or mark it ended
    /// (its end); refused if the run is another node's (`lease.rs`).
    async fn own_runs<'a>(
        &self,
        client: &deadpool_postgres::Client,
        batch: &[&'a Entry],
        steps: &mut Vec<Step<'a>>,
    ) -> Result<(), Error> {
        let mut runs: Vec<(&[u8], bool)> = Vec::new();
        for (table, key, value) in batch.iter().copied() {
            if *table != crate::table::RUNS.def.name || is_removal(value) {
                continue;
            }
            let ended = crate::table::RUNS
                .decode(value)
                .map(|run| run.status.is_terminal())
                .unwrap_or(false);
            match runs.iter_mut().find(|(run, _)| *run == key.as_slice()) {
                Some(seen) => seen.1 |= ended,
                None => runs.push((key.as_slice(), ended)),
            }
        }
        if runs.is_empty() {
            return Ok(());
        }
        let own = prepare(client, &lease::own_sql(&self.sql)).await?;
        let holder = &self.holder;
        for (run, ended) in runs {
            steps.push(Step::refusable(
                own.clone(),
                vec![
                    Box::new(run),
                    Box::new(holder.node.clone()),
                    Box::new(holder.epoch),
                    Box::new(ended),
                ],
                format!(
                    "run {} is another node's now: node {:?} commits nothing more of it",
                    crate::codec::hex(run),
                    holder.node
                ),
            ));
        }
        Ok(())
    }

    async fn remove<'a>(
        &self,
        client: &deadpool_postgres::Client,
        (table, prefix, _): &'a Entry,
    ) -> Result<Step<'a>, Error> {
        let upper = successor(prefix);
        let sql = self.sql.range(table, "DELETE", upper.is_some(), "");
        let statement = prepare(client, &sql).await?;
        let mut params: Vec<Param<'a>> = vec![Box::new(prefix.as_slice())];
        if let Some(upper) = upper {
            params.push(Box::new(upper));
        }
        Ok(Step::statement(statement, params))
    }

    /// Fault injection (`Faults::crash_at`): the process dies here. For
    /// this engine a power cut is a kill: what the server committed, it keeps.
    fn crash_if_due(&self, point: CrashPoint) {
        if self.faults.crash_due(self.flush, point).is_some() {
            crate::faults::die();
        }
    }
}
