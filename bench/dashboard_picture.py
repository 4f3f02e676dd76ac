"""The README's picture of the chart's Grafana dashboard (charts/kvfence/dashboards/kvfence.json),
drawn from a real run: the emulated cluster with `kvfence operator`, tiny-random behind a
router with a standing canary, decode autoscaled, the prefix cache on, and two tenants' users;
a real Prometheus (Debian's, 2.42) scrapes the engines, the routers (with the metrics token, as
the chart's PodMonitor does, and the labels its relabelling gives) and the operator; then every
panel's own PromQL is evaluated by that Prometheus over the run and drawn, panel by panel in
the dashboard's grid, into a PNG (matplotlib). Two thirds in, the decode engine goes bad
(the test-only POST /internal/unsafe-fault early-release): the refusals, the failed standing
run and IsolationVerified falling to 0 are what the dashboard is for.

    apt-get install prometheus && pip install matplotlib     # neither is a test dependency
    python bench/dashboard_picture.py --out docs/dashboard.png   # about 5 minutes
"""

import argparse
import base64
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from kvfence_devcluster.fixtures import Cluster, start_cluster
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.builders.secret import INTERNAL_TOKEN_KEY, secret_name
from kvfence_operator.meta import LABEL_REVISION, LABEL_ROLE, Instance

NAME = "picture"
DASHBOARD = Path(__file__).parents[1] / "charts/kvfence/dashboards/kvfence.json"
TOKEN_SECRET = "kvfence-metrics-token"
USERS = {"sk-team-a-0123456789abcdef": "team-a", "sk-team-b-0123456789abcdef": "team-b"}
STEP = 5  # seconds between the points of a panel's series
RATE_WINDOW = "30s"  # what $__rate_interval stands for, at a 2 s scrape


def manifest() -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {
                "kvCacheMemory": str(4096 * 768),
                "extraArgs": ["--threads", "1", "--max-num-seqs", "4"],
                "prefixCache": {"enabled": True},
            },
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "250m"}}},
            "decode": {"resources": {"requests": {"cpu": "250m"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {
                "timeoutSeconds": 300,
                "schedule": "@every 45s",
                "standingLoad": {"maxRequests": 400, "requestsPerSecond": 10},
            },
            "autoscaling": {
                "decode": {
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "signal": "RunningSequences",
                    "target": 3,
                    "scaleUpStabilizationSeconds": 10,
                    "scaleDownStabilizationSeconds": 30,
                }
            },
        },
    }


def keys_secret() -> dict[str, Any]:
    lines = "".join(f"{key} {tenant}\n" for key, tenant in USERS.items())
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{NAME}-keys"},
        "data": {"api-keys": base64.b64encode(lines.encode()).decode()},
    }


def wait(what: str, check: Any, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(1)
    raise TimeoutError(f"no {what} in {timeout:.0f} s")


def infd(cluster: Cluster) -> dict[str, Any]:
    found = cluster.get("InferenceDeployment", NAME, api_version="kvfence.dev/v1alpha1")
    assert found is not None
    return found


def ready(cluster: Cluster) -> bool:
    conditions = (infd(cluster).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def targets(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    """The revision's engine and router pods as file_sd targets, with the labels the chart's
    PodMonitor relabelling gives (namespace, name, revision, kvfence_role, pod)."""
    found = []
    for pod in cluster.list("Pod", "default", {LABEL_REVISION: revision}):
        role = pod["metadata"]["labels"].get(LABEL_ROLE)
        if role not in ("prefill", "decode", "router") or not (pod.get("status") or {}).get(
            "podIP"
        ):
            continue
        found.append({
            "targets": [cluster.pod_url(pod).removeprefix("http://")],
            "labels": {"namespace": "default", "name": NAME, "revision": revision,
                       "kvfence_role": role, "pod": pod["metadata"]["name"]},
        })  # fmt: skip
    return found


@contextmanager
def prometheus(folder: Path, token: str, operator_metrics: str) -> Iterator[str]:
    port = free_port()
    (folder / "token").write_text(token)
    (folder / "targets.json").write_text("[]")
    operator = operator_metrics.removeprefix("http://").split("/", 1)[0]
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {
                "job_name": "kvfence-pods",
                "authorization": {"type": "Bearer", "credentials_file": str(folder / "token")},
                "file_sd_configs": [
                    {"files": [str(folder / "targets.json")], "refresh_interval": "5s"}
                ],
            },
            {"job_name": "kvfence-operator", "honor_labels": True,
             "static_configs": [{"targets": [operator]}]},
        ],
    }  # fmt: skip
    (folder / "prometheus.yml").write_text(json.dumps(config))
    proc = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait("Prometheus", lambda: _answers(url + "/-/ready"), 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def users(base_url: str, stop: threading.Event, clients: list[int]) -> list[threading.Thread]:
    """Streaming users of both tenants; `clients[0]` of them are active. Each repeats a system
    prompt of its tenant's, so the prefix cache hits."""

    def user(index: int) -> None:
        key = list(USERS)[index % len(USERS)]
        api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        system = f"You are {USERS[key]}'s assistant. " * 20
        while not stop.is_set():
            if index >= clients[0]:
                stop.wait(0.5)
                continue
            try:
                for _ in api.completions.create(
                    model="tiny-random", prompt=system + f"question {time.time()}",
                    max_tokens=48, temperature=0, stream=True,
                ):  # fmt: skip
                    pass
            except openai.OpenAIError:
                stop.wait(0.5)  # after the fault: requests fail closed

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    return threads


def decode_pods(cluster: Cluster, revision: str) -> list[dict[str, Any]]:
    pods = cluster.list("Pod", "default", {LABEL_REVISION: revision, LABEL_ROLE: "decode"})
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def switch_on_fault(cluster: Cluster, revision: str, uid: str) -> None:
    (decode, *_) = decode_pods(cluster, revision)
    secret = cluster.get("Secret", secret_name(Instance(NAME, "default", uid), revision))
    assert secret is not None
    token = base64.b64decode(secret["data"][INTERNAL_TOKEN_KEY]).decode()
    answer = httpx.post(
        cluster.pod_url(decode) + "/internal/unsafe-fault",
        json={"fault": "early-release"},
        headers={TOKEN_HEADER: token},
        timeout=10,
    )
    answer.raise_for_status()
    print(f"early-release switched on in {decode['metadata']['name']}", flush=True)


def series(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_WINDOW).replace("$__interval", f"{STEP}s")
    expr = re.sub(r'=~"\$namespace"', '=~"default"', expr)
    expr = re.sub(r'=~"\$name"', f'=~"{NAME}"', expr)
    answer = httpx.get(
        url + "/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": STEP},
        timeout=30,
    ).json()
    if answer.get("status") != "success":
        raise RuntimeError(f"{expr}: {answer.get('error')}")
    return list(answer["data"]["result"])


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def draw(url: str, start: float, end: float, out: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") in ("timeseries", "stat")]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(20, rows * 0.42))
    grid = figure.add_gridspec(
        rows, 24, hspace=2.4, wspace=1.2, top=0.975, bottom=0.02, left=0.03, right=0.99
    )
    for panel in panels:
        pos = panel["gridPos"]
        axes = figure.add_subplot(
            grid[pos["y"] : pos["y"] + pos["h"] - 1, pos["x"] : pos["x"] + pos["w"]]
        )
        axes.set_title(panel["title"], fontsize=10, loc="left")
        for target in panel.get("targets", []):
            for found in series(url, target["expr"], start, end):
                points = [(float(t) - start, float(v)) for t, v in found["values"] if v != "NaN"]
                if not points:
                    continue
                name = legend(target.get("legendFormat"), found["metric"])
                if panel["type"] == "stat":
                    value = points[-1][1]
                    axes.text(0.5, 0.5, f"{value:g}", fontsize=40, ha="center", va="center",
                              color="tab:green" if value >= 1 else "tab:red",
                              transform=axes.transAxes)  # fmt: skip
                    axes.set_xticks([])
                    axes.set_yticks([])
                    continue
                axes.plot([p[0] for p in points], [p[1] for p in points], label=name[:40])
        if panel["type"] == "timeseries":
            axes.tick_params(labelsize=7)
            axes.set_xlabel("s", fontsize=7, loc="right")
            if axes.lines:
                axes.legend(fontsize=6, loc="upper left")
            else:
                axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
    figure.suptitle(caption, fontsize=12, x=0.01, y=0.995, ha="left")
    figure.savefig(out, dpi=70, bbox_inches="tight")
    print(f"wrote {out}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=300, help="the run's length")
    args = parser.parse_args()
    if shutil.which("prometheus") is None:
        print("dashboard_picture: needs prometheus (apt-get install prometheus)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dashboard-picture-") as tmp:
        folder = Path(tmp)
        with start_cluster(folder / "cluster") as cluster:
            cluster.create(keys_secret())
            operator_metrics = f"http://127.0.0.1:{free_port()}/metrics"
            operator = cluster.start_operator(
                ["--standalone", "--namespace", "default", "--metrics", operator_metrics],
                env={"KVFENCE_RECONCILE_INTERVAL": "1", "OPERATOR_NAMESPACE": "default",
                     "KVFENCE_METRICS_TOKEN_SECRET": TOKEN_SECRET},
            )  # fmt: skip
            created = cluster.create(manifest())
            wait("Ready InferenceDeployment", lambda: ready(cluster))
            revision = infd(cluster)["status"]["revision"]["current"]
            token_secret = wait("metrics token", lambda: cluster.get("Secret", TOKEN_SECRET))
            token = base64.b64decode(token_secret["data"]["token"]).decode()
            stable = cluster.get("Service", NAME)
            assert stable is not None
            base_url = f"http://{stable['spec']['clusterIP']}:8000/v1"
            with prometheus(folder, token, operator_metrics) as url:
                stop, clients = threading.Event(), [2]
                users(base_url, stop, clients)
                start = time.time()
                # (share of the run, users): a step up that scales decode to 2, then down
                phases = [(0.0, 2), (0.2, 8), (0.45, 3)]
                faulted = None
                while (elapsed := time.time() - start) < args.seconds:
                    share = elapsed / args.seconds
                    clients[0] = next(c for s, c in reversed(phases) if share >= s)
                    # the fault once decode is back to one pod: every decode goes through it
                    one = len(decode_pods(cluster, revision)) == 1
                    if share >= 0.7 and faulted is None and (one or share >= 0.8):
                        switch_on_fault(cluster, revision, created["metadata"]["uid"])
                        faulted = elapsed
                    (folder / "targets.json").write_text(json.dumps(targets(cluster, revision)))
                    time.sleep(2)
                stop.set()
                time.sleep(4)  # a last scrape
                caption = (
                    "kvfence dashboard (charts/kvfence/dashboards/kvfence.json), every panel's "
                    "own PromQL evaluated by Prometheus 2.42 over a real run: emulated cluster, "
                    "tiny-random, 2-8 streaming users of 2 tenants; the decode engine goes bad "
                    f"at {faulted or 0:.0f} s"
                )
                draw(url, start, time.time(), args.out, caption)
            operator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
