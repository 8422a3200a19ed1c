#!/usr/bin/env bash
# arbord's API fuzzed from its own OpenAPI document by schemathesis (PyPI),
# on loopback: every operation, positive and negative data, and the links
# between operations. Fails on any 5xx and on any response the document
# does not describe (status, content type, headers, body schema), and on an
# operation that answers without the token. Then tenant b fuzzes tenant a's
# ids: 404 on every route that names one, and never one of a's ids in an
# answer. Needs target/debug/arbord and arbor built; run from the repo.
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
# Two tenants (I-63), each with an admin of its own: tenant a's runs are
# then fuzzed at by tenant b.
printf '\n[tenants.a]\n[tenants.b]\n' >>"$work/ws/arbor.toml"
mkdir -p "$work/ws/.arbor"
a_token=$(target/debug/arbor token add a-admin --tenant a --roles admin --data-dir "$work/ws/.arbor")
b_token=$(target/debug/arbor token add b-admin --tenant b --roles admin --data-dir "$work/ws/.arbor")
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
token=$a_token
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

# Tenant b, an admin of its own tenant, at tenant a's ids (I-63): every
# route that names one answers 404, and no response carries any id of
# tenant a's but the one the request itself named (a check of our own).
foreign=$("$venv/bin/python" - "$url" "$token" <<'PY'
import json, sys, urllib.request
url, token = sys.argv[1:3]
def get(path):
    request = urllib.request.Request(url + path, headers={"Authorization": "Bearer " + token})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())
ids = set()
for run in get("/v1/runs?limit=500")["runs"]:
    ids.add(run["id"])
    def walk(node):
        ids.add(node["id"])
        for child in node["children"]:
            walk(child)
    walk(get(f"/v1/runs/{run['id']}")["run"])
for card in get("/v1/approvals")["approvals"]:
    ids.add(card["id"])
print(",".join(sorted(ids)))
PY
)
cat >"$work/tenancy_hooks.py" <<'PY'
import os
import schemathesis

FOREIGN = set(filter(None, os.environ["ARBOR_FOREIGN_IDS"].split(",")))


@schemathesis.check
def another_tenants_objects_are_a_404_and_never_shown(ctx, response, case):
    # The coverage phase also sends cases without the credential: not tenant b's.
    sent = response.request.headers
    if not (sent.get("Authorization") or sent.get("authorization")):
        return
    named = {str(v) for v in (case.path_parameters or {}).values()}
    # A method the route does not take is a 405 before any id is looked at.
    if named & FOREIGN and response.status_code not in (404, 405):
        raise AssertionError(
            f"{case.method} {case.formatted_path} names tenant a's object and answered "
            f"{response.status_code} to tenant b, not 404"
        )
    text = response.text or ""
    for id in FOREIGN - named:
        if id in text:
            raise AssertionError(f"a response to tenant b carries tenant a's id {id}")
PY
(cd "$work" && ARBOR_FOREIGN_IDS="$foreign" PYTHONPATH="$work" SCHEMATHESIS_HOOKS=tenancy_hooks \
  "$venv/bin/schemathesis" --config-file "$work/schemathesis.toml" run "$work/openapi.json" --url "$url" \
  -H "Authorization: Bearer $b_token" \
  --checks another_tenants_objects_are_a_404_and_never_shown,not_a_server_error \
  --max-examples 10 --request-timeout 20 --seed 7 --no-color)

# The fuzzing left the node healthy, and it drains cleanly.
"$venv/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/readyz', timeout=10)" "$url"
kill -TERM "$pid"
wait "$pid"
echo "schemathesis: arbord answered by its document, and drained with exit 0"
