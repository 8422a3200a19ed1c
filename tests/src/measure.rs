//! What benchmarks measure with: how a bench binary picks its sizes, the
//! runtime it runs on, the process CPU clock, latency figures, medians, and
//! the raw write + `fdatasync` that durable writes are set beside. Shared by
//! `tests/benches/*` and `arbor-bench`.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// `cargo bench` passes `--bench` (and a filter, if given); `cargo test
/// --all-targets` runs a bench binary without it, and gets the smoke run, as
/// criterion does. `--quick` asks for the smoke run; anything else is ignored.
pub fn quick() -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench")
}

/// A multi-thread tokio runtime, one worker per core, and its worker count.
pub fn runtime() -> (tokio::runtime::Runtime, usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let workers = runtime.metrics().num_workers();
    (runtime, workers)
}

/// CPU time this process has used, user and system, on every thread: the
/// tokio workers, the journal's flusher and sled's own I/O threads.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    pub user: Duration,
    pub system: Duration,
}

impl Cpu {
    pub fn now() -> Cpu {
        use nix::sys::resource::{UsageWho, getrusage};
        use nix::sys::time::TimeValLike;
        let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage of this process");
        let of = |t: nix::sys::time::TimeVal| Duration::from_micros(t.num_microseconds() as u64);
        Cpu {
            user: of(usage.user_time()),
            system: of(usage.system_time()),
        }
    }

    pub fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user: self.user - before.user,
            system: self.system - before.system,
        }
    }

    pub fn total(self) -> Duration {
        self.user + self.system
    }
}

/// Latency figures of one series, in microseconds.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub samples: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

impl Latency {
    pub fn of(samples: &[Duration]) -> Latency {
        assert!(!samples.is_empty(), "a series with no samples");
        let mut sorted = samples.to_vec();
        sorted.sort();
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        // Nearest rank: the smallest sample with at least p% of them at or below it.
        let rank = |p: f64| {
            let index = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
            micros(sorted[index.clamp(1, sorted.len()) - 1])
        };
        Latency {
            samples: sorted.len(),
            mean_us: sorted.iter().map(|d| micros(*d)).sum::<f64>() / sorted.len() as f64,
            p50_us: rank(50.0),
            p99_us: rank(99.0),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "n": self.samples,
            "mean_us": round(self.mean_us),
            "p50_us": round(self.p50_us),
            "p99_us": round(self.p99_us),
        })
    }

    /// The header of a table of `print_row`s with names `width` wide.
    pub fn print_header(width: usize) {
        println!(
            "{:<width$} {:>6} {:>11} {:>11} {:>11}",
            "latency", "n", "mean µs", "p50 µs", "p99 µs"
        );
    }

    pub fn print_row(&self, name: &str, width: usize) {
        println!(
            "{name:<width$} {:>6} {:>11.1} {:>11.1} {:>11.1}",
            self.samples, self.mean_us, self.p50_us, self.p99_us
        );
    }
}

/// One decimal place, for the summary lines.
pub fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// The middle value (the upper middle of an even count).
pub fn median(xs: &[f64]) -> f64 {
    assert!(!xs.is_empty(), "a median of nothing");
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Where each write of a `RawLog` goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawWrite {
    /// At the end of the file: its size changes, as a log's does.
    Append,
    /// Over the first bytes: data only, no size to commit.
    Overwrite,
}

/// A plain file written a few bytes at a time, each write followed by
/// `fdatasync`: the floor a durable write on this filesystem cannot beat.
pub struct RawLog {
    file: File,
}

impl RawLog {
    /// Creates `raw.log` in `dir` (which decides the filesystem measured).
    pub fn create(dir: &Path) -> RawLog {
        RawLog {
            file: File::create(dir.join("raw.log")).expect("a raw log file"),
        }
    }

    /// One write of `bytes`, then `fdatasync`.
    pub fn write_synced(&mut self, bytes: &[u8], how: RawWrite) {
        use std::os::unix::fs::FileExt;
        match how {
            RawWrite::Append => self.file.write_all(bytes),
            RawWrite::Overwrite => self.file.write_all_at(bytes, 0),
        }
        .expect("the raw write");
        self.file.sync_data().expect("fdatasync");
    }
}
