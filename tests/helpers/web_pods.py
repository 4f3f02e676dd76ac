"""Pods that answer with their name, and Services in front of them, for the devcluster's
kube-proxy tests."""

from typing import Any

# Answers every GET with its pod's name; its port comes from --port, as `kvfence serve` takes it.
NAMED_SERVER = """
import http.server as h, os, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
class Handler(h.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def do_GET(self):
        body = os.environ['POD_NAME'].encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
h.ThreadingHTTPServer(('127.0.0.1', port), Handler).serve_forever()
"""
GATE = "example.com/serving"


def pod(name: str, labels: dict[str, str], gated: bool = False) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": "python:3.11",
        "command": ["python", "-c", NAMED_SERVER, "--port", "8080"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"tcpSocket": {"port": "http"}},
    }
    spec: dict[str, Any] = {"containers": [container]}
    if gated:
        spec["readinessGates"] = [{"conditionType": GATE}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }


def service(name: str, selector: dict[str, str] | None, **spec: Any) -> dict[str, Any]:
    ports = [{"name": "http", "port": 8000, "targetPort": spec.pop("target_port", "http")}]
    body = {"ports": ports, **({"selector": selector} if selector else {}), **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": body}
