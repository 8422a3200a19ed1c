//! Workspace versions in the journal (I-67): each distinct content of
//! arbor.toml, the agents and the flows, kept once, by its version id
//! (`Workspace::version`), so a run admitted with it runs with it to its
//! end, whatever the files are now; and which version is current.

use arbor_storage::{Journal, Record, Table, VERSIONS_TABLE};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A row of the `versions` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum VersionRecord {
    /// One version's files, by path (`Workspace::files`).
    Snapshot {
        id: String,
        files: BTreeMap<String, String>,
        created_ms: u64,
        epoch: u64,
    },
    /// The version new runs and schedules take: `id`, made current at
    /// `at_ms` while the files on disk were version `disk` (a restart on
    /// the same files keeps it; edited files are a new deploy).
    Current {
        id: String,
        disk: String,
        at_ms: u64,
        epoch: u64,
    },
}

/// The key of the current version's row: no version id is this.
const CURRENT: &[u8] = b"current";

pub static VERSIONS: Table<VersionRecord> = Table::bincode(
    VERSIONS_TABLE,
    |r| match r {
        VersionRecord::Snapshot { id, .. } => id.as_bytes().to_vec(),
        VersionRecord::Current { .. } => CURRENT.to_vec(),
    },
    |r| match r {
        VersionRecord::Snapshot { epoch, .. } | VersionRecord::Current { epoch, .. } => *epoch,
    },
);

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The row keeping `workspace`'s version, unless the journal has it.
pub fn snapshot(
    journal: &Journal,
    workspace: &crate::Workspace,
) -> Result<Option<Record>, arbor_storage::Error> {
    if journal
        .read_one(&VERSIONS, workspace.version.as_bytes())?
        .is_some()
    {
        return Ok(None);
    }
    VERSIONS
        .row(&VersionRecord::Snapshot {
            id: workspace.version.clone(),
            files: workspace.files.clone(),
            created_ms: now_ms(),
            epoch: journal.epoch(),
        })
        .map(|row| Some(Record::Row(row)))
}

/// The row making `id` current, the files on disk being version `disk`.
pub fn current_row(
    journal: &Journal,
    id: &str,
    disk: &str,
) -> Result<Record, arbor_storage::Error> {
    VERSIONS
        .row(&VersionRecord::Current {
            id: id.to_string(),
            disk: disk.to_string(),
            at_ms: now_ms(),
            epoch: journal.epoch(),
        })
        .map(Record::Row)
}

/// Version `id`'s files, if the journal keeps them.
pub fn files(
    journal: &Journal,
    id: &str,
) -> Result<Option<BTreeMap<String, String>>, arbor_storage::Error> {
    Ok(match journal.read_one(&VERSIONS, id.as_bytes())? {
        Some(VersionRecord::Snapshot { files, .. }) => Some(files),
        _ => None,
    })
}

/// The current version's row, if one was made current: (id, disk).
pub fn current(journal: &Journal) -> Result<Option<(String, String)>, arbor_storage::Error> {
    Ok(match journal.read_one(&VERSIONS, CURRENT)? {
        Some(VersionRecord::Current { id, disk, .. }) => Some((id, disk)),
        _ => None,
    })
}

/// Every version the journal keeps: (id, created_ms, paths), oldest first.
pub fn all(journal: &Journal) -> Result<Vec<(String, u64, Vec<String>)>, arbor_storage::Error> {
    let mut all: Vec<(String, u64, Vec<String>)> = journal
        .read(&VERSIONS, &[])?
        .into_iter()
        .filter_map(|r| match r {
            VersionRecord::Snapshot {
                id,
                files,
                created_ms,
                ..
            } => Some((id, created_ms, files.into_keys().collect())),
            VersionRecord::Current { .. } => None,
        })
        .collect();
    all.sort_by_key(|(id, at, _)| (*at, id.clone()));
    Ok(all)
}
