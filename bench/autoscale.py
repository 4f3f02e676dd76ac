"""Autoscaling under a load ramp: does the operator follow the load up and down without a failed
request, while it keeps the latency target, the prefill:decode ratio, and fewer pods than a
deployment fixed at its maximum?

Starts the standalone emulated cluster (`kvfence-devcluster --operator --install-crds`, a pass
a second), applies an InferenceDeployment of builtin:tiny-random with `spec.autoscaling`
(prefill on TimeToFirstToken, decode on RunningSequences, a prefill:decode ratio guard), waits
for Ready, then runs a ramp of concurrent streaming clients through the stable Service (the
`openai` client, max_retries=0): --phases `SECONDS:CLIENTS,...`. A decode pod has
--max-num-seqs slots, so what holds the clients' first tokens back is decode pods, not this
machine's two cores. Every second it samples the
engine pods Running and the counts the autoscaler decided (status.autoscaling).

A request fails when it raises (a refused or reset connection, a non-2xx answer, a timeout) or
when its stream ends without a finish_reason. It reports, per phase, the p90 time to first
token (client side) against the target, how long after each step up the p90 took to come back
under the target (over 5 s buckets, staying under for the rest of the phase), the reaction
time (the step to the first count raised), the pod-seconds of engine pods against the same
ramp at every role's maxReplicas, and every sample where the decided counts broke the ratio
guard. The last line:

    autoscale requests=N failed=N pod_minutes=P fixed_max_pod_minutes=F ratio=P/F
        recovered_within_two_windows=yes|no ratio_violations=N

Exit status 1 if a request failed, the ratio guard was broken, the pods were over 60% of the
fixed maximum, or the p90 did not come back under the target within two scale-up windows of a
step up; 2 if the cluster did not get there.

    python bench/autoscale.py     # about 9 minutes on 2 cores
"""

import argparse
import collections
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from kubernetes import client as kube_client
from kubernetes import config as kube_config

from rollout_under_load import (
    API_KEY,
    NAMESPACE,
    TINY_KV_BYTES_PER_TOKEN,
    Kubectl,
    devcluster,
    keys_secret,
)

NAME = "autoscale-bench"
ENGINE_ROLES = ("prefill", "decode")


def manifest(args: argparse.Namespace) -> dict[str, Any]:
    def role(signal: str, target: float, most: int) -> dict[str, Any]:
        return {
            "minReplicas": 1,
            "maxReplicas": most,
            "signal": signal,
            "target": target,
            "scaleUpStabilizationSeconds": args.up_window,
            "scaleDownStabilizationSeconds": args.down_window,
        }

    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "builtin:tiny-random"},
            "engine": {
                "kvCacheMemory": str(4096 * TINY_KV_BYTES_PER_TOKEN),
                "extraArgs": [
                    "--threads",
                    "1",
                    "--max-num-seqs",
                    str(args.max_num_seqs),
                    "--max-batched-tokens",
                    str(args.max_batched_tokens),
                ],
            },
            "contextLength": 1024,
            "prefill": {"resources": {"requests": {"cpu": "250m"}}},
            "decode": {"resources": {"requests": {"cpu": "250m"}}},
            "router": {"apiKeysSecret": f"{NAME}-keys"},
            "canary": {"timeoutSeconds": 300},
            "rollout": {"terminationGracePeriodSeconds": 60},
            "autoscaling": {
                "prefill": role("TimeToFirstToken", args.prefill_ttft_target, args.max_prefill),
                "decode": role("RunningSequences", args.decode_target, args.max_decode),
                "prefillToDecodeRatio": {"min": args.ratio_min, "max": args.ratio_max},
            },
        },
    }


@dataclass
class Sample:
    at: float  # seconds into the ramp
    running: dict[str, int]  # engine pods Running, per role
    ready: dict[str, int]  # of those, Ready (their pool gate open: serving)
    decided: dict[str, int]  # status.autoscaling.<role>.desired


@dataclass
class Ramp:
    """Streaming clients through the stable Service; client i runs while the phase has more
    than i clients."""

    base_url: str
    phases: list[tuple[float, int]]
    stream_tokens: int
    words: int  # the prompt's length, in repeats of "tells a story "
    started: float = 0.0
    results: list[tuple[float, float | None, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def clients_at(self, t: float) -> int:
        for seconds, clients in self.phases:
            if t < seconds:
                return clients
            t -= seconds
        return 0

    @property
    def seconds(self) -> float:
        return sum(s for s, _ in self.phases)

    def steps(self) -> list[tuple[float, int, int, float]]:
        """(when, clients before, clients after, seconds until the next) of each change."""
        out, at = [], 0.0
        for (seconds, before), (lasts, after) in zip(self.phases, self.phases[1:], strict=False):
            at += seconds
            out.append((at, before, after, lasts))
        return out

    def now(self) -> float:
        return time.monotonic() - self.started

    def client(self, index: int) -> None:
        api = openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        while not self.stop.is_set():
            if self.clients_at(self.now()) <= index:
                self.stop.wait(0.2)
                continue
            begun = self.now()
            first: float | None = None
            failure: str | None = None
            try:
                finish = None
                stream = api.completions.create(
                    model="tiny-random", prompt=f"client {index} " + "tells a story " * self.words,
                    max_tokens=self.stream_tokens, temperature=0, stream=True,
                )  # fmt: skip
                for chunk in stream:
                    if first is None:
                        first = self.now() - begun
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if not finish:
                    failure = "stream ended without a finish_reason"
            except openai.OpenAIError as exc:
                said = str(exc).split(" (request ", 1)[0]  # one line per cause, not per request
                failure = f"{type(exc).__name__}: {said[:100]}"
                self.stop.wait(0.2)
            with self.lock:
                self.results.append((begun, first, failure))

    def run(self, most: int) -> list[threading.Thread]:
        self.started = time.monotonic()
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True)
                   for i in range(most)]  # fmt: skip
        for thread in threads:
            thread.start()
        return threads


def sample(core: kube_client.CoreV1Api, custom: kube_client.CustomObjectsApi, at: float) -> Sample:
    pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/instance={NAME}")
    running = dict.fromkeys(ENGINE_ROLES, 0)
    ready = dict.fromkeys(ENGINE_ROLES, 0)
    for pod in pods.items:
        role = (pod.metadata.labels or {}).get("kvfence.dev/role")
        if (
            role in running
            and pod.status.phase == "Running"
            and not pod.metadata.deletion_timestamp
        ):
            running[role] += 1
            conditions = pod.status.conditions or []
            ready[role] += any(c.type == "Ready" and c.status == "True" for c in conditions)
    infd = custom.get_namespaced_custom_object(
        "kvfence.dev", "v1alpha1", NAMESPACE, "inferencedeployments", NAME
    )
    scaling = (infd.get("status") or {}).get("autoscaling") or {}
    decided = {r: int((scaling.get(r) or {}).get("desired") or 0) for r in ENGINE_ROLES}
    return Sample(at, running, ready, decided)


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def recovery(
    ramp: Ramp, step: float, end: float, target: float, bucket: float = 5.0
) -> float | None:
    """Seconds after `step` from which every `bucket` s of first tokens has its p90 under
    `target` up to `end`; None if it never does."""
    buckets: list[tuple[float, float | None]] = []
    at = step
    while at < end:
        firsts = [f for b, f, e in ramp.results if at <= b < at + bucket and f is not None]
        buckets.append((at, p90(firsts)))
        at += bucket
    recovered = None
    for start, value in buckets:
        if value is not None and value > target:
            recovered = None
        elif recovered is None:
            recovered = start - step
    return recovered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="60:1,90:4,90:8,90:4,150:1",
                        help="SECONDS:CLIENTS,... the ramp of streaming clients")  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--prompt-words", type=int, default=200,
                        help="repeats of 'tells a story ' in each prompt")  # fmt: skip
    parser.add_argument("--max-batched-tokens", type=int, default=64,
                        help="each engine's tokens per step: prompts take steps")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=2,
                        help="each engine's: a decode pod's slots")  # fmt: skip
    parser.add_argument("--ttft-target", type=float, default=0.5,
                        help="the clients' p90 first-token time to hold, s")  # fmt: skip
    parser.add_argument("--prefill-ttft-target", type=float, default=0.25,
                        help="prefill's TimeToFirstToken target (the engines' p90), s")  # fmt: skip
    parser.add_argument("--decode-target", type=float, default=2,
                        help="decode's RunningSequences target, per pod")  # fmt: skip
    parser.add_argument("--max-prefill", type=int, default=2)
    parser.add_argument("--max-decode", type=int, default=4)
    parser.add_argument("--ratio-min", type=float, default=0.25)
    parser.add_argument("--ratio-max", type=float, default=1.0)
    parser.add_argument("--up-window", type=int, default=15, help="scaleUpStabilizationSeconds")
    parser.add_argument("--down-window", type=int, default=30,
                        help="scaleDownStabilizationSeconds")  # fmt: skip
    parser.add_argument("--dump", type=Path, help="write every request and sample here (JSON)")
    args = parser.parse_args()
    phases = [(float(s), int(c)) for s, c in (p.split(":") for p in args.phases.split(","))]

    with tempfile.TemporaryDirectory(prefix="autoscale-bench-") as tmp:
        try:
            with devcluster(Path(tmp), grace_cap=60) as kubeconfig:
                return run(Kubectl(kubeconfig), kubeconfig, args, phases)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
            print(f"autoscale: {exc}", file=sys.stderr)
            return 2


def run(
    kubectl: Kubectl, kubeconfig: Path, args: argparse.Namespace, phases: list[tuple[float, int]]
) -> int:
    kubectl.apply(keys_secret(NAME))
    kubectl.apply(manifest(args))
    kubectl.wait_ready(NAME)
    address = kubectl.jsonpath(f"service/{NAME}", ".spec.clusterIP")
    revision = kubectl.jsonpath(f"infd/{NAME}", ".status.revision.current")
    print(f"revision {revision} serves at http://{address}:8000/v1", flush=True)
    kube_config.load_kube_config(str(kubeconfig))
    core, custom = kube_client.CoreV1Api(), kube_client.CustomObjectsApi()

    ramp = Ramp(f"http://{address}:8000/v1", phases, args.stream_tokens, args.prompt_words)
    threads = ramp.run(max(c for _, c in phases))
    samples: list[Sample] = []
    while (at := ramp.now()) < ramp.seconds:
        samples.append(sample(core, custom, at))
        time.sleep(max(0.0, 1.0 - (ramp.now() - at)))
    ramp.stop.set()
    for thread in threads:
        thread.join(180)
    print(kubectl("get", "infd", NAME, "-n", NAMESPACE, "-o", "wide").rstrip(), flush=True)
    return report(ramp, samples, args)


def timeline(ramp: Ramp, samples: list[Sample]) -> None:
    """One line per change of the clients, the decided counts, or the pods Running/Ready."""
    last = None
    for s in samples:
        shape = (ramp.clients_at(s.at), s.decided, s.running, s.ready)
        if shape != last:
            print(
                f"  t={s.at:5.0f} s  clients {shape[0]}  decided p{s.decided['prefill']} "
                f"d{s.decided['decode']}  running p{s.running['prefill']} "
                f"d{s.running['decode']}  ready p{s.ready['prefill']} d{s.ready['decode']}"
            )
            last = shape


def report(ramp: Ramp, samples: list[Sample], args: argparse.Namespace) -> int:
    if args.dump:
        args.dump.write_text(json.dumps({
            "requests": [{"begun": b, "first": f, "failure": e} for b, f, e in ramp.results],
            "samples": [dataclasses.asdict(s) for s in samples],
        }))  # fmt: skip
    timeline(ramp, samples)
    at = 0.0
    for seconds, clients in ramp.phases:
        firsts = [f for b, f, e in ramp.results if at <= b < at + seconds and f is not None]
        inside = [s for s in samples if at <= s.at < at + seconds]
        pods = {r: max((s.running[r] for s in inside), default=0) for r in ENGINE_ROLES}
        value = p90(firsts)
        said = f"{value:.3f} s" if value is not None else "-"
        print(f"  {at:5.0f}-{at + seconds:5.0f} s  {clients:3d} clients  requests "
              f"{len(firsts):4d}  p90 TTFT {said} (target {args.ttft_target:g} s)  most pods "
              f"prefill {pods['prefill']} decode {pods['decode']}", flush=True)  # fmt: skip
        at += seconds

    two_windows = 2 * args.up_window
    recovered_ok = True
    for step, before, after, lasts in ramp.steps():
        raised = next(
            (s.at - step for s in samples if s.at >= step
             and sum(s.decided.values()) > sum(_decided_at(samples, step).values())),
            None,
        )  # fmt: skip
        if after <= before:
            print(f"  step down at {step:.0f} s: {before} -> {after} clients")
            continue
        recovered = recovery(ramp, step, step + lasts, args.ttft_target)
        ok = recovered is not None and recovered <= two_windows
        recovered_ok &= ok
        print(f"  step up at {step:.0f} s: {before} -> {after} clients; first count raised after "
              f"{'-' if raised is None else f'{raised:.0f} s'}; p90 TTFT under target after "
              f"{'never' if recovered is None else f'{recovered:.0f} s'} "
              f"(two windows: {two_windows} s)", flush=True)  # fmt: skip

    violations = [
        s for s in samples
        if s.decided["decode"] and not (
            args.ratio_min - 1e-9 <= s.decided["prefill"] / s.decided["decode"]
            <= args.ratio_max + 1e-9
        )
    ]  # fmt: skip
    pod_seconds = sum(sum(s.running.values()) for s in samples)
    fixed = (args.max_prefill + args.max_decode) * len(samples)
    failures = collections.Counter(e for _, _, e in ramp.results if e is not None)
    for cause, count in failures.most_common():
        print(f"  {count:5d}  {cause}")
    failed = sum(failures.values())
    share = pod_seconds / fixed if fixed else 0.0
    print(
        f"autoscale requests={len(ramp.results)} failed={failed} "
        f"pod_minutes={pod_seconds / 60:.1f} fixed_max_pod_minutes={fixed / 60:.1f} "
        f"ratio={share:.2f} recovered_within_two_windows={'yes' if recovered_ok else 'no'} "
        f"ratio_violations={len(violations)}"
    )
    return 1 if failed or violations or share > 0.6 or not recovered_ok else 0


def _decided_at(samples: list[Sample], at: float) -> dict[str, int]:
    before = [s for s in samples if s.at <= at]
    return before[-1].decided if before else dict.fromkeys(ENGINE_ROLES, 0)


if __name__ == "__main__":
    sys.exit(main())
