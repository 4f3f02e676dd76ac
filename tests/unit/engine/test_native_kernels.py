"""kvfence's own kernels (native/blocks.c; ops.c in test_native_ops.py): a GGUF's 4-bit (Q4_0 and
Q4_1) and 8-bit (Q8_0) blocks times float32 activations, in float32, built from source with the
machine's C compiler on first use.

What it must be: a float32 GEMM's answer on the dequantized weights (any rows, every tile
shape of the kernel, with and without bias), and, where it cannot be built, a reason and aten's
kernel instead, never a failed start. The weights read back through it bit for bit, and the
int4 engine next to the float32 one: test_int4_weights.py.
"""

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from helpers.engines import generate, prompt_of, tiny_q4
from kvfence_engine import native
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.quantization import (
    Float16Linear,
    Int4Groups,
    Int4Linear,
    Q8Linear,
    packed_or_float16,
)

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text(),
    reason="the kernel is x86 AVX2 (elsewhere the engine runs aten's; test_int4_weights.py)",
)


def _groups(n: int, k: int, seed: int) -> Int4Groups:
    """Random 4-bit groups whose scales and zeros are fp16 values, as a GGUF's are."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.05).half().float()
    zero = (torch.randn(n, k // 32, generator=gen) * 0.2).half().float() + 8 * scale
    return Int4Groups(q, scale, zero)


def _weights(groups: Int4Groups) -> torch.Tensor:
    scale = groups.scale.repeat_interleave(32, dim=1).double()
    zero = groups.zero.repeat_interleave(32, dim=1).double()
    return (groups.q.double() - 8) * scale + zero


def test_the_kernel_is_built_here() -> None:
    """CI's machines have a C compiler and AVX2: the engine runs this kernel. (The engine image
    carries it built: tests/images/test_images.py.)"""
    kernel = native.kernels()
    assert isinstance(kernel, native.Kernels), kernel
    assert set(kernel.paths) == {"blocks", "ops"}
    assert all(path.exists() for path in kernel.paths.values())
    assert kernel.name.startswith("kvfence AVX2 (blocks-")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 11, 12, 16, 17, 40, 130])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (5, 64), (96, 576), (33, 1536)])
def test_the_kernel_is_a_float32_gemm_on_the_dequantized_weights(rows: int, n: int, k: int) -> None:
    """Against float64 on the same weights, within float32 accumulation: |error| <= K * eps32 *
    sum |x w|, which a float32 F.linear meets too (the bound the exact aten path is held to)."""
    groups = _groups(n, k, seed=rows * 1000 + n)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        layer = Int4Linear(groups, b)
        assert isinstance(layer.kernel, native.Kernels)
        x = torch.randn(rows, k, generator=gen)
        w = _weights(groups)
        exact = x.double() @ w.T + (0 if b is None else b.double())
        bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-6
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert ((got.double() - exact).abs() <= bound).all(), (rows, n, k)


def test_a_non_contiguous_input_and_no_rows() -> None:
    groups = _groups(8, 64, seed=3)
    layer = Int4Linear(groups, None)
    x = torch.randn(64, 6)[:, ::2].T  # [3, 64], not contiguous
    exact = x.double() @ _weights(groups).T
    assert torch.allclose(layer(x).double(), exact, atol=1e-4)
    assert layer(torch.empty(0, 64)).shape == (0, 8)
    with pytest.raises(ValueError, match="block linear"):
        layer(torch.randn(2, 32))


def test_scales_that_are_not_fp16_take_aten_s_kernel() -> None:
    """The kernel keeps fp16 scales (a GGUF's are): other groups (a requantization) would be
    served rounded, so they go to aten's kernel, said why."""
    groups = _groups(16, 64, seed=4)  # aten's kernel takes N in 16s
    odd = Int4Groups(groups.q, groups.scale * (1 + 2**-20), groups.zero)
    assert native.pack_q4(odd.q, odd.scale, odd.zero) is None
    layer = Int4Linear(odd, None)
    assert layer.kernel == native.Unavailable("scales that are not fp16")
    assert isinstance(Int4Linear(groups, None).kernel, native.Kernels)


def test_without_a_compiler_or_when_disabled_the_reason_is_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.kernels.cache_clear()
    try:
        assert native.kernels() == native.Unavailable(
            f"no C compiler ({tmp_path / 'no-such-cc'}) to build blocks.c"
        )
        native.kernels.cache_clear()
        monkeypatch.setenv("KVFENCE_NATIVE", "0")
        assert native.kernels() == native.Unavailable("KVFENCE_NATIVE=0")
        layer = Int4Linear(_groups(16, 64, seed=5), None)
        assert layer.kernel == native.Unavailable("KVFENCE_NATIVE=0")  # aten's bfloat16 runs
        assert layer(torch.randn(2, 64)).shape == (2, 16)
    finally:
        native.kernels.cache_clear()


def test_a_compiler_that_fails_is_said_and_nothing_half_built_is_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: error: no space left' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    native.kernels.cache_clear()
    try:
        found = native.kernels()
        assert isinstance(found, native.Unavailable)
        assert "blocks.c failed: cc: error: no space left" in found.reason
        assert list((tmp_path / "cache" / "kvfence" / "native").iterdir()) == []
    finally:
        native.kernels.cache_clear()


def test_the_library_is_built_once_and_kept_or_taken_prebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.kernels.cache_clear()
    try:
        first = native.kernels()
        assert isinstance(first, native.Kernels)
        kept = tmp_path / "cache" / "kvfence" / "native"
        assert {path.parent for path in first.paths.values()} == {kept}
        built = {name: path.stat().st_mtime_ns for name, path in first.paths.items()}
        native.kernels.cache_clear()
        again = native.kernels()
        assert isinstance(again, native.Kernels) and again.paths == first.paths
        # kept, not compiled again
        assert {name: path.stat().st_mtime_ns for name, path in again.paths.items()} == built
        # an image's: built at image build (python -m kvfence_engine.native), no compiler after
        prebuilt = tmp_path / "prebuilt"
        native.build_all(prebuilt)
        monkeypatch.setenv("KVFENCE_NATIVE_DIR", str(prebuilt))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        native.kernels.cache_clear()
        taken = native.kernels()
        assert isinstance(taken, native.Kernels)
        assert {path.parent for path in taken.paths.values()} == {prebuilt}
    finally:
        native.kernels.cache_clear()


def _q8_tensor(n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """A Q8_0 tensor as gguf quantizes it: its raw blocks and their dequantization."""
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    raw = quantize(weights, GGMLQuantizationType.Q8_0)
    return raw, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))


def test_a_q8_0_tensors_dequantization_packs_back_into_its_own_blocks() -> None:
    """pack_q8 finds the blocks a float weight is the dequantization of: for a GGUF's Q8_0
    tensor, byte for byte the file's blocks (ggml's block_q8_0: fp16 d, 32 int8)."""
    raw, weight = _q8_tensor(24, 96, seed=1)
    for rows in (1024, 5):  # a chunk of rows at a time, the last one short
        blocks = native.pack_q8(weight, rows=rows)
        assert blocks is not None
        file_blocks = torch.from_numpy(raw.view(np.uint8).reshape(24, -1))
        assert torch.equal(blocks.reshape(24, -1), file_blocks)
    # a weight that is no Q8_0 tensor's (one value off by an ulp, or a float table) is refused
    off = weight.clone()
    off[23, 7] = torch.nextafter(off[23, 7], torch.tensor(1.0))
    assert native.pack_q8(off) is None and native.pack_q8(off, rows=5) is None
    assert native.pack_q8(torch.randn(8, 64)) is None
    assert native.pack_q8(torch.zeros(8, 64)) is not None  # all-zero blocks: d = 0, exact


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 70])
def test_the_q8_kernel_is_a_float32_gemm_on_the_files_weights(rows: int) -> None:
    n, k = 37, 192
    _, weight = _q8_tensor(n, k, seed=rows)
    bias = torch.randn(n)
    layer = packed_or_float16(nn.Linear(k, n).requires_grad_(False).float(), exact=True)
    assert isinstance(layer, Float16Linear)  # a float layer: no blocks to keep
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    layer = packed_or_float16(linear)
    assert isinstance(layer, Q8Linear)
    x = torch.randn(rows, k)
    exact = x.double() @ weight.double().T + bias.double()
    bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert ((layer(x).double() - exact).abs() <= bound + 1e-6).all()
    assert isinstance(packed_or_float16(linear, exact=False), Float16Linear)


def test_an_int4_model_with_a_q8_0_lm_head_keeps_its_blocks() -> None:
    """SmolLM2's tied lm_head is its Q8_0 embedding table: int4 serves it as those blocks."""
    loaded = tiny_q4()
    table = loaded.weights["model.embed_tokens.weight"]
    raw = quantize(table.numpy(), GGMLQuantizationType.Q8_0)
    loaded.weights["model.embed_tokens.weight"] = torch.from_numpy(
        dequantize(raw, GGMLQuantizationType.Q8_0)
    )
    engine = LLMEngine(loaded, EngineArgs(kv_cache_memory=16 << 20, weight_dtype="int4"))
    assert isinstance(engine.runner.model.lm_head, Q8Linear)
    out = generate(engine, prompt_of(12, seed=3), 6, ignore_eos=True)
    assert len(out.output_ids) == 6
