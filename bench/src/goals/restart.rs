//! P5: a restart on a journal of `journal_records` records with
//! `open_jobs` steps and jobs open at the crash (the testkit's synthetic
//! crashed journal, `arbor_tests::synthetic`). Timed: `Journal::open`
//! and `recovery::recover`, until recovery has failed every orphan and
//! reconciled every account: what a restarted node waits for before it
//! can take work. Beside it, a bare sled open of the same database and a
//! walk of every entry of every tree.
//!
//! The journal is built once. Every measurement, of either side, runs on a
//! fresh copy made just before it (not timed): sled writes a snapshot while
//! it opens a db, so whoever opened a copy first would leave the next one
//! less log to replay.

use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Unit, figure};
use crate::trial::{interleaved, progress};
use anyhow::ensure;
use arbor_tests::synthetic::{self, Built, copy_dir, wait_until_released};
use std::path::{Path, PathBuf};

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    progress(
        "P5",
        &format!(
            "building a crashed journal of {} records, {} jobs open",
            sizes.journal_records, sizes.open_jobs
        ),
    );
    let built = synthetic::build_journal(sizes.journal_records, sizes.open_jobs).await;
    let scratch = tempfile::tempdir()?;
    let copies = Copies {
        built: &built,
        scratch: scratch.path().to_path_buf(),
    };
    let mut failed = 0;
    let mut entries = 0;
    let row = interleaved(
        "P5",
        "",
        async |_| {
            let copy = copies.fresh("scan");
            let scan = synthetic::plain_scan(&copy);
            entries = scan.entries;
            copies.remove(&copy);
            Ok(scan.total().as_secs_f64())
        },
        async |_| {
            let copy = copies.fresh("boot");
            let boot = synthetic::boot(&copy).await;
            failed = boot.report.jobs_failed.len();
            ensure!(
                failed == built.open_jobs,
                "recovery failed {failed} steps and jobs, not the {} left open",
                built.open_jobs
            );
            let seconds = boot.total().as_secs_f64();
            drop(boot);
            copies.remove(&copy);
            Ok(seconds)
        },
    )
    .await?;
    Ok(Outcome {
        id: "P5",
        what: "restart: open + recovery",
        unit: Unit::Seconds,
        per: "to boot",
        bound: Bound::AtMost(1.5),
        rows: vec![row],
        conditions: vec![],
        notes: vec![
            format!(
                "journal: {} records ({} written), {} runs of which {} interrupted, {} steps and jobs open, {} on disk, built in {}",
                built.records,
                built.written,
                built.runs_finished + built.runs_interrupted,
                built.runs_interrupted,
                built.open_jobs,
                figure(built.bytes as f64, Unit::Bytes),
                figure(built.build.as_secs_f64(), Unit::Seconds),
            ),
            format!(
                "arbor: Journal::open + recovery::recover on a fresh copy; recovery failed {failed} steps and jobs each time"
            ),
            format!(
                "baseline: sled's open_db on a fresh copy and a walk of every key and value of every tree, nothing decoded: {entries} sled entries (events and ledger entries are held in chunks)"
            ),
        ],
    })
}

/// Fresh copies of the built journal, one a measurement.
struct Copies<'a> {
    built: &'a Built,
    scratch: PathBuf,
}

impl Copies<'_> {
    fn fresh(&self, name: &str) -> PathBuf {
        let copy = self.scratch.join(name);
        copy_dir(&self.built.journal(), &copy);
        copy
    }

    /// Once sled has let go of it.
    fn remove(&self, copy: &Path) {
        wait_until_released(copy);
        let _ = std::fs::remove_dir_all(copy);
    }
}
