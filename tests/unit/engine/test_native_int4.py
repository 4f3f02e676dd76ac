"""kvfence's own int4 kernel (native/q4.c): the file's 4-bit blocks times float32 activations,
in float32, built from source with the machine's C compiler on first use.

What it must be: a float32 GEMM's answer on the dequantized weights (any rows, every tile
shape of the kernel, with and without bias), and, where it cannot be built, a reason and aten's
kernel instead, never a failed start. The weights read back through it bit for bit, and the
int4 engine next to the float32 one: test_int4_weights.py.
"""

import platform
from pathlib import Path

import pytest
import torch

from kvfence_engine import native
from kvfence_engine.core.quantization import Int4Groups, Int4Linear

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
    """CI's machines have a C compiler and AVX2: the engine runs this kernel. (The images do
    not carry a compiler yet: there the engine says so and runs aten's.)"""
    kernel = native.q4()
    assert isinstance(kernel, native.Q4Kernel), kernel
    assert kernel.path.exists() and kernel.name.startswith("kvfence q4 AVX2")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (5, 64), (96, 576), (33, 1536)])
def test_the_kernel_is_a_float32_gemm_on_the_dequantized_weights(rows: int, n: int, k: int) -> None:
    """Against float64 on the same weights, within float32 accumulation: |error| <= K * eps32 *
    sum |x w|, which a float32 F.linear meets too (the bound the exact aten path is held to)."""
    groups = _groups(n, k, seed=rows * 1000 + n)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        layer = Int4Linear(groups, b)
        assert isinstance(layer.kernel, native.Q4Kernel)
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
    with pytest.raises(ValueError, match="q4 linear"):
        layer(torch.randn(2, 32))


def test_scales_that_are_not_fp16_take_aten_s_kernel() -> None:
    """The kernel keeps fp16 scales (a GGUF's are): other groups (a requantization) would be
    served rounded, so they go to aten's kernel, said why."""
    groups = _groups(16, 64, seed=4)  # aten's kernel takes N in 16s
    odd = Int4Groups(groups.q, groups.scale * (1 + 2**-20), groups.zero)
    assert native.pack_blocks(odd.q, odd.scale, odd.zero) is None
    layer = Int4Linear(odd, None)
    assert layer.kernel == native.Unavailable("scales that are not fp16")
    assert isinstance(Int4Linear(groups, None).kernel, native.Q4Kernel)


def test_without_a_compiler_or_when_disabled_the_reason_is_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.q4.cache_clear()
    try:
        assert native.q4() == native.Unavailable(
            f"no C compiler ({tmp_path / 'no-such-cc'}) to build q4.c"
        )
        native.q4.cache_clear()
        monkeypatch.setenv("KVFENCE_NATIVE", "0")
        assert native.q4() == native.Unavailable("KVFENCE_NATIVE=0")
        layer = Int4Linear(_groups(16, 64, seed=5), None)
        assert layer.kernel == native.Unavailable("KVFENCE_NATIVE=0")  # aten's bfloat16 runs
        assert layer(torch.randn(2, 64)).shape == (2, 16)
    finally:
        native.q4.cache_clear()


def test_a_compiler_that_fails_is_said_and_nothing_half_built_is_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: error: no space left' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    native.q4.cache_clear()
    try:
        found = native.q4()
        assert isinstance(found, native.Unavailable)
        assert "q4.c failed: cc: error: no space left" in found.reason
        assert list((tmp_path / "cache" / "kvfence" / "native").iterdir()) == []
    finally:
        native.q4.cache_clear()


def test_the_library_is_built_once_and_kept_or_taken_prebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.q4.cache_clear()
    try:
        first = native.q4()
        assert isinstance(first, native.Q4Kernel)
        assert first.path.parent == tmp_path / "cache" / "kvfence" / "native"
        built = first.path.stat().st_mtime_ns
        native.q4.cache_clear()
        again = native.q4()
        assert isinstance(again, native.Q4Kernel) and again.path == first.path
        assert again.path.stat().st_mtime_ns == built  # kept, not compiled again
        # an image's: built at image build (python -m kvfence_engine.native), no compiler after
        prebuilt = tmp_path / "prebuilt"
        native.build_all(prebuilt)
        monkeypatch.setenv("KVFENCE_NATIVE_DIR", str(prebuilt))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        native.q4.cache_clear()
        taken = native.q4()
        assert isinstance(taken, native.Q4Kernel) and taken.path.parent == prebuilt
    finally:
        native.q4.cache_clear()
