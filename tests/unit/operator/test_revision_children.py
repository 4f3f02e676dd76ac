"""What the operator would create for a revision: valid Kubernetes 1.30 objects, all owned by the
InferenceDeployment, all running hardened pods, none carrying a secret in the clear."""

import json

import kubernetes_validate
import pytest

from helpers.builders import CREDENTIALS, everything_built, instance_for, pod_spec, sample_spec
from helpers.crd_admission import SAMPLE_NAMES
from kvfence_operator.builders import build_revision_children
from kvfence_operator.meta import Instance
from kvfence_operator.revision import revision_of

ALL_BUILT = [(name, obj) for name in SAMPLE_NAMES for obj in everything_built(name)]
IDS = [f"{name}-{obj['kind']}-{obj['metadata']['name']}" for name, obj in ALL_BUILT]
WORKLOADS = [(n, o) for n, o in ALL_BUILT if o["kind"] in ("Deployment", "Job")]
WORKLOAD_IDS = [f"{n}-{o['metadata']['name']}" for n, o in WORKLOADS]


@pytest.mark.parametrize(("sample", "obj"), ALL_BUILT, ids=IDS)
def test_every_built_object_is_valid_for_kubernetes_1_30(sample, obj):
    kubernetes_validate.validate(obj, "1.30", strict=True)


def test_a_misspelt_field_fails_that_validation():
    """Negative control: strict validation does catch a wrong manifest."""
    deployment = next(o for o in everything_built("minimal") if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["readinessGate"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30", strict=True)


@pytest.mark.parametrize(("sample", "obj"), ALL_BUILT, ids=IDS)
def test_every_built_object_is_owned_by_its_inference_deployment(sample, obj):
    instance = instance_for(sample)
    assert obj["metadata"]["namespace"] == instance.namespace
    assert obj["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "kvfence.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "name": instance.name,
            "uid": instance.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "kvfence"
    assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == instance.name


def test_one_revision_is_a_secret_config_policies_services_and_three_deployments():
    kinds = [(o["kind"], o["metadata"]["name"]) for o in everything_built("minimal")]
    revision = revision_of(sample_spec("minimal"))
    prefix = f"smollm-{revision}"
    assert kinds == [
        ("Secret", f"{prefix}-credentials"),
        ("ConfigMap", f"{prefix}-router"),
        ("NetworkPolicy", f"{prefix}-prefill"),
        ("NetworkPolicy", f"{prefix}-decode"),
        ("NetworkPolicy", f"{prefix}-router"),
        ("Service", f"{prefix}-prefill"),
        ("Service", f"{prefix}-decode"),
        ("Service", f"{prefix}-router"),
        ("PodDisruptionBudget", f"{prefix}-prefill"),
        ("PodDisruptionBudget", f"{prefix}-decode"),
        ("PodDisruptionBudget", f"{prefix}-router"),
        ("Deployment", f"{prefix}-prefill"),
        ("Deployment", f"{prefix}-decode"),
        ("Deployment", f"{prefix}-router"),
        ("Job", f"{prefix}-canary"),
        ("Service", "smollm"),
    ]


@pytest.mark.parametrize(("sample", "workload"), WORKLOADS, ids=WORKLOAD_IDS)
def test_every_pod_runs_non_root_with_a_read_only_root_and_no_capabilities(sample, workload):
    pod = pod_spec(workload)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        context = c["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]


@pytest.mark.parametrize(("sample", "workload"), WORKLOADS, ids=WORKLOAD_IDS)
def test_no_workload_spec_contains_a_credential(sample, workload):
    text = json.dumps(workload)
    for value in (CREDENTIALS.internal_token, CREDENTIALS.tenant_a_key, CREDENTIALS.tenant_b_key):
        assert value not in text


def test_children_names_stay_within_dns_label_limits_for_the_longest_name():
    spec = sample_spec("full")
    instance = Instance(name="a" * 40, namespace="default", uid="u")
    children = build_revision_children(spec, instance, revision_of(spec), CREDENTIALS, "ops")
    assert all(len(o["metadata"]["name"]) <= 63 for o in children)


@pytest.mark.parametrize("name", ["a" * 41, "1abc", "Upper", "ends-"])
def test_an_instance_name_children_cannot_carry_is_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="at most 40 characters"):
        Instance(name=name, namespace="default", uid="u")
