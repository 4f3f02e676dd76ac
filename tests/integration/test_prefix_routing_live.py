"""Prefix-aware routing through real processes (issue 17): with --routing-secret-file the router
sends one tenant's repeated prompt to one prefill instance, different prompts across both, and
nothing in its answers says which instance served."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from helpers.processes import metric
from kvfence_engine.tools.localproc import LocalProcess

KEYS = {"team-a": "key-a", "team-b": "key-b"}
PROMPT_TOKENS = "kvfence_prompt_tokens_total"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, logs_dir: Path) -> Iterator[Deployment]:
    here = tmp_path_factory.mktemp("prefix-routing")
    keys, secret = here / "keys", here / "routing-secret"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    secret.write_text("routing-secret-for-the-prefix-routing-test\n")
    router_args = ["--api-keys", str(keys), "--routing-secret-file", str(secret)]
    d = start_deployment(logs_dir, "prefix-routing", prefills=2, router_args=router_args)
    try:
        yield d
    finally:
        d.stop()


def served(prefills: list[LocalProcess]) -> list[float]:
    return [metric(p.url, PROMPT_TOKENS) for p in prefills]


def complete(d: Deployment, tenant: str, prompt: list[int]) -> httpx.Response:
    r = httpx.post(
        d.router.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        json={"model": "tiny-random", "prompt": prompt, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def test_a_tenants_repeated_prompt_lands_on_one_prefill_instance(deployment: Deployment) -> None:
    prompt = prompt_of(80, seed=11)
    before = served(deployment.prefills)
    for _ in range(4):
        complete(deployment, "team-a", prompt)
    grew = [a - b for a, b in zip(served(deployment.prefills), before, strict=True)]
    assert sorted(grew) == [0, 4 * 80], grew


def test_different_prompts_spread_and_no_header_names_the_instance(
    deployment: Deployment,
) -> None:
    by_instance: dict[int, list[httpx.Response]] = {}
    for seed in range(16):
        before = served(deployment.prefills)
        r = complete(deployment, "team-b", prompt_of(70, seed=100 + seed))
        grew = [a - b for a, b in zip(served(deployment.prefills), before, strict=True)]
        by_instance.setdefault(grew.index(70), []).append(r)
    assert len(by_instance) == 2, "16 prompts all went to one of two instances"
    # The same header names whichever instance served, and no value names an engine.
    names = {frozenset(r.headers) for rs in by_instance.values() for r in rs}
    assert len(names) == 1, names
    engines = [p.url.removeprefix("http://") for p in deployment.prefills]
    engines += [":" + p.url.rsplit(":", 1)[1] for p in deployment.prefills]
    for rs in by_instance.values():
        for r in rs:
            for value in r.headers.values():
                assert not any(e in value for e in engines), r.headers


@pytest.mark.parametrize(
    ("content", "extra", "says"),
    [
        (b"short\n", [], "routing-secret: the routing secret must be at least 16 bytes"),
        (None, [], "No such file or directory"),
        (b"x" * 32, ["--routing-prefix-tokens", "0"], "must be a whole number >= 1"),
    ],
)
def test_an_unusable_routing_secret_is_a_one_line_usage_error(
    tmp_path: Path, content: bytes | None, extra: list[str], says: str
) -> None:
    secret = tmp_path / "routing-secret"
    if content is not None:
        secret.write_bytes(content)
    args = ["router", "--model", "builtin:tiny-random", "--prefill", "http://127.0.0.1:9"]
    args += ["--decode", "http://127.0.0.1:9", "--routing-secret-file", str(secret), *extra]
    r = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", *args], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert says in r.stderr.strip().splitlines()[-1], r.stderr


def test_routing_prefix_tokens_needs_the_secret() -> None:
    args = ["router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    r = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", *args, "--routing-prefix-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "kvfence router: --routing-prefix-tokens needs --routing-secret-file"
