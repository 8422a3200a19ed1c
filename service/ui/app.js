// The console: the same JSON the CLI reads, with the session cookie
// `POST /v1/ui/session` sets (never the token in a URL).

const $ = (id) => document.getElementById(id);

// A status as text and an icon, so that it reads without colour.
const ICONS = { queued: "…", pending: "…", running: "▶", done: "✔", failed: "✖", stopped: "■" };

async function api(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  if (response.status === 401) {
    showLogin();
    throw new Error("not logged in");
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(body.error?.message ?? `${response.status}`);
  }
  return response.status === 204 ? null : response.json();
}

function showLogin() {
  $("login").hidden = false;
  $("runs").hidden = true;
  $("logout").hidden = true;
  $("token").focus();
}

async function showRuns() {
  $("login").hidden = true;
  $("runs").hidden = false;
  $("logout").hidden = false;
  const status = await api("/v1/status");
  const { node, admission } = status;
  $("node").textContent =
    `arbord ${node.version} · epoch ${node.epoch} · ${admission.running} running, ${admission.queued} queued (max ${admission.max_running_runs})`;
  await refresh();
}

async function refresh() {
  const status = $("status").value;
  const flow = $("flow").value.trim();
  const query = status ? `?status=${encodeURIComponent(status)}` : "";
  const list = await api(`/v1/runs${query}`);
  const rows = list.runs.filter((run) => !flow || run.flow.includes(flow));
  const body = $("run-rows");
  body.replaceChildren(
    ...rows.map((run) => {
      const row = document.createElement("tr");
      const cells = [
        `${ICONS[run.status] ?? "?"} ${run.status}`,
        run.id,
        run.flow,
        String(run.budget_tokens),
        run.reason ?? "",
      ];
      cells.forEach((text, at) => {
        const cell = document.createElement("td");
        cell.textContent = text;
        if (at === 1) cell.className = "id";
        row.append(cell);
      });
      return row;
    }),
  );
  $("runs-note").textContent = rows.length ? "" : "No runs.";
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
    await showRuns();
  } else {
    const body = await response.json().catch(() => ({}));
    $("login-error").textContent = body.error?.message ?? `refused (${response.status})`;
  }
});

$("logout").addEventListener("click", async () => {
  await fetch("/v1/ui/session", { method: "DELETE", credentials: "same-origin" });
  showLogin();
});

$("filter").addEventListener("input", () => refresh().catch(() => {}));
$("filter").addEventListener("submit", (event) => event.preventDefault());

// Live: the list is read again every two seconds while the page is shown.
setInterval(() => {
  if (!$("runs").hidden && document.visibilityState === "visible") refresh().catch(() => {});
}, 2000);

showRuns().catch(() => {});
