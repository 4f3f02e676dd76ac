"""spec.engine.prefixCache (issue 17): off by default; on, the prefill engines run the prefix
cache keyed with the revision's prefix-cache secret and the routers route prefix-aware with its
routing secret, each mounted only where it is used."""

import base64
from typing import Any

import pytest
from pydantic import ValidationError

from helpers.builders import CREDENTIALS, container, flag, instance_for, pod_spec
from helpers.crd_admission import crd_admission, load_sample, stored_spec
from kvfence_operator.builders.engine_deployment import build_engine_deployment, engine_args
from kvfence_operator.builders.router_deployment import build_router_deployment, router_args
from kvfence_operator.builders.secret import (
    PREFIX_CACHE_SECRET_FILE,
    ROUTING_SECRET_FILE,
    RevisionCredentials,
    build_revision_secret,
)
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec, Role
from kvfence_operator.local.up import PrefixCacheFiles, override_flags

REVISION = "0123456789"


def spec_with(enabled: bool | None) -> InferenceDeploymentSpec:
    manifest = load_sample("minimal")
    if enabled is not None:
        manifest["spec"]["engine"] = {"prefixCache": {"enabled": enabled}}
    return InferenceDeployment.model_validate(manifest).spec


def credentials_items(manifest: dict[str, Any]) -> list[str]:
    """The revision Secret's keys a pod mounts (engines: a secret volume; router: projected)."""
    (volume,) = [v for v in pod_spec(manifest)["volumes"] if v["name"] == "credentials"]
    if "secret" in volume:
        return [i["key"] for i in volume["secret"]["items"]]
    return [i["key"] for s in volume["projected"]["sources"] for i in s["secret"]["items"]]


def test_off_by_default_on_apply_and_in_the_operator():
    assert stored_spec(load_sample("minimal")["spec"])["engine"]["prefixCache"] == {
        "enabled": False
    }
    spec = spec_with(None)
    assert spec.engine.prefix_cache.enabled is False
    for role in (Role.PREFILL, Role.DECODE):
        args = engine_args(spec, role, REVISION, "cpu")
        assert not [a for a in args if a.startswith("--prefix-cache")], args
    assert "--routing-secret-file" not in router_args(spec)


def test_on_the_prefill_engines_cache_with_the_mounted_secret():
    spec = spec_with(True)
    instance = instance_for("minimal")
    prefill = build_engine_deployment(spec, instance, REVISION, Role.PREFILL)
    args = container(prefill)["args"]
    assert "--prefix-cache" in args
    assert flag(args, "--prefix-cache-secret-file") == PREFIX_CACHE_SECRET_FILE
    assert "prefix-cache-secret" in credentials_items(prefill)
    assert PREFIX_CACHE_SECRET_FILE.startswith(container(prefill)["volumeMounts"][1]["mountPath"])
    # decode receives KV whole: no cache, no secret it does not use
    decode = build_engine_deployment(spec, instance, REVISION, Role.DECODE)
    assert not [a for a in container(decode)["args"] if a.startswith("--prefix-cache")]
    assert credentials_items(decode) == ["internal-token"]


def test_on_the_routers_route_by_prefix_with_the_mounted_routing_secret():
    spec = spec_with(True)
    router = build_router_deployment(spec, instance_for("minimal"), REVISION)
    assert flag(container(router)["args"], "--routing-secret-file") == ROUTING_SECRET_FILE
    assert "routing-secret" in credentials_items(router)
    assert "prefix-cache-secret" not in credentials_items(router)
    off = build_router_deployment(spec_with(False), instance_for("minimal"), REVISION)
    assert "routing-secret" not in credentials_items(off)


def test_the_revision_secret_holds_both_secrets_distinct_and_random():
    data = build_revision_secret(instance_for("minimal"), REVISION, CREDENTIALS)["data"]
    prefix = base64.b64decode(data["prefix-cache-secret"]).decode()
    routing = base64.b64decode(data["routing-secret"]).decode()
    assert prefix == CREDENTIALS.prefix_cache_secret
    assert routing == CREDENTIALS.routing_secret
    assert len({prefix, routing, CREDENTIALS.internal_token}) == 3
    a, b = RevisionCredentials.generate(), RevisionCredentials.generate()
    assert len({a.prefix_cache_secret, a.routing_secret, b.prefix_cache_secret}) == 3
    assert min(len(a.prefix_cache_secret), len(a.routing_secret)) >= 32
    with pytest.raises(ValueError, match="at least 32 characters"):
        RevisionCredentials("t" * 32, "a" * 32, "b" * 32, "short", "r" * 32)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_enabled_is_a_boolean_on_apply_and_in_the_operator(value):
    manifest = load_sample("minimal")
    manifest["spec"]["engine"] = {"prefixCache": {"enabled": value}}
    assert crd_admission().refusals(manifest)
    with pytest.raises(ValidationError):
        InferenceDeployment.model_validate(manifest)


def test_the_partition_fields_reach_the_prefill_engines_only_and_roll_nothing_unset():
    manifest = load_sample("minimal")
    cache = {"enabled": True, "share": 0.5, "tenants": 4, "idleSeconds": 30}
    manifest["spec"]["engine"] = {"prefixCache": cache}
    assert not crd_admission().refusals(manifest)
    spec = InferenceDeployment.model_validate(manifest).spec
    prefill = engine_args(spec, Role.PREFILL, REVISION, "cpu")
    assert (flag(prefill, "--prefix-cache-share"), flag(prefill, "--prefix-cache-tenants")) == (
        "0.5",
        "4",
    )
    assert flag(prefill, "--prefix-cache-idle-seconds") == "30"
    decode = engine_args(spec, Role.DECODE, REVISION, "cpu")
    assert not [a for a in decode if a.startswith("--prefix-cache")], decode
    # unset, the engine's defaults: no flag, and no schema default in the stored object
    assert stored_spec(load_sample("minimal")["spec"])["engine"]["prefixCache"] == {
        "enabled": False
    }
    assert "--prefix-cache-share" not in engine_args(spec_with(True), Role.PREFILL, REVISION, "cpu")
    for wrong in ({"share": 1.0}, {"share": 0}, {"tenants": 0}, {"idleSeconds": 0}):
        manifest["spec"]["engine"] = {"prefixCache": {"enabled": True, **wrong}}
        assert crd_admission().refusals(manifest), wrong
        with pytest.raises(ValidationError):
            InferenceDeployment.model_validate(manifest)


def test_unknown_prefix_cache_fields_are_refused():
    manifest = load_sample("minimal")
    manifest["spec"]["engine"] = {"prefixCache": {"enabled": True, "salt": "x"}}
    assert crd_admission().refusals(manifest)
    with pytest.raises(ValidationError):
        InferenceDeployment.model_validate(manifest)


@pytest.mark.parametrize("enabled", [False, True])
def test_kvfence_up_passes_the_same_flags_with_its_own_secret_files(tmp_path, enabled):
    """`kvfence up` runs the builders' command lines with the mounted files' paths replaced by
    files in its state folder, and adds no flag the pods would not have."""
    spec = spec_with(enabled)
    files = PrefixCacheFiles.write(tmp_path, CREDENTIALS)
    assert files.prefix_cache_secret.read_text() == CREDENTIALS.prefix_cache_secret + "\n"
    assert files.routing_secret.read_text() == CREDENTIALS.routing_secret + "\n"
    assert files.routing_secret.stat().st_mode & 0o777 == 0o600
    prefill = override_flags(
        engine_args(spec, Role.PREFILL, REVISION, "cpu"), files.overrides(spec, Role.PREFILL)
    )
    decode = override_flags(
        engine_args(spec, Role.DECODE, REVISION, "cpu"), files.overrides(spec, Role.DECODE)
    )
    router = override_flags(router_args(spec), files.overrides(spec, Role.ROUTER))
    assert not [a for a in decode if a.startswith("--prefix-cache")]
    if enabled:
        assert "--prefix-cache" in prefill
        assert flag(prefill, "--prefix-cache-secret-file") == str(files.prefix_cache_secret)
        assert flag(router, "--routing-secret-file") == str(files.routing_secret)
        assert prefill.count("--prefix-cache-secret-file") == 1
    else:
        assert not [a for a in prefill if a.startswith("--prefix-cache")]
        assert "--routing-secret-file" not in router
