"""A router on a cluster gets its tokenizer from its engines (issue 15, item 4): it mounts no
model volume (a ReadWriteOnce claim would not attach on a second node), so with
--tokenizer-from-engines it reads the tokenizer from an engine of its backends file, with the
internal token, and is not Ready until it has one. It still refuses an over-long prompt."""

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_CONTEXT, FUZZ_KEY, FUZZ_TOKEN
from helpers.waits import READY_S
from kvfence_engine.contracts import TOKEN_HEADER, BackendsFile, ServedModel
from kvfence_engine.tools.localproc import LocalProcess


def backends_file(path: Path, deployment: Deployment | None, source: str, version: int) -> None:
    path.write_text(
        BackendsFile(
            version=version,
            revision="r1",
            model=ServedModel(source=source),
            context_length=FUZZ_CONTEXT,
            prefill=[p.url for p in deployment.prefills] if deployment else [],
            decode=[d.url for d in deployment.decodes] if deployment else [],
        ).file_text()
    )


def router_command(folder: Path, source: str) -> list[str]:
    (folder / "keys").write_text(f"{FUZZ_KEY} fuzzer\n")
    (folder / "token").write_text(FUZZ_TOKEN + "\n")
    return [
        "router",
        "--backends-file", str(folder / "backends.json"),
        "--model", source,
        "--tokenizer-from-engines",
        "--api-keys", str(folder / "keys"),
        "--internal-token-file", str(folder / "token"),
    ]  # fmt: skip


@contextlib.contextmanager
def listening(command: list[str], log: Path) -> Iterator[LocalProcess]:
    """The router started and answering HTTP, not yet Ready (its context manager waits)."""
    router = LocalProcess(command, log_path=log).start()
    try:
        _wait_listening(router)
        yield router
    finally:
        router.stop()


def _wait_listening(router: LocalProcess) -> None:
    deadline = time.monotonic() + READY_S  # a hang guard
    while time.monotonic() < deadline:
        assert router.proc is not None and router.proc.poll() is None, router.describe()
        try:
            httpx.get(router.url + "/healthz", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{router.describe()} never listened")


def test_a_router_reads_its_tokenizer_from_its_engines_and_refuses_over_long_prompts(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    backends = tmp_path / "backends.json"
    backends_file(backends, None, "builtin:tiny-random", 1)  # no engine is Ready yet
    command = router_command(tmp_path, "builtin:tiny-random")
    with listening(command, tmp_path / "router.log") as router:
        assert httpx.get(router.url + "/readyz").status_code == 503
        early = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "tiny-random", "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {FUZZ_KEY}"},
        )
        assert early.status_code == 503, early.text
        assert early.json()["error"]["message"]  # the API's shape, one line

        backends_file(backends, fuzz_deployment, "builtin:tiny-random", 2)
        router.wait_ready(timeout=READY_S)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=FUZZ_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-random"]
        answer = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.choices[0].message.content is not None
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="tiny-random", prompt="word " * (4 * FUZZ_CONTEXT), max_tokens=1
            )
        assert refused.value.code == "context_length_exceeded"


def test_a_router_whose_engines_serve_another_model_never_becomes_ready(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    """Engines listed at start are checked at start (served_model.py); these are listed later."""
    backends = tmp_path / "backends.json"
    backends_file(backends, None, "builtin:smollm2-135m-instruct", 1)
    command = router_command(tmp_path, "builtin:smollm2-135m-instruct")
    with listening(command, tmp_path / "router.log") as router:
        backends_file(backends, fuzz_deployment, "builtin:smollm2-135m-instruct", 2)
        time.sleep(1.0)
        ready = httpx.get(router.url + "/readyz")
        assert ready.status_code == 503
        assert "builtin:tiny-random" in ready.text  # says why


def test_the_engines_tokenizer_needs_the_internal_token(fuzz_deployment: Deployment) -> None:
    url = fuzz_deployment.prefills[0].url + "/internal/v1/tokenizer"
    assert httpx.get(url).status_code == 401
    served = httpx.get(url, headers={TOKEN_HEADER: FUZZ_TOKEN})
    assert served.status_code == 200
    assert served.json()["model_source"] == "builtin:tiny-random"


def test_without_model_the_router_takes_its_engines_tokenizer_and_name(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    """What the operator runs for a model on a volume: the engines were given the same source,
    and the tokenizer is theirs by construction."""
    backends = tmp_path / "backends.json"
    backends_file(backends, None, "builtin:tiny-random", 1)
    command = router_command(tmp_path, "builtin:tiny-random")
    command.remove("--model")
    command.remove("builtin:tiny-random")
    with listening(command, tmp_path / "router.log") as router:
        backends_file(backends, fuzz_deployment, "builtin:tiny-random", 2)
        router.wait_ready(timeout=READY_S)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=FUZZ_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-random"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="tiny-random", prompt="word " * (4 * FUZZ_CONTEXT), max_tokens=1
            )
        assert refused.value.code == "context_length_exceeded"


def test_no_answer_names_an_engine_while_the_router_has_no_tokenizer(tmp_path: Path) -> None:
    """Issue 33, finding 6: why no engine gave the tokenizer reaches callers by the engine's
    place in the list (/readyz needs no key), its address only the router's log."""
    unreachable = "http://127.0.0.1:9"  # the discard port: nothing listens
    (tmp_path / "backends.json").write_text(
        BackendsFile(
            version=1, revision="r1", model=ServedModel(source="builtin:tiny-random"),
            context_length=FUZZ_CONTEXT, prefill=[unreachable], decode=[unreachable],
        ).file_text()
    )  # fmt: skip
    command = router_command(tmp_path, "builtin:tiny-random")
    key = {"Authorization": f"Bearer {FUZZ_KEY}"}
    with listening(command, tmp_path / "router.log") as router:
        answers = [
            httpx.get(router.url + "/readyz"),
            httpx.get(router.url + "/v1/models", headers=key),
            httpx.post(
                router.url + "/v1/completions",
                json={"model": "tiny-random", "prompt": "Hi", "max_tokens": 1},
                headers=key,
            ),
        ]
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert "127.0.0.1" not in answer.text and "http" not in answer.text, answer.text
        assert "engine 1 of 2: ConnectError" in answers[0].text  # still says why
    assert unreachable in (tmp_path / "router.log").read_text()  # the operator's detail
