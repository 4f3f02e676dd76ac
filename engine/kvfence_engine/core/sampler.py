"""Next-token choice: greedy or seeded sampling (temperature, top-k, top-p), with logprobs."""

import torch

from kvfence_engine.core.request import SamplingParams, TokenLogprob


def _sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    # The largest logit shifted to 0 first: dividing by a small temperature then takes the
    # others to -inf at worst (probability 0), never to +inf (inf - inf is NaN in softmax).
    scaled = (logits - logits.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()):  # only non-finite logits get here
        raise ValueError("the model's logits are not finite: nothing to sample from")
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] float32. Logprobs are the model's own distribution (before temperature)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = _sample_one(logits[row], p, generators[row])
    want = [row for row, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        for i, row in enumerate(want):
            chosen = tokens[row]
            top: tuple[tuple[int, float], ...] = ()
            n = min(params[row].logprobs or 0, lp.shape[-1])
            if n > 0:
                values, ids = torch.topk(lp[i], n)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs[row] = TokenLogprob(chosen, float(lp[i, chosen]), top)
    return tokens, logprobs
