"""Checks the spans receiver.py decoded against the run's own document
(`arbor run --json`): one trace per run whose id is the run's, parents that
mirror the tree, the conventions' names, kinds and attributes, no content
and no secret.

usage: check.py SPANS_FILE RUN_JSON SECRET
"""

import json
import sys

spans = [json.loads(line) for line in open(sys.argv[1])]
doc = json.load(open(sys.argv[2]))
secret = sys.argv[3]
raw = open(sys.argv[1]).read()
INTERNAL, CLIENT = 1, 3  # SpanKind in the protobufs
ERROR = 2  # Status.StatusCode


def fail(why):
    sys.exit(f"otel: {why}")


tree = doc["run"]
run_id = tree["id"]
trace = run_id.replace("-", "")
mine = [s for s in spans if s["trace_id"] == trace]
if not mine:
    fail(f"no span of run {run_id} (trace ids seen: {sorted({s['trace_id'] for s in spans})})")
if len(mine) != len(spans):
    fail("spans of another trace arrived")
by_id = {s["span_id"]: s for s in mine}
if len(by_id) != len(mine):
    fail("a span was exported twice")

roots = [s for s in mine if not s["parent_span_id"]]
if len(roots) != 1:
    fail(f"{len(roots)} root spans")
root = roots[0]
if root["name"] != "invoke_workflow agent:lead" or root["kind"] != INTERNAL:
    fail(f"root span: {root['name']} kind {root['kind']}")
if root["attributes"].get("gen_ai.operation.name") != "invoke_workflow":
    fail("the root's gen_ai.operation.name")
if root["resource"].get("service.name") != "arbor-ci":
    fail(f"service.name: {root['resource'].get('service.name')}")

agent_spans = {}
for s in mine:
    if s["name"].startswith("invoke_agent "):
        agent_spans[s["attributes"]["gen_ai.agent.id"]] = s


def walk(node, parent):
    for child in node.get("children", []):
        span = agent_spans.get(child["id"])
        if span is None:
            fail(f"no span for {child['kind']} {child['id']}")
        if span["name"] != f"invoke_agent {child['agent']}" or span["kind"] != INTERNAL:
            fail(f"{child['id']}: {span['name']} kind {span['kind']}")
        if span["attributes"].get("gen_ai.agent.name") != child["agent"]:
            fail(f"{child['id']}: gen_ai.agent.name")
        up = by_id.get(span["parent_span_id"])
        if up is None:
            fail(f"{child['id']}: its parent span was not exported")
        if node is tree:
            if up is not root:
                fail(f"step {child['id']} is not under the run's span")
        else:
            if up["name"] != "execute_tool delegate" or up["parent_span_id"] != parent["span_id"]:
                fail(f"job {child['id']} is not under its parent's delegate call")
        status = child["status"]
        error = span["attributes"].get("error.type")
        if status == "done":
            if error is not None:
                fail(f"{child['id']} is done but has error.type {error}")
        elif status == "stopped":
            if error != "stopped" or span["status"] != ERROR:
                fail(f"{child['id']} was stopped: error.type {error}")
        else:
            if error != child.get("error_class") or span["status"] != ERROR:
                fail(f"{child['id']} failed ({child.get('error_class')}): error.type {error}")
        walk(child, span)


walk(tree, root)
nodes = []


def count(node):
    for c in node.get("children", []):
        nodes.append(c)
        count(c)


count(tree)
if len(agent_spans) != len(nodes):
    fail(f"{len(agent_spans)} agent spans for {len(nodes)} steps and jobs")
statuses = sorted(n["status"] for n in nodes)
if "stopped" not in statuses or "failed" not in statuses:
    fail(f"the flow was to have a stop and a failure: {statuses}")

chats = [s for s in mine if s["name"].startswith("chat ")]
for s in chats:
    a = s["attributes"]
    for key in ["gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
                "arbor.reserved_tokens", "arbor.cost_usd_micros"]:
        if key not in a:
            fail(f"{s['name']} lacks {key}")
    if s["kind"] != CLIENT:
        fail(f"{s['name']} is not a client span")
    if by_id[s["parent_span_id"]]["name"].split(" ")[0] != "invoke_agent":
        fail(f"{s['name']} is not under an agent")
failed_chats = [s for s in chats if s["status"] == ERROR]
if not failed_chats or not all("error.type" in s["attributes"] for s in failed_chats):
    fail("the model error is not a failed chat span with error.type")
tools = [s for s in mine if s["name"].startswith("execute_tool ")]
for s in tools:
    if s["attributes"].get("gen_ai.tool.name") != s["name"].split(" ", 1)[1]:
        fail(f"{s['name']}: gen_ai.tool.name")

for key in ["gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.result"]:
    if key in raw:
        fail(f"content exported without capture_content: {key}")
for text in ["part one of the plan", "the part is done", "the plan, in parts", secret]:
    if text in raw:
        fail(f"{text!r} was exported")

print(f"otel: {len(mine)} spans in one trace ({run_id}): "
      f"{len(agent_spans)} agents, {len(chats)} model calls, {len(tools)} tool calls; "
      f"parents mirror the tree")
