"""Every request the test API server answers, counted as a kube-apiserver's audit log or its
`apiserver_request_total` metric would: by verb, resource and user agent. A watch counts once,
when it is opened, however long it streams.

Verbs are Kubernetes' (RequestInfo): get, list, watch, create, update (PUT), patch, delete,
deletecollection. A resource is `plural[.group][/subresource]` (`pods`, `deployments.apps`,
`inferencedeployments.kvfence.dev/status`); a request for no resource (discovery, OpenAPI,
`/version`) counts under its path with the HTTP method as its verb. The user agent is the
first word of the User-Agent header (`kopf/1.37.2`, `kubectl/v1.32.0`), "" without one.

The kubelet, controllers and proxy of the test cluster read and write the store directly, not
over HTTP, so none of their work is counted: what is counted is what clients ask.
"""

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kmock._internal import parsing


class RequestKey(NamedTuple):
    verb: str
    resource: str
    user_agent: str


@dataclass(frozen=True)
class RequestCounts:
    """A snapshot: how many requests of each (verb, resource, user agent)."""

    counts: Mapping[RequestKey, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by(self, *fields: str) -> dict[tuple[str, ...], int]:
        """Totals grouped by some of verb, resource, user_agent (in that order of the key)."""
        grouped: Counter[tuple[str, ...]] = Counter()
        for key, count in self.counts.items():
            grouped[tuple(getattr(key, f) for f in fields)] += count
        return dict(grouped)

    def only(self, user_agents: Iterable[str]) -> "RequestCounts":
        """The requests of clients whose user agent starts with one of `user_agents`."""
        prefixes = tuple(user_agents)
        return RequestCounts(
            {k: n for k, n in self.counts.items() if k.user_agent.startswith(prefixes)}
        )

    def __sub__(self, earlier: "RequestCounts") -> "RequestCounts":
        """What was counted between two snapshots."""
        diff = Counter(self.counts)
        diff.subtract(earlier.counts)
        return RequestCounts({k: n for k, n in diff.items() if n > 0})


def classify(
    method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]
) -> RequestKey:
    agent = (headers.get("User-Agent") or "").split(" ")[0]
    parsed = parsing.parse_path(path)
    method = method.upper()
    if parsed is None or parsed.group is None or not parsed.plural or parsed.version is None:
        return RequestKey(method.lower(), path, agent)
    resource = parsed.plural + (f".{parsed.group}" if parsed.group else "")
    if parsed.subresource:
        resource += f"/{parsed.subresource}"
    named = parsed.name is not None
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else "get" if named else "list"
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return RequestKey(verb, resource, agent)


class RequestCounter:
    """Counted on the API server's loop, read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[RequestKey] = Counter()

    def count(self, key: RequestKey) -> None:
        with self._lock:
            self._counts[key] += 1

    def snapshot(self, reset: bool = False) -> RequestCounts:
        with self._lock:
            taken = RequestCounts(dict(self._counts))
            if reset:
                self._counts.clear()
        return taken
