"""Spec flags win over extraArgs in both directions: extraArgs may not name a `kvfence serve`
flag that engine_args derives from the spec (`--no-kv-checksum` while `kvChecksum: true` would
silently turn the check off), in any form argparse takes: `--x`, `--x=v`, or abbreviated. The
API server (CEL) and the operator (pydantic) refuse the same arguments."""

import argparse

import pytest
from pydantic import ValidationError

from helpers.builders import sample_spec
from helpers.crd_admission import crd_admission, load_sample
from kvfence_cli.main import build_parser
from kvfence_operator.builders.engine_deployment import engine_args
from kvfence_operator.crd.types import SPEC_FLAGS, EngineSpec, KvCacheDtype, Role

DERIVED = {flag for flags, _ in SPEC_FLAGS for flag in flags}


def _serve_options() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = sub.choices["serve"]
    return {o for a in serve._actions for o in a.option_strings if o.startswith("--")}


def _refused_on_apply(args: list[str]) -> bool:
    manifest = load_sample("minimal")
    manifest["spec"]["engine"] = {"extraArgs": args}
    return bool(crd_admission().refusals(manifest))


def _refused_by_the_operator(args: list[str]) -> bool:
    try:
        EngineSpec(extra_args=args)
    except ValidationError:
        return True
    return False


def _refused(arg: str) -> bool:
    on_apply, by_operator = _refused_on_apply([arg]), _refused_by_the_operator([arg])
    assert on_apply == by_operator, f"{arg}: CEL says {on_apply}, pydantic {by_operator}"
    return on_apply


def test_every_flag_engine_args_derives_from_the_spec_is_refused_in_extra_args():
    spec = sample_spec("full")
    spec.engine.extra_args = []
    spec.engine.kv_checksum = False
    spec.engine.scrub_on_free = True
    spec.engine.kv_cache_dtype = KvCacheDtype.FLOAT16
    spec.tenant_limits.max_pool_share_per_tenant = 0.5
    spec.engine.prefix_cache.enabled = True
    emitted = set()
    for memory, role in ((None, Role.DECODE), ("1Gi", Role.DECODE), ("1Gi", Role.PREFILL)):
        spec.engine.kv_cache_memory = memory
        spec.engine.memory_fraction = None if memory else 0.5
        args = engine_args(spec, role, "abc123", "cuda")
        emitted |= {a.split("=")[0] for a in args if a.startswith("--")}
    # --threads comes from the pod's CPU before extraArgs: extraArgs may override it on purpose
    emitted -= {"--threads"}
    assert emitted <= DERIVED, f"engine_args sets {emitted - DERIVED}, which extraArgs could flip"
    assert "--prefix-cache" in emitted  # the prefill role's, with prefixCache on
    # --listen-fd replaces the --host and --port the operator sets
    also = {"--kv-checksum", "--no-scrub-on-free", "--no-prefix-cache", "--listen-fd"}
    for flag in sorted(emitted | also):
        assert _refused(flag), flag
        assert _refused(f"{flag}=1"), flag


def test_every_abbreviation_argparse_resolves_to_a_derived_flag_is_refused():
    options = _serve_options()
    checked = 0
    for flag in sorted(DERIVED & options):
        for end in range(3, len(flag)):
            prefix = flag[:end]
            if [o for o in options if o.startswith(prefix)] == [flag]:
                assert _refused(prefix), f"{prefix} abbreviates {flag}"
                checked += 1
    assert checked > 50


@pytest.mark.parametrize(
    "option", sorted(_serve_options() - DERIVED - {"--help", "--unsafe-fault"})
)
def test_serve_options_the_spec_does_not_derive_stay_allowed(option):
    assert not _refused(option)
    assert not _refused(f"{option}=1")
