"""What makes a stop graceful: every server pod sleeps in preStop while endpoints drop it,
has a grace period from the spec and drains for the rest of it; PDBs per role."""

import pytest

from helpers.builders import container, flag, instance_for, pod_spec
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.disruption_budget import build_disruption_budgets
from kvfence_operator.builders.secret import RevisionCredentials
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import selector

REVISION = "0123456789"
SPEC = {
    "model": {"source": "builtin:tiny-random"},
    "contextLength": 1024,
    "router": {"apiKeysSecret": "keys"},
}


def deployments(**spec: object) -> list[dict]:
    parsed = InferenceDeploymentSpec.model_validate({**SPEC, **spec})
    children = build_revision_children(
        parsed, instance_for("minimal"), REVISION, RevisionCredentials.generate(), "kvfence"
    )
    return [c for c in children if c["kind"] == "Deployment"]


def test_every_server_pod_sleeps_in_pre_stop_then_drains_for_the_rest_of_its_grace():
    built = deployments(rollout={"terminationGracePeriodSeconds": 120})
    assert [d["metadata"]["name"].rsplit("-", 1)[1] for d in built] == [
        "prefill",
        "decode",
        "router",
    ]
    for deployment in built:
        c = container(deployment)
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] == 120
        assert flag(c["args"], "--drain-seconds") == "115"


def test_the_default_grace_outlasts_long_streams():
    for deployment in deployments():
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] == 300
        assert flag(container(deployment)["args"], "--drain-seconds") == "295"


@pytest.mark.parametrize("grace", [0, 9])
def test_a_grace_period_that_leaves_no_drain_after_the_pre_stop_is_refused(grace):
    with pytest.raises(ValueError, match="terminationGracePeriodSeconds"):
        InferenceDeploymentSpec.model_validate(
            {**SPEC, "rollout": {"terminationGracePeriodSeconds": grace}}
        )


def test_each_role_of_a_revision_has_a_budget_of_one_unavailable_pod():
    instance = instance_for("minimal")
    budgets = build_disruption_budgets(instance, REVISION)
    assert [(b["apiVersion"], b["kind"]) for b in budgets] == [
        ("policy/v1", "PodDisruptionBudget")
    ] * 3
    for budget, deployment in zip(budgets, deployments(), strict=True):
        assert budget["metadata"]["name"] == deployment["metadata"]["name"]
        assert budget["spec"] == {
            "maxUnavailable": 1,
            "selector": deployment["spec"]["selector"],
        }
        role = deployment["metadata"]["labels"]["kvfence.dev/role"]
        assert budget["spec"]["selector"]["matchLabels"] == selector(instance, REVISION, role)
