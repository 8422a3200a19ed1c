//! C and F: arbor on several nodes sharing one PostgreSQL journal, as
//! whole `arbord` processes (the one built beside this `arbor-bench`) on
//! loopback, against the server `ARBOR_DATABASE_URL` names; each
//! repetition on a fresh schema.
//!
//! C: many small runs, `runs` of them submitted through the nodes in turn,
//! 32 requests in flight, each node running at most `max_running_runs = 8`
//! at once: the capacity of one node that a cluster multiplies. Two
//! workloads: an agent that submits at once (the cost is arbor's and the
//! database's alone), and one whose model answers in `THINKS` (a node's
//! capacity, its runs at once, is what limits it, as with a real model). A
//! repetition's figure is runs/s from the first submission until the last
//! run is done (every node lists every run). One node, then three,
//! alternating, after one unmeasured warm-up of each; the ratio is three's
//! median over one's. Goal: >= 2.
//!
//! F: failover. Two nodes with a 2 s lease; a run whose step waits (its
//! first model call takes an hour) runs on the first; it is killed with
//! SIGKILL; the figure is the time from the kill until the second node
//! runs the step again (its document: epoch 2, the step's attempt 2
//! running). Goal: within the lease plus 1 s, every repetition.

use anyhow::{Context, bail, ensure};
use arbor_service::api::SubmitRun;
use arbor_service::client::Client;
use futures::StreamExt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// C's goal: three nodes' runs/s over one node's.
const GOAL_RATIO: f64 = 2.0;

/// How long the second workload's model takes to answer.
const THINKS: Duration = Duration::from_millis(200);

/// F's lease.
const LEASE: Duration = Duration::from_secs(2);

/// How long any one wait here may take before the measurement gives up.
const LIMIT: Duration = Duration::from_secs(300);

/// What was measured.
pub struct Measured {
    pub runs: usize,
    /// C's runs/s, each repetition: one node, three nodes; an agent that
    /// submits at once.
    pub one: Vec<f64>,
    pub three: Vec<f64>,
    /// The same with a model that answers in `THINKS`.
    pub thinking_runs: usize,
    pub one_thinking: Vec<f64>,
    pub three_thinking: Vec<f64>,
    /// F's failover times.
    pub failovers: Vec<Duration>,
}

/// The `arbord` beside the running `arbor-bench`.
pub fn arbord_beside_me() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("where arbor-bench is")?;
    let arbord = me.with_file_name("arbord");
    ensure!(
        arbord.is_file(),
        "no arbord beside {} (build it: cargo build --release -p arbor-bin -p arbor-bench)",
        me.display()
    );
    Ok(arbord)
}

/// A running arbord.
struct Node {
    child: Child,
    client: Client,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A workspace on a fresh schema: `tiny` submits at once, `thinks` once
/// its model has answered (in `THINKS`), `waits` waits an hour for its
/// first model call.
fn workspace(url: &str, lease: Duration) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let agents = [
        (
            "tiny",
            "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: done}}".to_string(),
        ),
        (
            "thinks",
            format!(
                "description: answers once its model has\nscript:\n  - say: thinking\n    delay: {}ms\n    call: {{tool: submit_output, args: {{output: done}}}}",
                THINKS.as_millis()
            ),
        ),
        (
            "waits",
            "description: waits\nscript:\n  - say: working\n    delay: 1h\n    call: {tool: submit_output, args: {output: late}}".to_string(),
        ),
    ];
    for (name, front) in &agents {
        let at = dir.path().join("agents").join(name);
        std::fs::create_dir_all(&at)?;
        std::fs::write(at.join("agent.md"), arbor_testkit::agent_md(front))?;
    }
    let schema = format!("bench_{}", arbor_protocol::RunId::new().0.simple());
    std::fs::write(
        dir.path().join("arbor.toml"),
        format!(
            "[service]\nmax_running_runs = 8\n\n[journal]\nbackend = \"postgres\"\nurl = \"{url}\"\n\
             schema = \"{schema}\"\nlease = \"{}ms\"\n",
            lease.as_millis()
        ),
    )?;
    Ok(dir)
}

/// Starts an arbord on `workspace` as node `id`, and waits until it listens.
fn start(arbord: &Path, workspace: &Path, data: &Path, id: &str) -> anyhow::Result<Node> {
    let mut child = Command::new(arbord)
        .arg("--workspace")
        .arg(workspace)
        .arg("--data-dir")
        .arg(data.join(id))
        .args(["--listen", "127.0.0.1:0", "--node-id", id])
        .env_remove("ARBOR_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", arbord.display()))?;
    let mut lines = BufReader::new(child.stderr.take().context("arbord's stderr")?).lines();
    let mut said = vec![];
    let url = loop {
        let Some(line) = lines.next() else {
            bail!("arbord {id} ended before it listened: {}", said.join("\n"));
        };
        let line = line?;
        if let Some(rest) = line.strip_prefix("arbord: listening on ") {
            break rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string();
        }
        said.push(line);
    };
    // The rest of what it says is not read: drained, so it never blocks.
    std::thread::spawn(move || for _ in lines {});
    let token = std::fs::read_to_string(data.join(id).join("token"))?;
    Ok(Node {
        child,
        client: Client::new(&url, Some(token.trim().to_string()))?,
    })
}

fn submit_body(agent: &str) -> SubmitRun {
    SubmitRun {
        flow: None,
        agent: Some(agent.into()),
        input: Some("go".into()),
        budget: None,
        record: false,
        tenant: None,
        on_ceiling: None,
        pause_timeout: None,
        priority: None,
    }
}

/// One repetition of C on `nodes` nodes, `runs` runs of `agent`: runs/s.
async fn throughput(
    arbord: &Path,
    url: &str,
    nodes: usize,
    runs: usize,
    agent: &str,
) -> anyhow::Result<f64> {
    let ws = workspace(url, Duration::from_secs(10))?;
    let data = tempfile::tempdir()?;
    let cluster: Vec<Node> = (0..nodes)
        .map(|n| start(arbord, ws.path(), data.path(), &format!("n{n}")))
        .collect::<anyhow::Result<_>>()?;
    let body = submit_body(agent);
    let started = Instant::now();
    let submitted: Vec<_> = futures::stream::iter(0..runs)
        .map(|n| {
            let (client, body) = (&cluster[n % nodes].client, &body);
            async move { client.submit(body, None).await }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for created in submitted {
        created.context("a submission")?;
    }
    loop {
        let done = cluster[0]
            .client
            .runs(Some("done"), 500, None)
            .await
            .context("listing the runs")?
            .runs
            .len();
        if done >= runs {
            break;
        }
        ensure!(started.elapsed() < LIMIT, "{done} of {runs} runs done");
        // Polling the list: the figure is seconds, the poll 5 ms.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(runs as f64 / started.elapsed().as_secs_f64())
}

/// One repetition of F: from the owner's SIGKILL to the step running again
/// on the other node.
async fn failover(arbord: &Path, url: &str) -> anyhow::Result<Duration> {
    let ws = workspace(url, LEASE)?;
    let data = tempfile::tempdir()?;
    let a = start(arbord, ws.path(), data.path(), "a")?;
    let run = a.client.submit(&submit_body("waits"), None).await?.id;
    let running = |doc: &serde_json::Value, attempt: u64| {
        doc["run"]["children"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|step| step["status"] == "running" && step["attempt"] == attempt)
    };
    let deadline = Instant::now() + LIMIT;
    loop {
        let (_, doc) = a.client.get_json(&format!("/v1/runs/{run}")).await?;
        if running(&doc, 1) {
            break;
        }
        ensure!(Instant::now() < deadline, "the step never ran on a: {doc}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // b starts once a has the run (the queue is shared).
    let b = start(arbord, ws.path(), data.path(), "b")?;
    let mut a = a;
    let killed = Instant::now();
    a.child.kill()?;
    a.child.wait()?;
    loop {
        let (_, doc) = b.client.get_json(&format!("/v1/runs/{run}")).await?;
        if doc["epoch"] == 2 && running(&doc, 2) {
            return Ok(killed.elapsed());
        }
        ensure!(Instant::now() < deadline, "b never resumed the run: {doc}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub async fn run(arbord: PathBuf, url: String, quick: bool) -> anyhow::Result<Measured> {
    let (runs, thinking_runs, reps) = if quick { (16, 16, 1) } else { (400, 200, 5) };
    eprintln!("[C] warm-up");
    throughput(&arbord, &url, 1, runs.min(50), "tiny").await?;
    throughput(&arbord, &url, 3, runs.min(50), "tiny").await?;
    let (mut one, mut three) = (vec![], vec![]);
    let (mut one_thinking, mut three_thinking) = (vec![], vec![]);
    for rep in 1..=reps {
        eprintln!("[C] repetition {rep}/{reps}");
        one.push(throughput(&arbord, &url, 1, runs, "tiny").await?);
        three.push(throughput(&arbord, &url, 3, runs, "tiny").await?);
        one_thinking.push(throughput(&arbord, &url, 1, thinking_runs, "thinks").await?);
        three_thinking.push(throughput(&arbord, &url, 3, thinking_runs, "thinks").await?);
    }
    let mut failovers = vec![];
    for rep in 1..=reps {
        eprintln!("[F] repetition {rep}/{reps}");
        failovers.push(failover(&arbord, &url).await?);
    }
    Ok(Measured {
        runs,
        one,
        three,
        thinking_runs,
        one_thinking,
        three_thinking,
        failovers,
    })
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

impl Measured {
    /// The report: the samples, then a `C` line and an `F` line.
    pub fn print(&self) {
        use crate::report::{Unit, figure, verdict};
        let rates = |v: &[f64]| {
            v.iter()
                .map(|r| figure(*r, Unit::PerSecond))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let secs = |d: &Duration| figure(d.as_secs_f64(), Unit::Seconds);
        println!(
            "C each repetition: runs submitted through the nodes in turn, 32 in flight, \
             max_running_runs = 8 per node, a fresh schema; runs/s until the last is done"
        );
        for (what, runs, one, three) in [
            (
                "an agent that submits at once",
                self.runs,
                &self.one,
                &self.three,
            ),
            (
                &format!("a model that answers in {} ms", THINKS.as_millis()) as &str,
                self.thinking_runs,
                &self.one_thinking,
                &self.three_thinking,
            ),
        ] {
            println!("C {runs} runs of {what}");
            println!("C   one node samples:    {}", rates(one));
            println!("C   three nodes samples: {}", rates(three));
            let ratio = median(three) / median(one);
            println!(
                "C   one={} three={} ratio={:.2} goal=>={GOAL_RATIO} {}",
                figure(median(one), Unit::PerSecond),
                figure(median(three), Unit::PerSecond),
                ratio,
                verdict(ratio >= GOAL_RATIO)
            );
        }
        let bound = LEASE + Duration::from_secs(1);
        println!(
            "F each repetition: two nodes, lease {}; from the owner's SIGKILL to the step's attempt 2 running on the other node",
            secs(&LEASE)
        );
        println!(
            "F samples: {}",
            self.failovers
                .iter()
                .map(secs)
                .collect::<Vec<_>>()
                .join(" ")
        );
        let mut sorted = self.failovers.clone();
        sorted.sort();
        let worst = *sorted.last().unwrap_or(&Duration::ZERO);
        println!(
            "F median={} max={} goal=<={} {}",
            secs(&sorted[sorted.len() / 2]),
            secs(&worst),
            secs(&bound),
            verdict(worst <= bound)
        );
    }
}
