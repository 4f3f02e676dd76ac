"""Sampling where the logits are: temperature, top-k and top-p over a batch's logits on the
device, and the logprobs a request asks for, so that only token ids and a few numbers per row
cross to the host (core/device_decode; the host path samples with core/sampler).

The draw is Gumbel-max: argmax(filtered logits / temperature + G), G = -log(-log(U)), which
picks each token with exactly its filtered softmax probability. U is not drawn from a
generator's stream but computed from (seed, position, token id) by a counter-based hash
(splitmix64's finalizer), so a row's draw depends only on its request's seed and the position
it samples: not on the batch it shares, the bucket it runs in, or a preemption that recomputed
it. A seed therefore reproduces on the device path; it does not give the host path's tokens
(core/sampler draws from torch.Generator), as vLLM's seeds do not carry across hardware either.

Filtering follows core/sampler: the largest logit shifted to 0, divided by the temperature;
top-k keeps logits at or above the k-th largest; top-p then keeps the smallest set of the
largest whose probability reaches top_p (the first token always), by a threshold on the sorted
values, so ties at the threshold are all kept.
"""

from dataclasses import dataclass

import torch

# splitmix64's constants as signed 64-bit integers (torch has no uint64 arithmetic)
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX2 = 0x94D049BB133111EB - (1 << 64)
POSITION = 0xD1B54A32D192ED03 - (1 << 64)  # another odd constant, for the position


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's >> is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift_right(x, 30)
    x = x * MIX1
    x = x ^ _shift_right(x, 27)
    x = x * MIX2
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float64 in (0, 1): a function of (seed, position, token id) alone."""
    row = _mix(seeds * GOLDEN + positions * POSITION)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix(row[:, None] + ids[None, :] * GOLDEN)
    return (_shift_right(bits, 11).double() + 0.5) / float(1 << 53)


@dataclass(frozen=True, slots=True)
class SamplingRows:
    """Per row of a batch, on the logits' device: temperature (0: greedy), top_k (0: all),
    top_p (1: all), the request's seed and the position the sampled token takes."""

    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # float32 [B]
    seed: torch.Tensor  # int64 [B]
    position: torch.Tensor  # int64 [B]


def filtered(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[B, V] float32: each row shifted, divided by its temperature (1 for a greedy row) and
    cut to its top-k and top-p; -inf where a token cannot be drawn."""
    vocab = logits.shape[-1]
    temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(rows.top_k > 0, rows.top_k, vocab).clamp(1, vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the larger tokens
    kept = (before <= rows.top_p[:, None]).sum(dim=-1).clamp(min=1)
    kept = torch.where(rows.top_p < 1.0, kept, vocab)  # top_p 1: no cut (rounding aside)
    # past top-k the sorted values are -inf: the cut is then top-k's
    threshold = torch.maximum(ordered.gather(1, (kept - 1)[:, None]), kth)
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """int64 [B]: a greedy row's argmax, the others' Gumbel-max draws."""
    cut = filtered(logits, rows)
    gumbel = -torch.log(-torch.log(uniforms(rows.seed, rows.position, logits.shape[-1])))
    drawn = (cut.double() + gumbel).argmax(dim=-1)
    return torch.where(rows.temperature > 0, drawn, logits.argmax(dim=-1))


def logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own log-probabilities (before temperature, as core/sampler reports them):
    each row's chosen token's [B], and the `top` largest, values and ids [B, top]."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], tokens[:, None][:, :0])
    return chosen, values, ids
