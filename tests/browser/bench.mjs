// The console's run page under load, in Debian's chromium (docs/benchmarks.md):
//   node tests/browser/bench.mjs [--quick]
// (ARBORD=target/release/arbord for the numbers in the docs; TRACE=PREFIX
// also writes a Chrome trace of each L window to PREFIX-RATE.json).
//
// D: a finished run of examples/fanout (1,088 steps and jobs): the time from
//    navigation to the whole tree drawn, by the page's own clock
//    (performance.now() counts from the navigation's start).
// L: the same tree, then a second group of steps whose jobs end at a steady
//    rate, at two rates: the events the page received and the events the
//    node had sent, the stream connections it needed (1: it was never
//    dropped as a slow client), its reads of the tree, and its main
//    thread's busy time per second (Chrome's own Performance.getMetrics).

import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { launch, login, repo, startArbord, until } from "./lib.mjs";

const quick = process.argv.includes("--quick");

// examples/fanout, and a flow that adds paced jobs after its fan-out:
// `pacers` steps, each delegating sixteen jobs a turn for `turns` turns,
// each job answering after `delay` ms.
function workspace(pacers, turns, delay) {
  const dir = mkdtempSync(path.join(tmpdir(), "arbor-console-bench-"));
  cpSync(path.join(repo, "examples/fanout"), dir, { recursive: true });
  const toml = readFileSync(path.join(dir, "arbor.toml"), "utf8").replace(/spawn_cap = \d+/, "spawn_cap = 20000");
  writeFileSync(path.join(dir, "arbor.toml"), toml);
  const jobs = Array.from({ length: 16 }, (_, i) => `          - { agent: tick, request: "tick ${i + 1}" }`).join("\n");
  const turn = `  - call:\n      tool: delegate\n      args:\n        jobs:\n${jobs}\n`;
  mkdirSync(path.join(dir, "agents/pacer"));
  mkdirSync(path.join(dir, "agents/tick"));
  writeFileSync(
    path.join(dir, "agents/pacer/agent.md"),
    `---\ndescription: Delegates sixteen paced jobs a turn.\nsubagents: [tick]\nscript:\n${turn.repeat(turns)}  - call: { tool: submit_output, args: { output: "paced", task_status: completed } }\n---\nYou pace.\n`,
  );
  writeFileSync(
    path.join(dir, "agents/tick/agent.md"),
    `---\ndescription: Answers after a while.\nscript:\n  - delay: ${delay}ms\n    call: { tool: submit_output, args: { output: "tick", task_status: completed } }\n---\nYou tick.\n`,
  );
  const fanout = readFileSync(path.join(dir, "flows/fanout.toml"), "utf8");
  const steps = Array.from({ length: pacers }, (_, i) => `  { agent = "pacer", instruction = "Pace ${i + 1}." },`).join("\n");
  writeFileSync(path.join(dir, "flows/live.toml"), `${fanout}\n[[group]]\nsteps = [\n${steps}\n]\n`);
  return dir;
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function metrics(cdp) {
  const { metrics } = await cdp.send("Performance.getMetrics");
  return Object.fromEntries(metrics.map((m) => [m.name, m.value]));
}

// The events the node has of the run, counted from its stream (not followed).
async function sent(node, run) {
  const response = await fetch(`${node.base}/v1/runs/${run}/events?follow=false`, {
    headers: { authorization: `Bearer ${node.token}` },
  });
  const text = await response.text();
  return (text.match(/^id:/gm) ?? []).length;
}

async function drawn(browser, node) {
  const { id } = await node.api("POST", "/v1/runs", { flow: "fanout" });
  await until("the fan-out to end", async () => (await node.api("GET", `/v1/runs/${id}`)).run.status === "done", 120000);
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  await login(page, node.base, node.token);
  const times = [];
  for (let i = 0; i < (quick ? 2 : 7); i += 1) {
    await page.goto("about:blank");
    await page.goto(`${node.base}/ui#/runs/${id}`);
    await page.waitForFunction(() => document.querySelectorAll("#tree li").length >= 1088, null, { timeout: 60000 });
    times.push(await page.evaluate(() => performance.now()));
  }
  await context.close();
  return times;
}

async function live(browser, node, rate) {
  const { id } = await node.api("POST", "/v1/runs", { flow: "live" });
  // Open the page once the fan-out is done and the paced jobs go.
  await until(
    "the paced group to start",
    async () => (await node.api("GET", `/v1/runs/${id}`)).run.children.some((c) => c.agent === "pacer" && c.status === "running"),
    120000,
  );
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const requests = [];
  page.on("request", (r) => requests.push(r.url()));
  await login(page, node.base, node.token);
  await page.goto(`${node.base}/ui#/runs/${id}`);
  await page.waitForFunction(() => document.querySelectorAll("#tree li").length >= 1088, null, { timeout: 60000 });
  const cdp = await context.newCDPSession(page);
  await cdp.send("Performance.enable");
  const seen = () => page.evaluate((run) => Number(sessionStorage.getItem(`arbor.events.${run}`) ?? 0), id);
  // Caught up with what was sent before it opened, it is measured.
  await until("the page to catch up with the stream", async () => (await seen()) >= (await sent(node, id)) - rate, 120000);
  const window = quick ? 3000 : 8000;
  const [m0, s0, n0, t0] = [await metrics(cdp), await seen(), await sent(node, id), Date.now()];
  const reads0 = requests.filter((u) => u.endsWith(`/v1/runs/${id}`)).length;
  const trace = process.env.TRACE;
  if (trace) await browser.startTracing(page, { path: `${trace}-${rate}.json` });
  await page.waitForTimeout(window); // a measuring window, not a synchronisation
  if (trace) await browser.stopTracing();
  const [m1, s1, n1, t1] = [await metrics(cdp), await seen(), await sent(node, id), Date.now()];
  const reads1 = requests.filter((u) => u.endsWith(`/v1/runs/${id}`)).length;
  const secs = (t1 - t0) / 1000;
  const busy = (name) => ((m1[name] - m0[name]) / secs) * 1000; // ms per second
  const result = {
    rate,
    sent_per_s: Math.round((n1 - n0) / secs),
    received_per_s: Math.round((s1 - s0) / secs),
    behind_at_end: n1 - s1,
    streams: requests.filter((u) => u.includes(`/v1/runs/${id}/events`)).length,
    tree_reads_per_s: +((reads1 - reads0) / secs).toFixed(1),
    task_ms_per_s: Math.round(busy("TaskDuration")),
    script_ms_per_s: Math.round(busy("ScriptDuration")),
    style_ms_per_s: Math.round(busy("RecalcStyleDuration")),
    layout_ms_per_s: Math.round(busy("LayoutDuration")),
    nodes: await page.locator("#tree li").count(),
  };
  await node.api("POST", `/v1/runs/${id}/stop`).catch(() => {});
  await context.close();
  return result;
}

const browser = await launch();
try {
  // D: drawn.
  {
    const node = await startArbord(path.join(repo, "examples/fanout"));
    try {
      const times = await drawn(browser, node);
      console.log(`D drawn_ms median=${median(times).toFixed(0)} all=${times.map((t) => t.toFixed(0)).join(",")} goal<1000 ${median(times) < 1000 ? "holds" : "misses"}`);
    } finally {
      await node.stop();
    }
  }
  // L: live, about 100 and about 1,000 events a second.
  for (const [rate, pacers] of [[100, 1], [1000, 13]]) {
    const dir = workspace(pacers, quick ? 4 : 10, 1500);
    const node = await startArbord(dir);
    try {
      const r = await live(browser, node, rate);
      const keeps = r.streams === 1 && r.behind_at_end <= r.sent_per_s; // within a second of the stream
      console.log(`L ${Object.entries(r).map(([k, v]) => `${k}=${v}`).join(" ")} ${keeps ? "keeps up" : "falls behind"}`);
    } finally {
      await node.stop();
      rmSync(dir, { recursive: true, force: true });
    }
  }
} finally {
  await browser.close();
}
