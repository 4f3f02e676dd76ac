"""The messages between kvfence's processes: one definition for both ends, the same bytes on the
wire as before they were typed, unknown keys refused where kvfence writes both ends, and the
/v1/kvpool readers as tolerant as they always were."""

import argparse
import json

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from kvfence_cli.main import build_parser
from kvfence_engine.canary.discovery import parse_pools
from kvfence_engine.contracts import (
    AbortBody,
    AbortReply,
    BackendReport,
    BackendsFile,
    BackendUnread,
    DecodeBody,
    DeltaLine,
    ErrorCode,
    FirstToken,
    KvPoolReport,
    PoolGateReport,
    PoolSize,
    PrefillBody,
    PrefillReply,
    ReserveBody,
    ReserveReply,
    Role,
    RouterPoolSizes,
    RouterPoolSummary,
    Sampling,
    ServedModel,
    TenantPoolSummary,
    TransferHandle,
    TransferHello,
    TransferLayout,
    WireError,
)
from kvfence_engine.core import errors
from kvfence_engine.core.deltas import Delta
from kvfence_engine.core.request import TokenLogprob
from kvfence_engine.disagg.wire import delta_line, delta_of
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.router.app import create_router_app
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.pool_views import tenant_view
from kvfence_engine.router.state import RouterState
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES

# GET /v1/kvpool of an engine, key for key and in this order: the operator, the router, the
# canary, preflight and dashboards read these names.
KVPOOL_FIELDS = [
    "role",
    "revision",
    "pool_tokens",
    "page_size",
    "num_pages",
    "free_pages",
    "kv_bytes_per_token",
    "kv_dtype",
    "weight_dtype",
    "weight_choice",
    "context_length_requested",
    "context_length_effective",
    "context_policy",
    "model_max_positions",
    "tag_check",
    "kv_checksum",
    "transfer_port",
    "deferred_release",
    "scrub_on_free",
    "unsafe_faults",
    "model_name",
    "model_source",
    "prefix_cache",
    "cached_pages",
    "prefix_cache_pages",
    "tensor_parallel_size",
]

REPORT = KvPoolReport(
    role=Role.DECODE,
    revision="r1",
    pool_tokens=1024,
    page_size=16,
    num_pages=64,
    free_pages=60,
    kv_bytes_per_token=768,
    kv_dtype="float32",
    weight_dtype="float32",
    context_length_requested=512,
    context_length_effective=512,
    context_policy="refuse",
    model_max_positions=4096,
    tag_check=True,
    kv_checksum=True,
    transfer_port=8001,
    deferred_release=True,
    scrub_on_free=False,
    unsafe_faults=[],
    model_name="tiny-random",
    model_source="builtin:tiny-random",
)
HANDLE = TransferHandle(
    request_id="t-1", seq_id=3, pages=[4, 5], tags=[1, 2], reserved_tokens=20, transfer_port=8001
)
FIRST = FirstToken(token_id=42, logprob=-0.5, top=[(42, -0.5), (7, -1.5)])
LAYOUT = TransferLayout(layers=2, page_size=16, kv_heads=2, head_dim=8, dtype="float32")
BACKENDS_FILE = BackendsFile(
    revision="r1",
    model=ServedModel(source="builtin:tiny-random"),
    context_length=512,
    prefill=["http://p"],
    decode=["http://d"],
)
SUMMARY = RouterPoolSummary(
    context_length_served=512,
    context_length_effective=512,
    pool_tokens=1024,
    page_size=16,
    tag_check=True,
    kv_checksum=True,
    deferred_release=True,
    backends=[
        BackendReport(role=Role.DECODE, url="http://d", report=REPORT),
        BackendUnread(role=Role.PREFILL, url="http://p", error="unreachable or not ready"),
    ],
)

# One of each message kvfence writes and reads at both ends.
MESSAGES: list[BaseModel] = [
    ReserveBody(request_id="t-1", prompt_ids=[1, 2, 3], max_tokens=4, sampling=Sampling(seed=1)),
    ReserveReply(**HANDLE.model_dump(), max_tokens=4),
    PrefillBody(handle=HANDLE, prompt_ids=[1, 2, 3]),
    PrefillReply(first=FIRST, prompt_tokens=3, kv_tokens=3),
    DecodeBody(request_id="t-1", first=FIRST),
    AbortBody(request_id="t-1"),
    AbortReply(aborted=True),
    DeltaLine(
        token_ids=[1],
        logprobs=[FIRST],
        finish_reason="error",
        error=WireError(status=503, message="m", type="server_error", code="overloaded"),
    ),
    TransferHello(request_id="t-1", seq_id=3, pages=[4], tags=[1], token="s", layout=LAYOUT),
    BACKENDS_FILE,
    SUMMARY,
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_reads_back_as_what_was_written(message: BaseModel) -> None:
    wire = message.model_dump_json(by_alias=True)
    assert type(message).model_validate_json(wire) == message


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_with_an_unknown_key_is_refused(message: BaseModel) -> None:
    data = message.model_dump(mode="json", by_alias=True) | {"sampling_temperature": 0.5}
    with pytest.raises(ValidationError, match="sampling_temperature"):
        type(message).model_validate(data)


def test_messages_are_frozen() -> None:
    with pytest.raises(ValidationError):
        HANDLE.transfer_port = 1  # type: ignore[misc]


def test_the_kvpool_report_has_exactly_its_wire_fields_in_order() -> None:
    assert list(KvPoolReport.model_fields) == KVPOOL_FIELDS
    assert list(REPORT.model_dump(mode="json")) == KVPOOL_FIELDS


def test_a_garbage_report_is_refused_naming_the_wrong_fields() -> None:
    with pytest.raises(ValidationError) as caught:
        KvPoolReport.model_validate({"pool_tokens": "lots", "role": 7})
    wrong = {str(e["loc"][0]) for e in caught.value.errors()}
    assert {"role", "pool_tokens", "revision", "tag_check"} <= wrong
    with pytest.raises(ValidationError, match="pool_tokens 1024 != num_pages 3 x page_size 16"):
        KvPoolReport.model_validate(REPORT.model_dump() | {"num_pages": 3})


def test_readers_take_what_they_use_and_ignore_the_rest() -> None:
    # The operator's gate needs neither the dtypes nor the port, and a newer field is no error.
    trusted = {k: v for k, v in REPORT.model_dump().items() if k not in ("kv_dtype", "free_pages")}
    gate = PoolGateReport.model_validate(trusted | {"added_in_a_later_version": 1})
    assert gate.pool_tokens == 1024 and gate.unsafe_faults == []
    size = PoolSize.model_validate(
        {"pool_tokens": 64, "page_size": 16, "context_length_effective": 64}
    )
    assert size.pool_tokens == 64
    # a gate still refuses what it trusts when it is wrong
    with pytest.raises(ValidationError, match="tag_check"):
        PoolGateReport.model_validate(REPORT.model_dump() | {"tag_check": "sometimes"})


def test_the_canary_reads_the_routers_summary_as_the_router_writes_it() -> None:
    summary = SUMMARY.model_dump(mode="json")
    assert RouterPoolSizes.model_validate(summary).backends[0].report == PoolSize(
        pool_tokens=1024, page_size=16, context_length_effective=512
    )
    engines, unreachable = parse_pools(summary)
    assert [(e.role, e.url, e.pool_tokens) for e in engines] == [(Role.DECODE, "http://d", 1024)]
    assert unreachable == ("prefill http://p",)


def test_the_canary_reads_a_tenants_view_of_the_summary_which_names_no_address() -> None:
    view = tenant_view(SUMMARY)
    text = view.model_dump_json()
    assert "http" not in text and "transfer_port" not in text and "free_pages" not in text
    assert view.pool_tokens == SUMMARY.pool_tokens and view.context_length_served == 512
    engines, unreachable = parse_pools(json.loads(text))
    assert [(e.role, e.url, e.pool_tokens) for e in engines] == [(Role.DECODE, "#1", 1024)]
    assert unreachable == ("prefill #2",)
    assert TenantPoolSummary.model_validate_json(text) == view


def test_the_backends_file_keeps_its_keys_and_a_hand_written_one_still_reads() -> None:
    text = BACKENDS_FILE.file_text()
    assert json.loads(text) == {
        "contextLength": 512,
        "decode": ["http://d"],
        "model": {"name": None, "source": "builtin:tiny-random"},
        "prefill": ["http://p"],
        "revision": "r1",
        "version": 0,
    }
    assert text.startswith('{\n  "contextLength": 512,\n') and text.endswith("}\n")
    assert BackendsFile.model_validate_json(text) == BACKENDS_FILE
    by_hand = BackendsFile.model_validate_json('{"prefill": ["http://p"], "contextLength": 256}')
    assert by_hand.context_length == 256 and by_hand.decode == []
    assert by_hand.version == 0  # a file without a version (hand-written, older) still reads
    with pytest.raises(ValidationError, match="contextlength"):
        BackendsFile.model_validate_json('{"contextlength": 256}')  # a typo is not ignored


def test_the_transfer_hello_is_the_same_bytes_as_before() -> None:
    hello = TransferHello(
        request_id="rq", seq_id=3, pages=[1, 2], tags=[7, 8], token="tok", layout=LAYOUT
    )
    assert json.dumps(hello.model_dump()) == (
        '{"request_id": "rq", "seq_id": 3, "pages": [1, 2], "tags": [7, 8], "token": "tok", '
        '"layout": {"layers": 2, "page_size": 16, "kv_heads": 2, "head_dim": 8, '
        '"dtype": "float32"}, "checksum": true}'
    )
    older = {k: v for k, v in hello.model_dump().items() if k not in ("checksum", "token")}
    assert TransferHello.model_validate(older).checksum is True


def test_a_decode_stream_line_is_the_same_bytes_as_before_and_reads_back() -> None:
    error = errors.overloaded("busy")
    delta = Delta([5], [TokenLogprob(5, -0.25, ((5, -0.25),))], "error", error)
    line = json.dumps(delta_line(delta).model_dump())
    assert line == (
        '{"token_ids": [5], "logprobs": [{"token_id": 5, "logprob": -0.25, "top": [[5, -0.25]]}], '
        '"finish_reason": "error", "error": {"status": 503, "message": "busy", '
        '"type": "server_error", "param": null, "code": "overloaded"}}'
    )
    back = delta_of(DeltaLine.model_validate_json(line))
    assert back.token_ids == [5] and back.logprobs == delta.logprobs
    assert back.error is not None and str(back.error) == str(error)
    assert back.error.code is ErrorCode.OVERLOADED  # a member again, not a string


def test_kvfence_serve_offers_exactly_the_engine_roles() -> None:
    actions = build_parser()._actions
    (subparsers,) = [a for a in actions if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]
    role = next(a for a in serve._actions if a.dest == "role")
    assert role.choices == [str(r) for r in Role] and role.default == Role.COMBINED


def test_the_operator_runs_only_engine_roles() -> None:
    """The operator's Role names parts of a deployment; those it runs as engines are engine
    roles, and `kvfence serve --role` gets the same string."""
    assert {str(r) for r in ENGINE_ROLES} == {Role.PREFILL, Role.DECODE}


def test_the_router_refuses_what_decode_would_refuse_as_the_clients_400() -> None:
    """An empty prompt never reaches a backend (here: none is reachable) and is a 400 in the
    words of the engine's admission, naming the client's field (not ReserveBody's
    `prompt_ids`), not a router error."""
    name, tokenizer = load_tokenizer(TINY_RANDOM)
    backends = Backends.create(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], None)
    with TestClient(
        create_router_app(RouterState(name, tokenizer, backends, None, None, 512))
    ) as c:
        r = c.post("/v1/completions", json={"prompt": "", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == "the prompt is empty"
