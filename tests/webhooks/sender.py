"""A Standard Webhooks sender: signs with PyPI's standardwebhooks (an
implementation independent of arbor's) and calls arbord's trigger. A good
call starts a run; the same webhook-id again gives the same run; a bad
signature and an old timestamp are refused with 401. Usage: sender.py URL
SECRET. Prints the run's id."""
import json
import sys
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

from standardwebhooks.webhooks import Webhook

url, secret = sys.argv[1], sys.argv[2]
webhook = Webhook(secret)
body = json.dumps({"type": "issue.opened", "data": {"topic": "tides"}})


def send(msg_id, at, signature=None):
    signature = signature or webhook.sign(msg_id, at, body)
    request = urllib.request.Request(
        url,
        data=body.encode(),
        method="POST",
        headers={
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(at.timestamp())),
            "webhook-signature": signature,
        },
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, None


now = datetime.now(timezone.utc)
status, first = send("msg_ci_1", now)
assert status == 201, status
status, again = send("msg_ci_1", now)
assert status == 200 and again["id"] == first["id"], (status, again)
status, _ = send("msg_ci_2", now, signature=Webhook("whsec_" + "QUJD" * 8).sign("msg_ci_2", now, body))
assert status == 401, f"a bad signature: {status}"
old = now - timedelta(minutes=10)
status, _ = send("msg_ci_3", old)
assert status == 401, f"an old timestamp: {status}"
print(first["id"])
