"""Where kvfence keeps what it can rebuild: $KVFENCE_CACHE_DIR, else $XDG_CACHE_HOME/kvfence,
else ~/.cache/kvfence. No torch here: the operator side (`kvfence up`) and the router use it."""

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(
        os.environ.get("KVFENCE_CACHE_DIR")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfence"
        )
    )


def writable_cache_dir() -> Path | None:
    """The cache root, created if needed; None where it cannot be written (a read-only file
    system): no cache then, just slower starts."""
    root = cache_root()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        return None
    return root if os.access(root, os.W_OK) else None


# "off": no converted weights are cached (loading/config.py::converted_path); the operator sets
# it in engine pods, whose only writable space is a small scratch volume.
WEIGHTS_CACHE_ENV = "KVFENCE_WEIGHTS_CACHE"


def weights_cache_dir() -> Path | None:
    """Where converted weights are kept: the cache root, unless $KVFENCE_WEIGHTS_CACHE=off."""
    if os.environ.get(WEIGHTS_CACHE_ENV, "").lower() == "off":
        return None
    return writable_cache_dir()


def file_key(path: Path, salt: str = "") -> str:
    """Names what is cached of a file: its path, size and modification time (and salt)."""
    stat = path.stat()
    text = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256((text + (f":{salt}" if salt else "")).encode()).hexdigest()[:16]
