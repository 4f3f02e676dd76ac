"""Which precision the weights and activations use, and opt-in packed weights for CPU.

A decode step reads every weight once, so on CPU its time is the bytes of the weights. Packed
weights cut those bytes. Only the linear layers are packed (q/k/v, o, gate/up, down and the
lm_head); embeddings, norms, RoPE, attention and the KV pool stay float32, so the pool and its
read check are exactly what they are with float32 weights.

- float16: weights stored as fp16, activations float32 (fbgemm's fp16 GEMM). Half the bytes,
  logits within ~0.05 of float32's: the CPU speed-up to use.
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

# Rows up to which int8pack beats dequantize + float32 GEMM (all 30 layers of SmolLM2, 2 AVX2
# cores: 53 vs 67 ms at 16 rows, 96 vs 89 ms at 32).
INT8PACK_MAX_ROWS = 16


class WeightDtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"


@dataclass(frozen=True, slots=True)
class Precision:
    """compute: activations and the KV pool; packed: CPU weight packing of the linears."""

    weights: WeightDtype
    compute: torch.dtype
    packed: WeightDtype | None = None


def resolve_precision(weight_dtype: str | None, device: torch.device) -> Precision:
    """The default is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on CUDA.

    On CPU, int8 and float16 pack the linear weights and compute in float32; on CUDA, float16
    and bfloat16 are the dtype of the whole model, and int8 is refused (a CPU path)."""
    cuda = device.type == "cuda"
    if weight_dtype is None:
        weight_dtype = WeightDtype.BFLOAT16 if cuda else WeightDtype.FLOAT32
    try:
        kind = WeightDtype(weight_dtype)
    except ValueError:
        choices = ", ".join(WeightDtype)
        raise ValueError(f"--weight-dtype {weight_dtype!r} is not one of {choices}") from None
    if kind is WeightDtype.INT8 and cuda:
        raise ValueError("--weight-dtype int8 is a CPU path; on CUDA use bfloat16 or float16")
    if cuda or kind in (WeightDtype.FLOAT32, WeightDtype.BFLOAT16):
        return Precision(kind, getattr(torch, kind.value))
    return Precision(kind, torch.float32, packed=kind)


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
