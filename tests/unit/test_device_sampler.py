"""Sampling on the device (core/device_sampler): the same candidates as core/sampler, each drawn
with its probability, a draw fixed by (seed, position) whatever the batch, greedy rows'
argmax, and the host's logprobs."""

from dataclasses import replace

import pytest
import torch

from kvfence_engine.core.device_sampler import (
    SamplingRows,
    filtered,
    logprobs,
    sample,
    uniforms,
)


def rows(batch: int, *, temperature=0.8, top_k=0, top_p=1.0, seed=1, position=0) -> SamplingRows:
    def full(value, dtype):
        return torch.full((batch,), value, dtype=dtype)

    return SamplingRows(
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        seed=full(seed, torch.int64),
        position=full(position, torch.int64),
    )


def host_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """core/sampler._sample_one's distribution, step for step."""
    scaled = (logits - logits.max()) / temperature
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 12, 0.8), (2.0, 1, 1.0), (1.0, 0, 0.0)],
)
def test_the_candidates_are_the_host_samplers(temperature, top_k, top_p) -> None:
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(6, 40, generator=gen) * 3
    cut = filtered(logits, rows(6, temperature=temperature, top_k=top_k, top_p=top_p))
    for row in range(6):
        expected = host_probs(logits[row], temperature, top_k, top_p) > 0
        assert torch.equal(torch.isfinite(cut[row]), expected), row


def test_each_token_is_drawn_with_its_probability() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 4.0])
    draws = 40_000
    batch = rows(draws, temperature=0.9, top_k=6, top_p=0.95, seed=11)
    batch = replace(batch, position=torch.arange(draws))  # one draw per position
    tokens = sample(logits.expand(draws, -1), batch)
    seen = torch.bincount(tokens, minlength=8).double() / draws
    expected = host_probs(logits, 0.9, 6, 0.95).double()
    assert torch.equal(seen > 0, expected > 0)
    error = (expected * (1 - expected) / draws).sqrt()
    assert bool(((seen - expected).abs() <= 4 * error + 1e-9).all())  # four standard errors


def test_a_draw_is_fixed_by_seed_and_position_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=gen)
    alone = sample(logits[2:3], rows(1, seed=42, position=17))
    batch = SamplingRows(
        temperature=torch.tensor([0.8, 1.0, 0.8, 0.0]),
        top_k=torch.tensor([0, 3, 0, 0]),
        top_p=torch.tensor([1.0, 0.9, 1.0, 1.0]),
        seed=torch.tensor([7, 8, 42, 9]),
        position=torch.tensor([3, 17, 17, 1]),
    )
    together = sample(logits, batch)
    assert int(together[2]) == int(alone[0])
    assert int(together[3]) == int(logits[3].argmax())  # temperature 0: greedy
    other_seeds = {int(sample(logits[2:3], rows(1, seed=s, position=17))[0]) for s in range(30)}
    assert len(other_seeds) > 5  # the seed matters


def test_uniforms_are_in_the_open_interval_and_flat() -> None:
    u = uniforms(torch.tensor([1, 2, -5]), torch.tensor([0, 0, 1 << 40]), 20_000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_logprobs_are_the_models_own() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen)
    tokens = torch.tensor([4, 0, 49])
    chosen, values, ids = logprobs(logits, tokens, 3)
    lp = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, lp[torch.arange(3), tokens])
    top = torch.topk(lp, 3)
    assert torch.equal(ids, top.indices) and torch.allclose(values, top.values)
    _, none_values, none_ids = logprobs(logits, tokens, 0)
    assert none_values.shape == (3, 0) and none_ids.shape == (3, 0)
