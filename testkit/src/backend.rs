//! Which journal a test node keeps: sled in its data dir (the default), or
//! PostgreSQL when the environment asks for it, so that a suite written for
//! one runs on both unchanged:
//!
//! ```sh
//! ARBOR_TEST_JOURNAL=postgres ARBOR_TEST_DATABASE_URL=postgres://... cargo test
//! ```
//!
//! Each data dir gets a schema of its own, named after the dir, so a process
//! a crash test starts and the test that checks after it find the same one.

use arbor_runtime::workspace::{DEFAULT_LEASE, JournalConfig};
use arbor_storage::{Journal, PgEngine, PgOptions};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::time::Duration;

/// Every test node's id.
const TEST_NODE: &str = "test-node";

/// The default lease: a shorter one is lost under a loaded machine's
/// scheduling, and a killed node's is ended at once (`node_killed`).
const TEST_LEASE: Duration = DEFAULT_LEASE;

/// Whether this process's test nodes keep their journals in PostgreSQL.
pub fn on_postgres() -> bool {
    match std::env::var("ARBOR_TEST_JOURNAL").as_deref() {
        Ok("postgres") => true,
        Ok("sled") | Err(_) => false,
        Ok(other) => panic!("ARBOR_TEST_JOURNAL={other:?}: sled or postgres"),
    }
}

fn database_url() -> String {
    std::env::var("ARBOR_TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "ARBOR_TEST_JOURNAL=postgres needs ARBOR_TEST_DATABASE_URL: start a server with \
             `tests/postgres/cluster.sh start DIR` and set it to the URL it prints"
        )
    })
}

/// The schema of `data_dir`'s journal: the same for every process.
fn schema_of(data_dir: &Path) -> String {
    let path = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    // SipHash with fixed keys: the same name in every process of a build.
    let mut hasher = std::hash::DefaultHasher::new();
    path.hash(&mut hasher);
    format!("t{:016x}", hasher.finish())
}

/// The journal a node on `data_dir` keeps: `workspace`'s own, unless the
/// environment puts test journals in PostgreSQL and it says sled.
pub fn journal_for(data_dir: &Path, configured: &JournalConfig) -> JournalConfig {
    if !on_postgres() || !matches!(configured, JournalConfig::Sled) {
        return configured.clone();
    }
    JournalConfig::Postgres {
        url: Some(database_url()),
        schema: schema_of(data_dir),
        lease: TEST_LEASE,
        connect_for: Duration::from_secs(10),
        node: Some(TEST_NODE.into()),
    }
}

fn options(data_dir: &Path) -> PgOptions {
    let mut options = PgOptions::new(database_url(), "test-reader");
    options.schema = schema_of(data_dir);
    options
}

/// Opens the journal of a node on `data_dir`, as `journal_for` places it.
pub fn open_journal(data_dir: &Path) -> Result<Journal, arbor_storage::Error> {
    if on_postgres() {
        return Journal::open_postgres(&options(data_dir));
    }
    Journal::open(&data_dir.join("journal"))
}

/// As `open_journal`, to read only.
pub fn open_journal_read_only(data_dir: &Path) -> Result<Journal, arbor_storage::Error> {
    if on_postgres() {
        return Journal::open_postgres_read_only(&options(data_dir));
    }
    Journal::open_read_only(&data_dir.join("journal"))
}

/// After the test killed the node on `data_dir` (SIGKILL, seen dead): its
/// lease ends now, as an operator who knows the node is gone would end it,
/// so the next node takes its runs without waiting the lease out.
pub fn node_killed(data_dir: &Path) -> Result<(), arbor_storage::Error> {
    if on_postgres() {
        PgEngine::expire(&options(data_dir), TEST_NODE)?;
    }
    Ok(())
}
