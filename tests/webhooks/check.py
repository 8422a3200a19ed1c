"""Checks what the receiver saw of run RUN: every request verified, each
event type of a run that asks (a question), is approved (a call) and fails,
each webhook-id once, and no body holding what the agent wrote.
Usage: check.py OUT RUN."""
import json
import sys

out, run = sys.argv[1], sys.argv[2]
lines = [json.loads(l) for l in open(out)]
bad = [l for l in lines if not l["verified"]]
assert not bad, f"signatures standardwebhooks refused: {bad}"
mine = [l for l in lines if l["data"].get("run") == run]
types = sorted(l["type"] for l in mine)
want = ["approval_decided", "approval_decided", "approval_requested", "approval_requested", "run_finished"]
assert types == want, f"the run's notifications: {types}, not {want}"
ids = [l["id"] for l in mine]
assert len(set(ids)) == len(ids), f"an id twice: {ids}"
kinds = sorted(l["data"]["card_kind"] for l in mine if l["type"] == "approval_requested")
assert kinds == ["call", "question"], kinds
states = sorted(l["data"]["state"] for l in mine if l["type"] == "approval_decided")
assert states == ["answered", "approved"], states
finished = next(l for l in mine if l["type"] == "run_finished")
assert finished["data"]["status"] == "failed", finished
text = json.dumps(mine)
for leak in ["the answer", "blue", "colour.txt", "Which colour"]:
    assert leak not in text, f"{leak!r} is in a notification"
print(f"webhooks: {len(mine)} notifications of {run}, each verified by standardwebhooks: {types}")
