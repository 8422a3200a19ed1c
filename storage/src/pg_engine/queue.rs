//! The admission queue every node shares (docs/cluster.md): a submission
//! made through any node is a run that no node owns yet, an `owners` row
//! with no node, in the order the database's clock gave it. A node takes
//! queued runs as it has room, in one statement that locks them
//! `FOR UPDATE SKIP LOCKED` (two nodes never wait on, or take, the same
//! run), owns each at run epoch + 1 and adds its `claims` row: a run is
//! claimed once per epoch. A run whose claimer died before it started
//! (no `runs` record) goes back to the queue (`lease::claim_orphans`).
//!
//! A request for another node's run (a stop, a steering message, a
//! decision, sent through any node's API) is a row of `requests`: the
//! run's owner takes the requests of its runs, acts, and writes the answer
//! there for the sender.
//!
//! A submission, a request and an answer are each announced on the
//! schema's channel in their own transaction (delivered at its commit);
//! each node listens on a connection of its own, and looks again also by
//! the clock, for a notification lost with a connection.

use super::schema::{Holder, Sql, db_error, pg, pool_error};
use crate::Error;
use deadpool_postgres::Pool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Queues the runs under `$1` that no node owns yet (a submission's first
/// record; its later ones change nothing here), and announces them on the
/// channel `$2`: a statement of the writer's transaction (`writer.rs`).
pub(crate) fn enqueue_sql(sql: &Sql) -> String {
    format!(
        "WITH queued AS ( \
           INSERT INTO {owners} (run, node, node_epoch, epoch, ended, queued) \
           SELECT k, NULL, 0, 0, false, clock_timestamp() FROM unnest($1::bytea[]) k \
           ON CONFLICT (run) DO NOTHING RETURNING 1) \
         SELECT pg_notify($2, '') FROM (SELECT 1 FROM queued LIMIT 1) q",
        owners = sql.owners
    )
}

/// Takes up to `limit` queued runs, oldest first (only `only`, if given),
/// each at its run epoch + 1 with a `claims` row; skips what another node
/// is taking at this moment.
pub(crate) async fn claim(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
    limit: usize,
    only: Option<Vec<u8>>,
) -> Result<Vec<crate::engine::Claimed>, Error> {
    let mut client = pool.get().await.map_err(pool_error)?;
    let tx = client.transaction().await.map_err(db_error)?;
    if tx
        .query_opt(
            &super::lease::fence_sql(sql),
            &[&holder.node, &holder.epoch],
        )
        .await
        .map_err(db_error)?
        .is_none()
    {
        return Err(Error::Fenced(format!(
            "node {:?} cannot take queued runs: its lease has run out",
            holder.node
        )));
    }
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = tx
        .query(
            &format!(
                "WITH next AS ( \
                   SELECT run FROM {owners} WHERE node IS NULL \
                     AND ($3::bytea IS NULL OR run = $3) \
                   ORDER BY queued, run LIMIT $4 FOR UPDATE SKIP LOCKED), \
                 taken AS ( \
                   UPDATE {owners} o SET node = $1, node_epoch = $2, epoch = o.epoch + 1, \
                     queued = NULL \
                   FROM next WHERE o.run = next.run RETURNING o.run, o.epoch) \
                 INSERT INTO {claims} (run, epoch, node, node_epoch) \
                 SELECT run, epoch, $1, $2 FROM taken RETURNING run, epoch",
                owners = sql.owners,
                claims = sql.claims,
            ),
            &[&holder.node, &holder.epoch, &only, &limit],
        )
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let epoch: i64 = row.get(1);
            (row.get(0), epoch as u64)
        })
        .collect())
}

/// The queued runs, oldest first.
pub(crate) async fn queued(pool: &Pool, sql: &Sql) -> Result<Vec<Vec<u8>>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let rows = client
        .query(
            &format!(
                "SELECT run FROM {} WHERE node IS NULL ORDER BY queued, run",
                sql.owners
            ),
            &[],
        )
        .await
        .map_err(db_error)?;
    Ok(rows.into_iter().map(|row| row.get(0)).collect())
}

/// Sends a request for `run` to its owner; its id.
pub(crate) async fn send_request(
    pool: &Pool,
    sql: &Sql,
    run: Vec<u8>,
    body: Vec<u8>,
) -> Result<i64, Error> {
    let mut client = pool.get().await.map_err(pool_error)?;
    let tx = client.transaction().await.map_err(db_error)?;
    let id: i64 = tx
        .query_one(
            &format!(
                "INSERT INTO {} (run, body) VALUES ($1, $2) RETURNING id",
                sql.requests
            ),
            &[&run, &body],
        )
        .await
        .map_err(db_error)?
        .get(0);
    tx.execute("SELECT pg_notify($1, '')", &[&sql.channel])
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;
    Ok(id)
}

/// The open requests for runs this node owns under this open's epoch.
pub(crate) async fn take_requests(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
) -> Result<Vec<crate::engine::Request>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let rows = client
        .query(
            &format!(
                "SELECT r.id, r.run, r.body FROM {requests} r JOIN {owners} o ON o.run = r.run \
                 WHERE r.answer IS NULL AND o.node = $1 AND o.node_epoch = $2 ORDER BY r.id",
                requests = sql.requests,
                owners = sql.owners
            ),
            &[&holder.node, &holder.epoch],
        )
        .await
        .map_err(db_error)?;
    Ok(rows
        .into_iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect())
}

/// Writes the answer to request `id` (once: a second answer is ignored).
pub(crate) async fn answer_request(
    pool: &Pool,
    sql: &Sql,
    id: i64,
    answer: Vec<u8>,
) -> Result<(), Error> {
    let mut client = pool.get().await.map_err(pool_error)?;
    let tx = client.transaction().await.map_err(db_error)?;
    tx.execute(
        &format!(
            "UPDATE {} SET answer = $2, answered_at = now() WHERE id = $1 AND answer IS NULL",
            sql.requests
        ),
        &[&id, &answer],
    )
    .await
    .map_err(db_error)?;
    tx.execute("SELECT pg_notify($1, '')", &[&sql.channel])
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)
}

pub(crate) async fn request_answer(
    pool: &Pool,
    sql: &Sql,
    id: i64,
) -> Result<Option<Vec<u8>>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let row = client
        .query_opt(
            &format!("SELECT answer FROM {} WHERE id = $1", sql.requests),
            &[&id],
        )
        .await
        .map_err(db_error)?;
    Ok(row.and_then(|row| row.get(0)))
}

/// Until the engine's runtime ends: listens on the schema's channel and
/// wakes `woken` at each notification (and at each connect, which may
/// have missed some). A lost connection is made again after a second.
pub(crate) async fn listen(
    config: tokio_postgres::Config,
    sql: Arc<Sql>,
    woken: watch::Sender<u64>,
) {
    let listen = format!("LISTEN \"{}\"", sql.channel);
    loop {
        match config.connect(tokio_postgres::NoTls).await {
            Ok((client, mut connection)) => {
                let woken_here = woken.clone();
                // Polling the connection drives the client's statements too.
                let messages = tokio::spawn(async move {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => {
                                woken_here.send_modify(|n| *n += 1)
                            }
                            Some(Ok(_)) => {}
                            Some(Err(e)) => {
                                tracing::warn!("journal: the queue's listener: {}", pg(&e));
                                break;
                            }
                            None => break,
                        }
                    }
                });
                match client.batch_execute(&listen).await {
                    Ok(()) => {
                        woken.send_modify(|n| *n += 1);
                        let _ = messages.await;
                    }
                    Err(e) => {
                        messages.abort();
                        tracing::warn!("journal: listening for submissions: {}", pg(&e))
                    }
                }
            }
            Err(e) => tracing::warn!("journal: connecting the queue's listener: {}", pg(&e)),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
