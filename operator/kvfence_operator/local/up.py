"""`kvfence up FILE.yaml`: the manifest a cluster takes, run on this machine.

Local processes stand in for pods; everything else is the operator's: the builders' command
lines, the pool decision (pool_gate.judge_pools), the canary gate and the promotion decision
(rollout.plan_rollout), the status (status.compute_status) and its printer columns.

What a cluster does for free is done here before anything starts, so that a mistake costs
seconds, not a model load: one `up` per state folder (a lock), the router's port held, the
model source, its positions and the device checked with the engine's own code, and the pool
check run on the pools `kvfence preflight` computes from the model's metadata (a pool too
small is refused before any engine loads; one that fits is checked again on the running
engines' own reports).
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml
from pydantic import ValidationError

import kvfence_engine
from kvfence_engine.contracts import EngineReadiness, PoolGateReport, ProgressReport
from kvfence_engine.core.pool_plan import ContextPolicy, effective_context
from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import (
    LocalProcess,
    ProcessFailed,
    last_line,
    loopback_socket,
    wait_all_ready,
)
from kvfence_engine.tools.progress import Progress
from kvfence_engine.tools.progress import say as say_line
from kvfence_operator.builders.engine_deployment import ENGINE_ROLES, caches_prefixes, engine_args
from kvfence_operator.builders.router_deployment import router_args, router_backends
from kvfence_operator.builders.secret import RevisionCredentials
from kvfence_operator.cluster.prober import read_pool
from kvfence_operator.crd.types import (
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    PoolPolicy,
    Role,
    RoleReplicas,
)
from kvfence_operator.decisions.pool_gate import PodPool, PoolDecision, judge_pools
from kvfence_operator.decisions.rollout import (
    CanaryOutcome,
    JobPhase,
    RevisionObservation,
    plan_rollout,
)
from kvfence_operator.decisions.scaling import starting_counts
from kvfence_operator.decisions.status import compute_status
from kvfence_operator.local.printer import table
from kvfence_operator.local.state import SERVING_RECORD, ServingRecord, default_state_dir
from kvfence_operator.local.tenants import LocalTenants, TenantsError
from kvfence_operator.revision import revision_of

START_TIMEOUT_SECONDS = 900.0
KEYS_FILE_HEADER = (
    "# Written by `kvfence up` at every start: the canary's tenants, then --api-key and\n"
    "# --tenant KEY=NAME. Edits here are lost; keep keys of your own in a file given to\n"
    "# --api-keys FILE (re-read when it changes).\n"
)
# (model source, contextLength, device) -> why engines could not start, or None. Given by the
# CLI: the checks need the engine's dependencies, which the operator package must not import.
EngineCheck = Callable[[str, int, str], str | None]
# A `kvfence serve` command line -> the pool it will allocate, (num_pages, page_size), by
# `kvfence preflight`'s arithmetic from the model's metadata; None where only the engine can
# say (a --memory-fraction of a device, a budget that holds no page). Given by the CLI, for
# the same reason as EngineCheck.
PoolEstimate = Callable[[Sequence[str]], tuple[int, int] | None]
PROGRESS_POLL_SECONDS = 0.5
QUIET = 10.0  # off a terminal, a phase says its line again after this long without one


class UpError(Exception):
    """Something the user must fix; the message says what."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised wherever `up` is (loading, canary, serving). A
    KeyboardInterrupt, so that neither `except Exception` nor asyncio (the canary) keeps it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended


def with_local_source(document: dict[str, Any]) -> dict[str, Any]:
    """The manifest with a relative `spec.model.source` (`./x.gguf`, `models/x.gguf`) made
    absolute against the working directory, as `kvfence serve --model` reads it: on this
    machine a relative path names a file here. The CRD takes only builtin:NAME or an absolute
    path (a pod has no working directory of the user's), and its pattern would refuse it."""
    spec = document.get("spec")
    if not isinstance(spec, dict) or not isinstance(model := spec.get("model"), dict):
        return document
    source = model.get("source")
    if not isinstance(source, str) or not source or source.startswith(("builtin:", "/")):
        return document
    local = {**model, "source": str(Path(source).absolute())}
    return {**document, "spec": {**spec, "model": local}}


def load_manifest(path: Path) -> InferenceDeployment:
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise UpError(f"cannot read {path}: {exc}") from exc
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceDeployment"]
    if len(found) != 1:
        raise UpError(f"{path} must hold exactly one InferenceDeployment, found {len(found)}")
    try:
        return InferenceDeployment.model_validate(with_local_source(found[0]))
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
    def processes(self) -> dict[str, LocalProcess]:
        procs = {name: proc for name, (_, proc) in self.engines.items()}
        return procs | ({"router": self.router} if self.router else {})

    def stop(self) -> list[str]:
        """Stop every process still running; their names."""
        running = {
            name: proc
            for name, proc in self.processes.items()
            if proc.proc is not None and proc.proc.poll() is None
        }
        with ThreadPoolExecutor() as pool:
            list(pool.map(lambda p: p.stop(), running.values()))
        return list(running)


@contextlib.contextmanager
def state_lock(workdir: Path, name: str) -> Iterator[None]:
    """One `up` per state folder: a second one would overwrite the first's internal token and
    keys, and the first router would then refuse every request. The kernel drops the lock when
    its process ends, however it ends."""
    path = workdir / "up.lock"
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            pid = lock.read().strip() or "unknown"
            raise UpError(
                f"{name} is already running (pid {pid}) from {workdir}: stop it first, or "
                "give this one another --state-dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield


def reserve_port(port: int) -> socket.socket:
    """Hold the router's port from before the engines load until the router starts, which is
    handed this socket itself: a port in use is found in a second, not after minutes of
    loading, and nothing else can bind it meanwhile. Port 0: any free port."""
    try:
        return loopback_socket(port)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise UpError(
            f"the router's port {port} is not free ({reason}): choose another with --port N "
            "(make up PORT=N)"
        ) from None


def _write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@dataclass(frozen=True, slots=True)
class PrefixCacheFiles:
    """The revision Secret's prefix-cache secrets, as files on this machine."""

    prefix_cache_secret: Path
    routing_secret: Path

    @classmethod
    def write(cls, workdir: Path, credentials: RevisionCredentials) -> "PrefixCacheFiles":
        return cls(
            _write_private(workdir / "prefix-cache-secret", credentials.prefix_cache_secret + "\n"),
            _write_private(workdir / "routing-secret", credentials.routing_secret + "\n"),
        )

    def overrides(self, spec: InferenceDeploymentSpec, role: Role) -> dict[str, list[str]]:
        """Where the pods' mounted secret files are here, for the flags this role's command
        has (none when spec.engine.prefixCache is off: an override would add the flag)."""
        if role is Role.ROUTER:
            on = spec.engine.prefix_cache.enabled
            return {"--routing-secret-file": [str(self.routing_secret)]} if on else {}
        if caches_prefixes(spec, role):
            return {"--prefix-cache-secret-file": [str(self.prefix_cache_secret)]}
        return {}


def prepare_engines(
    manifest: InferenceDeployment,
    local: LocalDeployment,
    token_file: Path,
    device: str,
    threads: int | None,
    secrets: PrefixCacheFiles,
) -> None:
    """Each engine process of the revision, with its command line and port, started not yet:
    its pool can be estimated from that command line before anything loads."""
    spec, revision, workdir = manifest.spec, local.revision, local.workdir
    counts = starting_counts(spec)
    for role in ENGINE_ROLES:
        replicas = counts.of(role)
        assert replicas is not None
        for i in range(replicas):
            name = f"{manifest.metadata.name}-{revision}-{role}-{i}"
            args = override_flags(
                engine_args(spec, role, revision, device),
                {
                    "--host": ["127.0.0.1"],
                    "--port": [],  # LocalProcess hands over its bound socket (--listen-fd)
                    "--transfer-port": ["0"],  # any free port: decode reports the one it got
                    "--internal-token-file": [str(token_file)],
                    "--termination-log": [],  # the reason is the log's last line here
                    **({"--threads": [str(threads)]} if threads else {}),
                    **secrets.overrides(spec, role),
                },
            )
            proc = LocalProcess(args, log_path=workdir / f"{name}.log")
            local.engines[name] = (role, proc)


def start_engines(
    spec: InferenceDeploymentSpec, local: LocalDeployment, say: Callable[[str], None]
) -> None:
    say(f"starting {len(local.engines)} engine processes, model {spec.model.source}")
    for _, proc in local.engines.values():
        proc.start()
    with engine_progress(local, say) as shown:
        wait_ready({name: proc for name, (_, proc) in local.engines.items()}, say, shown.finish)


def estimated_pools(
    spec: InferenceDeploymentSpec, local: LocalDeployment, estimate: PoolEstimate
) -> list[PodPool] | None:
    """Each engine's pool as `kvfence preflight` computes it from the model's metadata, in
    the report the pool check reads, so that `judge_pools` gives the verdict (and the
    remedy) it will give the running engines, before any loads. Only the pool is estimated:
    the isolation defences are read from the running engines, after they start. None when
    an engine's pool cannot be told from its command line."""
    policy = ContextPolicy.LOWER if spec.pool_policy is PoolPolicy.LOWER_CONTEXT else None
    pools = []
    for name, (role, proc) in local.engines.items():
        planned = estimate(proc.args)
        if planned is None:
            return None
        num_pages, page_size = planned
        tokens = num_pages * page_size
        served = effective_context(
            spec.context_length, tokens, page_size, policy or ContextPolicy.REFUSE
        )
        report = PoolGateReport(
            role=role, revision=local.revision, pool_tokens=tokens, page_size=page_size,
            num_pages=num_pages, context_length_effective=served, tag_check=True,
            deferred_release=True,
        )  # fmt: skip
        pools.append(PodPool(name, str(role), local.revision, report=report))
    return pools


STARTING_STEP = "the process: python, torch, its HTTP server"


class EngineProgress:
    """What each engine is doing while it loads, from its /readyz: before its HTTP server
    answers, that its process is starting (python importing torch takes seconds, a minute on
    a busy machine); then its load steps and the counted work within one (a GGUF's tensors
    dequantized), a bar each on a terminal, lines otherwise (tools/progress.Progress, which
    also keeps a long step from being silent). The engines log to files; this is what a person
    at `up` sees of them.

    Each engine's work is a stack, as the engine reports it (tools/progress.current: the
    latest unfinished, within the ones before it): work shown that a report no longer holds is
    finished, whatever it last said (its last tensors may convert between two polls), and the
    engine ready means all of it is."""

    def __init__(
        self,
        names: Sequence[str],
        say: Callable[[str], None],
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._say = say
        self._stream = stream  # where bars are drawn, if a terminal (default: stdout)
        self._clock = clock  # for tests, as Progress's
        self._lock = threading.Lock()  # the watcher shows, `wait_ready` finishes
        self._shown: dict[str, list[tuple[str, Progress]]] = {}
        for name in names:
            starting = self._progress(name, "starting", 1, "step")
            starting.start_step(STARTING_STEP)
            self._shown[name] = [("", starting)]  # no label of the engine's: finished first

    def _progress(self, name: str, label: str, total: int, unit: str) -> Progress:
        return Progress(
            f"  {name}: {label}", total, unit=unit, stream=self._stream, write=self._say,
            quiet=QUIET, clock=self._clock,
        )  # fmt: skip

    def show(self, name: str, readiness: EngineReadiness | None) -> None:
        """What the engine's /readyz said (None: it does not answer yet)."""
        if readiness is None:
            return
        with self._lock:
            shown = self._shown.get(name)
            if shown is None:  # finished
                return
            if shown and shown[0][0] == "":  # it answers: its process has started
                self._end(shown, 0)
            if readiness.status != "loading" or readiness.progress is None:
                return
            chain: list[ProgressReport] = []  # the outermost work first
            report: ProgressReport | None = readiness.progress
            while report is not None:
                chain.insert(0, report)
                report = report.within
            kept = 0  # the work still under way: what is shown and reported alike
            while kept < min(len(shown), len(chain)) and shown[kept][0] == chain[kept].label:
                kept += 1
            self._end(shown, kept)  # what the engine has moved on from
            for report in chain[kept:]:
                shown.append((report.label, self._progress(name, report.label, report.total,
                                                           report.unit)))  # fmt: skip
            for i, ((_, progress), report) in enumerate(zip(shown, chain, strict=True)):
                progress.follow(report)  # the outer step's line before the work within it
                # the latest work speaks for the steps it is within
                progress.quiet = QUIET if i == len(chain) - 1 else None

    def finish(self, name: str) -> None:
        """The engine is ready: all it was doing is done."""
        with self._lock:
            shown = self._shown.pop(name, None)
            if shown is not None:
                self._end(shown, 0)

    def close(self) -> None:
        """Stopped watching (the engines are ready, or one failed): whatever is still shown
        goes, as it was last seen."""
        with self._lock:
            for shown in self._shown.values():
                for _, progress in reversed(shown):
                    progress.close()
            self._shown.clear()

    @staticmethod
    def _end(shown: list[tuple[str, Progress]], keep: int) -> None:
        """Finish the work above the first `keep`, the latest first."""
        while len(shown) > keep:
            _, progress = shown.pop()
            progress.finish()
            progress.close()


@contextlib.contextmanager
def engine_progress(local: LocalDeployment, say: Callable[[str], None]) -> Iterator[EngineProgress]:
    """EngineProgress, fed by a thread that polls each engine's /readyz."""
    shown = EngineProgress(list(local.engines), say)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(PROGRESS_POLL_SECONDS):
            for name, (_, proc) in local.engines.items():
                shown.show(name, _readiness(proc.url))

    watcher = threading.Thread(target=watch, name="kvfence-up-progress", daemon=True)
    watcher.start()
    try:
        yield shown
    finally:
        stop.set()
        watcher.join()
        shown.close()


def _readiness(url: str) -> EngineReadiness | None:
    """An engine's /readyz; None while it does not answer (its process is starting)."""
    try:
        answer = http_clients.get(url + "/readyz", timeout=PROGRESS_POLL_SECONDS)
        return EngineReadiness.model_validate_json(answer.content)
    except (httpx.HTTPError, ValueError):
        return None


def wait_ready(
    procs: Mapping[str, LocalProcess],
    say: Callable[[str], None],
    before_ready: Callable[[str], None] = lambda name: None,
) -> None:
    """All at once, each process and its /readyz: the first that exits or says it failed
    ends the wait within a second or so, quoting its own words and naming its log.
    `before_ready` is told a process is ready before that is said (its progress ends)."""
    started = time.monotonic()

    def ready(name: str, proc: LocalProcess) -> None:
        before_ready(name)
        say(f"  {name} ready ({time.monotonic() - started:.0f}s) on {proc.url}")

    try:
        wait_all_ready(procs, START_TIMEOUT_SECONDS, on_ready=ready)
    except ProcessFailed as exc:
        raise UpError(str(exc)) from None


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
    reserved_port: socket.socket,
    token_file: Path,
    keys_files: Sequence[Path],
    say: Callable[[str], None],
    secrets: PrefixCacheFiles,
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
            "--api-keys": [str(path) for path in keys_files],
            "--internal-token-file": [str(token_file)],
            **secrets.overrides(spec, Role.ROUTER),
        },
    )
    local.router = LocalProcess(args, reserved_port, log_path=local.workdir / "router.log")
    local.router.start()  # hands the held port to the router
    wait_ready({"router": local.router}, say)


def source_digest(package: Path) -> str:
    """A digest of a package's Python sources (names and contents): an editable install keeps
    its version string while its code changes. Reading ~100 small files takes milliseconds."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def engine_code_identity() -> str:
    """What the canary ran: the engine, router and canary code, all in kvfence_engine."""
    return source_digest(Path(kvfence_engine.__file__).parent)


def canary_cache_file(cache_dir: Path, revision: str, code: str) -> Path:
    """A canary passed is remembered for what it tested: the manifest's revision and the
    code (`engine_code_identity`), not only the version string."""
    from importlib.metadata import version

    return cache_dir / f"canary-{revision}-{version('kvfence')}-{code}.json"


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

    say(f"canary: tenant B tries to see tenant A's secret (timeout {timeout:.0f}s) ...")
    config = CanaryConfig(
        target=target,
        tenant_a_key=credentials.tenant_a_key,
        tenant_b_key=credentials.tenant_b_key,
        internal_token=credentials.internal_token,
        context_length=context,
        timeout=timeout,
    )
    steps = Progress(
        "canary", len(planned_steps(config.rounds)), write=lambda s: say(f"  {s}"), quiet=QUIET
    )
    with steps:
        report = run_canary(replace(config, progress=steps.start_step, notice=steps.say))
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


@dataclass(frozen=True, slots=True)
class LocalOptions:
    """How to run a manifest here: what a cluster has and a laptop must be told."""

    port: int
    tenants: LocalTenants
    device: str = "cpu"
    threads: int | None = None
    check_engines: EngineCheck | None = None
    estimate_pool: PoolEstimate | None = None


def up(
    path: Path,
    options: LocalOptions,
    state_dir: Path,
    wait: bool = True,
    say: Callable[[str], None] = say_line,
) -> int:
    """0 once served and stopped cleanly; 1 when the pool check or the canary refuses;
    UpError (exit 2) for a manifest, a check before start, or a process that failed;
    Interrupted on SIGINT or SIGTERM, after every process is stopped."""
    manifest = load_manifest(path)
    revision = revision_of(manifest.spec)
    workdir = state_dir / f"{manifest.metadata.name}-{revision}"
    workdir.mkdir(parents=True, exist_ok=True)
    with (
        state_lock(workdir, manifest.metadata.name),
        contextlib.closing(reserve_port(options.port)) as router_port,
    ):
        say(f"kvfence up: {manifest.metadata.name}, revision {revision} (logs in {workdir})")
        spec = manifest.spec
        if spec.autoscaling is not None:
            mode = spec.autoscaling.mode
            say(f"spec.autoscaling ({mode}) is a cluster's: kvfence up runs each role at its "
                "replicas, within minReplicas..maxReplicas, and scales no further")  # fmt: skip
        if spec.canary.schedule is not None:
            say(
                f"spec.canary.schedule ({spec.canary.schedule!r}) is a cluster's: kvfence up runs "
                "the canary once, before serving; `kvfence canary` by hand runs it again"
            )
        if options.check_engines is not None:
            # a GGUF's header holds its whole vocabulary: seconds to read, said first
            say(f"checking {spec.model.source}, the context, the device and the pools ...")
            problem = options.check_engines(spec.model.source, spec.context_length, options.device)
            if problem:
                raise UpError(problem)
        return _run(manifest, revision, workdir, router_port, options, state_dir, wait, say)


def _run(
    manifest: InferenceDeployment,
    revision: str,
    workdir: Path,
    router_port: socket.socket,
    options: LocalOptions,
    state_dir: Path,
    wait: bool,
    say: Callable[[str], None],
) -> int:
    created = datetime.now(UTC)
    spec = manifest.spec
    device = options.device
    credentials = RevisionCredentials.generate()
    token_file = _write_private(workdir / "internal-token", credentials.internal_token + "\n")
    keys_file = _write_private(  # up's own: rewritten at every start (local/tenants.py)
        workdir / "api-keys",
        KEYS_FILE_HEADER + credentials.api_keys_file() + options.tenants.keys_file_lines(),
    )
    keys_files = [keys_file, *options.tenants.files]
    secrets = PrefixCacheFiles.write(workdir, credentials)  # used where prefixCache is on
    counts = starting_counts(spec)
    replicas = {role: counts.of(role) or 0 for role in ENGINE_ROLES}
    local = LocalDeployment(manifest.metadata.name, revision, workdir)

    def judge(pools: list[PodPool]) -> PoolDecision:
        return judge_pools(
            pools,
            spec.pool_policy,
            spec.context_length,
            spec.min_context_length,
            pool_share=spec.tenant_limits.max_pool_share_per_tenant,
        )

    try:
        prepare_engines(manifest, local, token_file, device, options.threads, secrets)
        # preflight's arithmetic first: a pool too small is refused in a second, not after
        # the engines load (the verdict the running engines would get, from the same numbers)
        estimate = options.estimate_pool
        estimated = estimated_pools(spec, local, estimate) if estimate is not None else None
        if estimated is not None and not judge(estimated).sufficient:
            pools = estimated
            say("pool check from the model's metadata (kvfence preflight's arithmetic), "
                "before any engine loads:")  # fmt: skip
        else:
            start_engines(spec, local, say)
            pools = read_pools(local, credentials.internal_token)
        decision = judge(pools)
        for line in pool_lines(pools, decision):
            say(line)
        canary: CanaryOutcome | None = None
        if decision.sufficient:
            say(f"pool check ({spec.pool_policy}): {decision.message}")
            start_router(
                manifest, local, decision, router_port, token_file, keys_files, say, secrets
            )
            if spec.canary.enabled:
                assert local.router is not None and decision.effective_context is not None
                canary = run_canary_gate(
                    local.router.url,
                    credentials,
                    decision.effective_context,
                    float(spec.canary.timeout_seconds),
                    canary_cache_file(state_dir, revision, engine_code_identity()),
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
        assert local.router is not None
        ServingRecord(  # what `kvfence canary --target` of this router finds (local/state.py)
            manifest.metadata.name,
            revision,
            os.getpid(),
            local.router.url,
            str(token_file),
            float(spec.canary.timeout_seconds),
        ).write(workdir)
        say(f"serving: {endpoint}  (OpenAI API; {options.tenants.describe()})")
        if wait:
            _serve_until_stopped(local)
        return 0
    except Interrupted as exc:
        say(f"interrupted ({exc})")
        raise
    finally:
        (workdir / SERVING_RECORD).unlink(missing_ok=True)  # stale from here on
        say("stopping ...")
        stopped = local.stop()
        if stopped:
            say(f"stopped {', '.join(stopped)}")


def _serve_until_stopped(local: LocalDeployment) -> None:
    """Until Interrupted; a process that dies ends the run, in its own words."""
    while True:
        for name, proc in local.processes.items():
            if proc.proc is not None and proc.proc.poll() is not None:
                said = last_line(proc.log_path)
                raise UpError(
                    f"{name} exited with {proc.proc.returncode}: {said} (log: {proc.log_path})"
                )
        time.sleep(0.5)


def _interrupt(signum: int, frame: object) -> None:
    for other in (signal.SIGINT, signal.SIGTERM):  # one stop at a time: later signals wait
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


def run_up(
    args: Any,
    check_engines: EngineCheck | None = None,
    estimate_pool: PoolEstimate | None = None,
) -> int:
    """Exit codes: 1 refused by the pool check or the canary; 2 a problem to fix (the message
    says what); 130 on Ctrl-C (SIGINT), 143 on SIGTERM, once every process is stopped. Serving
    ends only that way, so 0 is for callers of `up` that do not wait."""
    state_dir = args.state_dir or default_state_dir()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe is noise here
    try:
        tenants = LocalTenants.make(args.api_key, args.tenants, args.api_keys)
    except TenantsError as exc:
        print(f"kvfence up: {exc}", file=sys.stderr)
        return 2
    options = LocalOptions(
        args.port, tenants, args.device, args.threads, check_engines, estimate_pool
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    try:
        return up(args.manifest, options, state_dir)
    except UpError as exc:
        print(f"kvfence up: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"kvfence up: interrupted ({exc}), exit {exc.exit_code}", file=sys.stderr)
        return exc.exit_code
