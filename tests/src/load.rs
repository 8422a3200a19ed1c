//! Many small runs at once: K clients each submit a run, follow it to its
//! end, and submit the next. Each run is one step that delegates F jobs
//! (wait = true) to a scripted leaf that answers at once, then submits.
//! Driven over HTTP (an in-process `Service` on a loopback port: the real
//! router, the bearer token, arbord's typed client, SSE) or on an
//! `EmbeddedNode` (`start_run` and the event bus): the difference is the
//! service's own cost. Used by the `service_load` bench and arbor-bench's P8.

use arbor_protocol::{EventKind, JobId, NodeKind, RunId, Status};
use arbor_runtime::{EmbeddedNode, Workspace};
use arbor_service::api::SubmitRun;
use arbor_service::{Flags, Service, config};
use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// K clients, each run delegating F jobs.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub clients: usize,
    pub fanout: usize,
}

/// The workspace of a load: the `fan` step and its `leaf`. `max_running_runs`
/// is K, so no run waits in the service's queue and both drivers do the
/// same work.
pub fn workspace(shape: Shape, dir: &Path) -> Workspace {
    let leaf = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: ok}}\n---\nYou answer.\n";
    let jobs: Vec<String> = (0..shape.fanout)
        .map(|i| format!("{{agent: leaf, label: j{i}, request: go}}"))
        .collect();
    let fan = format!(
        "---\nsubagents: [leaf]\nscript:\n  - call: {{tool: delegate, args: {{wait: true, jobs: [{}]}}}}\n  - call: {{tool: submit_output, args: {{output: done}}}}\n---\nYou fan out.\n",
        jobs.join(", ")
    );
    let toml = format!(
        "[budget]\ntokens = 10000000\n[limits]\nfan_out = {}\n[service]\nmax_running_runs = {}\nmax_queued_runs = {}\n",
        shape.fanout.max(1),
        shape.clients,
        shape.clients * 4
    );
    Workspace::from_texts(
        dir.to_path_buf(),
        Some(&toml),
        &[("leaf", leaf), ("fan", &fan)],
        &[],
    )
    .unwrap_or_else(|e| panic!("the load's workspace: {e}"))
}

/// What the runs of one drive took, each from its submission.
#[derive(Default)]
pub struct Samples {
    /// To the first job's `job_running`.
    pub first_job: Vec<Duration>,
    /// To `run_finished`.
    pub end: Vec<Duration>,
    pub jobs: usize,
    pub runs: Vec<RunId>,
    /// From the first submission to the last run's end.
    pub wall: Duration,
}

impl Samples {
    pub fn jobs_per_second(&self) -> f64 {
        self.jobs as f64 / self.wall.as_secs_f64()
    }

    pub fn runs_per_second(&self) -> f64 {
        self.runs.len() as f64 / self.wall.as_secs_f64()
    }

    /// Adds another drive's samples (its wall time too).
    pub fn extend(&mut self, other: Samples) {
        self.first_job.extend(other.first_job);
        self.end.extend(other.end);
        self.jobs += other.jobs;
        self.runs.extend(other.runs);
        self.wall += other.wall;
    }
}

/// Follows one run's events and records when its first job started and
/// when it ended.
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
                assert_eq!(*status, Status::Done, "a load's run did not complete");
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

/// Runs `client` on K tasks until `deadline`, each submitting its next run
/// when the last ended.
async fn clients<F, R>(shape: Shape, seconds: Duration, client: F) -> Samples
where
    F: Fn(Arc<Mutex<Samples>>) -> R + Clone + Send + 'static,
    R: Future<Output = ()> + Send,
{
    let samples = Arc::new(Mutex::new(Samples::default()));
    let began = Instant::now();
    let deadline = began + seconds;
    let tasks: Vec<_> = (0..shape.clients)
        .map(|_| {
            let (client, samples) = (client.clone(), samples.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    client(samples.clone()).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let mut samples = std::mem::take(&mut *samples.lock().unwrap());
    samples.wall = began.elapsed();
    samples
}

/// arbord in this process, on a loopback port.
pub struct HttpLoad {
    shape: Shape,
    service: Service,
    client: arbor_service::client::Client,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl HttpLoad {
    /// A service on `dir` (its workspace in `dir/ws`, its data in `dir/data`).
    pub async fn start(shape: Shape, dir: &Path) -> HttpLoad {
        let ws = workspace(shape, &dir.join("ws"));
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
        let client = arbor_service::client::Client::new(&url, Some(token)).unwrap();
        HttpLoad {
            shape,
            service,
            client,
            stop,
            serving,
        }
    }

    /// K clients POST /v1/runs and follow each run's SSE stream to its end,
    /// for `seconds`.
    pub async fn drive(&self, seconds: Duration) -> Samples {
        let client = self.client.clone();
        clients(self.shape, seconds, move |samples| {
            let client = client.clone();
            async move {
                let run = SubmitRun {
                    flow: None,
                    agent: Some("fan".into()),
                    input: Some("go".into()),
                    budget: None,
                    record: false,
                    tenant: None,
                    on_ceiling: None,
                    pause_timeout: None,
                    priority: None,
                };
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
        .await
    }

    /// Checks that every run the API lists is terminal and that the journal
    /// says the same of each, and that the journal verifies clean; then
    /// stops the service.
    pub async fn finish(self) {
        check_http(&self.client, &self.service).await;
        let _ = self.stop.send(());
        self.serving.await.unwrap().unwrap();
    }
}

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

/// The same load on an `EmbeddedNode`, no HTTP.
pub struct EmbeddedLoad {
    shape: Shape,
    node: Arc<EmbeddedNode>,
    ws: Arc<Workspace>,
}

impl EmbeddedLoad {
    pub async fn start(shape: Shape, dir: &Path) -> EmbeddedLoad {
        let ws = workspace(shape, &dir.join("ws"));
        let node = Arc::new(EmbeddedNode::start(&ws, &dir.join("data")).await.unwrap());
        EmbeddedLoad {
            shape,
            node,
            ws: Arc::new(ws),
        }
    }

    /// K clients call `start_run` and follow the event bus to each run's
    /// end, for `seconds`.
    pub async fn drive(&self, seconds: Duration) -> Samples {
        let (node, ws) = (self.node.clone(), self.ws.clone());
        clients(self.shape, seconds, move |samples| {
            let (node, ws) = (node.clone(), ws.clone());
            async move {
                let started = Instant::now();
                let spec = ws.agent_run("fan", "go", None).unwrap();
                // The run's id is chosen before it starts, so its reader misses
                // nothing of it.
                let run = RunId::new();
                let mut live = node.events().subscribe_run(run);
                node.start_run_as(Some(run), spec).await.unwrap();
                let mut follow = Follow::new(started);
                loop {
                    let event = live.recv().await.expect("no lag at this load");
                    if follow.see(&event.kind) {
                        break;
                    }
                }
                follow.record(&samples, run);
            }
        })
        .await
    }

    pub async fn finish(self) {
        self.node.close().await.unwrap();
    }
}
