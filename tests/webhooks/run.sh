#!/usr/bin/env bash
# Notifications against an independent receiver (receiver.py: PyPI's
# standardwebhooks verifies every signature): arbord runs a flow that asks a
# question, has a call approved and fails, and the receiver must see each of
# those events, verified (check.py). Before that, a trigger signed by the
# same package (sender.py) starts a flow once per webhook-id. Needs target/debug/arbord and arbor
# built; run from the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=target/webhooks-venv
port=18996
listen=127.0.0.1:18995
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import standardwebhooks' 2>/dev/null; then
  python3 -m venv "$venv" >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  }
  "$venv/bin/pip" install -q -r tests/webhooks/requirements.txt
fi

work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"' EXIT
cp -r tests/webhooks/workspace "$work/ws"
secret="whsec_$(python3 -c 'import base64, os; print(base64.b64encode(os.urandom(24)).decode())')"
printf 'CI_WEBHOOK_SECRET=%s\n' "$secret" >"$work/ws/secrets.env"
chmod 600 "$work/ws/secrets.env"

"$venv/bin/python" tests/webhooks/receiver.py "$port" "$secret" "$work/seen.jsonl" &
pids+=($!)
target/debug/arbord --workspace "$work/ws" --data-dir "$work/data" --listen "$listen" 2>"$work/arbord.log" &
pids+=($!)
export ARBOR_URL="http://$listen"
for _ in $(seq 150); do
  [ -s "$work/data/token" ] && grep -q "listening on" "$work/arbord.log" && break
  sleep 0.1
done
export ARBOR_TOKEN_FILE="$work/data/token"

# A trigger, signed by standardwebhooks: one run per webhook-id, and the
# bad calls refused.
triggered=$("$venv/bin/python" tests/webhooks/sender.py "$ARBOR_URL/v1/triggers/ci" "$secret") || {
  cat "$work/arbord.log" >&2
  exit 1
}
[ "$(target/debug/arbor watch "$triggered" >/dev/null && echo done)" = done ] || {
  echo "webhooks: the triggered run did not end done" >&2
  exit 1
}

run=$(target/debug/arbor submit --flow asks)
# The question, answered; then the call, approved (`--wait` follows the
# run's events until a card is pending).
card=$(target/debug/arbor approvals "$run" --wait --ids | head -1)
target/debug/arbor answer "$card" blue >/dev/null
card=$(target/debug/arbor approvals "$run" --wait --ids | head -1)
target/debug/arbor approve "$card" >/dev/null
target/debug/arbor watch "$run" >/dev/null && {
  echo "webhooks: the run was to fail" >&2
  exit 1
}
# The receiver's file has the run's end once its notification was sent.
for _ in $(seq 300); do
  grep -q '"run_finished"' "$work/seen.jsonl" 2>/dev/null && break
  sleep 0.1
done
"$venv/bin/python" tests/webhooks/check.py "$work/seen.jsonl" "$run" || {
  cat "$work/arbord.log" >&2
  exit 1
}
