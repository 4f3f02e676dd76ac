"""The API server's state and its write rules, without HTTP.

What a real kube-apiserver does on every write and kmock 0.8 does not: uid, resourceVersion
(one global counter, bumped on every write), creationTimestamp, namespace from the URL,
generation (bumped on spec changes only), the status subresource (main writes keep status,
status writes keep everything else), resourceVersion preconditions, finalizers and
deletionTimestamp, owner-reference garbage collection, defaulting, and watch events with a
replayable history. The HTTP layer (apiserver.py) and the test kubelet both write through here.
"""

import asyncio
import pickle
import re
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .cluster_ips import allocate_cluster_ip
from .defaults import apply_defaults
from .patching import PatchError, json_patch, merge_patch, strategic_merge_patch
from .resources import (
    ApiError,
    ResourceType,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
    now_rfc3339,
    random_suffix,
)
from .selectors import Selector, fields_match, labels_match

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
SERVER_OWNED_METADATA = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
FULL = "*"  # store.update(subresource=FULL): a controller writing spec and status in one go
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True, slots=True)
class Change:
    """One committed write. `old` and `new` are snapshots that nobody mutates."""

    rt: ResourceType
    type: str  # ADDED | MODIFIED | DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]
    resource_version: int


class Watcher:
    """One watch request: filters committed changes into Kubernetes watch events. An object
    that starts or stops matching the selector arrives as ADDED or DELETED, as in Kubernetes."""

    def __init__(
        self, rt: ResourceType, namespace: str | None, labels: Selector, fields: Selector
    ) -> None:
        self.rt, self.namespace, self.labels, self.fields = rt, namespace, labels, fields
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def _selects(self, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, obj)

    def event(self, change: Change) -> dict[str, Any] | None:
        if (change.rt.group, change.rt.plural) != (self.rt.group, self.rt.plural):
            return None
        was = change.old is not None and self._selects(change.old)
        if change.type == "DELETED":
            return {"type": "DELETED", "object": change.new} if was else None
        now = self._selects(change.new)
        kind = "MODIFIED" if was and now else "ADDED" if now else "DELETED" if was else None
        return None if kind is None else {"type": kind, "object": change.new}

    def offer(self, change: Change) -> None:
        if (event := self.event(change)) is not None:
            self.queue.put_nowait(event)


ObjectKey = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name


def snapshot(obj: Any) -> Any:
    """A deep copy of a JSON-like object: what copy.deepcopy gives, about five times faster
    (the kubelet and the controllers list every pod at every write)."""
    return pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


class Store:
    """Every object of every kind. Not thread-safe: use it from the server's event loop."""

    def __init__(self, history_limit: int = 20_000) -> None:
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        # the same objects by (group, plural): a list reads one kind, not every object
        self._by_kind: dict[tuple[str, str], dict[ObjectKey, dict[str, Any]]] = {}
        self._kinds: dict[tuple[str, str], ResourceType] = {}
        self._uids: dict[str, ObjectKey] = {}
        self._rv = 0
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._history_floor = 0  # changes at or below this resourceVersion were forgotten
        self._watchers: set[Watcher] = set()
        self._listeners: list[Callable[[Change], None]] = []
        self._propagation: dict[ObjectKey, str] = {}  # deletions waiting for finalizers
        # Checks a new object, or one whose spec a write changes (the status subresource is
        # not checked); raises the ApiError that refuses the write. The API server sets it.
        self.admit: Callable[[ResourceType, dict[str, Any]], None] | None = None

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    # ---- reads ----------------------------------------------------------------------------

    @staticmethod
    def _key(rt: ResourceType, namespace: str | None, name: str) -> ObjectKey:
        return (rt.group, rt.plural, (namespace or "") if rt.namespaced else "", name)

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self._objects.get(self._key(rt, namespace, name))
        return snapshot(obj) if obj is not None else None

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.find(rt, namespace, name)
        if obj is None:
            raise not_found(rt, name)
        return obj

    def _select(
        self, rt: ResourceType, namespace: str | None, labels: Selector, fields: Selector
    ) -> Iterator[dict[str, Any]]:
        for (_, _, ns, _), obj in sorted(self._by_kind.get((rt.group, rt.plural), {}).items()):
            if namespace is not None and ns != namespace:
                continue
            meta = obj["metadata"]
            if labels_match(labels, meta.get("labels")) and fields_match(fields, obj):
                yield obj

    def list_objects(
        self,
        rt: ResourceType,
        namespace: str | None = None,
        labels: Selector = (),
        fields: Selector = (),
    ) -> list[dict[str, Any]]:
        return [snapshot(o) for o in self._select(rt, namespace, labels, fields)]

    def exists_uid(self, uid: str) -> bool:
        return uid in self._uids

    # ---- writes ---------------------------------------------------------------------------

    def subscribe(self, listener: Callable[[Change], None]) -> None:
        """Called after every committed write (the test kubelet wakes up on these)."""
        self._listeners.append(listener)

    def _commit(
        self,
        rt: ResourceType,
        key: ObjectKey,
        old: dict[str, Any] | None,
        new: dict[str, Any],
        kind: str,
    ) -> dict[str, Any]:
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        uid = new["metadata"]["uid"]
        of_kind = self._by_kind.setdefault((rt.group, rt.plural), {})
        if kind == "DELETED":
            self._objects.pop(key, None)
            of_kind.pop(key, None)
            self._uids.pop(uid, None)
            self._propagation.pop(key, None)
        else:
            self._objects[key] = of_kind[key] = new
            self._uids[uid] = key
        self._kinds[(rt.group, rt.plural)] = rt
        change = Change(rt, kind, old, new, self._rv)
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self._history_floor = self._history.popleft().resource_version
        for watcher in list(self._watchers):
            watcher.offer(change)
        for listener in self._listeners:
            listener(change)
        return new

    def _namespace_for(self, rt: ResourceType, url_ns: str | None, body_ns: str | None) -> str:
        if not rt.namespaced:
            if url_ns:
                raise bad_request(f"{rt.qualified} is not namespaced")
            return ""
        if url_ns and body_ns and url_ns != body_ns:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        namespace = url_ns or body_ns
        if not namespace:
            raise bad_request(f"a namespace is required to create {rt.qualified}")
        return namespace

    def _check_name(self, rt: ResourceType, name: str) -> None:
        dns_label = rt.plural in ("services", "namespaces")
        pattern, limit = (_LABEL_1035, 63) if dns_label else (_SUBDOMAIN, 253)
        if len(name) > limit or not pattern.match(name):
            raise invalid(
                rt,
                name,
                f"metadata.name: Invalid value: {name!r}: must be a lowercase RFC 1123 "
                f"{'label' if dns_label else 'subdomain'} of at most {limit} characters",
            )

    def create(
        self, rt: ResourceType, namespace: str | None, body: Any, dry_run: bool = False
    ) -> dict[str, Any]:
        """dry_run (`?dryRun=All`): every check and default, a 409 for a taken name, and
        nothing stored or announced."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise bad_request(f"a {rt.kind} must be a JSON object with metadata")
        obj = snapshot(body)
        meta = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        ns = self._namespace_for(rt, namespace, meta.get("namespace"))
        name = meta.get("name") or ""
        if not name:
            prefix = meta.get("generateName")
            if not prefix:
                raise invalid(rt, "", "metadata.name: Required value: name or generateName")
            name = prefix + random_suffix()
            while self._key(rt, ns, name) in self._objects:
                name = prefix + random_suffix()
        self._check_name(rt, name)
        key = self._key(rt, ns, name)
        if key in self._objects:
            raise already_exists(rt, name)
        for field in SERVER_OWNED_METADATA:
            meta.pop(field, None)
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
        if ns:
            meta["namespace"] = ns
        if rt.tracks_generation:
            meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        if rt.has_status:  # status is the controllers' to write, never the creator's
            obj.pop("status", None)
            if not rt.custom:
                obj["status"] = {"phase": "Pending"} if rt.plural == "pods" and not rt.group else {}
        if (rt.group, rt.plural) == ("", "services"):
            self._allocate_cluster_ip(rt, obj)
        apply_defaults(rt.group, rt.plural, obj, creating=True)
        if self.admit is not None:
            self.admit(rt, obj)
        if dry_run:
            return obj
        return snapshot(self._commit(rt, key, None, obj, "ADDED"))

    def _allocate_cluster_ip(self, rt: ResourceType, service: dict[str, Any]) -> None:
        """A Service's clusterIP, as the API server allocates it: a loopback address 127.0.x.y
        that the test kube-proxy (proxy.py) serves. Headless (None) and ExternalName have none."""
        spec = service.setdefault("spec", {})
        if not isinstance(spec, dict) or spec.get("type") == "ExternalName":
            return
        taken = {(o.get("spec") or {}).get("clusterIP") for o in self._select(rt, None, (), ())}
        wanted = spec.get("clusterIP")
        if wanted and wanted != "None" and wanted in taken:
            raise invalid(
                rt,
                service["metadata"]["name"],
                f"spec.clusterIPs: Invalid value: [{wanted!r}]: failed to allocate IP "
                f"{wanted}: provided IP is already allocated",
            )
        if not wanted:
            ports = [p.get("port") for p in spec.get("ports") or [] if isinstance(p, dict)]
            spec["clusterIP"] = allocate_cluster_ip(
                {str(t) for t in taken if t}, [int(str(p)) for p in ports if str(p).isdigit()]
            )

    def _require(
        self, rt: ResourceType, namespace: str | None, name: str
    ) -> tuple[ObjectKey, dict[str, Any]]:
        key = self._key(rt, namespace, name)
        obj = self._objects.get(key)
        if obj is None:
            raise not_found(rt, name)
        return key, obj

    @staticmethod
    def _check_resource_version(rt: ResourceType, old: dict[str, Any], candidate: Any) -> None:
        if not isinstance(candidate, dict):
            return
        wanted = (candidate.get("metadata") or {}).get("resourceVersion")
        if wanted and str(wanted) != old["metadata"]["resourceVersion"]:
            raise conflict(
                rt,
                old["metadata"]["name"],
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )

    @staticmethod
    def _spec(rt: ResourceType, obj: dict[str, Any]) -> Any:
        if rt.custom:
            return {
                k: v
                for k, v in obj.items()
                if k not in ("metadata", "status", "apiVersion", "kind")
            }
        return obj.get("spec")

    def _check_immutable(self, rt: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> None:
        if rt.group or rt.plural not in ("secrets", "configmaps") or not old.get("immutable"):
            return
        for field in ("data", "binaryData", "immutable"):
            if new.get(field) != old.get(field):
                raise invalid(
                    rt,
                    old["metadata"]["name"],
                    f"{field}: Forbidden: field is immutable when `immutable` is set",
                )

    def _finish_update(
        self,
        rt: ResourceType,
        key: ObjectKey,
        old: dict[str, Any],
        candidate: Any,
        subresource: str | None,
    ) -> dict[str, Any]:
        if not isinstance(candidate, dict):
            raise bad_request(f"a {rt.kind} must be a JSON object")
        if subresource == "status":
            new = snapshot(old)
            if "status" in candidate:
                new["status"] = candidate["status"]
            else:
                new.pop("status", None)
        elif subresource in (None, FULL):
            new = candidate
            if rt.has_status and subresource is None:
                if "status" in old:
                    new["status"] = snapshot(old["status"])
                else:
                    new.pop("status", None)
        else:
            raise ApiError(
                405, "MethodNotAllowed", f"{rt.qualified}/{subresource} cannot be written here"
            )
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        for field in SERVER_OWNED_METADATA:
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        new["apiVersion"], new["kind"] = rt.api_version, rt.kind
        if (rt.group, rt.plural) == ("", "services") and subresource != "status":
            self._keep_cluster_ip(rt, old, new)
        if subresource != "status":
            apply_defaults(rt.group, rt.plural, new, creating=False)
            self._check_immutable(rt, old, new)
            if self.admit is not None and self._spec(rt, new) != self._spec(rt, old):
                self.admit(rt, new)
        if new == old:
            return snapshot(old)  # a no-op write changes nothing, not even resourceVersion
        if rt.tracks_generation and self._spec(rt, new) != self._spec(rt, old):
            meta["generation"] = int(meta.get("generation") or 0) + 1
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(rt, key, old, new)
            return snapshot(new)
        return snapshot(self._commit(rt, key, old, new, "MODIFIED"))

    @staticmethod
    def _keep_cluster_ip(rt: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> None:
        """An update that leaves clusterIP out keeps the allocated one; changing it is refused."""
        before = (old.get("spec") or {}).get("clusterIP")
        spec = new.get("spec")
        if not before or not isinstance(spec, dict):
            return
        if not spec.get("clusterIP"):
            spec["clusterIP"] = before
            spec.setdefault("clusterIPs", (old.get("spec") or {}).get("clusterIPs", [before]))
        elif spec["clusterIP"] != before:
            raise invalid(
                rt,
                old["metadata"]["name"],
                f"spec.clusterIPs[0]: Invalid value: [{spec['clusterIP']!r}]: may not change "
                "once set",
            )

    def replace(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        key, old = self._require(rt, namespace, name)
        if isinstance(body, dict) and (body.get("metadata") or {}).get("name", name) != name:
            raise bad_request("the name of the object does not match the name on the URL")
        self._check_resource_version(rt, old, body)
        return self._finish_update(rt, key, old, snapshot(body), subresource)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        key, old = self._require(rt, namespace, name)
        content_type = content_type.split(";")[0].strip().lower()
        try:
            if content_type == JSON_PATCH:
                candidate = json_patch(old, patch)
            elif content_type == MERGE_PATCH:
                if not isinstance(patch, dict):
                    raise bad_request("a merge patch must be a JSON object")
                self._check_resource_version(rt, old, patch)
                candidate = merge_patch(old, patch)
            elif content_type == STRATEGIC_MERGE_PATCH and not rt.custom:
                if not isinstance(patch, dict):
                    raise bad_request("a strategic merge patch must be a JSON object")
                self._check_resource_version(rt, old, patch)
                candidate = strategic_merge_patch(old, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: {JSON_PATCH}, {MERGE_PATCH}"
                    + ("" if rt.custom else f", {STRATEGIC_MERGE_PATCH}")
                    + f"; got {content_type!r}",
                )
        except PatchError as exc:
            raise ApiError(422, "Invalid", f"the patch cannot be applied: {exc}") from None
        return self._finish_update(rt, key, old, snapshot(candidate), subresource)

    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        mutate: Callable[[dict[str, Any]], None],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        """Read, mutate and write in one step (for controllers); None if the object is gone."""
        key = self._key(rt, namespace, name)
        old = self._objects.get(key)
        if old is None:
            return None
        candidate = snapshot(old)
        mutate(candidate)
        return self._finish_update(rt, key, old, candidate, subresource)

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        propagation: str | None = None,
        preconditions: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """None when the object is gone; the object when finalizers keep it (being deleted)."""
        key, old = self._require(rt, namespace, name)
        meta = old["metadata"]
        for field, value in (preconditions or {}).items():
            if value is not None and str(meta.get(field)) != str(value):
                raise conflict(
                    rt,
                    name,
                    f"Precondition failed: {field} in precondition: {value}, "
                    f"{field} in object meta: {meta.get(field)}",
                )
        propagation = propagation or rt.default_propagation
        if meta.get("finalizers"):
            self._propagation[key] = propagation
            if meta.get("deletionTimestamp"):
                return snapshot(old)
            new = snapshot(old)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            if rt.tracks_generation:
                new["metadata"]["generation"] = int(meta.get("generation") or 0) + 1
            return snapshot(self._commit(rt, key, old, new, "MODIFIED"))
        self._remove(rt, key, old, snapshot(old), propagation)
        return None

    def delete_collection(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: Selector = (),
        fields: Selector = (),
        propagation: str | None = None,
    ) -> list[dict[str, Any]]:
        doomed = list(self._select(rt, namespace, labels, fields))
        for obj in doomed:
            meta = obj["metadata"]
            if self._key(rt, meta.get("namespace"), meta["name"]) in self._objects:
                self.delete(rt, meta.get("namespace"), meta["name"], propagation)
        return [snapshot(o) for o in doomed]

    def _remove(
        self,
        rt: ResourceType,
        key: ObjectKey,
        old: dict[str, Any],
        final: dict[str, Any],
        propagation: str | None = None,
    ) -> None:
        propagation = propagation or self._propagation.get(key) or rt.default_propagation
        self._commit(rt, key, old, final, "DELETED")
        self._collect_garbage(final["metadata"]["uid"], propagation)

    def _collect_garbage(self, owner_uid: str, propagation: str) -> None:
        """After `owner_uid` is gone: with Orphan, its dependents are released (the reference
        removed); otherwise every dependent whose every owner is gone is deleted."""
        if propagation != "Orphan":
            self.collect_dangling()
            return

        def release(obj: dict[str, Any]) -> None:
            obj["metadata"]["ownerReferences"] = [
                r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid
            ]

        for key, dependent in list(self._objects.items()):
            refs = dependent["metadata"].get("ownerReferences") or []
            if key in self._objects and any(r.get("uid") == owner_uid for r in refs):
                self.update(self._kinds[(key[0], key[1])], key[2] or None, key[3], release)

    def collect_dangling(self) -> list[ObjectKey]:
        """Delete every dependent whose every owner is gone, as a real garbage collector does
        (it looks each owner up by uid and finds none): at an owner's deletion, and on every
        pass of the test kubelet for one written after its owner was deleted (a controller's
        write racing the deletion). Returns what it deleted."""
        dangling = [
            key
            for key, obj in self._objects.items()
            if (refs := obj["metadata"].get("ownerReferences"))
            and not obj["metadata"].get("deletionTimestamp")
            and not any(self.exists_uid(r.get("uid", "")) for r in refs)
        ]
        for key in dangling:
            if key in self._objects:  # not gone with an earlier one
                rt = self._kinds[(key[0], key[1])]
                self.delete(rt, key[2] or None, key[3], propagation="Background")
        return dangling

    # ---- watching -------------------------------------------------------------------------

    def watch(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: Selector,
        fields: Selector,
        since: str | None,
    ) -> tuple[list[dict[str, Any]], Watcher]:
        """The events to send first, and the watcher that receives every later one. Without a
        resourceVersion (or "0") the first events are ADDED for what exists now; with one, the
        changes after it (410 Gone if they were forgotten)."""
        watcher = Watcher(rt, namespace, labels, fields)
        if since in (None, "", "0"):
            first = [
                {"type": "ADDED", "object": o} for o in self._select(rt, namespace, labels, fields)
            ]
        else:
            try:
                since_rv = int(str(since))
            except ValueError:
                raise bad_request(f"invalid resourceVersion {since!r}") from None
            if since_rv < self._history_floor:
                raise ApiError(
                    410, "Expired", f"too old resource version: {since_rv} ({self._history_floor})"
                )
            first = [
                event
                for change in self._history
                if change.resource_version > since_rv
                for event in [watcher.event(change)]
                if event is not None
            ]
        self._watchers.add(watcher)
        return first, watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)
