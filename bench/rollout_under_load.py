"""A rollout under continuous client load: does promotion drop a request?

Starts the standalone emulated cluster (`kvfence-devcluster --operator --install-crds`, its
Services reachable on loopback clusterIPs), applies an InferenceDeployment of
builtin:tiny-random, waits for Ready, then keeps --streams concurrent streaming clients and
--rate short requests per second going through the stable Service (the `openai` client,
max_retries=0) while a pod-shaping field changes (a new revision: pods, canary, promotion). The
load runs until the new revision serves and the old one is gone (its Deployments and pods),
then stops; streams in flight are let finish.

A request fails when it raises (a refused or reset connection, a non-2xx answer, a timeout) or
when a stream ends without a finish_reason. The failures are listed by cause. The last line:

    requests=N failed=N rollout_seconds=S

With --handover the change is the operator's, not the spec's: two `kvfence operator
--leader-elect` replicas run (the cluster starts none), and under the same load the leader is
killed (SIGKILL, as a node loss or an OOM kill) and then the new leader's first passes run with
nothing read yet; a third replica is started as the next standby, and the leader is stopped
gracefully too (SIGTERM, as a chart rolling update does), twice the handover. Before it,
--hung engine pods of another InferenceDeployment are made to hang (SIGSTOP), so the new
leader's pool probes wait on them (3 s each, 8 at a time) as on a cluster with hung pods. The
load runs until each new leader has made --settle passes (a pass a second). Its last line:

    requests=N failed=N handovers=2 handover_seconds=S gates_closed_by_new_leaders=N

Exit status 1 if any request failed, 2 if the cluster or the rollout did not get there.

    python bench/rollout_under_load.py            # about 3 minutes on 2 cores
    python bench/rollout_under_load.py --handover # about 2 minutes
"""

import argparse
import base64
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
from kubernetes import client as kube_client
from kubernetes import config as kube_config

NAME = "rollout-bench"
NAMESPACE = "default"
API_KEY = "sk-bench-0123456789"
TINY_KV_BYTES_PER_TOKEN = 768  # builtin:tiny-random
REVISION_LABEL = "kvfence.dev/revision"


def manifest(max_num_seqs: int, retire_after: int, grace: int, name: str = NAME) -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {
                "kvCacheMemory": str(4096 * TINY_KV_BYTES_PER_TOKEN),
                # a new --max-num-seqs is the pod-shaping change that makes the next revision
                "extraArgs": ["--threads", "1", "--max-num-seqs", str(max_num_seqs)],
            },
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "1"}}},
            "decode": {"resources": {"requests": {"cpu": "1"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {"timeoutSeconds": 300},
            "rollout": {"retireAfterSeconds": retire_after, "terminationGracePeriodSeconds": grace},
        },
    }


def keys_secret(name: str = NAME) -> dict[str, Any]:
    """The API keys Secret `<name>-keys`: API_KEY for tenant `bench`."""
    keys = base64.b64encode(f"{API_KEY} bench\n".encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{name}-keys", "namespace": NAMESPACE},
        "data": {"api-keys": keys},
    }


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    def __call__(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def apply(self, obj: dict[str, Any]) -> None:
        self("apply", "-f", "-", stdin=json.dumps(obj))

    def wait_ready(self, name: str) -> None:
        """Until the InferenceDeployment `name` has condition Ready True."""
        self("wait", "--for=condition=Ready", f"infd/{name}", "-n", NAMESPACE, "--timeout=400s",
             timeout=420)  # fmt: skip

    def jsonpath(self, what: str, path: str) -> str:
        return self("get", what, "-n", NAMESPACE, "-o", f"jsonpath={{{path}}}").strip()

    def names(self, kinds: str, revision: str) -> list[str]:
        selector = f"{REVISION_LABEL}={revision}"
        out = self("get", kinds, "-n", NAMESPACE, "-l", selector, "-o", "name")
        return out.split()


def wait(observe: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            if value := observe():
                return value
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not after {timeout:g} s (last: {last})")


@contextlib.contextmanager
def devcluster(state: Path, grace_cap: int, operator: bool = True) -> Iterator[Path]:
    """`kvfence-devcluster --install-crds` (with `--operator` unless the bench runs its own);
    its kubeconfig once it answers."""
    kubeconfig = state / "kubeconfig"
    env = {**os.environ, "KVFENCE_RECONCILE_INTERVAL": "1"}
    command = [
        sys.executable, "-m", "kvfence_devcluster",
        "--kubeconfig", str(kubeconfig),
        "--state-dir", str(state / "cluster"),
        *(["--operator"] if operator else []), "--install-crds",
        "--grace-cap", str(grace_cap),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # one line once the cluster and the operator answer
        if proc.poll() is not None or "cluster at" not in line:
            raise RuntimeError(f"kvfence-devcluster did not start: {line.strip()}")
        print(line.strip(), flush=True)
        yield kubeconfig
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


class Load:
    """Streaming clients and a steady rate of short requests, counting what failed and why."""

    def __init__(self, base_url: str, streams: int, rate: float, stream_tokens: int) -> None:
        self.client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
        self.streams, self.rate, self.stream_tokens = streams, rate, stream_tokens
        self.requests = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _count(self, failure: str | None) -> None:
        with self.lock:
            self.requests += 1
            if failure is not None:
                self.failures[failure] += 1

    @staticmethod
    def _cause(exc: Exception) -> str:
        cause = exc.__cause__ or exc.__context__
        detail = f" ({type(cause).__name__}: {str(cause)[:80]})" if cause else ""
        return f"{type(exc).__name__}: {str(exc)[:120]}{detail}"

    def _stream_forever(self) -> None:
        while not self.stop.is_set():
            try:
                finish = None
                stream = self.client.completions.create(
                    model="tiny-random",
                    prompt="tell me a long story",
                    max_tokens=self.stream_tokens,
                    temperature=0,
                    stream=True,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                self._count(None if finish else "stream ended without a finish_reason")
            except openai.OpenAIError as exc:
                self._count(self._cause(exc))
                time.sleep(0.2)

    def _one(self) -> None:
        try:
            answer = self.client.completions.create(
                model="tiny-random", prompt="hello", max_tokens=4, temperature=0
            )
            self._count(None if answer.choices else "an answer without choices")
        except openai.OpenAIError as exc:
            self._count(self._cause(exc))

    def _paced(self) -> None:
        """Starts a request every 1/rate s, each on its own thread (a slow one does not
        lower the rate)."""
        period, due = 1.0 / self.rate, time.monotonic()
        while not self.stop.is_set():
            thread = threading.Thread(target=self._one, daemon=True)
            thread.start()
            self.threads.append(thread)
            due += period
            self.stop.wait(max(0.0, due - time.monotonic()))

    def start(self) -> None:
        # a list of its own: the paced thread adds each request's thread to self.threads
        first = [threading.Thread(target=self._stream_forever, daemon=True)
                 for _ in range(self.streams)]  # fmt: skip
        first.append(threading.Thread(target=self._paced, daemon=True))
        self.threads.extend(first)
        for thread in first:
            thread.start()

    def finish(self) -> None:
        """Stop starting requests; let those in flight end."""
        self.stop.set()
        for thread in list(self.threads):
            thread.join(180)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--rate", type=float, default=4.0, help="short requests per second")
    parser.add_argument("--stream-tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--retire-after", type=int, default=30, help="retireAfterSeconds")
    parser.add_argument("--grace", type=int, default=60, help="terminationGracePeriodSeconds")
    parser.add_argument("--timeout", type=float, default=600, help="for the rollout, seconds")
    parser.add_argument(
        "--handover",
        action="store_true",
        help="hand the operator's leadership over under load (SIGKILL, then SIGTERM) "
        "instead of rolling out a new revision",
    )
    parser.add_argument(
        "--hung",
        type=int,
        default=12,
        help="engine pods of another InferenceDeployment that hang (SIGSTOP) before the "
        "handover, holding the new leader's pool probes (--handover; 0: none)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=20,
        help="passes each new leader makes before the next step (--handover; one a second)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        try:
            with devcluster(
                Path(tmp), grace_cap=args.grace, operator=not args.handover
            ) as kubeconfig:
                if args.handover:
                    with Replicas(kubeconfig, Path(tmp)) as replicas:
                        return handover(Kubectl(kubeconfig), replicas, args)
                return run(Kubectl(kubeconfig), args)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
            print(f"rollout_under_load: {exc}", file=sys.stderr)
            return 2


def run(kubectl: Kubectl, args: argparse.Namespace) -> int:
    kubectl.apply(keys_secret())
    kubectl.apply(manifest(16, args.retire_after, args.grace))
    kubectl.wait_ready(NAME)
    first = kubectl.jsonpath(f"infd/{NAME}", ".status.revision.current")
    address = kubectl.jsonpath(f"service/{NAME}", ".spec.clusterIP")
    print(f"revision {first} serves at http://{address}:8000/v1", flush=True)

    load = Load(f"http://{address}:8000/v1", args.streams, args.rate, args.stream_tokens)
    load.start()
    time.sleep(10)  # the load runs on the serving revision before the change
    started = time.monotonic()
    kubectl.apply(manifest(32, args.retire_after, args.grace))
    try:
        second = wait(
            lambda: (
                (r := kubectl.jsonpath(f"infd/{NAME}", ".status.revision.current")) != first and r
            ),
            "the new revision to serve",
            args.timeout,
        )
        print(f"revision {second} serves after {time.monotonic() - started:.0f} s", flush=True)
        wait(
            lambda: not kubectl.names("deployments,pods", first),
            f"revision {first} to be gone",
            args.timeout,
        )
    finally:
        rollout_seconds = time.monotonic() - started
        load.finish()
    for cause, count in load.failures.most_common():
        print(f"  {count:5d}  {cause}")
    failed = sum(load.failures.values())
    print(f"requests={load.requests} failed={failed} rollout_seconds={rollout_seconds:.0f}")
    return 1 if failed else 0


LEASE = "kvfence-operator"


class Replicas:
    """`kvfence operator --leader-elect` replicas against the cluster, each named by its
    POD_NAME (the Lease's holderIdentity), a pass a second."""

    def __init__(self, kubeconfig: Path, logs: Path) -> None:
        self.kubeconfig, self.logs = kubeconfig, logs
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        kube_config.load_kube_config(str(kubeconfig))
        self.leases = kube_client.CoordinationV1Api()

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *_: object) -> None:
        for replica in self.running.values():
            replica.terminate()
        for replica in self.running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.wait(30)

    def start(self, name: str) -> None:
        kvfence = Path(sys.executable).with_name("kvfence")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "POD_NAME": name,
               "OPERATOR_NAMESPACE": NAMESPACE, "KVFENCE_RECONCILE_INTERVAL": "1"}  # fmt: skip
        with (self.logs / f"{name}.log").open("ab") as log:
            self.running[name] = subprocess.Popen(
                [str(kvfence), "operator", "--leader-elect", "--all-namespaces"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def holder(self) -> str | None:
        try:
            lease = self.leases.read_namespaced_lease(LEASE, NAMESPACE)
        except kube_client.ApiException:
            return None
        return lease.spec.holder_identity or None

    def passes(self, name: str) -> int:
        """The reconcile passes `name` has logged so far (kopf's line for each)."""
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return text.count("Timer 'reconcile' succeeded")

    def gates_closed(self, name: str, instance: str) -> int:
        """The kv-pool gates `name` turned False on `instance`'s pods (the Warning Events it
        logged for a pod leaving traffic, reason PoolUnknown)."""
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return sum(
            1 for line in text.splitlines() if "PoolUnknown: " in line and f"{instance}-" in line
        )


HUNG = "hung-bench"


def hung_deployment(args: argparse.Namespace) -> dict[str, Any]:
    """Another InferenceDeployment of --hung engine pods (one prefill, the rest decode; no
    canary), applied before the bench's own: a new leader lists it first (by name, and here by
    creation too), so its probes are queued first."""
    hung = manifest(16, args.retire_after, args.grace, name=HUNG)
    hung["spec"]["decode"]["replicas"] = args.hung - 1
    hung["spec"]["canary"] = {"enabled": False}
    return hung


def hang_engines(kubectl: Kubectl) -> list[int]:
    """Stop (SIGSTOP) the hung deployment's engine processes, once Ready: a probe's connection
    is accepted and never answered, as a hung pod's, so a new leader, which has read no pool
    yet, waits its 3 s timeout on each with its 8 probe workers. The pids."""
    kubectl.wait_ready(HUNG)
    selector = f"app.kubernetes.io/instance={HUNG}"
    listed = kubectl("get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json")
    pods = json.loads(listed)["items"]
    pids = [
        int(status["containerID"].rpartition("://")[2])
        for pod in pods
        if pod["metadata"]["labels"].get("kvfence.dev/role") in ("prefill", "decode")
        for status in pod["status"].get("containerStatuses") or []
        if status.get("containerID")
    ]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    print(f"{len(pids)} engine pods of {HUNG} hang", flush=True)
    return pids


def handover(kubectl: Kubectl, replicas: Replicas, args: argparse.Namespace) -> int:
    kubectl.apply(keys_secret())
    replicas.start("replica-a")
    wait(lambda: replicas.holder() == "replica-a", "replica-a to lead", 120)
    replicas.start("replica-b")
    if args.hung > 0:
        kubectl.apply(hung_deployment(args))
    kubectl.apply(manifest(16, args.retire_after, args.grace))
    kubectl.wait_ready(NAME)
    address = kubectl.jsonpath(f"service/{NAME}", ".spec.clusterIP")
    print(f"serving at http://{address}:8000/v1; replica-a leads", flush=True)
    hung = hang_engines(kubectl) if args.hung > 0 else []
    load = Load(f"http://{address}:8000/v1", args.streams, args.rate, args.stream_tokens)
    load.start()
    time.sleep(10)  # the load runs under the first leader
    started = time.monotonic()
    try:
        steps = [("replica-a", "kill", "killed", "replica-b", "replica-c"),
                 ("replica-b", "terminate", "stopped", "replica-c", None)]  # fmt: skip
        for leader, how, done, successor, standby in steps:
            getattr(replicas.running[leader], how)()
            took = time.monotonic()
            wait(lambda s=successor: replicas.holder() == s, f"{successor} to lead", 120)
            print(f"{leader} {done}; {successor} leads after {time.monotonic() - took:.0f} s",
                  flush=True)  # fmt: skip
            if standby is not None:
                replicas.start(standby)
            first = replicas.passes(successor)
            wait(lambda s=successor, f=first: replicas.passes(s) >= f + args.settle,
                 f"{args.settle:g} passes of {successor}", 300)  # fmt: skip
    finally:
        handover_seconds = time.monotonic() - started
        load.finish()
        for pid in hung:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    for cause, count in load.failures.most_common():
        print(f"  {count:5d}  {cause}")
    failed = sum(load.failures.values())
    closed = sum(replicas.gates_closed(name, NAME) for name in ("replica-b", "replica-c"))
    print(
        f"requests={load.requests} failed={failed} handovers=2 "
        f"handover_seconds={handover_seconds:.0f} gates_closed_by_new_leaders={closed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
