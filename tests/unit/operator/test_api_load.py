"""The operator's steady-state API load (issue 15, item 1): children read from watch-fed
caches, get-before-create, Secrets through a TTL cache, pool probes once per container instance
off the pass, and status written only when it changes."""

import threading
import time
from typing import Any

from helpers.memory_kube import MemoryKube
from helpers.reconciling import body, run_timer, sufficient
from helpers.waits import eventually
from kvfence_engine.contracts import LoadReport
from kvfence_operator.cluster.cache import CACHE_LABELS, WATCHED, CachedKube, Store
from kvfence_operator.cluster.prober import PROBING, Probe, load_prober, pool_prober
from kvfence_operator.crd.types import InferenceDeploymentSpec, Role
from kvfence_operator.decisions.autoscaling import PodLoad
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.decisions.status import merged, status_changes
from kvfence_operator.meta import Instance, selector
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

KEYS = {"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "keys", "namespace": "default"}, "data": {}}  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def filled_store(kube: MemoryKube) -> Store:
    """What the informers' first LISTs leave: every watched kind, as the API holds it."""
    store = Store(["default"])
    for api_version, kind in WATCHED:
        store.replace(kind, "default", kube.list(api_version, kind, "default", {}))
    return store


def play_kubelet(kube: MemoryKube, store: Store, revision: str) -> None:
    """What the cluster's controllers would do, seen through the watch: one running pod per
    Deployment, the Deployments ready, a canary Job complete."""
    for (kind, name), obj in list(kube.objects.items()):
        if kind == "Deployment":
            role = Role(obj["metadata"]["labels"]["kvfence.dev/role"])
            pod_name = f"{name}-0"
            if ("Pod", pod_name) not in kube.objects:
                owner = {"kind": "Deployment", "uid": obj["metadata"]["uid"], "controller": True}
                kube.objects[("Pod", pod_name)] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod_name, "namespace": "default", "uid": f"u-{pod_name}",
                                 "labels": selector(INSTANCE, revision, role),
                                 "ownerReferences": [owner]},
                    "spec": {"containers": [{"name": "engine",
                                             "ports": [{"name": "http", "containerPort": 8000}]}]},
                    "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [],
                               "containerStatuses": [{"name": "engine", "restartCount": 0}]},
                }  # fmt: skip
            replicas = obj["spec"].get("replicas", 1)
            obj["status"] = {"readyReplicas": replicas, "replicas": replicas}
        if kind == "Job" and not (obj.get("status") or {}).get("conditions"):
            obj["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    for (kind, _), obj in kube.objects.items():
        if store.covers(kind, "default"):
            store.apply("MODIFIED", obj)


INSTANCE = Instance("tiny", "default", "uid-infd")


def test_a_steady_pass_makes_no_api_request_and_secrets_cost_two_creates_a_minute():
    kube = MemoryKube(KEYS)
    clock = Clock()
    store = filled_store(kube)
    reconciler = Reconciler(  # as the chart runs it: with a credentials key
        CachedKube(kube, store, clock=clock),
        "kvfence-system",
        read_pool=sufficient,
        push_backends=lambda *_: None,
        credentials_key=b"the credentials key",
    )
    obj = body()
    revision = revision_of(InferenceDeploymentSpec.model_validate(obj["spec"]))
    for _ in range(8):  # to Ready: children, pods, gates, canary, the stable Service
        status = reconciler.reconcile(obj).status
        obj = {**obj, "status": status.model_dump(mode="json", by_alias=True)}
        play_kubelet(kube, store, revision)
        clock.now += 5
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.status == "True", status.conditions
    # no child was ever POSTed twice: get-before-create, and the writes went through
    posted = [r for r in kube.requests if r[0] == "create"]
    assert len(posted) == len(set(posted))

    kube.requests.clear()
    for _ in range(3):  # steady: within the Secrets' TTL nothing is asked
        reconciler.reconcile(obj)
        clock.now += 5
    assert kube.requests == []

    clock.now += 60  # the Secret TTL ran out: one create each (409: exists), nothing else
    reconciler.reconcile(obj)
    assert sorted(kube.requests) == [
        ("create", "Secret", "keys"),  # a dry run: does the API keys Secret exist?
        ("create", "Secret", f"tiny-{revision}-credentials"),
    ]
    assert not any(kind == "Secret" for kind, _ in kube.reads)  # never read: derived


# ---- pool probes: once per container instance, off the pass -------------------------------


def probe(instance: str = "u-p/c1/0") -> Probe:
    return Probe("p", "decode", "r1", "http://10.0.0.1:8000", "tok", instance)


class Reader:
    """A read_pool that counts its reads and answers what `answer` says."""

    def __init__(self) -> None:
        self.reads = 0
        self.answer = "report"
        self.release = threading.Event()

    def __call__(self, pod: str, role: str, revision: str, url: Any, token: Any) -> PodPool:
        self.reads += 1
        if self.answer == "hang":
            self.release.wait(30)
        if self.answer == "report":
            return sufficient(pod, role, revision, url, token)
        return PodPool(pod, role, revision, error=f"unreachable at {url} (ConnectError)")


def test_a_pod_is_probed_once_per_container_instance_and_again_after_a_restart():
    reader = Reader()
    prober = pool_prober(reader)
    for _ in range(3):
        [pool] = prober.readings([probe()])
        assert pool.report is not None
    assert reader.reads == 1
    [pool] = prober.readings([probe("u-p/c2/1")])  # the engine container restarted
    assert pool.report is not None and reader.reads == 2


def test_a_later_failing_or_hanging_probe_never_turns_a_judged_pod_false():
    reader = Reader()
    prober = pool_prober(reader)
    assert prober.readings([probe()])[0].report is not None
    reader.answer = "unreachable"  # the pod is slow to answer now: it is not asked again
    assert prober.readings([probe()])[0].report is not None
    assert reader.reads == 1


def test_a_failed_probe_is_retried_on_later_passes_with_back_off():
    reader, clock = Reader(), Clock()
    reader.answer = "unreachable"
    prober = pool_prober(reader, clock=clock, first_retry_seconds=1, max_retry_seconds=4)
    assert "unreachable" in (prober.readings([probe()])[0].error or "")
    prober.readings([probe()])  # within the back-off: not read again
    assert reader.reads == 1
    for wait, reads in ((1, 2), (1, 2), (1, 3), (4, 4), (4, 5)):  # 1 s, 2 s, 4 s, 4 s (cap)
        clock.now += wait
        prober.readings([probe()])
        assert reader.reads == reads, (wait, reads)
    reader.answer = "report"
    clock.now += 4
    assert prober.readings([probe()])[0].report is not None


def test_a_hanging_probe_does_not_hold_the_pass():
    reader = Reader()
    reader.answer = "hang"
    prober = pool_prober(reader, wait_seconds=0.2)
    try:
        # The read hangs until released (30 s at most): PROBING, not the read's own answer, is
        # what a pass that waited for it could not return.
        [pool] = prober.readings([probe()])
        assert pool.error == PROBING and pool.report is None
        [pool] = prober.readings([probe()])  # the next pass: still probing, not probed twice
        assert pool.error == PROBING and reader.reads == 1
    finally:
        reader.release.set()
        prober.close()


def test_a_pass_with_a_hanging_probe_returns_and_judges_the_pod_unknown():
    reader = Reader()
    reader.answer = "hang"
    kube = MemoryKube(KEYS)
    store = filled_store(kube)
    prober = pool_prober(reader, wait_seconds=0.2)
    reconciler = Reconciler(
        CachedKube(kube, store),
        "kvfence-system",
        push_backends=lambda *_: None,
        prober=prober,
    )
    obj = body()
    revision = revision_of(InferenceDeploymentSpec.model_validate(obj["spec"]))
    try:
        reconciler.reconcile(obj)
        play_kubelet(kube, store, revision)
        status = reconciler.reconcile(obj).status  # returns while both reads still hang
        assert reader.reads == 2  # both engine pods are being probed
        gate = kube.objects[("Pod", f"tiny-{revision}-decode-0")]["status"]["conditions"][0]
        assert (gate["status"], gate["reason"]) == ("False", "PoolUnknown")
        assert PROBING in gate["message"]
        assert next(c for c in status.conditions if c.type == "Ready").status == "False"
    finally:
        reader.release.set()
        prober.close()


# ---- status: written only when it changes ---------------------------------------------------


def test_an_unchanged_status_is_not_patched_and_a_changed_one_is():
    import kopf

    from kvfence_operator.app.metrics import PassMetrics

    kube = MemoryKube(KEYS)
    reconciler = Reconciler(
        CachedKube(kube, filled_store(kube)),
        "kvfence-system",
        read_pool=sufficient,
        push_backends=lambda *_: None,
    )
    memo = kopf.Memo(reconciler=reconciler, metrics=PassMetrics())

    obj, writes = body(), 0
    # a new object, its children appearing: status is written
    while written := run_timer(memo, obj):
        obj = {**obj, "status": merged(obj.get("status"), dict(written["status"]))}
        writes += 1
        assert writes < 5, "the status never settles"
    assert writes >= 1
    assert not run_timer(memo, obj)  # nothing changed since: nothing to write, pass after pass
    assert status_changes(obj["status"], {"observedGeneration": 2})
    assert not status_changes(obj["status"], {"observedGeneration": 1, "gone": None})


def test_a_name_taken_by_someone_elses_object_is_read_from_the_api_and_posted_once():
    """The caches hold only objects labelled as the operator's children: a user's Service
    named like the deployment is not among them, and must still be seen (a NameConflict)."""
    meta = {"name": "tiny", "namespace": "default", "labels": {"team": "web"}}
    theirs: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": meta}
    ours = {**theirs, "metadata": {**theirs["metadata"], "labels": dict(CACHE_LABELS)}}
    kube = MemoryKube(theirs)
    cached = CachedKube(kube, filled_store(kube))
    assert cached.get("v1", "Service", "default", "tiny") is None  # not a child: not cached
    for _ in range(3):
        assert cached.create(ours) is False
        assert cached.get("v1", "Service", "default", "tiny")["metadata"]["labels"] == {
            "team": "web"
        }
    assert [r for r in kube.requests if r[0] == "create"] == [("create", "Service", "tiny")]
    del kube.objects[("Service", "tiny")]  # the user deletes theirs: the name is free again
    assert cached.get("v1", "Service", "default", "tiny") is None
    assert cached.create(ours) is True
    kube.requests.clear()
    assert cached.get("v1", "Service", "default", "tiny") is not None
    assert kube.requests == []


def test_reads_wait_for_a_kinds_first_list_then_go_to_the_api_without_waiting():
    """A latency property, kept as one. The first read waits out the sync timeout (a lower
    bound: a loaded machine only lengthens it); the next five would wait 5 s if each waited
    again, and 2.5 s is a hang guard no loaded machine reaches for five in-memory reads."""
    kube = MemoryKube(KEYS)
    store = Store(["default"])  # no LIST has come in
    cached = CachedKube(kube, store, sync_timeout=1.0)
    started = time.monotonic()
    assert cached.get("apps/v1", "Deployment", "default", "x") is None
    assert time.monotonic() - started > 0.8  # waited for the first LIST, then the API
    started = time.monotonic()
    for _ in range(5):
        cached.get("apps/v1", "Deployment", "default", "x")
    assert time.monotonic() - started < 2.5  # past the deadline: no more waiting
    assert kube.requests == [("get", "Deployment", "x")] * 6
    store.replace("Deployment", "default", [])
    kube.requests.clear()
    assert cached.get("apps/v1", "Deployment", "default", "x") is None
    assert kube.requests == []  # filled: from the cache


def test_a_missing_secret_is_asked_for_again_and_a_present_one_is_kept_for_the_ttl():
    """A missing apiKeysSecret is an error the user fixes by creating it: the next pass must
    see it (Degraded must not outlive the cause by a TTL). A present one is kept 60 s."""
    kube, clock = MemoryKube(), Clock()
    cached = CachedKube(kube, filled_store(kube), clock=clock)
    assert cached.get("v1", "Secret", "default", "keys") is None
    kube.objects[("Secret", "keys")] = KEYS
    assert cached.get("v1", "Secret", "default", "keys") is not None
    kube.requests.clear()
    clock.now += 59
    assert cached.get("v1", "Secret", "default", "keys") is not None
    assert kube.requests == []
    clock.now += 2
    cached.get("v1", "Secret", "default", "keys")
    assert kube.requests == [("get", "Secret", "keys")]


def test_loads_are_read_again_every_refresh_and_a_pass_never_waits_for_one():
    clock = Clock()
    reads: list[str] = []
    release = threading.Event()

    def reader(pod: str, role: str, revision: str, url: Any, token: Any) -> PodLoad:
        reads.append(pod)
        release.wait(5)
        report = LoadReport(
            role=role, revision=revision, waiting_requests=0, queued_prompt_tokens=0,
            running_sequences=0, pages_used=0, pages_total=8,
            time_to_first_token_p90_seconds=None, inter_token_latency_p90_seconds=None,
            window_seconds=60,
        )  # fmt: skip
        return PodLoad(pod, role, revision, report, read_at=time.time())

    prober = load_prober(reader, clock=clock, refresh_seconds=1.0)
    try:
        [load] = prober.readings([probe()])  # returns at once: the read is still running
        assert load.error == PROBING
        release.set()
        # the same instant of the prober's clock: the running read is awaited, not repeated
        [load] = eventually(
            lambda: prober.readings([probe()]), "the read's report", 5,
            until=lambda found: found[0].report is not None,
        )  # fmt: skip
        assert reads == ["p"]
        clock.now += 0.5
        [load] = prober.readings([probe()])
        assert load.report is not None and reads == ["p"]  # within the refresh: not read again
        clock.now += 1.0
        prober.readings([probe()])
        eventually(lambda: len(reads), "a second read", 5, until=lambda n: n == 2)
    finally:
        release.set()
        prober.close()
