#!/usr/bin/env bash
# arbord's API fuzzed from its own OpenAPI document by schemathesis (PyPI),
# on loopback: every operation, positive and negative data, and the links
# between operations. Fails on any 5xx and on any response the document
# does not describe (status, content type, headers, body schema), and on an
# operation that answers without the token. Needs target/debug/arbord built;
# run from the repo.
#
# One check is left out: positive_data_acceptance. A request can match the
# schema and still be refused by design: it names a flow the workspace does
# not have (404-like, answered 422), or asks more than a cap in this node's
# [service] settings (max_run_tokens, ...). The schema cannot know either.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="$PWD/target/schemathesis-venv"
version=4.32.5
if ! "$venv/bin/schemathesis" --version 2>/dev/null | grep -q "$version"; then
  if ! command -v python3 >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
  fi
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q "schemathesis==$version"
fi

work=$(mktemp -d)
cp -r examples/research "$work/ws"
# The approvals example's agents and flow too: a run of it leaves a card
# pending for the approval routes.
cp -r examples/approvals/agents/. "$work/ws/agents/"
cp examples/approvals/flows/release.toml "$work/ws/flows/"
target/debug/arbord --workspace "$work/ws" --listen 127.0.0.1:0 \
  >"$work/arbord.out" 2>"$work/arbord.log" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
url=""
for _ in $(seq 1 300); do
  url=$(sed -n 's/^arbord: listening on \(http[^ ]*\).*/\1/p' "$work/arbord.log")
  [ -n "$url" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/arbord.log"; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "arbord did not start"; cat "$work/arbord.log"; exit 1; }
token=$(cat "$work/ws/.arbor/token")
# The document, and one finished run of the example whose ids the fuzzer
# gets for the routes that name a run or a job (else it would only ever
# meet unknown ids).
"$venv/bin/python" - "$url" "$token" "$work" <<'PY'
import json, sys, urllib.request
url, token, work = sys.argv[1:4]
def call(method, path, body=None):
    request = urllib.request.Request(url + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=60).read()
open(f"{work}/openapi.json", "wb").write(call("GET", "/v1/openapi.json"))
run = json.loads(call("POST", "/v1/runs", {"flow": "research"}))["id"]
call("GET", f"/v1/runs/{run}/events")  # follows the stream until the run ends
job = json.loads(call("GET", f"/v1/runs/{run}"))["run"]["children"][0]["id"]
# A run that waits on a card: the stream is read until the card is asked.
gated = json.loads(call("POST", "/v1/runs", {"flow": "release"}))["id"]
stream = urllib.request.urlopen(urllib.request.Request(url + f"/v1/runs/{gated}/events",
    headers={"Authorization": "Bearer " + token}), timeout=60)
for line in stream:
    if b'"approval_requested"' in line:
        break
stream.close()
card = json.loads(call("GET", f"/v1/approvals?run={gated}&state=pending"))["approvals"][0]["id"]
open(f"{work}/schemathesis.toml", "w").write(f"""
[[operations]]
include-path = ["/v1/runs/{{id}}", "/v1/runs/{{id}}/stop", "/v1/runs/{{id}}/events"]
parameters = {{ id = "{run}" }}

[[operations]]
include-path = ["/v1/jobs/{{id}}", "/v1/jobs/{{id}}/stop", "/v1/jobs/{{id}}/messages", "/v1/jobs/{{id}}/continue"]
parameters = {{ id = "{job}" }}

[[operations]]
include-path = ["/v1/approvals/{{id}}"]
parameters = {{ id = "{card}" }}
""")
PY

# From the scratch dir, so that its cache stays out of the repository.
(cd "$work" && "$venv/bin/schemathesis" --config-file "$work/schemathesis.toml" run "$work/openapi.json" --url "$url" \
  -H "Authorization: Bearer $token" \
  --checks all --exclude-checks positive_data_acceptance \
  --max-examples 40 --request-timeout 20 --seed 7 --no-color)

# The fuzzing left the node healthy, and it drains cleanly.
"$venv/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/readyz', timeout=10)" "$url"
kill -TERM "$pid"
wait "$pid"
echo "schemathesis: arbord answered by its document, and drained with exit 0"
