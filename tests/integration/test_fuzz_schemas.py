"""Schemathesis against the OpenAPI schemas the engine and the router serve (FastAPI generates
them at /openapi.json), over real processes and sockets: every operation gets bodies that fit
its schema and bodies that break it (wrong types, missing fields, out-of-range numbers, odd
Unicode). Whatever arrives, the answer is no 5xx, an error in the OpenAI shape, a well-formed
completion, no KV page leaked (the autouse pool-whole check, for every engine process), and an
answer the schema documents: its status code, its content type and its body's schema (so a
client generated from the schema knows every answer it can get).

A body that fits the schema names the served model (any other is a 404 model_not_found, which
test_openai_parity.py checks), so that it reaches generation.

Bounded for CI: a fixed number of examples per operation and generation mode, derandomized
(the same cases on every run), a per-example deadline far above a tiny-random completion, and
a short served context (conftest.py's fuzz processes).
"""

import traceback
from collections.abc import Callable

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from helpers.deployments import Deployment
from helpers.fuzzing import FUZZ_AUTH, FUZZ_CONTEXT, check_answer
from kvfence_engine.tools.localproc import LocalProcess

EXAMPLES = 75  # per operation and generation mode
DOCUMENTED = [status_code_conformance, content_type_conformance, response_schema_conformance]
BOUNDED = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=10_000,  # ms; one tiny-random completion takes well under a second
    database=None,
    suppress_health_check=list(HealthCheck),
)


def naming_model(served: str) -> Callable[[schemathesis.Case], schemathesis.Case]:
    def named(case: schemathesis.Case) -> schemathesis.Case:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body = case.body | {"model": served}
        return case

    return named


def fuzz_every_operation(url: str, headers: dict[str, str]) -> list[str]:
    """Each operation of url's served schema, with cases that fit it and (where it takes any
    input) cases that break it; what failed, with the request that failed."""
    [served] = [m["id"] for m in httpx.get(url + "/v1/models", headers=headers).json()["data"]]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    schema.config.max_stream_events = 10 * FUZZ_CONTEXT  # read whole streams (it stops at 20)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation the schema failed to describe
        operations.append(result.ok())
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= {op.label for op in operations}
    failed = []
    for operation in operations:
        takes_input = bool(operation.body or operation.query or operation.headers)
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if takes_input else [])
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode)
            if mode is GenerationMode.POSITIVE:
                cases = cases.map(naming_model(served))

            @BOUNDED
            @given(case=cases)
            def answers_well(case: schemathesis.Case) -> None:
                r = case.call(headers=headers, timeout=30)
                media = next(iter(r.headers.get("content-type", [])), "")
                try:
                    check_answer(case.path, r.status_code, media, r.content)
                    case.validate_response(r, checks=DOCUMENTED, headers=headers)
                except AssertionError as exc:
                    exc.add_note(f"request body: {case.body!r}"[:4000])
                    raise

            try:
                answers_well()
            except Exception as exc:  # a failed check, a broken connection, a timeout
                report = "".join(traceback.format_exception_only(exc))
                failed.append(f"{operation.label} ({mode.value}): {report}")
    return failed


def test_the_engine_answers_anything_its_schema_allows_or_forbids_without_a_5xx(
    fuzz_server: LocalProcess,
) -> None:
    failed = fuzz_every_operation(fuzz_server.url, {})
    assert not failed, "\n\n".join(failed)


def test_the_router_answers_anything_its_schema_allows_or_forbids_without_a_5xx(
    fuzz_deployment: Deployment,
) -> None:
    failed = fuzz_every_operation(fuzz_deployment.router.url, FUZZ_AUTH)
    assert not failed, "\n\n".join(failed)
