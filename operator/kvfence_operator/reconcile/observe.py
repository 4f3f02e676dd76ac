"""What a pass reads, and only reads: the InferenceDeployment's frame (its stable Service, its
API keys Secret, every child it may retire) and, for each revision it keeps, one typed
observation (the spec recorded on it, its credentials, Deployments, pods and their pools, its
canary Job's verdict).

Nothing here writes. An object is counted as this InferenceDeployment's only when its
controller reference says so (decisions/ownership.py), and a pod as a revision's only when the
revision's Deployment controls it, so a pod someone else labelled like an engine is never
probed, gated or given the internal token.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfence_engine.contracts import BackendsFile
from kvfence_operator.builders.canary_job import canary_job_name
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES
from kvfence_operator.builders.router_deployment import BACKENDS_FILE_NAME
from kvfence_operator.builders.secret import (
    CREDENTIALS_MARK,
    RevisionCredentials,
    derived_mark,
    internal_token_of,
    secret_name,
)
from kvfence_operator.cluster.cache import ClusterVerbs
from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.cluster.prober import LoadReader, PoolReader, Probe, Prober
from kvfence_operator.cluster.router_push import written_backends
from kvfence_operator.crd.types import Role
from kvfence_operator.decisions.autoscaling import PodLoad
from kvfence_operator.decisions.canary import CanaryOutcome, canary_outcome
from kvfence_operator.decisions.findings import CredentialsUnreadable
from kvfence_operator.decisions.ownership import pod_controlled_by_deployment
from kvfence_operator.decisions.pods import container_instance, may_serve, pod_url
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.decisions.retirement import REVISION_KINDS
from kvfence_operator.decisions.standing_canary import StandingJob, is_standing_job
from kvfence_operator.meta import (
    ANNOTATION_SPEC,
    Instance,
    child_name,
    controlled_by,
    selector,
)
from kvfence_operator.revision import recorded_spec

Objects = Mapping[tuple[str, str], Sequence[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Frame:
    """The InferenceDeployment's own objects, as a pass finds them before it looks at any
    revision."""

    stable: dict[str, Any] | None  # the stable Service, whoever's it is
    keys_secret_exists: bool  # spec.router.apiKeysSecret
    children: Objects  # every object labelled as its child, by (apiVersion, kind)


@dataclass(frozen=True, slots=True)
class RevisionSeen:
    """One revision as a pass finds it."""

    revision: str
    # the spec recorded on its objects (revision.judged_spec): the first copy that hashes to
    # the revision, its router ConfigMap's, else one of its Deployments' (None: none does)
    record: str | None
    backends: BackendsFile | None  # what its router ConfigMap (if ours) holds
    token: str | None  # its internal token (the engines require it on /v1/kvpool)
    deployments: Mapping[Role, dict[str, Any] | None]  # ours, by role (prefill, decode, router)
    engine_pods: tuple[dict[str, Any], ...]  # those that may serve, prefill then decode
    pools: tuple[PodPool, ...]  # each engine pod's, in the same order
    router_pods: tuple[dict[str, Any], ...]  # every one its router Deployment controls
    canary: CanaryOutcome | None  # its canary Job's verdict; None without a Job of ours
    canary_job: dict[str, Any] | None  # that Job
    # "Kind name" of each of its objects (ours) whose record is present but refused, or, on
    # the router ConfigMap, missing: put back from `record` (drift)
    records_refused: tuple[str, ...] = ()
    # each engine pod's load, in the same order (the serving revision's, when autoscaled;
    # else none read)
    loads: tuple[PodLoad, ...] = ()
    # its standing canary Jobs (ours), with their verdicts (the serving revision's, when
    # spec.canary.schedule is set; else none read)
    standing: tuple[StandingJob, ...] = ()


@dataclass(frozen=True)
class Observer:
    """The reads of a pass. `prober`: pools read once per container instance, off the pass
    (cluster/prober.py); None: `read_pool` is called in the pass (unit tests). The same for
    loads, with `load_prober` and `read_load`."""

    kube: ClusterVerbs
    read_pool: PoolReader
    prober: Prober[PodPool] | None
    credentials_key: bytes | None
    read_load: LoadReader | None = None
    load_prober: Prober[PodLoad] | None = None

    def frame(self, instance: Instance, keys_secret: str) -> Frame:
        stable = self.kube.get("v1", "Service", instance.namespace, instance.name)
        children = {
            (api_version, kind): self.kube.list(
                api_version, kind, instance.namespace, selector(instance)
            )
            for api_version, kind in REVISION_KINDS
        }
        return Frame(stable, self._secret_exists(instance.namespace, keys_secret), children)

    def revision(
        self,
        instance: Instance,
        revision: str,
        desired: bool,
        loads: bool = False,
        standing: bool = False,
    ) -> RevisionSeen:
        """`desired`: the spec's revision, whose router ConfigMap this pass creates if it is
        missing (with this operator's credentials mark); `loads`: read its engines' loads;
        `standing`: read its standing canary Jobs."""
        ns = instance.namespace
        configmap = self.kube.get(
            "v1", "ConfigMap", ns, child_name(instance, revision, Role.ROUTER)
        )
        ours = (
            configmap if configmap is not None and controlled_by(configmap, instance.uid) else None
        )
        token = self._internal_token(instance, revision, ours, configmap is None and desired)
        deployments = {
            role: self._ours(
                instance,
                self.kube.get("apps/v1", "Deployment", ns, child_name(instance, revision, role)),
            )
            for role in (*ENGINE_ROLES, Role.ROUTER)
        }
        engines = [
            (role, pod)
            for role in ENGINE_ROLES
            for pod in self._revision_pods(
                ns, deployments[role], selector(instance, revision, role)
            )
            if may_serve(pod)  # deleted, evicted or finished: no engine of its revision
        ]
        probes = [
            Probe(
                pod["metadata"]["name"],
                str(role),
                revision,
                pod_url(pod),
                token,
                container_instance(pod),
            )
            for role, pod in engines
        ]
        job = self._ours(
            instance, self.kube.get("batch/v1", "Job", ns, canary_job_name(instance, revision))
        )
        canary_pods = (
            self.kube.list("v1", "Pod", ns, selector(instance, revision, Role.CANARY))
            if job is not None or standing
            else []
        )
        canary = canary_outcome(job, _of_job(canary_pods, job)) if job is not None else None
        standing_jobs = (
            tuple(
                StandingJob(j, canary_outcome(j, _of_job(canary_pods, j)))
                for j in self.kube.list(
                    "batch/v1", "Job", ns, selector(instance, revision, Role.CANARY)
                )
                if controlled_by(j, instance.uid)
                and is_standing_job(j["metadata"]["name"], instance, revision)
            )
            if standing
            else ()
        )
        routers = self._revision_pods(
            ns, deployments[Role.ROUTER], selector(instance, revision, Role.ROUTER)
        )
        record, refused = _record(
            revision,
            [
                (f"ConfigMap {child_name(instance, revision, Role.ROUTER)}", ours),
                *(
                    (f"Deployment {child_name(instance, revision, role)}", deployment)
                    for role, deployment in deployments.items()
                ),
            ],
        )
        return RevisionSeen(
            revision,
            record,
            written_backends(((ours or {}).get("data") or {}).get(BACKENDS_FILE_NAME)),
            token,
            deployments,
            tuple(pod for _, pod in engines),
            tuple(self._pools(probes)),
            tuple(routers),
            canary,
            job,
            refused,
            tuple(self._loads(probes)) if loads else (),
            standing_jobs,
        )

    def token(self, instance: Instance, revision: str) -> str | None:
        """A revision's internal token, as `revision` would find it (None: none readable)."""
        configmap = self._ours(
            instance,
            self.kube.get(
                "v1", "ConfigMap", instance.namespace, child_name(instance, revision, Role.ROUTER)
            ),
        )
        return self._internal_token(instance, revision, configmap, made_now=False)

    def _ours(self, instance: Instance, obj: dict[str, Any] | None) -> dict[str, Any] | None:
        return obj if obj is not None and controlled_by(obj, instance.uid) else None

    def _secret_exists(self, namespace: str, name: str) -> bool:
        """Whether a Secret exists, without reading it: a dry-run create answers 409 when the
        name is taken and stores nothing when not. Another refusal (a quota's 403) leaves the
        question open: not reported missing."""
        probe = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
        }
        try:
            return not self.kube.create(probe, dry_run=True)
        except KubeError:
            return True

    def _internal_token(
        self,
        instance: Instance,
        revision: str,
        configmap: Mapping[str, Any] | None,
        made_now: bool,
    ) -> str | None:
        """The revision's internal token: derived when its router ConfigMap (ours) records
        this operator's credentials key, or when this pass makes that ConfigMap (`made_now`);
        read from its Secret otherwise (a revision made by an older operator, or under another
        key: RBAC `get`, chart rbac.legacyRevisionSecrets)."""
        key = self.credentials_key
        if key is not None:
            annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
            if made_now or annotations.get(CREDENTIALS_MARK) == derived_mark(key):
                return RevisionCredentials.derive(key, instance, revision).internal_token
        name = secret_name(instance, revision)
        try:
            secret = self.kube.get("v1", "Secret", instance.namespace, name)
        except KubeError as exc:
            if exc.status == 403:
                raise CredentialsUnreadable(revision, name) from exc
            raise
        return internal_token_of(self._ours(instance, secret))

    def _pools(self, probes: Sequence[Probe]) -> list[PodPool]:
        """Each pod's pool: from the prober when there is one, else read now."""
        if self.prober is not None:
            return self.prober.readings(probes)
        return [self.read_pool(p.pod, p.role, p.revision, p.url, p.token) for p in probes]

    def _loads(self, probes: Sequence[Probe]) -> list[PodLoad]:
        if self.load_prober is not None:
            return self.load_prober.readings(probes)
        if self.read_load is None:
            return [PodLoad(p.pod, p.role, p.revision, error="not read") for p in probes]
        return [self.read_load(p.pod, p.role, p.revision, p.url, p.token) for p in probes]

    def _revision_pods(
        self, namespace: str, deployment: Mapping[str, Any] | None, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """The pods `deployment` controls, among those carrying its labels."""
        if deployment is None:
            return []
        replicasets: dict[str, dict[str, Any] | None] = {}

        def replicaset(name: str) -> dict[str, Any] | None:
            if name not in replicasets:
                replicasets[name] = self.kube.get("apps/v1", "ReplicaSet", namespace, name)
            return replicasets[name]

        return [
            pod
            for pod in self.kube.list("v1", "Pod", namespace, labels)
            if pod_controlled_by_deployment(pod, deployment, replicaset)
        ]


def _of_job(pods: Sequence[dict[str, Any]], job: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [pod for pod in pods if controlled_by(pod, job["metadata"]["uid"])]


def _record(
    revision: str, holders: Sequence[tuple[str, Mapping[str, Any] | None]]
) -> tuple[str | None, tuple[str, ...]]:
    """The revision's record (the first copy among `holders`, each (name, object or None),
    that hashes to it) and the names of those whose copy is refused: present but not the
    revision's, or missing from the first holder (the router ConfigMap, which always had one).
    A Deployment made before it carried a copy is given one without a word."""
    record = None
    refused = []
    for index, (name, obj) in enumerate(holders):
        if obj is None:
            continue
        copy = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC)
        if recorded_spec(revision, copy) is not None:
            record = record or copy
        elif copy is not None or index == 0:
            refused.append(name)
    return record, tuple(refused)
