"""API discovery as kubectl reads it: `/version`, `/api`, `/apis`, `/apis/<group>` and the
per-version resource lists (legacy discovery; kubectl asks for the aggregated kind first and
falls back when it gets an APIGroupList).

The resources are kmock's (its bundled list plus the CRDs registered on the server); only the
documents are built here, because kmock 0.8's have gaps kubectl trips on: the core list's
`groupVersion` is "/v1" (so no core kind resolves), subresources repeat their parent's short
names and verbs (so `kubectl get ns` is ambiguous), and a group's preferred version is an
arbitrary one of its versions.
"""

import re
from collections.abc import Iterable
from typing import Any

import kmock

SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-kvfence-devcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
# What each subresource the server serves can do, as a kube-apiserver lists them.
SUBRESOURCE_VERBS = {"status": ["get", "patch", "update"], "log": ["get"]}
_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")

Entry = tuple[kmock.resource, kmock.ResourceInfo, Iterable[str]]  # resource, info, served subs


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes' ordering, highest first when sorted: GA > beta > alpha, then by number;
    versions that do not look like Kubernetes versions last, alphabetically."""
    match = _VERSION.match(version)
    if not match:
        return (3, 0, 0, version)
    major, level, minor = match.groups()
    stability = {None: 0, "beta": 1, "alpha": 2}[level]
    return (stability, -int(major), -int(minor or 0), version)


def _group_versions(entries: Iterable[Entry]) -> dict[str, list[str]]:
    groups: dict[str, set[str]] = {}
    for resource, _, _ in entries:
        if resource.group and resource.version:
            groups.setdefault(resource.group, set()).add(resource.version)
    return {group: sorted(versions, key=version_priority) for group, versions in groups.items()}


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": listed, "preferredVersion": listed[0]}


def api_versions() -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "apiVersion": "v1",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
    }


def group_list(entries: Iterable[Entry]) -> dict[str, Any]:
    groups = _group_versions(entries)
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(name, groups[name]) for name in sorted(groups)],
    }


def group(entries: Iterable[Entry], name: str) -> dict[str, Any] | None:
    versions = _group_versions(entries).get(name)
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, versions)}


def resource_list(entries: Iterable[Entry], group: str, version: str) -> dict[str, Any] | None:
    resources: list[dict[str, Any]] = []
    for resource, info, served in sorted(entries, key=lambda e: e[0].plural or ""):
        if (resource.group or "", resource.version) != (group, version) or not resource.plural:
            continue
        kind = info.kind or resource.plural.capitalize()
        resources.append(
            {
                "name": resource.plural,
                "singularName": info.singular or kind.lower(),
                "namespaced": bool(info.namespaced),
                "kind": kind,
                "verbs": sorted(info.verbs),
                **({"shortNames": sorted(info.shortnames)} if info.shortnames else {}),
                **({"categories": sorted(info.categories)} if info.categories else {}),
            }
        )
        for sub in sorted(served):
            resources.append(
                {
                    "name": f"{resource.plural}/{sub}",
                    "singularName": "",
                    "namespaced": bool(info.namespaced),
                    "kind": kind,
                    "verbs": SUBRESOURCE_VERBS[sub],
                }
            )
    if not resources:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }
