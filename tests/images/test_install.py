"""The README's "On a cluster" section, step for step, with the images (issue 27, item 3): on
the test cluster whose kubelet runs every pod as a podman container of its image, the CRD is
applied with kubectl, the chart (rendered by Helm's Go SDK, helm-python-sdk, as `helm install`
would, and applied with kubectl) runs the operator in its image as the chart's Deployment, the
CPU example serves SmolLM2 from its claim to the openai client through the stable Service after
its canary Job passed in the engine image, a spec change rolls a new revision, and deleting the
example removes everything. Inside the containers: read-only root, uid 65532, no capability,
the model read from the mounted volume. After the test no container or conmon is left."""

import json
import shlex
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from helpers.images import ENGINE, INSTALL_STEPS, OPERATOR, ROOT, podman
from helpers.kubectl_tables import table
from helpers.waits import READY_S, eventually
from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_devcluster.options import KubeletOptions
from kvfence_engine.loading.tokenizer_source import smollm2_gguf_path
from kvfence_operator.meta import LABEL_REVISION

pytestmark = pytest.mark.images

NAMESPACE, NAME = "kvfence-system", "smollm"
USER_KEY = "sk-" + "0123456789abcdef" * 3
CHART_VALUES = {  # the locally built image, never pulled
    "image": {
        "repository": OPERATOR.rsplit(":", 1)[0],
        "tag": OPERATOR.rsplit(":", 1)[1],
        "pullPolicy": "Never",
    }
}
# What `id -u; id -g`, CapEff and a write to / say in a locked-down container.
LOCKED_DOWN = ["65532 65532", "0000000000000000", "Read-only file system"]
INSPECT = (
    "import os\n"
    "print(os.getuid(), os.getgid())\n"
    "print([l.split()[1] for l in open('/proc/1/status') if l.startswith('CapEff')][0])\n"
    "try:\n    open('/written', 'w')\nexcept OSError as e:\n    print(e.strerror)\n"
)


def readme_table() -> str:
    """The `kubectl get infd -o wide` output the README's cluster section shows."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## On a cluster\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```\n\n```\n", 1)[1].split("```", 1)[0]


def edited_example(tmp_path: Path) -> Path:
    """The `$EDITOR examples/cpu-cluster.yaml` step: an API key, and the engine image built
    here (the example names the released one)."""
    secret, infd = yaml.safe_load_all((ROOT / "examples" / "cpu-cluster.yaml").read_text())
    secret["stringData"]["api-keys"] += f"{USER_KEY} alice\n"
    infd["spec"]["engine"]["image"] = ENGINE
    path = tmp_path / "cpu-cluster.yaml"
    path.write_text(yaml.safe_dump_all([secret, infd], sort_keys=False))
    return path


def helm_install(cluster: Cluster, tmp_path: Path, release: str, namespace: str) -> None:
    """`helm install RELEASE charts/kvfence --namespace NS --create-namespace`: the namespace,
    then the chart's templates rendered by Helm's Go SDK and applied (helm's release record
    aside, what helm sends)."""
    import helm_python

    with helm_python.Chart.load(ROOT / "charts" / "kvfence") as chart:
        rendered = chart.render(CHART_VALUES, name=release, namespace=namespace)
    documents = [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc is not None
    ]
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "--namespace", namespace, "-f", str(manifest))


def container_of(podman_env: dict[str, str], pod: str, container: str) -> str:
    """The running podman container of a pod's container, by the labels the runtime sets."""
    names = podman(
        podman_env, "ps", "--format", "{{.Names}}",
        "--filter", f"label=io.kubernetes.pod.name={pod}",
        "--filter", f"label=io.kubernetes.container.name={container}",
    ).split()  # fmt: skip
    assert len(names) == 1, f"pod {pod} container {container}: {names}"
    return names[0]


def locked_down(podman_env: dict[str, str], pod: str, container: str) -> list[str]:
    name = container_of(podman_env, pod, container)
    return podman(podman_env, "exec", name, "python3", "-c", INSPECT).split("\n")[:3]


def running_pods(cluster: Cluster, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    return [
        p
        for p in cluster.list("Pod", namespace, labels)
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


def test_the_readme_install_runs_in_containers_of_the_images(
    tmp_path: Path, built: None, podman_env: dict[str, str], swept: None
) -> None:
    model = smollm2_gguf_path()
    options = KubeletOptions(runtime="podman", claims={"models": model.parent}, grace_cap=10)
    example = edited_example(tmp_path)
    with start_cluster(tmp_path / "cluster", kubelet=options, crds=()) as cluster:

        def run(step: str) -> str:
            """One README step; relative paths are the repository's, the example the edited."""
            argv = shlex.split(step.split("  #", 1)[0])
            argv = [
                str(example) if a == "examples/cpu-cluster.yaml" else
                str(ROOT / a) if a.startswith(("crds/", "charts/")) else a
                for a in argv
            ]  # fmt: skip
            if argv[0] == "helm":
                helm_install(cluster, tmp_path, argv[2], argv[argv.index("--namespace") + 1])
                return ""
            if argv[0] == "$EDITOR":
                return ""  # edited_example()
            assert argv[0] == "kubectl", step
            timeout = 900 if argv[1] == "wait" else 120
            return cluster.kubectl(*argv[1:], timeout=timeout).stdout

        steps = iter(INSTALL_STEPS)
        try:
            assert "created" in run(next(steps))  # the CRD
            cluster.wait_for(
                lambda: cluster.kubectl(
                    "wait", "--for=condition=Established", "crd/inferencedeployments.kvfence.dev",
                    "--timeout=5s", check=False,
                ).returncode == 0,
                "the CRD to be established",
            )  # fmt: skip
            run(next(steps))  # helm install
            cluster.kubectl(
                "wait", "--namespace", NAMESPACE, "--for=condition=Available",
                "deployment/kvfence-operator", "--timeout=300s", timeout=320,
            )  # fmt: skip
            operators = running_pods(
                cluster, NAMESPACE, {"app.kubernetes.io/name": "kvfence-operator"}
            )
            assert len(operators) == 2  # the chart's two leader-elected replicas
            for operator in operators:
                (status,) = operator["status"]["containerStatuses"]
                assert (status["image"], status["containerID"][:9]) == (OPERATOR, "podman://")
                assert locked_down(podman_env, operator["metadata"]["name"], "operator") == (
                    LOCKED_DOWN
                )

            run(next(steps))  # $EDITOR
            run(next(steps))  # kubectl apply -f examples/cpu-cluster.yaml
            run(next(steps))  # kubectl wait --for=condition=Ready
            printed = run(next(steps))  # kubectl get infd -o wide
            print(printed)
            header, rows = table(printed)
            shown_header, shown_rows = table(readme_table())
            assert header == shown_header
            (row,) = rows
            # what the README shows, but for the revision's hash and the age
            keep = [i for i, column in enumerate(header) if column not in ("REVISION", "AGE")]
            assert [row[i] for i in keep] == [shown_rows[0][i] for i in keep], printed
            first = served(cluster, podman_env, model)

            run(next(steps))  # kubectl patch: a spec change
            run(next(steps))  # kubectl wait --for=condition=Progressing=False
            second = served(cluster, podman_env, model)
            assert second != first, "the change rolled no new revision"
            eventually(  # the previous revision drains, then goes
                lambda: cluster.list("Pod", "default", {LABEL_REVISION: first}),
                "the previous revision's pods to be gone",
                120,
                until=lambda left: not left,
            )

            run(next(steps))  # kubectl delete -f examples/cpu-cluster.yaml
            eventually(
                lambda: [
                    f"{kind} {o['metadata']['name']}"
                    for kind in ("Pod", "Deployment", "Service", "Job", "Secret")
                    for o in cluster.list(kind, "default", {"app.kubernetes.io/instance": NAME})
                ],
                "every child of the deleted InferenceDeployment to be gone",
                120,
                until=lambda left: not left,
            )
            assert next(steps, None) is None, "a README step this test does not run"
        except BaseException:
            print(cluster.describe(40))
            raise


def served(cluster: Cluster, podman_env: dict[str, str], model: Path) -> str:
    """The serving revision: its canary Job passed in the engine image, its engines run locked
    down with the model read from the mounted claim, and the openai client gets an answer
    through the stable Service. Returns the revision."""
    infd = cluster.kubectl("get", "infd", NAME, "-o", "json").stdout
    status = json.loads(infd)["status"]
    revision = status["revision"]["current"]
    jobs = cluster.list("Job", "default", {"app.kubernetes.io/instance": NAME})
    (job,) = [j for j in jobs if j["metadata"]["labels"].get(LABEL_REVISION) == revision]
    assert (job.get("status") or {}).get("succeeded") == 1, job.get("status")
    (canary,) = job["spec"]["template"]["spec"]["containers"]
    assert canary["image"] == ENGINE
    for role in ("prefill", "decode"):
        (pod,) = running_pods(
            cluster, "default", {LABEL_REVISION: revision, "kvfence.dev/role": role}
        )
        (status_,) = pod["status"]["containerStatuses"]
        assert (status_["image"], status_["containerID"][:9]) == (ENGINE, "podman://")
        name = pod["metadata"]["name"]
        assert locked_down(podman_env, name, status_["name"]) == LOCKED_DOWN
        assert f"'model_source': '/models/{model.name}'" in cluster.pod_log(name)
    address = cluster.kubectl(
        "get", "svc", NAME, "-o", "jsonpath={.spec.clusterIP}:{.spec.ports[0].port}"
    ).stdout  # fmt: skip
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key=USER_KEY, timeout=120)
    answer = eventually(  # the Service's proxy follows the promotion within a moment
        lambda: client.completions.create(
            model=client.models.list().data[0].id,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
        ),
        "a completion through the stable Service",
        READY_S,
    )
    assert "Paris" in answer.choices[0].text, answer
    return str(revision)
