"""Issue 26 item 10: a transient answer from the API server (429, 500, 502, 503, 504) is
retried inside the pass, after the server's Retry-After when it gives one, and never escapes
the pass for one blip. Against a real HTTP server on a real socket, through the operator's own
Kube on the official client's ApiClient, configured as the operator configures it."""

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from kvfence_operator.cluster.kube import Kube, KubeError, with_retries

DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "d", "namespace": "default"}}  # fmt: skip


class FlakyAPI(BaseHTTPRequestHandler):
    """Answers each request with the next of `server.answers` ((status, headers)), then 200
    with the object; every request is counted with its method and time."""

    server: "FlakyServer"

    def handle_one(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.seen.append((self.command, time.monotonic()))
        status, headers = self.server.answers.pop(0) if self.server.answers else (200, {})
        refusal = {"kind": "Status", "code": status, "message": "slow down"}
        body = json.dumps(DEPLOYMENT if status < 300 else refusal).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_DELETE = handle_one

    def log_message(self, *_: Any) -> None:
        pass


class FlakyServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FlakyAPI)
        self.answers: list[tuple[int, dict[str, str]]] = []
        self.seen: list[tuple[str, float]] = []


@pytest.fixture
def server() -> Iterator[FlakyServer]:
    flaky = FlakyServer()
    thread = threading.Thread(target=flaky.serve_forever, daemon=True)
    thread.start()
    yield flaky
    flaky.shutdown()
    flaky.server_close()


def kube_of(server: FlakyServer, retrying: bool = True) -> Kube:
    configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    return Kube(client.ApiClient(with_retries(configuration) if retrying else configuration))


@pytest.mark.parametrize(
    "call",
    [
        lambda kube: kube.create(DEPLOYMENT),
        lambda kube: kube.patch("apps/v1", "Deployment", "default", "d", {"spec": {}}),
        lambda kube: kube.delete("apps/v1", "Deployment", "default", "d"),
        lambda kube: kube.get("apps/v1", "Deployment", "default", "d"),
    ],
    ids=["create", "patch", "delete", "get"],
)
@pytest.mark.parametrize("status", [429, 500, 503])
def test_one_transient_answer_is_retried_inside_the_call(server, call, status):
    server.answers = [(status, {})]
    call(kube_of(server))
    assert len(server.seen) == 2


def test_the_retry_waits_for_the_servers_retry_after(server):
    server.answers = [(429, {"Retry-After": "1"})]
    kube_of(server).patch("apps/v1", "Deployment", "default", "d", {"spec": {}})
    (_, first), (_, second) = server.seen
    assert second - first >= 1.0


def test_a_retry_after_longer_than_a_pass_should_wait_is_cut_short(server):
    server.answers = [(429, {"Retry-After": "3600"})]
    started = time.monotonic()
    kube_of(server).patch("apps/v1", "Deployment", "default", "d", {"spec": {}})
    assert time.monotonic() - started < 10


def test_an_error_that_lasts_is_raised_after_a_bounded_number_of_tries(server):
    server.answers = [(503, {})] * 10
    with pytest.raises(KubeError) as raised:
        kube_of(server).patch("apps/v1", "Deployment", "default", "d", {"spec": {}})
    assert raised.value.status == 503
    assert len(server.seen) == 4


def test_an_answer_that_no_retry_changes_is_not_retried(server):
    server.answers = [(403, {}), (422, {})]
    kube = kube_of(server)
    for _ in range(2):
        with pytest.raises(KubeError):
            kube.patch("apps/v1", "Deployment", "default", "d", {"spec": {}})
    assert len(server.seen) == 2


def test_negative_control_without_the_operators_configuration_one_429_escapes(server):
    server.answers = [(429, {})]
    with pytest.raises(KubeError):
        kube_of(server, retrying=False).patch("apps/v1", "Deployment", "default", "d", {})
