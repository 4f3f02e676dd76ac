"""The GGUF's own 4-bit blocks, kept (--weight-dtype int4; `auto` measures it against float16
on CPU for such files: test_weight_choice.py).

Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m) blocks of 32 become aten's int4 packed groups
of 32, whose kernel dequantizes w = (q - 8) * scale + zero: scale = d, and zero = 0 (Q4_0) or
m + 8 * d (Q4_1). The engine runs kvfence's own kernel (native/blocks.c: the blocks as the file
holds them, float32 arithmetic), whose weights ARE the file's, bit for bit, as are aten's
kernel's with float32 scales (d and m are fp16, so d * (q - 8) and m + 8 * d are exact in
float32 and the kernel rounds once, where gguf rounds d * q + m once). Where kvfence's kernel
cannot be built the engine runs aten's on bfloat16 (its float32 path is scalar: slower than a
float32 GEMM), so the served weights are the file's up to bfloat16 rounding of the scales,
zeros and products; that bound is a test too. The kernel itself: test_native_int4.py. Greedy
agreement with the float32 engine on SmolLM2: tests/unit/engine/test_int8_weights.py (slow).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from helpers.engines import generate, prompt_of, run_until_done, submit, tiny_q4
from kvfence_engine import native
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.quantization import (
    Float16Linear,
    Int4Linear,
    pack_int4_linears,
    resolve_precision,
)
from kvfence_engine.loading.loader import int4_groups, load_model, tiny_random
from kvfence_engine.loading.tokenizer_source import SMOLLM2
from kvfence_engine.native import Kernels

Q4 = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _quantized(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return quantize(weights * 0.2 + 0.05, kind)


def _kernel_weights(layer: Int4Linear, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The weight the kernel multiplies by, read back through it: x = identity rows."""
    eye = torch.eye(layer.in_features)
    return layer(eye if columns is None else eye[columns]).T


# the exact kernels: kvfence's own (native/blocks.c, what the engine runs) and aten's on float32
EXACT = {"kvfence": None, "aten-float32": torch.float32}


@pytest.mark.parametrize("kernel", EXACT)
@pytest.mark.parametrize("kind", Q4, ids=lambda k: k.name)
def test_the_kernels_weights_are_ggufs_dequantization_bit_for_bit(
    kind: GGMLQuantizationType, kernel: str
) -> None:
    raw = _quantized(96, 256, kind)
    layer = Int4Linear(int4_groups(raw, kind), None, kernel_dtype=EXACT[kernel])
    assert isinstance(layer.kernel, Kernels) == (kernel == "kvfence"), layer.kernel
    file_weights = torch.from_numpy(dequantize(raw, kind))
    assert torch.equal(_kernel_weights(layer), file_weights)
    # and as a matmul: against float64 over the same weights, within float32 accumulation
    # (|error| <= K * eps32 * sum |x w|, here ~1e-5 on outputs of ~1)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ file_weights.double().T
    bound = (
        256 * torch.finfo(torch.float32).eps * (x.double().abs() @ file_weights.double().abs().T)
    )
    assert ((layer(x).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", Q4, ids=lambda k: k.name)
def test_served_bfloat16_int4_weights_are_the_files_up_to_bfloat16_rounding(
    kind: GGMLQuantizationType,
) -> None:
    """bfloat16 keeps 8 significant bits: scale and zero each within 2^-9 relative, the
    product and the output within 2^-9 of theirs; 2^-7 of (8|scale| + |zero| + |w|) bounds it."""
    raw = _quantized(64, 128, kind, seed=2)
    groups = int4_groups(raw, kind)
    served = _kernel_weights(Int4Linear(groups, None, kernel_dtype=torch.bfloat16)).float()
    file_weights = torch.from_numpy(dequantize(raw, kind))
    per_group = 8 * groups.scale.abs() + groups.zero.abs()
    bound = 2**-7 * (per_group.repeat_interleave(32, dim=1) + file_weights.abs())
    assert ((served - file_weights).abs() <= bound).all()
    assert not torch.equal(served, file_weights)  # it IS rounded: the bound is what holds


def test_int4_keeps_int4_blocks_and_packs_the_rest_as_float16() -> None:
    args = EngineArgs(kv_cache_memory=16 << 20, weight_dtype="int4")
    engine = LLMEngine(tiny_q4(GGMLQuantizationType.Q4_1), args)
    model = engine.runner.model
    assert engine.precision.weights == "int4"
    layers = [
        layer.get_submodule(n)
        for layer in model.layers
        for n in ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")
    ]
    assert all(isinstance(m, Int4Linear) for m in layers)
    # the tied lm_head is the embedding table (Q8_0 in SmolLM2): the float path, in float16
    assert isinstance(model.lm_head, Float16Linear)
    assert engine.pages.kv.k.dtype == torch.float32
    assert engine.kvpool_report().weight_dtype == "int4"
    assert engine.kvpool_report().weight_choice is None  # asked for, not chosen
    assert not engine.loaded.int4  # the model holds them now
    # a model without 4-bit blocks keeps the float32 default, unmeasured
    plain = LLMEngine(tiny_random(), EngineArgs(kv_cache_memory=16 << 20))
    assert plain.precision.weights == "float32" and plain.precision.why is None


def test_int4_is_refused_where_it_cannot_run_with_what_to_use_instead() -> None:
    with pytest.raises(ValueError, match="int4 needs a GGUF model with Q4_0 or Q4_1 tensors"):
        resolve_precision("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match="on CUDA use bfloat16 or float16"):
        resolve_precision("int4", torch.device("cuda"), gguf_int4=True)
    assert resolve_precision("auto", torch.device("cuda"), gguf_int4=True).weights == "bfloat16"
    with pytest.raises(ValueError, match="int4\\+float16 needs a GGUF model with Q4_0 or Q4_1"):
        resolve_precision("int4+float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="on CUDA use bfloat16 or float16"):
        resolve_precision("int4+float16", torch.device("cuda"), gguf_int4=True)
    auto = resolve_precision("auto", torch.device("cpu"), gguf_int4=True)  # measured at start
    assert (auto.weights, auto.candidates) == ("int4", ("int4", "int4+float16"))
    assert resolve_precision("auto", torch.device("cpu")).weights == "float32"


@pytest.mark.parametrize("served", ["int4", "int4+float16"])
@pytest.mark.parametrize("kind", Q4, ids=lambda k: k.name)
def test_int4_engine_stays_close_to_float32_on_the_same_file_weights(
    kind: GGMLQuantizationType, served: str
) -> None:
    """Same dequantized weights both ways: only the float16 lm_head and the order of float32
    sums differ (kvfence's kernel). Measured: max |dlogit| 0.009, mean 0.001, top-1 100%
    (logits: std 8, max 40); int4+float16, whose prefill of 72 rows takes the float16 form:
    0.04. Aten's bfloat16 kernel (where kvfence's cannot be built) also rounds activations
    and scales: 0.54 (Q4_0) / 0.68 (Q4_1), mean 0.06, top-1 97% / 100% (int8's, for scale:
    1.85, 0.14, 93%), the looser bound."""
    prompts = [prompt_of(40, seed=1), prompt_of(9, seed=2), prompt_of(23, seed=3)]

    def logits(weight_dtype: str) -> torch.Tensor:
        engine = LLMEngine(
            tiny_q4(kind), EngineArgs(kv_cache_memory=16 << 20, weight_dtype=weight_dtype)
        )
        seqs = [submit(engine, p, 1, ignore_eos=True, logprobs=0) for p in prompts]
        step = engine.runner.prepare(engine.scheduler.schedule()[0], True)
        step.logits_rows = torch.arange(sum(len(p) for p in prompts))
        out = engine.runner.run(step)
        for seq in seqs:
            seq.finish("abort")
            engine.scheduler.release(seq)
        return out

    reference, packed = logits("float32"), logits(served)
    diff = (packed - reference).abs()
    top1 = (packed.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{kind.name}: max |dlogit| {diff.max():.3f}, mean {diff.mean():.4f}, top-1 {top1}")
    exact = isinstance(native.kernels(), Kernels)
    assert diff.max().item() <= (0.1 if exact else 1.0)
    assert diff.mean().item() <= (0.01 if exact else 0.1)
    assert top1 >= (1.0 if exact else 0.93)


def test_with_the_float32_kernel_the_int4_model_is_the_float32_model() -> None:
    """Packing end to end (which blocks go to which fused linear, in which order): with exact
    weights the model's logits are the float32 engine's up to float rounding and the float16
    lm_head (measured 0.009 on logits of std 8); the served bfloat16 kernel: up to 0.68."""
    loaded = tiny_q4(GGMLQuantizationType.Q4_1)
    int4 = dict(loaded.int4)
    engine = LLMEngine(loaded, EngineArgs(kv_cache_memory=16 << 20, weight_dtype="float32"))
    ids = prompt_of(40, seed=1)
    reference = _prefill_logits(engine, ids)
    model = engine.runner.model
    counts = pack_int4_linears(model, model.linear_sources, int4, kernel_dtype=torch.float32)
    assert counts == {"int4": 4 * engine.config.num_layers, "float16": 1}
    diff = (_prefill_logits(engine, ids) - reference).abs().max().item()
    print(f"float32 kernel: max |dlogit| {diff:.4f}")
    assert diff <= 0.02


def _prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    seq = submit(engine, ids, 1, ignore_eos=True)
    step = engine.runner.prepare(engine.scheduler.schedule()[0], True)
    step.logits_rows = torch.arange(len(ids))
    logits = engine.runner.run(step)
    seq.finish("abort")
    engine.scheduler.release(seq)
    return logits


def test_int4_float16_takes_the_int4_kernel_up_to_its_switch_and_float16_beyond() -> None:
    """int4+float16: one layer, both forms of the file's weights; a batch of up to wide_above
    rows is the int4 kernel's product, a larger one the float16 GEMM's, each within its own
    rounding of the file's weights."""
    kind = GGMLQuantizationType.Q4_1
    raw = _quantized(96, 256, kind, seed=4)
    file_weights = torch.from_numpy(dequantize(raw, kind))
    layer = Int4Linear(int4_groups(raw, kind), None, wide=Float16Linear(file_weights, None))
    layer.wide_above = 3
    assert layer.wide is not None
    gen = torch.Generator().manual_seed(5)
    for rows, form in ((1, layer.narrow), (3, layer.narrow), (4, layer.wide), (40, layer.wide)):
        x = torch.randn(rows, 256, generator=gen)
        assert torch.equal(layer(x), form(x)), rows
        assert not torch.equal(layer.narrow(x), layer.wide(x))  # the two forms do differ
        exact = x.double() @ file_weights.double().T
        scale = x.double().abs() @ file_weights.double().abs().T
        assert ((layer(x).double() - exact).abs() <= 2**-7 * scale + 1e-4).all(), rows


def test_int4_float16_keeps_int4_blocks_each_with_its_float16_form() -> None:
    args = EngineArgs(kv_cache_memory=16 << 20, weight_dtype="int4+float16")
    engine = LLMEngine(tiny_q4(GGMLQuantizationType.Q4_0), args)
    model = engine.runner.model
    layers = [
        layer.get_submodule(n)
        for layer in model.layers
        for n in ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")
    ]
    assert all(isinstance(m, Int4Linear) and m.wide is not None for m in layers)
    assert all(m.wide_above in (0, 1, 2, 4, 8, 16) for m in layers)  # measured at build
    assert isinstance(model.lm_head, Float16Linear)
    assert engine.kvpool_report().weight_dtype == "int4+float16"
    assert engine.kvpool_report().weight_choice is None  # asked for, not chosen


def test_int4_engine_decodes_a_batch_like_each_request_alone() -> None:
    kind = GGMLQuantizationType.Q4_0
    prompts = [prompt_of(n, seed=n) for n in (5, 17, 33, 48)]
    args = EngineArgs(kv_cache_memory=16 << 20, weight_dtype="int4")
    solo = [
        generate(LLMEngine(tiny_q4(kind), args), p, 10, ignore_eos=True).output_ids for p in prompts
    ]
    engine = LLMEngine(tiny_q4(kind), args)
    seqs = [submit(engine, p, 10, ignore_eos=True) for p in prompts]
    run_until_done(engine)
    assert [s.output_ids for s in seqs] == solo


@pytest.mark.slow
def test_smollm2_int4_weights_are_the_files_bit_for_bit() -> None:
    """Every Q4_1 tensor of the SmolLM2 file (Q/K rows un-permuted as the float path does),
    read back through each exact kernel at 32 sampled input columns, equals the float
    weights load_model gives (gguf's dequantization)."""
    loaded = load_model(SMOLLM2)
    assert len(loaded.int4) == 30 * 7
    gen = torch.Generator().manual_seed(0)
    for name, groups in loaded.int4.items():
        for kernel_dtype in EXACT.values():
            layer = Int4Linear(groups, None, kernel_dtype=kernel_dtype)
            columns = torch.randperm(layer.in_features, generator=gen)[:32]
            served = _kernel_weights(layer, columns)
            assert torch.equal(served, loaded.weights[name][:, columns]), name
