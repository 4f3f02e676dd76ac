"""Rotary position embeddings: each variant's frequencies, computed as transformers'
modeling_rope_utils does (same float32 ops, so a boundary test like llama3's wavelength bands
falls the same way), then one cos/sin table per position, shared by every layer.

Every variant here is a function of the position alone, which is what a paged pool needs: a
key is rotated once, when it is written, and read back by later steps. transformers' `dynamic`
(NTK) is not, past max_position_embeddings: there it recomputes the frequencies from the
longest sequence of the current batch, and keys already cached keep the rotation of the step
that wrote them. Up to max_position_embeddings it is plain RoPE, and that is as far as the
engine serves any model (ModelConfig.max_positions; model_config.positions_note says why).

Nor is transformers' `longrope` (Phi-3/4): it takes the short factors while the longest
position of a forward is below original_max_position_embeddings and the long ones past it, so
the same position turns differently in a short and a long sequence. Here the served context
decides once, for every position, as llama.cpp does: short factors where the engine serves
at most original_max_position_embeddings (no sequence can pass it: transformers' choice at
every step), long ones where it serves more (transformers' choice for a prompt that is past
it from its first forward; a shorter one it would start with short factors).

partial_rotary_factor (Phi-4-mini: 0.75): only the leading fraction of each head dim turns.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from kvfence_engine import native
from kvfence_engine.core.model_config import RopeScaling, RopeType


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth band between."""
    assert s.original_max_positions is not None
    old_context = s.original_max_positions
    low_wavelen = old_context / s.low_freq_factor
    high_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (by
    dimension, from beta_fast/beta_slow rotations over the original context), and cos/sin
    scaled by attention_factor."""
    original = s.original_max_positions
    assert original is not None
    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # how much of each dimension is extrapolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope(theta: float, dim: int, s: RopeScaling, context: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: each frequency divided by its own factor, the short list's or the long one's
    by the served context (the module docstring says why), and cos/sin scaled by
    attention_factor, by default sqrt(1 + ln(factor) / ln(original))."""
    original = s.original_max_positions
    assert original is not None
    factors = s.long_factor if context > original else s.short_factor
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents), float(attention)


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling,
    max_positions: int,
    context: int | None = None,
) -> tuple[torch.Tensor, float]:
    """inv_freq (float32, [rotary dim / 2]) and the factor cos and sin are multiplied by, for
    an engine serving `context` positions (default max_positions; only longrope reads it)."""
    kind = scaling.type
    dim = scaling.rotary_dim(head_dim)
    if kind is RopeType.YARN:
        return _yarn(theta, dim, scaling)
    if kind is RopeType.LONGROPE:
        return _longrope(theta, dim, scaling, context or max_positions)
    if kind is RopeType.DYNAMIC:
        # transformers' value at seq_len = max_position_embeddings: the base unchanged up to
        # float rounding, and the frequencies of every position the engine serves
        seq_len, factor = max_positions, scaling.factor
        theta = theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = _base_inv_freq(theta, dim)
    if kind is RopeType.LINEAR:
        inv_freq /= scaling.factor
    elif kind is RopeType.LLAMA3:
        inv_freq = _llama3(inv_freq, scaling)
    elif kind is RopeType.FREQ_FACTORS:  # as ggml's rope: theta / freq_factors[i]
        inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return inv_freq, 1.0


class Rotary(nn.Module):
    """Rotate-half RoPE (Hugging Face layout), cos/sin tables precomputed once for an engine
    that serves `context` positions (rope_frequencies)."""

    cos: torch.Tensor  # buffers (register_buffer): [max_positions, rotary dim]
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        context: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention = rope_frequencies(head_dim, theta, scaling, max_positions, context)
        # float64 angles: exact at any position, where float32 would lose the low bits
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq.double())
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (angles.cos() * attention).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * attention).float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeAngles":
        """This step's cos/sin rows, looked up once and shared by every layer."""
        return RopeAngles(
            self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
        )


class RopeAngles(NamedTuple):
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated by each token's position: its first rotary-dim dims (all
        of them but where partial_rotary_factor < 1), the rest passed through."""
        if x.is_cpu and native.Kernels.can_rotate(x, self.cos):
            kernels = native.kernels()
            if isinstance(kernels, native.Kernels):  # one call where aten's takes seven
                return kernels.rope(x, self.cos, self.sin)
        dim = self.cos.shape[-1]
        if dim < x.shape[-1]:
            return torch.cat([self.rotate(x[..., :dim]), x[..., dim:]], dim=-1)
        half = dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin
