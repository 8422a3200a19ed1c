//! Replays in tests: a recording exported as a fixture and replayed against
//! a workspace (`Fixture`), a node's recorded run replayed (`TestNode::replay`),
//! and models that vary the schedule from a seed (`Shuffled`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use arbor_testkit::replay::Fixture;
//! // Written by `arbor export RUN -o tests/fixtures/research.json`.
//! let replayed = Fixture::load("tests/fixtures/research.json")?
//!     .replay("examples/research")
//!     .await?;
//! assert_eq!(replayed.run_status(), arbor_testkit::protocol::Status::Done);
//! # Ok(()) }
//! ```

use crate::{DefaultModels, TestNode};
use arbor_actors::model::{Model, ModelError, ModelFactory, ModelInfo, ModelReply, ModelRequest};
use arbor_protocol::tape::Export;
use arbor_protocol::{AgentDef, RunId, Tree};
pub use arbor_runtime::replay::{ReplayError, ReplayOptions};
use futures::FutureExt;
use futures::future::BoxFuture;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// An exported recording (`arbor export RUN -o FILE`), checked whole.
pub struct Fixture {
    pub export: Export,
}

/// Why a fixture did not replay to its recording.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error(transparent)]
    Refused(#[from] ReplayError),
    #[error("the workspace does not load: {0}")]
    Workspace(#[from] arbor_runtime::LoadError),
    #[error("the replay differs from its recording:\n  {}", .0.join("\n  "))]
    Differs(Vec<String>),
}

impl Fixture {
    /// Reads an export, refusing a truncated, edited or newer one.
    pub fn load(path: impl AsRef<Path>) -> Result<Fixture, ReplayError> {
        Ok(Fixture {
            export: arbor_runtime::replay::read_export(path.as_ref())?,
        })
    }

    /// Replays it against the workspace folder `workspace` on a node of its
    /// own, and checks the replay has the recording's tree, account numbers
    /// and event kinds in order per job (I-49). Returns the replayed tree.
    pub async fn replay(&self, workspace: impl AsRef<Path>) -> Result<Tree, FixtureError> {
        let workspace = arbor_runtime::Workspace::load(workspace.as_ref())?;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let node = TestNode::open(workspace, &dir.path().join("data"), Arc::new(DefaultModels))
            .await
            .map_err(|e| ReplayError::Start(e.to_string()))?;
        let run = arbor_runtime::replay::replay_export(
            node.node(),
            &node.workspace,
            &self.export,
            ReplayOptions::default(),
        )
        .await?;
        let tree = node.wait_run(run).await;
        let differences = self.differences(&node, run, &tree);
        node.shutdown().await;
        if differences.is_empty() {
            Ok(tree)
        } else {
            Err(FixtureError::Differs(differences))
        }
    }

    /// Where run `run` of `node` differs from this recording.
    pub fn differences(&self, node: &TestNode, run: RunId, tree: &Tree) -> Vec<String> {
        let root = tree.root();
        let events = arbor_runtime::replay::job_events(&root, &node.events(run));
        arbor_runtime::replay::differences(
            &self.export.tree,
            &self.export.events,
            &root,
            &events,
            20,
        )
    }
}

impl TestNode {
    /// Replays recorded run `run` of this node as a new run, and returns it.
    pub async fn replay(&self, run: RunId, options: ReplayOptions) -> Result<RunId, ReplayError> {
        arbor_runtime::replay::replay(self.node(), &self.workspace, run, options).await
    }

    /// Where replay `replayed` differs from recorded run `recorded` (both
    /// ended), in words; empty when they are the same (I-49).
    pub fn replay_differences(&self, recorded: RunId, replayed: RunId) -> Vec<String> {
        let (old, new) = (self.tree(recorded).root(), self.tree(replayed).root());
        let old_events = arbor_runtime::replay::job_events(&old, &self.events(recorded));
        let new_events = arbor_runtime::replay::job_events(&new, &self.events(replayed));
        arbor_runtime::replay::differences(&old, &old_events, &new, &new_events, 20)
    }
}

/// Models that vary the schedule: before each call, live or replayed, a
/// model yields to the scheduler a number of times drawn from `seed`, so
/// parallel jobs answer in another order with each seed. It counts the
/// calls its agents' own models were asked (a strict replay asks none).
pub struct Shuffled {
    inner: Arc<dyn ModelFactory>,
    seed: AtomicU64,
    draws: AtomicU64,
    live_calls: Arc<AtomicU64>,
}

impl Shuffled {
    pub fn new(inner: Arc<dyn ModelFactory>, seed: u64) -> Arc<Self> {
        Arc::new(Self {
            inner,
            seed: AtomicU64::new(seed),
            draws: AtomicU64::new(0),
            live_calls: Default::default(),
        })
    }

    /// The models made from now on draw from `seed`.
    pub fn reseed(&self, seed: u64) {
        self.seed.store(seed, Ordering::Release);
    }

    /// The calls the agents' own models were asked so far.
    pub fn live_calls(&self) -> u64 {
        self.live_calls.load(Ordering::Acquire)
    }

    fn shuffle(&self, inner: Arc<dyn Model>, live: bool) -> Arc<dyn Model> {
        let draw = self.draws.fetch_add(1, Ordering::AcqRel);
        Arc::new(Yielding {
            inner,
            rng: std::sync::Mutex::new(fastrand::Rng::with_seed(
                self.seed
                    .load(Ordering::Acquire)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ draw,
            )),
            live_calls: live.then(|| self.live_calls.clone()),
        })
    }
}

struct Yielding {
    inner: Arc<dyn Model>,
    rng: std::sync::Mutex<fastrand::Rng>,
    live_calls: Option<Arc<AtomicU64>>,
}

impl Model for Yielding {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        self.inner.count_input(request)
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        if let Some(calls) = &self.live_calls {
            calls.fetch_add(1, Ordering::AcqRel);
        }
        let yields = self.rng.lock().unwrap().u32(0..64);
        let answer = self.inner.complete(request);
        async move {
            for _ in 0..yields {
                tokio::task::yield_now().await;
            }
            answer.await
        }
        .boxed()
    }

    fn info(&self) -> ModelInfo {
        self.inner.info()
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        self.inner.estimate_prompt(request)
    }
}

impl ModelFactory for Shuffled {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        Ok(self.shuffle(self.inner.model_for(agent)?, true))
    }

    fn preflight(&self, agent: &AgentDef) -> Result<(), String> {
        self.inner.preflight(agent)
    }

    fn replaying(&self, agent: &AgentDef, recording: Arc<dyn Model>) -> Arc<dyn Model> {
        self.shuffle(self.inner.replaying(agent, recording), false)
    }
}
