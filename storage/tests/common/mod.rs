//! Where a test's journal lives: a sled directory, or a fresh schema of the
//! PostgreSQL server `ARBOR_TEST_DATABASE_URL` names (`.ci/run` starts one
//! and runs these with `--ignored`; `tests/postgres/cluster.sh` starts one
//! by hand). `on_both!` makes a test of each from one body.
#![allow(dead_code)] // each test target uses its own part

use arbor_protocol::JobId;
use arbor_storage::{Error, Journal, PgOptions, Record, SteerRecord, SteerState};

pub enum Store {
    Sled(tempfile::TempDir),
    Postgres(PgOptions),
}

/// The PostgreSQL tests' server, from the environment.
pub fn database_url() -> String {
    std::env::var("ARBOR_TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "ARBOR_TEST_DATABASE_URL is not set: start a server with \
             `tests/postgres/cluster.sh start DIR` and set it to the URL it prints"
        )
    })
}

impl Store {
    pub fn sled() -> Store {
        Store::Sled(tempfile::tempdir().unwrap())
    }

    /// A schema of its own, so tests run side by side on one server.
    pub fn postgres() -> Store {
        let mut options = PgOptions::new(database_url(), "test-node");
        options.schema = format!("t{}", arbor_protocol::RunId::new().0.simple());
        Store::Postgres(options)
    }

    /// A place of the same kind where no journal is.
    pub fn elsewhere(&self) -> Store {
        match self {
            Store::Sled(_) => Store::sled(),
            Store::Postgres(_) => Store::postgres(),
        }
    }

    pub fn open(&self) -> Journal {
        self.try_open().unwrap()
    }

    pub fn try_open(&self) -> Result<Journal, Error> {
        match self {
            Store::Sled(dir) => Journal::open(dir.path()),
            Store::Postgres(options) => Journal::open_postgres(options),
        }
    }

    pub fn open_read_only(&self) -> Result<Journal, Error> {
        match self {
            Store::Sled(dir) => Journal::open_read_only(dir.path()),
            Store::Postgres(options) => Journal::open_postgres_read_only(options),
        }
    }
}

/// `on_both!(name, flavor)`: tests `name::sled` and `name::postgres` (ignored
/// unless asked for) running `async fn name(store: Store)`.
#[macro_export]
macro_rules! on_both {
    ($name:ident $(, $($flavor:tt)*)?) => {
        mod $name {
            #[tokio::test$(($($flavor)*))?]
            async fn sled() {
                super::$name($crate::common::Store::sled()).await
            }
            #[tokio::test$(($($flavor)*))?]
            #[ignore = "needs PostgreSQL: ARBOR_TEST_DATABASE_URL"]
            async fn postgres() {
                super::$name($crate::common::Store::postgres()).await
            }
        }
    };
}

/// A steering message's record: the smallest record a test can commit.
pub fn steer(job: JobId, message_id: u64, epoch: u64) -> Record {
    Record::Steer(SteerRecord {
        job,
        message_id,
        text: format!("message {message_id}"),
        state: SteerState::Queued,
        epoch,
    })
}

/// The ids of `job`'s steering messages, in order.
pub fn message_ids(journal: &Journal, job: JobId) -> Vec<u64> {
    journal
        .steering(job)
        .unwrap()
        .into_iter()
        .map(|s| s.message_id)
        .collect()
}
