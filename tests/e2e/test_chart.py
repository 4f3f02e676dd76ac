"""The Helm chart in charts/kvfence, rendered offline with helm-python-sdk (Helm's Go SDK, no
helm binary) and checked the way an API server would: every manifest validates strictly
against Kubernetes 1.30, values.schema.json refuses bad values, the operator runs as two
leader-elected replicas (or once, without leader election), locked down, with the arguments
`kvfence operator` accepts, and its RBAC grants exactly what the operator does — nothing more,
and no Secret listing."""

import copy
import re
import tomllib
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.builders import everything_built
from helpers.chart import (
    CHART,
    KUBERNETES_VERSION,
    NAMESPACE,
    RELEASE,
    ROOT,
    default_values,
    load_helm,
    manifests,
    merged,
    of_kind,
    render,
    schema,
)
from kvfence_cli.main import build_parser
from kvfence_engine.contracts import PoolGateReport
from kvfence_operator.app.handlers import OPERATOR_NAMESPACE_ENV
from kvfence_operator.builders.pod_template import RUN_AS_ID
from kvfence_operator.cluster.cache import WATCHED, CachedKube, Store
from kvfence_operator.cluster.leader import POD_NAME_ENV
from kvfence_operator.cluster.metrics_token import (
    SCRAPERS_ENV,
    TOKEN_KEY,
    TOKEN_SECRET_ENV,
    metrics_access,
    scrapers_from,
)
from kvfence_operator.cluster.own_secrets import CREDENTIALS_KEY_SECRET_ENV, credentials_key
from kvfence_operator.crd.schema import render_crd_yaml
from kvfence_operator.crd.types import API_GROUP, API_VERSION, KIND, PLURAL, InferenceDeployment
from kvfence_operator.decisions.pool_gate import PodPool
from kvfence_operator.meta import OPERATOR_POD_LABELS
from kvfence_operator.reconcile.reconciler import Reconciler
from kvfence_operator.revision import revision_of

CUSTOM_VALUES: dict[str, Any] = {
    "watchNamespaces": ["team-a", "team-b"],
    "image": {"repository": "registry.example/ml/kvfence-operator", "tag": "0.1.0-rc1"},
    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    "verbose": True,
    # A user label may not take over the one the engines' NetworkPolicies admit.
    "podLabels": {"app.kubernetes.io/name": "not-the-operator", "team": "ml-platform"},
    "imagePullSecrets": [{"name": "registry-creds"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
}

# One operator, no leader election: the chart before two replicas, one value away.
STANDALONE_VALUES: dict[str, Any] = {"replicaCount": 1, "leaderElection": {"enabled": False}}

BAD_VALUES: dict[str, dict[str, Any]] = {
    "unknown pullPolicy": {"image": {"pullPolicy": "Sometimes"}},
    "two replicas without leader election": {
        "replicaCount": 2,
        "leaderElection": {"enabled": False},
    },
    "no replica": {"replicaCount": 0},
    "unknown leaderElection key": {"leaderElection": {"leaseDuration": 30}},
    "lease name that is no DNS name": {"leaderElection": {"leaseName": "Leader_Lease"}},
    "unknown top-level key": {"watchNamespace": ["typo"]},
    "unknown image key": {"image": {"digest": "sha256:0"}},
    "empty image repository": {"image": {"repository": ""}},
    "tag with a space": {"image": {"tag": "latest please"}},
    "namespace that is no DNS label": {"watchNamespaces": ["Team_A"]},
    "namespace twice": {"watchNamespaces": ["a", "a"]},
    "resources that are no quantity": {"resources": {"requests": {"cpu": "lots"}}},
    "existing ServiceAccount without a name": {"serviceAccount": {"create": False}},
    "verbose as a string": {"verbose": "yes"},
    "a PodMonitor without a metrics token": {
        "metrics": {"tokenSecret": "", "podMonitor": {"enabled": True}}
    },
    "a scraper without a selector": {"metrics": {"scrapers": [{}]}},
    "a scraper that is no NetworkPolicy peer": {"metrics": {"scrapers": [{"ipBlock": {}}]}},
    "a scrapers selector that is no label selector": {
        "metrics": {"scrapers": [{"podSelector": {"app": "prometheus"}}]}
    },
    "a scrape interval that is no duration": {"metrics": {"podMonitor": {"interval": "often"}}},
}


# ---- helm-python-sdk ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm() -> Any:
    """The renderer (the schema and CRD checks below do not need it and still run without)."""
    return load_helm()


def operator_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = of_kind(docs, "Deployment")
    return deployment


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = operator_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def default_docs(helm: Any) -> list[dict[str, Any]]:
    return manifests(render(helm))


@pytest.fixture(scope="module")
def custom_docs(helm: Any) -> list[dict[str, Any]]:
    return manifests(render(helm, CUSTOM_VALUES))


# ---- without the renderer: CRD copy and values schema -------------------------------------


def test_chart_crd_is_byte_identical_to_the_generated_crd() -> None:
    chart_crd = (CHART / "crds" / "inferencedeployment.yaml").read_bytes()
    assert chart_crd == (ROOT / "crds" / "inferencedeployment.yaml").read_bytes(), (
        "charts/kvfence/crds/ is stale: cp crds/inferencedeployment.yaml charts/kvfence/crds/"
    )
    assert chart_crd.decode() == render_crd_yaml()


def test_chart_crd_is_a_valid_kubernetes_object() -> None:
    crd = yaml.safe_load((CHART / "crds" / "inferencedeployment.yaml").read_text())
    kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


def test_default_and_custom_values_satisfy_the_schema() -> None:
    validator = jsonschema.Draft7Validator(schema())
    validator.check_schema(schema())
    validator.validate(default_values())
    validator.validate(merged(default_values(), CUSTOM_VALUES))


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_refuses_bad_values(bad: dict[str, Any]) -> None:
    errors = list(jsonschema.Draft7Validator(schema()).iter_errors(merged(default_values(), bad)))
    assert errors, f"values.schema.json accepts {bad}"


def test_chart_app_version_is_the_package_version() -> None:
    """The image tag defaults to appVersion: it must name the release the chart ships with."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]


# ---- rendered ------------------------------------------------------------------------------


def election(doc: dict[str, Any]) -> bool:
    """The leader election's Role or RoleBinding (leader-election.yaml)."""
    return str(doc["metadata"]["name"]).endswith("-election")


def test_default_render_is_valid_kubernetes_and_watches_every_namespace(
    default_docs: list[dict[str, Any]],
) -> None:
    assert sorted(d["kind"] for d in default_docs) == [
        "ClusterRole",
        "ClusterRole",  # the users' view role (aggregated)
        "ClusterRole",  # the users' edit role (aggregated)
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Role",  # the leader Lease's
        "Role",  # the operator's own Secrets', in the release namespace (own-secrets.yaml)
        "RoleBinding",
        "RoleBinding",
        "ServiceAccount",
    ]
    for doc in default_docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    args = operator_container(default_docs)["args"]
    assert "--all-namespaces" in args and "--namespace" not in args


def test_custom_render_is_valid_kubernetes_with_a_role_per_watched_namespace(
    custom_docs: list[dict[str, Any]],
) -> None:
    for doc in custom_docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # Nothing cluster-wide for the operator: the only ClusterRoles are the users' aggregated
    # ones, bound to nobody by the chart.
    assert not of_kind(custom_docs, "ClusterRoleBinding")
    assert all(aggregated_to(r) for r in of_kind(custom_docs, "ClusterRole"))
    # Each watched namespace's Role, beside the leader Lease's and the operator's own Secrets'
    # in the release namespace.
    roles, bindings = [
        [d for d in of_kind(custom_docs, kind) if not election(d)]
        for kind in ("Role", "RoleBinding")
    ]
    (metrics_role,) = [r for r in roles if r["metadata"]["namespace"] == NAMESPACE]
    assert metrics_role == own_secrets_role(custom_docs)  # its own test: below
    roles = [r for r in roles if r is not metrics_role]
    bindings = [b for b in bindings if b["roleRef"]["name"] != metrics_role["metadata"]["name"]]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (account,) = of_kind(custom_docs, "ServiceAccount")
    for binding in bindings:
        assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]
    container = operator_container(custom_docs)
    assert container["image"] == "registry.example/ml/kvfence-operator:0.1.0-rc1"
    assert container["resources"] == CUSTOM_VALUES["resources"]
    args = container["args"]
    assert args[args.index("--namespace") :].count("--namespace") == 2
    assert "--all-namespaces" not in args and "--verbose" in args


def test_default_image_is_the_operator_image_at_the_charts_app_version(
    default_docs: list[dict[str, Any]],
) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    container = operator_container(default_docs)
    assert container["image"] == f"ghcr.io/kvfence/kvfence-operator:{app_version}"
    assert container["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize(
    "values", [None, CUSTOM_VALUES, STANDALONE_VALUES], ids=["default", "custom", "standalone"]
)
def test_operator_runs_with_arguments_kvfence_operator_accepts(
    helm: Any, values: dict[str, Any] | None
) -> None:
    docs = manifests(render(helm, values))
    deployment = operator_deployment(docs)
    leader_elect = values is not STANDALONE_VALUES
    if leader_elect:  # two by default, rolled one at a time: a standby takes the Lease over
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
    else:  # one writer, never two, not even during an upgrade
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(docs)
    assert container["command"] == ["kvfence"]
    parsed = build_parser().parse_args(container["args"])
    assert parsed.command == "operator"
    assert parsed.leader_elect == leader_elect and parsed.standalone == (not leader_elect)
    assert parsed.namespace == ((values or {}).get("watchNamespaces") or [])
    assert parsed.all_namespaces == (not parsed.namespace)
    # The kubelet probes the endpoint kopf serves.
    liveness = urlsplit(parsed.liveness)
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert (liveness.hostname, liveness.port, liveness.path) == (
        "0.0.0.0",
        port["containerPort"],
        probe["path"],
    )
    # The operator's own metrics are served on the port named "metrics".
    metrics = urlsplit(parsed.metrics)
    (metrics_port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert (metrics.hostname, metrics.port, metrics.path) == (
        "0.0.0.0",
        metrics_port["containerPort"],
        "/metrics",
    )


def test_replicas_elect_a_leader_on_a_lease_in_their_own_namespace_and_spread_across_nodes(
    default_docs: list[dict[str, Any]],
) -> None:
    deployment = operator_deployment(default_docs)
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(default_docs)
    parsed = build_parser().parse_args(container["args"])
    assert parsed.leader_elect_lease == deployment["metadata"]["name"]
    assert parsed.leader_elect_namespace is None  # $OPERATOR_NAMESPACE: the release's
    (pod_name,) = [e for e in container["env"] if e["name"] == POD_NAME_ENV]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    # The Lease verbs LeaseLock uses (read, create, replace), in the release namespace only.
    (role,) = [r for r in of_kind(default_docs, "Role") if election(r)]
    (binding,) = [b for b in of_kind(default_docs, "RoleBinding") if election(b)]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (account,) = of_kind(default_docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert not any(
        "leases" in rule["resources"]
        for cluster_role in of_kind(default_docs, "ClusterRole")
        for rule in cluster_role["rules"]
    )

    (budget,) = of_kind(default_docs, "PodDisruptionBudget")
    assert budget["metadata"]["namespace"] == NAMESPACE
    assert budget["spec"] == {
        "minAvailable": 1,
        "selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
    }
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
    }


@pytest.mark.parametrize(
    "values",
    [
        STANDALONE_VALUES,
        {"podDisruptionBudget": {"enabled": False}, "spreadAcrossNodes": False},
        {"replicaCount": 1},
    ],
    ids=["leader election off", "budget and spread off", "one replica"],
)
def test_leader_election_budget_and_spread_are_values_away(
    helm: Any, values: dict[str, Any]
) -> None:
    docs = manifests(render(helm, values))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    pod = operator_deployment(docs)["spec"]["template"]["spec"]
    # No budget and no spread for a lone replica (a budget of 1 would block its node's drains).
    assert not of_kind(docs, "PodDisruptionBudget") and "affinity" not in pod
    leader_elect = values is not STANDALONE_VALUES
    assert any(election(r) for r in of_kind(docs, "Role")) == leader_elect
    assert any(election(b) for b in of_kind(docs, "RoleBinding")) == leader_elect


def test_an_affinity_of_the_users_replaces_the_spread(helm: Any) -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ops"]}]}
                ]
            }
        }
    }
    docs = manifests(render(helm, {"affinity": affinity}))
    assert operator_deployment(docs)["spec"]["template"]["spec"]["affinity"] == affinity


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_operator_pods_carry_the_label_engine_network_policies_admit(
    helm: Any, values: dict[str, Any] | None
) -> None:
    deployment = operator_deployment(manifests(render(helm, values)))
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = operator_container(manifests(render(helm, values)))
    (namespace_env,) = [e for e in container["env"] if e["name"] == OPERATOR_NAMESPACE_ENV]
    assert namespace_env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_operator_pod_is_locked_down(default_docs: list[dict[str, Any]]) -> None:
    pod = operator_deployment(default_docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == RUN_AS_ID != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in context and "hostNetwork" not in pod
    # The only writable path is an emptyDir at /tmp.
    (mount,) = container["volumeMounts"]
    (volume,) = pod["volumes"]
    assert mount == {"name": volume["name"], "mountPath": "/tmp"} and "emptyDir" in volume
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_notes_say_how_to_apply_an_example_and_watch_it(helm: Any) -> None:
    notes = render(helm)[f"{RELEASE}/templates/NOTES.txt"]
    assert "kubectl get infd" in notes
    example = re.search(r"kubectl apply -f (examples/\S+)", notes)
    assert example, notes
    documents = list(yaml.safe_load_all((ROOT / example.group(1)).read_text()))
    (infd,) = [d for d in documents if d["kind"] == "InferenceDeployment"]
    assert f"kubectl wait --for=condition=Ready infd/{infd['metadata']['name']} " in notes


def test_chart_carries_the_crd(helm: Any) -> None:
    with helm.Chart.load(CHART) as chart:
        (crd,) = chart.crds
    assert crd["data"] == (ROOT / "crds" / "inferencedeployment.yaml").read_text()


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_lint_passes(helm: Any, values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0", namespace=NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_render_and_lint_refuse_bad_values(helm: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(helm, bad)
    assert helm.lint(CHART, bad)["errors"], f"lint accepts {bad}"


# ---- RBAC -----------------------------------------------------------------------------------

FRAMEWORK_RULES = [
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
APPLICATION_RULES = [
    {"apiGroups": [API_GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": [""],
        "resources": ["services", "configmaps"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
]


def commented_rules(rendered_role: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the comment above the rule, the rule) for each rule of one rendered Role."""
    doc = yaml.safe_load(rendered_role)
    comments: list[str] = []
    blocks: list[str] = []
    in_rules = False
    for line in rendered_role.splitlines():
        stripped = line.strip()
        if line.startswith("rules:"):
            in_rules = True
        elif in_rules and stripped.startswith("#"):
            comments.append(stripped)
        elif in_rules and stripped.startswith("- apiGroups:"):
            blocks.append(" ".join(comments))
            comments = []
    assert len(blocks) == len(doc["rules"]), "one comment block per rule"
    yield from zip(blocks, doc["rules"], strict=True)


def role_texts(helm: Any, values: dict[str, Any] | None) -> list[str]:
    rbac = render(helm, values)[f"{RELEASE}/templates/rbac.yaml"]
    return [t for t in rbac.split("\n---\n") if re.search(r"^kind: (Cluster)?Role$", t, re.M)]


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_every_rule_is_commented_framework_or_application_and_grants_exactly_that(
    helm: Any, values: dict[str, Any] | None
) -> None:
    texts = role_texts(helm, values)
    assert len(texts) == (1 if values is None else len(values["watchNamespaces"]))
    for text in texts:
        framework: list[dict[str, Any]] = []
        application: list[dict[str, Any]] = []
        for comment, rule in commented_rules(text):
            assert re.match(r"# (framework|application): \S", comment), comment
            (framework if comment.startswith("# framework") else application).append(rule)
        assert framework == FRAMEWORK_RULES
        assert application == APPLICATION_RULES


# framework: what kopf needs; application: what kvfence's handlers do; users: what the
# aggregated view/edit roles give people.
RULE_COMMENT = r"# (framework|application|users):"


def test_every_rule_in_the_template_source_has_a_comment() -> None:
    for path in sorted((CHART / "templates").iterdir()):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.lstrip().startswith("- apiGroups:"):
                above = lines[number - 1].strip()
                while above.startswith("#") and not re.match(RULE_COMMENT, above):
                    number -= 1
                    above = lines[number - 1].strip()
                assert re.match(RULE_COMMENT + r" \S", above), (
                    f"{path.name}:{number + 1}: rule without a framework/application/users comment"
                )


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_rbac_grants_no_wildcards_no_secret_listing_and_no_privilege_verbs(
    helm: Any, values: dict[str, Any] | None
) -> None:
    roles = [d for d in manifests(render(helm, values)) if d["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert "nonResourceURLs" not in rule, rule
            if "resourceNames" in rule:  # only to narrow: the one Secret the operator reads
                assert rule == OWN_SECRETS_GET, rule
            if "secrets" in rule["resources"]:
                assert not {"list", "watch"} & set(rule["verbs"]), rule


# ---- RBAC against what the operator really does --------------------------------------------


class RecordingKube:
    """An in-memory API server for the Reconciler that records every call it makes as
    (verb, apiVersion, kind, subresource); enough kubelet/controller play to roll out."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.calls: set[tuple[str, str, str, str]] = set()
        self.store: Store | None = None

    def watch_into(self, store: Store, namespace: str) -> None:
        """The operator's informers (cache.py): a LIST, then a WATCH, of each cached kind."""
        for api_version, kind in WATCHED:
            self.calls.add(("list", api_version, kind, ""))
            self.calls.add(("watch", api_version, kind, ""))
            store.replace(kind, namespace, self.list(api_version, kind, namespace, {}))
        self.store = store

    def send_watch_events(self) -> None:
        for obj in self.objects.values():
            if self.store is not None and obj["kind"] in dict((k, v) for v, k in WATCHED):
                self.store.apply("MODIFIED", obj)

    def admit_owner_references(self, references: list[Mapping[str, Any]]) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin (on by default on
        OpenShift): an ownerReference with blockOwnerDeletion may be set only by whom may
        update the owner's finalizers subresource. Recorded as the call that permission
        allows. (The emulated cluster checks no identity, so the check lives here.)"""
        for reference in references:
            if reference.get("blockOwnerDeletion"):
                self.calls.add(("update", reference["apiVersion"], reference["kind"], "finalizers"))

    @staticmethod
    def key(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
        meta = obj["metadata"]
        return (obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        self.calls.add(("get", api_version, kind, ""))
        return copy.deepcopy(self.objects.get((api_version, kind, namespace, name)))

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> Any:
        self.calls.add(("list", api_version, kind, ""))
        return [
            copy.deepcopy(obj)
            for (v, k, ns, _), obj in self.objects.items()
            if (v, k, ns) == (api_version, kind, namespace)
            and labels.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def create(self, obj: Mapping[str, Any], dry_run: bool = False) -> bool:
        if dry_run:
            self.calls.add(("create", obj["apiVersion"], obj["kind"], ""))
            return self.key(obj) not in self.objects
        return self.create_object(obj) is not None

    def create_object(self, obj: Mapping[str, Any]) -> Any:
        self.calls.add(("create", obj["apiVersion"], obj["kind"], ""))
        self.admit_owner_references(obj["metadata"].get("ownerReferences") or [])
        if self.key(obj) in self.objects:
            return None
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["uid"] = f"uid-{len(self.objects)}-{obj['metadata']['name']}"
        self.objects[self.key(obj)] = stored
        return copy.deepcopy(stored)

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str = "",
    ) -> Any:
        self.calls.add(("patch", api_version, kind, subresource))
        self.admit_owner_references((patch.get("metadata") or {}).get("ownerReferences") or [])
        key = (api_version, kind, namespace, name)
        self.objects[key] = merged(self.objects[key], patch)
        return copy.deepcopy(self.objects[key])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.add(("delete", api_version, kind, ""))
        self.objects.pop((api_version, kind, namespace, name), None)

    def edit_children(self) -> set[str]:
        """Edits one declared field of each kept child, as another hand would; the kinds."""
        edits = {
            "PodDisruptionBudget": lambda o: o["spec"].update(maxUnavailable=3),
            "NetworkPolicy": lambda o: o["spec"].update(ingress=[]),
            "Deployment": lambda o: o["spec"]["template"]["spec"]["containers"][0].update(
                image="registry.example/someone-else:latest"
            ),
            "Service": lambda o: o["spec"]["ports"][0].update(port=1),
            "ConfigMap": lambda o: o.update(data={"edited": "by hand"}),
        }
        kinds = set()
        for obj in self.objects.values():
            if obj["kind"] in edits and obj["metadata"].get("ownerReferences"):
                edits[obj["kind"]](obj)
                kinds.add(obj["kind"])
        assert kinds == set(edits), f"a rollout made no {set(edits) - kinds}"
        return kinds

    def play_controllers(self) -> None:
        """Deployments get a ReplicaSet and ready pods (with an IP and the template's ports),
        owned as on a real cluster (pod -> ReplicaSet -> Deployment); Jobs complete."""
        for (_, kind, namespace, name), obj in list(self.objects.items()):
            if kind == "Deployment":
                template = obj["spec"]["template"]
                replicaset = {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "metadata": {
                        "name": f"{name}-5d8f9",
                        "namespace": namespace,
                        "labels": template["metadata"]["labels"],
                        "uid": f"rs-{obj['metadata']['uid']}",
                        "ownerReferences": [controller_ref(obj)],
                    },
                }
                self.objects.setdefault(self.key(replicaset), replicaset)
                for index in range(obj["spec"]["replicas"]):
                    pod = {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": f"{name}-5d8f9-{index}",
                            "namespace": namespace,
                            "labels": template["metadata"]["labels"],
                            "resourceVersion": "1",
                            "ownerReferences": [controller_ref(replicaset)],
                        },
                        "spec": template["spec"],
                        "status": {"podIP": f"10.0.0.{index + 1}", "conditions": []},
                    }
                    self.objects.setdefault(self.key(pod), pod)
                obj["status"] = {"readyReplicas": obj["spec"]["replicas"]}
            elif kind == "Job":
                obj["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
        self.send_watch_events()


def controller_ref(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"kind": owner["kind"], "name": meta["name"], "uid": meta["uid"], "controller": True}


def sufficient_pool(
    pod: str, role: str, revision: str, url: str | None, internal_token: str | None
) -> PodPool:
    assert url is not None, f"{pod} has no URL"
    assert internal_token, f"{pod} was probed without the revision's internal token"
    report = PoolGateReport(
        role=role,
        revision=revision,
        pool_tokens=16384,
        page_size=16,
        num_pages=1024,
        context_length_effective=16384,
        tag_check=True,
        deferred_release=True,
    )
    return PodPool(pod, role, revision, report=report)


def roll_out(reconciler: Reconciler, kube: RecordingKube, body: dict[str, Any]) -> None:
    """Reconcile passes, with the cluster answering in between, until the spec's revision
    serves."""
    desired = revision_of(InferenceDeployment.model_validate(body).spec)
    for _ in range(12):
        outcome = reconciler.reconcile(body)
        body["status"] = outcome.status.model_dump(mode="json", by_alias=True)
        if (body["status"].get("revision") or {}).get("current") == desired:
            return
        kube.play_controllers()
    raise AssertionError(f"revision {desired} never served: {body['status']}")


def granted(rules: list[dict[str, Any]], verb: str, api_version: str, resource: str) -> bool:
    group = api_version.rpartition("/")[0]
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


def operator_cluster_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [r for r in of_kind(docs, "ClusterRole") if not aggregated_to(r)]
    return role


def recorded_rollout_and_update(legacy: bool = False) -> RecordingKube:
    """legacy: an operator without a credentials key (random credentials, read back)."""
    manifest = yaml.safe_load((ROOT / "examples" / "smollm2-local.yaml").read_text())
    body = {
        **manifest,
        "metadata": {
            **manifest["metadata"],
            "namespace": "inference",
            "uid": "u1",
            "generation": 1,
        },
    }
    kube = RecordingKube()
    store = Store(["inference"])
    kube.watch_into(store, "inference")  # the reads go through the operator's caches
    reconciler = Reconciler(  # as the chart runs it: with a credentials key
        CachedKube(kube, store),
        NAMESPACE,
        read_pool=sufficient_pool,
        credentials_key=None if legacy else b"the credentials key",
    )
    roll_out(reconciler, kube, body)
    # A spec change: a second revision rolls out and the first one is retired (at once: no
    # drain delay, so that this pass makes the deletes).
    body["spec"] = {
        **body["spec"],
        "contextLength": body["spec"]["contextLength"] // 2,
        "rollout": {"retireAfterSeconds": 0},
    }
    body["metadata"]["generation"] = 2
    roll_out(reconciler, kube, body)
    # Someone else edits every child the operator keeps as declared (an SRE relaxes a
    # PodDisruptionBudget to drain a node, ...): the next pass puts each back with a patch.
    edited = kube.edit_children()
    kube.send_watch_events()
    reconciler.reconcile(body)
    repaired = {kind for verb, _, kind, sub in kube.calls if verb == "patch" and not sub}
    assert edited <= repaired, f"drift repair patched {repaired}, not every edited {edited}"
    return kube


def test_rbac_grants_every_call_the_operator_makes_in_a_rollout_and_an_update(
    default_docs: list[dict[str, Any]],
) -> None:
    """The calls of two rollouts and of drift repair over every kind of child (a
    PodDisruptionBudget an SRE relaxed was patched back under a rule without patch: every
    pass died on the 403)."""
    role = operator_cluster_role(default_docs)
    kube = recorded_rollout_and_update()
    # no get: reads come from the caches (a get is for a name someone else's object took, or
    # before the caches fill, and the rules keep it for those)
    assert {verb for verb, *_ in kube.calls} == {
        "list",
        "watch",  # the caches' informers
        "create",
        "patch",
        "delete",
        "update",  # the owner's finalizers: ownerReferences with blockOwnerDeletion
    }
    assert ("update", f"{API_GROUP}/{API_VERSION}", KIND, "finalizers") in kube.calls
    denied = sorted(
        f"{verb} {kind}{'/' + sub if sub else ''} ({api_version})"
        for verb, api_version, kind, sub in kube.calls
        if not granted(role["rules"], verb, api_version, plural(kind) + (f"/{sub}" if sub else ""))
    )
    assert not denied, f"the chart's RBAC forbids calls the operator makes: {denied}"


def plural(kind: str) -> str:
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + "s"


def test_rbac_grants_no_secret_verb_the_operator_does_not_use(
    default_docs: list[dict[str, Any]],
) -> None:
    """Secrets hold credentials: the rule grants exactly the calls a rollout and an update
    make (the revision Secrets are immutable, so never patched), and no list or watch; no
    get either: the revisions' credentials are derived, so no Secret is read back."""
    role = operator_cluster_role(default_docs)
    (rule,) = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert rule["resources"] == ["secrets"]
    used = {verb for verb, _, kind, sub in recorded_rollout_and_update().calls if kind == "Secret"}
    assert sorted(rule["verbs"]) == sorted(used) == ["create", "delete"]


@pytest.mark.parametrize("values", [{}, CUSTOM_VALUES], ids=["default", "custom"])
def test_secret_get_is_granted_only_for_revisions_of_an_older_operator(
    helm: Any, values: dict[str, Any]
) -> None:
    """rbac.legacyRevisionSecrets adds get where InferenceDeployments are: what an operator
    without a credentials key (an older one's revisions) reads."""
    on = merged(values, {"rbac": {"legacyRevisionSecrets": True}})
    docs = manifests(render(helm, on))
    own = own_secrets_role(docs)
    roles = [r for r in [*of_kind(docs, "ClusterRole"), *of_kind(docs, "Role")]
             if not aggregated_to(r) and r != own and not election(r)]  # fmt: skip
    assert len(roles) == len(values.get("watchNamespaces") or [None])
    assert roles
    used = {verb for verb, _, kind, _ in recorded_rollout_and_update(legacy=True).calls
            if kind == "Secret"}  # fmt: skip
    assert "get" in used
    for role in roles:
        (rule,) = [r for r in role["rules"] if "secrets" in r["resources"]]
        assert sorted(rule["verbs"]) == sorted(used)


# ---- the users' aggregated roles -------------------------------------------------------------

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def aggregated_to(role: Mapping[str, Any]) -> set[str]:
    """The built-in roles (view, edit, admin) a ClusterRole is aggregated into."""
    labels = role["metadata"].get("labels") or {}
    return {k.removeprefix(AGGREGATE) for k, v in labels.items() if k.startswith(AGGREGATE)}


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_users_with_view_or_edit_get_inference_deployments_through_aggregated_roles(
    helm: Any, values: dict[str, Any] | None
) -> None:
    """Whoever has the built-in view role in a namespace can read its InferenceDeployments,
    whoever has edit or admin can also create, change and delete them; nothing else, and the
    chart binds these roles to nobody."""
    docs = manifests(render(helm, values))
    roles = {
        frozenset(aggregated_to(r)): r for r in of_kind(docs, "ClusterRole") if aggregated_to(r)
    }
    assert set(roles) == {frozenset({"view"}), frozenset({"edit", "admin"})}
    for role in roles.values():
        assert all(v == "true" for k, v in role["metadata"]["labels"].items() if AGGREGATE in k)
        for rule in role["rules"]:
            assert rule["apiGroups"] == [API_GROUP], rule
    view, edit = roles[frozenset({"view"})], roles[frozenset({"edit", "admin"})]
    read = ["get", "list", "watch"]
    assert view["rules"] == [
        {"apiGroups": [API_GROUP], "resources": [PLURAL, f"{PLURAL}/status"], "verbs": read}
    ]
    assert edit["rules"] == [
        {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "verbs": read},
        {
            "apiGroups": [API_GROUP],
            "resources": [PLURAL],
            "verbs": [*read, "create", "update", "patch", "delete"],
        },
    ]
    names = {view["metadata"]["name"], edit["metadata"]["name"]}
    for binding in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["name"] not in names, binding


def test_the_aggregated_user_roles_can_be_left_out(helm: Any) -> None:
    docs = manifests(render(helm, {"aggregateUserRoles": False}))
    assert [r for r in of_kind(docs, "ClusterRole") if aggregated_to(r)] == []
    assert len(of_kind(docs, "ClusterRole")) == 1  # the operator's


# ---- metrics for Prometheus ------------------------------------------------------------------

METRICS_TOKEN_SECRET = "kvfence-metrics-token"
CREDENTIALS_KEY_SECRET = "kvfence-credentials-key"
OWN_SECRETS_GET = {
    "apiGroups": [""],
    "resources": ["secrets"],
    "resourceNames": [CREDENTIALS_KEY_SECRET, METRICS_TOKEN_SECRET],
    "verbs": ["get"],
}


def own_secrets_role(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-own-secrets")]
    return role


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in operator_container(docs)["env"]}


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_the_operator_may_create_and_read_its_own_secrets_and_no_other(
    helm: Any, values: dict[str, Any] | None
) -> None:
    """In the release namespace only: create (a 409 keeps an existing one) and get by name.
    What metrics_access and credentials_key really call at start-up is granted; reading
    another Secret is not."""
    docs = manifests(render(helm, values))
    role = own_secrets_role(docs)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        OWN_SECRETS_GET,
    ]
    (binding,) = [
        b for b in of_kind(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    (account,) = of_kind(docs, "ServiceAccount")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    env = operator_env(docs)
    assert env[TOKEN_SECRET_ENV] == METRICS_TOKEN_SECRET
    assert env[CREDENTIALS_KEY_SECRET_ENV] == CREDENTIALS_KEY_SECRET
    kube = RecordingKube()
    access = metrics_access(kube, NAMESPACE, env)
    assert credentials_key(kube, NAMESPACE, env)
    assert access.token_sha256 and kube.calls == {
        ("create", "v1", "Secret", ""),
        ("get", "v1", "Secret", ""),
    }
    assert set(kube.objects) == {
        ("v1", "Secret", NAMESPACE, name) for name in OWN_SECRETS_GET["resourceNames"]
    }


def test_the_scrapers_the_values_name_are_what_the_operator_admits(helm: Any) -> None:
    default = scrapers_from(operator_env(manifests(render(helm)))[SCRAPERS_ENV])
    assert default == default_values()["metrics"]["scrapers"]
    (prometheus,) = default
    assert prometheus["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    # A list: what a user sets replaces the default (Helm would merge a map's labels into it).
    chosen = [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}]
    values = {"metrics": {"scrapers": chosen}}
    assert scrapers_from(operator_env(manifests(render(helm, values)))[SCRAPERS_ENV]) == chosen
    off = {"metrics": {"scrapers": [], "tokenSecret": ""}}
    docs = manifests(render(helm, off))
    assert not {SCRAPERS_ENV, TOKEN_SECRET_ENV} & set(operator_env(docs))
    assert own_secrets_role(docs)["rules"][1]["resourceNames"] == [CREDENTIALS_KEY_SECRET]


def test_no_pod_monitor_by_default(default_docs: list[dict[str, Any]]) -> None:
    assert not of_kind(default_docs, "PodMonitor")


@pytest.mark.parametrize("values", [{}, CUSTOM_VALUES], ids=["default", "custom"])
def test_the_pod_monitor_scrapes_engines_and_routers_with_the_metrics_token(
    helm: Any, values: dict[str, Any]
) -> None:
    on = merged(
        values, {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
    )
    (monitor,) = of_kind(manifests(render(helm, on)), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE  # where the token's Secret is
    assert monitor["metadata"]["labels"]["release"] == "kps"
    watched = values.get("watchNamespaces")
    expected = {"matchNames": watched} if watched else {"any": True}
    assert monitor["spec"]["namespaceSelector"] == expected
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": METRICS_TOKEN_SECRET, "key": TOKEN_KEY},
    }
    # It selects exactly the engine and router pods the operator builds, by a port they have.
    selected = set()
    for built in everything_built("full"):
        if built["kind"] not in ("Deployment", "Job"):
            continue
        template = built["spec"]["template"]
        if selects(monitor["spec"]["selector"], template["metadata"]["labels"]):
            (container,) = template["spec"]["containers"]
            assert endpoint["port"] in {p["name"] for p in container["ports"]}
            selected.add(template["metadata"]["labels"]["kvfence.dev/role"])
    assert selected == {"prefill", "decode", "router"}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True
