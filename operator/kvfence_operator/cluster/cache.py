"""Watch-fed caches for the operator's reads: a steady reconcile pass costs (almost) no
API request.

`CachedKube` has `Kube`'s verbs. Reads of the kinds in `WATCHED` come from a `Store` that
informer threads (`Informer`: LIST, then WATCH from its resourceVersion, LIST again on 410
Gone or a broken watch) keep up to date with every object labelled
`app.kubernetes.io/name=kvfence` (every child carries it; ReplicaSets and pods carry the pod
template's labels) in the namespaces the operator watches. A read waits until its kind's first
LIST is in (never a partially filled cache). The operator's own writes go through to the
cache with the API's answer, so the next pass sees them even before the watch event arrives:
a child the cache holds is never POSTed again (get-before-create). Secrets are not watched
(the operator has no list/watch on Secrets): their GETs go through a TTL cache that the
operator's own creates and deletes update; a missing Secret is not remembered. What a create
of a Secret learnt (created, or 409: it exists; a dry-run create's 409 too) is remembered for
the same TTL, so the derived revision Secrets and the API keys Secret, which the operator
asks about by creating rather than reading, cost one POST a minute, not one a pass.

Informer threads rather than kopf indexes: the reconciler is synchronous code that kopf runs
in a thread, the same `Kube` interface serves the unit tests' in-memory API, and the cache
must take the operator's own writes (kopf's indexes are read-only views).
"""

import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes import client

from kvfence_operator.cluster.kube import KubeError, collection_path, label_selector
from kvfence_operator.meta import APP_NAME, LABEL_NAME

LOG = logging.getLogger(__name__)
CACHE_LABELS = {LABEL_NAME: APP_NAME}
WATCHED: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("apps/v1", "ReplicaSet"),
    ("v1", "Pod"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("batch/v1", "Job"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
)
SECRET_TTL_SECONDS = 60.0
SYNC_TIMEOUT_SECONDS = 60.0
WATCH_SECONDS = 300
RELIST_PAUSE_SECONDS = 1.0


class ClusterVerbs(Protocol):
    """What a reconcile pass asks of the cluster: Kube, CachedKube, or a test's in-memory one."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any: ...
    def list(
        self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]
    ) -> Any: ...
    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool: ...
    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str = "",
    ) -> Any: ...
    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...


class KubeVerbs(ClusterVerbs, Protocol):
    """What the cache needs of the API client beneath it: the verbs, and a create that returns
    the created object (its resourceVersion goes into the store)."""

    def create_object(self, obj: Mapping[str, Any]) -> dict[str, Any] | None: ...


def _rv(obj: Mapping[str, Any]) -> int | None:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or "")
    except ValueError:
        return None


def _labelled(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    held = (obj.get("metadata") or {}).get("labels") or {}
    return all(held.get(k) == v for k, v in labels.items())


class Store:
    """The cached objects of the watched kinds, by kind and (namespace, name); thread-safe.
    `namespaces`: the ones the informers cover, None for all."""

    def __init__(self, namespaces: Sequence[str] | None = None) -> None:
        self.namespaces = None if namespaces is None else frozenset(namespaces)
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            kind: {} for _, kind in WATCHED
        }
        self._synced = {kind: threading.Event() for _, kind in WATCHED}
        self._listed: dict[str, set[str]] = {kind: set() for _, kind in WATCHED}
        self._lock = threading.Lock()

    def covers(self, kind: str, namespace: str) -> bool:
        return kind in self._objects and (self.namespaces is None or namespace in self.namespaces)

    def wait_synced(self, kind: str, timeout: float) -> bool:
        return self._synced[kind].wait(timeout)

    def replace(self, kind: str, namespace: str | None, items: Sequence[Mapping[str, Any]]) -> None:
        """A LIST's answer: everything of `kind` in `namespace` (None: all) is what it says."""
        with self._lock:
            objects = self._objects[kind]
            for key in [k for k in objects if namespace is None or k[0] == namespace]:
                del objects[key]
            for item in items:
                if _labelled(item, CACHE_LABELS):
                    objects[self._key(item)] = copy.deepcopy(dict(item))
            if namespace is not None:
                self._listed[kind].add(namespace)
            filled = namespace is None or (
                self.namespaces is not None and self.namespaces <= self._listed[kind]
            )
        if filled:
            self._synced[kind].set()

    def apply(self, event: str, obj: Mapping[str, Any]) -> None:
        """A watch event, or the operator's own write (ADDED/MODIFIED with the API's answer,
        DELETED). An object older than the one held (by resourceVersion) is ignored: a
        write-through is not undone by the watch event of an earlier change."""
        kind = str(obj.get("kind") or "")
        if kind not in self._objects or not (obj.get("metadata") or {}).get("name"):
            return
        key = self._key(obj)
        with self._lock:
            objects = self._objects[kind]
            held = objects.get(key)
            new, old = _rv(obj), _rv(held) if held is not None else None
            if new is not None and old is not None and new < old:
                return
            if event == "DELETED" or not _labelled(obj, CACHE_LABELS):
                objects.pop(key, None)
            else:
                objects[key] = copy.deepcopy(dict(obj))

    def forget(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._objects[kind].pop((namespace, name), None)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return copy.deepcopy(self._objects[kind].get((namespace, name)))

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        with self._lock:
            return [
                copy.deepcopy(obj)
                for (ns, _), obj in self._objects[kind].items()
                if ns == namespace and _labelled(obj, labels)
            ]

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = obj["metadata"]
        return (str(meta.get("namespace") or ""), str(meta["name"]))


@dataclass
class CachedKube:
    """`Kube`'s verbs, reading the watched kinds from `store` and Secrets through a TTL cache;
    writes go to `kube` and, with the API's answer, into the caches."""

    kube: KubeVerbs
    store: Store
    secret_ttl: float = SECRET_TTL_SECONDS
    sync_timeout: float = SYNC_TIMEOUT_SECONDS
    clock: Callable[[], float] = time.monotonic
    _secrets: dict[tuple[str, str], tuple[float, dict[str, Any] | None]] = field(
        default_factory=dict, init=False
    )
    _secrets_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # Secrets a create (or dry-run create) found taken or made, until when that holds
    _secrets_exist: dict[tuple[str, str], float] = field(default_factory=dict, init=False)
    # reads wait for a kind's first LIST until then; after it, an unfilled kind is read from
    # the API without waiting (a Role missing list/watch must not stall every pass)
    _fill_deadline: float = field(default=0.0, init=False)
    _unfilled_said: set[str] = field(default_factory=set, init=False)
    # names a create found taken by an object the cache does not hold (not labelled as the
    # operator's children are: someone else's): read from the API until it is gone
    _taken: set[tuple[str, str, str]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self._fill_deadline = time.monotonic() + self.sync_timeout

    def _cached(self, kind: str, namespace: str) -> bool:
        if not self.store.covers(kind, namespace):
            return False
        if self.store.wait_synced(kind, max(0.0, self._fill_deadline - time.monotonic())):
            return True
        if kind not in self._unfilled_said:
            self._unfilled_said.add(kind)
            LOG.warning("the %s cache has not been filled: reading %ss from the API", kind, kind)
        return False

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        if self._cached(kind, namespace):
            held = self.store.get(kind, namespace, name)
            if held is not None or (kind, namespace, name) not in self._taken:
                return held
            found = self.kube.get(api_version, kind, namespace, name)
            if found is None:
                self._taken.discard((kind, namespace, name))
            return found
        if kind != "Secret":
            return self.kube.get(api_version, kind, namespace, name)
        key = (namespace, name)
        with self._secrets_lock:
            remembered = self._secrets.get(key)
        if remembered is not None and remembered[0] > self.clock():
            return copy.deepcopy(remembered[1])
        secret = self.kube.get(api_version, kind, namespace, name)
        if secret is not None:  # a missing one is asked for again: the user may create it now
            self._remember_secret(key, secret)
        return copy.deepcopy(secret)

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> Any:
        if CACHE_LABELS.items() <= dict(labels).items() and self._cached(kind, namespace):
            return self.store.list(kind, namespace, labels)
        return self.kube.list(api_version, kind, namespace, labels)

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool:
        """Get-before-create: False, without a request, for a name the cache holds or one a
        409 showed taken by an object the cache does not hold (someone else's, which `get`
        then reads from the API); a 409 for a child of ours is the cache behind, once.
        Secrets: False, without a request, while a create of that name (dry run or not)
        learnt in the last TTL that it exists; a free name is never remembered."""
        meta = obj["metadata"]
        kind, namespace, name = obj["kind"], meta["namespace"], meta["name"]
        if kind == "Secret":
            return self._create_secret(obj, dry_run)
        if dry_run:
            return self.kube.create(obj, dry_run=True)
        cached = self._cached(kind, namespace)
        if cached and (
            self.store.get(kind, namespace, name) or (kind, namespace, name) in self._taken
        ):
            return False
        created = self.kube.create_object(obj)
        if created is None:
            if cached:
                self._taken.add((kind, namespace, name))
            return False
        answer = created if (created.get("metadata") or {}).get("name") else dict(obj)
        self.store.apply("ADDED", {**answer, "kind": kind, "apiVersion": obj["apiVersion"]})
        return True

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str = "",
    ) -> Any:
        answer = self.kube.patch(api_version, kind, namespace, name, patch, subresource)
        if isinstance(answer, Mapping) and (answer.get("metadata") or {}).get("name"):
            self.store.apply("MODIFIED", {**answer, "kind": kind, "apiVersion": api_version})
        return answer

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.kube.delete(api_version, kind, namespace, name)
        if kind == "Secret":
            with self._secrets_lock:
                self._secrets.pop((namespace, name), None)
                self._secrets_exist.pop((namespace, name), None)
        elif self.store.covers(kind, namespace):
            self.store.forget(kind, namespace, name)

    def _remember_secret(self, key: tuple[str, str], secret: dict[str, Any]) -> None:
        with self._secrets_lock:
            self._secrets[key] = (self.clock() + self.secret_ttl, copy.deepcopy(secret))
            self._secrets_exist[key] = self.clock() + self.secret_ttl

    def _create_secret(self, obj: Mapping[str, Any], dry_run: bool) -> bool:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._secrets_lock:
            exists_until = self._secrets_exist.get(key, 0.0)
        if exists_until > self.clock():
            return False
        if dry_run:
            free = self.kube.create(obj, dry_run=True)
            if not free:
                with self._secrets_lock:
                    self._secrets_exist[key] = self.clock() + self.secret_ttl
            return free
        created = self.kube.create_object(obj)
        if created is None:
            with self._secrets_lock:
                self._secrets_exist[key] = self.clock() + self.secret_ttl
            return False
        answer = created if (created.get("metadata") or {}).get("name") else dict(obj)
        self._remember_secret(key, {**answer, "kind": "Secret", "apiVersion": "v1"})
        return True


# ---- informers -------------------------------------------------------------------------------


class Informer(threading.Thread):
    """Keeps `store` filled with one kind in one namespace (None: all): LIST, then WATCH from
    the list's resourceVersion; a watch that ends is resumed, one that fails or answers 410
    Gone starts over with a LIST."""

    def __init__(
        self,
        api: client.ApiClient,
        api_version: str,
        kind: str,
        namespace: str | None,
        store: Store,
    ) -> None:
        super().__init__(name=f"informer-{kind}-{namespace or 'all'}", daemon=True)
        self.api, self.api_version, self.kind, self.namespace = api, api_version, kind, namespace
        self.store = store
        self.stopping = threading.Event()

    def path(self) -> str:
        if self.namespace is not None:
            return collection_path(self.api_version, self.kind, self.namespace)
        # the cluster-wide collection: /api/v1/pods, /apis/apps/v1/deployments, ...
        prefix, _, plural = collection_path(self.api_version, self.kind, "-").rpartition("/")
        return f"{prefix.rsplit('/namespaces/', 1)[0]}/{plural}"

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                version: str | None = self._list()
                while not self.stopping.is_set() and version is not None:
                    version = self._watch(version)
            except Exception as exc:  # the API away, a broken stream: list again shortly
                LOG.warning("watching %s: %s; listing again", self.path(), exc)
            self.stopping.wait(RELIST_PAUSE_SECONDS)

    def _request(self, query: Mapping[str, str], timeout: Any) -> Any:
        request = self.api.param_serialize(
            method="GET",
            resource_path=self.path(),
            query_params=list(query.items()),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=timeout)
        if not 200 <= response.status < 300:
            body = response.read() or b""
            raise KubeError(response.status, "GET", self.path(), body.decode(errors="replace"))
        return response

    def _list(self) -> str:
        response = self._request({"labelSelector": label_selector(CACHE_LABELS)}, 30)
        found = json.loads(response.read() or b"{}")
        items = [
            {**item, "kind": self.kind, "apiVersion": self.api_version}
            for item in found.get("items") or []
        ]
        self.store.replace(self.kind, self.namespace, items)
        return str((found.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, since: str) -> str | None:
        """Events from `version` on; the resourceVersion to resume from, or None to LIST."""
        query = {
            "labelSelector": label_selector(CACHE_LABELS),
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        if since:
            query["resourceVersion"] = since
        version = since
        response = self._request(query, (10, WATCH_SECONDS + 30))
        for event in _events(response.response):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                LOG.info("watch %s: %s; listing again", self.path(), obj.get("message"))
                return None
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                obj = {**obj, "kind": self.kind, "apiVersion": self.api_version}
                self.store.apply(str(kind), obj)
            if self.stopping.is_set():
                return None
        return version


def _events(raw: Any) -> Iterator[dict[str, Any]]:
    """One JSON watch event per line of the streamed answer."""
    pending = b""
    try:
        for chunk in raw.stream(amt=None, decode_content=False):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
    finally:
        raw.release_conn()


def start_informers(
    configuration: client.Configuration, namespaces: Sequence[str] | None
) -> tuple[Store, list[Informer]]:
    """One informer per watched kind and namespace (one cluster-wide per kind for None),
    each on its own ApiClient: a watch holds its connection."""
    store = Store(namespaces or None)
    informers = [
        Informer(client.ApiClient(configuration), api_version, kind, namespace, store)
        for api_version, kind in WATCHED
        for namespace in (namespaces if namespaces else [None])
    ]
    for informer in informers:
        informer.start()
    return store, informers


def wait_filled(store: Store, timeout: float) -> bool:
    """Has every watched kind's first LIST come in within `timeout` seconds?"""
    deadline = time.monotonic() + timeout
    return all(
        store.wait_synced(kind, max(0.0, deadline - time.monotonic())) for _, kind in WATCHED
    )
