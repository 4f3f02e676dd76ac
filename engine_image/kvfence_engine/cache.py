"""Where kvfence keeps what it can rebuild: $KVFENCE_CACHE_DIR, else $XDG_CACHE_HOME/kvfence,
else ~/.cache/kvfence. No torch here: the operator side (`kvfence up`) uses it too."""

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(
        os.environ.get("KVFENCE_CACHE_DIR")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvfence"
        )
    )
