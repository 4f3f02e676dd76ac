"""A backend that is not an instance of the router's deployment — a pod IP that another
revision's engine now has (another internal token), or a decode engine listed as prefill — is
taken out of rotation like one that does not answer, and its answer never reaches the client
as the client's own error: the engine's 401 about the internal token would read, to an OpenAI
client, as a bad API key."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from helpers.engines import tiny_budget
from helpers.processes import metric, serve
from helpers.waits import READY_S
from kvfence_engine.tools.localproc import LocalProcess

KEY = "sk-tenant"
OURS, THEIRS = "ours-internal-token", "another-revisions-token"


@dataclass
class Engines:
    prefill: LocalProcess  # ours
    decode: LocalProcess  # ours
    foreign: LocalProcess  # a decode engine of another revision: another internal token
    token_file: Path  # ours


@pytest.fixture(scope="module")
def engines(logs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    folder = tmp_path_factory.mktemp("foreign")
    ours, theirs = folder / "ours", folder / "theirs"
    ours.write_text(OURS + "\n")
    theirs.write_text(THEIRS + "\n")
    started = []
    try:
        for name, role, token in (
            ("prefill", "prefill", ours),
            ("decode", "decode", ours),
            ("foreign", "decode", theirs),
        ):
            started.append(serve(
                logs_dir, f"foreign-backends-{name}", "--role", role, "--model",
                "builtin:tiny-random", "--context-length", "512", "--kv-cache-memory",
                str(tiny_budget(64)), "--transfer-port", "0", "--internal-token-file", str(token),
            ).start())  # fmt: skip
        for proc in started:
            proc.wait_ready(timeout=READY_S)
        prefill, decode, foreign = started
        yield Engines(prefill, decode, foreign, token_file=ours)
    finally:
        for proc in started:
            proc.stop()


def router(logs_dir: Path, engines: Engines, prefill: list[str], decode: list[str]) -> LocalProcess:
    keys = logs_dir / "foreign-backends-keys"
    keys.write_text(f"{KEY} tenant\n")
    args = ["router", "--model", "builtin:tiny-random", "--api-keys", str(keys),
            "--internal-token-file", str(engines.token_file)]  # fmt: skip
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    return LocalProcess(args, log_path=logs_dir / "foreign-backends-router.log")


def complete(proc: LocalProcess) -> httpx.Response:
    return httpx.post(
        proc.url + "/v1/completions",
        json={"model": "tiny-random", "prompt": "hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def errors_of(proc: LocalProcess, role: str) -> float:
    return metric(proc.url, f'kvfence_router_backend_errors_total{{role="{role}"}}', OURS)


def test_a_decode_of_another_revision_is_passed_over_and_the_request_served(
    logs_dir: Path, engines: Engines
) -> None:
    decodes = [engines.foreign.url, engines.decode.url]
    with router(logs_dir, engines, [engines.prefill.url], decodes) as r:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for _ in range(3):
            assert client.completions.create(model="tiny-random", prompt="hi", max_tokens=2).usage
        assert errors_of(r, "decode") >= 1, "the foreign decode was tried"


def test_a_prefill_that_is_not_ours_is_a_503_that_names_no_address_never_a_401(
    logs_dir: Path, engines: Engines
) -> None:
    prefills = [engines.foreign.url, engines.decode.url]  # another token; a decode engine
    with router(logs_dir, engines, prefills, [engines.decode.url]) as r:
        for _ in prefills:  # each is tried once, then out of rotation
            answer = complete(r)
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "backend_unreachable", error
            assert "127.0.0.1" not in answer.text and "token" not in answer.text, answer.text
            assert answer.headers["retry-after"] == "1"
        assert errors_of(r, "prefill") == 2
