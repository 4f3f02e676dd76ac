"""Which precision the weights and activations use, and opt-in packed weights for CPU.

A decode step reads every weight once, so on CPU its time is the bytes of the weights. Packed
weights cut those bytes. Only the linear layers are packed (q/k/v, o, gate/up, down and the
lm_head); embeddings, norms, RoPE, attention and the KV pool stay float32, so the pool and its
read check are exactly what they are with float32 weights.

- float16: weights stored as fp16, activations float32 (fbgemm's fp16 GEMM). Half the bytes,
  logits within ~0.05 of float32's: the CPU speed-up to use.
- int4 (`auto`'s first candidate for a GGUF file with Q4_0/Q4_1 tensors on CPU, int4+float16
  the other: whichever measures faster on the CPU at start, core/weight_choice.py): the file's own
  4-bit blocks, kept. The kernel is kvfence's own where it can be built (native/blocks.c: x86 with
  AVX2, the blocks as ggml lays them out, float32 products and sums, so the served weights are
  the file's exactly; SmolLM2 one-row step on emulated AVX2 22.2 ms against aten's 24.4).
  Elsewhere each block of 32 becomes a group of aten's int4 packed matmul, whose
  dequantization is w = (q - 8) * scale + zero: scale = d, zero = 0 (Q4_0: w = d * (q - 8))
  or m + 8 * d (Q4_1: w = d * q + m). With float32 scales those are the file's weights bit
  for bit; the engine runs that kernel on bfloat16 (its float32 path is scalar, slower than a
  float32 GEMM), so the served weights are the file's up to bfloat16 rounding of scale, zero
  and product (relative 2^-9 each: small against the 4-bit step itself). Every other linear
  (Q8_0, F16, F32 in the file) takes the float16 path, except one that is exactly a Q8_0
  tensor's dequantization (SmolLM2's tied lm_head is its Q8_0 embedding table) where kvfence's
  kernel is here: Q8Linear keeps those blocks (aten's int8pack could not: its scales are per
  output channel, and a per-channel requantization would change the file's weights).
  Speed of aten's kernel (SmolLM2, 1 thread, rough): batch 1 int4 79 tokens/s, float16 63,
  float32 25; but from ~16 rows the bfloat16 int4 kernel is slower than fbgemm's float16 GEMM
  (16 requests: 209 vs 244), and on AVX2-only CPUs (ATEN_CPU_CAPABILITY=avx2) even at batch 1
  (47 vs 65).
- int4+float16 (`auto`'s other candidate for such a file): each int4 linear also holds the
  float16 packing of the same weights (2.5 bytes a weight); a batch of up to `wide_above` rows
  takes the int4 kernel, a larger one the float16 GEMM. The kernel's speed hardly grows with
  the rows (AVX2, 2 cores: ~85 GFLOP/s at 16 rows and at 800, fbgemm's float16 ~180), so
  prefills and busy decode steps take float16 while a lone decode row reads 4-bit blocks.
  Where each shape switches is measured at build (core/weight_choice.calibrate_switch).
- int8: per-output-channel symmetric int8 weights (scale = max |w| / 127 per row), weight-only:
  aten's int8pack kernel (vectorized on AVX2 for bf16 activations only) for decode-sized
  batches, dequantized float32 GEMM for prefill-sized ones. A quarter of the bytes, but slower
  than float16 beyond a few rows and less accurate (top-1 ~96% on SmolLM2-135M).

Measured and rejected: fbgemm's dynamic int8 linear (what quantize_dynamic uses) is the fastest
kernel here, but it quantizes activations per tensor to 7 bits; on SmolLM2-135M that alone
drops top-1 agreement with float32 to ~45%. Accuracy: tests/unit/engine/test_int8_weights.py; speed:
bench/engine_throughput.py.
"""

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn

from kvfence_engine import native

# Rows up to which int8pack beats dequantize + float32 GEMM (all 30 layers of SmolLM2, 2 AVX2
# cores: 53 vs 67 ms at 16 rows, 96 vs 89 ms at 32).
INT8PACK_MAX_ROWS = 16


class WeightDtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"
    INT4 = "int4"
    INT4_FLOAT16 = "int4+float16"  # int4 for a few rows, float16 beyond (both held)
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Precision:
    """compute: activations and the KV pool; packed: CPU weight packing of the linears;
    candidates: `auto`'s packings to measure at start (core/weight_choice.py), weights and
    packed being the first of them until one is chosen; why: how the packing was chosen."""

    weights: WeightDtype
    compute: torch.dtype
    packed: WeightDtype | None = None
    candidates: tuple[WeightDtype, ...] = ()
    why: str | None = None


def resolve_precision(
    weight_dtype: str | None, device: torch.device, gguf_int4: bool = False
) -> Precision:
    """auto (or None): on CPU for a model whose file holds Q4_0/Q4_1 tensors (gguf_int4), int4
    or float16, whichever measures faster at start (both serve the file's weights: candidates);
    else float32 on CPU (bf16 matmuls are slow there) and bfloat16 on CUDA.

    On CPU, int4, int8 and float16 pack the linear weights and compute in float32; on CUDA,
    float16 and bfloat16 are the dtype of the whole model, and int8/int4 are refused (CPU
    paths)."""
    cuda = device.type == "cuda"
    candidates: tuple[WeightDtype, ...] = ()
    if weight_dtype is None or weight_dtype == WeightDtype.AUTO:
        if cuda:
            weight_dtype = WeightDtype.BFLOAT16
        elif gguf_int4:  # in the order of the bytes they hold: fewer first
            candidates = (WeightDtype.INT4, WeightDtype.INT4_FLOAT16)
            weight_dtype = candidates[0]
        else:
            weight_dtype = WeightDtype.FLOAT32
    try:
        kind = WeightDtype(weight_dtype)
    except ValueError:
        choices = ", ".join(WeightDtype)
        raise ValueError(f"--weight-dtype {weight_dtype!r} is not one of {choices}") from None
    int4 = kind in (WeightDtype.INT4, WeightDtype.INT4_FLOAT16)
    if (int4 or kind is WeightDtype.INT8) and cuda:
        raise ValueError(f"--weight-dtype {kind} is a CPU path; on CUDA use bfloat16 or float16")
    if int4 and not gguf_int4:
        raise ValueError(
            f"--weight-dtype {kind} needs a GGUF model with Q4_0 or Q4_1 tensors (it keeps the "
            "file's own blocks); use float16 or int8 for this model"
        )
    if cuda or kind in (WeightDtype.FLOAT32, WeightDtype.BFLOAT16):
        return Precision(kind, getattr(torch, kind.value))
    return Precision(kind, torch.float32, packed=kind, candidates=candidates)


class Int8Linear(nn.Module):
    """y = x @ W.T + b with W as per-output-channel symmetric int8; activations are not
    quantized (weight-only)."""

    # buffers (register_buffer), declared so they type as tensors, not Tensor | Module
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("qweight", torch.round(w / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", _float_or_none(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8PACK_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)
            y = y.to(x.dtype)
        else:  # the int8pack kernel costs ~rows x a GEMV: past a few rows, float32 GEMM wins
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Float16Linear(nn.Module):
    """y = x @ W.T + b with W stored as fp16 and x kept float32 (fbgemm fp16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float(), _float_or_none(bias)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)


class Q8Linear(nn.Module):
    """y = x @ W.T + b with W as the Q8_0 blocks it is exactly the dequantization of (a GGUF's
    Q8_0 tensor, e.g. SmolLM2's tied lm_head): kvfence's kernel, float32 on the file's weights,
    1.06 bytes a weight where float16 takes 2. `packed_or_float16` makes one where it can."""

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, blocks: torch.Tensor, bias: torch.Tensor | None, kernels: native.Kernels
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * GROUP
        self.kernels = kernels
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", _float_or_none(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_linear(self.blocks, self.bias, x)


def packed_or_float16(layer: nn.Linear, exact: bool = True) -> nn.Module:
    """A linear that is no 4-bit tensor: its Q8_0 blocks on kvfence's kernel where it is exactly
    a Q8_0 tensor's dequantization and the kernel is here (exact: False asks for float16 alone,
    as aten's float32 int4 path does in tests), else fbgemm's float16."""
    kernels = native.kernels() if exact else None
    if isinstance(kernels, native.Kernels):
        blocks = native.pack_q8(layer.weight.detach().float())
        if blocks is not None:
            return Q8Linear(blocks, layer.bias, kernels)
    return Float16Linear(layer.weight, layer.bias)


GROUP = 32  # weights per Q4_0/Q4_1 block, and per group of the int4 kernel
# int4+float16: rows up to which a linear stays int4 until measured (the crossover of SmolLM2's
# 30 layers on 2 cores lies between 1 and 16 rows, by shape and CPU)
WIDE_ABOVE = 4


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """A linear weight [N, K] as 4-bit values in groups of 32 along K: w = (q - 8) * scale +
    zero, the int4 kernel's dequantization (loading.loader.int4_groups reads a GGUF's)."""

    q: torch.Tensor  # uint8 [N, K], each 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    zero: torch.Tensor  # float32 [N, K / 32]

    @staticmethod
    def concat(parts: "list[Int4Groups]") -> "Int4Groups":
        """Stacked along N (the fused q/k/v and gate/up linears)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W as int4 groups of 32. The kernel: kvfence's own (native/blocks.c:
    float32, the file's weights exactly) where it can be built, else aten's int4 packed matmul
    on bfloat16; kernel_dtype (bfloat16 or float32, the latter exact but scalar: tests) asks
    for aten's."""

    # buffers (register_buffer), declared so they type as tensors, not Tensor | Module
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        groups: Int4Groups,
        bias: torch.Tensor | None,
        kernel_dtype: torch.dtype | None = None,
        wide: "Float16Linear | None" = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.q.shape
        # int4+float16: a batch of more than wide_above rows takes the float16 form of the same
        # weights (core/weight_choice.calibrate_switch measures where, per shape)
        self.wide = wide
        self.wide_above = WIDE_ABOVE
        if self.in_features % GROUP:
            raise ValueError(f"int4 groups: {self.in_features} inputs is not a multiple of 32")
        self.kernel = native.kernels() if kernel_dtype is None else None
        self.register_buffer("bias", _float_or_none(bias))
        if isinstance(self.kernel, native.Kernels):
            # w = (q - 8) * scale + zero = d * q + m with m = zero - 8 * scale
            blocks = native.pack_q4(groups.q, groups.scale, groups.zero - 8 * groups.scale)
            if blocks is not None:
                self.register_buffer("blocks", blocks)
                return
            self.kernel = native.Unavailable("scales that are not fp16")
        self.kernel_dtype = kernel_dtype or torch.bfloat16
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 1)
        # the kernel's layout: [K / 32, N, 2], scale then zero
        layout = torch.stack([groups.scale.T, groups.zero.T], dim=-1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", layout.to(self.kernel_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.shape[0] > self.wide_above:
            return self.wide(x)
        return self.narrow(x)

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 kernel, whatever the rows."""
        if isinstance(self.kernel, native.Kernels):
            return self.kernel.q4_linear(self.blocks, self.bias, x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.kernel_dtype), self.packed, GROUP, self.scales_and_zeros
        ).to(x.dtype)
        return y if self.bias is None else y + self.bias


def int4_kernel() -> str:
    """Which kernel an int4 linear runs here, and why where it is aten's (logs, the weight
    choice, its cache key)."""
    kernel = native.kernels()
    if isinstance(kernel, native.Kernels):
        return kernel.name
    return f"aten bfloat16 ({kernel.reason})"


def _float_or_none(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float()


def pack_linear(layer: nn.Linear, kind: WeightDtype) -> nn.Module:
    if kind is WeightDtype.INT8:
        return Int8Linear(layer.weight, layer.bias)
    if kind is WeightDtype.FLOAT16:
        return Float16Linear(layer.weight, layer.bias)
    raise ValueError(f"no packed CPU linear for {kind}")


def pack_linears(model: nn.Module, kind: WeightDtype) -> int:
    """Replace every nn.Linear inside `model` by its packed form; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, pack_linear(child, kind))
                replaced += 1
    return replaced


def pack_int4_linears(
    model: nn.Module,
    sources: dict[str, list[str]],
    int4: dict[str, Int4Groups],
    kernel_dtype: torch.dtype | None = None,
    wide: bool = False,
) -> dict[str, int]:
    """Replace each linear named in `sources` (module path -> the weights it was built from)
    by an Int4Linear when every source weight has int4 groups, else (and every other
    nn.Linear) by packed_or_float16's. Returns how many of each kind. (kernel_dtype float32:
    aten's kernel on the file's exact weights, at its slow scalar speed, and float16 for the
    rest; for tests.) wide: each Int4Linear also holds the float16 packing of the layer
    (int4+float16)."""
    counts = {"int4": 0, "q8": 0, "float16": 0}

    def other(layer: nn.Linear) -> nn.Module:
        packed = packed_or_float16(layer, exact=kernel_dtype is None)
        counts["q8" if isinstance(packed, Q8Linear) else "float16"] += 1
        return packed

    for path, names in sources.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = getattr(parent, attr)
        assert isinstance(layer, nn.Linear), path
        if all(name in int4 for name in names):
            groups = Int4Groups.concat([int4[n] for n in names])
            companion = Float16Linear(layer.weight, layer.bias) if wide else None
            packed: nn.Module = Int4Linear(groups, layer.bias, kernel_dtype, companion)
            counts["int4"] += 1
        else:
            packed = other(layer)
        setattr(parent, attr, packed)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, other(child))
    return {kind: n for kind, n in counts.items() if n}
