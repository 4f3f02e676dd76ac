"""The shape of a Llama-family decoder, whatever file it came from."""

from dataclasses import dataclass


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
    attention_bias: bool = False  # Qwen2-style q/k/v bias

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "query heads must group over kv heads"
        assert self.head_dim % 2 == 0, "rotary embedding needs an even head dim"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer, every KV head: what one token costs in the pool."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
