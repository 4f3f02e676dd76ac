"""kvfence's small operators (native/ops.c): RMSNorm, RoPE, silu(gate) * up, and a decode
step's attention read in place from the paged pool.

What they must be: aten's answer (F.rms_norm, RoPE's bits, F.silu; the page gather and
scaled_dot_product_attention that core/attention.py runs where the kernel does not) and a
float64 one, for every shape the families here take (grouped-query heads, sliding windows,
pages in any order, lengths that end anywhere in a page); a position or page outside the pool
is refused before anything is read; and what the kernel does not take (another dtype, a
soft-cap, a partial rotary) still runs, on aten's path.
"""

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.engines import make_tiny_engine, prompt_of, run_until_done, submit
from kvfence_engine import native
from kvfence_engine.core.attention import FULL, Scoring, StepBatch, paged_attention
from kvfence_engine.core.layers import GatedMLP, RMSNorm, Weights
from kvfence_engine.core.model_config import RopeScaling
from kvfence_engine.core.rope import RopeAngles, Rotary

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text(),
    reason="the kernels are x86 AVX2 (elsewhere the engine runs aten's)",
)


@pytest.fixture
def kernels() -> native.Kernels:
    found = native.kernels()
    assert isinstance(found, native.Kernels), found
    return found


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 5, 64), (2, 8), (0, 64)])
def test_rms_norm_is_aten_s(kernels: native.Kernels, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    ours = kernels.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=2e-6, atol=2e-6)
    exact = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    torch.testing.assert_close(ours.double(), exact, rtol=2e-6, atol=2e-6)


def test_the_norm_layer_takes_the_kernel_where_it_can(kernels: native.Kernels) -> None:
    norm = RMSNorm(torch.randn(64), 1e-6)
    rows = torch.randn(4, 64)
    assert torch.equal(norm(rows), kernels.rms_norm(rows, norm.weight, 1e-6))
    # a view of every other head (q/k norms of a split) and another dtype: aten's
    heads = torch.randn(4, 6, 64)[:, ::2]
    torch.testing.assert_close(norm(heads), F.rms_norm(heads, (64,), norm.weight, 1e-6))
    half = RMSNorm(torch.randn(64).bfloat16(), 1e-6)
    x16 = rows.bfloat16()
    assert torch.equal(half(x16), F.rms_norm(x16, (64,), half.weight, 1e-6))
    with pytest.raises(ValueError, match="rms_norm"):
        kernels.rms_norm(rows, torch.randn(32), 1e-6)


def test_rope_is_aten_s_bits(kernels: native.Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every head of q and k turned by its token's angles, as a layer hands them over (a view
    of the fused q/k/v heads), bit for bit aten's; a partial rotary (Phi-4-mini) on aten's."""
    rotary = Rotary(64, 4096, 10000.0, RopeScaling(), None)
    angles = rotary(torch.tensor([0, 5, 4095, 17]), torch.float32)
    fused = torch.randn(4, 9 + 3 + 3, 64, generator=torch.Generator().manual_seed(13)) * 4
    qk = fused[:, :12]
    assert kernels.can_rotate(qk, angles.cos) and not qk.is_contiguous()
    ours = angles.rotate(qk)
    monkeypatch.setattr(native, "kernels", lambda: native.Unavailable("test"))
    assert torch.equal(ours, angles.rotate(qk))
    partial = RopeAngles(angles.cos[..., :48], angles.sin[..., :48])
    assert not kernels.can_rotate(qk, partial.cos)
    with pytest.raises(ValueError, match="rope"):
        kernels.rope(qk, partial.cos, partial.sin)


def test_silu_mul_is_aten_s(kernels: native.Kernels) -> None:
    """silu(gate) * up over ordinary values and the far ends of exp's range."""
    gen = torch.Generator().manual_seed(14)
    gate_up = torch.randn(5, 2 * 1536, generator=gen) * 4
    ends = torch.tensor([0.0, -0.0, 88.5, -88.5, 87.0, -87.0, 100.0, -100.0, 1e-30, -1e-30])
    gate_up[0, : len(ends)] = ends
    gate_up[0, 1536 : 1536 + len(ends)] = 3.0
    gate, up = gate_up.chunk(2, dim=-1)
    ours = kernels.silu_mul(gate_up)
    torch.testing.assert_close(ours, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    torch.testing.assert_close(ours.double(), exact, rtol=1e-6, atol=1e-30)
    assert not kernels.can_silu_mul(gate_up[:, 8:])
    with pytest.raises(ValueError, match="silu_mul"):
        kernels.silu_mul(gate_up.double())


def test_the_mlp_takes_the_kernel_for_silu_only(
    kernels: native.Kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(15)
    names = ("gate_proj", "up_proj", "down_proj")
    shapes = {"gate_proj": (32, 16), "up_proj": (32, 16), "down_proj": (16, 32)}
    tensors = {f"m.{n}.weight": torch.randn(shapes[n], generator=gen) for n in names}
    x = torch.randn(3, 16, generator=gen)
    for activation in ("silu", "gelu_pytorch_tanh"):
        mlp = GatedMLP(Weights(tensors, "test"), "m.", bias=False, activation=activation)
        ours = mlp(x)
        with monkeypatch.context() as m:
            m.setattr(native, "kernels", lambda: native.Unavailable("test"))
            torch.testing.assert_close(ours, mlp(x), rtol=1e-6, atol=1e-6)


def _pool(pages: int, page_size: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pages, page_size, kv_heads, dim, generator=gen)


def _decode_batch(positions: list[int], page_size: int, pages: int, seed: int) -> StepBatch:
    """Each row's pages drawn at random from the pool (distinct, in any order), as many as
    its position needs, the table padded as the runner pads it."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages, generator=gen).tolist()
    width = max(p // page_size + 1 for p in positions)
    table = torch.zeros(len(positions), width, dtype=torch.int64)
    for row, position in enumerate(positions):
        held = position // page_size + 1
        table[row, :held] = torch.tensor([order.pop() for _ in range(held)])
    pos = torch.tensor(positions)
    keys = torch.arange(width * page_size)
    slots = table[torch.arange(len(positions)), pos // page_size] * page_size + pos % page_size
    return StepBatch(
        is_prefill=False,
        slot_mapping=slots,
        cu_seqlens=[],
        page_table=table,
        key_mask=(keys[None, :] <= pos[:, None])[:, None, None, :],
        query_positions=pos,
    )


def _float64(q, k_cache, v_cache, batch: StepBatch, scoring: Scoring) -> torch.Tensor:
    """softmax(q.k * scale) v in float64, each row over its own positions."""
    assert batch.page_table is not None and batch.query_positions is not None
    _, page_size, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, pos in enumerate(batch.query_positions.tolist()):
        first = 0 if scoring.window is None else max(0, pos + 1 - scoring.window)
        where = torch.arange(first, pos + 1)
        slots = batch.page_table[row, where // page_size] * page_size + where % page_size
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].double()
        values = v_cache.reshape(-1, kv_heads, dim)[slots].double()
        for h in range(q.shape[1]):
            scale = scoring.scale if scoring.scale is not None else dim**-0.5
            scores = keys[:, h // group] @ q[row, h].double() * scale
            out[row, h] = scores.softmax(0) @ values[:, h // group]
    return out


CASES = [
    # heads, kv heads, head dim, page size, positions, scoring
    (9, 3, 64, 16, [0], FULL),
    (9, 3, 64, 16, [15, 16, 17, 90], FULL),
    (4, 4, 128, 8, [7, 8, 300], FULL),
    (8, 2, 8, 4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 23], FULL),
    (6, 1, 32, 16, [40, 41, 300, 2999], Scoring(window=33)),
    (6, 2, 64, 16, [3, 100], Scoring(window=200, scale=0.3)),
    (4, 2, 256, 16, [5, 70], FULL),  # Gemma's heads, the widest the kernel takes
    (2, 1, 48, 4, [9, 30], FULL),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "page_size", "positions", "scoring"), CASES)
def test_decode_attention_is_aten_s_over_the_gathered_pages(
    kernels: native.Kernels,
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
    positions: list[int],
    scoring: Scoring,
) -> None:
    pages = sum(p // page_size + 1 for p in positions) + 3
    k_cache = _pool(pages, page_size, kv_heads, dim, seed=1)
    v_cache = _pool(pages, page_size, kv_heads, dim, seed=2)
    batch = _decode_batch(positions, page_size, pages, seed=len(positions))
    # as a layer hands them over: q a split of the fused q/k/v heads, not contiguous
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(len(positions), heads + 2 * kv_heads, dim, generator=gen) * 2
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    assert kernels.can_attend(q, k_cache) and (len(positions) == 1 or not q.is_contiguous())
    ours = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, scoring)
    monkeypatch.setattr(native, "kernels", lambda: native.Unavailable("test"))
    theirs = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, scoring)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # this step's key and value were written into the pool before it was read
    k_cache.view(-1, kv_heads, dim)[batch.slot_mapping] = k
    v_cache.view(-1, kv_heads, dim)[batch.slot_mapping] = v
    exact = _float64(q, k_cache, v_cache, batch, scoring)
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5)


def test_scores_far_apart_and_equal(kernels: native.Kernels) -> None:
    """The softmax of scores spread over hundreds (most weights underflow to zero) and of
    scores all equal (a uniform average)."""
    k_cache = _pool(16, 16, 1, 64, seed=4) * 30
    v_cache = _pool(16, 16, 1, 64, seed=5)
    batch = _decode_batch([100, 127], 16, 16, seed=6)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(7)) * 30
    assert batch.page_table is not None and batch.query_positions is not None
    ours = kernels.decode_attention(
        q, k_cache, v_cache, batch.page_table, batch.query_positions, None, 0.125
    )
    exact = _float64(q, k_cache, v_cache, batch, Scoring(scale=0.125))
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5)
    flat = torch.zeros(2, 2, 64)
    ours = kernels.decode_attention(
        flat, k_cache, v_cache, batch.page_table, batch.query_positions, None, 0.125
    )
    exact = _float64(flat, k_cache, v_cache, batch, Scoring(scale=0.125))
    torch.testing.assert_close(ours.double(), exact, rtol=1e-6, atol=1e-6)


def test_a_position_or_page_outside_the_pool_is_refused_before_any_read(
    kernels: native.Kernels,
) -> None:
    """The read check keeps every row within pages it holds; the kernel reads raw memory, so it
    refuses what would read outside its table or the pool rather than trust that."""
    k_cache, v_cache = _pool(4, 16, 1, 64, seed=8), _pool(4, 16, 1, 64, seed=9)
    q = torch.randn(1, 1, 64)
    table = torch.tensor([[0, 1]])
    for positions, pages in [([32], table), ([-1], table), ([20], torch.tensor([[0, 4]]))]:
        with pytest.raises(ValueError, match="outside"):
            kernels.decode_attention(q, k_cache, v_cache, pages, torch.tensor(positions), None, 1.0)
    with pytest.raises(ValueError, match="decode attention"):
        narrow = torch.tensor([3], dtype=torch.int32)
        kernels.decode_attention(q, k_cache, v_cache, table, narrow, None, 1.0)


@pytest.mark.parametrize(
    ("dtype", "dim", "scoring"),
    [
        (torch.bfloat16, 64, FULL),  # --kv-cache-dtype bfloat16
        (torch.float32, 12, FULL),  # heads not a multiple of 8 wide
        (torch.float32, 264, FULL),  # wider than MAX_HEAD_DIM
        (torch.float32, 64, Scoring(softcap=20.0)),  # Gemma 2
    ],
)
def test_what_the_kernel_does_not_take_runs_on_aten(
    kernels: native.Kernels, dtype: torch.dtype, dim: int, scoring: Scoring
) -> None:
    k_cache = _pool(6, 16, 2, dim, seed=10).to(dtype)
    v_cache = _pool(6, 16, 2, dim, seed=11).to(dtype)
    batch = _decode_batch([20, 33], 16, 6, seed=12)
    q = torch.randn(2, 4, dim)
    out = paged_attention(q, q[:, :2], q[:, 2:], k_cache, v_cache, batch, scoring)
    assert out.shape == (2, 4, dim) and torch.isfinite(out).all()
    if scoring.softcap is None:
        assert not kernels.can_attend(q, k_cache)


def test_the_engine_answers_alike_with_and_without_the_kernels(
    kernels: native.Kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rows decoding together on the tiny model, with the kernels and without them: the
    same greedy tokens and, within float32's rounding, the same logprobs."""

    def run() -> list[tuple[list[int], list[float]]]:
        engine = make_tiny_engine()
        prompts = [prompt_of(4, seed=1), prompt_of(37, seed=2), prompt_of(17, seed=3)]
        seqs = [submit(engine, p, 24, ignore_eos=True, logprobs=0) for p in prompts]
        run_until_done(engine)
        return [(s.output_ids, [t.logprob for t in s.output_logprobs]) for s in seqs]

    ours = run()
    monkeypatch.setattr(native, "kernels", lambda: native.Unavailable("test"))
    theirs = run()
    for (ids, logprobs), (their_ids, their_logprobs) in zip(ours, theirs, strict=True):
        assert ids == their_ids and len(ids) == 24
        torch.testing.assert_close(logprobs, their_logprobs, rtol=0, atol=1e-4)
