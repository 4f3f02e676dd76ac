"""How Prometheus reaches the engines' and routers' /metrics, as the builders declare it.

`token_sha256`: the SHA-256 of the metrics token (kept in a Secret in the operator's namespace,
kvfence_operator/cluster/metrics_token.py); engines and routers get it as
`--metrics-token-sha256`, and accept that token on /metrics and nowhere else. Only its hash is
in the pods' arguments, so no Secret has to be copied into the workload namespaces (a 256-bit
random token's hash gives nothing away). `scrapers`: NetworkPolicy peers (each a
namespaceSelector and/or podSelector) that the engines' and routers' policies admit to the HTTP
port, where /metrics is served. The platform team chooses both (chart values); none of it is in
the revision hash."""

from dataclasses import dataclass, field
from typing import Any

from kvfence_operator.meta import HTTP_PORT


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    token_sha256: str | None = None
    scrapers: list[dict[str, Any]] = field(default_factory=list, hash=False)

    def args(self) -> list[str]:
        """The engines' and routers' flag, after any extraArgs (so the operator's wins)."""
        return ["--metrics-token-sha256", self.token_sha256] if self.token_sha256 else []

    def ingress(self) -> list[dict[str, Any]]:
        """The scrapers' NetworkPolicy rule, or none."""
        if not self.scrapers:
            return []
        peers = [dict(peer) for peer in self.scrapers]
        return [{"from": peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}]


NO_METRICS_ACCESS = MetricsAccess()
