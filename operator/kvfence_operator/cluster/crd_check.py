"""The installed CRD, checked against the one this operator was built for (crd/installed.py):
at start, and again while it is outdated, so a CRD upgraded after the operator is seen within
`recheck_seconds` without a restart. Once it holds every field it is not read again."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.installed import (
    OPENAPI_PATH,
    missing_fields,
    outdated_message,
    published_schema,
)

log = logging.getLogger(__name__)
RECHECK_SECONDS = 15.0


class DocumentReader(Protocol):
    def document(self, path: str) -> dict[str, object] | None: ...


@dataclass
class CrdCheck:
    kube: DocumentReader
    recheck_seconds: float = RECHECK_SECONDS
    clock: Callable[[], float] = time.monotonic
    _message: str | None = field(default=None, init=False)
    _checked_at: float | None = field(default=None, init=False)
    _current: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def outdated(self) -> str | None:
        """What is wrong with the installed CRD, or None when it holds this operator's fields
        (or cannot be read: the check is for compatibility, and a cluster that does not
        publish OpenAPI v3 is not refused)."""
        with self._lock:
            if self._current:
                return None
            now = self.clock()
            if self._checked_at is None or now - self._checked_at >= self.recheck_seconds:
                self._checked_at = now
                self._message = self._read()
                self._current = self._message is None
            return self._message

    def _read(self) -> str | None:
        try:
            document = self.kube.document(OPENAPI_PATH)
        except KubeError as exc:
            log.warning("the installed CRD could not be checked (%s): going on", exc)
            return None
        if document is None:
            log.warning(
                "the API server publishes no %s: the installed CRD is not checked", OPENAPI_PATH
            )
            return None
        missing = missing_fields(published_schema(document))
        return outdated_message(missing) if missing else None
