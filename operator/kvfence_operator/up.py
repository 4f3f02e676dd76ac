"""`kvfence up FILE.yaml`: the manifest a cluster takes, run on this machine.

Local processes stand in for pods; everything else is the operator's: the builders' command
lines, the pool decision (pool_gate.judge_pools), the canary gate and the promotion decision
(rollout.plan_rollout), the status (status.compute_status) and its printer columns.
"""

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import ValidationError

from kvfence_engine.contracts import EngineReadiness, ProgressReport
from kvfence_engine.tools.cache_dir import cache_root
from kvfence_engine.tools.localproc import LocalProcess, ProcessFailed, free_port
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES, engine_args
from kvfence_operator.builders.router_deployment import router_args, router_backends
from kvfence_operator.builders.secret import RevisionCredentials
from kvfence_operator.crd.types import (
    InferenceDeployment,
    InferenceDeploymentStatus,
    Role,
    RoleReplicas,
)
from kvfence_operator.pool_gate import PodPool, PoolDecision, judge_pools, read_pool
from kvfence_operator.printer import table
from kvfence_operator.revision import revision_of
from kvfence_operator.rollout import CanaryOutcome, JobPhase, RevisionObservation, plan_rollout
from kvfence_operator.status import compute_status

LOCAL_TENANT = "local"
START_TIMEOUT_SECONDS = 900.0
PROGRESS_POLL_SECONDS = 0.5


class UpError(Exception):
    """Something the user must fix; the message says what."""


def load_manifest(path: Path) -> InferenceDeployment:
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise UpError(f"cannot read {path}: {exc}") from exc
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceDeployment"]
    if len(found) != 1:
        raise UpError(f"{path} must hold exactly one InferenceDeployment, found {len(found)}")
    try:
        return InferenceDeployment.model_validate(found[0])
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise UpError(f"{path}: invalid InferenceDeployment: {problems}") from exc


def override_flags(args: Sequence[str], overrides: Mapping[str, Sequence[str]]) -> list[str]:
    """Drop every occurrence of the given flags (and their values) and append new values: the
    pod's paths and ports mean nothing on this machine. A flag mapped to [] is just dropped."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in overrides:
            skip = "=" not in arg
            continue
        kept.append(arg)
    for flag, values in overrides.items():
        for value in values:
            kept += [flag, value]
    return kept


@dataclass
class LocalDeployment:
    """One revision as local processes, with its credentials and router config in `workdir`."""

    name: str
    revision: str
    workdir: Path
    engines: dict[str, tuple[Role, LocalProcess]] = field(default_factory=dict)
    router: LocalProcess | None = None

    @property
    def processes(self) -> list[LocalProcess]:
        procs = [proc for _, proc in self.engines.values()]
        return procs + ([self.router] if self.router else [])

    def stop(self) -> None:
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda p: p.stop(), self.processes))


def _write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def start_engines(
    manifest: InferenceDeployment,
    revision: str,
    workdir: Path,
    token_file: Path,
    device: str,
    say: Callable[[str], None],
) -> LocalDeployment:
    spec = manifest.spec
    local = LocalDeployment(manifest.metadata.name, revision, workdir)
    for role in ENGINE_ROLES:
        replicas = spec.prefill.replicas if role is Role.PREFILL else spec.decode.replicas
        for i in range(replicas):
            name = f"{manifest.metadata.name}-{revision}-{role}-{i}"
            args = override_flags(
                engine_args(spec, role, revision, device),
                {
                    "--host": ["127.0.0.1"],
                    "--port": [],  # LocalProcess adds its own
                    "--transfer-port": [str(free_port())],
                    "--internal-token-file": [str(token_file)],
                },
            )
            proc = LocalProcess(args, log_path=workdir / f"{name}.log")
            local.engines[name] = (role, proc)
    say(f"starting {len(local.engines)} engine processes, model {spec.model.source}")
    for _, proc in local.engines.values():
        proc.start()
    with engine_progress(local, say):
        _wait_all(local, [p for _, p in local.engines.values()], say)
    return local


@contextmanager
def engine_progress(local: LocalDeployment, say: Callable[[str], None]) -> Iterator[None]:
    """While the engines load, show the work their /readyz reports (a weight conversion takes
    a while on a first start): a bar per engine on a terminal, a line every tenth of the way
    otherwise. The engines log to files; this is what a person at `up` sees of them."""
    from kvfence_engine.tools.progress import Progress

    shown: dict[tuple[str, str], Progress] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(PROGRESS_POLL_SECONDS):
            for name, (_, proc) in local.engines.items():
                report = _loading_progress(proc.url)
                if report is None:
                    continue
                key = (name, report.label)
                if key not in shown:
                    shown[key] = Progress(
                        f"  {name}: {report.label}", report.total, unit=report.unit, write=say
                    )
                shown[key].move_to(report.done)

    watcher = threading.Thread(target=watch, name="kvfence-up-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        for progress in shown.values():
            progress.close()


def _loading_progress(url: str) -> ProgressReport | None:
    """The work an engine's /readyz reports under way; None when it reports none (or is not
    answering yet: it is starting)."""
    try:
        answer = httpx.get(url + "/readyz", timeout=PROGRESS_POLL_SECONDS)
        return EngineReadiness.model_validate_json(answer.content).progress
    except (httpx.HTTPError, ValueError):
        return None


def _wait_all(
    local: LocalDeployment, procs: list[LocalProcess], say: Callable[[str], None]
) -> None:
    started = time.monotonic()
    for proc in procs:
        name = next((n for n, (_, p) in local.engines.items() if p is proc), "router")
        try:
            proc.wait_ready(timeout=START_TIMEOUT_SECONDS)
        except ProcessFailed as exc:
            raise UpError(f"{name} did not start: {exc}") from exc
        say(f"  {name} ready ({time.monotonic() - started:.0f}s) on {proc.url}")


def read_pools(local: LocalDeployment, internal_token: str) -> list[PodPool]:
    return [
        read_pool(name, str(role), local.revision, proc.url, internal_token)
        for name, (role, proc) in local.engines.items()
    ]


def pool_lines(pools: list[PodPool], decision: PoolDecision) -> list[str]:
    """One line per pod with its pool, then the verdict: a refusal's findings (each naming
    its pod) and remedy are said once, there."""
    lines = []
    for pool in pools:
        gate = decision.gates[pool.pod]
        size = f"{pool.report.pool_tokens} tokens" if pool.report else "unknown"
        lines.append(f"  {pool.pod}: pool {size} -> {'ok' if gate.sufficient else 'refused'}")
    return lines


def start_router(
    manifest: InferenceDeployment,
    local: LocalDeployment,
    decision: PoolDecision,
    port: int,
    token_file: Path,
    keys_file: Path,
    say: Callable[[str], None],
) -> None:
    spec = manifest.spec
    urls: dict[Role, list[str]] = {role: [] for role in ENGINE_ROLES}
    for name, (role, proc) in local.engines.items():
        if decision.gates[name].sufficient:
            urls[role].append(proc.url)
    backends = router_backends(
        spec, local.revision, decision.effective_context, urls[Role.PREFILL], urls[Role.DECODE]
    )
    backends_file = local.workdir / "backends.json"
    backends_file.write_text(backends.file_text())
    args = override_flags(
        router_args(spec),
        {
            "--host": ["127.0.0.1"],
            "--port": [],
            "--backends-file": [str(backends_file)],
            "--api-keys": [str(keys_file)],
            "--internal-token-file": [str(token_file)],
        },
    )
    local.router = LocalProcess(args, port=port, log_path=local.workdir / "router.log")
    local.router.start()
    _wait_all(local, [local.router], say)


def canary_cache_file(cache_dir: Path, revision: str) -> Path:
    from importlib.metadata import version

    return cache_dir / f"canary-{revision}-{version('kvfence')}.json"


def run_canary_gate(
    target: str,
    credentials: RevisionCredentials,
    context: int,
    timeout: float,
    cache: Path,
    say: Callable[[str], None],
) -> CanaryOutcome:
    """The same gate as the cluster's canary Job. An unchanged revision (and kvfence version)
    that passed before is not re-checked, just as the operator does not re-run a canary for a
    revision already serving."""
    if cache.exists():
        cached = json.loads(cache.read_text())
        say(f"canary: passed for this revision at {cached['at']} (cached in {cache})")
        return CanaryOutcome("local", JobPhase.SUCCEEDED, cached["summary"])
    from kvfence_engine.canary import CanaryConfig, planned_steps, run_canary
    from kvfence_engine.tools.progress import Progress

    say(f"canary: tenant B tries to see tenant A's secret (timeout {timeout:.0f}s) ...")
    config = CanaryConfig(
        target=target,
        tenant_a_key=credentials.tenant_a_key,
        tenant_b_key=credentials.tenant_b_key,
        internal_token=credentials.internal_token,
        context_length=context,
        timeout=timeout,
    )
    steps = Progress("canary", len(planned_steps(config.rounds)), write=lambda s: say(f"  {s}"))
    with steps:
        report = run_canary(replace(config, progress=steps.start_step))
    say(report.summary)
    if not report.passed:
        return CanaryOutcome("local", JobPhase.FAILED, report.summary)
    cache.write_text(json.dumps({"at": datetime.now(UTC).isoformat(), "summary": report.summary}))
    return CanaryOutcome("local", JobPhase.SUCCEEDED, report.summary)


def observe(local: LocalDeployment, decision: PoolDecision, replicas: Mapping[Role, int],
            canary: CanaryOutcome | None) -> RevisionObservation:  # fmt: skip
    ready: dict[str, RoleReplicas] = {}
    for role in ENGINE_ROLES:
        procs = [p for r, p in local.engines.values() if r is role]
        alive = [p for p in procs if p.proc is not None and p.proc.poll() is None]
        ready[str(role)] = RoleReplicas(ready=len(alive), desired=replicas[role])
    router_alive = local.router is not None and local.router.proc is not None
    ready[str(Role.ROUTER)] = RoleReplicas(ready=int(router_alive), desired=1)
    return RevisionObservation(local.revision, ready, decision, canary)


def status_object(
    manifest: InferenceDeployment, status: InferenceDeploymentStatus, created: datetime
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": manifest.metadata.name,
            "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        "status": status.model_dump(mode="json", by_alias=True),
    }


def up(
    path: Path,
    port: int,
    api_key: str,
    device: str,
    state_dir: Path,
    wait: bool = True,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """0 once served and stopped cleanly (Ctrl-C); 1 when the pool check or the canary
    refuses; 2 for a manifest or start-up problem."""
    created = datetime.now(UTC)
    manifest = load_manifest(path)
    spec = manifest.spec
    revision = revision_of(spec)
    workdir = state_dir / f"{manifest.metadata.name}-{revision}"
    workdir.mkdir(parents=True, exist_ok=True)
    credentials = RevisionCredentials.generate()
    token_file = _write_private(workdir / "internal-token", credentials.internal_token + "\n")
    keys_file = _write_private(
        workdir / "api-keys",
        credentials.api_keys_file() + f"{api_key} {LOCAL_TENANT}\n",
    )
    say(f"kvfence up: {manifest.metadata.name}, revision {revision} (logs in {workdir})")
    replicas = {Role.PREFILL: spec.prefill.replicas, Role.DECODE: spec.decode.replicas}
    local = start_engines(manifest, revision, workdir, token_file, device, say)
    try:
        pools = read_pools(local, credentials.internal_token)
        decision = judge_pools(
            pools,
            spec.pool_policy,
            spec.context_length,
            spec.min_context_length,
            pool_share=spec.tenant_limits.max_pool_share_per_tenant,
        )
        for line in pool_lines(pools, decision):
            say(line)
        canary: CanaryOutcome | None = None
        if decision.sufficient:
            say(f"pool check ({spec.pool_policy}): {decision.message}")
            start_router(manifest, local, decision, port, token_file, keys_file, say)
            if spec.canary.enabled:
                assert local.router is not None and decision.effective_context is not None
                canary = run_canary_gate(
                    local.router.url,
                    credentials,
                    decision.effective_context,
                    float(spec.canary.timeout_seconds),
                    canary_cache_file(state_dir, revision),
                    say,
                )
        else:
            say(f"pool check ({spec.pool_policy}) refused: {decision.message}")
        observed = {revision: observe(local, decision, replicas, canary)}
        plan = plan_rollout(revision, None, None, observed, spec.canary.enabled)
        endpoint = local.router.url + "/v1" if local.router else None
        status = compute_status(
            spec, 1, InferenceDeploymentStatus(), plan, observed, pools, endpoint, now=created
        )
        say(table([status_object(manifest, status, created)]))
        if plan.serve != revision:  # the reason was said above, once
            say("not serving: " + ("the canary failed" if canary else "the pool check refused"))
            return 1
        say(f"serving: {endpoint}  (OpenAI API; api key: {api_key})")
        if wait:
            _wait_for_interrupt(local, say)
        return 0
    finally:
        say("stopping ...")
        local.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_for_interrupt(local: LocalDeployment, say: Callable[[str], None]) -> None:
    """Until Ctrl-C or SIGTERM; a process that dies ends the run (its log says why)."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            for proc in local.processes:
                if proc.proc is not None and proc.proc.poll() is not None:
                    say(f"{proc.describe()} exited with {proc.proc.returncode}")
                    return
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("interrupted")


def default_state_dir() -> Path:
    return cache_root() / "up"


def run_up(args: Any) -> int:
    state_dir = args.state_dir or default_state_dir()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe is noise here
    try:
        return up(args.manifest, args.port, args.api_key, args.device, state_dir)
    except UpError as exc:
        print(f"kvfence up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
