"""One size grammar: `kvfence serve/preflight --kv-cache-memory`, the API server (the CRD's
schema) and the operator's own parsing accept exactly the same strings, Kubernetes quantity
style, and a size that is not one is refused with what it could have meant."""

import copy

import pytest
from pydantic import ValidationError

from helpers.crd_admission import crd_admission, load_sample
from kvfence_cli.main import main
from kvfence_engine.tools.units import parse_size
from kvfence_operator.crd.types import InferenceDeployment

SIZES = [
    ("1000", 1000),
    ("0", 0),
    ("2k", 2000),
    ("64M", 64 * 10**6),
    ("1G", 10**9),
    ("2T", 2 * 10**12),
    ("512Ki", 512 * 2**10),
    ("64Mi", 64 * 2**20),
    ("1.5Gi", 3 * 2**29),
    ("1Ti", 2**40),
]
# (what a user wrote, what the refusal suggests)
NOT_SIZES = [
    ("64MB", "did you mean 64M (10^6 bytes) or 64Mi (2^20 bytes)?"),
    ("64mb", "did you mean 64M (10^6 bytes) or 64Mi (2^20 bytes)?"),
    ("64m", "did you mean 64M (10^6 bytes) or 64Mi (2^20 bytes)?"),  # m is milli to Kubernetes
    ("64MiB", "did you mean 64Mi (2^20 bytes)?"),
    ("8K", "did you mean 8k (10^3 bytes) or 8Ki (2^10 bytes)?"),
    ("1gi", "did you mean 1Gi (2^30 bytes)?"),
    ("64 Mi", "did you mean 64Mi (2^20 bytes)?"),
    ("lots", "e.g. 512Mi"),
    ("4Qi", "e.g. 512Mi"),
    ("-5", "e.g. 512Mi"),
    ("1e9", "e.g. 512Mi"),
]


def _manifest(size: str) -> dict:
    manifest = copy.deepcopy(load_sample("minimal"))
    manifest["spec"].setdefault("engine", {})["kvCacheMemory"] = size
    return manifest


@pytest.mark.parametrize(("text", "expected"), SIZES)
def test_a_size_reads_the_same_on_the_command_line_and_in_a_manifest(text, expected):
    assert parse_size(text) == expected
    assert crd_admission().refusals(_manifest(text)) == []
    spec = InferenceDeployment.model_validate(_manifest(text)).spec
    assert spec.engine.kv_cache_memory == text


@pytest.mark.parametrize(("text", "hint"), NOT_SIZES)
def test_a_string_that_is_not_a_size_is_refused_everywhere_with_a_hint(text, hint):
    with pytest.raises(ValueError, match="cannot read size") as raised:
        parse_size(text)
    assert hint in str(raised.value)
    assert [r.path for r in crd_admission().refusals(_manifest(text))] == [
        "spec.engine.kvCacheMemory"
    ]
    with pytest.raises(ValidationError) as refused:
        InferenceDeployment.model_validate(_manifest(text))
    assert hint in str(refused.value)


def test_the_cli_refuses_a_size_as_a_usage_error_with_the_hint(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["preflight", "--model", "builtin:tiny-random", "--kv-cache-memory", "64MB",
              "--context-length", "512"])  # fmt: skip
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "kvfence preflight: error: argument --kv-cache-memory: cannot read size '64MB': "
        "did you mean 64M (10^6 bytes) or 64Mi (2^20 bytes)?"
    )
