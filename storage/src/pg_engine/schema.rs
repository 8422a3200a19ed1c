//! The PostgreSQL engine's layout and its open: connecting (with backoff
//! while the server does not answer), making the schema under an advisory
//! lock (two nodes may start at once), the format check, a new epoch, and
//! where the seq goes on from. Also every statement the engine runs, built
//! once per open with the schema's name in it.

use crate::Error;
use crate::codec;
use crate::table::JOURNAL_TABLES;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use std::time::{Duration, Instant};
use tokio_postgres::NoTls;

/// The layout of the tables this build reads and writes (`meta/layout`):
/// the base layout and every step of `MIGRATIONS` after it. An older
/// database is migrated forward at a node's open; a newer one is refused,
/// saying which.
pub const PG_LAYOUT: u32 = BASE_LAYOUT + MIGRATIONS.len() as u32;

/// The layout a new schema is made at, before the migrations run on it as
/// they would on an old one: one path to every layout, so a new schema and
/// a migrated one cannot differ.
const BASE_LAYOUT: u32 = 1;

/// One step of the layout: from `BASE_LAYOUT + i` to the next, for the
/// step at index `i`. Run in the open's transaction, under its lock.
struct Migration {
    /// What it changes, as `migrations` records it.
    name: &'static str,
    ddl: fn(&Sql) -> String,
}

/// Every step, in order. A new one goes at the end; none is ever edited.
const MIGRATIONS: [Migration; 2] = [
    Migration {
        name: "a run may be queued in the database, owned by no node yet",
        ddl: |sql| {
            format!(
                "ALTER TABLE {owners} ALTER COLUMN node DROP NOT NULL;
                 ALTER TABLE {owners} ADD COLUMN IF NOT EXISTS queued timestamptz;
                 ALTER TABLE {owners} ADD CONSTRAINT owners_queued_or_owned
                   CHECK ((node IS NULL) = (queued IS NOT NULL));
                 CREATE INDEX IF NOT EXISTS owners_queued ON {owners} (queued, run) WHERE node IS NULL;",
                owners = sql.owners
            )
        },
    },
    Migration {
        name: "each migration is recorded with when and by which node",
        ddl: |sql| {
            format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (layout bigint PRIMARY KEY,
                   name text NOT NULL, node text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now());",
                migrations = sql.migrations
            )
        },
    },
];

/// Connections in the pool for reads (the writer holds one of them).
const POOL_SIZE: usize = 8;

/// The meta rows: bare integers.
const META_FORMAT: &str = "format";
const META_LAYOUT: &str = "layout";
pub(crate) const META_EPOCH: &str = "epoch";

/// Every statement, for this schema.
pub(crate) struct Sql {
    /// Per journal table, in `JOURNAL_TABLES` order: its qualified name.
    pub(crate) tables: Vec<String>,
    pub(crate) meta: String,
    pub(crate) seqs: String,
    pub(crate) nodes: String,
    pub(crate) owners: String,
    pub(crate) claims: String,
    pub(crate) requests: String,
    pub(crate) migrations: String,
    /// The channel a submission is announced on (`queue.rs`).
    pub(crate) channel: String,
}

impl Sql {
    fn new(schema: &str) -> Sql {
        let qualified = |name: &str| format!("\"{schema}\".\"{name}\"");
        Sql {
            tables: JOURNAL_TABLES
                .iter()
                .map(|t| qualified(t.def().name))
                .collect(),
            meta: qualified("meta"),
            seqs: qualified("seqs"),
            nodes: qualified("nodes"),
            owners: qualified("owners"),
            claims: qualified("claims"),
            requests: qualified("requests"),
            migrations: qualified("migrations"),
            // A channel's name has at most 63 bytes, as a schema's.
            channel: if schema.len() <= 57 {
                format!("arbor.{schema}")
            } else {
                schema.to_string()
            },
        }
    }

    pub(crate) fn table(&self, name: &str) -> &str {
        let at = crate::table::table_index(name)
            .unwrap_or_else(|| unreachable!("no journal table {name:?}"));
        &self.tables[at]
    }

    /// Writes rows given as three arrays (keys, seqs, values), each key
    /// once; a key already there takes the new row.
    pub(crate) fn upsert(&self, table: &str) -> String {
        format!(
            "INSERT INTO {} (key, seq, value) \
             SELECT * FROM unnest($1::bytea[], $2::int8[], $3::bytea[]) \
             ON CONFLICT (key) DO UPDATE SET seq = EXCLUDED.seq, value = EXCLUDED.value",
            self.table(table)
        )
    }

    /// The rows with `lower <= key` (and `key < upper`, if `bounded`).
    pub(crate) fn range(&self, table: &str, what: &str, bounded: bool, tail: &str) -> String {
        let upper = if bounded { " AND key < $2" } else { "" };
        format!(
            "{what} FROM {} WHERE key >= $1{upper}{tail}",
            self.table(table)
        )
    }

    pub(crate) fn set_seq(&self) -> String {
        format!("UPDATE {} SET seq = $2 WHERE node = $1", self.seqs)
    }
}

/// How to reach the database and what to call this node there.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// A libpq-style URL or key=value string (`postgres://user@host/db`).
    pub url: String,
    /// The PostgreSQL schema that holds the journal (`arbor`); one database
    /// can hold several journals side by side, each in its own schema.
    pub schema: String,
    /// This node's id, under which it records the last seq it wrote.
    pub node: String,
    /// How long an open keeps trying a server that does not answer, with
    /// backoff, before it gives up saying so.
    pub connect_for: Duration,
    /// How long the node owns its runs without renewing (`lease.rs`).
    pub lease: Duration,
}

impl PgOptions {
    pub fn new(url: impl Into<String>, node: impl Into<String>) -> PgOptions {
        PgOptions {
            url: url.into(),
            schema: "arbor".into(),
            node: node.into(),
            connect_for: Duration::from_secs(60),
            lease: Duration::from_secs(10),
        }
    }
}

/// What a node holds: its id, the epoch of this open, its lease.
#[derive(Clone, Debug)]
pub(crate) struct Holder {
    pub(crate) node: String,
    pub(crate) epoch: i64,
    pub(crate) lease: Duration,
}

impl Holder {
    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// How much before the database's deadline the node stops by its own
    /// clock: a fifth of the lease, at most 2 s.
    pub(crate) fn margin(&self) -> Duration {
        (self.lease / 5).min(Duration::from_secs(2))
    }
}

/// What an open found and began.
pub(crate) struct Opened {
    pub(crate) pool: Pool,
    pub(crate) sql: Sql,
    pub(crate) place: String,
    pub(crate) config: tokio_postgres::Config,
    /// The node, this open's epoch, its lease.
    pub(crate) holder: Holder,
    pub(crate) last_seq: u64,
}

/// A schema name arbor will put in its statements: lower-case letters,
/// digits and `_`, not starting with a digit, at most 63 bytes. Says why
/// not, for a message that names where the name came from.
pub fn check_schema_name(schema: &str) -> Result<(), String> {
    let ok = !schema.is_empty()
        && schema.len() <= 63
        && !schema.starts_with(|c: char| c.is_ascii_digit())
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{schema:?} is not a plain name: use lower-case letters, digits and _, not \
             starting with a digit, at most 63 of them"
        ))
    }
}

/// Host, port, database and schema: where the journal is, without the
/// password a URL may carry.
fn describe(config: &tokio_postgres::Config, schema: &str) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|host| match host {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("{host}:{port}/{db} schema {schema}")
}

/// A PostgreSQL error as a person reads it: the server's message and code,
/// or the client's own (a refused connection, a closed socket).
pub(crate) fn pg(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{} (SQLSTATE {})", db.message(), db.code().code());
    }
    // The client's own error names its kind; the cause says what happened.
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(next) = cause {
        let said = next.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        cause = next.source();
    }
    text
}

pub(crate) fn pool_error(error: deadpool_postgres::PoolError) -> Error {
    match error {
        deadpool_postgres::PoolError::Backend(e) => Error::Postgres(pg(&e)),
        other => Error::Postgres(other.to_string()),
    }
}

pub(crate) fn db_error(error: tokio_postgres::Error) -> Error {
    Error::Postgres(pg(&error))
}

/// Whether a failed connection is worth trying again: the server is not
/// there yet, or is starting, or is full. A refused login or a database
/// that does not exist will not change by waiting.
fn retryable(error: &deadpool_postgres::PoolError) -> bool {
    let deadpool_postgres::PoolError::Backend(e) = error else {
        return true;
    };
    match e.as_db_error() {
        None => true,
        Some(db) => matches!(db.code().code(), "57P03" | "53300"),
    }
}

async fn connect(
    pool: &Pool,
    place: &str,
    patience: Duration,
) -> Result<deadpool_postgres::Object, Error> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(250);
    loop {
        match pool.get().await {
            Ok(client) => return Ok(client),
            Err(e) if retryable(&e) && started.elapsed() + pause <= patience => {
                let why = match &e {
                    deadpool_postgres::PoolError::Backend(e) => pg(e),
                    other => other.to_string(),
                };
                tracing::warn!(
                    "journal: PostgreSQL at {place} does not answer ({why}); trying again in {} ms",
                    pause.as_millis()
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) => {
                let why = match &e {
                    deadpool_postgres::PoolError::Backend(e) => pg(e),
                    other => other.to_string(),
                };
                let waited = if retryable(&e) {
                    format!(" (tried for {} s)", started.elapsed().as_secs())
                } else {
                    String::new()
                };
                return Err(Error::Postgres(format!(
                    "cannot reach the journal at {place}{waited}: {why}"
                )));
            }
        }
    }
}

pub(crate) async fn open(options: PgOptions, read_only: bool) -> Result<Opened, Error> {
    check_schema_name(&options.schema).map_err(|why| Error::Postgres(format!("schema {why}")))?;
    if options.node.is_empty() {
        return Err(Error::Postgres("a node's id cannot be empty".into()));
    }
    let config: tokio_postgres::Config = options
        .url
        .parse()
        .map_err(|e| Error::Postgres(format!("the database URL does not parse: {e}")))?;
    let place = describe(&config, &options.schema);
    let manager = Manager::from_config(
        config.clone(),
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(POOL_SIZE)
        .build()
        .map_err(|e| Error::Postgres(format!("cannot make a connection pool: {e}")))?;
    let mut client = connect(&pool, &place, options.connect_for).await?;
    let sql = Sql::new(&options.schema);

    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("\"{}\".meta", options.schema)],
        )
        .await
        .map_err(db_error)?
        .get(0);
    if !exists && read_only {
        return Err(Error::Postgres(format!("no journal at {place}")));
    }

    let tx = client.transaction().await.map_err(db_error)?;
    if !read_only {
        // Two nodes starting at once make the schema once: the lock is
        // the schema name's, held to the end of this transaction.
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('arbor journal ' || $1))",
            &[&options.schema],
        )
        .await
        .map_err(db_error)?;
        if !exists {
            tx.batch_execute(&base_layout(&sql, &options.schema))
                .await
                .map_err(db_error)?;
        }
        migrate(&tx, &sql, &place, &options.node).await?;
    }

    let meta = tx
        .query(&format!("SELECT name, value FROM {}", sql.meta), &[])
        .await
        .map_err(db_error)?;
    let value = |name: &str| -> Option<i64> {
        meta.iter()
            .find(|row| row.get::<_, &str>(0) == name)
            .map(|row| row.get(1))
    };
    // A read-only open migrates nothing: it reads only the layout it knows.
    for (name, supported) in [
        (META_FORMAT, u32::from(codec::FORMAT_VERSION)),
        (META_LAYOUT, PG_LAYOUT),
    ] {
        let found = value(name).unwrap_or(-1);
        if found != i64::from(supported) {
            return Err(Error::FormatVersion {
                dir: place.clone(),
                found: u32::try_from(found).unwrap_or(0),
                supported,
            });
        }
    }
    let epoch = if read_only {
        value(META_EPOCH).unwrap_or(0)
    } else {
        tx.query_one(
            &format!(
                "UPDATE {} SET value = value + 1 WHERE name = '{META_EPOCH}' RETURNING value",
                sql.meta
            ),
            &[],
        )
        .await
        .map_err(db_error)?
        .get(0)
    };
    if !read_only {
        tx.execute(
            &format!(
                "INSERT INTO {} (node, seq) VALUES ($1, 0) ON CONFLICT (node) DO NOTHING",
                sql.seqs
            ),
            &[&options.node],
        )
        .await
        .map_err(db_error)?;
    }
    let last_seq = highest_seq(&tx, &sql).await?;
    tx.commit().await.map_err(db_error)?;
    drop(client);
    let holder = Holder {
        node: options.node.clone(),
        epoch,
        lease: options.lease,
    };
    Ok(Opened {
        pool,
        sql,
        place,
        config,
        holder,
        last_seq,
    })
}

/// The schema at `BASE_LAYOUT`, as the first release of this engine made it.
fn base_layout(sql: &Sql, schema: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\";
         CREATE TABLE IF NOT EXISTS {meta} (name text PRIMARY KEY, value bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS {seqs} (node text PRIMARY KEY, seq bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS {nodes} (id text PRIMARY KEY, epoch bigint NOT NULL,
           deadline timestamptz NOT NULL, lease_ms bigint NOT NULL,
           opened_at timestamptz NOT NULL DEFAULT now(),
           renewed_at timestamptz NOT NULL DEFAULT now(),
           draining boolean NOT NULL DEFAULT false);
         CREATE TABLE IF NOT EXISTS {owners} (run bytea PRIMARY KEY, node text NOT NULL,
           node_epoch bigint NOT NULL, epoch bigint NOT NULL, ended boolean NOT NULL,
           settled boolean NOT NULL DEFAULT false);
         CREATE INDEX IF NOT EXISTS owners_unsettled ON {owners} (node) WHERE NOT settled;
         CREATE TABLE IF NOT EXISTS {requests} (id bigserial PRIMARY KEY, run bytea NOT NULL,
           body bytea NOT NULL, sent_at timestamptz NOT NULL DEFAULT now(),
           answer bytea, answered_at timestamptz);
         CREATE INDEX IF NOT EXISTS requests_open ON {requests} (run) WHERE answer IS NULL;
         CREATE TABLE IF NOT EXISTS {claims} (run bytea NOT NULL, epoch bigint NOT NULL,
           node text NOT NULL, node_epoch bigint NOT NULL,
           claimed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run, epoch));
         INSERT INTO {meta} VALUES ('{META_FORMAT}', {format}), ('{META_LAYOUT}', {BASE_LAYOUT}), ('{META_EPOCH}', 0)
           ON CONFLICT (name) DO NOTHING;",
        meta = sql.meta,
        seqs = sql.seqs,
        nodes = sql.nodes,
        owners = sql.owners,
        claims = sql.claims,
        requests = sql.requests,
        format = codec::FORMAT_VERSION,
    )
}

/// Brings the schema to `PG_LAYOUT`, a step at a time, each recorded once
/// `migrations` exists; then makes every journal table that is missing (a
/// table added to `JOURNAL_TABLES` needs no step of its own). A layout newer
/// than this build's, or older than its base, is refused and nothing changes.
async fn migrate(
    tx: &deadpool_postgres::Transaction<'_>,
    sql: &Sql,
    place: &str,
    node: &str,
) -> Result<(), Error> {
    let found: i64 = tx
        .query_opt(
            &format!(
                "SELECT value FROM {} WHERE name = '{META_LAYOUT}'",
                sql.meta
            ),
            &[],
        )
        .await
        .map_err(db_error)?
        .map_or(-1, |row| row.get(0));
    let refused = || Error::FormatVersion {
        dir: place.to_string(),
        found: u32::try_from(found).unwrap_or(0),
        supported: PG_LAYOUT,
    };
    let from = u32::try_from(found).map_err(|_| refused())?;
    if !(BASE_LAYOUT..=PG_LAYOUT).contains(&from) {
        return Err(refused());
    }
    for (layout, step) in (BASE_LAYOUT + 1..)
        .zip(&MIGRATIONS)
        .skip((from - BASE_LAYOUT) as usize)
    {
        tx.batch_execute(&(step.ddl)(sql)).await.map_err(db_error)?;
        tx.execute(
            &format!(
                "UPDATE {} SET value = $1 WHERE name = '{META_LAYOUT}'",
                sql.meta
            ),
            &[&i64::from(layout)],
        )
        .await
        .map_err(db_error)?;
        let recorded = tx
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&sql.migrations])
            .await
            .map_err(db_error)?
            .get::<_, bool>(0);
        if recorded {
            tx.execute(
                &format!(
                    "INSERT INTO {} (layout, name, node) VALUES ($1, $2, $3)",
                    sql.migrations
                ),
                &[&i64::from(layout), &step.name, &node],
            )
            .await
            .map_err(db_error)?;
        }
        tracing::info!(layout, step = step.name, "migrated the journal's layout");
    }
    let mut ddl = String::new();
    for table in &sql.tables {
        ddl.push_str(&format!(
            "CREATE TABLE IF NOT EXISTS {table} \
             (key bytea PRIMARY KEY, seq bigint NOT NULL, value bytea NOT NULL);"
        ));
    }
    tx.batch_execute(&ddl).await.map_err(db_error)
}

/// The highest seq any node has written: where an open, or a claim, goes on.
pub(crate) async fn highest_seq(
    tx: &deadpool_postgres::Transaction<'_>,
    sql: &Sql,
) -> Result<u64, Error> {
    let seq: i64 = tx
        .query_one(
            &format!("SELECT coalesce(max(seq), 0)::int8 FROM {}", sql.seqs),
            &[],
        )
        .await
        .map_err(db_error)?
        .get(0);
    Ok(u64::try_from(seq).unwrap_or(0))
}

/// Ends node `node`'s lease now (`PgEngine::expire`).
pub(crate) async fn expire(options: &PgOptions, node: &str) -> Result<bool, Error> {
    check_schema_name(&options.schema).map_err(|why| Error::Postgres(format!("schema {why}")))?;
    let config: tokio_postgres::Config = options
        .url
        .parse()
        .map_err(|e| Error::Postgres(format!("the database URL does not parse: {e}")))?;
    let (client, connection) = config.connect(NoTls).await.map_err(db_error)?;
    tokio::spawn(connection);
    let sql = Sql::new(&options.schema);
    let expired = client
        .execute(
            &format!(
                "UPDATE {} SET deadline = now() WHERE id = $1 AND deadline > now()",
                sql.nodes
            ),
            &[&node],
        )
        .await
        .map_err(db_error)?;
    Ok(expired > 0)
}

/// The engine's own rows that are not as they must be (`Engine::check_own`).
pub(crate) async fn check_meta(
    pool: &Pool,
    sql: &Sql,
) -> Result<Vec<(String, String, String)>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let mut wrong = Vec::new();
    for row in client
        .query(&format!("SELECT name, value FROM {}", sql.meta), &[])
        .await
        .map_err(db_error)?
    {
        let (name, value): (String, i64) = (row.get(0), row.get(1));
        if ![META_FORMAT, META_LAYOUT, META_EPOCH].contains(&name.as_str()) {
            wrong.push(("meta".into(), name, "unknown meta row".into()));
        } else if value < 0 {
            wrong.push(("meta".into(), name, format!("negative value {value}")));
        }
    }
    for row in client
        .query(&format!("SELECT node, seq FROM {}", sql.seqs), &[])
        .await
        .map_err(db_error)?
    {
        let (node, seq): (String, i64) = (row.get(0), row.get(1));
        if seq < 0 {
            wrong.push(("seqs".into(), node, format!("negative seq {seq}")));
        }
    }
    Ok(wrong)
}

/// The first key past every key that starts with `prefix`, if there is one
/// (a prefix of only 0xff bytes, or none, has every key above it).
pub(crate) fn successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut upper = prefix.to_vec();
    while let Some(last) = upper.pop() {
        if last < u8::MAX {
            upper.push(last + 1);
            return Some(upper);
        }
    }
    None
}
