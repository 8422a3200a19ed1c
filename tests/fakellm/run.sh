#!/usr/bin/env bash
# A delegating flow against fakellm 0.3.5 (an independent fake provider from
# PyPI), once over each wire format: examples/local-model with its base_url
# pointed at fakellm (OpenAI, streamed), and tests/fakellm/anthropic
# (Anthropic, streamed). Needs target/debug/arbor built; run from the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=target/fakellm-venv
port=18999
if [ ! -x "$venv/bin/fakellm" ]; then
  if ! command -v python3 >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
  fi
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q fakellm==0.3.5
fi

"$venv/bin/fakellm" serve --host 127.0.0.1 --port "$port" \
  --config tests/fakellm/rules.yaml >target/fakellm.log 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
# Ready once its stats route answers (it has no health route).
"$venv/bin/python" - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/_fakellm/stats", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit("fakellm did not start")
PY

work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
cp -r examples/local-model "$work/openai"
sed -i -e "s#^base_url = .*#base_url = \"http://127.0.0.1:$port/v1\"#" \
  -e 's/^id = .*/id = "fake-small"/' "$work/openai/arbor.toml"

for ws in "$work/openai" tests/fakellm/anthropic; do
  out="$work/out-$(basename "$ws").json"
  if ! target/debug/arbor run "$ws" --record --json --data-dir "$work/data-$(basename "$ws")" >"$out"; then
    echo "fakellm: the flow in $ws failed:" >&2
    cat "$out" >&2
    tail -n 20 target/fakellm.log >&2
    exit 1
  fi
  "$venv/bin/python" - "$out" "$ws" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["run"]
planner = run["children"][0]
researchers = planner["children"]
assert run["status"] == "done", run
assert run["output"] == "Report: tide pools hold anemones.", run["output"]
assert len(researchers) == 1 and researchers[0]["output"] == "Tide pools hold anemones.", researchers
assert run["account"]["held"] == 0 and run["account"]["spent"] > 0, run["account"]
print(f"fakellm: {sys.argv[2]}: done, {run['account']['spent']} tokens, one delegation")
PY
done

# A model whose supply fakellm walls (429 forever), each way between the
# wire formats: every call moves to its agent's fallback on the other
# provider (I-55), the run completes there, and its tree says which model
# answered each step.
out="$work/out-fallback.json"
if ! target/debug/arbor run tests/fakellm/fallback --json --data-dir "$work/data-fallback" >"$out"; then
  echo "fakellm: the fallback flow failed:" >&2
  cat "$out" >&2
  tail -n 20 target/fakellm.log >&2
  exit 1
fi
"$venv/bin/python" - "$out" "$port" <<'PY'
import json, sys, urllib.request
run = json.load(open(sys.argv[1]))["run"]
assert run["status"] == "done", run
answered = {c["label"]: (c["status"], c["model"], c["output"]) for c in run["children"]}
assert answered == {
    "to-anthropic": ("done", "ant/m", "Answered on the fallback."),
    "to-openai": ("done", "oai/m", "Answered on the fallback."),
}, answered
assert run["account"]["held"] == 0, run["account"]
stats = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/_fakellm/stats"))
walled = stats["by_rule"].get("walled_supply", 0)
assert walled >= 4, f"each walled model was asked and retried once: {stats['by_rule']}"
print(f"fakellm: walled supplies on both wires: each step fell back and answered ({walled} calls refused first)")
PY

# The roster is what the planner's delegation turns on: its first request,
# as `arbor prompt` prints it, is answered with a delegate call; the same
# request with the roster cut from its system prompt is not (no rule matches).
for wire in openai anthropic; do
  target/debug/arbor prompt "$work/openai" planner --input "Write a short report on tide pools." \
    --wire "$wire" -o json >"$work/prompt-$wire.json"
  "$venv/bin/python" - "$work/prompt-$wire.json" "$wire" "$port" <<'PY'
import json, sys, urllib.error, urllib.request
body, wire, port = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
body.pop("stream", None); body.pop("stream_options", None)
path = "/v1/chat/completions" if wire == "openai" else "/v1/messages"
heading = "## Sub-agents you may delegate to"
def delegates(body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        answer = json.load(urllib.request.urlopen(request, timeout=10))
    except urllib.error.HTTPError:
        return False
    if wire == "openai":
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        return any(c["function"]["name"] == "delegate" for c in calls)
    return any(b.get("type") == "tool_use" and b["name"] == "delegate" for b in answer["content"])
assert delegates(body), f"{wire}: the planner's request with its roster did not delegate"
if wire == "openai":
    system = body["messages"][0]["content"]
    body["messages"][0]["content"] = system[:system.index(heading)]
else:
    body["system"] = body["system"][:body["system"].index(heading)]
assert not delegates(body), f"{wire}: the planner's request without its roster delegated"
print(f"fakellm: {wire}: the planner delegates with its roster, and not without it")
PY
done

# Both recorded: with fakellm gone, each replays offline to its recording
# (tree, statuses, accounts, events; `arbor replay` exits 0 only then), and
# from its export too.
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
for ws in "$work/openai" tests/fakellm/anthropic; do
  name=$(basename "$ws")
  run=$("$venv/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["run"]["id"])' "$work/out-$name.json")
  target/debug/arbor replay "$run" --workspace "$ws" --data-dir "$work/data-$name" --json >"$work/replay-$name.json"
  target/debug/arbor export "$run" -o "$work/$name.recording.json" --data-dir "$work/data-$name"
  target/debug/arbor replay --fixture "$work/$name.recording.json" "$ws" >/dev/null
  "$venv/bin/python" - "$work/out-$name.json" "$work/replay-$name.json" "$ws" <<'PY'
import json, sys
old, new = (json.load(open(p))["run"] for p in sys.argv[1:3])
assert new["id"] != old["id"] and new["status"] == old["status"] == "done", (old["status"], new["status"])
assert new["account"] == old["account"], (old["account"], new["account"])
assert new["output"] == old["output"], new["output"]
print(f"fakellm: {sys.argv[3]}: replayed offline, {new['account']['spent']} tokens, the same tree")
PY
done
