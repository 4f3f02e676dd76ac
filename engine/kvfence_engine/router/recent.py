"""A value that is read again at most once per `seconds`: concurrent readers of a stale value
wait for the one read in progress instead of starting their own. What the router keeps of
views a tenant may ask for as often as it likes (GET /v1/kvpool, issue 33, finding 7): a
flood of them costs the backends one read per second, not one per request.

A failed read is not kept: the next reader tries again."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Recent(Generic[T]):
    seconds: float
    clock: Callable[[], float] = time.monotonic
    _value: T | None = None
    _read_at: float = float("-inf")
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, read: Callable[[], Awaitable[T]]) -> T:
        if (value := self._fresh()) is not None:
            return value
        async with self._lock:
            if (value := self._fresh()) is not None:  # read while this one waited
                return value
            value = await read()
            self._value, self._read_at = value, self.clock()
            return value

    def _fresh(self) -> T | None:
        return self._value if self.clock() - self._read_at < self.seconds else None
