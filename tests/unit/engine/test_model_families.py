"""Every family and RoPE variant kvfence serves, against transformers on the same folder.

Each case is a tiny model built from transformers' own config class (hidden 64, 2 layers, 256
tokens), every weight redrawn (norm gains around 1, biases nonzero, so that each is seen),
saved with save_pretrained and loaded by kvfence's real loader: float32 on CPU on both sides,
the combined engine with pages of 8 tokens, so that prompts and generations cross pages.

- teacher-forced log-probs over a 200-token prompt: max |diff| < 1e-4 (measured: <= 8e-5, the
  tied Gemmas the most);
- 64 greedy tokens after it: identical, and their log-probs within 1e-4.

The long-context variants (linear, llama3, yarn) put original_max_position_embeddings at 64,
so that most of the 264 positions lie past it. `dynamic` is exact up to max_position_embeddings
(512 here), where transformers' dynamic NTK is plain RoPE; past it the engine refuses to serve
(tests/unit/engine/test_model_refusals.py). `longrope` in both of the regimes where the served
context decides as transformers' sequence does (core/rope.py): served past
original_max_position_embeddings (64) with a prompt past it from the first forward (long
factors), and served within it (320, short factors).
"""

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Unpack

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from helpers.engines import TinyEngineOptions
from helpers.model_cases import CASES, FAMILIES, SERVED
from helpers.transformers_reference import (
    hf_model,
    our_greedy,
    our_prefill_logits,
    random_prompt,
    their_greedy,
)
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.layers import SparseMoE
from kvfence_engine.core.model_config import RopeScaling, RopeType
from kvfence_engine.core.quantization import pack_int4_linears
from kvfence_engine.core.request import Request, SamplingParams
from kvfence_engine.core.rope import rope_frequencies
from kvfence_engine.disagg.receiver import KVReceiver
from kvfence_engine.disagg.reservations import DecodeReservations
from kvfence_engine.disagg.transfer import Layout, send_kv
from kvfence_engine.loading.loader import LoadedModel, int4_groups, load_model

# Each case builds and runs transformers' model too: make test runs them, test-fast does not.
pytestmark = pytest.mark.slow

PAGE = 8
PROMPT, NEW = 200, 64
TOLERANCE = 1e-4


def engine_for_loaded(loaded: LoadedModel, **args: Unpack[TinyEngineOptions]) -> LLMEngine:
    budget = EngineArgs(kv_cache_memory=4 << 20, page_size=PAGE)
    return LLMEngine(loaded, replace(budget, **args))


def engine_for(folder: Path, **args: Unpack[TinyEngineOptions]) -> LLMEngine:
    return engine_for_loaded(load_model(str(folder)), **args)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_are_transformers(case: str, tmp_path: Path) -> None:
    config_class, overrides = CASES[case]
    theirs = hf_model(tmp_path, config_class, **overrides)
    engine = engine_for(tmp_path, context_length=SERVED.get(case))
    ids = random_prompt(PROMPT)
    with torch.no_grad():
        expected = torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), -1)
    ours = torch.log_softmax(our_prefill_logits(engine, ids), -1)
    diff = (ours - expected).abs().max().item()
    tokens, logprobs = our_greedy(engine, ids, NEW)
    ref_tokens, ref_logprobs = their_greedy(theirs, ids, NEW)
    lp_diff = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    print(f"{case}: max |dlogprob| {diff:.2e} (prefill), {lp_diff:.2e} (greedy)")
    assert diff < TOLERANCE
    assert len(ref_tokens) == NEW and tokens == ref_tokens
    assert lp_diff < TOLERANCE


def test_a_llama_3_folder_with_llama3_rope_scaling_gives_transformers_greedy_tokens(
    tmp_path: Path,
) -> None:
    """Issue #25's case: Llama-3.2-1B's RoPE (rope_theta 500000 and its rope_scaling, written as
    its config.json writes them), tied embeddings; 48 greedy tokens after a 40-token prompt.
    Before rope scaling was read, the tokens left transformers' at the 12th."""
    model = hf_model(tmp_path, "LlamaConfig", tie_word_embeddings=True, head_dim=16)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config |= {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "architectures": ["LlamaForCausalLM"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    import transformers  # here, not at collection: test-fast collects this module too

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    embed = "model.embed_tokens.weight"
    assert torch.equal(theirs.state_dict()[embed], model.state_dict()[embed])
    engine = engine_for(tmp_path, context_length=1024)
    ids = random_prompt(40, seed=3)
    tokens, _ = our_greedy(engine, ids, 48)
    ref_tokens, _ = their_greedy(theirs.eval(), ids, 48)
    assert tokens == ref_tokens


@pytest.mark.parametrize(
    "case", ["llama-biases", "qwen2", "qwen3-tied-biases", "qwen3-moe", "gemma3", "phi3"]
)
def test_packed_weights_find_each_familys_linears(case: str, tmp_path: Path) -> None:
    """linear_sources names the weights each fused linear was built from, biases beside: with
    a GGUF's kind of int4 groups (Q4_0 of every projection) and the exact float32 kernel, the
    packed model is the float32 one on the same rounded weights, up to the float16 lm_head;
    int8 packs every linear of the family too. (A MoE's experts are packed, each its own
    linears; its router stays float, so that packed and float route alike.)"""
    config_class, overrides = CASES[case]
    hf_model(tmp_path, config_class, **overrides)
    loaded = load_model(str(tmp_path))
    kind = GGMLQuantizationType.Q4_0
    int4 = {}
    for name, weight in list(loaded.weights.items()):
        if name.endswith("_proj.weight"):
            raw = quantize(weight.numpy(), kind)
            loaded.weights[name] = torch.from_numpy(dequantize(raw, kind))
            int4[name] = int4_groups(raw, kind)
    engine = engine_for_loaded(loaded, weight_dtype="float32")
    ids = random_prompt(40)
    reference = our_prefill_logits(engine, ids)
    model = engine.runner.model
    counts = pack_int4_linears(model, model.linear_sources, int4, kernel_dtype=torch.float32)
    projections = [p for p in model.linear_sources if p != "lm_head"]
    # q/k/v and o, then gate/up and down for each expert (a dense MLP: one)
    per_layer = 2 + 2 * (engine.config.num_experts or 1)
    assert len(projections) == engine.config.num_layers * per_layer
    assert counts == {"int4": len(projections), "float16": 1}
    diff = (our_prefill_logits(engine, ids) - reference).abs().max().item()
    float32 = our_prefill_logits(engine_for(tmp_path), ids)
    int8 = engine_for(tmp_path, weight_dtype="int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.runner.model.modules())
    int8_logits = our_prefill_logits(int8, ids)
    top1 = (int8_logits.argmax(-1) == float32.argmax(-1)).float().mean().item()
    print(
        f"{case}: int4 (float32 kernel) max |dlogit| {diff:.4f}; int8 max |dlogit| "
        f"{(int8_logits - float32).abs().max().item():.3f}, top-1 {top1:.2f} "
        f"(logits std {float32.std().item():.1f})"
    )
    assert diff <= 0.02
    assert top1 >= 0.9


@pytest.mark.parametrize(
    "case", ["mistral-window", "qwen2-window", "gemma2-small-caps", "gemma3-softcaps"]
)
def test_a_sliding_window_after_a_prefix_cache_hit_is_transformers(
    case: str, tmp_path: Path
) -> None:
    """A prompt whose first pages come from the prefix cache: its own queries attend through
    the window to keys read from the shared pages (attention's after-prefix path), and its
    greedy tokens are transformers' still."""
    config_class, overrides = CASES[case]
    theirs = hf_model(tmp_path, config_class, **overrides)
    engine = engine_for(tmp_path, prefix_cache=True)
    ids = random_prompt(PROMPT)
    our_greedy(engine, ids, 1)  # fills the cache with the prompt's full pages
    again = engine.admit(ids, SamplingParams(max_tokens=1, ignore_eos=True), max_tokens=NEW)
    engine.add(again)
    while engine.has_work():
        engine.step()
    assert again.cached_tokens >= PROMPT - PAGE
    ref_tokens, _ = their_greedy(theirs, ids, NEW)
    assert again.output_ids == ref_tokens


@pytest.mark.parametrize("case", ["qwen3-moe", "qwen3-moe-mixed-layers"])
def test_a_tiny_moe_routes_its_tokens_to_every_expert(case: str, tmp_path: Path) -> None:
    """The conformance cases see the router choose: over the prompt, each sparse layer
    sends some token to every expert and no choice of experts is every token's; the dense
    layers are plain gated MLPs."""
    config_class, overrides = CASES[case]
    hf_model(tmp_path, config_class, **overrides)
    engine = engine_for(tmp_path)
    chosen: dict[int, torch.Tensor] = {}  # sparse layer -> each prompt token's experts

    def record(layer: int) -> Callable[..., None]:
        def hook(moe: torch.nn.Module, args: tuple[torch.Tensor], _out: object) -> None:
            assert isinstance(moe, SparseMoE)
            chosen[layer] = moe.route(args[0])[1]

        return hook

    for i, layer in enumerate(engine.runner.model.layers):
        assert isinstance(layer.mlp, SparseMoE) == engine.config.layer_is_sparse(i)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.register_forward_hook(record(i))
    our_prefill_logits(engine, random_prompt(PROMPT))
    sparse = [i for i in range(engine.config.num_layers) if engine.config.layer_is_sparse(i)]
    assert sorted(chosen) == sparse and sparse
    for experts in chosen.values():
        assert experts.unique().tolist() == list(range(engine.config.num_experts))
        picks = {tuple(sorted(row)) for row in experts.tolist()}
        assert len(picks) > 1


def test_two_moe_prompts_decoded_in_one_step_get_the_tokens_each_gets_alone(
    tmp_path: Path,
) -> None:
    """The experts gather the rows routed to them and add them back: two prompts of different
    lengths, prefilled and decoded together, each get the greedy tokens they get alone (rows
    mixed across requests would change both)."""
    config_class, overrides = CASES["qwen3-moe"]
    hf_model(tmp_path, config_class, **overrides)
    engine = engine_for(tmp_path)
    prompts = [random_prompt(37, seed=5), random_prompt(90, seed=6)]
    alone = [our_greedy(engine, ids, 24)[0] for ids in prompts]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    seqs = [engine.admit(ids, params, max_tokens=24) for ids in prompts]
    for seq in seqs:
        engine.add(seq)
    decoded_together = 0
    while engine.has_work():
        decoding = all(seq.output_ids for seq in seqs)
        changed = engine.step()
        decoded_together += decoding and all(seq in changed for seq in seqs)
    assert decoded_together >= 20  # steps that decoded both at once
    assert [seq.output_ids for seq in seqs] == alone
    assert alone[0] != alone[1]


def test_longrope_served_past_its_original_context_turns_a_short_prompt_by_the_long_factors(
    tmp_path: Path,
) -> None:
    """Where the rule and transformers part (core/rope.py): an engine serving 512 positions,
    past original_max_position_embeddings (64), rotates a 40-token prompt by the long factors
    too, where transformers, whose sequence has not passed 64, takes the short ones. Ours is
    transformers' with its short table swapped for its own long one; transformers' itself is
    another function of the prompt."""
    import transformers

    config_class, overrides = CASES["phi3-longrope"]
    theirs = hf_model(tmp_path, config_class, **overrides)
    ids = random_prompt(40)
    ours = torch.log_softmax(our_prefill_logits(engine_for(tmp_path), ids), -1)

    def their_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), -1)

    short = their_logprobs()
    longrope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
    long_inv_freq = longrope(theirs.config, None, seq_len=65)[0]  # what it takes past 64
    rotary = theirs.get_submodule("model.rotary_emb")
    rotary.register_buffer("original_inv_freq", long_inv_freq, persistent=False)
    long = their_logprobs()
    to_long, to_short = (ours - long).abs().max().item(), (ours - short).abs().max().item()
    print(
        f"phi3-longrope, 40 tokens: max |dlogprob| {to_long:.2e} to long, {to_short:.2f} to short"
    )
    assert to_long < TOLERANCE
    assert to_short > 100 * TOLERANCE


def greedy_params() -> SamplingParams:
    return SamplingParams(max_tokens=1, logprobs=0, ignore_eos=True)


def run(engine: LLMEngine, seq: Request) -> None:
    engine.add(seq)
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("case", FAMILIES)
def test_prefill_then_a_kv_transfer_then_decode_gives_transformers_greedy_tokens(
    case: str, tmp_path: Path
) -> None:
    """A prefill engine computes the prompt's KV (a second time: from the prefix cache's pages
    the first left), streams it over TCP into the pages a decode engine reserved (the transfer
    protocol, checksums on), and decode continues from prefill's first token: the 64 tokens
    and their log-probs are transformers'. Pages of 8 tokens: the prompt's last page is part
    filled, and the window (where there is one) slides across the transferred pages."""
    config_class, overrides = CASES[case]
    theirs = hf_model(tmp_path, config_class, **overrides)
    # one tenant: the prefix cache's whole share of the pool is its own
    prefill = engine_for(tmp_path, role="prefill", prefix_cache=True, prefix_cache_tenants=1)
    decode = engine_for(tmp_path, role="decode")
    book = DecodeReservations(decode)
    receiver = KVReceiver(book, "127.0.0.1", 0, token=None)
    receiver.start()
    try:
        decode.args.transfer_port = receiver.port
        ids = random_prompt(PROMPT - 3)  # 197: the last of 25 pages holds 5 tokens
        for attempt in ("cold", "cached"):
            first = prefill.admit(ids, greedy_params(), max_tokens=1)
            first.export_kv = True
            run(prefill, first)
            assert attempt == "cold" or first.cached_tokens >= len(ids) - PAGE
            assert first.exported is not None and first.output_logprobs
            k, v, written = first.exported
            seq = decode.admit(ids, greedy_params(), max_tokens=NEW)
            handle = book.reserve(seq, f"{case}-{attempt}")
            send_kv(handle, k, v, written, Layout.of(prefill.pages.kv), token=None)
            book.start_decode(handle.request_id, first.output_logprobs[0])
            while decode.has_work():
                decode.step()
            tokens = seq.output_ids
            logprobs = [lp.logprob for lp in seq.output_logprobs]
            ref_tokens, ref_logprobs = their_greedy(theirs, ids, NEW)
            lp_diff = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
            print(f"{case} ({attempt} prefill): max |dlogprob| {lp_diff:.2e} after the transfer")
            assert len(ref_tokens) == NEW and tokens == ref_tokens
            assert lp_diff < TOLERANCE
        assert decode.pages.num_used == 0
    finally:
        receiver.stop()


@pytest.mark.parametrize("case", FAMILIES)
def test_requests_preempted_and_recomputed_give_transformers_greedy_tokens(
    case: str, tmp_path: Path
) -> None:
    """Three prompts in a pool that holds two of them whole: decoding, the youngest is preempted
    (its pages released) and later computed again from its prompt and the tokens it had, and
    every one of them still gets transformers' greedy tokens. (Every prompt is longer than the
    64 positions of phi3-longrope's original context: transformers rotates a shorter one by
    the short factors, which a paged pool cannot, docs/engine.md#supported-models.)"""
    config_class, overrides = CASES[case]
    theirs = hf_model(tmp_path, config_class, **overrides)
    loaded = load_model(str(tmp_path))
    footprint = (96 + NEW) // PAGE + 1  # pages of the longest request, whole
    budget = loaded.config.kv_bytes_per_token(4) * PAGE * 2 * footprint
    engine = LLMEngine(loaded, EngineArgs(kv_cache_memory=budget, page_size=PAGE))
    prompts = [random_prompt(n, seed=10 + n) for n in (96, 80, 70)]
    seqs = [engine.admit(ids, greedy_params(), max_tokens=NEW) for ids in prompts]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    preempted = engine.metrics.registry.get_sample_value("kvfence_preemptions_total")
    assert preempted is not None and preempted >= 1
    for ids, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == their_greedy(theirs, ids, NEW)[0]
    assert engine.pages.num_used == 0


# --- a GGUF as llama.cpp's converter writes a Llama 3.1 (its llama3 RoPE as rope_freqs) -------


def llama_cpp_rope_factors(rope: dict[str, Any], head_dim: int) -> list[float]:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py derives it from a llama3 rope:
    1 for short wavelengths, `factor` for long ones, a smooth band between (its rule, restated)."""
    freqs = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for the llama architecture (interleaved RoPE pairs)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf_as_llama_cpp(model: torch.nn.Module, path: Path, arch: str) -> None:
    """`model` (a transformers Llama or Qwen3) as a float32 GGUF the way llama.cpp's converter
    writes one: `<arch>.` keys, its tensor names, Q/K rows in its order for llama (not qwen3),
    a llama3 rope as rope_freqs.weight alone, and a byte-level tokenizer of the same ids."""
    from gguf import GGUFWriter

    c: Any = model.config  # a transformers LlamaConfig or Qwen3Config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, c.vocab_size))])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(1)
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name in top:
            writer.add_tensor(top[name], array)
            continue
        _, _, layer, *part, kind = name.split(".")
        gguf_part = parts[".".join(part)]
        if arch == "llama" and gguf_part in ("attn_q", "attn_k"):
            heads = c.num_attention_heads if gguf_part == "attn_q" else c.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        writer.add_tensor(f"blk.{layer}.{gguf_part}.{kind}", np.ascontiguousarray(array))
    if c.rope_parameters["rope_type"] == "llama3":
        factors = llama_cpp_rope_factors(c.rope_parameters, c.head_dim)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# GGUF architecture, the case whose folder it is converted from
GGUF_CASES = {"llama-llama3": "llama", "qwen3-tied-biases": "qwen3"}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_a_gguf_written_as_llama_cpp_writes_it_is_its_transformers_model(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF converted from a folder as llama.cpp converts it serves what transformers
    computes from the folder: teacher-forced log-probs over 200 tokens and 64 greedy tokens.
    llama-llama3: a Llama 3.1-style GGUF (the llama3 scaling as llama.cpp's rope_freqs tensor,
    the only form its converter writes; most of the 200 positions past the original 64).
    qwen3-tied-biases: Qwen3's per-head q/k norms, its own head dim, biases, tied."""
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path / "cache"))
    config_class, overrides = CASES[case]
    (tmp_path / "hf").mkdir()
    theirs = hf_model(tmp_path / "hf", config_class, **overrides)
    path = tmp_path / f"{case}.gguf"
    write_gguf_as_llama_cpp(theirs, path, GGUF_CASES[case])
    engine = engine_for(path)
    assert engine.config.family == GGUF_CASES[case]
    llama3 = case == "llama-llama3"
    assert (engine.config.rope.type is RopeType.FREQ_FACTORS) == llama3
    ids = random_prompt(PROMPT)
    with torch.no_grad():
        expected = torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), -1)
    diff = (torch.log_softmax(our_prefill_logits(engine, ids), -1) - expected).abs().max().item()
    tokens, _ = our_greedy(engine, ids, NEW)
    print(f"{case} as a GGUF: max |dlogprob| {diff:.2e}")
    assert diff < TOLERANCE
    assert tokens == their_greedy(theirs, ids, NEW)[0]
    assert load_model(str(path)).config == engine.config  # from the converted weights' cache


def test_rope_freqs_of_the_real_llama_3_2_1b_are_transformers_llama3_frequencies() -> None:
    """On Llama-3.2-1B's own config (factor 32, original context 8192, head dim 64): the
    factors llama.cpp writes, divided out as ggml does, give transformers' llama3 frequencies
    to float32 rounding."""
    import transformers

    raw = json.loads((Path(__file__).parents[3] / "bench/configs/llama-3.2-1b.json").read_text())
    config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    theirs = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, None)[0]
    head_dim = raw["head_dim"]
    factors = llama_cpp_rope_factors(dict(config.rope_parameters or {}), head_dim)
    scaling = RopeScaling(type=RopeType.FREQ_FACTORS, freq_factors=tuple(factors))
    ours, attention = rope_frequencies(head_dim, raw["rope_theta"], scaling, 131072)
    assert attention == 1.0
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = rope_frequencies(head_dim, raw["rope_theta"], RopeScaling(), 8)[0]
    assert not torch.allclose(ours, plain)
