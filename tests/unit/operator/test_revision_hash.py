"""A revision changes exactly when the pods would change; scaling or re-pointing does not roll."""

import re
from typing import Any

import pytest

from helpers.builders import sample_spec
from helpers.crd_admission import SAMPLE_NAMES, load_sample, stored_spec
from kvfence_operator.crd.types import EngineSpec, InferenceDeployment, InferenceDeploymentSpec
from kvfence_operator.revision import revision_of


def _with(change: dict) -> InferenceDeploymentSpec:
    manifest = load_sample("full")
    for path, value in change.items():
        *parents, leaf = path.split(".")
        node = manifest["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return InferenceDeployment.model_validate(manifest).spec


def test_revision_is_a_short_hex_label_value():
    assert re.fullmatch(r"[0-9a-f]{10}", revision_of(sample_spec("full")))


def test_revision_is_stable_across_parses_and_key_order():
    manifest = load_sample("full")
    reordered = dict(reversed(list(manifest["spec"].items())))
    assert revision_of(InferenceDeploymentSpec.model_validate(reordered)) == revision_of(
        sample_spec("full")
    )


def test_writing_a_default_explicitly_does_not_change_the_revision():
    minimal = load_sample("minimal")["spec"]
    explicit = {**minimal, "poolPolicy": "Refuse", "engine": {"pageSize": 16}}
    assert revision_of(InferenceDeploymentSpec.model_validate(explicit)) == revision_of(
        InferenceDeploymentSpec.model_validate(minimal)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"prefill.replicas": 7},
        {"decode.replicas": 0},
        {"router.replicas": 5},
        {"minContextLength": 1024},
        {"router.service.port": 8080},
        {"router.service.type": "ClusterIP"},
        {"canary.timeoutSeconds": 60},
        {"canary.enabled": False},
        {"rollout.retireAfterSeconds": 600},
    ],
    ids=lambda c: next(iter(c)),
)
def test_changes_applied_in_place_keep_the_revision(change):
    assert revision_of(_with(change)) == revision_of(sample_spec("full"))


@pytest.mark.parametrize(
    "change",
    [
        {"contextLength": 4096},
        {"poolPolicy": "LowerContext"},
        {"engine.image": "kvfence/engine:0.2.0"},
        {"engine.pageSize": 32},
        {"engine.scrubOnFree": False},
        {"engine.extraArgs": []},
        {"model.source": "/models/other.gguf"},
        {"prefill.resources": {"limits": {"cpu": "8"}}},
        {
            "engine.tensorParallelSize": 2,
            "prefill.resources": {"limits": {"nvidia.com/gpu": 2}},
            "decode.resources": {"limits": {"nvidia.com/gpu": 2}},
        },
        {"decode.pod": {"nodeSelector": {"gpu": "h100"}}},
        {"router.apiKeysSecret": "other-keys"},
        {"tenantLimits.maxConcurrentRequests": 8},
        {"tenantLimits.maxPoolSharePerTenant": 0.25},
        {"rollout.terminationGracePeriodSeconds": 60},
        {"engine.prefixCache": {"enabled": True}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_changes_to_what_pods_run_make_a_new_revision(change):
    assert revision_of(_with(change)) != revision_of(sample_spec("full"))


@pytest.fixture
def release_with_other_defaults(monkeypatch):
    """A later operator release whose code changes the engine image's and the page size's
    defaults (the generated CRD with them); restored afterwards."""
    fields = EngineSpec.model_fields
    for name, value in (("image", "ghcr.io/kvfence/kvfence-engine:9.9.9"), ("page_size", 32)):
        monkeypatch.setattr(fields[name], "default", value)
    EngineSpec.model_rebuild(force=True)
    InferenceDeploymentSpec.model_rebuild(force=True)
    yield
    monkeypatch.undo()
    EngineSpec.model_rebuild(force=True)
    InferenceDeploymentSpec.model_rebuild(force=True)


@pytest.mark.parametrize("name", ["minimal", "full"])
def test_a_release_that_changes_a_default_rolls_no_stored_object(name, request):
    """The object as the API server stored it at creation: its revision under today's code and
    under a release with other defaults is the same."""
    stored = stored_spec(load_sample(name)["spec"])
    before = revision_of(InferenceDeploymentSpec.model_validate(stored))
    request.getfixturevalue("release_with_other_defaults")
    assert EngineSpec().image.endswith(":9.9.9")  # the release is in effect
    assert revision_of(InferenceDeploymentSpec.model_validate(stored)) == before


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_a_manifest_and_the_object_stored_from_it_have_one_revision(name):
    """`kvfence up`, tests and the devcluster (which does not default) hash the manifest as
    written; a cluster hashes the object with the CRD's defaults filled in: the same."""
    spec = load_sample(name)["spec"]
    assert revision_of(InferenceDeploymentSpec.model_validate(spec)) == revision_of(
        InferenceDeploymentSpec.model_validate(stored_spec(spec))
    )


# Each sample's revision under the release before spec.rollout existed.
REVISIONS_BEFORE_SPEC_ROLLOUT = {
    "cpu-lower-context": "3a445c4e3d",
    "full": "43c69ce858",
    "minimal": "e41b67ea55",
}


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_the_release_that_adds_spec_rollout_rolls_no_existing_object(name):
    """An object stored before: on upgrade the API server fills in the new field's schema
    default (a grace period of 300 s), which must not change its revision."""
    stored = stored_spec(load_sample(name)["spec"])
    assert stored["rollout"]["terminationGracePeriodSeconds"] == 300
    before = REVISIONS_BEFORE_SPEC_ROLLOUT[name]
    assert revision_of(InferenceDeploymentSpec.model_validate(stored)) == before


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_the_release_that_adds_engine_prefix_cache_rolls_no_existing_object(name):
    """On upgrade the API server fills in engine.prefixCache's schema default ({enabled:
    false}): the revision stays what it was before the field existed; writing it explicitly
    off is the same spec."""
    stored = stored_spec(load_sample(name)["spec"])
    assert stored["engine"]["prefixCache"] == {"enabled": False}
    before = REVISIONS_BEFORE_SPEC_ROLLOUT[name]
    assert revision_of(InferenceDeploymentSpec.model_validate(stored)) == before
    explicit = load_sample(name)["spec"]
    explicit.setdefault("engine", {})["prefixCache"] = {"enabled": False}
    assert revision_of(InferenceDeploymentSpec.model_validate(explicit)) == before


def test_the_spec_schema_is_built_once_not_on_every_pass(monkeypatch):
    """Issue 26, item 13: revision_of fills the CRD schema's defaults in; building that schema
    was most of a steady pass's CPU. Built once, a second call does not rebuild it."""
    from kvfence_operator.crd import schema

    getattr(schema.spec_schema, "cache_clear", lambda: None)()  # a fresh start
    built = []
    real = schema._model_schema

    def counted(*args: Any) -> Any:
        built.append(args)
        return real(*args)

    monkeypatch.setattr(schema, "_model_schema", counted)
    first = schema.spec_schema()
    tiny = {"model": {"source": "builtin:tiny-random"}, "contextLength": 512}
    spec = InferenceDeploymentSpec.model_validate({**tiny, "router": {"apiKeysSecret": "k"}})
    revision_of(spec)
    revision_of(spec)
    assert schema.spec_schema() is first
    assert len(built) == 1
