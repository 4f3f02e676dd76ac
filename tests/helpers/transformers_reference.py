"""Our engine against Hugging Face transformers on the same weights: teacher-forced logits
through the paged prefill, greedy tokens through the step loop, and transformers' own."""

import torch

from kvfence_engine.core.engine import LLMEngine
from kvfence_engine.core.request import SamplingParams


def our_prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the paged prefill path."""
    seq = engine.admit(ids, SamplingParams(max_tokens=1), max_tokens=1)
    engine.add(seq)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and seqs == [seq]
    step = engine.runner.prepare(seqs, True)
    step.logits_rows = torch.arange(len(ids))
    logits = engine.runner.run(step)
    seq.finish("abort")  # over: its pages go back
    engine.scheduler.release(seq)
    return logits


def our_greedy(engine: LLMEngine, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    seq = engine.admit(ids, SamplingParams(max_tokens=1, logprobs=0, ignore_eos=True), max_tokens=n)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output_ids, [lp.logprob for lp in seq.output_logprobs]


def their_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    # greedy without logits processors: the scores are the raw logits. It stops at eos.
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item()
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs
