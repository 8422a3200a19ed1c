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
//! The last line printed is `summary {json}` for machines.

use arbor_protocol::{EventKind, JobId, NodeKind, RunId, Status};
use arbor_runtime::{EmbeddedNode, Workspace};
use arbor_service::api::SubmitRun;
use arbor_service::{Flags, Service, config};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arbor_tests::measure::{self, Latency, round};

#[derive(Clone, Copy, Debug)]
struct Load {
    clients: usize,
    fanout: usize,
    seconds: u64,
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

fn workspace(load: Load, dir: &std::path::Path) -> Workspace {
    let leaf = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: ok}}\n---\nYou answer.\n";
    let jobs: Vec<String> = (0..load.fanout)
        .map(|i| format!("{{agent: leaf, label: j{i}, request: go}}"))
        .collect();
    let fan = format!(
        "---\nsubagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{wait: true, jobs: [{}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}\n---\nYou fan out.\n",
        jobs.join(", ")
    );
    let toml = format!(
        "[budget]\ntokens = 10000000\n[limits]\nfan_out = {}\n[service]\nmax_running_runs = {}\nmax_queued_runs = {}\n",
        load.fanout.max(1),
        load.clients,
        load.clients * 4
    );
    Workspace::from_texts(
        dir.to_path_buf(),
        Some(&toml),
        &[("leaf", leaf), ("fan", &fan)],
        &[],
    )
    .unwrap_or_else(|e| panic!("the bench workspace: {e}"))
}

/// What one run took, from its submission.
#[derive(Default)]
struct Samples {
    first_job: Vec<Duration>,
    end: Vec<Duration>,
    jobs: usize,
    runs: Vec<RunId>,
}

/// Follows one run's events (as `Event`s, from wherever they come) and
/// records when its first job started and when it ended.
struct Follow {
    started: Instant,
    jobs: HashSet<JobId>,
    first_job: Option<Duration>,
}

impl Follow {
    fn new(started: Instant) -> Self {
        Self {
            started,
            jobs: HashSet::new(),
            first_job: None,
        }
    }

    /// True at the run's end.
    fn see(&mut self, kind: &EventKind) -> bool {
        match kind {
            EventKind::JobSpawned {
                id,
                kind: NodeKind::Job,
                ..
            } => {
                self.jobs.insert(*id);
            }
            EventKind::JobRunning { id } if self.jobs.contains(id) => {
                self.first_job.get_or_insert(self.started.elapsed());
            }
            EventKind::RunFinished { status, .. } => {
                assert_eq!(*status, Status::Done, "a bench run did not complete");
                return true;
            }
            _ => {}
        }
        false
    }

    fn record(self, samples: &Mutex<Samples>, run: RunId) {
        let mut s = samples.lock().unwrap();
        s.end.push(self.started.elapsed());
        if let Some(first) = self.first_job {
            s.first_job.push(first);
        }
        s.jobs += self.jobs.len();
        s.runs.push(run);
    }
}

async fn drive_http(load: Load, dir: &std::path::Path) -> (Samples, Duration) {
    let ws = workspace(load, &dir.join("ws"));
    let settings = config::resolve(
        &ws.config.service,
        Vec::<(String, String)>::new(),
        Flags {
            listen: Some("127.0.0.1:0".into()),
            data_dir: Some(dir.join("data")),
        },
        dir.join("data"),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let service = Service::start(ws, settings).await.unwrap();
    let token = service.token().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(service.clone().serve(listener, async {
        let _ = stopped.await;
    }));
    let samples = Arc::new(Mutex::new(Samples::default()));
    let began = Instant::now();
    let deadline = began + Duration::from_secs(load.seconds);
    let client = arbor_service::client::Client::new(&url, Some(token)).unwrap();
    let tasks: Vec<_> = (0..load.clients)
        .map(|_| {
            let (client, samples) = (client.clone(), samples.clone());
            tokio::spawn(async move {
                let run = SubmitRun {
                    flow: None,
                    agent: Some("fan".into()),
                    input: Some("go".into()),
                    budget: None,
                    record: false,
                };
                while Instant::now() < deadline {
                    let started = Instant::now();
                    let created = client.submit(&run, None).await.unwrap();
                    let mut stream = client.events(created.id, true, None).await.unwrap();
                    let mut follow = Follow::new(started);
                    while let Some(event) = stream.next().await {
                        if follow.see(&event.unwrap().event.kind) {
                            break;
                        }
                    }
                    follow.record(&samples, created.id);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let wall = began.elapsed();
    check_http(&client, &service).await;
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    (samples, wall)
}

/// Every run the API lists is terminal, and the journal says the same of each.
async fn check_http(client: &arbor_service::client::Client, service: &Service) {
    let mut listed = vec![];
    let mut after = None;
    loop {
        let page = client.runs(None, 500, after).await.unwrap();
        listed.extend(
            page.runs
                .iter()
                .map(|run| (run.id.to_string(), run.status.as_str().to_string())),
        );
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let journal = service.node().journal();
    let records = journal.runs().unwrap();
    assert_eq!(
        listed.len(),
        records.len(),
        "the API lists every journaled run"
    );
    for (id, status) in &listed {
        let record = records
            .iter()
            .find(|r| r.id.to_string() == *id)
            .expect("journaled");
        assert_eq!(
            record.status.as_str(),
            status,
            "{id}: the journal and the API agree"
        );
        assert!(
            record.status.is_terminal(),
            "{id} is {status} after the load"
        );
    }
    let report = journal.verify().unwrap();
    assert!(report.is_clean(), "{report:?}");
}

async fn drive_embedded(load: Load, dir: &std::path::Path) -> (Samples, Duration) {
    let ws = workspace(load, &dir.join("ws"));
    let node = Arc::new(EmbeddedNode::start(&ws, &dir.join("data")).await.unwrap());
    let ws = Arc::new(ws);
    let samples = Arc::new(Mutex::new(Samples::default()));
    let began = Instant::now();
    let deadline = began + Duration::from_secs(load.seconds);
    let tasks: Vec<_> = (0..load.clients)
        .map(|_| {
            let (node, ws, samples) = (node.clone(), ws.clone(), samples.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let started = Instant::now();
                    let mut live = node.events().subscribe();
                    let spec = ws.agent_run("fan", "go", None).unwrap();
                    let run = node.start_run(spec).await.unwrap();
                    let mut follow = Follow::new(started);
                    loop {
                        let event = live.recv().await.expect("no lag at this load");
                        if event.run == run && follow.see(&event.kind) {
                            break;
                        }
                    }
                    follow.record(&samples, run);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let wall = began.elapsed();
    node.close().await.unwrap();
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    (samples, wall)
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
    let (samples, wall) = runtime.block_on(async {
        match mode {
            "http" => drive_http(load, dir.path()).await,
            _ => drive_embedded(load, dir.path()).await,
        }
    });
    let secs = wall.as_secs_f64();
    let result = serde_json::json!({
        "mode": mode,
        "runs": samples.end.len(),
        "jobs": samples.jobs,
        "runs_per_s": round(samples.end.len() as f64 / secs),
        "jobs_per_s": round(samples.jobs as f64 / secs),
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
