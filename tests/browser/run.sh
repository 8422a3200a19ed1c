#!/usr/bin/env bash
# The console in a real browser: Debian's chromium (no browser download),
# driven headless by playwright-core, pinned in tests/browser/package-lock.json
# (`npm ci`), against an arbord on loopback over tests/browser/workspace.
# Screenshots go to target/console/. Needs target/debug/arbord built; run
# from the repository (CI: .ci/run).
set -euo pipefail
cd "$(dirname "$0")/../.."

install() { apt-get update -qq && apt-get install -y -qq "$@" >/dev/null; }

command -v npm >/dev/null 2>&1 || install nodejs npm
[ -x /usr/bin/chromium ] || install chromium
npm ci --prefix tests/browser --no-audit --no-fund --loglevel=error

# One test at a time: they share one arbord and one browser.
node --test --test-concurrency=1 tests/browser/console.mjs

# The run page's benchmark, small (a smoke run: speed is never a pass or a
# fail here; docs/benchmarks.md has the full one's numbers).
node tests/browser/bench.mjs --quick | tee target/console/bench-quick.txt
grep -q '^D drawn_ms' target/console/bench-quick.txt
[ "$(grep -c '^L rate=' target/console/bench-quick.txt)" = 2 ]
