// The console: the same JSON the CLI reads, with the session cookie
// `POST /v1/ui/session` sets (never the token in a URL). Views are chosen
// by the URL's fragment: #/ runs, #/runs/ID, #/jobs/ID, #/node.

const $ = (id) => document.getElementById(id);

// A status as text and an icon, so that it reads without colour.
const ICONS = { pending: "…", running: "▶", done: "✔", failed: "✖", stopped: "■" };
const WORDS = { pending: "queued" };
const VIEWS = ["login", "runs", "run", "job", "nodeview"];

// How long a tool's result may be on the page before it is clipped.
const CLIP = 300;
// How many events the run page keeps in its list.
const EVENTS_SHOWN = 200;

// --- helpers ---------------------------------------------------------------

// What a node waits on, as the tree's `waiting` names it by `reason`.
function waitingText(w) {
  if (!w) return "";
  if (w.reason === "retry") return ` · waits to try ${w.label} again (attempt ${w.attempt}, after ${w.class})`;
  if (w.reason === "approval" && w.tool === "ask_person") return " · waits for a person's answer";
  if (w.reason === "approval") return ` · waits for approval of ${w.tool}`;
  if (w.reason === "needs_decision") return ` · waits for a person to continue ${w.label} or stop the run: ${w.why}`;
  if (w.reason === "budget") return ` · paused at its ceiling: needs ${w.needs.tokens} tokens${w.needs.usd_micros ? ` and ${w.needs.usd_micros} micro-dollars` : ""} more (top it up below) until ${new Date(w.deadline_ms).toLocaleString()}`;
  return ` · waits: ${w.reason}`;
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function statusText(status) {
  return `${ICONS[status] ?? "?"} ${WORDS[status] ?? status}`;
}

function statusBadge(status) {
  return el("span", { class: `status ${status}`, text: statusText(status) });
}

const int = (n) => Number(n ?? 0).toLocaleString("en");
const usd = (micros) => `$${(Number(micros ?? 0) / 1e6).toFixed(micros >= 1e6 ? 2 : 4)}`;

function span(ms) {
  if (ms === null || ms === undefined || ms < 0) return "";
  const s = ms / 1000;
  if (s < 1) return `${Math.round(ms)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function took(node) {
  if (!node.started_at_ms) return "";
  return span((node.ended_at_ms ?? Date.now()) - node.started_at_ms);
}

function clip(text, at = CLIP) {
  const s = String(text ?? "");
  return s.length > at ? `${s.slice(0, at)}… (${int(s.length - at)} more characters)` : s;
}

// An account as a bar (spent, then held, of the grant) and in words; the
// words carry it all, the bar is for the eye.
function bar(account, unit) {
  if (!account) return el("span", { class: "muted", text: "no account yet" });
  const { grant, spent, held } = account;
  const fmt = unit === "usd" ? usd : int;
  const words = `${fmt(spent)} spent, ${fmt(held)} held of ${fmt(grant)}${unit === "usd" ? "" : " tokens"}`;
  const track = el("span", { class: "bar", "aria-hidden": "true" });
  const part = (cls, value) => {
    const fill = el("span", { class: cls });
    // CSSOM, not a style attribute: the CSP forbids inline styles.
    fill.style.width = `${grant > 0 ? Math.min(100, (100 * value) / grant) : 0}%`;
    return fill;
  };
  track.append(part("spent", spent), part("held", held));
  return el("span", { class: "account" }, track, el("span", { class: "words", text: words }));
}

class LoggedOut extends Error {}

async function api(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  if (response.status === 401) {
    showLogin("You are not logged in, or your session ended.");
    throw new LoggedOut();
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(body.error?.message ?? `${path}: ${response.status}`);
  }
  return response.status === 204 ? null : response.json();
}

function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body ?? {}),
  });
}

function problem(error) {
  if (error instanceof LoggedOut) return;
  $("problem").textContent = error.message;
  $("problem").hidden = false;
}

function show(view) {
  for (const v of VIEWS) $(v).hidden = v !== view;
  const inside = view !== "login";
  $("logout").hidden = !inside;
  $("nav").hidden = !inside;
}

// --- routing ---------------------------------------------------------------

let leave = () => {};
// Counts the views opened: a view whose opening awaited past a newer one
// starts nothing (no stream, no timer) for a page no longer shown.
let opened = 0;
const stale = (mine) => mine !== opened;

function route() {
  const hash = location.hash;
  if (hash && !hash.startsWith("#/")) return; // an in-page link (skip link)
  opened += 1;
  leave();
  leave = () => {};
  $("problem").hidden = true;
  const [, kind, id] = hash.slice(1).split("/");
  const mine = opened;
  let view;
  if (kind === "runs" && id) view = openRun(id, mine);
  else if (kind === "jobs" && id) view = openJob(id, mine);
  else if (kind === "node") view = openNode(mine);
  else view = openRuns(mine);
  view.catch(problem);
}

window.addEventListener("hashchange", route);

// Every few seconds while `alive()`, and while the page is shown.
function every(ms, tick, alive) {
  const timer = setInterval(() => {
    if (alive() && document.visibilityState === "visible") tick().catch(problem);
  }, ms);
  return () => clearInterval(timer);
}

// --- login -----------------------------------------------------------------

function showLogin(why = "") {
  opened += 1;
  leave();
  leave = () => {};
  show("login");
  $("login-why").textContent = why;
  $("node").textContent = "";
  $("token").focus();
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("login-error").textContent = "";
  const response = await fetch("/v1/ui/session", {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ token: $("token").value.trim() }),
  });
  $("token").value = "";
  if (response.status === 204) {
    route();
  } else {
    const body = await response.json().catch(() => ({}));
    $("login-error").textContent = body.error?.message ?? `refused (${response.status})`;
  }
});

$("logout").addEventListener("click", async () => {
  await fetch("/v1/ui/session", { method: "DELETE", credentials: "same-origin" });
  showLogin("You logged out.");
});

// --- the node line and the node view ---------------------------------------

async function nodeLine() {
  const status = await api("/v1/status");
  const { node, admission } = status;
  $("node").textContent =
    `arbord ${node.version} · ${node.accepting ? "accepting" : "draining"} · ` +
    `${admission.running} running, ${admission.queued} queued (max ${admission.max_running_runs})`;
  return status;
}

async function openNode(mine) {
  const draw = async () => {
    const status = await nodeLine();
    const { node, admission, journal, recovery } = status;
    const facts = [
      ["Version", node.version],
      ["Boot epoch", node.epoch],
      ["Up for", span(node.uptime_ms)],
      ["Accepting runs", node.accepting ? "yes" : "no: draining"],
      ["Sandbox", `${node.sandbox.mode}${node.sandbox.sealed ? ", sealed" : ", not sealed"}: ${node.sandbox.detail}`],
      ["Runs", `${admission.running} running, ${admission.queued} queued, at most ${admission.max_running_runs} at once`],
      ["Journal", `applied to ${int(journal.applied_seq)}, durable to ${int(journal.durable_seq)}; ${int(journal.flushes)} flushes, ${int(journal.fsyncs)} fsyncs`],
      ["Journal failure", journal.failed ?? "none"],
      ["Last recovery", `epoch ${recovery.epoch}: ${recovery.jobs_failed.length} jobs failed, ${recovery.processes_killed.length} processes killed, ${recovery.grants_released} grants released, ${recovery.runs_resumed.length} runs resumed`],
      ["Account breaches", recovery.breaches.length ? recovery.breaches.join("; ") : "none"],
      ["Live process groups", String(status.sandboxes.length)],
    ];
    for (const peer of status.nodes ?? []) {
      facts.push([`Node ${peer.id}`, `epoch ${peer.epoch}, lease ${span(peer.lease_left_ms)} left, ${peer.runs.length} runs`]);
    }
    // What it throttles (`arbor limits`): each provider's rate window.
    const limits = await api("/v1/limits");
    const of = (used, limit) => `${int(used)}/${limit === undefined ? "-" : int(limit)}`;
    for (const w of limits.models) {
      facts.push([
        `Rate ${w.model}`,
        `${of(w.used.requests, w.rpm)} requests, ${of(w.used.tokens, w.tpm)} tokens in the last minute` +
          (w.closed_ms ? `; closed by the provider for ${span(w.closed_ms)}` : "") +
          (w.waiting ? `; ${int(w.waiting)} waiting` : ""),
      ]);
    }
    // Each tenant's quota windows: what each holds of its limit.
    for (const t of limits.tenants ?? []) {
      const windows = Object.entries(t.quota).map(([name, limit]) => {
        const used = t.used[name] ?? 0;
        return name.startsWith("usd_") ? `${name} ${usd(used)}/${usd(limit)}` : `${name} ${int(used)}/${int(limit)}`;
      });
      facts.push([
        `Quota ${t.tenant}`,
        windows.join(", ") + (t.queued ? `; ${int(t.queued)} queued for room` : "") + ` (over it: ${t.on_quota})`,
      ]);
    }
    // Each concurrency key: what it runs of its bound, and what waits.
    for (const c of limits.concurrency ?? []) {
      facts.push([`Concurrency ${c.key}`, `${int(c.running)}/${int(c.limit)} running, ${int(c.queued)} queued`]);
    }
    $("node-facts").replaceChildren(
      ...facts.flatMap(([term, value]) => [el("dt", { text: term }), el("dd", { text: String(value) })]),
    );
  };
  await draw();
  if (stale(mine)) return;
  show("nodeview");
  leave = every(2000, draw, () => !$("nodeview").hidden);
}

// --- runs ------------------------------------------------------------------

async function openRuns(mine) {
  await drawRuns();
  if (stale(mine)) return;
  show("runs");
  leave = every(2000, drawRuns, () => !$("runs").hidden);
}

async function drawRuns() {
  await nodeLine();
  const status = $("status").value;
  const flow = $("flow").value.trim();
  const query = status ? `?status=${encodeURIComponent(status)}` : "";
  const list = await api(`/v1/runs${query}`);
  const rows = list.runs.filter((run) => !flow || run.flow.includes(flow));
  const now = Date.now();
  $("run-rows").replaceChildren(
    ...rows.map((run) =>
      el(
        "tr",
        {},
        el("td", {}, statusBadge(run.status)),
        el("td", { class: "id" }, el("a", { href: `#/runs/${run.id}`, text: run.id })),
        el("td", { text: run.flow }),
        el("td", { text: `${span(now - run.created_at_ms)} ago` }),
        el("td", { text: took(run) }),
        el("td", {}, run.tokens ? bar(run.tokens, "tokens") : el("span", { text: `ceiling ${int(run.budget_tokens)}` })),
        el("td", { text: run.usd ? `${usd(run.usd.spent)} of ${usd(run.usd.grant)}` : "" }),
        el("td", { text: run.failed_job?.error ?? run.reason ?? (run.queue_position !== undefined ? `queued, ${run.queue_position} ahead` : "") }),
      ),
    ),
  );
  $("runs-note").textContent = rows.length ? "" : "No runs.";
}

$("filter").addEventListener("input", () => drawRuns().catch(problem));
$("filter").addEventListener("submit", (event) => event.preventDefault());

// --- a run -----------------------------------------------------------------

// What the run page holds while it is open.
const page = {
  run: null, // the id
  tree: null, // the last document's `run`
  collapsed: new Set(),
  rows: new Map(), // a node's id: its <li>, what its row shows, its <ul>
  source: null, // the EventSource
  dirty: false, // events came since the tree was read
  reading: false,
  last: 0, // the last event index seen
  pending: [], // events not yet in the list
};

const seenKey = (run) => `arbor.events.${run}`;
const listKey = (run) => `arbor.events.${run}.list`;

async function openRun(id, mine) {
  Object.assign(page, { run: id, tree: null, dirty: false, reading: false, last: 0, pending: [] });
  page.collapsed = new Set();
  page.rows = new Map();
  $("events").replaceChildren();
  $("tree").replaceChildren();
  show("run");
  nodeLine().catch(problem);
  await readTree();
  if (stale(mine)) return;
  // After a reload, the list is as this tab left it and the stream goes
  // on from the last event it saw.
  const seen = Number(sessionStorage.getItem(seenKey(id)) ?? 0);
  page.last = seen;
  const kept = JSON.parse(sessionStorage.getItem(listKey(id)) ?? "[]");
  $("events").append(...kept.map(([index, text]) => el("li", { "data-index": index, text })));
  $("events-note").textContent = seen ? `Resumed after event ${seen}.` : "";
  follow(id, seen);
  leave = () => {
    page.source?.close();
    page.source = null;
    page.run = null;
  };
}

function follow(run, after) {
  const source = new EventSource(`/v1/runs/${run}/events${after ? `?after=${after}` : ""}`);
  page.source = source;
  source.onmessage = (message) => {
    const event = JSON.parse(message.data);
    page.last = event.index;
    page.pending.push(event);
    // A hidden tab draws no frames: it keeps only what the list would show.
    if (page.pending.length > 2 * EVENTS_SHOWN) page.pending.splice(0, EVENTS_SHOWN);
    page.dirty = true;
    if (event.kind.type === "run_finished") {
      // The stream ends here; EventSource would otherwise open it again.
      source.close();
      page.source = null;
    }
    schedule();
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      // Refused (logged out, or the run is gone): say why from the API.
      readTree().catch(problem);
    }
  };
}

// One draw per frame at most, and one read of the tree at a time: a fast
// stream is coalesced, never queued behind.
let frame = 0;
function schedule() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    flushEvents();
    if (page.dirty && !page.reading) readTree().catch(problem);
  });
}

async function readTree() {
  const run = page.run;
  if (!run) return;
  page.reading = true;
  page.dirty = false;
  try {
    const doc = await api(`/v1/runs/${run}`);
    if (page.run !== run) return;
    page.tree = doc.run;
    drawRun();
  } finally {
    page.reading = false;
  }
  if (page.dirty) schedule();
}

function drawRun() {
  const root = page.tree;
  $("run-title").replaceChildren(statusBadge(root.status), ` Run ${root.id}`);
  const counts = { running: 0, done: 0, failed: 0, stopped: 0, pending: 0 };
  let nodes = 0;
  const count = (node) => {
    for (const child of node.children) {
      nodes += 1;
      counts[child.status] = (counts[child.status] ?? 0) + 1;
      count(child);
    }
  };
  count(root);
  $("run-facts").textContent =
    `${int(nodes)} steps and jobs: ${counts.running} running, ${counts.done} done, ${counts.failed} failed, ${counts.stopped} stopped. ` +
    (root.started_at_ms ? `Took ${took(root)}.` : "Not started.") +
    (root.reason ? ` ${root.reason}` : "") +
    (["done", "failed", "stopped"].includes(root.status) ? "" : waitingText(root.waiting));
  $("run-money").replaceChildren(
    el("span", { text: "Tokens " }),
    bar(root.account, "tokens"),
    ...(root.usd ? [el("span", { text: " USD " }), bar(root.usd, "usd")] : []),
  );
  $("stop-run").hidden = ["done", "failed", "stopped"].includes(root.status);
  $("top-up-form").hidden = $("stop-run").hidden;
  drawTree();
  const ended = ["done", "failed", "stopped"].includes(root.status);
  $("run-result").hidden = !ended;
  if (ended) {
    $("run-output").textContent = JSON.stringify(root.output, null, 2);
    const artifacts = [];
    const gather = (node) => {
      for (const a of node.artifacts ?? []) artifacts.push(`${node.label ?? node.agent ?? node.id}: ${node.workdir ? `${node.workdir}/` : ""}${a}`);
      node.children.forEach(gather);
    };
    gather(root);
    $("run-artifacts").replaceChildren(...(artifacts.length ? artifacts : ["none"]).map((a) => el("li", { text: a })));
  }
}

// A node is shown under "failed only" when it or one below it failed.
function hasFailure(node) {
  return node.status === "failed" || node.children.some(hasFailure);
}

function treeRow(node, open) {
  const kids = node.children.length;
  const toggle = kids
    ? el("button", {
        type: "button",
        class: "toggle",
        "data-id": node.id,
        "aria-expanded": open ? "true" : "false",
        "aria-label": `${open ? "Collapse" : "Expand"} ${node.label ?? node.agent} (${kids} below)`,
        text: open ? "▾" : "▸",
      })
    : el("span", { class: "toggle", "aria-hidden": "true" });
  return el(
    "div",
    { class: "row" },
    toggle,
    statusBadge(node.status),
    el("a", { href: `#/jobs/${node.id}`, text: node.label ?? node.agent ?? node.id }),
    el("span", { class: "muted", text: `${node.kind}${node.agent && node.label !== node.agent ? ` · ${node.agent}` : ""}${waitingText(node.waiting)}` }),
    bar(node.account, "tokens"),
  );
}

// Puts `items` in `parent` unless they are there already, in that order.
function setChildren(parent, items) {
  const now = parent.children;
  if (now.length !== items.length || items.some((item, at) => now[at] !== item)) parent.replaceChildren(...items);
}

// The tree is drawn by keeping one <li> per node and making a row again
// only when what it shows changed: a read of a large tree during a fast
// run touches the rows that moved, not every row (docs/benchmarks.md).
function drawTree() {
  const failedOnly = $("failed-only").checked;
  const focused = document.activeElement?.dataset?.id;
  const list = (nodes) => {
    const items = [];
    for (const node of nodes) {
      if (failedOnly && !hasFailure(node)) continue;
      const open = !page.collapsed.has(node.id);
      const a = node.account;
      const shows = [node.status, a.spent, a.held, a.grant, node.label, waitingText(node.waiting), open, node.children.length].join("|");
      let entry = page.rows.get(node.id);
      if (!entry) {
        entry = { li: el("li"), shows: null, ul: null };
        page.rows.set(node.id, entry);
      }
      if (entry.shows !== shows) {
        entry.li.dataset.status = node.status;
        const row = treeRow(node, open);
        if (entry.li.firstElementChild) entry.li.firstElementChild.replaceWith(row);
        else entry.li.prepend(row);
        entry.shows = shows;
      }
      if (node.children.length && open) {
        entry.ul ??= el("ul");
        setChildren(entry.ul, list(node.children));
        if (entry.ul.parentNode !== entry.li) entry.li.append(entry.ul);
      } else {
        entry.ul?.remove();
      }
      items.push(entry.li);
    }
    return items;
  };
  const items = list(page.tree.children);
  setChildren($("tree"), items);
  $("tree-note").textContent = items.length ? "" : failedOnly ? "Nothing failed." : "No steps yet.";
  if (focused && document.activeElement?.dataset?.id !== focused) $("tree").querySelector(`[data-id="${focused}"]`)?.focus();
}

$("tree").addEventListener("click", (event) => {
  const toggle = event.target.closest("button.toggle");
  if (!toggle) return;
  const id = toggle.dataset.id;
  if (page.collapsed.has(id)) page.collapsed.delete(id);
  else page.collapsed.add(id);
  drawTree();
});

$("failed-only").addEventListener("change", () => page.tree && drawTree());
$("expand-all").addEventListener("click", () => {
  page.collapsed.clear();
  if (page.tree) drawTree();
});
$("collapse-all").addEventListener("click", () => {
  if (!page.tree) return;
  for (const node of page.tree.children) if (node.children.length) page.collapsed.add(node.id);
  drawTree();
});

// A top-up of the run's ceiling (I-58): a journaled grant, answered once durable.
$("top-up-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const tokens = Number($("top-up-tokens").value);
  if (!page.run || !Number.isSafeInteger(tokens) || tokens < 1) return;
  const topped = await post(`/v1/runs/${page.run}/budget`, { tokens }).catch(problem);
  if (topped) {
    $("top-up-tokens").value = "";
    $("top-up-note").textContent = `Its ceiling is now ${int(topped.account.grant)} tokens.`;
  }
});

$("stop-run").addEventListener("click", async () => {
  if (!page.run || !confirm(`Stop run ${page.run} and everything in it?`)) return;
  await post(`/v1/runs/${page.run}/stop`).catch(problem);
});

// Every event kind there is (docs/contract/event.schema.json), with where
// the console draws more of it than its name and whose it is: "line" in
// the events list (`describe`), "turn" in a job's turns (`noteTurn`), and
// "name" nowhere. A test compares these keys with the schema: a new kind
// fails it until it is placed here.
const EVENT_KINDS = {
  run_started: "name", run_resumed: "name", recovered: "name", run_finished: "line",
  job_spawned: "line", job_running: "name", job_finished: "line", account_changed: "line",
  wind_down: "name", model_called: "turn", context_compacted: "turn", context_pressure: "turn", budget_overrun: "name",
  tool_started: "name", tool_called: "turn", mcp_server: "name", refused: "turn",
  steer_queued: "name", steer_delivered: "turn", steer_discarded: "name",
  approval_requested: "turn", approval_expiring: "name", approval_decided: "turn",
  retry_waiting: "line", needs_decision: "line", model_fallback: "turn",
  peer_queued: "name", peer_delivered: "turn", iteration_checked: "line", reviewed: "line",
  budget_reached: "line", budget_pause_ended: "line",
};

// One line per event: its index, its kind and whose it is.
function describe(event) {
  const k = event.kind;
  const who = k.id ? ` ${k.id.slice(-8)}` : k.owner ? ` ${Object.values(k.owner)[0].slice(-8)}` : "";
  const more = {
    job_spawned: () => ` ${k.kind} ${k.label ?? k.agent}, granted ${int(k.grant_tokens)}`,
    job_finished: () => ` ${k.status}${k.reason ? `: ${k.reason}` : ""}`,
    account_changed: () => ` spent ${int(k.spent)}, held ${int(k.held)} of ${int(k.grant)}`,
    model_called: () => ` turn ${k.turn}, ${k.model}, ${int(k.input_tokens + k.output_tokens)} tokens`,
    tool_called: () => ` turn ${k.turn}, ${k.tool} ${k.ok ? "ok" : "failed"}`,
    refused: () => ` ${k.tool}: ${k.refusal?.refusal ?? ""}`,
    run_finished: () => ` ${k.status}${k.reason ? `: ${k.reason}` : ""}`,
    model_fallback: () => ` ${k.from} walled (${k.class}): on to ${k.to}`,
    needs_decision: () => ` ${k.label} waits for a person: ${k.why}`,
    retry_waiting: () => ` ${k.label} failed (${k.class}): attempt ${k.attempt} at ${new Date(k.until_ms).toISOString()}`,
    iteration_checked: () => ` ${k.label} iteration ${k.iteration} ${k.passed ? "passed" : k.ended ? `did not pass; the loop ends: ${k.ended}` : "did not pass; it runs again"}`,
    budget_reached: () => ` the run pauses at its ceiling: the next step needs ${k.needs.tokens} tokens more`,
    budget_pause_ended: () => k.expired ? " the pause's deadline passed without a top-up" : " topped up: the run goes on",
    reviewed: () => k.failed ? ` not reviewed: ${k.failed}` : k.accept ? " accepted" : ` missing: ${(k.missing ?? []).join("; ")}; the last group runs once more`,
  }[k.type];
  const known = k.type in EVENT_KINDS ? "" : " (a kind this console does not know)";
  return `#${event.index} ${k.type}${who}${more ? more() : ""}${known}`;
}

function flushEvents() {
  if (!page.pending.length) return;
  const list = $("events");
  const fresh = page.pending.splice(0).slice(-EVENTS_SHOWN);
  list.append(...fresh.map((e) => el("li", { "data-index": e.index, text: describe(e) })));
  while (list.childElementCount > EVENTS_SHOWN) list.firstElementChild.remove();
  // The list and the last index are kept together, once a frame: a
  // reload finds them agreeing.
  const kept = [...list.children].map((li) => [Number(li.dataset.index), li.textContent]);
  sessionStorage.setItem(listKey(page.run), JSON.stringify(kept));
  sessionStorage.setItem(seenKey(page.run), String(page.last));
}

// --- a job -----------------------------------------------------------------

async function openJob(id, mine) {
  const job = { id, source: null, turns: new Map(), steering: new Map(), last: 0, run: null, alive: true };
  const draw = async () => {
    const [doc, status] = await Promise.all([api(`/v1/jobs/${id}`), nodeLine()]);
    job.run = doc.run;
    for (const m of doc.steering) job.steering.set(m.message_id, m.text);
    drawJob(doc, status, job);
    drawTurns(job);
    const cards = await api(`/v1/approvals?run=${doc.run}&state=pending`);
    drawCards(cards.approvals.filter((c) => c.job === id), () => draw().catch(problem));
    return doc;
  };
  const doc = await draw();
  if (stale(mine)) return;
  show("job");
  $("job-turns").replaceChildren();
  // Its turns from its own events (the run's stream, filtered by arbord).
  const source = new EventSource(`/v1/runs/${doc.run}/events?job=${id}`);
  job.source = source;
  let redraw = 0;
  source.onmessage = (message) => {
    const event = JSON.parse(message.data);
    if (event.kind.type === "run_finished") {
      source.close();
    }
    if (event.kind.id !== id) return;
    noteTurn(job, event);
    if (!redraw) {
      redraw = requestAnimationFrame(() => {
        redraw = 0;
        drawTurns(job);
        draw().catch(problem);
      });
    }
  };
  const stop = every(2000, draw, () => job.alive && !$("job").hidden);
  leave = () => {
    job.alive = false;
    source.close();
    stop();
  };
  $("stop-job").onclick = async () => {
    if (!confirm(`Stop ${doc.job.label ?? doc.job.agent} and every job below it?`)) return;
    await post(`/v1/jobs/${id}/stop`).catch(problem);
    await draw().catch(problem);
  };
  $("continue-job").onclick = async () => {
    const continued = await post(`/v1/jobs/${id}/continue`).catch(problem);
    if (continued) location.hash = `#/runs/${continued.run}`;
  };
  $("steer-form").onsubmit = async (event) => {
    event.preventDefault();
    const text = $("steer-text").value.trim();
    if (!text) return;
    const queued = await post(`/v1/jobs/${id}/messages`, { text }).catch(problem);
    if (queued) {
      $("steer-text").value = "";
      $("steer-note").textContent = `Queued as message ${queued.message_id}; it reaches the model at its next turn.`;
      await draw().catch(problem);
    }
  };
}

function drawJob(doc, status, job) {
  const j = doc.job;
  const ended = ["done", "failed", "stopped"].includes(j.status);
  $("job-run-link").href = `#/runs/${doc.run}`;
  $("job-run-link").textContent = `Run ${doc.run}`;
  $("job-title").replaceChildren(statusBadge(j.status), ` ${j.kind} ${j.label ?? j.agent}`);
  $("job-facts").textContent =
    `Agent ${j.agent}, depth ${j.depth}, attempt ${j.attempt}, ${Math.max(j.turns, job.last)} turns, ${j.children.length} jobs below. ` +
    (j.started_at_ms ? `Took ${took(j)}.` : "Not started.") +
    (j.reason ? ` ${j.reason}` : "") +
    (j.error ? ` Error: ${j.error}` : "");
  $("job-money").replaceChildren(
    el("span", { text: "Tokens " }),
    bar(j.account, "tokens"),
    ...(j.usd ? [el("span", { text: " USD " }), bar(j.usd, "usd")] : []),
  );
  const s = doc.setup;
  const tools = Object.entries(j.tools ?? {}).map(([t, n]) => `${t} ×${n}`).join(", ");
  const facts = [
    ["Model", s?.model ?? "unknown (its agent is not in this node's workspace)"],
    ["Tools it may use", s ? s.tools.join(", ") || "none" : ""],
    ["Tool calls", tools || "none"],
    ["Denied", s?.deny.join(", ") || "nothing"],
    ["Asks a person before", s?.approve.join(", ") || "nothing"],
    ["Sandbox", `${s?.sandbox ?? "?"} workdir ${j.workdir ?? ""}; node: ${status.node.sandbox.mode}${status.node.sandbox.sealed ? ", sealed" : ", not sealed"}`],
    ["Network", s?.network ?? "?"],
    ["May delegate to", s?.subagents.join(", ") || "nobody"],
  ];
  for (const [server, view] of Object.entries(j.mcp ?? {})) {
    facts.push([`MCP ${server}`, `${view.state}, ${view.restarts} restarts`]);
  }
  $("job-setup").replaceChildren(...facts.flatMap(([t, v]) => [el("dt", { text: t }), el("dd", { text: v })]));
  $("stop-job").hidden = ended;
  $("continue-job").hidden = !(ended && j.status !== "done");
  $("steer-form").hidden = ended;
  $("job-steering").replaceChildren(
    ...(doc.steering.length
      ? doc.steering.map((m) => el("li", { "data-state": m.state, text: `${m.text} (${m.state})` }))
      : [el("li", { class: "muted", text: "none" })]),
  );
  $("job-result").hidden = !ended;
  if (ended) $("job-output").textContent = JSON.stringify(j.output, null, 2);
}

// Cards are kept while they wait, so that a reason being typed survives
// the page's redraws.
const cardEls = new Map();

function drawCards(cards, decided) {
  const pending = new Set(cards.map((card) => card.id));
  for (const id of cardEls.keys()) if (!pending.has(id)) cardEls.delete(id);
  setChildren(
    $("job-cards"),
    cards.map((card) => {
      if (cardEls.has(card.id)) return cardEls.get(card.id);
      const article = card.kind === "question" ? questionCard(card, decided) : callCard(card, decided);
      cardEls.set(card.id, article);
      return article;
    }),
  );
}

// A gated call (or a step's go-ahead): approve, or reject with a reason.
function callCard(card, decided) {
  const reason = el("input", { type: "text", "aria-label": `Why (for ${card.tool})`, placeholder: "why (needed to reject)" });
  const decide = async (decision) => {
    const why = reason.value.trim();
    if (decision === "reject" && !why) {
      reason.focus();
      return;
    }
    if (decision === "reject" && !confirm(`Reject ${card.tool}? The agent is told why.`)) return;
    const done = await post(`/v1/approvals/${card.id}`, { decision, ...(why ? { reason: why } : {}) }).catch(problem);
    if (done) decided();
  };
  return el(
    "article",
    { class: "card", "aria-label": `Approval for ${card.tool}` },
    el("h3", { text: `Waits for a person: ${card.tool}` }),
    el("p", { text: `${card.lineage.join(" › ")} asks; expires ${new Date(card.deadline_ms).toLocaleString()}.` }),
    el("pre", { text: clip(JSON.stringify(card.args, null, 2), 2000) }),
    reason,
    el("button", { type: "button", text: "Approve", onclick: () => decide("approve") }),
    el("button", { type: "button", text: "Reject", onclick: () => decide("reject") }),
  );
}

// An agent's question (ask_person): its choices as buttons, or an answer box.
function questionCard(card, decided) {
  const answer = async (text) => {
    const done = await post(`/v1/approvals/${card.id}`, { decision: "answer", answer: text }).catch(problem);
    if (done) decided();
  };
  const choices = card.args.choices || [];
  const box = el("input", { type: "text", "aria-label": "Your answer", placeholder: "your answer" });
  const send = el("button", {
    type: "button",
    text: "Answer",
    onclick: () => {
      const text = box.value.trim();
      if (!text) box.focus();
      else answer(text);
    },
  });
  return el(
    "article",
    { class: "card", "aria-label": "Question" },
    el("h3", { text: "A question for a person" }),
    el("p", { text: `${card.lineage.join(" › ")} asks; expires ${new Date(card.deadline_ms).toLocaleString()}.` }),
    el("blockquote", { text: clip(String(card.args.question || ""), 4000) }),
    ...(choices.length
      ? choices.map((choice) => el("button", { type: "button", text: choice, onclick: () => answer(choice) }))
      : [box, send]),
  );
}

function noteTurn(job, event) {
  const k = event.kind;
  // A model call, a compaction and a steering delivery name the turns done
  // before them; a tool call names the turn it is in (the call's answer
  // began it). Events without a turn go with the latest.
  const before = ["model_called", "context_compacted", "context_pressure", "steer_delivered", "budget_overrun"];
  const turn = k.turn === undefined ? job.last : before.includes(k.type) ? k.turn + 1 : k.turn;
  job.last = Math.max(job.last, turn);
  if (!job.turns.has(turn)) job.turns.set(turn, []);
  const lines = job.turns.get(turn);
  if (k.type === "model_called") lines.push(`model ${k.provider}/${k.model}: ${int(k.input_tokens)} in, ${int(k.output_tokens)} out, ${span(k.latency_ms)}${k.outcome !== "ok" ? `, ${k.outcome}` : ""}`);
  else if (k.type === "tool_called") lines.push(`${k.ok ? "✔" : "✖"} ${k.tool}: ${clip(k.detail)}`);
  else if (k.type === "refused") lines.push(`refused ${k.tool}: ${clip(JSON.stringify(k.refusal))}`);
  else if (k.type === "steer_delivered") lines.push({ steer: k.message_id });
  else if (k.type === "approval_requested") lines.push(`${k.tool} waits for a person`);
  else if (k.type === "approval_decided") lines.push(`card ${k.state} by ${k.by}${k.reason ? `: ${k.reason}` : ""}`);
  else if (k.type === "context_compacted") lines.push(`history compacted: ${k.estimate_before} → ${k.estimate_after} tokens`);
  else if (k.type === "context_pressure") lines.push(`context filling: ${k.estimate} of ${k.window} tokens`);
  else if (k.type === "peer_delivered") lines.push(`read a message from its peer ${k.from}`);
}

function drawTurns(job) {
  const turns = [...job.turns.entries()].filter(([, lines]) => lines.length).sort((a, b) => a[0] - b[0]);
  $("job-turns").replaceChildren(
    ...turns.map(([turn, lines]) =>
      el("li", { "data-turn": turn }, el("strong", { text: turn ? `Turn ${turn}` : "Before its first turn" }), el("ul", {}, ...lines.map((l) => el("li", { class: l.steer ? "steer" : null, text: l.steer ? `steered: “${job.steering.get(l.steer) ?? `message ${l.steer}`}”` : l })))),
    ),
  );
}

route();
