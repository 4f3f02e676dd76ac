"""The layers every family's decoder is built of: RMSNorm, attention over the paged pool, the
gated MLP (or a mixture of such experts), and the pre-norm block around them (RoPE:
core/rope.py).

Each layer takes its weights from a Weights, by Hugging Face name, and fuses what runs together
(q/k/v, gate/up) into one linear; `sources` says which weights each linear was fused from, in
order, for packing them from a GGUF's own blocks (quantization.pack_int4_linears).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvfence_engine import native
from kvfence_engine.core.attention import FULL, Scoring, StepBatch, paged_attention
from kvfence_engine.core.rope import RopeAngles


class Weights:
    """A checkpoint's tensors by name, and which of them the model took: a tensor it did not
    take is one it does not understand (Decoder refuses it), a missing one a clear error."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        self.tensors = tensors
        self.what = what  # the model that reads them, for messages
        self.taken: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"weights: the {self.what} model needs tensor {name!r}, not found")
        self.taken.add(name)
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def untaken(self) -> list[str]:
        return sorted(set(self.tensors) - self.taken)


def fused_linear(w: Weights, names: list[str], bias: bool) -> nn.Linear:
    """One linear whose rows are the named weights' rows, in order (and their biases)."""
    weight = torch.cat([w[n + ".weight"] for n in names])
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.cat([w[n + ".bias"] for n in names]), requires_grad=False)
    return layer


class RMSNorm(nn.Module):
    """x / rms(x) * gain; the gain is the weight, or 1 + the weight (Gemma's, which stores
    its gains as offsets from one)."""

    def __init__(self, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        gain = 1.0 + weight.float() if unit_offset else weight
        self.weight = nn.Parameter(gain, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and native.Kernels.can_norm(x) and self.weight.dtype == torch.float32:
            kernels = native.kernels()
            if isinstance(kernels, native.Kernels):  # one call where aten's takes several
                return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
SEPARATE_GATE_UP = ("gate_proj", "up_proj")


class PagedSelfAttention(nn.Module):
    """Grouped-query attention whose keys and values live in the paged pool. Options, by
    family: biases on q/k/v and on o; an RMSNorm over each head of q and of k before RoPE (its
    gains offsets from one: Gemma 3); how keys are scored (a sliding window, a scale, a
    soft-cap); the checkpoint's names of the q/k/v weights (Phi-3's one qkv_proj holds their
    rows already stacked)."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        shape: tuple[int, int, int],
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        scoring: Scoring = FULL,
        qkv_names: tuple[str, ...] = SEPARATE_QKV,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape
        self.scoring = scoring
        qkv = [prefix + name for name in qkv_names]
        self.qkv = fused_linear(w, qkv, qkv_bias)
        self.o_proj = fused_linear(w, [prefix + "o_proj"], o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            offset = qk_norm_unit_offset
            self.q_norm = RMSNorm(w[prefix + "q_norm.weight"], qk_norm_eps, unit_offset=offset)
            self.k_norm = RMSNorm(w[prefix + "k_norm.weight"], qk_norm_eps, unit_offset=offset)
        self.sources = {"qkv": [n + ".weight" for n in qkv], "o_proj": [prefix + "o_proj.weight"]}

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAngles,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads = self.qkv(x).view(tokens, -1, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            qk = rope.rotate(torch.cat([q, k], dim=1))
        else:
            qk = rope.rotate(heads[:, : self.num_heads + self.num_kv_heads])  # q and k at once
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, k_cache, v_cache, batch, self.scoring)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma's GeGLU
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): act silu (SwiGLU) or tanh-approximated gelu (GeGLU); the
    gate and up weights by the checkpoint's names (Phi-3's one gate_up_proj: gate rows, then
    up rows)."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        *,
        bias: bool,
        activation: str = "silu",
        gate_up_names: tuple[str, ...] = SEPARATE_GATE_UP,
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.silu = activation == "silu"
        gate_up = [prefix + name for name in gate_up_names]
        self.gate_up = fused_linear(w, gate_up, bias)
        self.down = fused_linear(w, [prefix + "down_proj"], bias)
        self.sources = {
            "gate_up": [n + ".weight" for n in gate_up],
            "down": [prefix + "down_proj.weight"],
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.silu and gate_up.is_cpu and native.Kernels.can_silu_mul(gate_up):
            kernels = native.kernels()
            if isinstance(kernels, native.Kernels):  # one call where aten's takes three
                return self.down(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class SparseMoE(nn.Module):
    """A mixture of experts (Qwen3-MoE's sparse MLP): a router (`gate`, a linear to one logit
    per expert) scores the experts, softmax in float32; each token takes the sum of its top_k
    experts' gated MLPs weighted by their probabilities, renormalized to sum to one if
    norm_topk_prob. Each expert runs once over the rows routed to it (gathered, then added
    back to theirs), in expert order as transformers adds them.

    The router is a plain parameter, not an nn.Linear: packing (core/quantization.py) leaves
    it exact, so that a packed model routes each token as the float one does."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        *,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.router = nn.Parameter(w[prefix + "gate.weight"], requires_grad=False)
        assert self.router.shape[0] == num_experts, "the router scores each expert"
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        experts = [
            GatedMLP(w, f"{prefix}experts.{e}.", bias=False, activation=activation)
            for e in range(num_experts)
        ]
        self.experts = nn.ModuleList(experts)
        self.sources = {
            f"experts.{e}.{k}": v
            for e, expert in enumerate(experts)
            for k, v in expert.sources.items()
        }

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts: their weights (in x's dtype) and indices, [rows, top_k]."""
        probs = F.linear(x, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # sorted: the experts some row chose
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): the pre-norm block of every family here.
    sandwich (Gemma 2/3): each sub-block's output is normed too before the residual add,
    x + norm(attn(norm(x))), then x + norm(mlp(norm(x))), with the norms' gains as offsets
    from one."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        eps: float,
        attn: PagedSelfAttention,
        mlp: GatedMLP | SparseMoE,
        *,
        sandwich: bool = False,
    ) -> None:
        super().__init__()

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w[prefix + name + ".weight"], eps, unit_offset=sandwich)

        self.input_norm = norm("input_layernorm")
        self.attn = attn
        self.attn_out_norm: RMSNorm | None = None
        self.mlp_out_norm: RMSNorm | None = None
        if sandwich:
            self.attn_out_norm = norm("post_attention_layernorm")
            self.post_norm = norm("pre_feedforward_layernorm")
            self.mlp_out_norm = norm("post_feedforward_layernorm")
        else:
            self.post_norm = norm("post_attention_layernorm")
        self.mlp = mlp
        # tensor parallelism (core/decoder.RankPart): the sum over the ranks of what attention
        # and the MLP each output (their last linear is row-parallel); alone, nothing to add
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _alone

    @property
    def sources(self) -> dict[str, list[str]]:
        """Each linear's path in this layer -> the weights it was fused from."""
        return {f"attn.{k}": v for k, v in self.attn.sources.items()} | {
            f"mlp.{k}": v for k, v in self.mlp.sources.items()
        }

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAngles,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        h = self.reduce(self.attn(self.input_norm(x), rope, k_cache, v_cache, batch))
        x = x + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        h = self.reduce(self.mlp(self.post_norm(x)))
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))


def _alone(x: torch.Tensor) -> torch.Tensor:
    return x
