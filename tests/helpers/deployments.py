"""Disaggregated deployments of real processes on loopback, for tests: router + prefill + decode."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai

from kvfence_engine.tools.localproc import LocalProcess

from .engines import tiny_budget
from .processes import serve
from .waits import READY_S


@dataclass
class Deployment:
    router: LocalProcess
    prefills: list[LocalProcess]
    decodes: list[LocalProcess]
    extra: list[LocalProcess] = field(default_factory=list)

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.router.url + "/v1", api_key=key, max_retries=0, timeout=60
        )

    @property
    def all(self) -> list[LocalProcess]:
        return [self.router, *self.prefills, *self.decodes, *self.extra]

    def stop(self) -> None:
        for proc in self.all:
            proc.stop()


def start_deployment(
    logs: Path,
    name: str,
    *,
    prefills: int = 1,
    decodes: int = 1,
    context: int = 512,
    pages: int = 64,
    decode_pages: int | None = None,
    router_args: Sequence[str] = (),
    prefill_faults: Sequence[str] = (),
    decode_faults: Sequence[str] = (),
    token_file: Path | None = None,
    engine_args: Sequence[str] = (),
    allow_unsafe: bool = False,  # KVFENCE_ALLOW_UNSAFE=1 for the engines, faults or not
) -> Deployment:
    def engine(role: str, index: int, n_pages: int, faults: Sequence[str]) -> LocalProcess:
        args = [
            "--role",
            role,
            "--model",
            "builtin:tiny-random",
            "--context-length",
            str(context),
            "--kv-cache-memory",
            str(tiny_budget(n_pages)),
            "--transfer-port",
            "0",
            *engine_args,
        ]
        for fault in faults:
            args += ["--unsafe-fault", fault]
        if token_file is not None:
            args += ["--internal-token-file", str(token_file)]
        return serve(logs, f"{name}-{role}{index}", *args, unsafe=bool(faults) or allow_unsafe)

    pre = [engine("prefill", i, pages, prefill_faults) for i in range(prefills)]
    dec = [engine("decode", i, decode_pages or pages, decode_faults) for i in range(decodes)]
    args = ["router", "--model", "builtin:tiny-random", *router_args]
    for p in pre:
        args += ["--prefill", p.url]
    for d in dec:
        args += ["--decode", d.url]
    if token_file is not None:
        args += ["--internal-token-file", str(token_file)]
    router = LocalProcess(args, log_path=logs / f"{name}-router.log")
    deployment = Deployment(router, pre, dec)
    try:
        for proc in deployment.all:
            proc.start()
        for proc in deployment.all:
            proc.wait_ready(timeout=READY_S)
    except BaseException:
        deployment.stop()
        raise
    return deployment


def two_tenant_router_args(folder: Path, key_a: str, key_b: str, token: str) -> list[str]:
    """Router flags for tenants tenant-a and tenant-b (keys files written into `folder`) and
    an internal token."""
    keys, token_file = folder / "api-keys", folder / "internal-token"
    keys.write_text(f"{key_a} tenant-a\n{key_b} tenant-b\n")
    token_file.write_text(token + "\n")
    return ["--api-keys", str(keys), "--internal-token-file", str(token_file)]
