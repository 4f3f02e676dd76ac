"""SIGTERM, as Kubernetes stops a pod: the router and the engines take no new connection, let
the streams in flight finish (up to --drain-seconds), then exit 0."""

import signal
import time
from pathlib import Path

import httpx

from helpers.deployments import start_deployment
from helpers.waits import FACT_S

# tiny-random streams 100-400 tokens/s here: 4000 tokens outlast the fixed 5 s drain there was.
# The drain given here must not cut them even on a loaded CI machine: a 60 s drain did, once,
# with the suite's e2e tests beside it (under 67 tokens/s), so it is 300 s, and the stream's
# end, not the drain, bounds the test.
LONG_STREAM = 4000
DRAIN_S = 300


def refuses_connections(url: str, within: float = FACT_S) -> bool:  # a hang guard
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/healthz", timeout=1.0)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True  # refused, or accepted by the closing socket's backlog and reset
        time.sleep(0.1)
    return False


def test_a_stream_in_flight_at_sigterm_finishes_then_every_server_exits_0(
    logs_dir: Path,
) -> None:
    drain = ["--drain-seconds", str(DRAIN_S)]
    deployment = start_deployment(
        logs_dir, "graceful", context=4096, pages=320, router_args=drain, engine_args=drain
    )
    try:
        stream = deployment.client().completions.create(
            model="tiny-random",
            prompt="a long answer",
            max_tokens=LONG_STREAM,
            temperature=0,
            stream=True,
        )
        chunks = iter(stream)
        received = [next(chunks)]
        stopped_at = time.monotonic()
        for proc in deployment.all:
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
        # stopping: no new connection, to the router or an engine ...
        for proc in deployment.all:
            assert refuses_connections(proc.url), proc.describe()
        # ... while the stream in flight goes on to its end
        received += list(chunks)
        tokens = [c for c in received if c.choices and c.choices[0].text]
        assert received[-1].choices[0].finish_reason == "length"
        assert len(tokens) == LONG_STREAM
        assert time.monotonic() - stopped_at > 5  # it outlasted the fixed drain there was
        for proc in deployment.all:
            assert proc.proc is not None
            assert proc.proc.wait(FACT_S) == 0, proc.describe()
    finally:
        deployment.stop()
