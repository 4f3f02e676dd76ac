"""Decode side of the KV transfer: a threaded TCP server that writes verified pages.

A transfer port is reachable by whatever the NetworkPolicy lets through, so the server bounds
what a connection may cost before it has proven anything: a complete HELLO within
`hello_timeout` seconds, and at most `max_connections` connections served at once (more are
told `too_many_connections` and closed). Every field of a PAGE frame is checked before its
payload is read or anything is written, and once a transfer began it always ends
(`DecodeReservations.end_transfer`), whatever went wrong, so its pages always come back. Every
refusal is a reply saying why, never a silent close.
"""

import contextlib
import logging
import socket
import socketserver
import threading
import time
from dataclasses import asdict

from pydantic import ValidationError

from kvfence_engine.auth import secret_matches
from kvfence_engine.contracts import ErrorCode, TransferHello, TransferLayout
from kvfence_engine.core import errors
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import (
    END,
    HELLO,
    PAGE,
    Layout,
    PageFrame,
    TransferError,
    checksum,
    read_frame_header,
    recv_exact,
    send_reply,
)

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0  # seconds a new connection has to send its whole HELLO
MAX_CONNECTIONS = 128  # transfer connections served at once; one thread and one page buffer each
LINGER = 1.0  # after a refusal, how long unread input is drained so the reply is not lost
LINGER_BYTES = 1 << 26


class KVReceiver:
    """Each connection runs on its own thread and writes through `reservations`, which
    matches it to a reservation and says which pages it may write."""

    def __init__(
        self,
        reservations: DecodeReservations,
        host: str,
        port: int,
        token: str | None,
        idle_timeout: float = 30.0,
        hello_timeout: float = HELLO_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.reservations = reservations
        self.engine = reservations.engine
        self.layout = Layout.of(self.engine.pages.kv)
        self.token = token
        self.idle_timeout = idle_timeout
        self.hello_timeout = hello_timeout
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refused_since_log = 0
        self._last_refusal_log = 0.0
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    receiver.serve_connection(self.request)
                finally:
                    receiver._slots.release()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
                # on the accepting thread: a connection over the cap never gets a thread
                if not receiver._slots.acquire(blocking=False):
                    receiver._refuse_over_cap(request)
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    receiver._slots.release()
                    raise

        self.server = Server((host, port), Handler)
        self.port = int(self.server.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="kv-receiver", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve_connection(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            seq, hello = self._hello(sock)
        except EngineError as exc:  # no such reservation, not its pages, a second transfer
            _refuse(sock, exc.code, exc.message)
            return
        except (TransferError, OSError) as exc:
            log.warning("transfer refused: %s", exc)
            code = exc.code if isinstance(exc, TransferError) else ErrorCode.BAD_FRAME
            _refuse(sock, code, str(exc))
            return
        except Exception:  # a bug: say so, keep the traceback in the log only
            log.exception("transfer refused: the HELLO could not be handled")
            _refuse(sock, ErrorCode.TRANSFER_FAILED, "the receiver could not handle the HELLO")
            return
        sock.settimeout(self.idle_timeout)
        self._receive(sock, seq, hello)

    def _hello(self, sock: socket.socket) -> tuple[Request, TransferHello]:
        """Read and check the HELLO within the deadline, and match it to its reservation."""
        deadline = time.monotonic() + self.hello_timeout
        try:
            magic, frame = read_frame_header(sock, deadline)
        except TransferError as exc:
            if exc.code is ErrorCode.TIMEOUT:
                raise TransferError(
                    ErrorCode.TIMEOUT, f"no complete HELLO within {self.hello_timeout:g} s"
                ) from exc
            raise
        if magic != HELLO or not isinstance(frame, dict):
            raise TransferError(ErrorCode.BAD_FRAME, "a transfer must start with HELLO")
        # the token first: a sender without it learns nothing about what else is wrong
        if self.token is not None and not secret_matches(frame.get("token"), self.token):
            raise TransferError(ErrorCode.UNAUTHORIZED, "missing or wrong internal token")
        try:
            hello = TransferHello.model_validate(frame)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "HELLO"
            raise TransferError(
                ErrorCode.BAD_FRAME, f"malformed HELLO ({where}: {first['msg']})"
            ) from exc
        if hello.layout != TransferLayout(**asdict(self.layout)):
            raise TransferError(
                ErrorCode.LAYOUT_MISMATCH, f"sender layout {hello.layout.model_dump()}"
            )
        if hello.checksum != self.engine.args.kv_checksum:
            raise TransferError(
                ErrorCode.CHECKSUM_SETTING,
                "prefill and decode disagree on "
                "--no-kv-checksum; both ends must use the same setting",
            )
        seq = self.reservations.begin_transfer(
            hello.request_id, hello.seq_id, hello.pages, hello.tags
        )
        return seq, hello

    def _receive(self, sock: socket.socket, seq: Request, hello: TransferHello) -> None:
        """The transfer has begun: whatever happens now, it ends, and the sender is told."""
        error: EngineError | None = None
        try:
            self._receive_pages(sock, seq, hello)
        except (TransferError, OSError) as exc:
            code = exc.code if isinstance(exc, TransferError) else ErrorCode.TRANSFER_INCOMPLETE
            error = errors.transfer_failed(f"KV transfer failed: {exc}", code)
        except Exception:  # a bug must not leave the reservation's pages fenced for good
            log.exception("KV transfer for %s failed", hello.request_id)
            error = errors.transfer_failed(
                "KV transfer failed: the receiver could not write a page", status=500
            )
        finally:
            final = self.reservations.end_transfer(seq, error)
        if final is None:
            _try_reply(sock, True)
        else:
            _refuse(sock, final.code, final.message)

    def _receive_pages(self, sock: socket.socket, seq: Request, hello: TransferHello) -> None:
        engine = self.engine
        assert seq.inbound is not None
        reserved_tokens = seq.inbound.reserved_tokens
        buffer = bytearray(self.layout.page_bytes)
        while True:
            magic, frame = read_frame_header(sock)
            if magic == END:
                return
            if magic != PAGE or not isinstance(frame, PageFrame):
                raise TransferError(ErrorCode.BAD_FRAME, f"unexpected {magic!r} frame")
            check_page_frame(frame, hello, reserved_tokens, self.layout)
            payload = recv_exact(sock, frame.nbytes, buffer)
            if engine.args.kv_checksum:
                if checksum(payload) != frame.digest:
                    engine.metrics.checksum_failed.inc()
                    raise TransferError(
                        ErrorCode.CHECKSUM_FAILED, f"page {frame.index} failed its checksum"
                    )
                engine.metrics.checksum_verified.inc()
            self.reservations.receive_page(seq, frame.page, frame.tag, frame.tokens, payload)

    def _refuse_over_cap(self, sock: socket.socket) -> None:
        """(accepting thread) Tell a connection over the cap why it is closed, without waiting
        on it: the reply fits an empty socket buffer."""
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_refusal_log > 10.0:
            log.warning(
                "transfer port: %d connection(s) refused, %d already open (--transfer-max-"
                "connections)",
                self._refused_since_log,
                self.max_connections,
            )
            self._refused_since_log, self._last_refusal_log = 0, now
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # what already arrived, so close sends no RST
                sock.recv(1 << 16)
            send_reply(
                sock,
                False,
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the transfer port already serves {self.max_connections} connections",
            )
            sock.shutdown(socket.SHUT_WR)


def check_page_frame(
    frame: PageFrame, hello: TransferHello, reserved_tokens: int, layout: Layout
) -> None:
    """Every field of a PAGE frame, before its payload is read or anything is written: its
    index names one of the HELLO's pages (begin_transfer matched them to the reservation),
    its page and tag are that index's, its tokens fit what the reservation has in that page,
    and its payload is exactly one page."""
    i = frame.index
    if i >= len(hello.pages):
        raise TransferError(
            ErrorCode.BAD_FRAME, f"page frame {i}: the reservation has {len(hello.pages)} pages"
        )
    if frame.page != hello.pages[i] or frame.tag != hello.tags[i]:
        raise TransferError(
            ErrorCode.BAD_FRAME, f"page frame {i} names a page or tag that is not the reservation's"
        )
    room = min(layout.page_size, reserved_tokens - i * layout.page_size)
    if not 0 < frame.tokens <= room:
        raise TransferError(
            ErrorCode.BAD_FRAME,
            f"page frame {i} carries {frame.tokens} tokens; its page holds 1 to {room}",
        )
    if frame.nbytes != layout.page_bytes:
        raise TransferError(
            ErrorCode.BAD_FRAME,
            f"page frame {i} has a payload of {frame.nbytes} bytes; a page is {layout.page_bytes}",
        )


def _refuse(sock: socket.socket, code: ErrorCode, message: str) -> None:
    """Reply with the reason, then drain what the sender still sends for a moment (bounded),
    so closing with unread input does not reset the connection before it reads the reply."""
    with contextlib.suppress(OSError):
        sock.settimeout(LINGER)  # not what is left of a deadline that may have passed
    _try_reply(sock, False, code, message)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER
        drained = 0
        while drained < LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            drained += len(chunk)


def _try_reply(
    sock: socket.socket, ok: bool, code: ErrorCode | None = None, message: str = ""
) -> None:
    with contextlib.suppress(OSError):  # the sender is gone; the request failed on our side
        send_reply(sock, ok, code, message)
