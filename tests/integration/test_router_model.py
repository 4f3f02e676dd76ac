"""The router serves the model its engines report (issue 18, item 5): without --model it
advertises and tokenizes for what every engine says in /v1/kvpool; it refuses to start, in one
line with exit 2, when the engines disagree with each other or with --model, or when none says
within the wait."""

import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_TOKEN
from helpers.waits import READY_S
from kvfence_engine.contracts import BackendsFile, ModelReport, ServedModel
from kvfence_engine.router.served_model import RouterModel, agreed_model, read_engine_models
from kvfence_engine.tools.localproc import LocalProcess

TINY = ModelReport(model_name="tiny-random", model_source="builtin:tiny-random")
SMOLLM2 = ModelReport(
    model_name="smollm2-135m-instruct", model_source="builtin:smollm2-135m-instruct"
)
OLD = ModelReport()  # an engine older than the report's model fields


def engine_flags(deployment: Deployment, token_file: Path) -> list[str]:
    token_file.write_text(FUZZ_TOKEN + "\n")
    flags = ["--internal-token-file", str(token_file)]
    for prefill in deployment.prefills:
        flags += ["--prefill", prefill.url]
    for decode in deployment.decodes:
        flags += ["--decode", decode.url]
    return flags


def test_a_router_without_model_serves_what_its_tiny_random_engines_report(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    flags = engine_flags(fuzz_deployment, tmp_path / "token")
    with LocalProcess(["router", *flags], log_path=tmp_path / "router.log") as router:
        router.wait_ready(timeout=READY_S)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-random"]
        answer = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.choices[0].message.content is not None


def test_a_router_given_another_model_than_its_engines_refuses_to_start(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    flags = engine_flags(fuzz_deployment, tmp_path / "token")
    command = [sys.executable, "-m", "kvfence_cli", "router", "--port", "0", *flags]
    refused = subprocess.run(
        [*command, "--model", "builtin:smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        timeout=READY_S,  # a hang guard: it reads its engines first
    )
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("kvfence router: --model is builtin:smollm2-135m-instruct, but ")
    assert f"{fuzz_deployment.decodes[0].url} serves builtin:tiny-random" in line


def test_engines_that_agree_decide_the_model_and_old_ones_are_not_counted() -> None:
    urls = ["http://p", "http://d", "http://old"]
    reports = {"http://p": TINY, "http://d": TINY, "http://old": OLD}
    assert agreed_model(urls, reports, None, 1) == RouterModel("builtin:tiny-random", "tiny-random")
    assert agreed_model(urls, reports, "builtin:tiny-random", 0).name == "tiny-random"


def test_engines_that_disagree_are_refused_naming_each() -> None:
    with pytest.raises(ValueError) as refused:
        agreed_model(["http://p", "http://d"], {"http://p": TINY, "http://d": SMOLLM2}, None, 1)
    assert str(refused.value) == (
        "the engines serve different models (http://d serves builtin:smollm2-135m-instruct, "
        "http://p serves builtin:tiny-random): give them one model"
    )


def test_without_model_and_without_an_answer_the_router_refuses_naming_who_was_silent() -> None:
    with pytest.raises(ValueError) as refused:
        agreed_model(["http://p", "http://d"], {"http://p": OLD}, None, 120)
    assert str(refused.value) == (
        "no engine reported its model within 120s (not answering: http://d); give --model"
    )


def test_with_model_given_engines_that_did_not_answer_yet_are_no_objection() -> None:
    assert agreed_model(["http://p"], {}, "/models/x.gguf", 0) == RouterModel(
        "/models/x.gguf", None
    )


def test_an_engine_listed_as_both_prefill_and_decode_is_read_once_without_waiting(
    fuzz_server: LocalProcess,
) -> None:
    """A latency property, kept as one: a loop that counted the URL twice would poll on for
    all of `wait`. The bound is half of that wait, a hang guard no loaded machine reaches for
    the one GET it takes (milliseconds on a quiet one)."""
    started = time.monotonic()
    reports = read_engine_models([fuzz_server.url, fuzz_server.url], None, wait=120)
    assert time.monotonic() - started < 60
    assert reports == {fuzz_server.url: TINY}


def test_the_backends_files_model_name_is_the_id_the_router_answers_to(
    fuzz_deployment: Deployment, tmp_path: Path
) -> None:
    """spec.model.name, which the operator writes into the backends file."""
    (tmp_path / "token").write_text(FUZZ_TOKEN + "\n")
    written = BackendsFile(
        model=ServedModel(source="builtin:tiny-random", name="house-model"),
        prefill=[p.url for p in fuzz_deployment.prefills],
        decode=[d.url for d in fuzz_deployment.decodes],
    )
    (tmp_path / "backends.json").write_text(written.file_text())
    args = ["router", "--backends-file", str(tmp_path / "backends.json")]
    args += ["--model", "builtin:tiny-random", "--internal-token-file", str(tmp_path / "token")]
    with LocalProcess(args, log_path=tmp_path / "router.log") as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["house-model"]
        assert client.completions.create(model="house-model", prompt="a", max_tokens=1).usage
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny-random", prompt="a", max_tokens=1)
