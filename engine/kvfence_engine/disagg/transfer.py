"""KV transfer from prefill to decode: framed TCP with a checksum per page and bounded batches.

Wire format (little endian), one connection per request, sender -> receiver:
  HELLO  b"KVFH" u32 len, JSON contracts.TransferHello {request_id, seq_id, pages, tags, token,
         layout, checksum}
  PAGE   b"KVFP" u32 index, u32 page, u64 tag, u32 tokens, u64 xxh3, u64 nbytes, then nbytes
         of payload: the page's K then V slots for every layer (full page, `tokens` valid)
  END    b"KVFE" u32 len, JSON {tokens_written}
receiver -> sender after END (or on a fatal error): u32 len, JSON {ok, code, message}.
The sender sends at most `batch_pages` pages per write and the receiver checks each page's
checksum and tag before writing it.
"""

import json
import socket
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash

from kvfence_engine.contracts import ErrorCode, TransferHello, TransferLayout
from kvfence_engine.core.kv_cache import KVCache

HELLO = b"KVFH"
PAGE = b"KVFP"
END = b"KVFE"
_PAGE_HEADER = struct.Struct("<4sIIQIQQ")
_LEN = struct.Struct("<I")
MAX_JSON = 1 << 20
REFUSAL_WAIT = 1.0  # after a failed send, how long the sender waits to read decode's reason


class TransferError(RuntimeError):
    """The transfer did not complete; `code` says why (for counters and HTTP errors)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Layout:
    layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv: KVCache) -> "Layout":
        """The shape of a pool's pages, every KV head of the model (a rank of a tensor-
        parallel engine holds some: a page travels whole): what both ends must agree on."""
        layers, _pages, page_size, _heads, head_dim = kv.k.shape
        dtype = str(kv.k.dtype).removeprefix("torch.")
        return cls(layers, page_size, kv.total_heads, head_dim, dtype)

    @property
    def page_bytes(self) -> int:
        """K and V of one page, every layer."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * itemsize


@dataclass(frozen=True, slots=True)
class Handle:
    """What decode hands out at reservation: where and into which pages to write."""

    request_id: str
    seq_id: int
    pages: list[int]
    tags: list[int]
    reserved_tokens: int
    transfer_port: int
    transfer_host: str = "127.0.0.1"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def checksum(*parts: memoryview | bytes) -> int:
    """XXH3-64 over the parts in order (K then V of a page): ~4x the speed of CRC-32 here,
    which keeps verification from halving the transfer rate."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def page_views(k: torch.Tensor, v: torch.Tensor) -> list[tuple[memoryview, memoryview]]:
    """k, v: [pages, layers, page_size, heads, dim] contiguous on the host -> per page, zero-copy
    byte views of its K and V."""
    assert k.is_contiguous() and v.is_contiguous()
    k_bytes = k.view(torch.uint8).numpy().reshape(k.shape[0], -1)
    v_bytes = v.view(torch.uint8).numpy().reshape(v.shape[0], -1)
    return [(memoryview(k_bytes[i]), memoryview(v_bytes[i])) for i in range(k.shape[0])]


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """sendmsg until every byte is out (it may send only part of the vector)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and len(views[0]) == 0:
            views.pop(0)


def _send_json(sock: socket.socket, magic: bytes, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    sock.sendall(magic + _LEN.pack(len(data)) + data)


def recv_exact(
    sock: socket.socket, n: int, into: bytearray | None = None, deadline: float | None = None
) -> memoryview:
    """n bytes, or TransferError. With a `deadline` (time.monotonic()) the whole read must
    finish by then, however the bytes trickle in; without one, the socket's timeout bounds
    each wait."""
    buf = into if into is not None and len(into) >= n else bytearray(n)
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(ErrorCode.TIMEOUT, f"deadline passed after {got}/{n} bytes")
            sock.settimeout(left)
        try:
            chunk = sock.recv_into(view[got:], n - got)
        except TimeoutError as exc:
            if deadline is None:
                raise  # an idle peer: the caller's OSError
            raise TransferError(
                ErrorCode.TIMEOUT, f"deadline passed after {got}/{n} bytes"
            ) from exc
        if chunk == 0:
            raise TransferError(
                ErrorCode.TRANSFER_INCOMPLETE, f"connection closed after {got}/{n} bytes"
            )
        got += chunk
    return view


def recv_json(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """A length-prefixed JSON object; anything else is a bad_frame TransferError."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline=deadline))
    if length > MAX_JSON:
        raise TransferError(ErrorCode.BAD_FRAME, f"JSON frame of {length} bytes is too large")
    data = bytes(recv_exact(sock, length, deadline=deadline))
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested too deep
        raise TransferError(ErrorCode.BAD_FRAME, "the frame is not valid JSON") from exc
    if not isinstance(body, dict):
        raise TransferError(ErrorCode.BAD_FRAME, "the frame is not a JSON object")
    return body


class Sender:
    """One transfer connection, sender side: HELLO, pages, END, then decode's verdict."""

    def __init__(
        self,
        handle: Handle,
        layout: Layout,
        *,
        token: str | None,
        timeout: float = 30.0,
        verify: bool = True,
    ) -> None:
        self.handle = handle
        self.layout = layout
        self.verify = verify
        self.sock = socket.create_connection((handle.transfer_host, handle.transfer_port), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = TransferHello(
            request_id=handle.request_id,
            seq_id=handle.seq_id,
            pages=handle.pages,
            tags=handle.tags,
            token=token,
            layout=TransferLayout(**asdict(layout)),
            checksum=self.verify,
        )
        _send_json(self.sock, HELLO, hello.model_dump())

    def send_pages(
        self, first: int, kv: list[tuple[memoryview, memoryview]], tokens: list[int]
    ) -> None:
        """Pages first, first+1, ... of the handle, with how many slots of each are valid."""
        parts: list[bytes | memoryview] = []
        for offset, ((k, v), filled) in enumerate(zip(kv, tokens, strict=True)):
            i = first + offset
            header = _PAGE_HEADER.pack(
                PAGE,
                i,
                self.handle.pages[i],
                self.handle.tags[i],
                filled,
                checksum(k, v) if self.verify else 0,
                len(k) + len(v),
            )
            parts += [header, k, v]
        _send_all(self.sock, parts)

    def finish(self, tokens_written: int) -> None:
        """Send END and wait for decode's verdict; raises TransferError if it refused."""
        _send_json(self.sock, END, {"tokens_written": tokens_written})
        refusal = _refusal(recv_json(self.sock))
        if refusal is not None:
            raise refusal

    def refusal(self) -> "TransferError | None":
        """After a send failed: decode's reason, if it refused and said why before it closed
        (e.g. too many connections, or a frame it would not take)."""
        try:
            self.sock.settimeout(REFUSAL_WAIT)
            return _refusal(recv_json(self.sock))
        except (OSError, TransferError):
            return None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_kv(
    handle: Handle,
    k: torch.Tensor,
    v: torch.Tensor,
    tokens_written: int,
    layout: Layout,
    *,
    token: str | None,
    batch_pages: int = 16,
    timeout: float = 30.0,
    verify: bool = True,
) -> None:
    """Stream the KV of `tokens_written` tokens into the handle's pages, at most `batch_pages`
    pages per write; returns once decode verified it. k, v: [pages, layers, page_size, heads,
    dim] on the host."""
    pages = k.shape[0]
    if pages > len(handle.pages):
        raise TransferError(
            ErrorCode.COUNT_MISMATCH, f"{pages} pages of KV for {len(handle.pages)} reserved"
        )
    views = page_views(k, v)
    size = layout.page_size
    with Sender(handle, layout, token=token, timeout=timeout, verify=verify) as sender:
        try:
            for start in range(0, pages, batch_pages):
                stop = min(start + batch_pages, pages)
                filled = [max(0, min(size, tokens_written - i * size)) for i in range(start, stop)]
                sender.send_pages(start, views[start:stop], filled)
            sender.finish(tokens_written)
        except OSError as exc:
            refusal = sender.refusal()
            if refusal is None:
                raise
            raise refusal from exc


@dataclass(frozen=True, slots=True)
class PageFrame:
    """A PAGE frame's header: which of the HELLO's pages (`index`), the pool page and tag it
    writes, how many of its slots are valid, the payload's checksum and length."""

    index: int
    page: int
    tag: int
    tokens: int
    digest: int
    nbytes: int


def read_frame_header(
    sock: socket.socket, deadline: float | None = None
) -> tuple[bytes, PageFrame | dict[str, Any]]:
    magic = bytes(recv_exact(sock, 4, deadline=deadline))
    if magic == PAGE:
        rest = recv_exact(sock, _PAGE_HEADER.size - 4, deadline=deadline)
        return magic, PageFrame(*_PAGE_HEADER.unpack(PAGE + bytes(rest))[1:])
    if magic in (HELLO, END):
        return magic, recv_json(sock, deadline)
    raise TransferError(ErrorCode.BAD_FRAME, f"unknown frame {magic!r}")


def _refusal(reply: dict[str, Any]) -> TransferError | None:
    if reply.get("ok") is True:
        return None
    try:
        code = ErrorCode(str(reply.get("code")))
    except ValueError:  # a code this version does not know: the message still says why
        code = ErrorCode.TRANSFER_FAILED
    return TransferError(code, str(reply.get("message")))


def send_reply(
    sock: socket.socket, ok: bool, code: ErrorCode | None = None, message: str = ""
) -> None:
    data = json.dumps({"ok": ok, "code": code or "", "message": message}).encode()
    sock.sendall(_LEN.pack(len(data)) + data)
