//! M1: one MCP call, the everything reference server's `echo`, from the
//! calling job's view: from the step's model reply that asks for it to the
//! tool result (the schema check, the journal, the Sandbox, the sealed
//! server and back), the model turn around it excluded. Beside it, the same
//! call from a bare rmcp client to the same server, spawned unsealed by
//! tokio with its pipes, in the same process.
//!
//! A repetition is one run whose step calls `echo` `mcp_calls` times in a
//! row, one call a turn, or one bare server process called as many times.
//! Its figure is the median call after the first; the first of each side
//! carries its server's start (arbor's: a sealed start in the job's
//! sandbox, and `initialize`), reported as a note beside the bare start.
//! Each arbor call is timed by an observer in the emitting task, at the
//! step's `ModelCalled` and at its `ToolCalled`.
//!
//! Needs the reference servers: `npm ci --prefix tests/mcp`.

use crate::goals::Sizes;
use crate::report::{Bound, Outcome, Unit, figure};
use crate::trial::interleaved;
use crate::workload::Marks;
use anyhow::{Context, bail};
use arbor_protocol::Status;
use arbor_testkit::{TestNode, agent_md};
use arbor_tests::measure::median;
use std::path::PathBuf;
use std::time::Instant;

const TOOL: &str = "mcp__everything__echo";

pub async fn run(sizes: &Sizes) -> anyhow::Result<Outcome> {
    let calls = sizes.mcp_calls;
    let server = everything()?;
    let modules = server
        .ancestors()
        .nth(2)
        .context("the server is in node_modules/.bin")?;
    let config = format!(
        "[mcp.servers.everything]\ncommand = {:?}\nread_only = [{:?}]\n",
        server.display().to_string(),
        modules.display().to_string()
    );
    let mut script = format!(
        "mcp: [everything]\nmax_turns: {}\nmax_repeats: {}\nscript:\n",
        calls + 1,
        calls + 1
    );
    for _ in 0..calls {
        script.push_str(&format!(
            "  - call: {{tool: {TOOL}, args: {{message: hi}}}}\n"
        ));
    }
    script.push_str("  - call: {tool: submit_output, args: {output: done}}");
    let node = TestNode::start_with_config(&config, &[("caller", &agent_md(&script))]).await;
    let marks = Marks::install(&node, TOOL);
    let (mut arbor_all, mut bare_all) = (vec![], vec![]);
    let (mut arbor_starts, mut bare_starts) = (vec![], vec![]);

    let row = interleaved(
        "M1",
        "",
        async |_| {
            let (start, samples) = bare_calls(&server, calls).await?;
            bare_starts.push(start);
            bare_all.extend_from_slice(&samples);
            Ok(median(&samples))
        },
        async |_| {
            let run = node.run_agent("caller", "go").await;
            let tree = node.wait_run(run).await;
            if tree.run_status() != Status::Done {
                bail!("the calling run did not end done: {:?}", tree.root());
            }
            let all = marks.calls(run, calls)?;
            arbor_starts.push(all[0]);
            let samples = all[1..].to_vec();
            arbor_all.extend_from_slice(&samples);
            Ok(median(&samples))
        },
    )
    .await?;
    let p99 = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[(xs.len() * 99 / 100).min(xs.len() - 1)]
    };
    let seconds = |x: f64| figure(x, Unit::Seconds);
    let (arbor_start, bare_start) = (median(&arbor_starts), median(&bare_starts));
    let beyond = arbor_start - bare_start;
    let beyond = if beyond >= 0.0 {
        seconds(beyond)
    } else {
        format!("none, {} less", seconds(-beyond))
    };
    let notes = vec![
        format!(
            "p99 over every measured call: arbor {}, bare {}",
            seconds(p99(&mut arbor_all)),
            seconds(p99(&mut bare_all))
        ),
        format!(
            "first call, its server's start included (median of the repetitions): arbor {} (sealed), bare {}; beyond the bare start: {} (goal < 50ms)",
            seconds(arbor_start),
            seconds(bare_start),
            beyond
        ),
        format!(
            "each repetition: {calls} echo calls in a row; arbor: one run whose step makes them, one a model turn, each from the model's reply to the tool result; bare: rmcp's client on a server spawned by tokio, unsealed"
        ),
    ];
    node.shutdown().await;
    Ok(Outcome {
        id: "M1",
        what: "MCP call (everything's echo)",
        unit: Unit::Seconds,
        per: "per call",
        bound: Bound::AtMost(1.5),
        rows: vec![row],
        conditions: vec![],
        notes,
    })
}

/// The everything server of `tests/mcp`.
fn everything() -> anyhow::Result<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/mcp/node_modules/.bin/mcp-server-everything");
    let folder = bin
        .parent()
        .and_then(|f| std::fs::canonicalize(f).ok())
        .context("the MCP reference servers are not installed: npm ci --prefix tests/mcp")?;
    Ok(folder.join("mcp-server-everything"))
}

/// A bare server: spawned, initialized and called `calls` times by rmcp's
/// client. Returns the start and first call, and each call after it.
async fn bare_calls(server: &PathBuf, calls: usize) -> anyhow::Result<(f64, Vec<f64>)> {
    use rmcp::ServiceExt;
    use rmcp::model::CallToolRequestParams;
    let began = Instant::now();
    let mut child = tokio::process::Command::new(server)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("the bare server")?;
    let (stdout, stdin) = (
        child.stdout.take().context("its stdout")?,
        child.stdin.take().context("its stdin")?,
    );
    let client = ().serve((stdout, stdin)).await?;
    let mut args = serde_json::Map::new();
    args.insert("message".into(), "hi".into());
    let mut samples = Vec::with_capacity(calls);
    let mut start = 0.0;
    for n in 0..calls {
        let at = Instant::now();
        let params = CallToolRequestParams::new("echo").with_arguments(args.clone());
        client.peer().call_tool(params).await?;
        if n == 0 {
            start = began.elapsed().as_secs_f64();
        } else {
            samples.push(at.elapsed().as_secs_f64());
        }
    }
    let _ = client.cancel().await;
    let _ = child.kill().await;
    Ok((start, samples))
}
