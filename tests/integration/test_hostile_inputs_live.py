"""Hostile request bodies against real processes: the combined engine, and router + prefill +
decode. Out-of-range seeds and broken text are the client's 400 on every path (they were a 500
text/plain from the engine and a 502 from the router); a tiny temperature is greedy and stops
nobody; no page leaks."""

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.deployments import Deployment, start_deployment
from helpers.processes import metric
from kvfence_engine.tools.localproc import LocalProcess

LONE = "\ud800"
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": f"a{LONE}b"}, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONE}]},
        "messages[0].content",
    ),
]


@pytest.fixture(scope="module")
def deployment(logs_dir: Path) -> Iterator[Deployment]:
    d = start_deployment(logs_dir, "hostile")
    yield d
    d.stop()


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    """Raw JSON with \\u escapes: a lone surrogate is valid JSON, whatever a client library
    would make of it."""
    return httpx.post(
        url,
        content=json.dumps({"max_tokens": 4} | body),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def completion_text(url: str, temperature: float) -> str:
    r = post(
        url + "/v1/completions",
        {
            "prompt": "Tenant isolation",
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": temperature,
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def pages_used(*procs: LocalProcess) -> list[float]:
    return [metric(proc.url, "kvfence_kv_pages_used") for proc in procs]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_the_router_answers_out_of_range_seeds_and_broken_text_with_a_400(
    deployment: Deployment, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(deployment.router.url + path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_the_engine_answers_them_with_a_400(
    tiny_server: LocalProcess, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(tiny_server.url + path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_tiny_temperature_through_the_router_is_greedy_and_leaks_no_page(
    deployment: Deployment,
) -> None:
    url = deployment.router.url
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda t: completion_text(url, t), [1e-300, 0.0, 1e-300, 1e-45]))
    assert len(set(texts)) == 1
    assert pages_used(*deployment.prefills, *deployment.decodes) == [0, 0]


def test_a_tiny_temperature_on_the_engine_stops_nobody_and_leaks_no_page(
    tiny_server: LocalProcess,
) -> None:
    """The incident: two such requests drained 36 of 64 pages and every later request timed
    out. Now they are greedy, alongside ordinary sampled requests."""
    url = tiny_server.url
    temperatures = [1e-300, 0.8, 1e-300, 0.0, 1.0, 1e-30]
    with concurrent.futures.ThreadPoolExecutor(len(temperatures)) as pool:
        texts = list(pool.map(lambda t: completion_text(url, t), temperatures))
    assert texts[0] == texts[2] == texts[3] == texts[5]
    assert pages_used(tiny_server) == [0]
