"""The chart's monitoring objects, rendered offline (helpers/chart.py): the Grafana dashboard's
ConfigMap, the PrometheusRule and the operator's PodMonitor are there only when asked for, and
valid; every PromQL expression of the dashboard and the alerts parses (promql-parser); every
metric it reads is a series that the engine's, the router's or the operator's prometheus-client
registry really exports (read from the registries, not from a list); every label it selects or
groups by is that metric's or one the PodMonitors give every series, and never a tenant's; and
every alert's runbook is a heading of docs/observability.md."""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from helpers.builders import everything_built
from helpers.chart import (
    CHART,
    KUBERNETES_VERSION,
    NAMESPACE,
    ROOT,
    default_values,
    load_helm,
    manifests,
    merged,
    of_kind,
    render,
    schema,
)
from helpers.markdown import github_anchors
from kvfence_engine.contracts import Role
from kvfence_engine.core.metrics import EngineMetrics
from kvfence_engine.router.backends import Backends
from kvfence_engine.router.pool_views import BackendCounters
from kvfence_engine.router.state import RouterState
from kvfence_operator.app.metrics import operator_metrics
from kvfence_operator.meta import LABEL_INSTANCE, LABEL_REVISION, LABEL_ROLE

# The labels prometheus-operator gives every target of a PodMonitor, before its relabelings.
POD_MONITOR_TARGET_LABELS = frozenset(
    {"namespace", "pod", "container", "endpoint", "job", "instance"}
)
# The series a family of each type exposes (`_created` left out: no expression reads it).
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}
# Grafana's own variables, replaced by a value of their kind before parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__interval": "30s", "$__range": "6h"}
DASHBOARD_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ALL_ON = {
    "dashboards": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "metrics": {"podMonitor": {"enabled": True}, "operatorPodMonitor": {"enabled": True}},
}


# ---- what the code exports ------------------------------------------------------------------


def registry_series(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    """Each series name the registry exposes, with its label names: a labelled metric with no
    child yet shows none in its samples, so its declared label names are read from the metric
    (prometheus-client keeps them in `_labelnames` and has no public accessor)."""
    declared = {
        collector._name: frozenset(collector._labelnames)
        for collector in registry._collector_to_names
        if isinstance(collector, MetricWrapperBase)
    }
    series: dict[str, frozenset[str]] = {}
    for family in registry.collect():
        labels = declared.get(family.name) or frozenset(
            label for sample in family.samples for label in sample.labels
        )
        for suffix in SERIES_SUFFIXES[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            series[family.name + suffix] = labels | extra
    return series


def engine_registry() -> CollectorRegistry:
    """An engine's /metrics (serving/app.py): its EngineMetrics, with the per-tenant pages the
    engine registers (core/engine.py) holding one tenant so its label shows."""
    metrics = EngineMetrics()
    metrics.watch_tenants(lambda: {"tenant-a": 1})
    return metrics.registry


def router_registries() -> list[CollectorRegistry]:
    """A router's /metrics (router/app.py): its state's registry, and its backends' counters
    as re-exported from one engine's /metrics."""
    state = RouterState("model", None, Backends.create([], [], None), None, None)
    engine_text = generate_latest(engine_registry()).decode()
    backends = CollectorRegistry(auto_describe=False)
    backends.register(BackendCounters([(Role.DECODE, "http://decode:8000", engine_text)]))
    return [state.metrics.registry, backends]


def exported(*parts: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """Every series of the parts, with the union of the label names each has wherever it is
    exported (engines and routers both export kvfence_requests_rejected_total)."""
    series: dict[str, frozenset[str]] = {}
    for part in parts:
        for name, labels in part.items():
            series[name] = series.get(name, frozenset()) | labels
    return series


# What the engines' PodMonitor scrapes, what the operator's does, and both.
ENGINES_AND_ROUTERS = exported(*map(registry_series, [engine_registry(), *router_registries()]))
OPERATOR = registry_series(operator_metrics().registry)
EXPORTED = exported(ENGINES_AND_ROUTERS, OPERATOR)


# ---- what an expression reads ---------------------------------------------------------------


@dataclass
class Reads:
    metrics: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)  # selected, grouped or matched on
    grouped_by: set[str] = field(default_factory=set)  # in a `by (...)`


def reads(expression: str) -> Reads:
    """The metrics an expression reads and the labels it uses. A ValueError if it does not
    parse."""
    found = Reads()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"{expression}: name the metric, not a __name__ matcher"
            found.metrics.add(node.name)
            matchers = [*node.matchers.matchers, *(m for o in node.matchers.or_matchers for m in o)]
            found.labels |= {m.name for m in matchers}
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            found.labels |= set(node.modifier.labels)
            if node.modifier.type == promql_parser.AggModifierType.By:
                found.grouped_by |= set(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                found.labels |= set(node.modifier.matching.labels)
            found.labels |= set(node.modifier.group_labels or ())

    promql_parser.walk(promql_parser.parse(expression), visit)
    return found


def unknown_metrics(expression: str) -> list[str]:
    """The metrics the expression reads that nothing exports."""
    return sorted(reads(expression).metrics - EXPORTED.keys())


@dataclass(frozen=True)
class ScrapeLabels:
    """What each PodMonitor adds to every series it scrapes."""

    engines: frozenset[str]  # the engines' and routers'
    operator: frozenset[str]  # the operator's


def unknown_labels(expression: str, scrape: ScrapeLabels) -> list[str]:
    """The labels the expression uses that none of its metrics carries, with what the
    PodMonitor that scrapes it adds, and any tenant label (per-tenant series exist, but nothing
    here may select, group or alert by a tenant)."""
    used = reads(expression)
    known: set[str] = set()
    for metric in used.metrics:
        if metric in ENGINES_AND_ROUTERS:
            known |= ENGINES_AND_ROUTERS[metric] | scrape.engines
        if metric in OPERATOR:
            known |= OPERATOR[metric] | scrape.operator
    return sorted((used.labels - known) | (used.labels & {"tenant"}))


# ---- the rendered objects -------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm() -> Any:
    return load_helm()


@pytest.fixture(scope="module")
def all_on(helm: Any) -> list[dict[str, Any]]:
    return manifests(render(helm, ALL_ON))


def dashboard_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (configmap,) = [
        d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")
    ]
    (text,) = configmap["data"].values()
    return json.loads(text)


def rule_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = of_kind(docs, "PrometheusRule")
    return rule


def alerts_of(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_of(docs)["spec"]["groups"] for r in g["rules"]}


def engine_pod_monitor(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (monitor,) = [
        d for d in of_kind(docs, "PodMonitor") if d["metadata"]["name"].endswith("-engines")
    ]
    return monitor


def operator_pod_monitor(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (monitor,) = [m for m in of_kind(docs, "PodMonitor") if m is not engine_pod_monitor(docs)]
    return monitor


def scrape_labels(docs: list[dict[str, Any]]) -> ScrapeLabels:
    """A PodMonitor target's labels, and what each PodMonitor relabels into them."""

    def added_by(monitor: dict[str, Any]) -> frozenset[str]:
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        relabelled = {r["targetLabel"] for r in endpoint.get("relabelings", [])}
        return POD_MONITOR_TARGET_LABELS | relabelled

    return ScrapeLabels(added_by(engine_pod_monitor(docs)), added_by(operator_pod_monitor(docs)))


def dashboard_variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def as_promql(expression: str, variables: Iterable[str]) -> str:
    """A Grafana query as Prometheus gets it: Grafana's interval variables as durations, the
    dashboard's own as the regex `.*`; a variable the dashboard does not define is an error."""
    for variable, value in GRAFANA_VARIABLES.items():
        expression = expression.replace(variable, value)

    def value_of(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"{expression}: ${name} is no variable of the dashboard"
        return ".*"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value_of, expression)


def expressions(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Every PromQL expression the chart ships, by where it is: each dashboard panel's queries,
    each query variable's metric selector, each alert's expression."""
    dashboard = dashboard_of(docs)
    variables = dashboard_variables(dashboard)
    found = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            where = f"dashboard: {panel['title']} ({target['refId']})"
            found[where] = as_promql(target["expr"], variables)
    for name, variable in variables.items():
        if variable["type"] == "query":
            values = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"]["query"])
            assert values, f"variable {name}: {variable['query']}"
            selector, label = values.groups()
            found[f"dashboard: variable {name}"] = as_promql(
                f"count by ({label}) ({selector})", variables
            )
    for alert, rule in alerts_of(docs).items():
        found[f"rule: {alert}"] = rule["expr"]
    return found


def shipped_expressions() -> dict[str, str]:
    return expressions(manifests(render(load_helm(), ALL_ON)))


SHIPPED = shipped_expressions()


# ---- the expressions ------------------------------------------------------------------------


@pytest.mark.parametrize("expression", SHIPPED.values(), ids=SHIPPED.keys())
def test_every_promql_expression_of_the_dashboard_and_the_alerts_parses(expression: str) -> None:
    promql_parser.parse(expression)  # a ValueError naming what is wrong, if it does not


@pytest.mark.parametrize("expression", SHIPPED.values(), ids=SHIPPED.keys())
def test_every_metric_an_expression_reads_is_one_the_code_exports(expression: str) -> None:
    assert reads(expression).metrics, f"reads no metric: {expression}"
    assert not unknown_metrics(expression), (
        f"{unknown_metrics(expression)}: no engine, router or operator registry exports these"
    )


@pytest.mark.parametrize("expression", SHIPPED.values(), ids=SHIPPED.keys())
def test_every_label_an_expression_uses_is_its_metrics_or_the_scrapes_and_none_is_a_tenant(
    expression: str, all_on: list[dict[str, Any]]
) -> None:
    unknown = unknown_labels(expression, scrape_labels(all_on))
    assert not unknown, f"{unknown}: no metric of `{expression}` has these labels"


def test_a_misspelt_metric_or_label_and_a_tenant_label_are_caught(
    all_on: list[dict[str, Any]],
) -> None:
    """The negative control: the checks above fail on a name one letter off, and on a tenant."""
    real = 'sum by (namespace, pod) (increase(kvfence_kv_tag_mismatch_total{name="chat"}[5m]))'
    scrape = scrape_labels(all_on)
    assert not unknown_metrics(real) and not unknown_labels(real, scrape)
    misspelt = real.replace("kvfence_kv_tag_mismatch_total", "kvfence_kv_tag_missmatch_total")
    assert unknown_metrics(misspelt) == ["kvfence_kv_tag_missmatch_total"]
    # a counter read without the `_total` prometheus-client exposes is no series either
    assert unknown_metrics(real.replace("_mismatch_total", "_mismatch")) == [
        "kvfence_kv_tag_mismatch"
    ]
    assert unknown_labels(real.replace("namespace,", "namepsace,"), scrape) == ["namepsace"]
    per_tenant = "sum by (tenant) (rate(kvfence_router_requests_total[5m]))"
    assert unknown_labels(per_tenant, scrape) == ["tenant"]
    # the engines' relabelled labels are not on the operator's series (another PodMonitor)
    operators = "max by (kvfence_role) (kvfence_desired_replicas)"
    assert unknown_labels(operators, scrape) == ["kvfence_role"]


def test_the_dashboard_shows_what_an_operator_of_kvfence_watches() -> None:
    """Latency, throughput, the KV pool, the prefix cache, queues, canary verdicts, isolation
    refusals and autoscaling each have a panel."""
    read = set().union(*(reads(e).metrics for w, e in SHIPPED.items() if w.startswith("dashboard")))
    wanted = {
        "kvfence_time_to_first_token_seconds_bucket",
        "kvfence_inter_token_latency_seconds_bucket",
        "kvfence_generation_tokens_total",
        "kvfence_router_requests_total",
        "kvfence_kv_pages_used",
        "kvfence_kv_pages_total",
        "kvfence_prefix_cache_hit_tokens_total",
        "kvfence_prefix_cache_queried_tokens_total",
        "kvfence_requests_waiting",
        "kvfence_queued_prompt_tokens",
        "kvfence_canary_runs_total",
        "kvfence_kv_tag_mismatch_total",
        "kvfence_kv_unwritten_read_total",
        "kvfence_transfer_checksum_failed_total",
        "kvfence_kv_foreign_tenant_read_total",
        "kvfence_desired_replicas",
        "kvfence_current_replicas",
    }
    assert wanted <= read, f"no panel reads {sorted(wanted - read)}"


# ---- the dashboard --------------------------------------------------------------------------


def test_the_dashboard_reads_its_datasource_variable_and_filters_by_namespace_and_name(
    all_on: list[dict[str, Any]],
) -> None:
    dashboard = dashboard_of(all_on)
    assert dashboard["uid"] == "kvfence"
    variables = dashboard_variables(dashboard)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "name"):
        assert variables[name]["datasource"] == DASHBOARD_DATASOURCE
        assert variables[name]["multi"] and variables[name]["includeAll"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == DASHBOARD_DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DASHBOARD_DATASOURCE, panel["title"]
            # every InferenceDeployment-scoped query follows the variables; the operator's
            # pass durations are the operator's own, across all of them
            if "kvfence_operator_reconcile_pass_seconds" not in target["expr"]:
                assert 'namespace=~"$namespace"' in target["expr"], target["expr"]
                assert 'name=~"$name"' in target["expr"], target["expr"]


# ---- rendering ------------------------------------------------------------------------------


MONITORING_KINDS = {"PrometheusRule", "PodMonitor"}


def test_no_dashboard_rule_or_operator_pod_monitor_unless_enabled(helm: Any) -> None:
    docs = manifests(render(helm))
    assert not of_kind(docs, "ConfigMap") and not of_kind(docs, "PrometheusRule")
    assert not of_kind(docs, "PodMonitor")
    # each is its own value
    docs = manifests(render(helm, {"dashboards": {"enabled": True}}))
    assert len(of_kind(docs, "ConfigMap")) == 1 and not (
        MONITORING_KINDS & {d["kind"] for d in docs}
    )
    docs = manifests(render(helm, {"prometheusRule": {"enabled": True}}))
    assert len(of_kind(docs, "PrometheusRule")) == 1 and not of_kind(docs, "ConfigMap")
    docs = manifests(render(helm, {"metrics": {"operatorPodMonitor": {"enabled": True}}}))
    (monitor,) = of_kind(docs, "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert not of_kind(docs, "PrometheusRule")


def test_every_object_with_everything_on_is_valid_kubernetes(all_on: list[dict[str, Any]]) -> None:
    for doc in all_on:
        if doc["kind"] in MONITORING_KINDS:
            # prometheus-operator's kinds are no built-in schema: their shape is checked below;
            # their metadata is an ObjectMeta like a ConfigMap's, checked as one
            doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "label": "grafana.example/dashboard",
            "labelValue": "kvfence",
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "LLM serving"},
        },
    ],
    ids=["default", "custom"],
)
def test_the_dashboard_is_a_configmap_with_the_sidecars_label_holding_the_charts_file(
    helm: Any, values: dict[str, Any]
) -> None:
    docs = manifests(render(helm, {"dashboards": {"enabled": True, **values}}))
    (configmap,) = of_kind(docs, "ConfigMap")
    kubernetes_validate.validate(configmap, KUBERNETES_VERSION, strict=True)
    label = values.get("label", "grafana_dashboard")
    assert configmap["metadata"]["labels"][label] == values.get("labelValue", "1")
    assert configmap["metadata"]["namespace"] == values.get("namespace", NAMESPACE)
    assert configmap["metadata"].get("annotations") == values.get("annotations")
    # copied as it is: Grafana's {{label}} legends are not Helm's
    file = (CHART / "dashboards" / "kvfence.json").read_text()
    assert configmap["data"] == {"kvfence.json": file.rstrip("\n")}
    assert "{{kvfence_role}}" in file


# The PrometheusRule's shape as prometheus-operator documents monitoring.coreos.com/v1
# (PrometheusRuleSpec, RuleGroup, Rule): no schema of it ships on PyPI, so this is written from
# that reference. A field it does not have, a rule with both or neither of alert and record, a
# duration Prometheus would not read, a label value that is no string: refused.
DURATION = {
    "type": "string",
    "pattern": "^(0|"
    + "".join(rf"(([0-9]+){unit})?" for unit in ("y", "w", "d", "h", "m", "s", "ms"))
    + ")$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object"},  # an ObjectMeta: validated as one above
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "labels": STRING_MAP,
                            "interval": DURATION,
                            "query_offset": DURATION,
                            "limit": {"type": "integer"},
                            "partial_response_strategy": {
                                "type": "string",
                                "pattern": "^([Aa][Bb][Oo][Rr][Tt]|[Ww][Aa][Rr][Nn])?$",
                            },
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string", "minLength": 1},
                                        "record": {"type": "string", "minLength": 1},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": DURATION,
                                        "keep_firing_for": {**DURATION, "minLength": 1},
                                        "labels": STRING_MAP,
                                        "annotations": STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}
ALERTS = {
    "KvfenceCanaryFailed": "critical",
    "KvfenceForeignTenantReadRefused": "critical",
    "KvfenceKvTagMismatch": "critical",
    "KvfenceKvUnwrittenRead": "critical",
    "KvfenceTransferCountMismatch": "critical",
    "KvfenceTransferChecksumFailed": "warning",
    "KvfenceTimeToFirstTokenHigh": "warning",
    "KvfenceIsolationUnverified": "warning",
    "KvfencePoolInsufficient": "warning",
    "KvfenceRolloutStalled": "warning",
}
RULE_VALUES: dict[str, Any] = {
    "enabled": True,
    "labels": {"release": "kube-prometheus-stack"},
    "alertLabels": {"team": "ml-platform"},
    "runbookUrl": "https://docs.example/kvfence/observability.md",
    "timeToFirstToken": {"p90Seconds": 2.5, "for": "15m"},
}


def test_the_prometheus_rule_has_its_documented_shape_and_the_values_labels(helm: Any) -> None:
    rule = rule_of(manifests(render(helm, {"prometheusRule": RULE_VALUES})))
    jsonschema.Draft7Validator(PROMETHEUS_RULE_SCHEMA).validate(rule)
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # the ruleSelector's
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(names) == len(set(names))
    alerts = alerts_of([rule])
    assert {name: a["labels"]["severity"] for name, a in alerts.items()} == ALERTS
    for alert in alerts.values():
        assert alert["labels"]["team"] == "ml-platform"
        assert alert["annotations"].keys() == {"summary", "description", "runbook_url"}
        assert alert["annotations"]["runbook_url"].startswith(RULE_VALUES["runbookUrl"] + "#")
    ttft = alerts["KvfenceTimeToFirstTokenHigh"]
    assert ttft["expr"].endswith("> 2.5") and ttft["for"] == "15m"
    assert "above 2.5 s" in ttft["annotations"]["description"]


def test_the_schema_refuses_a_rule_prometheus_operator_would_not_take(
    all_on: list[dict[str, Any]],
) -> None:
    """The negative control of the shape check."""
    validator = jsonschema.Draft7Validator(PROMETHEUS_RULE_SCHEMA)
    rule = rule_of(all_on)
    validator.validate(rule)
    bad_rules = [
        {"alert": "A", "record": "b", "expr": "up"},  # both
        {"alert": "A", "expr": "up", "for": "ten minutes"},
        {"alert": "A", "expr": "up", "severity": "critical"},  # a label where no field is
        {"alert": "A", "expr": "up", "labels": {"severity": 1}},
    ]
    for bad in bad_rules:
        broken = merged(rule, {"spec": {"groups": [{"name": "g", "rules": [bad]}]}})
        assert list(validator.iter_errors(broken)), bad


def test_every_runbook_is_a_heading_of_the_observability_page(all_on: list[dict[str, Any]]) -> None:
    page = ROOT / "docs" / "observability.md"
    anchors = github_anchors(page.read_text())
    base = default_values()["prometheusRule"]["runbookUrl"]
    assert base.endswith("/docs/observability.md")
    for name, alert in alerts_of(all_on).items():
        url = alert["annotations"]["runbook_url"]
        assert url == f"{base}#{name.lower()}"
        assert name.lower() in anchors, f"docs/observability.md has no heading {name}"


def test_each_alerts_text_names_only_labels_its_expression_keeps(
    all_on: list[dict[str, Any]],
) -> None:
    for name, alert in alerts_of(all_on).items():
        text = " ".join(alert["annotations"].values())
        named = set(re.findall(r"\$labels\.(\w+)", text))
        kept = reads(alert["expr"]).grouped_by - {"le"}
        assert named <= kept, f"{name} names {named - kept}, which its alert does not carry"
        assert kept <= {"namespace", "name", "kind", "kvfence_role", "pod"}, name


# ---- the PodMonitors that feed them ---------------------------------------------------------


def test_the_operators_pod_monitor_scrapes_its_metrics_port_and_keeps_its_namespace_label(
    all_on: list[dict[str, Any]],
) -> None:
    monitor = operator_pod_monitor(all_on)
    (deployment,) = of_kind(all_on, "Deployment")
    pod = deployment["spec"]["template"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert "authorization" not in endpoint  # the operator's metrics need no token
    # the operator's `namespace` is the InferenceDeployment's: without honorLabels Prometheus
    # would rename it exported_namespace and the alerts' `namespace` would be the operator's
    assert endpoint["honorLabels"] is True
    assert "namespace" in OPERATOR["kvfence_desired_replicas"]


def test_the_engines_pod_monitor_labels_series_from_the_labels_the_operator_gives_its_pods(
    all_on: list[dict[str, Any]],
) -> None:
    (endpoint,) = engine_pod_monitor(all_on)["spec"]["podMetricsEndpoints"]
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    pod_label = {"name": LABEL_INSTANCE, "revision": LABEL_REVISION, "kvfence_role": LABEL_ROLE}
    assert relabel == {
        target: ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)]
        for target, key in pod_label.items()
    }
    # no relabelled label may clash with one an engine or router series has of its own
    assert not relabel.keys() & set().union(*ENGINES_AND_ROUTERS.values())
    pods = [
        b["spec"]["template"]["metadata"]["labels"]
        for b in everything_built("full")
        if b["kind"] == "Deployment"
    ]
    assert pods
    for labels in pods:
        assert set(pod_label.values()) <= labels.keys()
        assert labels[LABEL_INSTANCE] == "full"  # `name` is the InferenceDeployment's name


# ---- values ---------------------------------------------------------------------------------


BAD_VALUES: dict[str, dict[str, Any]] = {
    "a label value that is no string": {"dashboards": {"labelValue": 1}},
    "a label key with a space": {"dashboards": {"label": "grafana dashboard"}},
    "a dashboard namespace that is no DNS label": {"dashboards": {"namespace": "Monitoring"}},
    "an unknown dashboards key": {"dashboards": {"folder": "kvfence"}},
    "a zero threshold": {"prometheusRule": {"timeToFirstToken": {"p90Seconds": 0}}},
    "a for that is no duration": {"prometheusRule": {"timeToFirstToken": {"for": "ten minutes"}}},
    "an alert label over severity": {"prometheusRule": {"alertLabels": {"severity": "page"}}},
    "an alert label that is no label name": {"prometheusRule": {"alertLabels": {"team-name": "x"}}},
    "a runbook URL with its own anchor": {"prometheusRule": {"runbookUrl": "https://x/a.md#b"}},
    "an unknown prometheusRule key": {"prometheusRule": {"threshold": 5}},
    "an operator scrape interval that is no duration": {
        "metrics": {"operatorPodMonitor": {"interval": "often"}}
    },
}


def test_the_monitoring_values_satisfy_the_schema() -> None:
    values = merged(default_values(), ALL_ON)
    values = merged(values, {"prometheusRule": RULE_VALUES})
    jsonschema.Draft7Validator(schema()).validate(values)


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_the_schema_and_the_render_refuse_bad_monitoring_values(
    helm: Any, bad: dict[str, Any]
) -> None:
    errors = list(jsonschema.Draft7Validator(schema()).iter_errors(merged(default_values(), bad)))
    assert errors, f"values.schema.json accepts {bad}"
    with pytest.raises(helm.HelmValuesError):
        render(helm, bad)


def test_lint_passes_with_every_monitoring_object_on(helm: Any) -> None:
    report = helm.lint(CHART, ALL_ON, strict=True, kube_version="v1.30.0", namespace=NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
