"""An OTLP/HTTP trace receiver for arbor's CI, independent of arbor: it
decodes each ExportTraceServiceRequest with the official protobufs
(opentelemetry-proto from PyPI) and appends one JSON line per span to a
file. Any other path answers as a model provider that refuses the key
(OpenAI's 401 body), so a flow can meet a model error offline.

usage: receiver.py PORT SPANS_FILE
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PORT = int(sys.argv[1])
OUT = sys.argv[2]


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            error = {"error": {"message": "Incorrect API key provided.",
                               "type": "invalid_request_error", "code": "invalid_api_key"}}
            data = json.dumps(error).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with open(OUT, "a") as out:
            for rs in request.resource_spans:
                resource = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.write(json.dumps({
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "name": s.name,
                            "kind": s.kind,
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                            "status": s.status.code,
                            "links": [l.span_id.hex() for l in s.links],
                            "scope": ss.scope.name,
                            "resource": resource,
                        }) + "\n")
        data = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
