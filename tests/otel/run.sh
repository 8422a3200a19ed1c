#!/usr/bin/env bash
# Traces against an independent OTLP receiver (tests/otel/receiver.py, the
# official protobufs from PyPI's opentelemetry-proto): a flow with a fan-out,
# a stop and a model error is run by `arbor run`, and its spans are checked
# against its own --json document (check.py). Then, with no collector at
# the address, the same flow must end the same, in about the same time. Needs
# target/debug/arbor built; run from the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=target/otel-venv
port=18997
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import opentelemetry.proto' 2>/dev/null; then
  python3 -m venv "$venv" >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  }
  "$venv/bin/pip" install -q -r tests/otel/requirements.txt
fi

work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
cp -r tests/otel/workspace "$work/ws"
secret=ci-secret-7f3a9b
printf 'CI_TOKEN=%s\n' "$secret" >"$work/ws/secrets.env"
chmod 600 "$work/ws/secrets.env"

"$venv/bin/python" tests/otel/receiver.py "$port" "$work/spans.jsonl" &
pid=$!
"$venv/bin/python" - "$port" <<'PY'
import socket, sys, time
for _ in range(150):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit("the receiver did not start")
PY

# A run's result and its wall time, in ms.
run() {
  local name=$1
  shift
  rm -rf "$work/ws/.arbor"
  local begin end code=0
  begin=$(date +%s%N)
  # Bounded: a run that never ends fails the check with its log and where
  # each of its threads and processes waits, not CI's clock.
  env "$@" target/debug/arbor run --json --agent lead --input "share out the plan" "$work/ws" >"$work/$name.json" 2>"$work/$name.err" &
  local apid=$!
  (
    sleep 120 &
    trap 'kill $! 2>/dev/null; exit 0' TERM
    wait $!
    kill -0 "$apid" 2>/dev/null || exit 0
    {
      echo "--- arbor run did not end in 120 s: its processes, then its threads"
      ps -e --forest -o pid,ppid,stat,wchan:32,args | grep -v ' ps -e' || true
      for task in /proc/"$apid"/task/*; do
        echo "$(cat "$task/comm" 2>/dev/null) $(cat "$task/wchan" 2>/dev/null)"
      done
      command -v gdb >/dev/null && gdb -p "$apid" -batch -ex 'thread apply all bt' 2>&1 | tail -300
    } >>"$work/$name.err"
    kill -9 "$apid"
  ) </dev/null >/dev/null 2>&1 &
  local watchdog=$!
  wait "$apid" || code=$?
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
  [ "$code" = 137 ] && code=124
  end=$(date +%s%N)
  echo "$code $(((end - begin) / 1000000))"
}

read -r code _ < <(run traced)
[ "$code" = 1 ] || [ "$code" = 0 ] || { echo "otel: arbor run exited $code (124: it did not end in 120 s)" >&2; cat "$work/traced.err"; exit 1; }
touch "$work/spans.jsonl"
"$venv/bin/python" tests/otel/check.py "$work/spans.jsonl" "$work/traced.json" "$secret"

# A collector that is not there (a port nothing listens on; the receiver
# stays up, as the flow's model): the same result, in about the same time
# as with telemetry off (the median of three each; noise allowed: half
# again, or half a second).
dead_port=18996
shape() { "$venv/bin/python" -c '
import json, sys
def walk(n): return [n["agent"], n["status"], n.get("error_class"), sorted(walk(c) for c in n.get("children", []))]
print(json.dumps(walk(json.load(open(sys.argv[1]))["run"])))' "$1"; }
want=$(shape "$work/traced.json")
dead=() off=()
for _ in 1 2 3; do
  read -r c ms < <(run dead OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$dead_port)
  [ "$c" = "$code" ] || { echo "otel: with no collector, arbor exited $c, not $code" >&2; exit 1; }
  [ "$(shape "$work/dead.json")" = "$want" ] || { echo "otel: with no collector, the tree differs: $(shape "$work/dead.json")" >&2; exit 1; }
  dead+=("$ms")
  read -r _ ms < <(run off OTEL_SDK_DISABLED=true)
  off+=("$ms")
done
median() { printf '%s\n' "$@" | sort -n | sed -n 2p; }
d=$(median "${dead[@]}") o=$(median "${off[@]}")
echo "otel: no collector: same tree, exit $code; median ${d} ms beside ${o} ms with telemetry off"
if [ "$d" -gt $((o * 3 / 2)) ] && [ "$d" -gt $((o + 500)) ]; then
  echo "otel: a dead collector slowed the run: ${d} ms against ${o} ms" >&2
  exit 1
fi
