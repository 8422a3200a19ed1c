//! F1: fair dispatch (issue 49). One tenant floods arbord's admission queue
//! with `flood` runs of 50 ms each, faster than the node's slots can run
//! them; then another tenant submits one quick run. The figure is how long
//! that run takes from its `POST /v1/runs` to its start (its `run_started`
//! event), beside the same run on the same node when it is idle. Goal: at
//! most 2x, with `[limits.concurrency] per_tenant` keeping a slot from the
//! flood. Without a key the flood holds every slot, and the quiet run,
//! next in line whatever the flood queued, waits for one of them to end:
//! that figure is a note, not the goal's.

use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Row, Unit};
use crate::trial::interleaved;
use arbor_protocol::{EventKind, RunId};
use arbor_testkit::service::{TestService, Texts};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const QUICK: &str = "---\ndescription: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: hi}}\n---\nYou answer.\n";
const SLOW: &str = "---\ndescription: answers after 50 ms\nscript:\n  - say: thinking\n    delay: 50ms\n  - call: {tool: submit_output, args: {output: hi}}\n---\nYou answer.\n";

/// Running runs at once on the node.
const SLOTS: usize = 8;

/// When each run started and how many ended, as the node's bus tells them.
#[derive(Default)]
struct Seen {
    started: Mutex<HashMap<RunId, Instant>>,
    ended: Mutex<usize>,
    moved: Notify,
}

struct Node {
    svc: TestService,
    seen: Arc<Seen>,
}

impl Node {
    async fn start(per_tenant: Option<usize>) -> Node {
        let bound = per_tenant
            .map(|n| format!("[limits.concurrency]\nper_tenant = {n}\n\n"))
            .unwrap_or_default();
        let texts = Texts::new(
            &[("quick", QUICK), ("slow", SLOW)],
            &[
                (
                    "hello",
                    "[[group]]\nsteps = [{ agent = \"quick\", instruction = \"say hi\" }]\n",
                ),
                (
                    "long",
                    "[[group]]\nsteps = [{ agent = \"slow\", instruction = \"say hi\" }]\n",
                ),
            ],
        )
        .with_config(&format!(
            "[service]\nmax_running_runs = {SLOTS}\nmax_queued_runs = 100000\n\n{bound}\
             [tenants.flood]\n[tenants.quiet]\n"
        ));
        let svc = TestService::start(texts).await;
        let seen = Arc::new(Seen::default());
        {
            let seen = seen.clone();
            svc.service.node().events().observe(Arc::new(move |e| {
                match e.kind {
                    EventKind::RunStarted { .. } => {
                        seen.started.lock().unwrap().insert(e.run, Instant::now());
                    }
                    EventKind::RunFinished { .. } => *seen.ended.lock().unwrap() += 1,
                    _ => return,
                }
                seen.moved.notify_waiters();
            }));
        }
        Node { svc, seen }
    }

    async fn submit(&self, tenant: &str, flow: &str) -> anyhow::Result<RunId> {
        let (status, reply) = self
            .svc
            .post_json("/v1/runs", json!({"flow": flow, "tenant": tenant}))
            .await;
        anyhow::ensure!(status == 201, "a submission was refused: {reply}");
        Ok(reply["id"].as_str().unwrap_or_default().parse()?)
    }

    /// Waits until `check` holds of what the bus told.
    async fn until(&self, check: impl Fn(&Seen) -> bool) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(600), async {
            loop {
                let moved = self.seen.moved.notified();
                if check(&self.seen) {
                    return;
                }
                moved.await;
            }
        })
        .await
        .map_err(|_| anyhow::anyhow!("the node did not get there in 10 minutes"))
    }

    /// Submits `flood` runs of the flooding tenant (none: the node is idle),
    /// then one of the quiet tenant's: the time from that submission to its
    /// start. Returns once every run has ended; `queued` gets how many runs
    /// were waiting when the quiet one was submitted.
    async fn quiet_start(&self, flood: usize, queued: &Mutex<Vec<u64>>) -> anyhow::Result<f64> {
        let ended = *self.seen.ended.lock().unwrap();
        for _ in 0..flood {
            self.submit("flood", "long").await?;
        }
        let (_, status) = self.svc.get_json("/v1/status").await;
        queued
            .lock()
            .unwrap()
            .push(status["admission"]["queued"].as_u64().unwrap_or(0));
        let asked = Instant::now();
        let quiet = self.submit("quiet", "hello").await?;
        self.until(|seen| seen.started.lock().unwrap().contains_key(&quiet))
            .await?;
        let started = self.seen.started.lock().unwrap()[&quiet];
        self.until(|seen| *seen.ended.lock().unwrap() > ended + flood)
            .await?;
        Ok(started.duration_since(asked).as_secs_f64())
    }
}

/// The row, and how many runs were queued at each quiet submission.
async fn row(
    label: &str,
    per_tenant: Option<usize>,
    flood: usize,
) -> anyhow::Result<(Row, Vec<u64>)> {
    let node = Node::start(per_tenant).await;
    let (idle, queued) = (Mutex::new(vec![]), Mutex::new(vec![]));
    let row = interleaved(
        "F1",
        label,
        async |_| node.quiet_start(0, &idle).await,
        async |_| node.quiet_start(flood, &queued).await,
    )
    .await?;
    node.svc.stop().await;
    Ok((row, queued.into_inner().unwrap()))
}

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let flood = if sizes.quick { 40 } else { 1000 };
    let (keyed, queued) = row(
        &format!("per_tenant = {}", SLOTS / 2),
        Some(SLOTS / 2),
        flood,
    )
    .await?;
    let (open, open_queued) = row("no concurrency key", None, flood).await?;
    let ms = |s: f64| format!("{:.2} ms", s * 1000.0);
    Ok(Outcome {
        id: "F1",
        what: "a quiet tenant's run behind another tenant's flood, from submission to start",
        unit: Unit::Seconds,
        per: "per run",
        bound: Bound::AtMost(2.0),
        rows: vec![keyed],
        conditions: vec![],
        notes: vec![
            format!(
                "arbord in process (sled journal, loopback HTTP), {SLOTS} runs at once; each repetition: the flooding tenant submits {flood} one-step runs of 50 ms each (a scripted agent that waits, then answers), then the quiet tenant submits one that answers at once; the figure is from the quiet run's POST to its run_started event, beside the same submission on the idle node (the baseline); the repetition ends when every run has; runs queued at the quiet submission: {queued:?}"
            ),
            format!(
                "without a concurrency key the flood holds all {SLOTS} slots and the quiet run, next in line, waits for one of them to end: {} (idle {}), ratio {:.1}; runs queued at its submission: {open_queued:?}",
                ms(open.arbor_median()),
                ms(open.baseline_median()),
                open.arbor_median() / open.baseline_median()
            ),
        ],
    })
}
