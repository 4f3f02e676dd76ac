"""Real `kvfence serve` processes, and what tests read from them over HTTP."""

import re
from pathlib import Path

from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import LocalProcess

from .pool_watch import watch_server


def serve(logs_dir: Path, name: str, *args: str, unsafe: bool = False) -> LocalProcess:
    env = {"KVFENCE_ALLOW_UNSAFE": "1"} if unsafe else {}
    proc = LocalProcess(
        ["serve", *args, "--threads", "1"], env=env, log_path=logs_dir / f"{name}.log"
    )
    flag = "--internal-token-file"
    token_file = Path(args[args.index(flag) + 1]) if flag in args else None
    return watch_server(proc, unsafe=unsafe, token_file=token_file)


def metric(url: str, name: str, token: str | None = None) -> float:
    """One sample of a Prometheus series (name including labels) from url/metrics (`token`:
    the engine's internal token, which its /metrics then requires)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = http_clients.get(url + "/metrics", headers=headers).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} missing from {url}/metrics"
    return float(match.group(1))
