"""Tensor parallelism (kvfence_engine/parallel): how a model splits over ranks, and two ranks
(gloo on CPU) giving the very greedy tokens one does, on every family, with the read check run
and refusing on each rank."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.model_cases import CASES, FAMILIES
from helpers.tensor_parallel import rank_one
from helpers.transformers_reference import hf_model, our_greedy, random_prompt
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.faults import Fault, Faults
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.quantization import Int4Groups
from kvfence_engine.core.request import SamplingParams
from kvfence_engine.core.shard_weights import shard_checkpoint
from kvfence_engine.core.shards import Span, even_spans, plan_shards, pool_shape, rank_config
from kvfence_engine.disagg.receiver import KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Layout, send_kv
from kvfence_engine.loading.loader import load_model
from kvfence_engine.parallel.launch import check_devices, rank_device

ARGS = EngineArgs(kv_cache_memory=4 << 20, page_size=8)
PROMPT, NEW = 200, 64


SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=2,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=1e4,
    rms_eps=1e-5,
    max_positions=256,
    tie_embeddings=True,
)


def config(heads: int, kv: int) -> ModelConfig:
    return replace(SMOLLM2, num_heads=heads, num_kv_heads=kv)


def test_even_spans_split_as_tensor_split_does() -> None:
    assert even_spans(9, 2) == [Span(0, 5), Span(5, 9)]
    for total in range(1, 12):
        for parts in range(1, total + 1):
            sizes = [s.size for s in even_spans(total, parts)]
            expected = [len(c) for c in torch.arange(total).tensor_split(parts)]
            assert sizes == expected


def test_kv_heads_split_whole_with_their_query_groups() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) over 2 ranks: 2 KV heads and their 6 query heads,
    then 1 and 3."""
    first, second = plan_shards(config(9, 3), 2)
    assert (first.kv_heads, first.q_heads) == (Span(0, 2), Span(0, 6))
    assert (second.kv_heads, second.q_heads) == (Span(2, 3), Span(6, 9))
    assert [s.vocab for s in (first, second)] == [Span(0, 24576), Span(24576, 49152)]
    assert rank_config(config(9, 3), second).num_heads == 3
    # each rank's pool has as many pages, sized for the rank with the most KV heads
    assert pool_shape(SMOLLM2, 2).num_kv_heads == 2
    assert pool_shape(SMOLLM2, 1) is SMOLLM2


def test_fewer_kv_heads_than_ranks_are_replicated_and_their_groups_split() -> None:
    shards = plan_shards(config(8, 2), 4)
    assert [s.kv_heads for s in shards] == [Span(0, 1), Span(0, 1), Span(1, 2), Span(1, 2)]
    assert [s.q_heads for s in shards] == [Span(0, 2), Span(2, 4), Span(4, 6), Span(6, 8)]


@pytest.mark.parametrize(
    ("heads", "kv", "world", "why"),
    [
        (4, 2, 8, "fewer than the ranks"),
        (12, 2, 3, "not a multiple"),
        (4, 4, 8, "fewer than the ranks"),
        (6, 3, 4, "not a multiple"),
    ],
)
def test_a_model_that_does_not_split_is_refused_by_name(
    heads: int, kv: int, world: int, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        plan_shards(config(heads, kv), world)


def test_each_rank_holds_its_rows_and_columns_and_one_rank_the_summed_biases() -> None:
    c = replace(config(4, 2), hidden_size=256, intermediate_size=64, vocab_size=10)
    d = c.head_dim
    names = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4 * d, 256),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2 * d, 256),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(256, 4 * d),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(256),
        "model.layers.0.mlp.down_proj.weight": torch.randn(256, 64),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(64, 256),
        "model.layers.0.input_layernorm.weight": torch.randn(256),
        "model.embed_tokens.weight": torch.randn(10, 256),
    }
    parts = [shard_checkpoint(c, s, names, {})[0] for s in plan_shards(c, 2)]
    for name, full in names.items():
        if name.endswith("o_proj.bias"):
            assert torch.equal(parts[0][name], full) and not parts[1][name].any()
        elif "layernorm" in name:
            assert all(torch.equal(p[name], full) for p in parts)
        else:
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), full), name


def test_int4_groups_split_on_their_32_wide_groups_or_are_refused() -> None:
    c = config(9, 3)
    groups = Int4Groups(
        torch.zeros(576, 9 * 64, dtype=torch.uint8), torch.ones(576, 18), torch.zeros(576, 18)
    )
    o_proj = {"model.layers.0.self_attn.o_proj.weight": groups}
    second = shard_checkpoint(c, plan_shards(c, 2)[1], {}, o_proj)[1]
    part = second["model.layers.0.self_attn.o_proj.weight"]
    assert part.q.shape == (576, 192) and part.scale.shape == (576, 6)
    odd = replace(c, head_dim=48)  # rank 1's inputs start at 288: not on a group
    with pytest.raises(ValueError, match="groups of 32"):
        shard_checkpoint(odd, plan_shards(odd, 2)[1], {}, o_proj)


# Every family (a sliding window wherever it has one), and the two uneven shapes: whole KV
# heads split 2 and 1 (SmolLM2's), and one KV head replicated on both ranks
SPLITS = {
    "llama-uneven-kv-heads": (
        "LlamaConfig",
        {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
    ),
    "llama-replicated-kv-head": ("LlamaConfig", {"num_key_value_heads": 1}),
}
TP_CASES = {name: CASES[name] for name in FAMILIES} | SPLITS


PREFILL, DECODE = replace(ARGS, role="prefill"), replace(ARGS, role="decode")


def disaggregated_greedy(prefill: LLMEngine, decode: LLMEngine, ids: list[int]) -> list[int]:
    """Prefill computes the prompt's KV and its first token; the KV streams over TCP (the
    transfer protocol, checksums on) into the pages decode reserved; decode goes on."""
    reservations = DecodeReservations(decode)
    receiver = KVReceiver(reservations, "127.0.0.1", 0, token=None)
    receiver.start()
    try:
        decode.args.transfer_port = receiver.port
        params = SamplingParams(max_tokens=1, logprobs=0, ignore_eos=True)
        first = prefill.admit(ids, params, max_tokens=1)
        first.export_kv = True
        prefill.add(first)
        while prefill.has_work():
            prefill.step()
        assert first.exported is not None and first.output_logprobs
        k, v, written = first.exported
        seq = decode.admit(ids, params, max_tokens=NEW)
        handle = reservations.reserve(seq, "tp")
        send_kv(handle, k, v, written, Layout.of(prefill.pages.kv), token=None)
        reservations.start_decode(handle.request_id, first.output_logprobs[0])
        while decode.has_work():
            decode.step()
        assert decode.pages.num_used == 0
        return seq.output_ids
    finally:
        receiver.stop()


@pytest.mark.slow
def test_two_ranks_give_one_ranks_greedy_tokens_on_every_family(tmp_path: Path) -> None:
    """64 greedy tokens after a 200-token prompt (pages of 8: prefill and decode cross pages),
    float32, TP=2 against TP=1 on the same folder: combined; a TP=2 prefill sending to a TP=1
    decode (its ranks' heads joined into whole pages); a TP=1 prefill sending to a TP=2
    decode (each rank keeping its heads of them)."""
    folders: list[str] = []
    groups = []
    for name, (config_class, overrides) in TP_CASES.items():
        (tmp_path / name).mkdir()
        hf_model(tmp_path / name, config_class, **overrides)
        folder = str(tmp_path / name)
        folders.append(folder)
        groups += [(folder, ARGS), (folder, PREFILL), (folder, DECODE)]
    ids = random_prompt(PROMPT)
    with rank_one(groups) as rank:
        for i, (name, folder) in enumerate(zip(TP_CASES, folders, strict=True)):
            expected, _ = our_greedy(LLMEngine(load_model(folder), ARGS), ids, NEW)
            with rank.engine(3 * i) as engine:
                tokens, _ = our_greedy(engine, ids, NEW)
            assert tokens == expected, f"{name}: combined"
            with rank.engine(3 * i + 1) as prefill:
                decode = LLMEngine(load_model(folder), DECODE)
                tokens = disaggregated_greedy(prefill, decode, ids)
            assert tokens == expected, f"{name}: TP=2 prefill, TP=1 decode"
            prefill = LLMEngine(load_model(folder), PREFILL)
            with rank.engine(3 * i + 2) as decode:
                tokens = disaggregated_greedy(prefill, decode, ids)
            assert tokens == expected, f"{name}: TP=1 prefill, TP=2 decode"


def test_a_rank_whose_pool_diverged_refuses_on_every_rank(tmp_path: Path) -> None:
    """The rank-desync fault: rank 1 stops following rank 0's bookkeeping, so its own part of
    every page is not the owner's as far as it knows. Rank 0's check passes the request, rank
    1's refuses it, and the step is refused on both: the request fails closed with an
    isolation error and nothing runs. Without the fault, the same request is served."""
    hf_model(tmp_path, "LlamaConfig")
    faulty = replace(ARGS, faults=Faults(frozenset({Fault.RANK_DESYNC})))
    ids = random_prompt(40)
    with rank_one([(str(tmp_path), ARGS), (str(tmp_path), faulty)]) as rank:
        with rank.engine(0) as engine:
            tokens, _ = our_greedy(engine, ids, 8)
            assert len(tokens) == 8
        with rank.engine(1) as engine:
            seq = engine.admit(ids, SamplingParams(max_tokens=8), max_tokens=8)
            engine.add(seq)
            while engine.has_work():
                engine.step()
            assert seq.error is not None and seq.error.code == "kv_isolation_violation"
            assert not seq.output_ids
            assert engine.metrics.tag_mismatch._value.get() == 1
            assert engine.leader is not None and engine.leader.refused_by_rank == [0, 1]
            assert engine.pages.num_used == 0  # its pages went back


def test_each_rank_gets_its_own_gpu_or_the_start_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank r takes the r-th GPU from --device; too few is refused before any rank starts."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_device("cuda:2", 1) == torch.device("cuda", 3)
    assert rank_device("cpu", 1) == torch.device("cpu")
    check_devices("cuda:2", 2)
    check_devices("cpu", 8)
    with pytest.raises(ValueError, match=r"needs GPUs cuda:3..cuda:4; this machine has 4"):
        check_devices("cuda:3", 2)
