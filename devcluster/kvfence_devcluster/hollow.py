"""Hollow pods (kubemark's "hollow node" idea): with `KubeletOptions(hollow=True)` (or
`kvfence-devcluster --hollow`) each `kvfence` container runs this small process instead, so
that a test cluster can hold a hundred InferenceDeployments on a laptop. It is NOT an engine:
it answers what the operator and the kubelet ask of a container and nothing else, so a
measurement on hollow pods measures the operator and the API server, never the engines.

    python -P .../kvfence_devcluster/hollow.py serve|router|canary ARGS   (the container's args)

Run as a file, not with -m: `-m` would import the package (kmock, the kubernetes client,
pytest), three times the memory a hollow server needs; -P keeps this folder off sys.path (its
selectors.py would shadow the standard library's).

It reads the container's real command line and answers with the typed contracts the real
processes use (kvfence_engine.contracts):

- `serve`: GET /healthz, /readyz (EngineReadiness "ready") and /v1/kvpool (a KvPoolReport for
  its --role and --revision, with the internal token required when --internal-token-file is
  given). The pool is what the real engine's arithmetic (pool_plan.plan_pool) gives for
  --kv-cache-memory and --page-size with builtin:tiny-random's KV cost per token (768 bytes,
  whatever --model says; --memory-fraction takes a share of HOLLOW_DEVICE_BYTES); a budget
  that holds no page, or a --model path that does not exist, exits 1 with the engine's reason
  in the termination log, in the engine's words. No model, no /v1/completions, no KV
  transfers.
- `router`: GET /healthz, /readyz, and GET/PUT /internal/v1/backends (BackendsInForce, the
  backends file at start, the newest version pushed after; internal token required). It routes
  nothing.
- `canary`: writes a canary summary line (CanaryReport.summary) that says it checked nothing
  to --termination-log and exits with its verdict's code: 0 (pass) unless the test gave the
  pod the hollow-only flag `--hollow-verdict fail` (exit 1, a "finding") or `cannot-run`
  (exit 2, no verdict), through `KubeletOptions.amend_argv`. A test of what the operator does
  with a verdict chooses the verdict so; it never stands for a canary that caught a fault (the
  real `kvfence canary` refuses the flag: exit 2). With `--hollow-wait-for FILE` it gives its
  verdict only once FILE exists: a test's way to hold a rollout while its canary runs.

`serve` reports each `--unsafe-fault` it is given in /v1/kvpool (`no-tag-check` also as
tag_check false), as the real engine does, and has none of their effects.

Plain http.server and pydantic, no torch: about 25 MB per process (the canary, which exits at
once, loads more).
"""

import argparse
import json
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvfence_engine.auth import presents_internal_token
from kvfence_engine.contracts import (
    BackendsFile,
    BackendsInForce,
    BackendsSource,
    EngineReadiness,
    KvPoolReport,
    Role,
)
from kvfence_engine.core.pool_plan import ContextPolicy, effective_context, plan_pool
from kvfence_engine.loading.config import TINY_CONFIG, source_error
from kvfence_engine.tools.units import parse_size

HOLLOW = "hollow pod of the test kubelet (no engine)"
HOLLOW_DEVICE_BYTES = 1 << 30  # what --memory-fraction takes a share of
DTYPE_BYTES = 4  # float32 KV, as the real engine on a CPU
BACKENDS_PATH = "/internal/v1/backends"
# --hollow-verdict (canary): (CanaryReport.outcome, exit code, what the summary says)
HOLLOW_VERDICTS = {
    "pass": ("pass", 0, "passed"),
    "fail": ("fail", 1, "failed as the test asked (--hollow-verdict fail)"),
    "cannot-run": ("error", 2, "could not run, as the test asked (--hollow-verdict cannot-run)"),
}
HOLLOW_SCRIPT = str(Path(__file__).resolve())


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


Route = tuple[int, BaseModel | dict[str, Any]]


class HollowServer:
    """What one container answers: subclasses route GET and PUT by path."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.lock = threading.Lock()

    def require_token(self, headers: Any) -> None:
        if self.token is None:
            return
        if not presents_internal_token(headers, self.token):
            raise HttpError(401, "the internal token is required", "invalid_internal_token")

    def get(self, path: str, headers: Any) -> Route:
        if path == "/healthz":
            return 200, {"status": "ok"}
        raise HttpError(404, f"{path} is not served by a {HOLLOW}", "not_found")

    def put(self, path: str, headers: Any, body: bytes) -> Route:
        raise HttpError(404, f"PUT {path} is not served by a {HOLLOW}", "not_found")


class HollowEngine(HollowServer):
    def __init__(self, args: argparse.Namespace, token: str | None) -> None:
        super().__init__(token)
        if not args.model.startswith("builtin:") and not Path(args.model).exists():
            # the one check of --model it makes, with the engine's own words: a path that is
            # not in the container (no volume) crash-loops a real engine with this message
            raise source_error(args.model, "load", "config.json + *.safetensors")
        budget = (
            parse_size(args.kv_cache_memory)
            if args.kv_cache_memory is not None
            else int(HOLLOW_DEVICE_BYTES * (args.memory_fraction or 0.5))
        )
        plan = plan_pool(
            TINY_CONFIG, page_size=args.page_size, dtype_bytes=DTYPE_BYTES, budget_bytes=budget
        )
        policy = ContextPolicy(args.context_policy)
        role = Role(args.role)
        faults = sorted(set(args.unsafe_fault))
        self.report = KvPoolReport(
            role=role,
            revision=args.revision,
            pool_tokens=plan.pool_tokens,
            page_size=plan.page_size,
            num_pages=plan.num_pages,
            free_pages=plan.num_pages,
            kv_bytes_per_token=plan.kv_bytes_per_token,
            kv_dtype="float32",
            weight_dtype="float32",
            context_length_requested=args.context_length,
            context_length_effective=effective_context(
                args.context_length, plan.pool_tokens, plan.page_size, policy
            ),
            context_policy=str(policy),
            model_max_positions=TINY_CONFIG.max_positions,
            tag_check="no-tag-check" not in faults,
            kv_checksum=role is not Role.COMBINED and not args.no_kv_checksum,
            transfer_port=args.transfer_port if role is Role.DECODE else None,
            deferred_release=True,
            scrub_on_free=args.scrub_on_free,
            unsafe_faults=faults,
            model_name="tiny-random",
            model_source=args.model,
        )

    def get(self, path: str, headers: Any) -> Route:
        if path == "/readyz":
            return 200, EngineReadiness(status="ready")
        if path == "/v1/kvpool":
            self.require_token(headers)
            return 200, self.report
        return super().get(path, headers)


class HollowRouter(HollowServer):
    def __init__(self, args: argparse.Namespace, token: str | None) -> None:
        super().__init__(token)
        self.file = Path(args.backends_file) if args.backends_file else None
        self.source: BackendsSource = "flags"
        self.backends = BackendsFile()
        self.refresh()

    def refresh(self) -> None:
        """A backends file newer than the set in force replaces it, as in the real router."""
        if self.file is None or not self.file.exists():
            return
        try:
            written = BackendsFile.model_validate_json(self.file.read_text())
        except ValidationError:
            return
        if self.source != "push" or written.version > self.backends.version:
            self.source, self.backends = "file", written

    def in_force(self) -> BackendsInForce:
        return BackendsInForce(
            source=self.source, digest=self.backends.digest(), backends=self.backends
        )

    def require_pusher(self, headers: Any) -> None:
        if self.token is None:
            raise HttpError(
                403, f"{BACKENDS_PATH} is off: no --internal-token-file", "permission_error"
            )
        self.require_token(headers)

    def get(self, path: str, headers: Any) -> Route:
        if path == "/readyz":
            return 200, {"status": "ready"}
        if path == BACKENDS_PATH:
            self.require_pusher(headers)
            with self.lock:
                self.refresh()
                return 200, self.in_force()
        return super().get(path, headers)

    def put(self, path: str, headers: Any, body: bytes) -> Route:
        if path != BACKENDS_PATH:
            return super().put(path, headers, body)
        self.require_pusher(headers)
        try:
            pushed = BackendsFile.model_validate_json(body)
        except ValidationError as exc:
            raise HttpError(422, str(exc).splitlines()[0], "invalid_backends") from None
        if pushed.version == 0:  # as the real router: a push carries its version
            raise HttpError(422, "a push needs its version (>= 1)", "invalid_backends")
        with self.lock:
            self.refresh()
            if pushed.version < self.backends.version:
                raise HttpError(
                    409,
                    f"backends version {pushed.version} is older than the version "
                    f"{self.backends.version} in force",
                    "stale_backends",
                )
            self.source, self.backends = "push", pushed
            return 200, self.in_force()


def hollow_argv(argv: list[str]) -> list[str]:
    """What the kubelet runs instead of a `kvfence ...` container under KubeletOptions.hollow:
    this file with the same arguments. Other commands run as they are."""
    if argv and Path(argv[0]).name == "kvfence":
        return [sys.executable, "-P", HOLLOW_SCRIPT, *argv[1:]]
    return argv


def _handler(server: HollowServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            path = self.path.split("?")[0]
            try:
                if method == "GET":
                    status, payload = server.get(path, self.headers)
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    status, payload = server.put(path, self.headers, self.rfile.read(length))
                data = (
                    payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
                )
            except HttpError as exc:
                status = exc.status
                data = {"error": {"message": str(exc), "type": "hollow_pod", "code": exc.code}}
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_PUT(self) -> None:
            self._answer("PUT")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a hundred pods' access logs would be most of the bench's disk writes

    return Handler


def _serve(server: HollowServer, host: str, port: int) -> int:
    httpd = ThreadingHTTPServer((host, port), _handler(server))
    httpd.daemon_threads = True

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"{HOLLOW}: serving on {host}:{port}", flush=True)
    httpd.serve_forever(poll_interval=0.5)
    httpd.server_close()
    return 0


def _token(path: str | None) -> str | None:
    return Path(path).read_text().strip() or None if path else None


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfence (hollow)", add_help=False, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "router", "canary"):
        command = sub.add_parser(name, add_help=False, allow_abbrev=False)
        command.add_argument("--host", default="127.0.0.1")
        command.add_argument("--port", type=int, default=8000)
        command.add_argument("--internal-token-file")
        command.add_argument("--termination-log")
    serve = sub.choices["serve"]
    serve.add_argument("--role", default="combined")
    serve.add_argument("--revision", default="")
    serve.add_argument("--model", default="builtin:tiny-random")
    serve.add_argument("--kv-cache-memory")
    serve.add_argument("--memory-fraction", type=float)
    serve.add_argument("--page-size", type=int, default=16)
    serve.add_argument("--context-length", type=int, default=1024)
    serve.add_argument("--context-policy", default="refuse")
    serve.add_argument("--transfer-port", type=int)
    serve.add_argument("--unsafe-fault", action="append", default=[])
    serve.add_argument("--no-kv-checksum", action="store_true")
    serve.add_argument("--scrub-on-free", action="store_true")
    sub.choices["router"].add_argument("--backends-file")
    sub.choices["canary"].add_argument("--target", default="")
    sub.choices["canary"].add_argument("--hollow-verdict", choices=HOLLOW_VERDICTS, default="pass")
    sub.choices["canary"].add_argument("--hollow-wait-for", metavar="FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, _ = _parser().parse_known_args(argv)
    if args.command == "canary":
        # here only: the canary package is most of what a long-lived hollow server would load
        from kvfence_engine.canary.report import CanaryReport

        while args.hollow_wait_for and not Path(args.hollow_wait_for).exists():
            time.sleep(0.1)
        outcome, code, said = HOLLOW_VERDICTS[args.hollow_verdict]
        report = CanaryReport(
            target=args.target,
            outcome=outcome,
            exit_code=code,
            reason=f"{HOLLOW}: {said}; nothing checked (a test of the operator, not of the "
            "engines)",
            complete=True,
            started_at=datetime.now(UTC).isoformat(),
            seconds=0.0,
            requests=0,
            seed=0,
            facts=None,
            plan=None,
            checks=[],
            answers=[],
        )
        _write(args.termination_log, report.summary)
        print(report.summary, flush=True)
        return report.exit_code
    token = _token(args.internal_token_file)
    server: HollowServer
    if args.command == "serve":
        try:
            server = HollowEngine(args, token)
        except ValueError as exc:  # no such model, or a budget that holds no page
            reason = f"engine failed to start: ValueError: {exc}"  # as `kvfence serve` says it
            _write(args.termination_log, reason + "\n")
            print(f"kvfence serve: {reason}", file=sys.stderr, flush=True)
            return 1
    else:
        server = HollowRouter(args, token)
    return _serve(server, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
