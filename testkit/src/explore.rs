//! A crash at every commit point: `explore_crashes`.
//!
//! A commit point is one flush of the journal's log (one `write` and one
//! `fdatasync`, which acknowledges every commit it covers). The exploration
//! runs the scenario once, in a child process, to count its flushes N; then,
//! for every k in 1..=N, it runs the scenario again in a child process that
//! dies (SIGKILL, no clean-up) just before flush k (its commits were never
//! durable) and just after it (durable, and nobody was told), each as a kill
//! and as a power cut (`arbor_storage::Faults::crash_at`: the log loses what
//! its last sync did not cover, and sled keeps what its own last sync left).
//! After each death it starts a node on the same data dir in this process,
//! which recovers and resumes, waits for the run to finish, and checks:
//!
//! - recovery found every account balanced (I-14) and nothing undecodable;
//! - everything the child was told was durable is there: the highest
//!   acknowledged seq, the run it started, every job it saw end (and as it
//!   ended);
//! - the run, resumed or ended, finishes;
//! - then `checks::recovered`: no job left running, no process alive, no
//!   sandbox recorded live, no job spawned twice, no child charged twice;
//! - and the test's own `check`.
//!
//! On a shared journal (`ARBOR_TEST_JOURNAL=postgres`) the exploration
//! adds the lease points. At every flush k, the node's lease is taken from
//! it just before the flush (`k:fenced`): that commit is refused for a
//! stale epoch, the node stops its runs and exits, and the checks add that
//! it committed nothing past what it was told was durable and left no
//! sandbox process alive. At the middle flush, the node dies just before
//! and just after a renewal of its lease (`k:renewal:before|after`), and,
//! killed after that flush, the next node dies just before and just after
//! its claim of the run (`k:claim:before|after`) before a third recovers
//! it. After each, the run is owned at a later epoch than any before.
//!
//! The child is the test binary itself, started again on the same test
//! (`--exact`), with the case in `ARBOR_CRASH_CHILD`: `explore_crashes`
//! called there runs the case instead of exploring. A failure names the
//! case and prints one command that replays exactly it
//! (`ARBOR_CRASH_CASE=<k>:<before|after>:<kill|power> <test binary> <test> --exact`,
//! or a lease point's code). Nothing is random: a case is its k, its point
//! and its kind. How many
//! flushes a run takes can differ by a few between runs (concurrent commits
//! share a flush when they meet), so a case past the end of a child's run is
//! counted as not reached, not as a failure.

use crate::{TestNode, WAIT_LIMIT, checks};
use arbor_actors::model::ModelFactory;
use arbor_protocol::{EventKind, JobId, RunId, Status};
use arbor_runtime::{Models, Workspace};
use arbor_storage::{Crash, CrashKind, CrashPoint};
use futures::FutureExt;
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The environment variable that makes a test binary a crash child.
const CHILD: &str = "ARBOR_CRASH_CHILD";

/// Whether this process is a crash child: a test that builds its scenario
/// around something of its own (a receiver on a port) must build the same
/// scenario here, and leave that something to its parent.
pub fn is_crash_child() -> bool {
    std::env::var_os(CHILD).is_some()
}
/// The environment variable that narrows an exploration to one case.
const CASE: &str = "ARBOR_CRASH_CASE";

/// Runs while the scenario's run is under way (a steer, a stop), given the
/// node and the run.
pub type During = Arc<dyn for<'a> Fn(&'a TestNode, RunId) -> BoxFuture<'a, ()> + Send + Sync>;

/// Builds the models a scenario's node uses, from its workspace.
pub type ModelsFor = Arc<dyn Fn(&Workspace) -> Arc<dyn ModelFactory> + Send + Sync>;

/// What `explore_crashes` runs: a workspace, the run it starts, and what
/// happens while it runs.
///
/// ```
/// use arbor_testkit::{agent_md, explore::Scenario};
/// let scenario = Scenario::agent(
///     &[("solo", &agent_md("script:\n  - call: {tool: submit_output, args: {output: hi}}"))],
///     "solo",
///     "say hi",
/// );
/// assert_eq!(scenario.describe(), "agent solo");
/// ```
#[derive(Clone)]
pub struct Scenario {
    source: Source,
    start: Start,
    during: Option<During>,
    /// Runs on the recovered node too, while its runs finish: a person who
    /// goes on deciding approval cards after a restart.
    after_restart: Option<During>,
    models: Option<ModelsFor>,
    test: Option<String>,
}

#[derive(Clone)]
enum Source {
    Dir(PathBuf),
    Texts {
        arbor_toml: Option<String>,
        agents: Vec<(String, String)>,
        flows: Vec<(String, String)>,
    },
}

#[derive(Clone)]
enum Start {
    Flow(String),
    Agent { agent: String, input: String },
}

impl Scenario {
    /// Flow `flow` of the workspace in `dir` (a folder with `agents/`,
    /// `flows/` and an optional `arbor.toml`, as `arbor run` takes it).
    pub fn flow(dir: impl Into<PathBuf>, flow: &str) -> Self {
        Self::new(Source::Dir(dir.into()), Start::Flow(flow.into()))
    }

    /// One agent of these (name, agent.md text), given `input`.
    pub fn agent(agents: &[(&str, &str)], agent: &str, input: &str) -> Self {
        Self::texts(None, agents, &[]).starting(Start::Agent {
            agent: agent.into(),
            input: input.into(),
        })
    }

    /// Flow `flow` of a workspace given as texts: arbor.toml, agents and
    /// flows (name, text).
    pub fn flow_texts(
        arbor_toml: Option<&str>,
        agents: &[(&str, &str)],
        flows: &[(&str, &str)],
        flow: &str,
    ) -> Self {
        Self::texts(arbor_toml, agents, flows).starting(Start::Flow(flow.into()))
    }

    /// Runs `during` while the run is under way, in every child and in the
    /// counting run: it is part of the scenario.
    pub fn during(
        mut self,
        during: impl for<'a> Fn(&'a TestNode, RunId) -> BoxFuture<'a, ()> + Send + Sync + 'static,
    ) -> Self {
        self.during = Some(Arc::new(during));
        self
    }

    /// Runs `after` on the node that recovered from each crash, for every
    /// run its journal holds, while the checks wait for the run to finish
    /// (a person answering approval cards: without one, a card carried
    /// across the crash would wait out its deadline).
    pub fn after_restart(
        mut self,
        after: impl for<'a> Fn(&'a TestNode, RunId) -> BoxFuture<'a, ()> + Send + Sync + 'static,
    ) -> Self {
        self.after_restart = Some(Arc::new(after));
        self
    }

    /// The models the node uses (the workspace's own by default: the
    /// scripted model and its `[providers]`). Built again in every process.
    pub fn models(
        mut self,
        models: impl Fn(&Workspace) -> Arc<dyn ModelFactory> + Send + Sync + 'static,
    ) -> Self {
        self.models = Some(Arc::new(models));
        self
    }

    /// The test's name as the test binary takes it (`module::test`), for a
    /// harness that does not name its test threads after the tests. By
    /// default, the name of the thread `explore_crashes` runs on, which is
    /// what the standard test harness does.
    pub fn test_name(mut self, name: &str) -> Self {
        self.test = Some(name.into());
        self
    }

    /// What the scenario runs, in a few words.
    pub fn describe(&self) -> String {
        match &self.start {
            Start::Flow(flow) => format!("flow {flow}"),
            Start::Agent { agent, .. } => format!("agent {agent}"),
        }
    }

    fn new(source: Source, start: Start) -> Self {
        Self {
            source,
            start,
            during: None,
            after_restart: None,
            models: None,
            test: None,
        }
    }

    fn texts(arbor_toml: Option<&str>, agents: &[(&str, &str)], flows: &[(&str, &str)]) -> Self {
        let own = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        Self::new(
            Source::Texts {
                arbor_toml: arbor_toml.map(str::to_string),
                agents: own(agents),
                flows: own(flows),
            },
            Start::Flow(String::new()),
        )
    }

    fn starting(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// The workspace, rooted at `root` if it is given as texts.
    fn workspace(&self, root: &Path) -> Result<Workspace, String> {
        match &self.source {
            Source::Dir(dir) => Workspace::load(dir).map_err(|e| e.to_string()),
            Source::Texts {
                arbor_toml,
                agents,
                flows,
            } => {
                fn borrowed(v: &[(String, String)]) -> Vec<(&str, &str)> {
                    v.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect()
                }
                let (agents, flows) = (borrowed(agents), borrowed(flows));
                Workspace::from_texts(root.to_path_buf(), arbor_toml.as_deref(), &agents, &flows)
                    .map_err(|e| e.to_string())
            }
        }
    }

    fn models_for(&self, workspace: &Workspace) -> Arc<dyn ModelFactory> {
        match &self.models {
            Some(models) => models(workspace),
            None => Arc::new(Models::new(&workspace.config.providers)),
        }
    }

    async fn start_run(&self, node: &TestNode) -> Result<RunId, String> {
        let spec = match &self.start {
            Start::Flow(flow) => node.workspace.flow_run(flow, None),
            Start::Agent { agent, input } => node.workspace.agent_run(agent, input, None),
        }
        .map_err(|e| e.to_string())?;
        node.node().start_run(spec).await.map_err(|e| e.to_string())
    }
}

/// One case: a flush of the counting run, and what happens at it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    pub flush: u64,
    pub at: At,
}

/// What happens at a case's flush.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The process dies at `point` of the flush, as `kind`.
    Crash { point: CrashPoint, kind: CrashKind },
    /// A shared journal's lease points (`arbor_storage::Faults`): just
    /// before the flush, the node's lease is taken from it; the flush's
    /// commit is refused for a stale epoch, and the node stops its runs
    /// and exits, having committed nothing more.
    Fenced,
    /// The node renews its lease at the flush and dies at `point` of the
    /// renewal.
    Renewal(CrashPoint),
    /// The node is killed just after the flush; the next node to start
    /// dies at `point` of its claim of the dead node's runs; a third
    /// recovers them.
    Claim(CrashPoint),
}

impl Case {
    /// `12:after:power`, `12:fenced`, `12:renewal:before` or
    /// `12:claim:after`, as `ARBOR_CRASH_CASE` takes it.
    pub fn code(&self) -> String {
        let point = |point: CrashPoint| match point {
            CrashPoint::BeforeFlush => "before",
            CrashPoint::AfterFlush => "after",
        };
        let at = match self.at {
            At::Crash { point: p, kind } => {
                let kind = match kind {
                    CrashKind::Kill => "kill",
                    CrashKind::PowerLoss => "power",
                };
                format!("{}:{kind}", point(p))
            }
            At::Fenced => "fenced".into(),
            At::Renewal(p) => format!("renewal:{}", point(p)),
            At::Claim(p) => format!("claim:{}", point(p)),
        };
        format!("{}:{at}", self.flush)
    }

    /// Reads `code`'s forms back; `None` if it is not one.
    pub fn parse(code: &str) -> Option<Case> {
        let point = |word: &str| match word {
            "before" => Some(CrashPoint::BeforeFlush),
            "after" => Some(CrashPoint::AfterFlush),
            _ => None,
        };
        let mut parts = code.trim().split(':');
        let flush = parts.next()?.parse().ok()?;
        let at = match (parts.next()?, parts.next(), parts.next()) {
            ("fenced", None, None) => At::Fenced,
            ("renewal", Some(p), None) => At::Renewal(point(p)?),
            ("claim", Some(p), None) => At::Claim(point(p)?),
            (p, Some(kind), None) => At::Crash {
                point: point(p)?,
                kind: match kind {
                    "kill" => CrashKind::Kill,
                    "power" => CrashKind::PowerLoss,
                    _ => return None,
                },
            },
            _ => return None,
        };
        Some(Case { flush, at })
    }

    /// Whether the case is a shared journal's alone.
    fn is_lease_point(&self) -> bool {
        !matches!(self.at, At::Crash { .. })
    }
}

/// What an exploration did and found.
#[derive(Debug, Default)]
pub struct Exploration {
    /// Flushes the counting run took, from its node's start to its shutdown.
    pub commits: u64,
    /// Cases run (four a commit point: before and after, kill and power cut).
    pub cases: u64,
    /// Cases whose child died at its point.
    pub crashed: u64,
    /// Cases whose child lost its lease at its flush and stopped (a shared
    /// journal's).
    pub fenced: u64,
    /// Cases whose child's run ended before its flush k came.
    pub not_reached: u64,
    /// Steps and jobs recovery failed as interrupted, over every case.
    pub jobs_interrupted: u64,
    /// Records read back by the checks, over every case.
    pub records_checked: u64,
    /// What went wrong, each naming its case (the exploration stops at the
    /// first case with any).
    pub violations: Vec<String>,
    /// The command that replays the first failing case.
    pub replay: Option<String>,
    pub elapsed: Duration,
}

impl std::fmt::Display for Exploration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} commit points, {} cases ({} crashed, {} fenced, {} past the run's end), {} jobs recovered as interrupted, {} records checked, {} violations, {:.1}s",
            self.commits,
            self.cases,
            self.crashed,
            self.fenced,
            self.not_reached,
            self.jobs_interrupted,
            self.records_checked,
            self.violations.len(),
            self.elapsed.as_secs_f64()
        )?;
        for v in &self.violations {
            write!(f, "\nviolation: {v}")?;
        }
        if let Some(replay) = &self.replay {
            write!(f, "\nreplay with: {replay}")?;
        }
        Ok(())
    }
}

/// The case a crash child runs, as it travels in `ARBOR_CRASH_CHILD`.
#[derive(serde::Serialize, serde::Deserialize)]
struct ChildCase {
    /// Which scenario of the test (its `describe`), in case it explores several.
    scenario: String,
    /// The workspace's root (for a workspace given as texts).
    root: PathBuf,
    data: PathBuf,
    /// Where the child writes what it was told.
    acks: PathBuf,
    /// The case as `Case::code` writes it; none for the counting run.
    case: Option<String>,
}

/// Explores every commit point of `scenario` (see the module docs) and
/// panics with the report, and a command that replays the failing case,
/// if any case breaks a promise or `check`. `check` runs on the recovered
/// node once the run has finished, given the run; an `Err` or a panic is a
/// violation.
///
/// ```no_run
/// # async fn demo() {
/// use arbor_testkit::explore::{Scenario, explore_crashes};
/// let scenario = Scenario::flow("examples/research", "research");
/// let report = explore_crashes(&scenario, |node, run| {
///     let tree = node.tree(run);
///     match tree.run_status() {
///         arbor_protocol::Status::Done => Ok(()),
///         other => Err(format!("the run ended {other}")),
///     }
/// })
/// .await;
/// println!("{report}");
/// # }
/// ```
pub async fn explore_crashes(
    scenario: &Scenario,
    check: impl Fn(&TestNode, RunId) -> Result<(), String>,
) -> Exploration {
    let report = explore(scenario, check).await;
    if !report.violations.is_empty() {
        panic!("explore_crashes ({}): {report}", scenario.describe());
    }
    report
}

/// `explore_crashes` without the panic: the report, violations included.
/// For a test that expects a broken recovery to be caught.
pub async fn explore(
    scenario: &Scenario,
    check: impl Fn(&TestNode, RunId) -> Result<(), String>,
) -> Exploration {
    if let Ok(case) = std::env::var(CHILD) {
        let case: ChildCase = serde_json::from_str(&case)
            .unwrap_or_else(|e| panic!("{CHILD} is not a crash case: {e}"));
        if case.scenario == scenario.describe() {
            run_child(scenario, case).await;
        }
        // Another scenario's exploration, in a child for this one.
        return Exploration::default();
    }
    let started = Instant::now();
    let mut report = Exploration::default();
    let test = scenario
        .test
        .clone()
        .or_else(|| std::thread::current().name().map(str::to_string))
        .filter(|name| name != "main")
        .unwrap_or_else(|| {
            panic!("explore_crashes: the test's name is unknown (its thread is not named after it); give it with Scenario::test_name")
        });
    let exe = std::env::current_exe().expect("the test binary's path");
    let temp = tempfile::tempdir().expect("a temporary directory");
    let only = std::env::var(CASE).ok().map(|code| {
        Case::parse(&code).unwrap_or_else(|| {
            panic!(
                "{CASE}={code:?} is not a case (<k>:<before|after>:<kill|power>, <k>:fenced, \
                 <k>:renewal:<before|after> or <k>:claim:<before|after>)"
            )
        })
    });

    // The counting run.
    let counted = temp.path().join("count");
    let child = Child {
        exe: &exe,
        test: &test,
        scenario,
    };
    match child.run(&counted, None, "stderr").await {
        Ok(Ended::Finished(acks)) => report.commits = acks.flushes.unwrap_or(0),
        Ok(Ended::Killed(_) | Ended::Fenced(_)) => report
            .violations
            .push("the counting run died or was fenced without a fault armed".into()),
        Err(e) => report.violations.push(format!("the counting run: {e}")),
    }
    if report.commits == 0 && report.violations.is_empty() {
        report
            .violations
            .push("the counting run made no commit: nothing to explore".into());
    }

    let cases: Vec<Case> = match only {
        Some(case) => vec![case],
        None => every_case(report.commits, crate::backend::on_postgres()),
    };
    // Cases run a few at a time: most of a case is waiting (a child's
    // start, a scripted delay, a recovery's syncs), not computing.
    for batch in cases.chunks(AT_ONCE) {
        if !report.violations.is_empty() {
            break;
        }
        let outcomes = futures::future::join_all(batch.iter().map(|case| {
            let dir = temp.path().join(case.code().replace(':', "-"));
            let child = &child;
            let check = &check;
            async move {
                let mut outcome = CaseOutcome::default();
                run_case(child, *case, &dir, check, &mut outcome).await;
                // A case's files go as soon as it passed: a long exploration
                // would otherwise fill the disk.
                if outcome.found.is_empty() {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                (*case, outcome)
            }
        }))
        .await;
        for (case, outcome) in outcomes {
            report.cases += 1;
            report.crashed += u64::from(outcome.crashed);
            report.fenced += u64::from(outcome.fenced);
            report.not_reached += u64::from(outcome.not_reached);
            report.jobs_interrupted += outcome.jobs_interrupted;
            report.records_checked += outcome.records_checked;
            if !outcome.found.is_empty() && report.replay.is_none() {
                report.replay = Some(format!(
                    "{CASE}={} {} {test} --exact --nocapture",
                    case.code(),
                    exe.display()
                ));
            }
            report.violations.extend(
                outcome
                    .found
                    .into_iter()
                    .map(|v| format!("case {}: {v}", case.code())),
            );
        }
    }
    report.elapsed = started.elapsed();
    report
}

/// How many cases run at once.
const AT_ONCE: usize = 4;

/// Every case of a run of `commits` flushes: at each flush, a crash before
/// and after it, each as a kill and as a power cut; on a shared journal
/// also the lease points: the lease taken at each flush, and a renewal and
/// a claim died in, before and after, at the middle flush.
fn every_case(commits: u64, shared: bool) -> Vec<Case> {
    let points = [CrashPoint::BeforeFlush, CrashPoint::AfterFlush];
    let mut cases: Vec<Case> = (1..=commits)
        .flat_map(|flush| {
            points.into_iter().flat_map(move |point| {
                [CrashKind::Kill, CrashKind::PowerLoss]
                    .into_iter()
                    .map(move |kind| Case {
                        flush,
                        at: At::Crash { point, kind },
                    })
            })
        })
        .collect();
    if shared && commits > 0 {
        cases.extend((1..=commits).map(|flush| Case {
            flush,
            at: At::Fenced,
        }));
        let middle = commits.div_ceil(2);
        for point in points {
            cases.push(Case {
                flush: middle,
                at: At::Renewal(point),
            });
            cases.push(Case {
                flush: middle,
                at: At::Claim(point),
            });
        }
    }
    cases
}

/// Runs one case in its child (two, for a claim) and checks after it.
async fn run_case(
    child: &Child<'_>,
    case: Case,
    dir: &Path,
    check: &impl Fn(&TestNode, RunId) -> Result<(), String>,
    outcome: &mut CaseOutcome,
) {
    let scenario = child.scenario;
    if case.is_lease_point() && !crate::backend::on_postgres() {
        return outcome
            .found
            .push("a lease point needs a shared journal (ARBOR_TEST_JOURNAL=postgres)".into());
    }
    let At::Claim(point) = case.at else {
        match child.run(dir, Some(case), "stderr").await {
            // The lease was taken before flush k, and the node went on to
            // commit it: its fence did not hold.
            Ok(Ended::Finished(acks))
                if case.at == At::Fenced && acks.flushes.is_some_and(|n| n >= case.flush) =>
            {
                outcome.found.push(format!(
                    "the node's lease was taken before flush {} and it committed {} flushes, \
                     not stopping",
                    case.flush,
                    acks.flushes.unwrap_or(0)
                ))
            }
            Ok(Ended::Finished(_)) => outcome.not_reached = true,
            Ok(Ended::Killed(acks)) => {
                outcome.crashed = true;
                recover_and_check(scenario, dir, &acks, check, 2, outcome).await;
            }
            Ok(Ended::Fenced(acks)) => {
                outcome.fenced = true;
                fenced_left_nothing(dir, &acks, case.flush, &mut outcome.found);
                recover_and_check(scenario, dir, &acks, check, 2, outcome).await;
            }
            Err(e) => outcome.found.push(e),
        }
        return;
    };
    // The node dies just after the flush, then the next one in its claim.
    let first = Case {
        flush: case.flush,
        at: At::Crash {
            point: CrashPoint::AfterFlush,
            kind: CrashKind::Kill,
        },
    };
    let acks = match child.run(dir, Some(first), "stderr").await {
        Ok(Ended::Killed(acks)) => acks,
        Ok(Ended::Finished(_)) => return outcome.not_reached = true,
        Ok(Ended::Fenced(_)) => return outcome.found.push("fenced with no fence armed".into()),
        Err(e) => return outcome.found.push(e),
    };
    match child.run(dir, Some(case), "claimer-stderr").await {
        Ok(Ended::Killed(_)) => {
            outcome.crashed = true;
            // A claim that committed took the run at the next epoch: the
            // node that recovers it takes it at the one after.
            let epoch = if point == CrashPoint::AfterFlush {
                3
            } else {
                2
            };
            recover_and_check(scenario, dir, &acks, check, epoch, outcome).await;
        }
        Ok(_) => outcome
            .found
            .push("the claimer started without dying at its claim".into()),
        Err(e) => outcome.found.push(e),
    }
}

/// After a node was fenced at flush `flush` and stopped: that flush and
/// every later one were refused, it committed nothing past what it was
/// told was durable, and it left no process of its sandboxes alive.
fn fenced_left_nothing(dir: &Path, acks: &Acks, flush: u64, found: &mut Vec<String>) {
    if acks.durable_lines >= flush {
        found.push(format!(
            "the fenced node was told {} flushes durable; its lease was taken before flush \
             {flush}, which and every later one must have been refused",
            acks.durable_lines
        ));
    }
    match crate::backend::open_journal_read_only(&dir.join("data")) {
        Ok(journal) => {
            if journal.applied_seq() > acks.durable {
                found.push(format!(
                    "the fenced node committed past seq {}, the last it was told was \
                     durable: the journal holds up to {}",
                    acks.durable,
                    journal.applied_seq()
                ));
            }
            match checks::processes_left(&journal) {
                Ok(left) => found.extend(
                    left.into_iter()
                        .map(|p| format!("the fenced node stopped and left {p}")),
                ),
                Err(e) => found.push(format!("the sandboxes do not read: {e}")),
            }
        }
        Err(e) => found.push(format!("the journal does not open: {e}")),
    }
}

/// What one case did and found.
#[derive(Default)]
struct CaseOutcome {
    crashed: bool,
    fenced: bool,
    not_reached: bool,
    jobs_interrupted: u64,
    records_checked: u64,
    found: Vec<String>,
}

/// What a child wrote down: every line is one `write`, so a kill keeps all
/// of them.
#[derive(Debug, Default)]
struct Acks {
    durable: u64,
    /// How many flushes were told durable.
    durable_lines: u64,
    run: Option<RunId>,
    ended: BTreeMap<JobId, Status>,
    flushes: Option<u64>,
    /// The child lost its lease and stopped.
    fenced: bool,
}

impl Acks {
    fn read(path: &Path) -> Acks {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let mut acks = Acks::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("durable"), Some(seq), None) => {
                    acks.durable = acks.durable.max(seq.parse().unwrap_or(0));
                    acks.durable_lines += 1;
                }
                // What the node's open committed (its workspace version),
                // durable before the case began: told, not a flush of it.
                (Some("opened"), Some(seq), None) => {
                    acks.durable = acks.durable.max(seq.parse().unwrap_or(0));
                }
                (Some("run"), Some(id), None) => acks.run = id.parse().ok(),
                (Some("ended"), Some(id), Some(status)) => {
                    if let (Ok(id), Ok(status)) =
                        (id.parse(), serde_json::from_value(status.into()))
                    {
                        acks.ended.insert(id, status);
                    }
                }
                (Some("flushes"), Some(n), None) => acks.flushes = n.parse().ok(),
                (Some("fenced"), None, None) => acks.fenced = true,
                _ => {}
            }
        }
        acks
    }
}

enum Ended {
    Finished(Acks),
    Killed(Acks),
    Fenced(Acks),
}

struct Child<'a> {
    exe: &'a Path,
    test: &'a str,
    scenario: &'a Scenario,
}

impl Child<'_> {
    /// Runs the scenario in a child process in `dir`, crashing at `case`;
    /// its stderr goes to `dir/stderr_name`.
    async fn run(
        &self,
        dir: &Path,
        case: Option<Case>,
        stderr_name: &str,
    ) -> Result<Ended, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let acks = dir.join("acks");
        let child_case = ChildCase {
            scenario: self.scenario.describe(),
            root: dir.join("workspace"),
            data: dir.join("data"),
            acks: acks.clone(),
            case: case.map(|c| c.code()),
        };
        let stderr_path = dir.join(stderr_name);
        let stderr = std::fs::File::create(&stderr_path).map_err(|e| e.to_string())?;
        let mut child = tokio::process::Command::new(self.exe)
            .args([self.test, "--exact", "--nocapture", "--test-threads=1"])
            .env(
                CHILD,
                serde_json::to_string(&child_case).expect("a case serializes"),
            )
            .env_remove(CASE)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("the test binary does not start again: {e}"))?;
        let status = match tokio::time::timeout(WAIT_LIMIT * 2, child.wait()).await {
            Ok(status) => status.map_err(|e| e.to_string())?,
            Err(_) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Err(format!(
                    "the child ran past {:?}: {}",
                    WAIT_LIMIT * 2,
                    tail(&stderr_path)
                ));
            }
        };
        let acks = Acks::read(&acks);
        if status.signal() == Some(9) {
            crate::backend::node_killed(&dir.join("data"))
                .map_err(|e| format!("the killed node's lease: {e}"))?;
        }
        match (status.code(), status.signal()) {
            (Some(0), _) if acks.fenced => Ok(Ended::Fenced(acks)),
            (Some(0), _) if acks.flushes.is_some() => Ok(Ended::Finished(acks)),
            (_, Some(9)) if case.is_some() => Ok(Ended::Killed(acks)),
            _ => Err(format!(
                "the child ended {status} before its crash point: {}",
                tail(&stderr_path)
            )),
        }
    }
}

/// What a child's stderr says of its end, for a report: its first panic
/// (the lines after a backtrace's start hide it), else its last lines.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    match lines.iter().position(|l| l.contains(" panicked at ")) {
        Some(at) => lines[at..]
            .iter()
            .take_while(|l| !l.starts_with("stack backtrace:"))
            .take(8)
            .copied()
            .collect::<Vec<_>>()
            .join("\n"),
        None => lines[lines.len().saturating_sub(12)..].join("\n"),
    }
}

/// In the child: runs the scenario on the case's data dir with the crash
/// armed, writes down what it is told, and exits 0 if the run ends first.
async fn run_child(scenario: &Scenario, case: ChildCase) -> ! {
    let crash = case
        .case
        .as_deref()
        .map(|code| Case::parse(code).expect("the parent wrote a case"));
    let workspace = scenario
        .workspace(&case.root)
        .unwrap_or_else(|e| panic!("the scenario's workspace does not load: {e}"));
    let models = scenario.models_for(&workspace);
    let acks = Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&case.acks)
            .expect("the acks file opens"),
    );
    if let Some(Case {
        at: At::Claim(point),
        ..
    }) = crash
    {
        // The claimer: its start claims the dead node's runs, and dies there.
        arbor_storage::crash_at_first_claim(point);
        let _node = TestNode::open(workspace, &case.data, models).await;
        eprintln!("the node started without dying at its claim");
        std::process::exit(3);
    }
    let node = TestNode::open(workspace, &case.data, models)
        .await
        .unwrap_or_else(|e| panic!("the node does not start: {e}"));
    let journal = node.journal().clone();
    // The base first: a flush between the two is counted toward the case's
    // k and told to nobody, so at most k - 1 are told before flush k.
    let base = journal.flush_count();
    let _ = (&*acks).write_all(format!("opened {}\n", journal.durable_seq()).as_bytes());
    journal
        .faults()
        .record_durable_to(acks.try_clone().expect("the acks file"));
    match crash.map(|c| (base + c.flush, c.at)) {
        Some((flush, At::Crash { point, kind })) => {
            journal.faults().crash_at(Crash { flush, point, kind })
        }
        Some((flush, At::Fenced)) => journal.faults().fence_at(flush),
        Some((flush, At::Renewal(point))) => journal.faults().crash_at_renewal(flush, point),
        Some((_, At::Claim(_))) | None => {}
    }
    {
        // A job's end is told (`JobFinished`) only once it is durable.
        let acks = Arc::clone(&acks);
        node.observe(move |event| {
            if let EventKind::JobFinished { result, .. } = &event.kind {
                let id = result.job;
                let status = serde_json::to_value(result.status).unwrap_or_default();
                let status = status.as_str().unwrap_or("unknown");
                let _ = (&*acks).write_all(format!("ended {id} {status}\n").as_bytes());
            }
        });
    }
    let work = async {
        let run = match scenario.start_run(&node).await {
            Ok(run) => run,
            // Fenced at the run's first commit: the other branch goes on.
            Err(_) if journal.is_shared() && journal.failed().is_some() => {
                std::future::pending().await
            }
            Err(e) => panic!("the run does not start: {e}"),
        };
        let _ = (&*acks).write_all(format!("run {run}\n").as_bytes());
        if let Some(during) = &scenario.during {
            during(&node, run).await;
        }
        node.wait_run(run).await;
    };
    let lost = node.node().lease_lost();
    let lease_gone = || {
        journal
            .lease_lost()
            .is_some_and(|lost| lost.borrow().is_some())
    };
    // Fenced: its runs are stopped here (the node does that on losing the
    // lease, which may also end the run as the work sees it), and its
    // shutdown's own commits are refused; the parent checks that nothing
    // of the runs is left.
    let fenced = tokio::select! {
        () = work => lease_gone(),
        _ = lost => true,
    };
    let shut = node.try_shutdown().await;
    if fenced || lease_gone() {
        let _ = (&*acks).write_all(b"fenced\n");
        drop(journal);
        std::process::exit(0)
    }
    shut.unwrap_or_else(|e| panic!("a clean shutdown: {e}"));
    let flushes = journal.flush_count() - base;
    let _ = (&*acks).write_all(format!("flushes {flushes}\n").as_bytes());
    drop(journal);
    std::process::exit(0)
}

/// In the parent, after a child died: recovery on its data dir, the run to
/// its end, and every check.
///
/// On a shared journal, every run the node recovered is owned at `epoch`
/// or later: the dead node's claims only ever grow.
async fn recover_and_check(
    scenario: &Scenario,
    dir: &Path,
    acks: &Acks,
    check: &impl Fn(&TestNode, RunId) -> Result<(), String>,
    epoch: u64,
    outcome: &mut CaseOutcome,
) {
    let found = &mut outcome.found;
    let data = dir.join("data");
    // What was acknowledged is there before recovery adds anything.
    match crate::backend::open_journal_read_only(&data) {
        Ok(journal) => {
            if journal.applied_seq() < acks.durable {
                found.push(format!(
                    "seq {} was acknowledged durable; the journal holds up to {}",
                    acks.durable,
                    journal.applied_seq()
                ));
            }
        }
        Err(e) => found.push(format!("the journal does not open: {e}")),
    }
    let workspace = match scenario.workspace(&dir.join("workspace")) {
        Ok(w) => w,
        Err(e) => return found.push(format!("the workspace does not load: {e}")),
    };
    let models = scenario.models_for(&workspace);
    let node = match TestNode::open(workspace, &data, models).await {
        Ok(node) => node,
        Err(e) => return found.push(format!("the node does not restart: {e}")),
    };
    let recovery = node.node().recovery();
    outcome.jobs_interrupted += recovery.jobs_failed.len() as u64;
    for b in &recovery.breaches {
        found.push(format!("recovery found a breach: {b}"));
    }
    for u in &recovery.undecodable {
        found.push(format!("recovery found an undecodable record: {u:?}"));
    }
    // The run the child was told it started must be there; whether or not
    // it was told (a crash inside the start), every run the journal holds
    // must finish, resumed or ended.
    if let Some(run) = acks.run {
        match node.journal().run(run) {
            Ok(Some(_)) => {}
            Ok(None) => found.push(format!(
                "the run {run} was started (acknowledged) and is gone"
            )),
            Err(e) => found.push(format!("the run's record does not read: {e}")),
        }
    }
    let runs = node.journal().runs().unwrap_or_default();
    for run in runs.iter().map(|r| r.id) {
        let after = async {
            if let Some(after) = &scenario.after_restart {
                after(&node, run).await;
            }
        };
        let (finished, ()) = tokio::join!(
            tokio::time::timeout(
                WAIT_LIMIT,
                node.node().wait_tree(run, |t| t.run_status().is_terminal()),
            ),
            tokio::time::timeout(WAIT_LIMIT, after).map(|_| ())
        );
        if finished.is_err() {
            let tree = node.tree(run);
            let open: Vec<String> = tree
                .nodes()
                .filter(|(_, n)| !n.status.is_terminal())
                .map(|(id, n)| {
                    format!(
                        "{id} ({}) {}",
                        n.label.as_deref().or(n.agent.as_deref()).unwrap_or("?"),
                        n.status
                    )
                })
                .collect();
            found.push(format!(
                "run {run}, resumed or ended, did not finish within {WAIT_LIMIT:?}: it is {}, and not ended: {}",
                tree.run_status(),
                open.join(", ")
            ));
        }
    }
    let recorded: std::collections::HashMap<JobId, Status> = node
        .journal()
        .all_jobs()
        .unwrap_or_default()
        .into_iter()
        .map(|j| (j.id, j.status))
        .collect();
    for (job, status) in &acks.ended {
        match recorded.get(job) {
            Some(now) if now == status => {}
            Some(now) => found.push(format!(
                "job {job} was told ended {status}; after recovery it is {now}"
            )),
            None => found.push(format!("job {job} was told ended {status}; it is gone")),
        }
    }
    for run in &runs {
        match node.journal().owner(run.id) {
            Ok(Some((_, at))) if at < epoch => found.push(format!(
                "run {} is owned at epoch {at} after the recovery; it must be {epoch} or later",
                run.id
            )),
            Ok(_) => {}
            Err(e) => found.push(format!("the run's owner does not read: {e}")),
        }
    }
    let checked = checks::recovered(node.journal(), &mut checks::Seen::default());
    outcome.records_checked += checked.records;
    found.extend(checked.violations);
    if let Some(run) = acks.run.or_else(|| runs.first().map(|r| r.id))
        && found.is_empty()
    {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&node, run)));
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => found.push(format!("the test's check: {e}")),
            Err(panic) => found.push(format!(
                "the test's check panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)")
            )),
        }
    }
    node.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_reads_back_from_its_code_and_bad_codes_are_none() {
        let cases = every_case(3, true);
        // Four crashes a flush, a fence a flush, two renewals, two claims.
        assert_eq!(cases.len(), 3 * 4 + 3 + 4);
        for case in &cases {
            assert_eq!(Case::parse(&case.code()), Some(*case), "{}", case.code());
        }
        assert_eq!(every_case(3, false).len(), 12, "no lease points on sled");
        for bad in [
            "",
            "x:before:kill",
            "1:fenced:kill",
            "1:claim",
            "1:claim:late",
            "1:before",
        ] {
            assert_eq!(Case::parse(bad), None, "{bad:?}");
        }
    }
}
