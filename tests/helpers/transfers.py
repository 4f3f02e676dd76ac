"""A raw transfer client: it reserves pages on a decode engine and sends KV pages the way a
prefill would, so a test can make writes arrive late, or a transfer stop halfway."""

import uuid

import httpx
import torch

from kvfence_engine.disagg.transfer import Handle, Layout, page_views
from kvfence_engine.loading.loader import TINY_CONFIG

from .engines import prompt_of

PAGE = 16
LAYOUT = Layout(
    TINY_CONFIG.num_layers, PAGE, TINY_CONFIG.num_kv_heads, TINY_CONFIG.head_dim, "float32"
)


def reserve(decode_url: str, length: int, seed: int) -> Handle:
    rid = uuid.uuid4().hex
    r = httpx.post(
        decode_url + "/internal/reserve",
        json={
            "request_id": rid,
            "prompt_ids": prompt_of(length, seed),
            "sampling": {"logprobs": 0},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    body.pop("max_tokens")
    return Handle(**body)


def kv_pages(count: int, value: float) -> list[tuple[memoryview, memoryview]]:
    shape = (count, LAYOUT.layers, PAGE, LAYOUT.kv_heads, LAYOUT.head_dim)
    gen = torch.Generator().manual_seed(int(value * 1000))
    return page_views(
        torch.randn(shape, generator=gen) * value, torch.randn(shape, generator=gen) * value
    )
