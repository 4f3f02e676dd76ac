"""The operator's push of backends to a router (issue 14, item 2): a real router process over
real HTTP. A push replaces the set in force at once; only the internal token may push; a
backends file that is older than the push (the kubelet's late ConfigMap refresh) never rolls
it back; a bad body is a 422 and a stale push a 409, and neither changes anything."""

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_KEY, FUZZ_TOKEN, check_error_shape
from helpers.waits import READY_S
from kvfence_engine.tools.localproc import LocalProcess, free_port

PATH = "/internal/v1/backends"
TOKEN = {"X-Kvfence-Internal-Token": FUZZ_TOKEN}
DEAD = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def backends(version: int, prefill: list[str], decode: list[str]) -> dict[str, Any]:
    return {"version": version, "revision": "r1", "prefill": prefill, "decode": decode}


def write_file(path: Path, content: dict[str, Any]) -> None:
    """Replace the file as the kubelet does (a new file, a later mtime)."""
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(content))
    os.replace(temp, path)
    stamp = time.time() + 1  # a later mtime even on a coarse clock
    os.utime(path, (stamp, stamp))


@pytest.fixture
def router(fuzz_deployment: Deployment, tmp_path: Path) -> Iterator[tuple[LocalProcess, Path]]:
    """A router of the fuzz deployment's engines (same token) reading a backends file whose
    decode instance is dead; only its prefill instance is real."""
    (tmp_path / "keys").write_text(f"{FUZZ_KEY} fuzzer\n")
    (tmp_path / "token").write_text(FUZZ_TOKEN + "\n")
    file = tmp_path / "backends.json"
    write_file(file, backends(5, [fuzz_deployment.prefills[0].url], [DEAD]))
    args = ["router", "--model", "builtin:tiny-random", "--backends-file", str(file)]
    args += ["--api-keys", str(tmp_path / "keys"), "--internal-token-file", str(tmp_path / "token")]
    with LocalProcess(args, log_path=tmp_path / "router.log") as proc:
        proc.wait_ready(timeout=READY_S)
        yield proc, file


def in_force(url: str) -> dict[str, Any]:
    r = httpx.get(url + PATH, headers=TOKEN, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def complete(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=url + "/v1", api_key=FUZZ_KEY, max_retries=0, timeout=60)
    return client.completions.create(model="tiny-random", prompt="hi", max_tokens=2)


def test_a_push_replaces_the_backends_at_once(
    router: tuple[LocalProcess, Path], fuzz_deployment: Deployment
) -> None:
    proc, _ = router
    first = in_force(proc.url)
    assert first["source"] == "file" and first["backends"]["version"] == 5
    assert first["backends"]["decode"] == [DEAD]
    with pytest.raises(openai.APIStatusError) as refused:
        complete(proc.url)
    assert refused.value.status_code == 503  # the only decode instance is dead

    real = backends(6, [fuzz_deployment.prefills[0].url], [fuzz_deployment.decodes[0].url])
    pushed = httpx.put(proc.url + PATH, headers=TOKEN, json=real, timeout=10)
    assert pushed.status_code == 200, pushed.text
    assert pushed.json() == in_force(proc.url)
    assert pushed.json()["source"] == "push" and pushed.json()["backends"]["version"] == 6
    assert len(pushed.json()["digest"]) == 64 and pushed.json()["digest"] != first["digest"]
    usage = complete(proc.url).usage
    assert usage is not None and usage.completion_tokens == 2  # at once: no file, no wait

    # the real decode instance removed: the next request never reaches it
    gone = backends(7, [fuzz_deployment.prefills[0].url], [DEAD])
    assert httpx.put(proc.url + PATH, headers=TOKEN, json=gone, timeout=10).status_code == 200
    with pytest.raises(openai.APIStatusError) as refused:
        complete(proc.url)
    assert refused.value.status_code == 503


def test_only_the_internal_token_pushes_or_reads_and_nothing_changes_otherwise(
    router: tuple[LocalProcess, Path], fuzz_deployment: Deployment
) -> None:
    proc, _ = router
    before = in_force(proc.url)
    body = backends(9, [DEAD], [DEAD])
    for headers, status in (
        ({}, 401),
        ({"X-Kvfence-Internal-Token": "not-the-token"}, 401),
        ({"Authorization": "Bearer not-the-token"}, 401),
        ({"Authorization": f"Bearer {FUZZ_KEY}"}, 403),  # a tenant's key
    ):
        for method in ("GET", "PUT"):
            r = httpx.request(method, proc.url + PATH, headers=headers, json=body, timeout=10)
            assert r.status_code == status, (method, headers, r.text)
            check_error_shape(r.status_code, r.json())
    assert in_force(proc.url) == before


def test_a_backends_file_older_than_the_push_does_not_roll_it_back(
    router: tuple[LocalProcess, Path], fuzz_deployment: Deployment
) -> None:
    proc, file = router
    prefill, decode = [fuzz_deployment.prefills[0].url], [fuzz_deployment.decodes[0].url]
    assert httpx.put(proc.url + PATH, headers=TOKEN, json=backends(10, prefill, decode)).is_success
    write_file(file, backends(9, prefill, [DEAD]))  # the kubelet's late refresh
    held = in_force(proc.url)
    assert (held["source"], held["backends"]["version"]) == ("push", 10)
    usage = complete(proc.url).usage
    assert usage is not None and usage.completion_tokens == 2
    write_file(file, backends(0, prefill, [DEAD]))  # a hand-written file: older than any push
    assert in_force(proc.url)["backends"]["version"] == 10

    write_file(file, backends(11, prefill, [DEAD]))  # newer than the push: it is in force
    held = in_force(proc.url)
    assert (held["source"], held["backends"]["version"]) == ("file", 11)
    assert held["backends"]["decode"] == [DEAD]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"version": -1, "prefill": [], "decode": []}).encode(),
        json.dumps({"version": 8, "prefill": "http://p"}).encode(),
        json.dumps({"version": 8, "prefil": ["http://p"]}).encode(),
        json.dumps({"version": 8, "prefill": ["10.0.0.1:8000"], "decode": []}).encode(),
        json.dumps({"version": 8, "prefill": [], "decode": ["ftp://x"]}).encode(),
        b"{}",  # issue 33: version 0 is a hand-written file's, never a push
        json.dumps({"version": 0, "prefill": ["http://p"], "decode": ["http://d"]}).encode(),
    ],
)
def test_a_bad_body_is_a_422_and_changes_nothing(
    router: tuple[LocalProcess, Path], body: bytes
) -> None:
    proc, _ = router
    before = in_force(proc.url)
    headers = TOKEN | {"Content-Type": "application/json"}
    r = httpx.put(proc.url + PATH, headers=headers, content=body, timeout=10)
    assert r.status_code == 422, r.text
    check_error_shape(422, r.json())
    assert r.json()["error"]["code"] == "invalid_backends"
    assert "\n" not in r.json()["error"]["message"]
    assert in_force(proc.url) == before


def test_a_push_older_than_the_set_in_force_is_a_409_and_changes_nothing(
    router: tuple[LocalProcess, Path],
) -> None:
    proc, _ = router
    before = in_force(proc.url)
    r = httpx.put(proc.url + PATH, headers=TOKEN, json=backends(4, [DEAD], [DEAD]), timeout=10)
    assert r.status_code == 409, r.text
    check_error_shape(409, r.json())
    assert r.json()["error"]["code"] == "stale_backends"
    assert "version 4 is older than the set in force (version 5" in r.json()["error"]["message"]
    assert in_force(proc.url) == before
