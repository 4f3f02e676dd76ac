"""A transferred KV page whose bytes do not match its checksum is refused: decode counts it,
fails the transfer, and never decodes from that reservation."""

import time
from collections.abc import Iterator

import pytest
import torch

from helpers.pool_watch import watch_reservations
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.request import Request, SamplingParams, TokenLogprob
from kvfence_engine.disagg import transfer
from kvfence_engine.disagg.receiver import KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Handle, Layout, TransferError, send_kv
from kvfence_engine.loading.loader import TINY_CONFIG, tiny_random

PAGE = 16
PROMPT = list(range(1000, 1020))  # 20 tokens: two pages


@pytest.fixture
def decode() -> Iterator[DecodeReservations]:
    """A decode engine's reservations with their transfer receiver on a free port (no HTTP
    server needed)."""
    budget = TINY_CONFIG.kv_bytes_per_token(4) * PAGE * 8
    engine = LLMEngine(tiny_random(), EngineArgs(role="decode", kv_cache_memory=budget))
    book = watch_reservations(DecodeReservations(engine))
    receiver = KVReceiver(book, "127.0.0.1", 0, token=None)
    engine.args.transfer_port = receiver.port
    receiver.start()
    try:
        yield book
    finally:
        receiver.stop()


def reserve(book: DecodeReservations, request_id: str) -> tuple[Request, Handle]:
    seq = book.engine.admit(PROMPT, SamplingParams(max_tokens=1), max_tokens=4)
    return seq, book.reserve(seq, request_id)


def prompt_kv(handle: Handle) -> tuple[torch.Tensor, torch.Tensor]:
    c = TINY_CONFIG
    shape = (len(handle.pages), c.num_layers, PAGE, c.num_kv_heads, c.head_dim)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def checksum_counts(book: DecodeReservations) -> tuple[float | None, float | None]:
    registry = book.engine.metrics.registry
    return (
        registry.get_sample_value("kvfence_transfer_checksum_verified_total"),
        registry.get_sample_value("kvfence_transfer_checksum_failed_total"),
    )


def wait_until_received(seq: Request) -> None:
    """The sender may see the refusal (or a reset) before the receiver thread has finished."""
    assert seq.inbound is not None
    deadline = time.monotonic() + 10
    while not seq.inbound.done:
        assert time.monotonic() < deadline, "the receiver never ended the transfer"
        time.sleep(0.01)


def test_pages_with_matching_checksums_are_verified_and_the_request_decodes(
    decode: DecodeReservations,
) -> None:
    seq, handle = reserve(decode, "intact")
    k, v = prompt_kv(handle)
    send_kv(handle, k, v, len(PROMPT), Layout.of(decode.engine.pages.kv), token=None)
    wait_until_received(seq)
    assert checksum_counts(decode) == (2.0, 0.0)
    started = decode.start_decode("intact", TokenLogprob(1, 0.0))
    assert started is seq and seq.error is None


def test_a_page_whose_bytes_do_not_match_its_checksum_is_refused_and_never_decoded(
    decode: DecodeReservations, monkeypatch: pytest.MonkeyPatch
) -> None:
    seq, handle = reserve(decode, "corrupted")
    k, v = prompt_kv(handle)
    honest = transfer.checksum
    # Corruption on the wire: the sender states a digest its bytes do not have. The receiver
    # imported its own reference to the real function, so only the sender is affected.
    monkeypatch.setattr(transfer, "checksum", lambda *parts: honest(*parts) ^ 1)
    with pytest.raises((TransferError, OSError)):
        send_kv(handle, k, v, len(PROMPT), Layout.of(decode.engine.pages.kv), token=None)
    wait_until_received(seq)
    assert checksum_counts(decode) == (0.0, 1.0)
    with pytest.raises(EngineError) as refused:
        decode.start_decode("corrupted", TokenLogprob(1, 0.0))
    assert refused.value.code == "checksum_failed"
    assert seq.output_ids == []  # nothing was generated from the refused KV
    assert decode.engine.pages.num_used == 0  # the reservation's pages went back to the pool
