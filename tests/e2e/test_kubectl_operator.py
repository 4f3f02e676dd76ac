"""The operator driven the way a user drives it: every step is a real `kubectl` command against
a devcluster running `kvfence operator` (kopf), whose kubelet runs hollow pods
(kvfence_devcluster/hollow.py): they report the pools real builtin:tiny-random engines would, so
`kubectl get` prints what docs/local.md shows, but serve no model (completions through the
operator's routers: test_operator.py)."""

import base64
import json
import textwrap
from pathlib import Path

import httpx
import pytest
import yaml

from helpers.kubectl_tables import table
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import LABEL_REVISION
from kvfence_operator.revision import revision_of

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
USER_KEY = "sk-user-a-0123456789"
# the serving revision's; `-o wide` adds the latest canary and the candidate's numbers
COLUMNS = ["NAME", "READY", "CONTEXT", "POOL", "PREFILL", "DECODE", "REVISION", "AGE"]
WIDE = [
    *COLUMNS,
    "CANARY",
    "ISOLATION",
    "CANDIDATE",
    "C-POOL",
    "C-PREFILL",
    "C-DECODE",
    "P-SCALE",
    "D-SCALE",
]
# tiny-random KV costs 768 bytes per token: 96 pages of 16 tokens hold 1536 tokens.
MANIFEST = textwrap.dedent(
    f"""\
    # builtin:tiny-random on CPU, one pod per role: what a laptop runs in a minute or two.
    apiVersion: kvfence.dev/v1alpha1
    kind: InferenceDeployment
    metadata:
      name: {NAME}
    spec:
      model:
        source: builtin:tiny-random
      engine:
        kvCacheMemory: 1152Ki  # {96 * 16 * 768} bytes
        extraArgs: ["--threads", "1"]
      contextLength: 1024
      prefill:
        resources: {{requests: {{cpu: "1"}}}}
      decode:
        resources: {{requests: {{cpu: "1"}}}}
      router:
        apiKeysSecret: {NAME}-keys
      canary:
        timeoutSeconds: 120
    """
)


def documented_cluster_steps() -> tuple[dict[str, object], str]:
    """The manifest and the `kubectl get infd -o wide` output that docs/local.md's "Try the
    operator locally" section shows."""
    text = (ROOT / "docs" / "local.md").read_text()
    section = text.split("\n## Try the operator locally", 1)[1].split("\n## ", 1)[0]
    manifest = section.split("kubectl apply -f - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    output = section.split("kubectl get infd -o wide\n", 1)[1].split("```\n", 2)[2]
    return yaml.safe_load(manifest), output.split("```", 1)[0]


def test_the_documented_steps_apply_the_manifest_this_test_applies() -> None:
    """Without a cluster: the page's manifest and table parse, and the manifest is this one (the
    slow test below also compares the table with what kubectl prints)."""
    manifest, output = documented_cluster_steps()
    assert manifest == yaml.safe_load(MANIFEST), "docs/local.md's manifest is not the test's"
    header, rows = table(output)
    assert header == WIDE and len(rows) == 1 and rows[0][0] == NAME, output


def revision(manifest_text: str) -> str:
    spec = yaml.safe_load(manifest_text)["spec"]
    return revision_of(InferenceDeploymentSpec.model_validate(spec))


def router_answers(cluster: Cluster, current: str) -> None:
    """The stable Service's clusterIP (the devcluster's kube-proxy) reaches a ready router of
    the current revision, which its selector names."""
    selector = json.loads(
        cluster.kubectl("get", "svc", NAME, "-o", "jsonpath={.spec.selector}").stdout
    )
    assert selector[LABEL_REVISION] == current, selector
    address = cluster.kubectl(
        "get", "svc", NAME, "-o", "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}"
    ).stdout  # fmt: skip
    assert address.startswith("127.") and not address.startswith("127.0.0.1:"), address
    assert httpx.get(f"http://{address}/readyz", timeout=10).status_code == 200


@pytest.mark.slow
@pytest.mark.hollow
def test_a_user_applies_waits_inspects_changes_and_deletes_with_kubectl(tmp_path: Path) -> None:
    hollow = KubeletOptions(hollow=True)
    with start_cluster(tmp_path / "cluster", kubelet=hollow, crds=()) as cluster:
        out = cluster.kubectl("apply", "-f", str(ROOT / "crds")).stdout
        assert out.strip() == (
            "customresourcedefinition.apiextensions.k8s.io/inferencedeployments.kvfence.dev created"
        )
        cluster.start_operator(
            ["--standalone", "--namespace", "default"], env={"KVFENCE_RECONCILE_INTERVAL": "1"}
        )
        cluster.kubectl(
            "create", "secret", "generic", f"{NAME}-keys",
            f"--from-literal=api-keys={USER_KEY} team-a",
        )  # fmt: skip
        keys = cluster.kubectl("get", "secret", f"{NAME}-keys", "-o", "jsonpath={.data.api-keys}")
        assert base64.b64decode(keys.stdout).decode() == f"{USER_KEY} team-a"

        manifest = tmp_path / "tiny.yaml"
        manifest.write_text(MANIFEST)
        applied = cluster.kubectl("apply", "-f", str(manifest)).stdout.strip()
        assert applied == f"inferencedeployment.kvfence.dev/{NAME} created"
        try:
            cluster.kubectl(
                "wait", "--for=condition=Ready", f"infd/{NAME}", "--timeout=300s", timeout=320
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n\n{cluster.describe()}") from None

        r1 = revision(MANIFEST)
        shown = cluster.kubectl("get", "infd").stdout
        saved = tmp_path / "kubectl-get-infd.txt"
        saved.write_text(shown)
        print(f"\n$ kubectl get infd   (saved to {saved})\n{shown}")
        header, rows = table(shown)
        assert header == COLUMNS
        ((name, ready, context, pool, prefill, decode, current, age),) = rows
        assert [name, ready, context, pool, prefill, decode, current] == [
            NAME, "True", "1024", "1536", "1/1", "1/1", r1
        ]  # fmt: skip
        assert age[-1] in "smh" and age[:-1].rstrip("smh0123456789") == ""
        wide = cluster.kubectl("get", "infd", "-o", "wide").stdout
        print(f"\n$ kubectl get infd -o wide\n{wide}")
        wide_header, wide_rows = table(wide)
        assert wide_header == WIDE and wide_rows[0][:7] == rows[0][:7]
        # no standing canary, candidate or autoscaling: empty cells
        assert wide_rows[0][8:] == ["Passed", "", "", "", "", "", "", ""]
        documented_manifest, documented_output = documented_cluster_steps()
        assert documented_manifest == yaml.safe_load(MANIFEST), (
            "docs/local.md's manifest is not the test's"
        )
        documented_header, documented_rows = table(documented_output)

        def without_age(row: list[str]) -> list[str]:
            return row[:7] + row[8:]

        assert (documented_header, without_age(documented_rows[0])) == (
            WIDE,
            without_age(wide_rows[0]),
        ), f"docs/local.md's `kubectl get infd -o wide` output is stale; this run printed:\n{wide}"

        described = cluster.kubectl("describe", "infd", NAME).stdout
        events = described.split("\nEvents:", 1)[1]
        for reason in ("PoolHoldsContext", "CanaryStarted", "CanaryPassed", "Promoted"):
            assert reason in events, described
        assert f"revision {r1} now serves" in events

        pods_header, pods = table(cluster.kubectl("get", "pods", "-l",
                                                  f"{LABEL_REVISION}={r1}").stdout)  # fmt: skip
        assert pods_header == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        serving = [p for p in pods if p[2] == "Running"]
        assert len(serving) == 3 and all(p[1] == "1/1" for p in serving), pods  # prefill, decode,
        router_answers(cluster, r1)  # router

        changed = MANIFEST.replace("contextLength: 1024", "contextLength: 512")
        r2 = revision(changed)
        assert r2 != r1
        cluster.kubectl("patch", "infd", NAME, "--type", "merge", "-p",
                        '{"spec": {"contextLength": 512}}')  # fmt: skip
        cluster.kubectl(
            "wait", f"--for=jsonpath={{.status.revision.current}}={r2}", f"infd/{NAME}",
            "--timeout=300s", timeout=320,
        )  # fmt: skip
        cluster.kubectl("wait", "--for=condition=Ready", f"infd/{NAME}", "--timeout=60s")
        _, rows = table(cluster.kubectl("get", "infd").stdout)
        assert rows[0][1:7] == ["True", "512", "1536", "1/1", "1/1", r2]
        router_answers(cluster, r2)

        deleted = cluster.kubectl("delete", "infd", NAME, "--timeout=120s", timeout=130)
        assert deleted.stdout.strip() == f'inferencedeployment.kvfence.dev "{NAME}" deleted'
        cluster.wait_for(
            lambda: cluster.kubectl(
                "get", "deployments,services,jobs,configmaps,pods",
                "-l", f"app.kubernetes.io/instance={NAME}", "-o", "name",
            ).stdout.strip(),
            "every child of the InferenceDeployment to be gone",
            timeout=60,
            until=lambda names: names == "",
        )  # fmt: skip
