"""Decode side of the KV transfer: a threaded TCP server that writes verified pages."""

import contextlib
import hmac
import logging
import socket
import socketserver
import threading
from dataclasses import asdict

from kvfence_engine.contracts import TransferHello, TransferLayout
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import (
    END,
    HELLO,
    PAGE,
    Layout,
    TransferError,
    checksum,
    read_frame_header,
    recv_exact,
    send_reply,
)

log = logging.getLogger(__name__)


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
    ) -> None:
        self.reservations = reservations
        self.engine = reservations.engine
        self.layout = Layout.of(self.engine.pool)
        self.token = token
        self.idle_timeout = idle_timeout
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                receiver.serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

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
        sock.settimeout(self.idle_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            magic, frame = read_frame_header(sock)
            if magic != HELLO or not isinstance(frame, dict):
                raise TransferError("bad_frame", "a transfer must start with HELLO")
            # the token first: a sender without it learns nothing about what else is wrong
            if self.token is not None and not hmac.compare_digest(
                str(frame.get("token") or ""), self.token
            ):
                send_reply(sock, False, "unauthorized", "missing or wrong internal token")
                return
            hello = TransferHello.model_validate(frame)
            if hello.layout != TransferLayout(**asdict(self.layout)):
                raise TransferError("layout_mismatch", f"sender layout {hello.layout.model_dump()}")
            if hello.checksum != self.engine.args.kv_checksum:
                raise TransferError(
                    "checksum_setting",
                    "prefill and decode disagree on "
                    "--no-kv-checksum; both ends must use the same setting",
                )
            seq = self.reservations.begin_transfer(
                hello.request_id, hello.seq_id, hello.pages, hello.tags
            )
        except EngineError as exc:
            send_reply(sock, False, exc.code, exc.message)
            return
        except (TransferError, OSError, ValueError) as exc:  # ValidationError is a ValueError
            log.warning("transfer refused: %s", exc)
            _try_reply(sock, False, getattr(exc, "code", "bad_frame"), str(exc))
            return
        self._receive(sock, seq)

    def _receive(self, sock: socket.socket, seq: Request) -> None:
        engine = self.engine
        page_bytes = self.layout.page_bytes
        buffer = bytearray(page_bytes)
        error: EngineError | None = None
        try:
            while True:
                magic, header = read_frame_header(sock)
                if magic == END:
                    break
                if magic != PAGE or not isinstance(header, tuple):
                    raise TransferError("bad_frame", f"unexpected {magic!r} frame")
                index, page, tag, tokens, digest, nbytes = header
                if nbytes != page_bytes or not 0 < tokens <= self.layout.page_size:
                    raise TransferError(
                        "bad_frame", f"page frame of {nbytes} bytes/{tokens} tokens"
                    )
                payload = recv_exact(sock, nbytes, buffer)
                if engine.args.kv_checksum:
                    if checksum(payload) != digest:
                        engine.metrics.checksum_failed.inc()
                        raise TransferError("checksum_failed", f"page {index} failed its checksum")
                    engine.metrics.checksum_verified.inc()
                self.reservations.receive_page(seq, page, tag, tokens, payload)
        except (TransferError, OSError) as exc:
            code = getattr(exc, "code", "transfer_incomplete")
            error = EngineError(502, f"KV transfer failed: {exc}", "server_error", code)
        final = self.reservations.end_transfer(seq, error)
        if final is None:
            _try_reply(sock, True)
        else:
            _try_reply(sock, False, final.code, final.message)


def _try_reply(sock: socket.socket, ok: bool, code: str = "", message: str = "") -> None:
    with contextlib.suppress(OSError):  # the sender is gone; the request failed on our side
        send_reply(sock, ok, code, message)
