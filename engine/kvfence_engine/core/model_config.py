"""The shape of a decoder, whatever file it came from (no torch: `kvfence preflight` reads it)."""

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any


class Family(StrEnum):
    """Which model definition (core/families.py) runs the weights."""

    LLAMA = "llama"  # Llama 2/3.x, and Mistral (with or without its sliding window)
    QWEN2 = "qwen2"  # Qwen2/2.5: q/k/v bias
    QWEN3 = "qwen3"  # Qwen3 dense: per-head q/k RMSNorm before RoPE
    GEMMA2 = "gemma2"  # Gemma 2: sandwich norms, GeGLU, soft-capping, local/global layers
    QWEN3_MOE = "qwen3_moe"  # Qwen3-MoE: Qwen3's attention, routed experts for the MLP
    GEMMA3 = "gemma3"  # Gemma 3 text: Gemma 2's layer with q/k norms, a RoPE per layer kind
    PHI3 = "phi3"  # Phi-3/3.5, Phi-4-mini: q/k/v and gate/up stored fused


class RopeType(StrEnum):
    """RoPE frequency variants, as transformers' modeling_rope_utils names and computes them."""

    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"  # NTK dynamic: exact only up to max_positions (core/rope.py says why)
    LLAMA3 = "llama3"
    YARN = "yarn"
    LONGROPE = "longrope"  # Phi-3/4: short or long factors, by the served context (core/rope.py)
    # a GGUF's rope_freqs tensor (llama.cpp's form of Llama 3.1's scaling): each frequency
    # divided by its own factor; no config.json names it
    FREQ_FACTORS = "freq_factors"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A rope_scaling / rope_parameters entry; fields a variant does not use keep defaults."""

    type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    original_max_positions: int | None = None  # llama3, yarn and longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # yarn and longrope: None = from factor (and yarn's mscale) as the papers
    attention_factor: float | None = None
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    # longrope: one factor per rotated frequency, for contexts up to original_max_positions
    # and for longer ones (factor: the context ratio its attention_factor is derived from)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # freq_factors: one factor per rotated frequency, at every context
    freq_factors: tuple[float, ...] = ()
    # any variant: the leading fraction of each head dim that is rotated (the rest passes)
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", RopeType(self.type))  # from JSON: a plain string
        object.__setattr__(self, "short_factor", tuple(self.short_factor))  # JSON: lists
        object.__setattr__(self, "long_factor", tuple(self.long_factor))
        object.__setattr__(self, "freq_factors", tuple(self.freq_factors))

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of a head RoPE rotates, as transformers rounds it."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    # llama and qwen3: a bias on q, k, v and o (transformers' attention_bias); qwen2 always has
    # one on q, k and v, and none on o
    attention_bias: bool = False
    mlp_bias: bool = False  # llama: a bias on gate, up and down
    family: Family = Family.LLAMA
    rope: RopeScaling = field(default_factory=RopeScaling)
    # the attention window of the sliding layers: a token attends to itself and the
    # window - 1 before it. None: every layer attends to all positions.
    sliding_window: int | None = None
    # with a window, the layers that still attend to all positions (Qwen's layers below
    # max_window_layers); every other layer slides
    full_attention_layers: tuple[int, ...] = ()
    # Gemma 2 and 3: the MLP's activation; the embeddings times sqrt(hidden_size); the attention
    # scale (query_pre_attn_scalar ** -0.5, where not head_dim ** -0.5); tanh soft-caps of
    # the attention scores and of the final logits
    activation: str = "silu"
    embed_scale: float | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # Qwen3-MoE: a sparse layer's MLP is num_experts gated MLPs of moe_intermediate_size, of
    # which a router picks experts_per_token for each token (their weights renormalized to sum
    # to one if norm_topk_prob). 0 experts: every layer's MLP is dense (intermediate_size).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()  # dense whatever decoder_sparse_step says
    # Gemma 3: the sliding layers' own RoPE (theta and scaling); None: they rotate as the
    # full-attention layers do (rope_theta, rope)
    sliding_rope_theta: float | None = None
    sliding_rope: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", Family(self.family))  # from JSON: a plain string
        object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        assert self.num_heads % self.num_kv_heads == 0, "query heads must group over kv heads"
        assert self.head_dim % 2 == 0, "rotary embedding needs an even head dim"

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window, or None where it attends to all positions."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is routed experts: transformers' Qwen3-MoE rule, every
        decoder_sparse_step-th layer (counting from one) not in mlp_only_layers."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: what one token costs in the pool."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @staticmethod
    def from_dict(values: dict[str, Any]) -> "ModelConfig":
        """The inverse of dataclasses.asdict (how a converted GGUF's cache stores it)."""
        known = {f.name for f in fields(ModelConfig)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        values = dict(values)
        for name in ("rope", "sliding_rope"):
            if name in values:
                values[name] = RopeScaling(**values[name])
        return ModelConfig(**values)


def positions_note(config: ModelConfig) -> str:
    """Why a context past max_positions is refused even where the weights might stretch."""
    if config.rope.type is RopeType.DYNAMIC:
        return (
            " (rope scaling type 'dynamic': past max_position_embeddings transformers rescales "
            "the frequencies by the longest sequence of the batch so far, which no per-position "
            "table of a paged pool reproduces)"
        )
    return ""
