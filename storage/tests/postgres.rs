//! What only the PostgreSQL journal has: a server that is not there, a
//! database of another layout, values edited behind its back, and several
//! nodes opening one schema. Run with `--ignored` and
//! `ARBOR_TEST_DATABASE_URL` (see `common/mod.rs`).

use arbor_protocol::{JobId, RunId, Status};
use arbor_storage::{Error, Journal, PgOptions, Record, RunRecord};
use std::time::{Duration, Instant};

mod common;
use common::{Store, message_ids, steer};

fn options(store: &Store) -> &PgOptions {
    match store {
        Store::Postgres(options) => options,
        Store::Sled(_) => unreachable!("a PostgreSQL test"),
    }
}

/// Runs `sql` on the test server, behind the journal's back.
async fn behind_its_back(sql: &str) {
    let (client, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    client.batch_execute(sql).await.unwrap();
    drop(client);
    connection.await.unwrap().unwrap();
}

#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_server_that_does_not_answer_is_retried_then_refused_saying_where() {
    // A loopback port nobody listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut options = PgOptions::new(
        format!("postgres://arbor:secret-password@127.0.0.1:{port}/arbor"),
        "n1",
    );
    options.connect_for = Duration::from_millis(1200);
    let started = Instant::now();
    let error = Journal::open_postgres(&options).map(drop).unwrap_err();
    let waited = started.elapsed();
    let message = error.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{port}/arbor schema arbor")),
        "{message}"
    );
    assert!(message.contains("tried for"), "{message}");
    assert!(!message.contains("secret-password"), "{message}");
    assert!(
        waited >= Duration::from_millis(700),
        "it retried with backoff before giving up ({waited:?})"
    );
}

#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn bad_options_are_refused_before_anything_is_made() {
    let store = Store::postgres();
    let mut options = options(&store).clone();
    options.schema = "Robert'); DROP TABLE students;--".into();
    let error = Journal::open_postgres(&options).map(drop).unwrap_err();
    assert!(error.to_string().contains("not a plain name"), "{error}");

    let mut options = self::options(&store).clone();
    options.url = "postgres://[nonsense".into();
    let error = Journal::open_postgres(&options).map(drop).unwrap_err();
    assert!(error.to_string().contains("URL does not parse"), "{error}");
}

#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_database_of_another_layout_is_refused_with_its_version_and_left_as_it_was() {
    let store = Store::postgres();
    let schema = options(&store).schema.clone();
    drop(store.open());
    behind_its_back(&format!(
        "UPDATE {schema}.meta SET value = 9 WHERE name = 'layout'"
    ))
    .await;
    let error = store.try_open().map(drop).unwrap_err();
    match &error {
        Error::FormatVersion {
            found, supported, ..
        } => assert_eq!((*found, *supported), (9, arbor_storage::PG_LAYOUT)),
        other => panic!("expected a format error, got {other:?}"),
    }
    assert!(error.to_string().contains("newer arbor"), "{error}");
    behind_its_back(&format!(
        "UPDATE {schema}.meta SET value = {} WHERE name = 'layout'",
        arbor_storage::PG_LAYOUT
    ))
    .await;
    assert_eq!(store.open().epoch(), 2, "the refused open began no epoch");
}

/// `(layout, node)` of each migration `schema` records, in order.
async fn migrations(schema: &str) -> Vec<(i64, String)> {
    let (client, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let layout: i64 = client
        .query_one(
            &format!("SELECT value FROM \"{schema}\".meta WHERE name = 'layout'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(layout, i64::from(arbor_storage::PG_LAYOUT));
    client
        .query(
            &format!("SELECT layout, node FROM \"{schema}\".migrations ORDER BY layout"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// A database made by the layout before this one (a frozen copy of what
/// that release made, without the tables added since) opens: it is
/// migrated forward, step by step, gains every journal table it lacked,
/// keeps its epoch and seqs, and takes new records in the new tables. The
/// next open migrates nothing.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_database_made_by_the_previous_layout_is_migrated_forward_and_gains_the_new_tables() {
    let store = Store::postgres();
    let schema = options(&store).schema.clone();
    behind_its_back(&include_str!("fixtures/pg-layout-2.sql").replace("{schema}", &schema)).await;

    let journal = store.open();
    assert_eq!(journal.epoch(), 5, "its epoch goes on from the old one");
    assert!(
        journal.applied_seq() >= 41,
        "its seqs go on from the old node's"
    );
    let id = RunId::new();
    journal
        .commit(vec![run(id, Status::Running, journal.epoch())])
        .await
        .unwrap();
    // Tables added after layout 2 are there, and read.
    assert!(journal.approvals(id).unwrap().is_empty());
    assert!(journal.tape(id).unwrap().is_empty());
    drop(journal);
    assert_eq!(migrations(&schema).await, [(3, "test-node".to_string())]);

    let journal = store.open();
    assert_eq!(journal.epoch(), 6);
    assert_eq!(
        journal.run(id).unwrap().map(|r| r.status),
        Some(Status::Running)
    );
    drop(journal);
    assert_eq!(migrations(&schema).await.len(), 1, "nothing migrated twice");
}

#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_value_edited_behind_its_back_is_reported_never_skipped() {
    let store = Store::postgres();
    let schema = options(&store).schema.clone();
    let job = JobId::new();
    let journal = store.open();
    journal
        .commit(vec![steer(job, 1, 1), steer(job, 2, 1)])
        .await
        .unwrap();
    drop(journal);
    behind_its_back(&format!(
        "UPDATE {schema}.steering SET value = set_byte(value, 0, 9) \
         WHERE key = (SELECT key FROM {schema}.steering ORDER BY key DESC LIMIT 1)"
    ))
    .await;
    let journal = store.open();
    let report = journal.scan().unwrap();
    assert_eq!(report.undecodable.len(), 1);
    assert_eq!(report.undecodable[0].tree, "steering");
    assert!(matches!(
        journal.steering(job),
        Err(Error::Undecodable { .. })
    ));
}

/// Two nodes on one schema: each open its own epoch, each sees what the
/// other committed, and a node opened later goes on above every seq.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn nodes_on_one_schema_take_their_own_epochs_and_read_each_others_commits() {
    let store = Store::postgres();
    let first = options(&store).clone();
    let one = Journal::open_postgres(&first).unwrap();
    let mut second = first.clone();
    second.node = "n2".into();
    let two = Journal::open_postgres(&second).unwrap();
    assert_ne!(one.epoch(), two.epoch());

    let (a, b) = (JobId::new(), JobId::new());
    let seq_one = one.commit(vec![steer(a, 1, one.epoch())]).await.unwrap();
    two.commit(vec![steer(b, 1, two.epoch())]).await.unwrap();
    assert_eq!(message_ids(&two, a), [1]);
    assert_eq!(message_ids(&one, b), [1]);

    // The one node's record is refused under the other's epoch (I-41).
    assert!(matches!(
        two.append(vec![steer(a, 2, one.epoch())]),
        Err(Error::StaleEpoch { .. } | Error::FutureEpoch { .. })
    ));
    let mut third = first.clone();
    third.node = "n3".into();
    let three = Journal::open_postgres(&third).unwrap();
    assert!(three.applied_seq() >= seq_one);
    assert!(three.epoch() > one.epoch().max(two.epoch()));
}

const LEASE: Duration = Duration::from_secs(3);

fn run(id: RunId, status: Status, epoch: u64) -> Record {
    Record::Run(RunRecord {
        id,
        flow: "f".into(),
        budget_tokens: 100,
        status,
        error_class: None,
        reason: None,
        output_json: String::new(),
        epoch,
    })
}

/// A node with a short lease, for the lease tests (long enough to be
/// renewed on a loaded machine).
fn node(store: &Store, id: &str) -> Journal {
    let mut options = options(store).clone();
    options.node = id.into();
    options.lease = LEASE;
    Journal::open_postgres(&options).unwrap()
}

/// The lease's deadline by the database's clock, from now (ms; negative
/// once passed).
async fn deadline_ms(store: &Store, id: &str) -> i64 {
    let (client, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
        .query_one(
            &format!(
                "SELECT (extract(epoch FROM deadline - now()) * 1000)::int8 FROM {}.nodes \
                 WHERE id = $1",
                options(store).schema
            ),
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

/// `claimer`'s claim once `owner`'s lease has run out by the database's
/// clock: the wait is for that deadline, the condition itself.
async fn claim_once_run_out(store: &Store, claimer: &Journal, owner: &str) -> Vec<(RunId, u64)> {
    let left = deadline_ms(store, owner).await;
    if left >= 0 {
        tokio::time::sleep(Duration::from_millis(left as u64 + 20)).await;
    }
    claimer.claim_orphans(true).unwrap().unwrap()
}

/// Waits for the node to say it lost its lease (the limit only catches a
/// test gone wrong: the loss is awaited, not slept for).
async fn lost(journal: &Journal) -> String {
    let mut lost = journal.lease_lost().expect("a shared journal");
    let why = tokio::time::timeout(Duration::from_secs(30), lost.wait_for(|why| why.is_some()))
        .await
        .expect("the lease is lost in time")
        .unwrap()
        .clone();
    why.unwrap()
}

#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_second_node_with_the_same_id_is_refused_while_the_first_renews() {
    let store = Store::postgres();
    let first = node(&store, "twin");
    let mut options = options(&store).clone();
    options.node = "twin".into();
    options.lease = LEASE;
    let error = Journal::open_postgres(&options).map(drop).unwrap_err();
    assert!(
        error.to_string().contains("two nodes cannot share an id"),
        "{error}"
    );
    assert_eq!(first.failed(), None, "the first goes on");
    // Closed cleanly, its lease ends at once: the id opens again.
    drop(first);
    let again = Journal::open_postgres(&options).unwrap();
    assert_eq!(again.failed(), None);
}

/// I-50: a node that cannot renew (paused, cut off) stops by its own clock
/// before the database's deadline passes, and commits nothing after.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn inv_50_a_node_that_cannot_renew_stops_before_its_lease_runs_out() {
    let store = Store::postgres();
    let journal = node(&store, "paused");
    let job = JobId::new();
    journal
        .commit(vec![steer(job, 1, journal.epoch())])
        .await
        .unwrap();
    journal.faults().hold_renewals(true);
    let why = lost(&journal).await;
    assert!(why.contains("could not renew its lease"), "{why}");
    assert!(
        deadline_ms(&store, "paused").await > 0,
        "it stopped before the database's deadline"
    );
    let refused = journal.commit(vec![steer(job, 2, journal.epoch())]).await;
    assert!(
        matches!(refused, Err(Error::Failed(_) | Error::Fenced(_))),
        "{refused:?}"
    );
    drop(journal);
    assert_eq!(message_ids(&node(&store, "reader"), job), [1]);
}

/// I-50, I-51: a run whose owner's lease ran out is taken by another node at
/// epoch + 1, once; the old owner's next commit is refused.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn inv_50_an_orphaned_run_is_claimed_once_at_the_next_epoch_and_fences_its_old_owner() {
    let store = Store::postgres();
    let a = node(&store, "a");
    let b = node(&store, "b");
    let (mine, done) = (RunId::new(), RunId::new());
    a.commit(vec![run(mine, Status::Running, a.epoch())])
        .await
        .unwrap();
    a.commit(vec![run(done, Status::Running, a.epoch())])
        .await
        .unwrap();
    a.commit(vec![run(done, Status::Done, a.epoch())])
        .await
        .unwrap();
    assert_eq!(
        b.claim_orphans(false).unwrap(),
        Some(vec![]),
        "a's lease is live"
    );

    // a is paused past its lease: b takes its runs.
    a.faults().hold_renewals(true);
    lost(&a).await;
    // The database's deadline passes a margin after a stopped itself.
    let claimed = claim_once_run_out(&store, &b, "a").await;
    // The ended run comes too, once: a crash may have taken its last
    // events, which the claimer tells again.
    let mut expected = vec![(mine, 2), (done, 2)];
    expected.sort();
    let mut claimed = claimed;
    claimed.sort();
    assert_eq!(claimed, expected);
    assert_eq!(
        b.claim_orphans(false).unwrap(),
        Some(vec![]),
        "claimed once"
    );
    b.commit(vec![run(mine, Status::Done, b.epoch())])
        .await
        .unwrap();
    assert!(
        a.commit(vec![run(mine, Status::Failed, a.epoch())])
            .await
            .is_err()
    );
    drop(a);
    assert_eq!(b.run(mine).unwrap().unwrap().status, Status::Done);
    // A node that writes a run another node owns is fenced.
    let c = node(&store, "c");
    let refused = c.commit(vec![run(mine, Status::Failed, c.epoch())]).await;
    assert!(matches!(refused, Err(Error::Fenced(_))), "{refused:?}");
    assert_eq!(b.run(mine).unwrap().unwrap().status, Status::Done);
}

/// A node whose journal failed (a write it could not make: here injected)
/// gives its lease up rather than hold its runs from the others.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn a_node_whose_journal_failed_gives_its_lease_up() {
    let store = Store::postgres();
    let journal = node(&store, "broken");
    let run_id = RunId::new();
    journal
        .commit(vec![run(run_id, Status::Running, journal.epoch())])
        .await
        .unwrap();
    journal.faults().fail_writes(true);
    assert!(
        journal
            .append(vec![steer(JobId::new(), 1, journal.epoch())])
            .is_err()
    );
    let why = lost(&journal).await;
    assert!(why.contains("its journal failed"), "{why}");
    // Its run goes to the next node once the lease has run out.
    let other = node(&store, "other");
    let claimed = claim_once_run_out(&store, &other, "broken").await;
    assert_eq!(claimed, [(run_id, 2)]);
}

/// A run submitted through a node: its submission's first record (the
/// service's, whose value the journal does not read) queues it.
fn submission(run: RunId, epoch: u64) -> Record {
    Record::Row(arbor_storage::Row {
        table: &arbor_storage::SUBMISSIONS_TABLE,
        key: arbor_storage::Key::Whole(run.0.as_bytes().to_vec()),
        value: std::sync::Arc::from(&b"queued"[..]),
        epoch: Some(epoch),
    })
}

/// Every (run, epoch, node) ever claimed, from the database.
async fn claims(store: &Store) -> Vec<(Vec<u8>, i64, String)> {
    let (client, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
        .query(
            &format!(
                "SELECT run, epoch, node FROM {}.claims ORDER BY run, epoch",
                options(store).schema
            ),
            &[],
        )
        .await
        .unwrap()
        .into_iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

/// I-50: three nodes race for runs queued through one of them: each run is
/// claimed once, at epoch 1, by one node; the others skip what one is
/// taking rather than wait for it or take it too.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn inv_50_queued_runs_three_nodes_race_for_are_each_claimed_once_per_epoch() {
    let store = Store::postgres();
    let nodes = [node(&store, "a"), node(&store, "b"), node(&store, "c")];
    let mut submitted: Vec<RunId> = (0..60).map(|_| RunId::new()).collect();
    // Woken by any node's submission: first the wake of its listener's
    // connect, then the one this commit announces.
    let mut woken = nodes[2].woken().expect("a shared queue");
    tokio::time::timeout(Duration::from_secs(10), woken.wait_for(|n| *n > 0))
        .await
        .expect("the listener connects")
        .unwrap();
    woken.mark_unchanged();
    nodes[0]
        .commit(
            submitted
                .iter()
                .map(|run| submission(*run, nodes[0].epoch()))
                .collect(),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), woken.changed())
        .await
        .expect("node c hears of the submission")
        .unwrap();
    let mut queued = nodes[1].queued_runs().unwrap().unwrap();
    queued.sort();
    submitted.sort();
    assert_eq!(queued, submitted, "every node sees the whole queue");

    let taken: Vec<Vec<(RunId, u64)>> = std::thread::scope(|scope| {
        let racers: Vec<_> = nodes
            .iter()
            .map(|node| {
                scope.spawn(move || {
                    let mut mine = vec![];
                    loop {
                        let some = node.claim_queued(2, None).unwrap().unwrap();
                        if some.is_empty() {
                            return mine;
                        }
                        mine.extend(some);
                    }
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let mut all: Vec<(RunId, u64)> = taken.iter().flatten().copied().collect();
    all.sort();
    let expected: Vec<(RunId, u64)> = submitted.iter().map(|run| (*run, 1)).collect();
    assert_eq!(all, expected, "each run once, at epoch 1");
    assert_eq!(nodes[0].queued_runs().unwrap(), Some(vec![]));
    let claims = claims(&store).await;
    assert_eq!(claims.len(), submitted.len());
    for ((run, epoch, node), (id, _)) in claims.iter().zip(&all) {
        assert_eq!((&run[..], *epoch), (&id.0.as_bytes()[..], 1));
        let holder = taken
            .iter()
            .position(|mine| mine.iter().any(|(r, _)| r == id))
            .unwrap();
        assert_eq!(
            node,
            ["a", "b", "c"][holder],
            "the claims row names its taker"
        );
    }
    // The owner of a claimed run is the taker, and only it may begin it.
    let (first, _) = taken.iter().flatten().next().copied().unwrap();
    let taker = taken.iter().position(|mine| !mine.is_empty()).unwrap();
    let other = &nodes[(taker + 1) % 3];
    let refused = other
        .commit(vec![run(first, Status::Running, other.epoch())])
        .await;
    assert!(matches!(refused, Err(Error::Fenced(_))), "{refused:?}");
}

/// I-51: a run claimed from the queue whose claimer died before it began
/// goes back to the queue, and is claimed again at the next epoch; a
/// queued run can be taken by its id alone (a stop before it starts).
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn inv_51_a_queued_run_whose_claimer_died_before_it_began_is_queued_again() {
    let store = Store::postgres();
    let (a, b) = (node(&store, "a"), node(&store, "b"));
    let (first, second) = (RunId::new(), RunId::new());
    b.commit(vec![submission(first, b.epoch())]).await.unwrap();
    b.commit(vec![submission(second, b.epoch())]).await.unwrap();
    assert_eq!(
        b.queued_runs().unwrap(),
        Some(vec![first, second]),
        "oldest first"
    );
    assert_eq!(
        a.claim_queued(5, Some(second)).unwrap(),
        Some(vec![(second, 1)])
    );
    assert_eq!(
        a.claim_queued(5, Some(second)).unwrap(),
        Some(vec![]),
        "once"
    );
    assert_eq!(a.claim_queued(1, None).unwrap(), Some(vec![(first, 1)]));
    a.commit(vec![run(second, Status::Running, a.epoch())])
        .await
        .unwrap();

    // a dies having begun `second` but not `first`.
    a.faults().hold_renewals(true);
    lost(&a).await;
    let claimed = claim_once_run_out(&store, &b, "a").await;
    assert_eq!(claimed, vec![(second, 2)], "what began is taken over");
    assert_eq!(
        b.queued_runs().unwrap(),
        Some(vec![first]),
        "what did not is queued"
    );
    assert_eq!(b.claim_queued(5, None).unwrap(), Some(vec![(first, 2)]));
    b.commit(vec![run(first, Status::Running, b.epoch())])
        .await
        .unwrap();
    let epochs: Vec<(Vec<u8>, i64)> = claims(&store)
        .await
        .into_iter()
        .filter(|(run, _, _)| run[..] == first.0.as_bytes()[..])
        .map(|(run, epoch, _)| (run, epoch))
        .collect();
    assert_eq!(epochs.iter().map(|e| e.1).collect::<Vec<_>>(), [1, 2]);
}

/// I-51: an ended run a claimer took is settled only once that claimer has
/// told its end again (`settle`): a claimer that died before is followed by
/// another that takes it again; a settled run is never taken again.
#[tokio::test]
#[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
async fn inv_51_an_ended_run_is_settled_only_by_a_claimer_that_told_its_end() {
    let store = Store::postgres();
    let a = node(&store, "a");
    let done = RunId::new();
    a.commit(vec![run(done, Status::Running, a.epoch())])
        .await
        .unwrap();
    a.commit(vec![run(done, Status::Done, a.epoch())])
        .await
        .unwrap();
    // Closed, a's lease ends at once; b takes the ended run and dies
    // before it settled it.
    drop(a);
    let b = node(&store, "b");
    assert_eq!(b.claim_orphans(true).unwrap(), Some(vec![(done, 2)]));
    drop(b);
    let c = node(&store, "c");
    assert_eq!(
        c.claim_orphans(true).unwrap(),
        Some(vec![(done, 3)]),
        "taken again: b never said its end was told"
    );
    c.settle(&[done]).unwrap();
    drop(c);
    let d = node(&store, "d");
    assert_eq!(
        d.claim_orphans(true).unwrap(),
        Some(vec![]),
        "settled: nobody takes it again"
    );
}
