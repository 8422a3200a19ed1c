//! arbord in-process on a loopback port, for tests over real HTTP: a
//! `Service` on a temporary data dir, served by axum on 127.0.0.1:0, and
//! arbord's typed client (`arbor_service::client`) carrying its token.
//!
//! ```
//! # #[tokio::main] async fn main() {
//! use arbor_testkit::agent_md;
//! use arbor_testkit::protocol::Status;
//! use arbor_testkit::service::{TestService, Texts, status_of};
//! let quick = agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}");
//! let flow = "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"go\" }]\n";
//! let svc = TestService::start(Texts::new(&[("quick", &quick)], &[("hello", flow)])).await;
//! let run = svc.submit(serde_json::json!({"flow": "hello"})).await;
//! assert_eq!(status_of(&svc.wait_run(run).await), Status::Done);
//! let (code, _) = svc.get_json(&format!("/v1/runs/{run}")).await;
//! assert_eq!(code, 200);
//! assert!(!svc.events(run, None).await.is_empty());
//! assert_eq!(svc.submissions().len(), 1);
//! // A drain (SIGTERM's), then a start on the same data dir: the run is still there.
//! let svc = svc.restart().await;
//! assert_eq!(svc.get_json(&format!("/v1/runs/{run}")).await.0, 200);
//! svc.stop().await;
//! # }
//! ```

use crate::WAIT_LIMIT;
use arbor_protocol::{RunId, Status};
use arbor_runtime::Workspace;
use arbor_service::client::{Client, Method};
use arbor_service::{Flags, Service, config};
use std::path::{Path, PathBuf};

/// A workspace as texts: arbor.toml, agents (name, agent.md) and flows (name, TOML).
#[derive(Clone, Default)]
pub struct Texts {
    pub arbor_toml: Option<String>,
    pub agents: Vec<(String, String)>,
    pub flows: Vec<(String, String)>,
    /// Schedules move only when the test calls `TestService::run_schedules`.
    pub manual_clock: bool,
}

impl Texts {
    pub fn new(agents: &[(&str, &str)], flows: &[(&str, &str)]) -> Self {
        Self {
            arbor_toml: None,
            manual_clock: false,
            agents: agents
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            flows: flows
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    pub fn with_config(mut self, arbor_toml: &str) -> Self {
        self.arbor_toml = Some(arbor_toml.to_string());
        self
    }

    /// Schedules follow the test's clock (`TestService::run_schedules`),
    /// not the machine's.
    pub fn with_manual_clock(mut self) -> Self {
        self.manual_clock = true;
        self
    }

    fn workspace(&self, dir: &Path) -> Workspace {
        let agents: Vec<(&str, &str)> = self
            .agents
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let flows: Vec<(&str, &str)> = self
            .flows
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        Workspace::from_texts(
            dir.to_path_buf(),
            self.arbor_toml.as_deref(),
            &agents,
            &flows,
        )
        .unwrap_or_else(|e| panic!("the test workspace does not load: {e}"))
    }
}

/// A served node and a client for it.
pub struct TestService {
    pub url: String,
    pub token: String,
    /// arbord's typed client, with the token.
    pub api: Client,
    pub service: Service,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    dir: Option<tempfile::TempDir>,
    /// What `dir` is, or the folder `start_at` was given.
    root: PathBuf,
    texts: Texts,
}

impl TestService {
    pub async fn start(texts: Texts) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Self::start_in(dir, texts).await
    }

    /// Starts on `dir/data` (a restart, when a service ran there before).
    pub async fn start_in(dir: tempfile::TempDir, texts: Texts) -> Self {
        let root = dir.path().to_path_buf();
        Self::start_on(root, Some(dir), texts).await
    }

    /// Starts on `root/data`, a folder the caller keeps (a crash test's,
    /// which another process shares).
    pub async fn start_at(root: &Path, texts: Texts) -> Self {
        Self::start_on(root.to_path_buf(), None, texts).await
    }

    async fn start_on(root: PathBuf, dir: Option<tempfile::TempDir>, texts: Texts) -> Self {
        let workspace = texts.workspace(&root.join("workspace"));
        let settings = config::resolve(
            &workspace.config.service,
            Vec::<(String, String)>::new(),
            Flags {
                listen: Some("127.0.0.1:0".into()),
                data_dir: Some(root.join("data")),
            },
            PathBuf::new(),
        )
        .unwrap_or_else(|e| panic!("the service settings: {e}"));
        let settings = arbor_service::ServiceConfig {
            schedule_clock: !texts.manual_clock,
            ..settings
        };
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .expect("a loopback port");
        let url = format!("http://{}", listener.local_addr().expect("an address"));
        let service = Service::start(workspace, settings)
            .await
            .unwrap_or_else(|e| panic!("the service starts: {e}"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(service.clone().serve(listener, async {
            let _ = stopped.await;
        }));
        let token = service.token().to_string();
        Self {
            api: Client::new(&url, Some(token.clone())).expect("a loopback URL"),
            url,
            token,
            service,
            stop: Some(stop),
            serving: Some(serving),
            dir,
            root,
            texts,
        }
    }

    /// What the journal's admission queue holds, in every state.
    pub fn submissions(&self) -> Vec<arbor_service::SubmissionRecord> {
        arbor_service::submission::submissions(self.service.node().journal())
            .expect("the journal reads")
    }

    /// Moves every schedule to `now` (a test's clock; see `with_manual_clock`).
    pub async fn run_schedules(&self, now: std::time::SystemTime) {
        self.service
            .run_schedules(now)
            .await
            .unwrap_or_else(|e| panic!("the schedules ran: {}", e.message));
    }

    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    /// A request with the token, built by hand (headers, methods).
    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.api.request(Method::GET, path)
    }

    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.api.request(Method::POST, path)
    }

    /// A client without the token.
    pub fn http(&self) -> &reqwest::Client {
        self.api.http()
    }

    /// POSTs JSON and returns the status and the body as JSON.
    pub async fn post_json(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        self.api
            .post_json(path, &body)
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"))
    }

    pub async fn get_json(&self, path: &str) -> (u16, serde_json::Value) {
        self.api
            .get_json(path)
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// Submits and returns the new run's id (fails the test unless 201).
    pub async fn submit(&self, body: serde_json::Value) -> RunId {
        let (status, reply) = self.post_json("/v1/runs", body).await;
        assert_eq!(status, 201, "{reply}");
        reply["id"]
            .as_str()
            .expect("an id")
            .parse()
            .expect("a run id")
    }

    /// Follows the run's event stream from `after` until it ends; returns
    /// each message's `id:` and parsed `data:`.
    pub async fn events(&self, run: RunId, after: Option<u64>) -> Vec<(u64, serde_json::Value)> {
        self.events_until(run, after, |_| false).await
    }

    /// As `events`, stopping early at the first event `stop` accepts.
    pub async fn events_until(
        &self,
        run: RunId,
        after: Option<u64>,
        mut stop: impl FnMut(&serde_json::Value) -> bool,
    ) -> Vec<(u64, serde_json::Value)> {
        let follow = async {
            let mut stream = self
                .api
                .events(run, true, after)
                .await
                .unwrap_or_else(|e| panic!("the event stream of {run}: {e}"));
            let mut seen = vec![];
            while let Some(event) = stream.next_json().await {
                let (id, data) = event.expect("a well-formed event stream");
                let done = stop(&data);
                seen.push((id, data));
                if done {
                    break;
                }
            }
            seen
        };
        tokio::time::timeout(WAIT_LIMIT, follow)
            .await
            .unwrap_or_else(|_| panic!("the event stream of {run} did not end"))
    }

    /// Waits for the run to end (over its event stream) and returns its document.
    pub async fn wait_run(&self, run: RunId) -> serde_json::Value {
        self.events(run, None).await;
        let (status, doc) = self.get_json(&format!("/v1/runs/{run}")).await;
        assert_eq!(status, 200, "{doc}");
        doc
    }

    /// Waits until a step or job of the run is running; returns its id.
    pub async fn wait_running(&self, run: RunId) -> String {
        let seen = self
            .events_until(run, None, |e| e["kind"]["type"] == "job_running")
            .await;
        let last = seen.last().expect("an event");
        assert_eq!(last.1["kind"]["type"], "job_running", "the run ended first");
        last.1["kind"]["id"].as_str().expect("an id").to_string()
    }

    /// Drains the service as SIGTERM would (I-40) and returns its dir, to
    /// start again on.
    pub async fn stop(mut self) -> tempfile::TempDir {
        self.drain().await;
        self.dir.take().expect("the dir")
    }

    /// Drains the service as SIGTERM would; its folder stays.
    pub async fn shut(mut self) {
        self.drain().await;
    }

    async fn drain(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(serving) = self.serving.take() {
            tokio::time::timeout(WAIT_LIMIT, serving)
                .await
                .expect("the drain ends")
                .expect("the server task")
                .expect("the server");
        }
    }

    /// Drains, then starts again on the same data dir and workspace.
    pub async fn restart(self) -> Self {
        let texts = self.texts.clone();
        let dir = self.stop().await;
        Self::start_in(dir, texts).await
    }
}

/// The status of a run document's root.
pub fn status_of(doc: &serde_json::Value) -> Status {
    serde_json::from_value(doc["run"]["status"].clone()).expect("a status")
}
