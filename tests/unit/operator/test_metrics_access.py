"""Prometheus reaches engine and router metrics: the scrapers the platform team names are
admitted to the HTTP port (where /metrics is) of every engine and router, and the pods accept
the metrics token by its SHA-256, a flag that comes after extraArgs. Without settings, no rule
and no flag."""

import hashlib

from helpers.builders import CREDENTIALS, OPERATOR_NAMESPACE, container, instance_for, sample_spec
from kvfence_operator.builders import build_revision_children
from kvfence_operator.builders.metrics import MetricsAccess
from kvfence_operator.crd.types import Role
from kvfence_operator.meta import HTTP_PORT, TRANSFER_PORT
from kvfence_operator.revision import revision_of

SCRAPERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    },
    {"podSelector": {"matchLabels": {"app": "vmagent"}}},
]
DIGEST = hashlib.sha256(b"the metrics token").hexdigest()
ACCESS = MetricsAccess(token_sha256=DIGEST, scrapers=SCRAPERS)


def children(metrics: MetricsAccess, serving: bool = False) -> dict[tuple[str, str], dict]:
    spec, instance = sample_spec("full"), instance_for("full")
    built = build_revision_children(
        spec,
        instance,
        revision_of(spec),
        CREDENTIALS,
        OPERATOR_NAMESPACE,
        serving=serving,
        metrics=metrics,
    )
    return {(c["kind"], c["metadata"]["labels"].get("kvfence.dev/role", "")): c for c in built}


def scraper_ports(policy: dict) -> list[list[dict]]:
    return [r["ports"] for r in policy["spec"]["ingress"] if r.get("from") == SCRAPERS]


def test_the_scrapers_reach_the_http_port_of_every_engine_and_router_and_nothing_else():
    for serving in (False, True):
        built = children(ACCESS, serving)
        for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
            ports = scraper_ports(built[("NetworkPolicy", str(role))])
            assert ports == [[{"protocol": "TCP", "port": HTTP_PORT}]], (role, serving)
        decode = built[("NetworkPolicy", str(Role.DECODE))]["spec"]["ingress"]
        transfer = [r for r in decode if {"protocol": "TCP", "port": TRANSFER_PORT} in r["ports"]]
        assert all(peer not in r["from"] for r in transfer for peer in SCRAPERS)


def test_engines_and_routers_accept_the_metrics_token_by_its_digest_after_extra_args():
    built = children(ACCESS)
    for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
        args = container(built[("Deployment", str(role))])["args"]
        assert args.count("--metrics-token-sha256") == 1, role
        at = args.index("--metrics-token-sha256")
        assert args[at + 1] == DIGEST
        assert at > args.index("--internal-token-file"), "after extraArgs, like every spec flag"
        assert "the metrics token" not in str(built[("Deployment", str(role))])


def test_without_metrics_settings_no_scraper_rule_and_no_flag():
    built = children(MetricsAccess())
    for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
        assert not scraper_ports(built[("NetworkPolicy", str(role))])
        assert "--metrics-token-sha256" not in container(built[("Deployment", str(role))])["args"]
