//! arbord under load, beside the same workload on an `EmbeddedNode`, in one run.
//!
//! K clients each submit a run, follow it to its end, and submit the next,
//! for S seconds. Each run is one step that delegates F jobs (wait = true)
//! to a scripted leaf that answers at once, then submits.
//!
//! - http: an in-process `Service` on a loopback port (axum, the real
//!   router, the bearer token); each client is arbord's typed client (`arbor_service::client`) that POSTs
//!   /v1/runs and follows /v1/runs/{id}/events (SSE) to the run's end.
//! - embedded: the same K clients call `EmbeddedNode::start_run` and follow
//!   the event bus.
//!
//! Each mode runs in a child process of its own (this binary, re-run with
//! `--mode`), so its peak RSS (VmHWM) is its own. `max_running_runs` is K,
//! so nothing waits in the queue and the two modes do the same work; the
//! ratio http / embedded is the service's own cost.
//!
//! Afterwards, in http mode, every run the API lists is terminal and the
//! journal agrees with the API run for run, and the journal verifies clean.
//!
//! ```text
//! cargo bench -p arbor-tests --bench service_load                 # K=50 F=8 S=60
//! cargo bench -p arbor-tests --bench service_load -- --clients 20 --fanout 4 --seconds 10
//! cargo bench -p arbor-tests --bench service_load -- --quick      # a smoke run
//! ```
//!
//! The drivers are `arbor_tests::load`, which arbor-bench's P8 uses too.
//! The last line printed is `summary {json}` for machines.

use arbor_tests::load::{EmbeddedLoad, HttpLoad, Shape};
use arbor_tests::measure::{self, Latency, round};
use std::time::Duration;

#[derive(Clone, Copy, Debug)]
struct Load {
    clients: usize,
    fanout: usize,
    seconds: u64,
}

impl Load {
    fn shape(self) -> Shape {
        Shape {
            clients: self.clients,
            fanout: self.fanout,
        }
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn load() -> Load {
    let quick = measure::quick() && arg("--clients").is_none();
    let default = if quick { (4, 2, 1) } else { (50, 8, 60) };
    let number = |name: &str, default: u64| {
        arg(name)
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name} {v}: not a number"))
            })
            .unwrap_or(default)
    };
    Load {
        clients: number("--clients", default.0) as usize,
        fanout: number("--fanout", default.1) as usize,
        seconds: number("--seconds", default.2),
    }
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// One mode, in this process: prints `result {json}`.
fn child(mode: &str, load: Load) {
    let (runtime, _) = measure::runtime();
    let dir = tempfile::tempdir().unwrap();
    let seconds = Duration::from_secs(load.seconds);
    let samples = runtime.block_on(async {
        match mode {
            "http" => {
                let http = HttpLoad::start(load.shape(), dir.path()).await;
                let samples = http.drive(seconds).await;
                http.finish().await;
                samples
            }
            _ => {
                let embedded = EmbeddedLoad::start(load.shape(), dir.path()).await;
                let samples = embedded.drive(seconds).await;
                embedded.finish().await;
                samples
            }
        }
    });
    let result = serde_json::json!({
        "mode": mode,
        "runs": samples.end.len(),
        "jobs": samples.jobs,
        "runs_per_s": round(samples.runs_per_second()),
        "jobs_per_s": round(samples.jobs_per_second()),
        "first_job": Latency::of(&samples.first_job).json(),
        "end": Latency::of(&samples.end).json(),
        "peak_rss_mib": round(peak_rss_kib() as f64 / 1024.0),
    });
    println!("result {result}");
}

fn main() {
    let load = load();
    if let Some(mode) = arg("--mode") {
        child(&mode, load);
        return;
    }
    println!(
        "service_load: {} clients, fan-out {}, {} s each mode",
        load.clients, load.fanout, load.seconds
    );
    let mut results = vec![];
    for mode in ["embedded", "http"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--mode",
                mode,
                "--clients",
                &load.clients.to_string(),
                "--fanout",
                &load.fanout.to_string(),
                "--seconds",
                &load.seconds.to_string(),
            ])
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap();
        assert!(out.status.success(), "the {mode} run failed");
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("result "))
            .expect("a result line");
        results.push(serde_json::from_str::<serde_json::Value>(line).unwrap());
    }
    println!(
        "{:<9} {:>6} {:>7} {:>8} {:>8} {:>13} {:>13} {:>13} {:>13} {:>9}",
        "mode",
        "runs",
        "jobs",
        "runs/s",
        "jobs/s",
        "1st job p50",
        "1st job p99",
        "end p50",
        "end p99",
        "peak MiB"
    );
    let ms = |v: &serde_json::Value| format!("{:.1} ms", v.as_f64().unwrap() / 1000.0);
    for r in &results {
        println!(
            "{:<9} {:>6} {:>7} {:>8} {:>8} {:>13} {:>13} {:>13} {:>13} {:>9}",
            r["mode"].as_str().unwrap(),
            r["runs"].to_string(),
            r["jobs"].to_string(),
            r["runs_per_s"].to_string(),
            r["jobs_per_s"].to_string(),
            ms(&r["first_job"]["p50_us"]),
            ms(&r["first_job"]["p99_us"]),
            ms(&r["end"]["p50_us"]),
            ms(&r["end"]["p99_us"]),
            r["peak_rss_mib"].to_string()
        );
    }
    let (e, h) = (&results[0], &results[1]);
    let ratio = |a: &serde_json::Value, b: &serde_json::Value| {
        (a.as_f64().unwrap() / b.as_f64().unwrap().max(1e-9) * 100.0).round() / 100.0
    };
    let ratios = serde_json::json!({
        "runs_per_s": ratio(&h["runs_per_s"], &e["runs_per_s"]),
        "end_p50": ratio(&h["end"]["p50_us"], &e["end"]["p50_us"]),
        "end_p99": ratio(&h["end"]["p99_us"], &e["end"]["p99_us"]),
        "first_job_p50": ratio(&h["first_job"]["p50_us"], &e["first_job"]["p50_us"]),
        "peak_rss": ratio(&h["peak_rss_mib"], &e["peak_rss_mib"]),
    });
    println!("http / embedded: {ratios}");
    println!(
        "summary {}",
        serde_json::json!({"load": {"clients": load.clients, "fanout": load.fanout, "seconds": load.seconds}, "embedded": e, "http": h, "ratios": ratios})
    );
}
