// What the console's browser tests and its benchmark share: an arbord on
// loopback, its API with the token (the test's own calls, never the
// page's), and Debian's chromium driven by playwright-core.

import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

export const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");

// An arbord on 127.0.0.1:0 over `workspace`, with a data dir of its own.
export async function startArbord(workspace) {
  const data = mkdtempSync(path.join(tmpdir(), "arbor-console-"));
  const binary = process.env.ARBORD ?? path.join(repo, "target/debug/arbord");
  const child = spawn(binary, ["--workspace", workspace, "--data-dir", data, "--listen", "127.0.0.1:0"], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  let log = "";
  const base = await new Promise((resolve, reject) => {
    child.stderr.on("data", (chunk) => {
      log += chunk;
      const found = /arbord: listening on (http:\/\/\S+)\s/.exec(log);
      if (found) resolve(found[1]);
    });
    child.on("exit", (code) => reject(new Error(`arbord exited (${code}):\n${log}`)));
  });
  const token = readFileSync(path.join(data, "token"), "utf8").trim();
  const api = async (method, route, body) => {
    const response = await fetch(base + route, {
      method,
      headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    if (!response.ok) throw new Error(`${method} ${route}: ${response.status} ${text}`);
    return text ? JSON.parse(text) : null;
  };
  // A named credential of `tenant` with `roles`, made as a person would
  // (`arbor token add` on the data dir): its token.
  const addToken = (name, tenant, roles) => {
    const arbor = process.env.ARBOR ?? path.join(repo, "target/debug/arbor");
    return execFileSync(arbor, ["token", "add", name, "--tenant", tenant, "--roles", roles, "--data-dir", data], {
      encoding: "utf8",
    }).trim();
  };
  const stop = async () => {
    if (child.exitCode === null) {
      const exited = new Promise((resolve) => child.once("exit", resolve));
      child.kill("SIGTERM");
      await exited;
    }
    rmSync(data, { recursive: true, force: true });
  };
  return { base, token, api, addToken, stop, log: () => log };
}

// Debian's chromium, headless; nothing is downloaded.
export function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

// Logs the page in through the console's own form.
export async function login(page, base, token) {
  await page.goto(`${base}/ui`);
  await page.locator("#token").fill(token);
  await page.getByRole("button", { name: "Log in" }).click();
  await page.locator("#runs").waitFor({ state: "visible" });
}

// Polls `check` (an async function) until it returns something truthy.
export async function until(what, check, timeoutMs = 30000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const got = await check();
    if (got) return got;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

// The node of `tree` labelled `label`, anywhere below it.
export function find(tree, label) {
  if (tree.label === label) return tree;
  for (const child of tree.children) {
    const found = find(child, label);
    if (found) return found;
  }
  return null;
}
