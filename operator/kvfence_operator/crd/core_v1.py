"""The core/v1 shapes an InferenceDeployment passes into its pods, typed.

Each is the subset of the Kubernetes type that a pod template takes, with the same camelCase
names, enums and required fields, so that the CRD's schema is structural all the way down: a
mistyped toleration (`effect: NoSchedul`, `tolerationSecond: 5`) is refused by `kubectl apply`
and by `model_validate`, not later when the operator creates the Deployment. They dump
(`model_dump(by_alias=True, exclude_none=True)`) to exactly what a pod spec holds.

The kubernetes client ships models but no OpenAPI document to generate these from; the field
lists follow the Kubernetes 1.32 API reference.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = int | Annotated[str, Field(pattern=QUANTITY_PATTERN)]
Name = Annotated[str, Field(min_length=1, max_length=253)]
LabelKey = Annotated[str, Field(min_length=1, max_length=317)]
# label values are at most 63 characters, but matchFields values are node names (253)
Values = Annotated[list[Annotated[str, Field(max_length=253)]], Field(max_length=64)]


class KubeModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """Schema extra holding CEL rules as (rule, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


# ---- scheduling ---------------------------------------------------------------------------------


# Kubernetes' own checks of a toleration (validateTolerations), as CEL and in pydantic.
TOLERATION_RULES = (
    (
        "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "a toleration without a key must have operator Exists",
    ),
    (
        "!(has(self.operator) && self.operator == 'Exists') || !has(self.value) || "
        "self.value == ''",
        "a toleration with operator Exists must not have a value",
    ),
    (
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds needs effect NoExecute",
    ),
)


class Toleration(KubeModel):
    model_config = ConfigDict(json_schema_extra=cel(*TOLERATION_RULES))

    key: str | None = Field(None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _as_kubernetes_checks_it(self) -> "Toleration":
        (no_key, exists_value, seconds), exists = TOLERATION_RULES, self.operator == "Exists"
        if not self.key and not exists:
            raise ValueError(no_key[1])
        if exists and self.value:
            raise ValueError(exists_value[1])
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(seconds[1])
        return self


class LabelSelectorRequirement(KubeModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: Values = Field(default_factory=list)


class LabelSelector(KubeModel):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=64)


class NodeSelectorRequirement(KubeModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: Values = Field(default_factory=list)


class NodeSelectorTerm(KubeModel):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=64)
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=64)


class NodeSelector(KubeModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(max_length=64)


class PreferredSchedulingTerm(KubeModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(KubeModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=64
    )


class PodAffinityTerm(KubeModel):
    topology_key: str = Field(min_length=1, max_length=317)
    label_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    namespaces: list[Name] = Field(default_factory=list, max_length=64)
    match_label_keys: list[LabelKey] = Field(default_factory=list, max_length=64)
    mismatch_label_keys: list[LabelKey] = Field(default_factory=list, max_length=64)


class WeightedPodAffinityTerm(KubeModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(KubeModel):
    """PodAffinity and PodAntiAffinity have the same shape."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=64
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=64
    )


class Affinity(KubeModel):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(KubeModel):
    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=317)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[LabelKey] = Field(default_factory=list, max_length=64)


# ---- env ----------------------------------------------------------------------------------------


class KeySelector(KubeModel):
    """ConfigMapKeySelector and SecretKeySelector have the same shape."""

    name: Name
    key: str = Field(min_length=1, max_length=253)
    optional: bool | None = None


class ObjectFieldSelector(KubeModel):
    field_path: str = Field(min_length=1, max_length=256)
    api_version: str | None = Field(None, max_length=64)


class ResourceFieldSelector(KubeModel):
    resource: str = Field(min_length=1, max_length=256)
    container_name: str | None = Field(None, max_length=63)
    divisor: Quantity | None = None


ENV_SOURCES = ("configMapKeyRef", "secretKeyRef", "fieldRef", "resourceFieldRef")
ONE_ENV_SOURCE = f"valueFrom must set exactly one of {', '.join(ENV_SOURCES)}"


class EnvVarSource(KubeModel):
    """Where an env var's value comes from. secretKeyRef can name any Secret in the namespace,
    as a pod's can: creating an InferenceDeployment is as powerful as creating pods (docs/crd.md,
    "Who may create one")."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})

    config_map_key_ref: KeySelector | None = None
    secret_key_ref: KeySelector | None = None
    field_ref: ObjectFieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "EnvVarSource":
        if sum(getattr(self, name) is not None for name in type(self).model_fields) != 1:
            raise ValueError(ONE_ENV_SOURCE)
        return self


# ---- the model volume ---------------------------------------------------------------------------


class PersistentVolumeClaimVolumeSource(KubeModel):
    claim_name: Name
    read_only: bool | None = None


class ImageVolumeSource(KubeModel):
    """An OCI image (or artifact) mounted as a volume (Kubernetes 1.31+, feature gate
    ImageVolume): weights shipped through a registry like the engine image."""

    reference: str = Field(min_length=1, max_length=1024)
    pull_policy: Literal["Always", "Never", "IfNotPresent"] | None = None


class LocalObjectReference(KubeModel):
    name: Name


class CSIVolumeSource(KubeModel):
    driver: str = Field(min_length=1, max_length=63)
    read_only: bool | None = None
    fs_type: str | None = Field(None, max_length=63)
    volume_attributes: dict[str, str] = Field(default_factory=dict)
    node_publish_secret_ref: LocalObjectReference | None = None


class NFSVolumeSource(KubeModel):
    server: str = Field(min_length=1, max_length=253)
    path: str = Field(min_length=1, max_length=4096)
    read_only: bool | None = None


# The volume sources a model may come from, and why only these: a model is read-only data
# shared by every engine replica, so it lives on shared storage (a claim, CSI, NFS) or in an
# image. hostPath (the node's filesystem), secret, configMap, downwardAPI and projected (API
# objects, not weights; a secret source would expose Secrets) are refused; so are emptyDir and
# ephemeral (a fresh, empty volume per pod) and the deprecated in-tree network sources
# (gitRepo, iscsi, rbd, cephfs, ...: use their CSI driver or a claim).
MODEL_VOLUME_TYPES = ("persistentVolumeClaim", "image", "csi", "nfs")


class ModelVolume(KubeModel):
    """One volume source, of an allowed type, for the model."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})

    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = None
    image: ImageVolumeSource | None = None
    csi: CSIVolumeSource | None = None
    nfs: NFSVolumeSource | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_allowed_type(cls, value: Any) -> Any:
        if isinstance(value, dict):
            allowed = ", ".join(MODEL_VOLUME_TYPES)
            given = [k for k, v in value.items() if v is not None]
            names = {n for f, info in cls.model_fields.items() for n in (f, info.alias)}
            refused = sorted(k for k in given if k not in names)
            if refused:
                raise ValueError(
                    f"model.volume: {', '.join(refused)} is not an allowed volume type; use one "
                    f"of {allowed}"
                )
            if len(given) != 1:
                raise ValueError(f"model.volume must set exactly one of {allowed}")
        return value

    def source(self) -> dict[str, Any]:
        """The volume source as a pod's volume spells it."""
        return self.model_dump(by_alias=True, exclude_none=True)

    # builders/pod_template.py spreads the volume into the pod's (`{**model.volume, ...}`)
    def keys(self) -> Any:
        return self.source().keys()

    def __getitem__(self, key: str) -> Any:
        return self.source()[key]
