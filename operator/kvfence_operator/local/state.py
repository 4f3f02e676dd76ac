"""The `kvfence up` state folder, and the record an `up` that serves leaves in it.

`up` keeps one folder per revision, `<state folder>/<name>-<revision>` (the state folder is
`--state-dir`, default `up/` in the cache root): the engines' and router's logs, the revision's
internal token, the router's keys file, the canary cache. While it serves, `serving.json` there
says where and with what; `up` removes it when it stops. That is how `kvfence canary --target
http://127.0.0.1:8000`, run by hand against a local `up`, finds that `up`'s internal token and
its canary's timeout without being told (docs/canary.md#against-kvfence-up).

Standard library only: the canary's CLI reads it, and must stay light.
"""

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvfence_engine.tools.cache_dir import cache_root

SERVING_RECORD = "serving.json"
# The router of `up` listens on 127.0.0.1 only; a target naming these is this machine's.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def default_state_dir() -> Path:
    return cache_root() / "up"


@dataclass(frozen=True, slots=True)
class ServingRecord:
    """What `up` serves, for the commands run beside it."""

    name: str  # the manifest's metadata.name
    revision: str
    pid: int  # the `up` process: a record whose process is gone is stale (a killed `up`)
    url: str  # the router's, e.g. http://127.0.0.1:8000
    internal_token_file: str
    canary_timeout_seconds: float  # the manifest's spec.canary.timeoutSeconds

    @property
    def workdir(self) -> Path:
        return Path(self.internal_token_file).parent

    def write(self, workdir: Path) -> Path:
        path = workdir / SERVING_RECORD
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> "ServingRecord | None":
        """None for a file that is not a record (half written, from another version)."""
        try:
            fields = json.loads(path.read_text())
            record = cls(**fields)
        except (OSError, ValueError, TypeError):
            return None
        strings = (record.name, record.revision, record.url, record.internal_token_file)
        numbers = isinstance(record.pid, int) and isinstance(
            record.canary_timeout_seconds, int | float
        )
        return record if numbers and all(isinstance(v, str) for v in strings) else None

    def serves(self, target: str) -> bool:
        """Whether `target` (a URL as `kvfence canary --target` has it) is this router, and
        the `up` that wrote the record still runs."""
        port = _loopback_port(self.url)
        return port is not None and _loopback_port(target) == port and _running(self.pid)


def serving_at(target: str, state_dir: Path | None = None) -> ServingRecord | None:
    """The `up` whose router `target` is, from the records in the state folder; None when the
    target is not a local `up` of that folder (or none serves)."""
    if _loopback_port(target) is None:
        return None
    folder = state_dir or default_state_dir()
    for path in sorted(folder.glob(f"*/{SERVING_RECORD}")):
        record = ServingRecord.read(path)
        if record is not None and record.serves(target):
            return record
    return None


def _loopback_port(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    return port if parts.hostname in LOOPBACK_HOSTS else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it runs
        return True
    return True
