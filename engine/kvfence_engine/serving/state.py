"""What an engine's HTTP layer serves: its role, the internal token, metrics and the engine
once loaded (in the background, so /healthz answers while it loads and /readyz says "loading"
or why it failed)."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfence_engine.contracts import Role
from kvfence_engine.core import errors
from kvfence_engine.core.metrics import EngineMetrics
from kvfence_engine.serving.async_engine import AsyncEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    """What the HTTP layer serves; `engine` is set once weights and pool are allocated."""

    role: Role = Role.COMBINED
    internal_token: str | None = None
    metrics_token_sha256: bytes | None = None  # Prometheus's token: opens /metrics only
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    engine: AsyncEngine | None = None
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    on_ready: list[Callable[[AsyncEngine], None]] = field(default_factory=list)

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise errors.not_ready()
        return self.engine

    def load_in_background(
        self,
        build: Callable[[EngineMetrics], AsyncEngine],
        on_failure: Callable[[str], None] = lambda error: None,
    ) -> None:
        """Health answers while the weights load (which can take minutes); a failure is said
        on /readyz and handed to `on_failure`, which `kvfence serve` turns into its exit."""

        def run() -> None:
            try:
                engine = build(self.metrics)
                for hook in self.on_ready:  # before its loop runs: a hook may add chores
                    hook(engine)
                engine.start()
                self.engine = engine
                log.info("engine ready: %s", engine.engine.kvpool_report().model_dump(mode="json"))
            except Exception as exc:
                self.load_error = f"{type(exc).__name__}: {exc}"
                # a bad source or setting says all in its message; anything else is a bug
                expected = isinstance(exc, (ValueError, OSError))
                log.error("engine failed to start: %s", self.load_error, exc_info=not expected)
                on_failure(self.load_error)

        threading.Thread(target=run, name="kvfence-loader", daemon=True).start()
