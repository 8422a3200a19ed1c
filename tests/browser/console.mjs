// The console in a real browser: Debian's chromium, headless, driven by
// playwright-core, against an arbord on loopback over tests/browser/workspace.
// Run by tests/browser/run.sh (CI: .ci/run). Screenshots go to
// target/console/ for a person to look at.

import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import path from "node:path";
import { after, before, test } from "node:test";
import { find, launch, login, repo, startArbord, until } from "./lib.mjs";

const shots = path.join(repo, "target/console");
mkdirSync(shots, { recursive: true });

let node; // the arbord
let browser;
// Every URL any page asked for, to check that none carries the token.
const urls = [];
// Every script error of any page.
const errors = [];

before(async () => {
  node = await startArbord(path.join(repo, "tests/browser/workspace"));
  browser = await launch();
});

after(async () => {
  await browser?.close();
  await node?.stop();
});

async function newPage(viewport = { width: 1280, height: 800 }) {
  const context = await browser.newContext({ viewport });
  const page = await context.newPage();
  page.on("request", (request) => urls.push(request.url()));
  page.on("pageerror", (error) => errors.push(`${page.url()}: ${error.stack ?? error}`));
  return page;
}

// The tree's text (textContent: rows off the screen are not rendered, so
// innerText would leave them out).
const treeText = (page) => page.locator("#tree").textContent();

test("without a session the page asks to log in and the API answers 401", async () => {
  const page = await newPage();
  await page.goto(`${node.base}/ui#/runs/0190b4a0-0000-7000-8000-000000000000`);
  await page.locator("#login").waitFor({ state: "visible" });
  assert.match(await page.locator("#login-why").innerText(), /not logged in/);
  assert.equal(await page.locator("#run").isHidden(), true, "no run view without a session");
  assert.equal(await page.locator("#nav").isHidden(), true, "no views to go to");
  const refused = await page.goto(`${node.base}/v1/runs`);
  assert.equal(refused.status(), 401);
  // A wrong token is refused in the form, and no session is made.
  await page.goto(`${node.base}/ui`);
  await page.locator("#token").fill("not-the-token");
  await page.getByRole("button", { name: "Log in" }).click();
  await page.locator("#login-error").filter({ hasText: /./ }).waitFor();
  assert.equal((await page.context().cookies()).length, 0);
  await page.context().close();
});

test("log in, see the runs, watch a run's tree grow live, reload and resume from the last event", async () => {
  const page = await newPage();
  const { id } = await node.api("POST", "/v1/runs", { flow: "grow" });
  await login(page, node.base, node.token);
  // The session is a cookie the page's script cannot read, and not the token.
  const cookies = await page.context().cookies();
  assert.equal(cookies.length, 1);
  assert.equal(cookies[0].name, "arbor_session");
  assert.equal(cookies[0].httpOnly, true);
  assert.equal(cookies[0].sameSite, "Strict");
  assert.notEqual(cookies[0].value, node.token);
  assert.equal(await page.evaluate(() => document.cookie), "");

  const row = page.locator("#run-rows tr", { has: page.locator(`a[href="#/runs/${id}"]`) });
  await row.waitFor();
  assert.match(await row.innerText(), /grow/);
  await row.getByRole("link").click();
  await page.locator("#run").waitFor({ state: "visible" });

  // Live: the page sees workers end while the run still runs, and each
  // node has its status in words and an icon.
  await page.waitForFunction(() => {
    const done = document.querySelectorAll('#tree li[data-status="done"]').length;
    return done >= 1 && document.querySelector("#run-title").textContent.includes("running");
  });
  const partial = await page.locator('#tree li[data-status="done"]').count();
  // The run's bar is drawn to scale, as its words say (its widths are set
  // through CSSOM, which the CSP allows): most of the grant is held now.
  // One synchronous look (the page redraws it as events come).
  const drawn = await page.evaluate(() => {
    const account = document.querySelector("#run-money .account");
    const width = (s) => account.querySelector(s).getBoundingClientRect().width;
    const track = account.querySelector(".bar").clientWidth;
    return { spent: width(".spent") / track, held: width(".held") / track, words: account.textContent };
  });
  const [spent, held, grant] = drawn.words.match(/\d[\d,]*/g).map((n) => Number(n.replaceAll(",", "")));
  assert.ok(held / grant > 0.1, `a running run holds part of its grant: ${drawn.words}`);
  assert.ok(Math.abs(drawn.held - held / grant) < 0.02 && Math.abs(drawn.spent - spent / grant) < 0.02, JSON.stringify(drawn));
  assert.ok(partial < 6 && (await page.locator("#tree li").count()) < 7, `the tree was seen part-way (${partial} done)`);
  assert.match(await treeText(page), /✔ done/);
  assert.match(await treeText(page), /part-1/);

  // Reload mid-run: the stream goes on after the last event this tab saw.
  const seen = await page.evaluate((run) => Number(sessionStorage.getItem(`arbor.events.${run}`)), id);
  assert.ok(seen > 0, "events were seen before the reload");
  const streamsBefore = urls.filter((u) => u.includes(`/v1/runs/${id}/events`)).length;
  await page.reload();
  // It resumes after the last index the tab kept: the one read above, or
  // a later one if a frame stored more before the reload.
  const note = page.locator("#events-note", { hasText: "Resumed after event" });
  await note.waitFor();
  const at = Number(/\d+/.exec(await note.innerText())[0]);
  assert.ok(at >= seen, `resumed after ${at}, seen ${seen}`);
  const resumed = () => urls.filter((u) => u.includes(`/v1/runs/${id}/events`)).slice(streamsBefore);
  await until(`the stream to be asked after ${at}`, () => resumed().some((u) => u.endsWith(`?after=${at}`)));
  // The list is as it was, and goes on with no gap and nothing twice.
  await page.locator(`#events li[data-index="${at + 1}"]`).waitFor();
  const indices = (await page.locator("#events li").evaluateAll((items) => items.map((li) => Number(li.dataset.index))));
  assert.deepEqual(indices, indices.map((_, at) => at + 1), "events 1, 2, 3, ... each once");

  // The run ends on the page as the API says it did.
  await page.locator("#run-title", { hasText: "✔ done" }).waitFor();
  await page.waitForFunction(() => document.querySelectorAll('#tree li[data-status="done"]').length === 7);
  const doc = await node.api("GET", `/v1/runs/${id}`);
  assert.equal(doc.run.status, "done");
  assert.match(await page.locator("#run-facts").innerText(), /7 steps and jobs: 0 running, 7 done/);
  assert.match(await page.locator("#run-money").innerText(), new RegExp(`${doc.run.account.spent.toLocaleString("en")} spent`));

  assert.match(await page.locator("#run-output").innerText(), /six parts done/);
  assert.match(await page.locator("#events li").last().innerText(), /run_finished done/);
  await page.screenshot({ path: path.join(shots, "run.png"), fullPage: true });

  // Keyboard: the step's toggle collapses and expands its jobs.
  const toggle = page.locator("#tree button.toggle").first();
  await toggle.focus();
  await page.keyboard.press("Enter");
  await page.locator("#tree button.toggle[aria-expanded=false]").waitFor();
  assert.doesNotMatch(await treeText(page), /part-1/);
  await page.locator("#tree button.toggle").first().press(" ");
  await page.locator("#tree button.toggle[aria-expanded=true]").waitFor();
  assert.match(await treeText(page), /part-1/);

  // "Failed only": nothing failed here.
  await page.getByLabel("Failed only").check();
  assert.equal(await page.locator("#tree li").count(), 0);
  assert.equal(await page.locator("#tree-note").innerText(), "Nothing failed.");
  await page.getByLabel("Failed only").uncheck();

  // The runs list: age, duration and spend, filtered by status and flow.
  await page.getByRole("link", { name: "Runs" }).click();
  await row.waitFor();
  const cells = await row.locator("td").allInnerTexts();
  assert.match(cells[0], /✔ done/);
  assert.match(cells[3], /ago$/);
  assert.match(cells[4], /\d+(\.\d)? s/);
  assert.match(cells[5], /spent, 0 held of 1,000,000 tokens/);
  await page.locator("#status").selectOption("failed");
  await page.locator("#runs-note", { hasText: "No runs." }).waitFor();
  await page.locator("#status").selectOption("");
  await page.locator("#flow").fill("grow");
  await row.waitFor();
  await page.screenshot({ path: path.join(shots, "runs.png") });

  // A phone's width: nothing runs off the side of the run page.
  await page.setViewportSize({ width: 390, height: 844 });
  await page.goto(`${node.base}/ui#/runs/${id}`);
  await page.locator("#run-title", { hasText: "done" }).waitFor();
  const wide = await page.evaluate(() => document.documentElement.scrollWidth);
  assert.ok(wide <= 390, `the page is ${wide}px wide on a 390px screen`);
  await page.screenshot({ path: path.join(shots, "run-phone.png"), fullPage: true });
  await page.context().close();
});

test("steer a job, stop a job and stop the run from the page; the API agrees", async () => {
  const page = await newPage();
  const { id } = await node.api("POST", "/v1/runs", { flow: "long" });
  const running = async (label) => {
    const doc = await node.api("GET", `/v1/runs/${id}`);
    const job = find(doc.run, label);
    return job?.status === "running" && job;
  };
  const talker = await until("the talker to run", () => running("talker"));
  const sleeper = await until("the sleeper to run", () => running("sleeper"));
  await login(page, node.base, node.token);
  page.on("dialog", (dialog) => dialog.accept());

  // Steer: the message shows in the job's turns once the model read it.
  await page.goto(`${node.base}/ui#/jobs/${talker.id}`);
  await page.locator("#job-title", { hasText: "talker" }).waitFor();
  assert.match(await page.locator("#job-setup").innerText(), /scripted/);
  const message = "Look at installation costs, not hardware.";
  await page.getByLabel("Message for its next turn").fill(message);
  await page.getByRole("button", { name: "Send" }).click();
  await page.locator("#steer-note", { hasText: "Queued as message" }).waitFor();
  await page.locator("#job-turns li.steer", { hasText: message }).waitFor();
  const steered = await node.api("GET", `/v1/jobs/${talker.id}`);
  assert.equal(steered.steering.length, 1);
  assert.equal(steered.steering[0].text, message);
  assert.equal(steered.steering[0].state, "delivered");
  // The tool calls it made are in its turns, results clipped.
  assert.match(await page.locator("#job-turns").innerText(), /read_file/);
  await page.screenshot({ path: path.join(shots, "job.png"), fullPage: true });

  // Stop one job: it ends stopped on the page and in the API.
  await page.goto(`${node.base}/ui#/jobs/${sleeper.id}`);
  await page.locator("#job-title", { hasText: "▶ running" }).waitFor();
  await page.getByRole("button", { name: "Stop this job" }).click();
  await page.locator("#job-title", { hasText: "■ stopped" }).waitFor();
  assert.equal((await node.api("GET", `/v1/jobs/${sleeper.id}`)).job.status, "stopped");
  assert.equal(await page.getByRole("button", { name: "Stop this job" }).isHidden(), true);
  assert.equal(await page.locator("#steer-form").isHidden(), true, "an ended job takes no message");

  // Top the run's ceiling up: a journaled grant the API then reports.
  await page.getByRole("link", { name: `Run ${id}` }).click();
  await page.locator("#run-title", { hasText: "running" }).waitFor();
  const before = (await node.api("GET", `/v1/runs/${id}`)).run.account.grant;
  await page.getByLabel("Tokens to add to its ceiling").fill("1234");
  await page.getByRole("button", { name: "Top up" }).click();
  await page.locator("#top-up-note", { hasText: "Its ceiling is now" }).waitFor();
  assert.equal((await node.api("GET", `/v1/runs/${id}`)).run.account.grant, before + 1234);

  // Stop the whole run.
  await page.getByRole("button", { name: "Stop the run" }).click();
  await page.locator("#run-title", { hasText: "■ stopped" }).waitFor();
  assert.equal((await node.api("GET", `/v1/runs/${id}`)).run.status, "stopped");
  await page.context().close();
});

test("approve a pending call from its job's page", async () => {
  const page = await newPage();
  const { id } = await node.api("POST", "/v1/runs", { flow: "gate" });
  const step = await until("the step to wait for a person", async () => {
    const doc = await node.api("GET", `/v1/runs/${id}`);
    return doc.run.children.find((c) => c.waiting);
  });
  await login(page, node.base, node.token);
  await page.goto(`${node.base}/ui#/jobs/${step.id}`);
  const card = page.getByRole("article", { name: "Approval for write_file" });
  await card.waitFor();
  assert.match(await card.innerText(), /notes\.md/);
  // A rejection needs a reason: without one, the page asks for it.
  await card.getByRole("button", { name: "Reject" }).click();
  assert.equal(await page.evaluate(() => document.activeElement?.getAttribute("aria-label")), "Why (for write_file)");
  assert.equal((await node.api("GET", `/v1/approvals?run=${id}&state=pending`)).approvals.length, 1);
  await card.getByRole("button", { name: "Approve" }).click();
  await page.locator("#job-title", { hasText: "✔ done" }).waitFor();
  await card.waitFor({ state: "detached" });
  const [decided] = (await node.api("GET", `/v1/approvals?run=${id}`)).approvals;
  assert.equal(decided.state, "approved");
  assert.equal(decided.decision.by, "operator");
  await page.context().close();
});

test("answer an agent's question from its job's page", async () => {
  const page = await newPage();
  const { id } = await node.api("POST", "/v1/runs", { flow: "question" });
  const step = await until("the step to ask its question", async () => {
    const doc = await node.api("GET", `/v1/runs/${id}`);
    return doc.run.children.find((c) => c.waiting);
  });
  await login(page, node.base, node.token);
  await page.goto(`${node.base}/ui#/jobs/${step.id}`);
  const card = page.getByRole("article", { name: "Question" });
  await card.waitFor();
  assert.match(await card.innerText(), /Announce v2\.0 on which channel\?/);
  await card.getByRole("button", { name: "mailing list" }).click();
  await page.locator("#job-title", { hasText: "✔ done" }).waitFor();
  const [answered] = (await node.api("GET", `/v1/approvals?run=${id}`)).approvals;
  assert.equal(answered.kind, "question");
  assert.equal(answered.state, "answered");
  assert.equal(answered.decision.answer, "mailing list");
  await page.context().close();
});

test("a run paused at its ceiling says so, and a top-up from the page lets it finish", async () => {
  const page = await newPage();
  const { id } = await node.api("POST", "/v1/runs", { flow: "pause" });
  const paused = await until("the run to pause at its ceiling", async () => {
    const doc = await node.api("GET", `/v1/runs/${id}`);
    return doc.run.waiting?.reason === "budget" && doc.run.waiting;
  });
  await login(page, node.base, node.token);
  await page.goto(`${node.base}/ui#/runs/${id}`);
  await page.locator("#run-facts", { hasText: `paused at its ceiling: needs ${paused.needs.tokens} tokens` }).waitFor();
  await page.getByLabel("Tokens to add to its ceiling").fill(String(paused.needs.tokens + 1000));
  await page.getByRole("button", { name: "Top up" }).click();
  await page.locator("#run-title", { hasText: "done" }).waitFor();
  const doc = await node.api("GET", `/v1/runs/${id}`);
  assert.equal(doc.run.status, "done");
  assert.equal(doc.run.account.grant, 1000 + paused.needs.tokens + 1000);
  assert.equal(doc.run.waiting, undefined, "no longer paused");
  assert.doesNotMatch(await page.locator("#run-facts").innerText(), /paused/);
  await page.context().close();
});

test("the node view says what `arbor status` says", async () => {
  const page = await newPage();
  await login(page, node.base, node.token);
  await page.getByRole("link", { name: "Node" }).click();
  const facts = page.locator("#node-facts");
  await facts.waitFor();
  const status = await node.api("GET", "/v1/status");
  const text = await facts.innerText();
  assert.match(text, new RegExp(`Version\\s+${status.node.version}`));
  assert.match(text, /Accepting runs\s+yes/);
  assert.match(text, new RegExp(`Sandbox\\s+${status.node.sandbox.mode}`));
  assert.match(text, /Journal\s+applied to [\d,]+, durable to [\d,]+/);
  // What it throttles, as `arbor limits` says.
  assert.match(text, /Rate paid\/\*\s+0\/60 requests, 0\/100,000 tokens in the last minute/);
  assert.match(text, /Concurrency tenant:other\s+\d+\/100 running, \d+ queued/);
  assert.match(text, /Quota other\s+runs_per_minute [\d,]+\/1,000, tokens_per_hour [\d,]+\/50,000,000 \(over it: refuse\)/);
  // Log out: the session ends, and the page asks to log in again.
  await page.getByRole("button", { name: "Log out" }).click();
  await page.locator("#login").waitFor({ state: "visible" });
  const refused = await page.goto(`${node.base}/v1/status`);
  assert.equal(refused.status(), 401);
  await page.context().close();
});

test("a viewer sees its own team's runs only, and each action is refused", async () => {
  const ours = await node.api("POST", "/v1/runs", { flow: "long" });
  const theirs = await node.api("POST", "/v1/runs", { flow: "long", tenant: "other" });
  const viewer = node.addToken("watcher", "default", "viewer");
  const page = await newPage();
  await login(page, node.base, viewer);
  await page.locator(`#run-rows a[href="#/runs/${ours.id}"]`).waitFor();
  assert.equal(await page.locator(`#run-rows a[href="#/runs/${theirs.id}"]`).count(), 0, "the other team's run is not listed");
  // The other team's run, asked for by its id, is not there.
  await page.goto(`${node.base}/ui#/runs/${theirs.id}`);
  await page.locator("#problem", { hasText: `no run ${theirs.id}` }).waitFor();
  // Its own team's run reads; stopping it is refused, naming the role.
  await page.goto(`${node.base}/ui#/runs/${ours.id}`);
  await page.locator("#run-title", { hasText: "running" }).waitFor();
  page.on("dialog", (dialog) => dialog.accept());
  await page.getByRole("button", { name: "Stop the run" }).click();
  await page.locator("#problem", { hasText: "needs operator" }).waitFor();
  assert.equal((await node.api("GET", `/v1/runs/${ours.id}`)).run.status, "running");
  // So is a top-up of its ceiling: the grant stays as it was.
  const grant = (await node.api("GET", `/v1/runs/${ours.id}`)).run.account.grant;
  await page.evaluate(() => { document.getElementById("problem").textContent = ""; });
  await page.getByLabel("Tokens to add to its ceiling").fill("500");
  await page.getByRole("button", { name: "Top up" }).click();
  await page.locator("#problem", { hasText: "needs operator" }).waitFor();
  assert.equal((await node.api("GET", `/v1/runs/${ours.id}`)).run.account.grant, grant);
  await page.context().close();

  // An operator of the other team: its run only, and it stops it.
  const operator = node.addToken("other-ops", "other", "operator");
  const second = await newPage();
  await login(second, node.base, operator);
  await second.locator(`#run-rows a[href="#/runs/${theirs.id}"]`).waitFor();
  assert.equal(await second.locator(`#run-rows a[href="#/runs/${ours.id}"]`).count(), 0);
  await second.locator(`#run-rows a[href="#/runs/${theirs.id}"]`).click();
  await second.locator("#run-title", { hasText: "running" }).waitFor();
  second.on("dialog", (dialog) => dialog.accept());
  await second.getByRole("button", { name: "Stop the run" }).click();
  await second.locator("#run-title", { hasText: "■ stopped" }).waitFor();
  assert.equal((await node.api("GET", `/v1/runs/${theirs.id}`)).run.status, "stopped");
  await node.api("POST", `/v1/runs/${ours.id}/stop`);
  // Each step of it is in the audit log, under its credential's name.
  const { entries } = await node.api("GET", "/v1/audit");
  const refused = entries.find((e) => e.subject === "watcher" && e.route === "POST /v1/runs/{id}/stop");
  assert.equal(refused?.outcome, "refused");
  const stopped = entries.find((e) => e.subject === "other-ops" && e.route === "POST /v1/runs/{id}/stop");
  assert.equal(stopped?.outcome, "ok");
  assert.equal(stopped?.tenant, "other");
  await second.context().close();
});

test("no request of any page carried the token in its URL", () => {
  assert.ok(urls.length > 20, `the pages made requests (${urls.length})`);
  const leaked = urls.filter((u) => u.includes(node.token) || u.includes(encodeURIComponent(node.token)));
  assert.deepEqual(leaked, []);
});

test("no page had a script error", () => {
  assert.deepEqual(errors, []);
});
