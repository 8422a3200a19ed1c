"""A Standard Webhooks receiver: every request is verified with PyPI's
standardwebhooks (an implementation independent of arbor's) and appended to
a JSON-lines file, verified or not. Usage: receiver.py PORT SECRET OUT."""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

port, secret, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
webhook = Webhook(secret)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        line = {"id": headers.get("webhook-id"), "path": self.path}
        try:
            payload = webhook.verify(body, headers)
            line.update(verified=True, type=payload.get("type"), data=payload.get("data"))
            status = 204
        except WebhookVerificationError as e:
            line.update(verified=False, error=str(e), body=body.decode("utf-8", "replace"))
            status = 400
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
