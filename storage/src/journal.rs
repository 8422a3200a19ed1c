//! The journal handle every caller holds: records in, records out, over an
//! `Engine` (engine.rs) that stores their bytes. Everything that is the same
//! for every engine is here, once: a record's table, key and encoding
//! (table.rs), the epoch check (I-41), group commit's wait, typed reads,
//! `scan`, `verify` and `forget`.
//!
//! Invariants (beside the engine's, engine.rs):
//! 1. An append whose records carry any epoch but this open's is refused
//!    whole, before anything is written (I-41).
//! 2. A record that cannot be encoded refuses its whole append.
//! 3. `commit` returns only once a flush covers its records (I-29).
//! 4. A read fails on a stored value that does not decode, naming its table
//!    and key; `scan` and `verify` list every such value (I-35).

use crate::Error;
use crate::codec;
use crate::engine::{Counters, Engine, Span};
use crate::faults::Faults;
use crate::pg_engine::{PgEngine, PgOptions};
use crate::record::{
    ApprovalRecord, DelegationRecord, JobRecord, LedgerRecord, RunRecord, SandboxRecord,
    SandboxState, SteerRecord, TapeRecord,
};
use crate::sled_engine::SledEngine;
use crate::table::{
    self, AnyTable, JOURNAL_TABLES, JournalTable, Key, KeyedBy, Row, Table, TableDef,
};
use crate::verify::{self, VerifyReport};
use arbor_protocol::{CardId, Event, JobId, ParentRef, RunId};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// A handle on the journal; clone it freely.
#[derive(Clone)]
pub struct Journal {
    engine: Arc<dyn Engine>,
    commit_observer: Arc<OnceLock<CommitObserver>>,
}

type CommitObserver = Box<dyn Fn(std::time::Duration) + Send + Sync>;

/// A handle that does not keep its journal open (`Journal::downgrade`): a
/// cache beside the node (a provider's shared rate windows) holds one, so a
/// node that stops lets its journal go (and a shared journal's lease).
#[derive(Clone)]
pub struct WeakJournal {
    engine: std::sync::Weak<dyn Engine>,
    commit_observer: Arc<OnceLock<CommitObserver>>,
}

impl WeakJournal {
    /// The journal, while it is open.
    pub fn upgrade(&self) -> Option<Journal> {
        Some(Journal {
            engine: self.engine.upgrade()?,
            commit_observer: self.commit_observer.clone(),
        })
    }
}

/// A lock of a shared journal's (`Journal::exclusive`), released on drop.
pub struct Exclusive {
    _held: Option<Box<dyn std::any::Any + Send>>,
}

/// Everything the journal stores, as handed to `Journal::append`.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Run(RunRecord),
    Job(JobRecord),
    Ledger(LedgerRecord),
    Delegation(DelegationRecord),
    Steer(SteerRecord),
    Event(Event),
    /// An event whose value the emitter encoded already (`EncodedEvent`).
    EncodedEvent(codec::EncodedEvent),
    Sandbox(SandboxRecord),
    Approval(ApprovalRecord),
    Tape(TapeRecord),
    /// A row of a table whose records another crate defines (`Table::row`).
    Row(Row),
}

impl Record {
    /// The boot epoch the record was written in; `None` for events, which
    /// carry no epoch (their run's records do).
    pub fn epoch(&self) -> Option<u64> {
        match self {
            Record::Run(run) => Some(run.epoch),
            Record::Job(job) => Some(job.epoch),
            Record::Ledger(entry) => Some(entry.epoch),
            Record::Delegation(delegation) => Some(delegation.epoch),
            Record::Steer(steer) => Some(steer.epoch),
            Record::Event(_) | Record::EncodedEvent(_) => None,
            Record::Sandbox(sandbox) => Some(sandbox.epoch),
            Record::Approval(card) => Some(card.epoch),
            Record::Tape(entry) => Some(entry.epoch),
            Record::Row(row) => row.epoch,
        }
    }
}

/// What `Journal::scan` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Records that decoded and sit under the key their content implies.
    pub records: u64,
    /// Everything else, the engine's own entries included.
    pub undecodable: Vec<Undecodable>,
}

/// One stored entry that does not decode, named by table and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undecodable {
    pub tree: String,
    pub key_hex: String,
    pub error: String,
}

/// Records encoded for an append (`Journal::prepare`), and why the append
/// must be refused, if something found that.
pub struct Prepared {
    rows: Vec<Row>,
    epochs: Option<Error>,
    unencoded: Option<Error>,
}

impl Prepared {
    /// `more` after these, in one append.
    pub fn extend(&mut self, more: Prepared) {
        self.rows.extend(more.rows);
        if self.epochs.is_none() {
            self.epochs = more.epochs;
        }
        if self.unencoded.is_none() {
            self.unencoded = more.unencoded;
        }
    }
}

impl Journal {
    /// Opens (creating) the journal at `dir` on sled and its write-ahead
    /// log: checks the format, begins a new epoch, replays the log.
    pub fn open(dir: &Path) -> Result<Journal, Error> {
        Ok(Journal::new(Arc::new(SledEngine::open(dir)?)))
    }

    /// Opens the journal to read it: no new epoch, and every write refused
    /// (`Error::ReadOnly`). For `arbor journal verify` and `inspect`.
    pub fn open_read_only(dir: &Path) -> Result<Journal, Error> {
        Ok(Journal::new(Arc::new(SledEngine::open_read_only(dir)?)))
    }

    /// Opens (creating) the journal in a PostgreSQL schema (`PgEngine`):
    /// checks the format, begins a new epoch.
    pub fn open_postgres(options: &PgOptions) -> Result<Journal, Error> {
        Ok(Journal::new(Arc::new(PgEngine::open(options)?)))
    }

    /// As `open_read_only`, for a journal in PostgreSQL.
    pub fn open_postgres_read_only(options: &PgOptions) -> Result<Journal, Error> {
        Ok(Journal::new(Arc::new(PgEngine::open_read_only(options)?)))
    }

    /// A shared journal's: resolves to why once this node has lost its
    /// lease; it then commits nothing more, and must stop its runs. `None`
    /// for a journal that is the node's alone (sled).
    pub fn lease_lost(&self) -> Option<tokio::sync::watch::Receiver<Option<String>>> {
        self.engine.lost()
    }

    /// A shared journal's: takes the runs whose owner's lease has run out
    /// (or whose owner has opened again since), with each one's new run
    /// epoch, for this node to recover (I-51). `wait`: wait out rows a
    /// transaction in flight holds (a start, which must find every run it
    /// is to recover) rather than leave them for the next try. `None`:
    /// every run in the journal is this node's (sled).
    pub fn claim_orphans(&self, wait: bool) -> Result<Option<Vec<(RunId, u64)>>, Error> {
        claimed_runs(self.engine.claim_orphans(wait)?)
    }

    /// A shared journal's: the ended runs among those this node claimed are
    /// settled (no claimer takes them again), once their ends have been told
    /// again and flushed. A claimer that dies before leaves them to the next.
    pub fn settle(&self, runs: &[RunId]) -> Result<(), Error> {
        let keys: Vec<Vec<u8>> = runs.iter().map(|r| r.0.into_bytes().to_vec()).collect();
        self.engine.settle(&keys)
    }

    /// A shared journal's admission queue: takes up to `limit` queued runs
    /// (only `only`, if given), oldest first, each at its new run epoch,
    /// for this node to start; a run is claimed once per epoch, whichever
    /// nodes ask at once. `None`: the queue is the node's own (sled).
    pub fn claim_queued(
        &self,
        limit: usize,
        only: Option<RunId>,
    ) -> Result<Option<Vec<(RunId, u64)>>, Error> {
        let only = only.map(|run| run.0.into_bytes());
        claimed_runs(
            self.engine
                .claim_queued(limit, only.as_ref().map(|b| &b[..]))?,
        )
    }

    /// A shared journal's queued runs, oldest first. `None`: the queue is
    /// the node's own (sled).
    pub fn queued_runs(&self) -> Result<Option<Vec<RunId>>, Error> {
        let Some(queued) = self.engine.queued()? else {
            return Ok(None);
        };
        queued
            .iter()
            .map(|key| run_id(key))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Whether other nodes share this journal (PostgreSQL): its runs may be
    /// another node's, their events written there.
    pub fn is_shared(&self) -> bool {
        self.engine.lost().is_some()
    }

    /// See `Engine::ask_drain`.
    pub fn ask_drain(&self, node: &str) -> Result<Option<bool>, Error> {
        self.engine.ask_drain(node)
    }

    /// See `Engine::drain_asked`.
    pub fn drain_asked(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.engine.drain_asked()
    }

    /// A shared journal's: this node's id in it. `None`: the journal is
    /// the node's alone.
    pub fn node_id(&self) -> Option<String> {
        self.engine.node_id()
    }

    /// A shared journal's: moves on when a run is submitted, or a request
    /// sent or answered, through any node (a notification may be lost with
    /// a connection: look by the clock too).
    pub fn woken(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.engine.woken()
    }

    /// A shared journal's: sends a request (an API call's, `body`) to the
    /// node that owns `run`, which answers it (`take_requests`); its id.
    /// `None`: the journal is the node's alone.
    pub fn send_request(&self, run: RunId, body: Vec<u8>) -> Result<Option<i64>, Error> {
        self.engine.send_request(run.0.as_bytes(), body)
    }

    /// A shared journal's: the requests not yet answered for runs this node
    /// owns, oldest first: (id, run, body).
    pub fn take_requests(&self) -> Result<Vec<(i64, RunId, Vec<u8>)>, Error> {
        self.engine
            .take_requests()?
            .unwrap_or_default()
            .into_iter()
            .map(|(id, run, body)| Ok((id, run_id(&run)?, body)))
            .collect()
    }

    /// Records the answer to request `id`, and tells its sender.
    pub fn answer_request(&self, id: i64, answer: Vec<u8>) -> Result<(), Error> {
        self.engine.answer_request(id, answer)
    }

    /// The answer to request `id`, once there is one.
    pub fn request_answer(&self, id: i64) -> Result<Option<Vec<u8>>, Error> {
        self.engine.request_answer(id)
    }

    /// A shared journal's: the node that owns `run` and the run's epoch
    /// there. `None`: the journal is this node's alone (sled).
    pub fn owner(&self, run: RunId) -> Result<Option<(String, u64)>, Error> {
        self.engine.owner(run.0.as_bytes())
    }

    /// A shared journal's nodes, their leases and the runs each owns.
    /// `None`: the journal is this node's alone (sled).
    pub fn nodes(&self) -> Result<Option<Vec<crate::NodeLease>>, Error> {
        self.engine.nodes()
    }

    /// `verify` over `runs` alone: their accounts (each run's and each of
    /// its steps' and jobs'), for a node that recovered only the runs it
    /// took over in a journal it shares.
    pub fn verify_runs(&self, runs: &[RunId]) -> Result<VerifyReport, Error> {
        /// A read that meets an undecodable record lists it (I-35) and
        /// gives nothing; any other failure ends the check.
        fn listed<T>(
            read: Result<T, Error>,
            report: &mut VerifyReport,
        ) -> Result<Option<T>, Error> {
            match read {
                Ok(found) => Ok(Some(found)),
                Err(Error::Undecodable {
                    tree,
                    key_hex,
                    error,
                }) => {
                    report.undecodable.push(Undecodable {
                        tree,
                        key_hex,
                        error,
                    });
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        }
        let mut report = VerifyReport::default();
        let mut accounts: Vec<(ParentRef, Vec<LedgerRecord>)> = Vec::new();
        for &run in runs {
            let mut owners = vec![ParentRef::Run(run)];
            if let Some(jobs) = listed(self.jobs(run), &mut report)? {
                owners.extend(jobs.iter().map(|j| ParentRef::Job(j.id)));
            }
            for owner in owners {
                if let Some(entries) = listed(self.ledger(owner), &mut report)?
                    && !entries.is_empty()
                {
                    report.records += entries.len() as u64;
                    accounts.push((owner, entries));
                }
            }
        }
        report.accounts = accounts.len() as u64;
        report.breaches = verify::account_breaches(&accounts);
        Ok(report)
    }

    /// A journal over `engine`.
    pub fn new(engine: Arc<dyn Engine>) -> Journal {
        Journal {
            engine,
            commit_observer: Arc::new(OnceLock::new()),
        }
    }

    /// A handle that does not keep this journal open.
    pub fn downgrade(&self) -> WeakJournal {
        WeakJournal {
            engine: Arc::downgrade(&self.engine),
            commit_observer: self.commit_observer.clone(),
        }
    }

    /// This open's epoch: 1 on the first open of a journal, +1 on each reopen.
    pub fn epoch(&self) -> u64 {
        self.engine.epoch()
    }

    /// Applies `records` now, atomically and in order, and returns the seq of
    /// the last one (each record takes one seq). Reads see them at once; they
    /// are not durable until a flush covers them (see `commit`). An empty
    /// list applies nothing and returns the last seq handed out.
    ///
    /// Refused whole, with nothing written: a record of another open's epoch
    /// (`StaleEpoch`, `FutureEpoch`), a record that cannot be encoded, and
    /// every append once the journal has failed (`Failed`).
    pub fn append(&self, records: Vec<Record>) -> Result<u64, Error> {
        self.append_prepared(self.prepare(records))
    }

    /// Encodes `records` for an append, outside any lock of the engine's: an
    /// event bus that must append under its own lock, so that journal order
    /// is emission order, prepares its records first. What would refuse the
    /// append is kept for `append_prepared` to tell.
    pub fn prepare(&self, records: Vec<Record>) -> Prepared {
        let epochs = check_epochs(&records, self.epoch()).err();
        let mut rows = Vec::with_capacity(records.len());
        let mut unencoded = None;
        for record in records {
            match row(record) {
                Ok(row) => rows.push(row),
                Err(e) => {
                    unencoded.get_or_insert(e);
                }
            }
        }
        Prepared {
            rows,
            epochs,
            unencoded,
        }
    }

    /// `append`, of records `prepare` encoded.
    pub fn append_prepared(&self, prepared: Prepared) -> Result<u64, Error> {
        if let Some(refusal) = self.engine.refusal() {
            return Err(refusal);
        }
        if prepared.rows.is_empty() && prepared.unencoded.is_none() {
            return self.engine.append(Vec::new());
        }
        if let Some(e) = prepared.epochs.or(prepared.unencoded) {
            return Err(e);
        }
        self.engine.append(prepared.rows)
    }

    /// `append`, then wait until a flush covers the records (I-29: the journal
    /// is written before anything acts on it). Concurrent commits share flushes.
    pub async fn commit(&self, records: Vec<Record>) -> Result<u64, Error> {
        let began = std::time::Instant::now();
        let seq = self.append(records)?;
        self.wait_durable(seq).await?;
        if let Some(observe) = self.commit_observer.get() {
            observe(began.elapsed());
        }
        Ok(seq)
    }

    /// Waits until a flush covers `seq` (a seq `append` returned): what
    /// `commit` does after its append, for a caller that must answer later
    /// without holding up its own work meanwhile.
    pub async fn wait_durable(&self, seq: u64) -> Result<(), Error> {
        self.engine.wait_durable(seq).await
    }

    /// Waits for a flush covering everything appended so far.
    pub async fn flush(&self) -> Result<(), Error> {
        self.wait_durable(self.applied_seq()).await
    }

    /// Calls `observe` with the latency of every successful commit from now
    /// on (append to durable), for the service's metrics. Set once; a second
    /// observer is refused (`false`).
    pub fn on_commit(&self, observe: impl Fn(std::time::Duration) + Send + Sync + 'static) -> bool {
        self.commit_observer.set(Box::new(observe)).is_ok()
    }

    /// Highest seq applied (readable, not necessarily durable). It never goes
    /// back, not even across a reopen: the next open continues from it.
    pub fn applied_seq(&self) -> u64 {
        self.engine.applied_seq()
    }

    /// Highest seq covered by a completed flush.
    pub fn durable_seq(&self) -> u64 {
        self.engine.durable_seq()
    }

    /// How many flushes have made something durable, each with its sync.
    pub fn flush_count(&self) -> u64 {
        self.engine.counters().flushes
    }

    /// How many times the log was synced by its writer (once per flush that
    /// synced; the syncs at open and at checkpoints not counted).
    pub fn sync_count(&self) -> u64 {
        self.engine.counters().syncs
    }

    /// How many checkpoints have completed.
    pub fn checkpoint_count(&self) -> u64 {
        self.engine.counters().checkpoints
    }

    pub fn counters(&self) -> Counters {
        self.engine.counters()
    }

    /// The faults a test can inject into this journal; all off unless a test
    /// switches them on.
    pub fn faults(&self) -> &Faults {
        self.engine.faults()
    }

    /// The first write or flush that failed, if one has: from then on the
    /// journal refuses every append with `Error::Failed` carrying this.
    pub fn failed(&self) -> Option<String> {
        self.engine.failed()
    }

    /// See `Engine::leave_unapplied_at_close`.
    pub fn leave_unapplied_at_close(&self) {
        self.engine.leave_unapplied_at_close()
    }

    /// See `Engine::hand_over`.
    pub fn hand_over(&self) -> bool {
        self.engine.hand_over()
    }

    /// See `Engine::flush_store`.
    pub fn flush_store(&self) -> Result<(), Error> {
        self.engine.flush_store()
    }

    /// Every record of `table` under `prefix`, in key order.
    pub fn read<R>(&self, table: &'static Table<R>, prefix: &[u8]) -> Result<Vec<R>, Error> {
        self.read_span(table, Span::Prefix(prefix))
    }

    fn read_span<R>(&self, table: &'static Table<R>, span: Span<'_>) -> Result<Vec<R>, Error> {
        let mut records = Vec::new();
        self.engine.scan(&table.def, span, &mut |key, value| {
            records.push(decoded(table, key, value)?);
            Ok(())
        })?;
        Ok(records)
    }

    /// The record of `table` under `key`, if there is one.
    pub fn read_one<R>(&self, table: &'static Table<R>, key: &[u8]) -> Result<Option<R>, Error> {
        let Some(value) = self.engine.get(&table.def, key)? else {
            return Ok(None);
        };
        decoded(table, key, &value).map(Some)
    }

    /// Every run, in key (creation) order.
    pub fn runs(&self) -> Result<Vec<RunRecord>, Error> {
        self.read(&table::RUNS, &[])
    }

    /// The run a step or job belongs to, from the journal: the runs that
    /// started no later than it did (ids are uuid v7, in time order), the
    /// latest first, each asked for the job by key. Not a walk over every
    /// job; a job of a run that started long before it asks more runs.
    pub fn run_of_job(&self, job: JobId) -> Result<Option<RunId>, Error> {
        let started_ms = job.0.get_timestamp().map_or(u64::MAX, |t| {
            let (secs, nanos) = t.to_unix();
            secs * 1000 + u64::from(nanos / 1_000_000)
        });
        let mut runs = self.runs_started_before(started_ms.saturating_add(1))?;
        runs.reverse();
        for run in runs {
            if self.job(run.id, job)?.is_some() {
                return Ok(Some(run.id));
            }
        }
        Ok(None)
    }

    pub fn run(&self, id: RunId) -> Result<Option<RunRecord>, Error> {
        self.read_one(&table::RUNS, &codec::run_key(id))
    }

    /// The runs whose ids were made before `ms` (milliseconds since the Unix
    /// epoch), oldest first: a run id is a uuid v7, whose first six bytes
    /// are the millisecond it was made, so this reads only that part.
    pub fn runs_started_before(&self, ms: u64) -> Result<Vec<RunRecord>, Error> {
        let mut bound = ms.min(0xFFFF_FFFF_FFFF).to_be_bytes()[2..].to_vec();
        bound.resize(16, 0);
        self.read_span(&table::RUNS, Span::Below(&bound))
    }

    /// Every step and job of every run, by run and then by id.
    pub fn all_jobs(&self) -> Result<Vec<JobRecord>, Error> {
        self.read(&table::JOBS, &[])
    }

    /// The run's steps and jobs, in id (that is, creation) order.
    pub fn jobs(&self, run: RunId) -> Result<Vec<JobRecord>, Error> {
        self.read(&table::JOBS, &codec::run_key(run))
    }

    pub fn job(&self, run: RunId, id: JobId) -> Result<Option<JobRecord>, Error> {
        self.read_one(&table::JOBS, &codec::job_key(run, id))
    }

    /// One account's entries, in the order they were written.
    pub fn ledger(&self, owner: ParentRef) -> Result<Vec<LedgerRecord>, Error> {
        self.read(&table::LEDGER, &codec::ledger_prefix(owner))
    }

    /// The parent's delegate calls, in key order.
    pub fn delegations(&self, parent: JobId) -> Result<Vec<DelegationRecord>, Error> {
        self.read(&table::DELEGATIONS, parent.0.as_bytes())
    }

    /// The parent's delegate call under `key`, if there is one: a point read,
    /// so a parent's thousandth call does not read the 999 before it.
    pub fn delegation(&self, parent: JobId, key: &str) -> Result<Option<DelegationRecord>, Error> {
        self.read_one(&table::DELEGATIONS, &codec::delegation_key(parent, key))
    }

    /// The job's steering messages, by message id.
    pub fn steering(&self, job: JobId) -> Result<Vec<SteerRecord>, Error> {
        self.read(&table::STEERING, job.0.as_bytes())
    }

    /// The run's events, by event seq.
    pub fn events(&self, run: RunId) -> Result<Vec<Event>, Error> {
        self.read(&table::EVENTS, &codec::run_key(run))
    }

    /// The run's newest event, without reading its whole history.
    pub fn last_event(&self, run: RunId) -> Result<Option<Event>, Error> {
        let events = &table::EVENTS;
        let Some((key, value)) = self.engine.last(&events.def, &codec::run_key(run))? else {
            return Ok(None);
        };
        events
            .decode(&value)
            .map(Some)
            .map_err(|error| codec::undecodable(events.def.name, &key, error))
    }

    /// The job's sandbox process groups, by pgid, whatever their state.
    pub fn sandboxes(&self, job: JobId) -> Result<Vec<SandboxRecord>, Error> {
        self.read(&table::SANDBOXES, job.0.as_bytes())
    }

    /// Every sandbox process group still `Live`, of every job: what recovery
    /// must kill (I-30), if it is still the process group recorded.
    pub fn live_sandboxes(&self) -> Result<Vec<SandboxRecord>, Error> {
        let mut all = self.read(&table::SANDBOXES, &[])?;
        all.retain(|sandbox| sandbox.state == SandboxState::Live);
        Ok(all)
    }

    /// The run's approval cards, in id (that is, asking) order.
    pub fn approvals(&self, run: RunId) -> Result<Vec<ApprovalRecord>, Error> {
        self.read(&table::APPROVALS, &codec::run_key(run))
    }

    /// Every approval card of every run, by run and then by id.
    pub fn all_approvals(&self) -> Result<Vec<ApprovalRecord>, Error> {
        self.read(&table::APPROVALS, &[])
    }

    pub fn approval(&self, run: RunId, card: CardId) -> Result<Option<ApprovalRecord>, Error> {
        self.read_one(&table::APPROVALS, &codec::approval_key(run, card))
    }

    /// The run's recording, job by job, each kind in its order.
    pub fn tape(&self, run: RunId) -> Result<Vec<TapeRecord>, Error> {
        self.read(&table::TAPES, &codec::run_key(run))
    }

    /// Removes every record of each run in `runs`: the run, its submission,
    /// its steps and jobs, their ledgers, delegations, steering and sandbox
    /// records, and its events. One append, so after a crash a run is either
    /// all there or all gone. Returns the append's seq; once it returns, no
    /// read finds the runs.
    ///
    /// For runs that are over (the service's retention, `keep_finished`): a
    /// record appended for a run after its removal would stay.
    pub fn forget(&self, runs: &[RunId]) -> Result<u64, Error> {
        let mut prefixes = Vec::new();
        for &run in runs {
            let jobs: Vec<JobId> = self.jobs(run)?.into_iter().map(|job| job.id).collect();
            for table in JOURNAL_TABLES.iter().map(JournalTable::def) {
                match table.keyed_by {
                    KeyedBy::Run => prefixes.push((table, codec::run_key(run))),
                    KeyedBy::Account => {
                        prefixes.push((table, codec::ledger_prefix(ParentRef::Run(run))));
                        for &job in &jobs {
                            prefixes.push((table, codec::ledger_prefix(ParentRef::Job(job))));
                        }
                    }
                    KeyedBy::Job => {
                        for job in &jobs {
                            prefixes.push((table, job.0.as_bytes().to_vec()));
                        }
                    }
                    // The audit and the quota and rate windows outlive the runs they name.
                    KeyedBy::Time
                    | KeyedBy::Tenant
                    | KeyedBy::Window
                    | KeyedBy::Schedule
                    | KeyedBy::Version => {}
                }
            }
        }
        self.engine.remove(prefixes)
    }

    /// Removes the rows of a table keyed by time (`KeyedBy::Time`: a log of
    /// the node's own, such as the audit) whose time is before `cutoff_ms`,
    /// in one append; returns how many.
    pub fn remove_before<R>(
        &self,
        table: &'static Table<R>,
        cutoff_ms: u64,
    ) -> Result<usize, Error> {
        debug_assert_eq!(table.def.keyed_by, KeyedBy::Time);
        let mut prefixes = Vec::new();
        let below = cutoff_ms.to_be_bytes();
        self.engine
            .scan(&table.def, Span::Below(&below), &mut |key, _| {
                prefixes.push((&table.def, key.to_vec()));
                Ok(())
            })?;
        let removed = prefixes.len();
        if removed > 0 {
            self.engine.remove(prefixes)?;
        }
        Ok(removed)
    }

    /// On a shared journal, the lock every node takes in turn for `key`
    /// (a PostgreSQL advisory lock), until the guard is dropped: what a
    /// node reads, checks and commits under it no other node interleaves
    /// with (a tenant's quota windows). On a journal of its own, nothing:
    /// the node's own locks serialize it.
    pub fn exclusive(&self, key: &str) -> Result<Exclusive, Error> {
        Ok(Exclusive {
            _held: self.engine.exclusive(key)?,
        })
    }

    /// Removes the rows of `table` under each of `keys`, in one append.
    pub fn remove_keys<R>(
        &self,
        table: &'static Table<R>,
        keys: Vec<Vec<u8>>,
    ) -> Result<(), Error> {
        if keys.is_empty() {
            return Ok(());
        }
        self.engine
            .remove(keys.into_iter().map(|key| (&table.def, key)).collect())
            .map(|_| ())
    }

    /// Decodes every record of every table (and checks the engine's own
    /// entries), listing what does not decode instead of skipping it. Fails
    /// only if the store cannot be read at all. A table whose records
    /// another crate defines is checked for its format byte alone, unless
    /// that crate's `Table` is passed to `scan_with`.
    pub fn scan(&self) -> Result<ScanReport, Error> {
        self.scan_with(&[])
    }

    /// `scan`, checking the rows of `also`'s tables as storage's own are.
    pub fn scan_with(&self, also: &[&dyn AnyTable]) -> Result<ScanReport, Error> {
        Ok(self.walk(also)?.0)
    }

    /// `scan`, and then the accounts: each one's ledger must balance (see
    /// `verify.rs` for the rules). Ledger entries that do not decode are in
    /// `undecodable` and left out of their account's totals.
    pub fn verify(&self) -> Result<VerifyReport, Error> {
        self.verify_with(&[])
    }

    /// `verify`, checking the rows of `also`'s tables as storage's own are.
    pub fn verify_with(&self, also: &[&dyn AnyTable]) -> Result<VerifyReport, Error> {
        let (scan, ledger) = self.walk(also)?;
        // Ledger keys start with their owner, so an account's entries are
        // contiguous and in journal order.
        let mut accounts: Vec<(ParentRef, Vec<LedgerRecord>)> = Vec::new();
        for record in ledger {
            match accounts.last_mut() {
                Some((owner, entries)) if *owner == record.owner => entries.push(record),
                _ => accounts.push((record.owner, vec![record])),
            }
        }
        Ok(VerifyReport {
            records: scan.records,
            undecodable: scan.undecodable,
            accounts: accounts.len() as u64,
            breaches: verify::account_breaches(&accounts),
        })
    }

    /// One pass over every table: each row decoded and its key checked, the
    /// ledger's entries kept for `verify`. The events (about half of a
    /// journal, and JSON) are walked on a thread of their own beside the
    /// rest, so a boot's pass takes the longer of the two, not their sum.
    fn walk(&self, also: &[&dyn AnyTable]) -> Result<(ScanReport, Vec<LedgerRecord>), Error> {
        let checker = |def: &TableDef| {
            let ours = table::tables().map(|table| -> &dyn AnyTable { table });
            ours.chain(also.iter().copied())
                .find(|table| table.def().name == def.name)
        };
        let events = &table::EVENTS.def;
        let (walked_events, rest) = std::thread::scope(|scope| {
            let walked_events = scope.spawn(|| self.walk_table(events, checker(events)));
            let mut rest: Result<Walked, Error> = Ok(Walked::default());
            for def in JOURNAL_TABLES
                .iter()
                .map(JournalTable::def)
                .filter(|def| def.name != events.name)
            {
                rest = rest.and_then(|mut walked: Walked| {
                    walked.add(self.walk_table(def, checker(def))?);
                    Ok(walked)
                });
            }
            (walked_events.join(), rest)
        });
        let walked_events =
            walked_events.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let rest = rest?;
        let mut undecodable = rest.undecodable;
        undecodable.extend(walked_events.undecodable);
        // In table order, as one walk would have listed them (the sort is stable).
        undecodable.sort_by_key(|u| table::table_index(&u.tree));
        for (tree, key_hex, error) in self.engine.check_own()? {
            undecodable.push(Undecodable {
                tree,
                key_hex,
                error,
            });
        }
        let report = ScanReport {
            records: rest.records + walked_events.records,
            undecodable,
        };
        Ok((report, rest.ledger))
    }

    /// Every row of one table, checked by `checker` (its format byte alone
    /// without one).
    fn walk_table(
        &self,
        def: &'static TableDef,
        checker: Option<&dyn AnyTable>,
    ) -> Result<Walked, Error> {
        let mut walked = Walked::default();
        let is_ledger = def.name == table::LEDGER.def.name;
        self.engine.walk(def, &mut |key, value| {
            let checked = value.and_then(|value| {
                if is_ledger {
                    // Decoded once: checked, then kept for the accounts.
                    let entry = table::LEDGER.decode(value)?;
                    table::LEDGER.check_key(key, &entry)?;
                    walked.ledger.push(entry);
                    return Ok(());
                }
                match checker {
                    Some(table) => table.check(key, value),
                    None => codec::check_version(value),
                }
            });
            match checked {
                Ok(()) => walked.records += 1,
                Err(error) => walked.undecodable.push(Undecodable {
                    tree: def.name.to_string(),
                    key_hex: codec::hex(key),
                    error,
                }),
            }
        })?;
        Ok(walked)
    }
}

/// What walking some tables found.
#[derive(Default)]
struct Walked {
    records: u64,
    undecodable: Vec<Undecodable>,
    /// The ledger's entries that decoded, in key order.
    ledger: Vec<LedgerRecord>,
}

impl Walked {
    fn add(&mut self, more: Walked) {
        self.records += more.records;
        self.undecodable.extend(more.undecodable);
        self.ledger.extend(more.ledger);
    }
}

/// A record as a row of its table.
/// A stored value read back: undecodable, it fails the read naming its key
/// (I-35); decoded, its shape is checked (test builds): stored under its key.
fn decoded<R>(table: &Table<R>, key: &[u8], value: &[u8]) -> Result<R, Error> {
    let record = table
        .decode(value)
        .map_err(|error| codec::undecodable(table.def.name, key, error))?;
    debug_assert!(
        table.check_key(key, &record).is_ok(),
        "{}: {:?}",
        table.def.name,
        table.check_key(key, &record)
    );
    Ok(record)
}

/// Runs an engine claimed, by the keys it gives, with their epochs; `None`
/// where the engine has no claims (sled).
fn claimed_runs(
    claimed: Option<Vec<crate::engine::Claimed>>,
) -> Result<Option<Vec<(RunId, u64)>>, Error> {
    let Some(claimed) = claimed else {
        return Ok(None);
    };
    claimed
        .into_iter()
        .map(|(key, epoch)| Ok((run_id(&key)?, epoch)))
        .collect::<Result<_, _>>()
        .map(Some)
}

fn row(record: Record) -> Result<Row, Error> {
    match record {
        Record::Run(run) => table::RUNS.row(&run),
        Record::Job(job) => table::JOBS.row(&job),
        Record::Ledger(entry) => table::LEDGER.row(&entry),
        Record::Delegation(delegation) => table::DELEGATIONS.row(&delegation),
        Record::Steer(steer) => table::STEERING.row(&steer),
        Record::Event(event) => table::EVENTS.row(&event),
        // Encoded already, outside the event bus's lock.
        Record::EncodedEvent(event) => Ok(Row {
            table: &table::EVENTS.def,
            key: Key::Whole(codec::event_key(event.run, event.seq)),
            value: event.value,
            epoch: None,
        }),
        Record::Sandbox(sandbox) => table::SANDBOXES.row(&sandbox),
        Record::Approval(card) => table::APPROVALS.row(&card),
        Record::Tape(entry) => table::TAPES.row(&entry),
        Record::Row(row) => Ok(row),
    }
}

/// I-41: every record must carry this open's epoch. The first one that does
/// not fails the whole append.
fn check_epochs(records: &[Record], current: u64) -> Result<(), Error> {
    for record_epoch in records.iter().filter_map(Record::epoch) {
        if record_epoch < current {
            return Err(Error::StaleEpoch {
                record_epoch,
                current,
            });
        }
        if record_epoch > current {
            return Err(Error::FutureEpoch {
                record_epoch,
                current,
            });
        }
    }
    Ok(())
}

// By hand: an engine's handles may print their whole cache state.
impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("epoch", &self.epoch())
            .field("applied_seq", &self.applied_seq())
            .field("durable_seq", &self.durable_seq())
            .field("counters", &self.counters())
            .field("failed", &self.failed())
            .finish()
    }
}

/// A run's id from an `owners` key.
fn run_id(key: &[u8]) -> Result<RunId, Error> {
    uuid::Uuid::from_slice(key)
        .map(RunId)
        .map_err(|_| Error::Undecodable {
            tree: "owners".into(),
            key_hex: codec::hex(key),
            error: "not a run id".into(),
        })
}
