//! The message-level harness: a real in-process node on a temporary journal,
//! agents loaded from strings, scripted models, and verbs to drive and read it.
//!
//! ```no_run
//! # async fn demo() {
//! use arbor_testkit::{agent_md, TestNode};
//! let node = TestNode::start(&[(
//!     "solo",
//!     &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"),
//! )])
//! .await;
//! let run = node.run_agent("solo", "say hi").await;
//! let tree = node.wait_run(run).await;
//! assert_eq!(tree.root().output, "hi");
//! # }
//! ```
//!
//! Every wait has a guard: past `WAIT_LIMIT` it panics with the tree, so a
//! broken promise fails the test instead of hanging it.

pub mod backend;
pub mod checks;
pub mod explore;
pub mod faults;

/// arbor's shared types (the tree, statuses, ids), so a test needs no other arbor crate.
pub use arbor_protocol as protocol;
/// The scripted models, and a workspace as loaded: what `start_full`, `start_workspace` and `open` take.
pub use arbor_runtime::{DefaultModels, Models, Workspace};
pub use explore::{Scenario, explore_crashes};
pub mod mock_provider;
pub mod random_crashes;
pub mod replay;
pub mod service;

use arbor_actors::model::{
    CallMeter, Model, ModelError, ModelFactory, ModelInfo, ModelReply, ModelRequest,
};
use arbor_protocol::{
    AgentDef, Event, EventKind, JobId, NodeKind, ParentRef, Refusal, RunId, Tree, TreeNode,
};
use arbor_runtime::EmbeddedNode;
use arbor_storage::{Journal, LedgerRecord, ledger_totals};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long any wait may take before the test fails with the tree printed.
pub const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// An agent.md text from its front matter (YAML) and a one-line prompt.
pub fn agent_md(front_matter: &str) -> String {
    format!("---\n{front_matter}\n---\nYou are a test agent.\n")
}

/// A `script:` (its lines, without the key) that runs each of `commands`
/// with exec, one a turn, then answers `done`.
pub fn exec_script(commands: &[&str]) -> String {
    let mut script = String::new();
    for command in commands {
        script.push_str(&format!(
            "  - call: {{tool: exec, args: {{command: {}}}}}\n",
            serde_json::to_string(command).expect("a string serializes")
        ));
    }
    script.push_str("  - call: {tool: submit_output, args: {output: done}}\n");
    script
}

/// Writes `text` as a secrets file of mode `mode` in `dir`, and returns the
/// arbor.toml that names it.
pub fn secrets_file(dir: &std::path::Path, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let file = dir.join("secrets.env");
    std::fs::write(&file, text).expect("the secrets file is written");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode))
        .expect("its mode is set");
    format!(
        "[sandbox]\nsecrets_file = {:?}\n",
        file.display().to_string()
    )
}

/// One `ToolCalled` event, as `TestNode::tool_calls` gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub job: JobId,
    pub tool: String,
    pub ok: bool,
    pub detail: String,
}

/// A real node on a temporary data dir.
pub struct TestNode {
    node: EmbeddedNode,
    /// The temporary folder the node's data dir is in, if the node made it.
    dir: Option<tempfile::TempDir>,
    data: PathBuf,
    pub workspace: Workspace,
    models: Arc<dyn ModelFactory>,
}

impl TestNode {
    /// Starts a node on these agents (name, agent.md text) with default limits.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let run = node.run_agent("solo", "go").await;
    /// assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    /// # }
    /// ```
    pub async fn start(agents: &[(&str, &str)]) -> Self {
        Self::start_inner(None, agents, &[], None).await
    }

    /// Starts a node with an arbor.toml text, and the models it configures
    /// (the scripted one, and its `[providers]`).
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// let node = TestNode::start_with_config(
    ///     "[limits]\ndepth = 1\n",
    ///     &[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))],
    /// ).await;
    /// assert_eq!(node.workspace.config.limits.depth, 1);
    /// # }
    /// ```
    pub async fn start_with_config(arbor_toml: &str, agents: &[(&str, &str)]) -> Self {
        Self::start_inner(Some(arbor_toml), agents, &[], None).await
    }

    /// Starts a node on arbor.toml, agents and flows, its models the
    /// providers arbor.toml configures (a `MockProvider`'s, say).
    pub async fn start_with_flows(
        arbor_toml: &str,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
    ) -> Self {
        Self::start_inner(Some(arbor_toml), agents, flows, None).await
    }

    /// Starts a node with the models a test chooses (a recorder, faults).
    pub async fn start_full(
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        models: Arc<dyn ModelFactory>,
    ) -> Self {
        Self::start_workspace(arbor_toml, agents, &[], models).await
    }

    /// Starts a node on a whole workspace: arbor.toml, agents and flows (name, TOML text).
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// let flow = "[[group]]\nsteps = [{ agent = \"solo\", instruction = \"go\" }]\n";
    /// let node = TestNode::start_workspace(
    ///     None,
    ///     &[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))],
    ///     &[("hello", flow)],
    ///     std::sync::Arc::new(arbor_testkit::DefaultModels),
    /// ).await;
    /// let run = node.run_flow("hello").await;
    /// assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    /// # }
    /// ```
    pub async fn start_workspace(
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
        models: Arc<dyn ModelFactory>,
    ) -> Self {
        Self::start_inner(arbor_toml, agents, flows, Some(models)).await
    }

    /// Starts a node on a workspace folder (agents/, flows/, arbor.toml), as
    /// `arbor run` takes it, with its own models, on a temporary data dir.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// let node = TestNode::start_dir("../examples/research").await;
    /// let run = node.run_flow("research").await;
    /// assert_eq!(node.wait_run(run).await.run_status(), Status::Done);
    /// # }
    /// ```
    pub async fn start_dir(dir: impl AsRef<std::path::Path>) -> Self {
        let dir = dir.as_ref();
        let workspace = Workspace::load(dir)
            .unwrap_or_else(|e| panic!("the workspace {} does not load: {e}", dir.display()));
        let temp = tempfile::tempdir().expect("a temporary directory");
        Self::start_in(temp, workspace, None).await
    }

    /// `start_dir` with the models a test chooses (a recorder, faults).
    pub async fn start_dir_with(
        dir: impl AsRef<std::path::Path>,
        models: Arc<dyn ModelFactory>,
    ) -> Self {
        let dir = dir.as_ref();
        let workspace = Workspace::load(dir)
            .unwrap_or_else(|e| panic!("the workspace {} does not load: {e}", dir.display()));
        let temp = tempfile::tempdir().expect("a temporary directory");
        Self::start_in(temp, workspace, Some(models)).await
    }

    /// `models` None: the workspace's own (`Models` of its arbor.toml).
    async fn start_inner(
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
        models: Option<Arc<dyn ModelFactory>>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let workspace =
            Workspace::from_texts(dir.path().join("workspace"), arbor_toml, agents, flows)
                .unwrap_or_else(|e| panic!("the test workspace does not load: {e}"));
        Self::start_in(dir, workspace, models).await
    }

    /// A node of `workspace` on `dir/data`, which it keeps; `models` None:
    /// the workspace's own.
    async fn start_in(
        dir: tempfile::TempDir,
        mut workspace: Workspace,
        models: Option<Arc<dyn ModelFactory>>,
    ) -> Self {
        let models = models.unwrap_or_else(|| Arc::new(Models::new(&workspace.config.providers)));
        let data = dir.path().join("data");
        workspace.config.journal = backend::journal_for(&data, &workspace.config.journal);
        let node = EmbeddedNode::start_with(&workspace, &data, models.clone())
            .await
            .expect("the node starts");
        Self {
            node,
            dir: Some(dir),
            data,
            workspace,
            models,
        }
    }

    /// Starts a node of `workspace` on a data dir of the caller's (which it
    /// leaves in place): recovery runs first, and the interrupted runs that
    /// can be are resumed. An error if the node does not start.
    pub async fn open(
        mut workspace: Workspace,
        data_dir: &std::path::Path,
        models: Arc<dyn ModelFactory>,
    ) -> Result<Self, arbor_runtime::Error> {
        workspace.config.journal = backend::journal_for(data_dir, &workspace.config.journal);
        let node = EmbeddedNode::start_with(&workspace, data_dir, models.clone()).await?;
        Ok(Self {
            node,
            dir: None,
            data: data_dir.to_path_buf(),
            workspace,
            models,
        })
    }

    /// Drops the node the way a crash would (every actor killed at once, no
    /// stop handlers, nothing journaled on the way out), then starts a new
    /// node on the same journal: recovery runs before anything else.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("slow", &agent_md("script:\n  - say: thinking\n    delay: 1h"))]).await;
    /// let run = node.run_agent("slow", "go").await;
    /// node.wait_status(run, "slow", Status::Running).await;
    /// let node = node.crash_and_restart().await;
    /// assert_eq!(node.node().recovery().jobs_failed.len(), 1);
    /// # }
    /// ```
    pub async fn crash_and_restart(self) -> Self {
        let Self {
            node,
            dir,
            data,
            workspace,
            models,
        } = self;
        node.crash().await;
        let node = EmbeddedNode::start_with(&workspace, &data, models.clone())
            .await
            .expect("the node restarts on the same journal");
        Self {
            node,
            dir,
            data,
            workspace,
            models,
        }
    }

    /// Crashes the node and keeps its data: the returned folder holds
    /// `data/journal` and `data/work` for the test to inspect. For a node
    /// `start` made (one `open`ed on the caller's data dir has no folder
    /// of its own to hand back, and panics).
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// let dir = node.crash().await;
    /// assert!(dir.path().join("data/journal").is_dir());
    /// # }
    /// ```
    pub async fn crash(self) -> tempfile::TempDir {
        self.node.crash().await;
        self.dir
            .expect("a node started on a data dir of its own (`open` leaves the dir to its caller)")
    }

    /// Runs flow `name` with its own budget.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// let flow = "[[group]]\nsteps = [{ agent = \"solo\", instruction = \"go\" }]\n";
    /// let node = TestNode::start_workspace(None, &[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))], &[("hello", flow)], std::sync::Arc::new(arbor_testkit::DefaultModels)).await;
    /// let run = node.run_flow("hello").await;
    /// node.wait_run(run).await;
    /// # }
    /// ```
    pub async fn run_flow(&self, name: &str) -> RunId {
        let spec = self
            .workspace
            .flow_run(name, None)
            .unwrap_or_else(|e| panic!("{e}"));
        self.node
            .start_run(spec)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn node(&self) -> &EmbeddedNode {
        &self.node
    }

    pub fn journal(&self) -> &Journal {
        self.node.journal()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data.clone()
    }

    /// Runs one agent on `input` with the default budget.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let run = node.run_agent("solo", "say hi").await;
    /// assert_eq!(node.wait_run(run).await.root().output, "hi");
    /// # }
    /// ```
    pub async fn run_agent(&self, agent: &str, input: &str) -> RunId {
        self.run_agent_with_budget(agent, input, None).await
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let run = node.run_agent_with_budget("solo", "go", Some(5_000)).await;
    /// assert_eq!(node.wait_run(run).await.root().account.grant, 5_000);
    /// # }
    /// ```
    pub async fn run_agent_with_budget(
        &self,
        agent: &str,
        input: &str,
        tokens: Option<u64>,
    ) -> RunId {
        let spec = self
            .workspace
            .agent_run(agent, input, tokens)
            .unwrap_or_else(|e| panic!("{e}"));
        self.node
            .start_run(spec)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert_eq!(node.tree(run).root().output, "hi");
    /// # }
    /// ```
    pub fn tree(&self, run: RunId) -> Tree {
        self.node.tree(run)
    }

    /// Waits for the run to end; returns its tree.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// let tree = node.wait_run(run).await;
    /// assert!(tree.run_status().is_terminal());
    /// # }
    /// ```
    pub async fn wait_run(&self, run: RunId) -> Tree {
        self.wait_until(run, |t| t.run_status().is_terminal()).await
    }

    /// Waits until `done` holds of the run's tree, re-checked after every event.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// let tree = node.wait_until(run, |t| t.find("solo").is_some()).await;
    /// assert!(tree.find("solo").is_some());
    /// # }
    /// ```
    pub async fn wait_until(&self, run: RunId, done: impl FnMut(&Tree) -> bool) -> Tree {
        match tokio::time::timeout(WAIT_LIMIT, self.node.wait_tree(run, done)).await {
            Ok(tree) => tree,
            Err(_) => panic!(
                "waited {WAIT_LIMIT:?} in vain; the tree:\n{}",
                serde_json::to_string_pretty(&self.tree(run).root()).unwrap_or_default()
            ),
        }
    }

    /// Waits until the run has an event for which `matches` holds; returns it.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// use arbor_testkit::protocol::EventKind;
    /// let event = node.wait_event(run, |k| matches!(k, EventKind::RunFinished { .. })).await;
    /// assert_eq!(event.run, run);
    /// # }
    /// ```
    pub async fn wait_event(
        &self,
        run: RunId,
        mut matches: impl FnMut(&EventKind) -> bool,
    ) -> Event {
        let mut found = None;
        self.wait_until(run, |_| {
            found = self.events(run).into_iter().find(|e| matches(&e.kind));
            found.is_some()
        })
        .await;
        found.expect("found above")
    }

    /// Waits until the node labelled (or, failing that, running agent) `name` exists.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// let step = node.wait_for(run, "solo").await;
    /// assert!(node.tree(run).node(step).is_some());
    /// # }
    /// ```
    pub async fn wait_for(&self, run: RunId, name: &str) -> JobId {
        let tree = self.wait_until(run, |t| t.find(name).is_some()).await;
        tree.find(name).expect("found above")
    }

    /// Waits until `name` has this status.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// let step = node.wait_status(run, "solo", Status::Done).await;
    /// assert_eq!(step.output, "hi");
    /// # }
    /// ```
    pub async fn wait_status(
        &self,
        run: RunId,
        name: &str,
        status: arbor_protocol::Status,
    ) -> TreeNode {
        let tree = self
            .wait_until(run, |t| {
                t.find(name)
                    .and_then(|id| t.node(id))
                    .is_some_and(|n| n.status == status)
            })
            .await;
        tree.node(tree.find(name).expect("found"))
            .expect("exists")
            .clone()
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("slow", &agent_md("script:\n  - say: thinking\n    delay: 1h"))]).await;
    /// let run = node.run_agent("slow", "go").await;
    /// node.wait_status(run, "slow", Status::Running).await;
    /// node.stop_run(run).await;
    /// assert_eq!(node.wait_run(run).await.run_status(), Status::Stopped);
    /// # }
    /// ```
    pub async fn stop_run(&self, run: RunId) {
        self.node
            .stop_run(run, "stopped by the test")
            .await
            .expect("stop the run");
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("slow", &agent_md("script:\n  - say: thinking\n    delay: 1h"))]).await;
    /// let run = node.run_agent("slow", "go").await;
    /// let step = node.wait_for(run, "slow").await;
    /// node.wait_status(run, "slow", Status::Running).await;
    /// node.stop_job(run, step).await;
    /// assert_eq!(node.wait_status(run, "slow", Status::Stopped).await.status, Status::Stopped);
    /// # }
    /// ```
    pub async fn stop_job(&self, run: RunId, job: JobId) {
        self.node
            .stop_job(run, job, "stopped by an operator")
            .await
            .expect("stop the job");
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("slow", &agent_md("script:\n  - say: thinking\n    delay: 1h"))]).await;
    /// let run = node.run_agent("slow", "go").await;
    /// let step = node.wait_for(run, "slow").await;
    /// node.wait_status(run, "slow", Status::Running).await;
    /// assert_eq!(node.steer(step, "use metric units").await, Ok(1));
    /// # }
    /// ```
    pub async fn steer(&self, job: JobId, text: &str) -> Result<u64, Refusal> {
        self.node.steer(job, text).await
    }

    /// The run's events as journaled.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert!(!node.events(run).is_empty());
    /// # }
    /// ```
    pub fn events(&self, run: RunId) -> Vec<Event> {
        self.journal().events(run).expect("events decode")
    }

    /// The models the node was started with, for a node `open`ed on its data later.
    pub fn models(&self) -> Arc<dyn ModelFactory> {
        self.models.clone()
    }

    /// Waits until the run has an approval card that is pending, and returns
    /// the oldest such (I-46). The card is in the journal before its event.
    pub async fn wait_card(&self, run: RunId) -> arbor_protocol::Card {
        let mut found = None;
        self.wait_until(run, |_| {
            found = self
                .node
                .approvals(Some(run), Some(arbor_protocol::CardState::Pending))
                .expect("cards decode")
                .into_iter()
                .next();
            found.is_some()
        })
        .await;
        found.expect("found above")
    }

    /// Every approval card of the run, oldest first, whatever its state.
    pub fn cards(&self, run: RunId) -> Vec<arbor_protocol::Card> {
        self.node.approvals(Some(run), None).expect("cards decode")
    }

    /// Decides a card as the person named `by` would through the API.
    pub async fn decide(
        &self,
        card: arbor_protocol::CardId,
        verdict: arbor_protocol::Verdict,
        reason: Option<&str>,
        args: Option<serde_json::Value>,
    ) -> Result<arbor_protocol::Card, arbor_runtime::DecideError> {
        self.node
            .decide(
                card,
                arbor_runtime::Decide {
                    verdict,
                    reason: reason.map(str::to_string),
                    args,
                    answer: None,
                    by: "tester".into(),
                    audit: None,
                },
            )
            .await
    }

    /// Answers a question card (`ask_person`, I-60) as the person named
    /// `tester` would through the API.
    pub async fn answer(
        &self,
        card: arbor_protocol::CardId,
        answer: &str,
    ) -> Result<arbor_protocol::Card, arbor_runtime::DecideError> {
        self.node
            .decide(
                card,
                arbor_runtime::Decide {
                    verdict: arbor_protocol::Verdict::Answer,
                    reason: None,
                    args: None,
                    answer: Some(answer.to_string()),
                    by: "tester".into(),
                    audit: None,
                },
            )
            .await
    }

    /// The error texts of the run's failed calls to `tool`, in order.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert!(node.failed_calls(run, "submit_output").is_empty());
    /// # }
    /// ```
    pub fn failed_calls(&self, run: RunId, tool: &str) -> Vec<String> {
        self.tool_calls(run)
            .into_iter()
            .filter(|c| !c.ok && c.tool == tool)
            .map(|c| c.detail)
            .collect()
    }

    /// Every tool call of the run, in order: who made it, which tool, and
    /// its result.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// let calls = node.tool_calls(run);
    /// assert_eq!((calls[0].tool.as_str(), calls[0].ok), ("submit_output", true));
    /// # }
    /// ```
    pub fn tool_calls(&self, run: RunId) -> Vec<ToolCall> {
        self.events(run)
            .into_iter()
            .filter_map(|e| match e.kind {
                EventKind::ToolCalled {
                    id,
                    tool,
                    ok,
                    detail,
                    ..
                } => Some(ToolCall {
                    job: id,
                    tool,
                    ok,
                    detail,
                }),
                _ => None,
            })
            .collect()
    }

    /// Runs `f` on every later event, synchronously at emission.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    /// let count = seen.clone();
    /// node.observe(move |_| { count.fetch_add(1, std::sync::atomic::Ordering::Relaxed); });
    /// let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert!(seen.load(std::sync::atomic::Ordering::Relaxed) > 0);
    /// # }
    /// ```
    pub fn observe(&self, f: impl Fn(&Event) + Send + Sync + 'static) {
        self.node
            .events()
            .observe(Arc::new(move |event: &Arc<Event>| f(event)));
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// let entries = node.ledger(arbor_testkit::protocol::ParentRef::Run(run));
    /// assert!(!entries.is_empty());
    /// # }
    /// ```
    pub fn ledger(&self, owner: ParentRef) -> Vec<LedgerRecord> {
        self.journal().ledger(owner).expect("ledger decodes")
    }

    /// I-14 at a quiescent point, from two sides: the tree's figures add up,
    /// and every account's ledger in the journal gives the same figures.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// node.assert_conserved(run);
    /// # }
    /// ```
    pub fn assert_conserved(&self, run: RunId) {
        let tree = self.tree(run);
        if let Err(breaches) = tree.check_conservation() {
            panic!("conservation broken:\n{}", breaches.join("\n"));
        }
        let root = tree.root();
        let mut owners = vec![(ParentRef::Run(run), root.account, root.usd)];
        owners.extend(
            tree.nodes()
                .map(|(id, n)| (ParentRef::Job(id), n.account, n.usd)),
        );
        for (owner, view, usd) in owners {
            let entries = self.ledger(owner);
            let totals = ledger_totals(&entries, arbor_storage::Unit::Tokens);
            assert_eq!(
                (totals.grant, totals.spent, totals.held),
                (view.grant, view.spent, view.held),
                "the journal's ledger of {owner:?} disagrees with the tree"
            );
            let usd_totals =
                arbor_storage::usd_totals(&entries).map(|t| (t.grant, t.spent, t.held));
            assert_eq!(
                usd_totals,
                usd.map(|u| (u.grant, u.spent, u.held)),
                "the journal's micro-dollars of {owner:?} disagree with the tree"
            );
        }
        let report = self.journal().verify().expect("the journal reads");
        assert!(report.breaches.is_empty(), "verify: {:#?}", report.breaches);
    }

    /// A job's workdir, from its spawn event.
    pub fn workdir(&self, run: RunId, job: JobId) -> PathBuf {
        self.events(run)
            .into_iter()
            .find_map(|e| match e.kind {
                EventKind::JobSpawned { id, workdir, .. } if id == job => {
                    Some(PathBuf::from(workdir))
                }
                _ => None,
            })
            .expect("the job was spawned")
    }

    /// Every step and job of the run.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert_eq!(node.jobs(run).len(), 1);
    /// # }
    /// ```
    pub fn jobs(&self, run: RunId) -> Vec<TreeNode> {
        let tree = self.tree(run);
        tree.nodes()
            .filter(|(_, n)| n.kind != NodeKind::Run)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// How many jobs of `agent` in the run ended done.
    ///
    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// assert_eq!(node.jobs_done(run, "solo"), 1);
    /// # }
    /// ```
    pub fn jobs_done(&self, run: RunId, agent: &str) -> usize {
        self.jobs(run)
            .iter()
            .filter(|j| {
                j.agent.as_deref() == Some(agent) && j.status == arbor_protocol::Status::Done
            })
            .count()
    }

    /// ```
    /// # #[tokio::main] async fn main() {
    /// # use arbor_testkit::{TestNode, agent_md};
    /// # use arbor_testkit::protocol::Status;
    /// # let node = TestNode::start(&[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))]).await;
    /// # let run = node.run_agent("solo", "go").await;
    /// node.wait_run(run).await;
    /// node.shutdown().await;
    /// # }
    /// ```
    pub async fn shutdown(self) {
        self.node.shutdown().await.expect("a clean shutdown");
    }

    /// As `shutdown`, saying how it went (a node that lost its lease
    /// cannot commit its shutdown).
    pub(crate) async fn try_shutdown(self) -> Result<(), arbor_runtime::Error> {
        self.node.shutdown().await
    }
}

/// Wraps a factory (the scripted models by default) and records every
/// request each agent's model got, in order. A request carries its
/// `CallMeter`, so a test can also act at a known point of a call in flight
/// (`meter`: stop a job once its answer has started streaming, say).
///
/// ```
/// # #[tokio::main] async fn main() {
/// use arbor_testkit::{RecordingModels, TestNode, agent_md};
/// let models = RecordingModels::new();
/// let solo = agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}");
/// let node = TestNode::start_full(None, &[("solo", &solo)], models.clone()).await;
/// let run = node.run_agent("solo", "say hi").await;
/// node.wait_run(run).await;
/// assert_eq!(models.requests("solo").len(), 1);
/// // `meter` waits for the n-th request, to act while its call is in flight.
/// let _meter = models.meter("solo", 0).await;
/// # }
/// ```
pub struct RecordingModels {
    inner: Arc<dyn ModelFactory>,
    requests: Arc<Mutex<HashMap<String, Vec<ModelRequest>>>>,
    sent: Arc<tokio::sync::Notify>,
}

impl RecordingModels {
    pub fn new() -> Arc<Self> {
        Self::wrapping(Arc::new(DefaultModels))
    }

    /// Records what `inner`'s models are sent (a workspace's `Models`, say).
    pub fn wrapping(inner: Arc<dyn ModelFactory>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            requests: Default::default(),
            sent: Default::default(),
        })
    }

    /// Every request the agent's models were sent, in order.
    pub fn requests(&self, agent: &str) -> Vec<ModelRequest> {
        self.requests
            .lock()
            .unwrap()
            .get(agent)
            .cloned()
            .unwrap_or_default()
    }

    /// The meter of the `n`th request (from 0) of `agent`, once it is sent.
    pub async fn meter(&self, agent: &str, n: usize) -> CallMeter {
        let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
        loop {
            let sent = self.sent.notified();
            if let Some(request) = self.requests(agent).get(n) {
                return request.meter.clone();
            }
            if tokio::time::timeout_at(deadline, sent).await.is_err() {
                panic!("request {n} of {agent} never came");
            }
        }
    }
}

struct Recording {
    inner: Arc<dyn Model>,
    agent: String,
    log: Arc<Mutex<HashMap<String, Vec<ModelRequest>>>>,
    sent: Arc<tokio::sync::Notify>,
}

impl Model for Recording {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        self.inner.count_input(request)
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        self.log
            .lock()
            .unwrap()
            .entry(self.agent.clone())
            .or_default()
            .push(request.clone());
        self.sent.notify_waiters();
        self.inner.complete(request)
    }

    fn info(&self) -> ModelInfo {
        self.inner.info()
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        self.inner.estimate_prompt(request)
    }
}

impl ModelFactory for RecordingModels {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        Ok(Arc::new(Recording {
            inner: self.inner.model_for(agent)?,
            agent: agent.name.clone(),
            log: self.requests.clone(),
            sent: self.sent.clone(),
        }))
    }

    fn preflight(&self, agent: &AgentDef) -> Result<(), String> {
        self.inner.preflight(agent)
    }
}

/// The crash driver's and the soak's workload, written as a workspace
/// folder in `dir` (flow `crash`): a planner fans out to three workers that run real commands
/// (one leaves a background process behind), then a writer. Its step may be
/// resumed as often as it is interrupted.
pub fn crash_workload(dir: &std::path::Path) -> std::io::Result<()> {
    let agent = |name: &str, text: &str| -> std::io::Result<()> {
        std::fs::create_dir_all(dir.join("agents").join(name))?;
        std::fs::write(dir.join("agents").join(name).join("agent.md"), text)
    };
    agent(
        "planner",
        "---\ntools: [exec, write_file]\nsubagents: [worker, writer]\nmax_turns: 10\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: a, label: a}, {agent: worker, request: b, label: b}, {agent: worker, request: c, label: c}]}}\n  - call: {tool: delegate, args: {jobs: [{agent: writer, request: w, label: w}]}}\n  - call: {tool: submit_output, args: {output: planned}}\n---\nplan\n",
    )?;
    agent(
        "worker",
        "---\ndescription: works with real processes\ntools: [exec, write_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"sleep 5 >/dev/null 2>&1 & sleep 0.05; echo started\"}}\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"sleep 0.1; echo done > out.txt\"}}\n  - call: {tool: submit_output, args: {output: worked}}\n---\nwork\n",
    )?;
    agent(
        "writer",
        "---\ndescription: writes\ntools: [write_file]\nscript:\n  - delay: 30ms\n    call: {tool: write_file, args: {path: r.md, content: report}}\n  - call: {tool: submit_output, args: {output: written}}\n---\nwrite\n",
    )?;
    std::fs::create_dir_all(dir.join("flows"))?;
    std::fs::write(
        dir.join("flows/crash.toml"),
        "budget = { tokens = 100000000 }\n[[group]]\nsteps = [{ agent = \"planner\", instruction = \"go\", retries = 100000 }]\n",
    )
}

/// A small, seedable generator for repeatable trials: fastrand's, so a seed
/// gives the same numbers on every run, and a failing trial that says its
/// seed replays.
///
/// ```
/// use arbor_testkit::Seeded;
/// let (mut a, mut b) = (Seeded::new(7), Seeded::new(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!((10..=20).contains(&a.between(10, 20)));
/// assert_eq!(a.between(5, 5), 5);
/// let _any = a.between(0, u64::MAX); // the whole range, no overflow
/// ```
pub struct Seeded(fastrand::Rng);

impl Seeded {
    pub fn new(seed: u64) -> Self {
        Self(fastrand::Rng::with_seed(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }

    /// A number in `lo..=hi`, every one as likely; `lo` if `hi` is below it.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        self.0.u64(lo..=hi)
    }
}

pub use arbor_sandbox::process_exits_within;

/// Every process whose working directory is `dir` or below it.
/// Waits (at most `WAIT_LIMIT`) until at least `n` processes run in `dir`
/// and returns them. Polls /proc: the kernel sends no event for a process
/// that starts in a folder.
pub async fn wait_processes_in(dir: &std::path::Path, n: usize) -> Vec<i32> {
    let deadline = tokio::time::Instant::now() + WAIT_LIMIT;
    loop {
        let found = processes_in(dir);
        if found.len() >= n {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {WAIT_LIMIT:?} for {n} processes in {}; found {found:?}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn processes_in(dir: &std::path::Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return vec![];
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(&dir))
        })
        .collect()
}
