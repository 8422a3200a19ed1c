//! Faults from outside, chosen per job: a model that answers 429, is
//! overloaded, times out, hangs, answers what no adapter could parse, or
//! panics; and sandbox commands that outlive their timeout or ignore
//! SIGTERM.
//!
//! Model faults wrap any `ModelFactory` (the scripted one by default). A
//! fault is planned for an agent's jobs, the n-th job of an agent (in the
//! order they ask for their model: spawn order), or every job of it; each
//! planned fault takes one call, in order, and the calls after them go to
//! the wrapped model. A faulty model retries as a provider's adapter does
//! (`RetryPolicy`), with a short backoff so a test waits milliseconds.
//!
//! ```
//! use arbor_testkit::faults::{FaultyModels, ModelFault};
//! let models = FaultyModels::new();
//! // The first job of `worker`: two 429s, then its script answers.
//! models.on_job("worker", 0, [ModelFault::RateLimited, ModelFault::RateLimited]);
//! // Every job of `critic`: a panic in its adapter on its first call.
//! models.on_every_job("critic", [ModelFault::Panic]);
//! assert_eq!(models.calls("worker"), 0);
//! ```

use arbor_actors::model::{
    Model, ModelError, ModelFactory, ModelInfo, ModelReply, ModelRequest, RetryPolicy,
};
use arbor_protocol::{AgentDef, ErrorClass};
use arbor_runtime::DefaultModels;
use futures::future::BoxFuture;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// One call's fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFault {
    /// 429, with a Retry-After of 1 ms: transient, retried.
    RateLimited,
    /// 529 / 503: transient, retried.
    Overloaded,
    /// 500: transient, retried.
    ServerError,
    /// The request timed out at the adapter: transient, retried.
    Timeout,
    /// The call never answers: only a stop or the job's timeout ends it.
    Hang,
    /// An answer no adapter could parse: a protocol error, not retried.
    Malformed,
    /// The adapter panics (contained, I-38).
    Panic,
}

/// The retries a faulty model makes: as a provider's adapter, three, with
/// millisecond backoffs.
pub const QUICK_RETRIES: RetryPolicy = RetryPolicy {
    max_retries: 3,
    base: Duration::from_millis(1),
    cap: Duration::from_millis(5),
};

type Plan = HashMap<(String, Option<usize>), VecDeque<ModelFault>>;

/// A `ModelFactory` whose models fail as planned, then answer as the
/// wrapped factory's.
pub struct FaultyModels {
    inner: Arc<dyn ModelFactory>,
    retry: RetryPolicy,
    plan: Arc<Mutex<Plan>>,
    jobs: Mutex<HashMap<String, usize>>,
    calls: Arc<Mutex<HashMap<String, usize>>>,
}

impl FaultyModels {
    /// Over the scripted models.
    pub fn new() -> Arc<Self> {
        Self::wrapping(Arc::new(DefaultModels))
    }

    /// Over `inner` (a workspace's `Models`, say).
    pub fn wrapping(inner: Arc<dyn ModelFactory>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            retry: QUICK_RETRIES,
            plan: Default::default(),
            jobs: Default::default(),
            calls: Default::default(),
        })
    }

    /// The `job`-th job of `agent` (from 0, in the order jobs ask for their
    /// model) meets `faults` on its next calls, one a call.
    pub fn on_job(&self, agent: &str, job: usize, faults: impl IntoIterator<Item = ModelFault>) {
        self.lock_plan()
            .entry((agent.into(), Some(job)))
            .or_default()
            .extend(faults);
    }

    /// Every job of `agent` meets `faults` on its first calls.
    pub fn on_every_job(&self, agent: &str, faults: impl IntoIterator<Item = ModelFault>) {
        self.lock_plan()
            .entry((agent.into(), None))
            .or_default()
            .extend(faults);
    }

    /// How many calls `agent`'s jobs made, faulty ones and retries included.
    pub fn calls(&self, agent: &str) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(agent)
            .copied()
            .unwrap_or(0)
    }

    fn lock_plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ModelFactory for FaultyModels {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        let inner = self.inner.model_for(agent)?;
        let index = {
            let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
            let n = jobs.entry(agent.name.clone()).or_default();
            *n += 1;
            *n - 1
        };
        // This job's own faults, then those of every job of the agent.
        let mut faults = VecDeque::new();
        {
            let mut plan = self.lock_plan();
            if let Some(own) = plan.remove(&(agent.name.clone(), Some(index))) {
                faults.extend(own);
            }
            if let Some(every) = plan.get(&(agent.name.clone(), None)) {
                faults.extend(every.iter().copied());
            }
        }
        Ok(Arc::new(Faulty {
            inner,
            agent: agent.name.clone(),
            retry: self.retry,
            faults: Mutex::new(faults),
            calls: self.calls.clone(),
        }))
    }

    fn preflight(&self, agent: &AgentDef) -> Result<(), String> {
        self.inner.preflight(agent)
    }
}

struct Faulty {
    inner: Arc<dyn Model>,
    agent: String,
    retry: RetryPolicy,
    faults: Mutex<VecDeque<ModelFault>>,
    calls: Arc<Mutex<HashMap<String, usize>>>,
}

impl Model for Faulty {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        self.inner.count_input(request)
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        *self
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(self.agent.clone())
            .or_default() += 1;
        let fault = self
            .faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        let error = |class, message: &str| -> BoxFuture<'static, Result<ModelReply, ModelError>> {
            let error = ModelError::new(class, message);
            Box::pin(async move { Err(error) })
        };
        match fault {
            None => self.inner.complete(request),
            Some(ModelFault::RateLimited) => {
                let mut e = ModelError::new(
                    ErrorClass::ModelRateLimit,
                    "429 Too Many Requests (injected)",
                );
                e.retry_after = Some(Duration::from_millis(1));
                Box::pin(async move { Err(e) })
            }
            Some(ModelFault::Overloaded) => {
                error(ErrorClass::ModelOverloaded, "529 overloaded (injected)")
            }
            Some(ModelFault::ServerError) => error(
                ErrorClass::ModelServer,
                "500 Internal Server Error (injected)",
            ),
            Some(ModelFault::Timeout) => {
                error(ErrorClass::ModelTimeout, "the request timed out (injected)")
            }
            Some(ModelFault::Malformed) => error(
                ErrorClass::ModelProtocol,
                "the answer did not parse: expected value at line 1 column 1 (injected)",
            ),
            Some(ModelFault::Hang) => Box::pin(futures::future::pending()),
            Some(ModelFault::Panic) => panic!("a model adapter bug (injected)"),
        }
    }

    fn info(&self) -> ModelInfo {
        ModelInfo {
            retry: self.retry,
            ..self.inner.info()
        }
    }

    fn estimate_prompt(&self, request: &ModelRequest) -> u64 {
        self.inner.estimate_prompt(request)
    }
}

/// The sleep every command below runs: an odd length, so that
/// `processes_running` finds them and nothing else.
pub const MARK: &str = "3600.125";

/// An `exec` command that outlives any short timeout: give the call a
/// `timeout` and the sandbox must kill it (its whole process group, I-17).
pub fn command_that_hangs() -> String {
    format!("sleep {MARK}")
}

/// An `exec` command that ignores SIGTERM, and leaves a background child
/// that ignores it too: only a SIGKILL of the whole group ends them.
pub fn command_that_ignores_sigterm() -> String {
    format!("trap '' TERM; (trap '' TERM; sleep {MARK}) & sleep {MARK}")
}

/// The pids of processes running one of the commands above.
pub fn processes_running() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(MARK))
        })
        .collect()
}
