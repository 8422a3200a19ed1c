//! Nodes, their leases, and who owns which run (docs/cluster.md).
//!
//! A node registers under its id with a lease whose deadline is the
//! database's clock plus `lease`, and renews it every third of the lease.
//! Every transaction of its writer first checks, `FOR SHARE`, that its
//! lease is live under its epoch; a node whose lease has run out commits
//! nothing more. A run is owned by the node that started it (`owners`), at
//! a run epoch that only grows: another node takes it (`claim_orphans`)
//! only from an owner whose lease has run out or whose id has since opened
//! again, locking that owner's row `FOR UPDATE`, so the claim waits for any
//! transaction of the owner still in flight and is refused to none after.
//! Each claim is a row of `claims`, (run, epoch) unique: a run is owned by
//! at most one node per epoch (I-50).
//!
//! The node's own clock decides when it stops: a renewal sent at `t` holds
//! the lease until `t + lease - margin` by the node's monotonic clock (the
//! database's deadline is later: `now()` at the server is after `t`). Past
//! that without a renewal, the lease is lost: the journal fails (nothing
//! more is committed) and `lost` tells the node, which stops its runs.

use super::progress::Progress;
use super::schema::{Holder, Sql, db_error, pg, pool_error};
use crate::Error;
use crate::faults::CrashPoint;
use deadpool_postgres::Pool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Registers the node in the open's transaction. An id whose lease is live
/// is another node's, or this node's previous life's: wait while it runs
/// out (a node killed a moment ago), and refuse if it is renewed meanwhile
/// (a second node configured with the same id).
pub(crate) async fn register(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
    place: &str,
) -> Result<(), Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let mut seen: Option<(i64, std::time::SystemTime)> = None;
    loop {
        let taken = client
            .query_opt(
                &format!(
                    "INSERT INTO {nodes} AS n (id, epoch, deadline, lease_ms, renewed_at) \
                     VALUES ($1, $2, now() + $3::int8 * interval '1 millisecond', $3, now()) \
                     ON CONFLICT (id) DO UPDATE SET epoch = EXCLUDED.epoch, \
                       deadline = EXCLUDED.deadline, lease_ms = EXCLUDED.lease_ms, \
                       opened_at = now(), renewed_at = now(), draining = false \
                     WHERE n.deadline < now() \
                     RETURNING 1",
                    nodes = sql.nodes
                ),
                &[&holder.node, &holder.epoch, &holder.lease_ms()],
            )
            .await
            .map_err(db_error)?;
        if taken.is_some() {
            return Ok(());
        }
        let row = client
            .query_one(
                &format!(
                    "SELECT epoch, renewed_at, \
                       greatest(extract(epoch FROM deadline - now()) * 1000, 0)::int8 \
                     FROM {} WHERE id = $1",
                    sql.nodes
                ),
                &[&holder.node],
            )
            .await
            .map_err(db_error)?;
        let (epoch, renewed, left_ms): (i64, std::time::SystemTime, i64) =
            (row.get(0), row.get(1), row.get(2));
        if seen.is_some_and(|before| before != (epoch, renewed)) {
            return Err(Error::Postgres(format!(
                "node id {:?} is serving the journal at {place} already (epoch {epoch}, its \
                 lease renewed while this node waited for it): two nodes cannot share an id; \
                 give this one another --node-id (or ARBOR_NODE_ID)",
                holder.node
            )));
        }
        if seen.is_none() {
            tracing::warn!(
                "journal: node id {:?} holds a lease at {place} for {left_ms} ms more (epoch \
                 {epoch}): waiting to see whether it is renewed (a second node with this id) \
                 or runs out (this node's previous life)",
                holder.node
            );
        }
        seen = Some((epoch, renewed));
        let wait = Duration::from_millis(u64::try_from(left_ms).unwrap_or(0))
            .min(holder.lease / 3)
            .max(Duration::from_millis(50));
        tokio::time::sleep(wait).await;
    }
}

/// The statement every writer transaction begins with: the lease is live
/// under this open's epoch, and stays so (the row is share-locked) until
/// the transaction ends.
pub(crate) fn fence_sql(sql: &Sql) -> String {
    format!(
        "SELECT 1 FROM {} WHERE id = $1 AND epoch = $2 AND deadline > now() FOR SHARE",
        sql.nodes
    )
}

/// The writer's fence (`writer.rs`), as `fence_sql`, but one that raises
/// (a division by zero) when the lease is not live: the writer sends its
/// whole transaction, COMMIT included, before any answer, so the fence
/// must abort the transaction rather than answer no row.
pub(crate) fn fence_or_abort_sql(sql: &Sql) -> String {
    format!(
        "WITH live AS ( \
           SELECT 1 FROM {} WHERE id = $1 AND epoch = $2 AND deadline > now() FOR SHARE) \
         SELECT 1 / (SELECT count(*)::int FROM live)",
        sql.nodes
    )
}

/// Owns a run this node writes the record of: its first record makes it
/// this node's at run epoch 1; its end marks it ended. Refused, raising a
/// division by zero as the writer's fence does, if another node owns it.
pub(crate) fn own_sql(sql: &Sql) -> String {
    format!(
        "WITH owned AS ( \
           INSERT INTO {owners} AS o (run, node, node_epoch, epoch, ended) \
           VALUES ($1, $2, $3, 1, $4) \
           ON CONFLICT (run) DO UPDATE SET ended = o.ended OR EXCLUDED.ended \
           WHERE o.node = EXCLUDED.node AND o.node_epoch = EXCLUDED.node_epoch \
           RETURNING (xmax = 0) AS new, epoch) \
         , claimed AS ( \
           INSERT INTO {claims} (run, epoch, node, node_epoch) \
           SELECT $1, epoch, $2, $3 FROM owned WHERE new \
           ON CONFLICT DO NOTHING) \
         SELECT 1 / (SELECT count(*)::int FROM owned)",
        owners = sql.owners,
        claims = sql.claims
    )
}

/// Takes every run not settled whose owner's lease has run out, or whose
/// owner's id has opened again since: each at its run epoch + 1, one
/// `claims` row each; with the highest seq any node has written. A run its
/// owner claimed from the queue but had not begun (no `runs` record) goes
/// back to the queue, where any node takes it at the next epoch. A run is
/// settled once it has ended and a claimer has taken it and told again,
/// durably, what a crash may have taken of its end (its last events,
/// appended after the end was committed: `settle`); a claimer that dies
/// before that leaves it to the next. A run not
/// ended is taken to be recovered. What is locked (a dead owner's transaction the server
/// has not yet aborted, another node claiming) is waited for if `wait` (a
/// start: it must find every run it is to recover), else skipped for the
/// next try.
pub(crate) async fn claim_orphans(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
    wait: bool,
    faults: &crate::Faults,
) -> Result<(Vec<crate::engine::Claimed>, u64), Error> {
    loop {
        match claim_once(pool, sql, holder, wait, faults).await {
            // Two claimers that wait may deadlock on each other's rows; the
            // server aborts one, which tries again.
            Err(Error::Postgres(why)) if why.contains("SQLSTATE 40P01") => continue,
            other => return other,
        }
    }
}

async fn claim_once(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
    wait: bool,
    faults: &crate::Faults,
) -> Result<(Vec<crate::engine::Claimed>, u64), Error> {
    let mut client = pool.get().await.map_err(pool_error)?;
    let tx = client.transaction().await.map_err(db_error)?;
    let fenced = tx
        .query_opt(&fence_sql(sql), &[&holder.node, &holder.epoch])
        .await
        .map_err(db_error)?;
    if fenced.is_none() {
        return Err(Error::Fenced(format!(
            "node {:?} cannot claim runs: its lease has run out",
            holder.node
        )));
    }
    // First lock the orphans (waiting for, or skipping, a dead owner's
    // transaction still in flight); then, in a statement that sees what
    // that transaction committed, take those that began and requeue those
    // that did not.
    let orphans: Vec<Vec<u8>> = tx
        .query(
            &format!(
                "SELECT o.run FROM {owners} o JOIN {nodes} n ON n.id = o.node \
                 WHERE NOT o.settled AND (n.epoch <> o.node_epoch OR n.deadline < now()) \
                 FOR UPDATE OF o, n{skip}",
                owners = sql.owners,
                nodes = sql.nodes,
                skip = if wait { "" } else { " SKIP LOCKED" },
            ),
            &[],
        )
        .await
        .map_err(db_error)?
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    let rows = if orphans.is_empty() {
        vec![]
    } else {
        tx.query(
            &format!(
                "WITH orphan AS ( \
                   SELECT o.run, EXISTS (SELECT 1 FROM {runs} r WHERE r.key = o.run) AS began \
                   FROM {owners} o WHERE o.run = ANY($3)), \
                 requeued AS ( \
                   UPDATE {owners} o SET node = NULL, node_epoch = 0, queued = clock_timestamp() \
                   FROM orphan WHERE o.run = orphan.run AND NOT orphan.began), \
                 taken AS ( \
                   UPDATE {owners} o SET node = $1, node_epoch = $2, epoch = o.epoch + 1 \
                   FROM orphan WHERE o.run = orphan.run AND orphan.began \
                   RETURNING o.run, o.epoch) \
                 INSERT INTO {claims} (run, epoch, node, node_epoch) \
                 SELECT run, epoch, $1, $2 FROM taken RETURNING run, epoch",
                owners = sql.owners,
                claims = sql.claims,
                runs = sql.table(crate::table::RUNS.def.name),
            ),
            &[&holder.node, &holder.epoch, &orphans],
        )
        .await
        .map_err(db_error)?
    };
    // The highest seq any node wrote, read after the dead owners' rows were
    // locked (so after their last commit): the claimer's seqs go on above
    // it, so that an account's entries stay in order across owners.
    let last_seq = super::schema::highest_seq(&tx, sql).await?;
    faults.crash_if_claim_due(CrashPoint::BeforeFlush);
    tx.commit().await.map_err(db_error)?;
    faults.crash_if_claim_due(CrashPoint::AfterFlush);
    let claimed = rows
        .into_iter()
        .map(|row| {
            let epoch: i64 = row.get(1);
            (row.get(0), epoch as u64)
        })
        .collect();
    Ok((claimed, last_seq))
}

/// Marks settled the ended runs of `runs` this node (at this epoch) owns:
/// their ends were told again and flushed (`claim_orphans`).
pub(crate) async fn settle(
    pool: &Pool,
    sql: &Sql,
    holder: &Holder,
    runs: &[Vec<u8>],
) -> Result<(), Error> {
    let client = pool.get().await.map_err(pool_error)?;
    client
        .execute(
            &format!(
                "UPDATE {} SET settled = true \
                 WHERE run = ANY($1) AND ended AND node = $2 AND node_epoch = $3",
                sql.owners
            ),
            &[&runs, &holder.node, &holder.epoch],
        )
        .await
        .map_err(db_error)?;
    Ok(())
}

/// What the node means to do with its lease, for its keeper (`keep`),
/// and what the keeper learns of it.
pub(crate) struct Intent {
    /// The lease was ended on purpose: the keeper stops quietly.
    pub(crate) released: std::sync::atomic::AtomicBool,
    /// The node hands its runs over: the keeper renews on although the
    /// journal has failed, until the lease is released.
    pub(crate) handing_over: std::sync::atomic::AtomicBool,
    /// Set once a renewal finds the node asked to drain (`ask_drain`).
    pub(crate) drain: watch::Sender<bool>,
}

impl Default for Intent {
    fn default() -> Self {
        Intent {
            released: Default::default(),
            handing_over: Default::default(),
            drain: watch::channel(false).0,
        }
    }
}

/// Asks node `node` to drain: its next renewal tells it. `false`: the
/// journal has no node of that id.
pub(crate) async fn ask_drain(pool: &Pool, sql: &Sql, node: String) -> Result<bool, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let asked = client
        .execute(
            &format!("UPDATE {} SET draining = true WHERE id = $1", sql.nodes),
            &[&node],
        )
        .await
        .map_err(db_error)?;
    Ok(asked == 1)
}

/// Renews the lease every third of it, on a connection of its own (a busy
/// pool never starves it), until the engine is dropped or the lease is
/// lost; tells `lost` why when it is.
pub(crate) async fn keep(
    config: tokio_postgres::Config,
    sql: Arc<Sql>,
    holder: Holder,
    progress: Arc<Progress>,
    faults: Arc<crate::Faults>,
    intent: Arc<Intent>,
    lost: watch::Sender<Option<String>>,
) {
    let renew = format!(
        "UPDATE {} SET deadline = now() + $3::int8 * interval '1 millisecond', renewed_at = now() \
         WHERE id = $1 AND epoch = $2 AND deadline > now() RETURNING draining",
        sql.nodes
    );
    let every = holder.lease / 3;
    // The registration was sent just before this started.
    let mut valid_until = Instant::now() + holder.lease - holder.margin();
    let mut client: Option<tokio_postgres::Client> = None;
    let mut last_error = String::from("no renewal answered");
    let why = loop {
        let next = (Instant::now() + every).min(valid_until);
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            // Fault injection: a renewal now, to die around it.
            () = faults.renewal_forced() => {}
        }
        if lost.is_closed() || intent.released.load(std::sync::atomic::Ordering::Acquire) {
            return; // the engine is gone, or ended its lease on purpose
        }
        if Instant::now() >= valid_until {
            break format!(
                "node {:?} could not renew its lease within {} ms ({last_error}); it stops \
                 its runs here, and another node takes them",
                holder.node,
                holder.lease.as_millis()
            );
        }
        // A journal that failed commits nothing more: the node must not
        // keep its runs from the others by renewing a lease it cannot use.
        // A node handing its runs over (`PgEngine::hand_over`) failed its
        // journal on purpose: it keeps its lease until its runs are stopped
        // here, then ends it.
        if let Some(failure) = progress.failure.get().filter(|_| {
            !intent
                .handing_over
                .load(std::sync::atomic::Ordering::Acquire)
        }) {
            break format!(
                "node {:?} stops renewing its lease: its journal failed ({failure}); its \
                 runs go to another node once the lease runs out",
                holder.node
            );
        }
        let sent = Instant::now();
        if faults.renewals_held() {
            last_error = "renewals held (fault injection)".into();
            continue;
        }
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            match tokio::time::timeout(every, config.connect(tokio_postgres::NoTls)).await {
                Ok(Ok((c, connection))) => {
                    tokio::spawn(connection);
                    client = Some(c);
                }
                Ok(Err(e)) => {
                    last_error = pg(&e);
                    continue;
                }
                Err(_) => {
                    last_error = "connecting took longer than a third of the lease".into();
                    continue;
                }
            }
        }
        let Some(c) = &client else { continue };
        faults.crash_if_renewal_due(CrashPoint::BeforeFlush);
        let renewed = tokio::time::timeout(
            every,
            c.query_opt(&renew, &[&holder.node, &holder.epoch, &holder.lease_ms()]),
        )
        .await;
        match renewed {
            Ok(Ok(Some(row))) => {
                faults.crash_if_renewal_due(CrashPoint::AfterFlush);
                valid_until = sent + holder.lease - holder.margin();
                if row.get::<_, bool>(0) {
                    intent
                        .drain
                        .send_if_modified(|asked| !std::mem::replace(asked, true));
                }
            }
            Ok(Ok(None)) if intent.released.load(std::sync::atomic::Ordering::Acquire) => return,
            Ok(Ok(None)) => {
                break format!(
                    "node {:?}'s lease ran out before it was renewed (the database's clock); \
                     its runs may be another node's now",
                    holder.node
                );
            }
            Ok(Err(e)) => last_error = pg(&e),
            Err(_) => last_error = "a renewal took longer than a third of the lease".into(),
        }
    };
    tracing::error!("journal: {why}");
    progress.fail("the node's lease", Error::Fenced(why.clone()));
    lost.send_replace(Some(why));
}

/// Fault injection (`Faults::fence_at`): the node's lease is taken from
/// it, as when its id opened again elsewhere and that life ended too: a
/// newer epoch, a deadline passed. Its next transaction is refused.
pub(crate) async fn take_away(pool: &Pool, sql: &Sql, holder: &Holder) -> Result<(), Error> {
    let client = pool.get().await.map_err(pool_error)?;
    client
        .execute(
            &format!(
                "WITH next AS (UPDATE {meta} SET value = value + 1 WHERE name = '{epoch}' \
                   RETURNING value) \
                 UPDATE {nodes} SET epoch = next.value, deadline = now() FROM next \
                 WHERE id = $1 AND epoch = $2",
                meta = sql.meta,
                epoch = super::schema::META_EPOCH,
                nodes = sql.nodes
            ),
            &[&holder.node, &holder.epoch],
        )
        .await
        .map_err(db_error)?;
    Ok(())
}

/// At a clean close: the lease ends now, so this node's runs can be taken
/// at once and its id opened again without waiting.
pub(crate) async fn release(pool: &Pool, sql: &Sql, holder: &Holder) -> Result<(), Error> {
    let client = pool.get().await.map_err(pool_error)?;
    client
        .execute(
            &format!(
                "UPDATE {} SET deadline = now() WHERE id = $1 AND epoch = $2",
                sql.nodes
            ),
            &[&holder.node, &holder.epoch],
        )
        .await
        .map_err(db_error)?;
    Ok(())
}

/// Which node owns the run under `key`, at which run epoch.
pub(crate) async fn owner(
    pool: &Pool,
    sql: &Sql,
    key: Vec<u8>,
) -> Result<Option<(String, u64)>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let row = client
        .query_opt(
            &format!(
                "SELECT node, epoch FROM {} WHERE run = $1 AND node IS NOT NULL",
                sql.owners
            ),
            &[&key],
        )
        .await
        .map_err(db_error)?;
    Ok(row.map(|row| {
        let epoch: i64 = row.get(1);
        (row.get(0), epoch as u64)
    }))
}

/// Every node, its lease, and the runs it owns that have not ended.
pub(crate) async fn nodes(pool: &Pool, sql: &Sql) -> Result<Vec<crate::engine::NodeLease>, Error> {
    let client = pool.get().await.map_err(pool_error)?;
    let nodes = client
        .query(
            &format!(
                "SELECT id, epoch, greatest(extract(epoch FROM deadline - now()) * 1000, 0)::int8 \
                 FROM {} ORDER BY id",
                sql.nodes
            ),
            &[],
        )
        .await
        .map_err(db_error)?;
    let owned = client
        .query(
            &format!(
                "SELECT node, run, epoch FROM {} WHERE NOT ended AND node IS NOT NULL \
                 ORDER BY run",
                sql.owners
            ),
            &[],
        )
        .await
        .map_err(db_error)?;
    Ok(nodes
        .into_iter()
        .map(|row| {
            let id: String = row.get(0);
            let (epoch, left): (i64, i64) = (row.get(1), row.get(2));
            let runs = owned
                .iter()
                .filter(|o| o.get::<_, &str>(0) == id)
                .map(|o| {
                    let epoch: i64 = o.get(2);
                    (o.get::<_, Vec<u8>>(1), epoch as u64)
                })
                .collect();
            crate::engine::NodeLease {
                id,
                epoch: epoch as u64,
                lease_left_ms: left as u64,
                runs,
            }
        })
        .collect())
}
