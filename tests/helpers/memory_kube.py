"""An in-memory API server for unit tests that run the real reconcile code: just the verbs of
kvfence_operator.cluster.kube.Kube, on plain dicts.

Objects are kept by (kind, name) in one namespace; create answers False on a taken name (the
API's 409) and gives the object a UID (`u-<name>`); patches are JSON merge patches, applied as
the API server applies them (to the status too, for a status subresource patch); every write
is recorded as (verb, kind, name), so a test can say what a pass wrote, every read as
(kind, name), and every request, reads and refused creates too, in `requests`, so a test can
count what a pass costs. A dry-run create answers like a create and stores nothing."""

import copy
import json
from collections.abc import Mapping
from typing import Any

from kvfence_devcluster.patching import merge_patch


class MemoryKube:
    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.writes: list[tuple[str, str, str]] = []
        self.reads: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str, str]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        self.reads.append((kind, name))
        self.requests.append(("get", kind, name))
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> Any:
        self.requests.append(("list", kind, ""))
        return [
            copy.deepcopy(o)
            for (k, _), o in self.objects.items()
            if k == kind and labels.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool:
        if dry_run:
            key = (obj["kind"], obj["metadata"]["name"])
            self.requests.append(("create", *key))
            return key not in self.objects
        return self.create_object(obj) is not None

    def create_object(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.requests.append(("create", *key))
        if key in self.objects:
            return None
        self.writes.append(("create", *key))
        self.objects[key] = {
            **copy.deepcopy(obj),
            "metadata": {**obj["metadata"], "uid": f"u-{key[1]}"},
        }
        return copy.deepcopy(self.objects[key])

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Any,
        subresource: str = "",
    ) -> Any:
        self.requests.append(("patch", kind, name))
        self.writes.append(("patch", kind, name))
        key = (kind, name)
        if key in self.objects:
            self.objects[key] = merge_patch(self.objects[key], json.loads(json.dumps(patch)))
        return copy.deepcopy(self.objects.get(key))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.requests.append(("delete", kind, name))
        self.writes.append(("delete", kind, name))
        self.objects.pop((kind, name), None)
