"""The pool-whole invariant, checked around every test: an engine a test used ends the test with
at least as many free KV pages as it had when the test began (an engine the test created: every
page free). A page that never comes back is a leak another tenant pays for.

Engines register themselves when tests create them through tests/helpers (in-process engines
from `make_tiny_engine`, engine processes from `serve`); the autouse fixture in
tests/conftest.py snapshots them before each test and checks them after. Engines running an
`--unsafe-fault` are left out: the faults break isolation on purpose.
"""

import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import LocalProcess

# Deferred release: a decode engine frees an aborted request's pages when its transfer ends,
# and a client's disconnect reaches the engine a moment after the test's last assertion.
SETTLE_SECONDS = 10.0

_engines: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()
_books: list[DecodeReservations] = []  # held until the next check: nothing else may hold them
_servers: list[LocalProcess] = []
_token_files: dict[int, Path] = {}  # id(server) -> its --internal-token-file


def watch_engine(engine: LLMEngine) -> LLMEngine:
    if not engine.faults.enabled:
        _engines.add(engine)
    return engine


def watch_reservations(book: DecodeReservations) -> DecodeReservations:
    """A decode engine's reservations: one a test leaves open is released the way the engine's
    housekeeping would once its deadline passes (expired reservations are not leaks)."""
    _books.append(book)
    return book


def watch_server(
    proc: LocalProcess, *, unsafe: bool, token_file: Path | None = None
) -> LocalProcess:
    """token_file: the engine's internal token, which its /v1/kvpool then requires (read at
    each check: a test may write the file after starting the engine's definition)."""
    if not unsafe:
        _servers.append(proc)
        if token_file is not None:
            _token_files[id(proc)] = token_file
    return proc


@dataclass(frozen=True, slots=True)
class Level:
    free: int
    total: int


Snapshot = dict[int, Level]


def _server_level(proc: LocalProcess) -> Level | None:
    if proc.proc is None or proc.proc.poll() is not None:
        return None  # not started yet, or stopped: nothing to hold pages
    token_file = _token_files.get(id(proc))
    headers = {TOKEN_HEADER: token_file.read_text().strip()} if token_file is not None else {}
    try:
        r = http_clients.get(proc.url + "/v1/kvpool", headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None  # not listening (yet): nothing it holds can be read
    if r.status_code in (401, 403):  # a watch that cannot read the pool would pass silently
        raise AssertionError(f"{proc.describe()}: /v1/kvpool refused the pool watch "
                             f"({r.status_code}): register the engine's token file")  # fmt: skip
    try:
        report = r.json()
        return Level(int(report["free_pages"]), int(report["num_pages"]))
    except (ValueError, KeyError, TypeError):
        return None  # still loading, or failed on purpose: the test says what it expects


def _engine_level(engine: LLMEngine) -> Level:
    return Level(engine.pages.num_free, engine.pages.num_pages)


def snapshot() -> Snapshot:
    levels: Snapshot = {id(e): _engine_level(e) for e in list(_engines)}
    for proc in list(_servers):
        level = _server_level(proc)
        if level is not None:
            levels[id(proc)] = level
    return levels


def _drain(engine: LLMEngine, max_steps: int = 10_000) -> None:
    """Let requests a test left queued or running finish: what is still held after that is
    held for good."""
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()


def leaks(before: Snapshot) -> list[str]:
    """What each watched engine is missing now, against `before` (or against a whole pool for
    an engine the test created)."""
    found = []
    for book in _books:
        book.expire(float("inf"))
    _books.clear()
    for engine in list(_engines):
        _drain(engine)
        now = _engine_level(engine)
        start = before.get(id(engine), Level(now.total, now.total))
        if now.free < start.free:
            found.append(f"in-process engine ({engine.args.role}): {now.free} free pages of "
                         f"{now.total}, {start.free} at the start")  # fmt: skip
        reserved = engine.shares.by_tenant()
        if now.free == now.total and reserved:  # no request holds a page: none may reserve any
            found.append(f"in-process engine ({engine.args.role}): a whole pool, yet tenants "
                         f"still reserve pages of it: {reserved}")  # fmt: skip
    deadline = time.monotonic() + SETTLE_SECONDS
    for proc in list(_servers):
        if proc.proc is not None and proc.proc.poll() is not None:
            _servers.remove(proc)  # stopped for good: it holds nothing any more
            _token_files.pop(id(proc), None)
            continue
        while True:
            served = _server_level(proc)
            if served is None:
                break
            start = before.get(id(proc), Level(served.total, served.total))
            if served.free >= start.free:
                break
            if time.monotonic() > deadline:
                found.append(f"{proc.describe()}: {served.free} free pages of {served.total}, "
                             f"{start.free} at the start")  # fmt: skip
                break
            time.sleep(0.05)
    return found
