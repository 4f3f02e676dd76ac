"""The router's API keys: which tenant presents which key.

Keys files hold one "KEY TENANT" per line (blank lines and # comments allowed). Everything is
checked when a file is read, with the file and line of the first problem: a tenant name
becomes the start of every request id of that tenant, so it must fit the request-id pattern
(`kvfence_engine/contracts.py`'s RequestId); a key must be printable ASCII, or no
Authorization header could carry it; a key may name one tenant only.

The files are re-read when they change (each lookup stats them: a mounted Secret is updated
by swapping a symlink, so the path's inode, size or mtime changes), so a revoked key stops
working without a restart. A changed file that does not read cleanly is logged and the keys
read before stay in force.
"""

import logging
import os
import re
import uuid
from dataclasses import dataclass, field

from kvfence_engine.auth import secret_matches
from kvfence_engine.contracts import REQUEST_ID_CHARS, REQUEST_ID_MAX, TENANT_MAX

log = logging.getLogger(__name__)


def request_id_for(tenant: str) -> str:
    """A new request id of this tenant: the tenant, '-', 32 hex digits."""
    return f"{tenant}-{uuid.uuid4().hex}"


assert REQUEST_ID_MAX - len(request_id_for("")) == TENANT_MAX, "contracts.TenantName"
TENANT = re.compile(rf"[{REQUEST_ID_CHARS}]{{1,{TENANT_MAX}}}")
_KEY = re.compile(r"[!-~]+")  # printable ASCII without space: what a Bearer token carries


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line."""


FileState = tuple[int, int, int, int] | None  # (device, inode, size, mtime_ns); None: missing


def entry_problem(key: str, tenant: str) -> str | None:
    """What is wrong with one key and its tenant, or None; never quoting the key. Also what
    `kvfence up --tenant KEY=NAME` is held to: its entries end up in a keys file."""
    if not _KEY.fullmatch(key):
        return (
            "the key may hold only printable ASCII characters without spaces (an "
            "Authorization header carries nothing else)"
        )
    if not TENANT.fullmatch(tenant):
        return (
            f"tenant {tenant!r} is not a valid tenant name: use 1 to {TENANT_MAX} of the "
            "characters A-Z a-z 0-9 _ . : - (it starts every request id of the tenant)"
        )
    return None


def parse_keys_files(paths: list[str]) -> dict[str, str]:
    """key -> tenant from every file, or KeysFileError (OSError: a file cannot be read)."""
    keys: dict[str, str] = {}
    where: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for number, line in enumerate(f, 1):
                here = f"{path}:{number}"
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2:  # the line is not echoed: it may hold a key
                    raise KeysFileError(f"{here}: expected 'KEY TENANT', got {len(parts)} fields")
                key, tenant = parts
                if problem := entry_problem(key, tenant):
                    raise KeysFileError(f"{here}: {problem}")
                if key in keys:
                    raise KeysFileError(f"{here}: this key is already given at {where[key]}")
                keys[key], where[key] = tenant, here
    return keys


def _state(path: str) -> FileState:
    try:
        st = os.stat(path)  # follows the symlink a Secret mount swaps
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(slots=True)
class ApiKeys:
    """The keys in force, and the state of the files they were read from."""

    paths: list[str]
    keys: dict[str, str]
    _read: list[FileState] = field(default_factory=list)  # what `keys` came from
    _refused: list[FileState] | None = None  # a changed version already found bad

    @classmethod
    def load(cls, paths: list[str]) -> "ApiKeys | None":
        """None without files (every request is the default tenant). Raises KeysFileError
        or OSError: at start, a bad keys file is an error."""
        if not paths:
            return None
        states = [_state(path) for path in paths]
        return cls(list(paths), parse_keys_files(paths), states)

    def refresh(self) -> None:
        """Re-read the files if any changed since they were read."""
        states = [_state(path) for path in self.paths]
        if states == self._read or states == self._refused:
            return
        try:
            keys = parse_keys_files(self.paths)
        except (KeysFileError, OSError) as exc:
            self._refused = states
            log.error("API keys not reloaded, the previous keys stay in force: %s", exc)
            return
        self.keys, self._read, self._refused = keys, states, None
        log.info("API keys reloaded: %d keys, %d tenants", len(keys), len(set(keys.values())))

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key this is, or None. Every known key is compared in constant
        time, so how long this takes says nothing about which keys exist."""
        self.refresh()
        found = None
        for known, tenant in self.keys.items():
            if secret_matches(key, known):
                found = tenant
        return found
