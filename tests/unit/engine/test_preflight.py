"""`kvfence preflight`: the engine's own pool arithmetic, before anything starts (and against
a running engine: tests/integration/test_commands.py)."""

import re
from pathlib import Path

import pytest

from kvfence_cli.main import main
from kvfence_engine.tools.units import SIZE_GRAMMAR


@pytest.mark.slow  # parses the real SmolLM2 GGUF's header
def test_preflight_says_a_context_does_not_fit_and_what_lower_context_would_serve(capsys):
    code = main(
        [
            "preflight",
            "--model", "builtin:smollm2-135m-instruct",
            "--kv-cache-memory", "64Mi",
            "--context-length", "2048",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "KV bytes per token: 46080" in out  # 2 x 30 layers x 3 heads x 64 dims x 4 bytes
    assert "DOES NOT FIT" in out and "LowerContext would serve 1456 tokens" in out


def test_preflight_sizes_a_moe_pool_by_its_attention_alone(tmp_path, capsys):
    """Qwen3-30B-A3B's 128 experts a layer hold most of its weights and no KV: a token costs
    K and V of 48 layers x 4 KV heads x 128 dims, as a dense model of that attention would
    (preflight reads config.json alone; it estimates no weights)."""
    hub = Path(__file__).resolve().parents[2] / "helpers/samples/hub_configs/qwen3-30b-a3b.json"
    (tmp_path / "config.json").write_text(hub.read_text())
    code = main(["preflight", "--model", str(tmp_path), "--kv-cache-memory", "12Gi",
                 "--context-length", "40960", "--device", "cuda"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "48 layers x 4 KV heads x 128 dims, 40960 positions" in out
    assert "KV bytes per token: 98304 (bfloat16" in out  # 2 x 48 x 4 x 128 x 2 bytes
    assert "context 40960: fits" in out


def test_preflight_with_tensor_parallelism_sizes_a_ranks_pool(tmp_path, capsys):
    """Qwen3-30B-A3B's 4 KV heads over 2 ranks: a rank's token costs its 2 heads, so the same
    budget per GPU holds twice the tokens; over 8, each KV head is replicated on 2 ranks (one
    head each); over 6 (more ranks than KV heads, and not a multiple of them) it is refused."""
    hub = Path(__file__).resolve().parents[2] / "helpers/samples/hub_configs/qwen3-30b-a3b.json"
    (tmp_path / "config.json").write_text(hub.read_text())
    base = ["preflight", "--model", str(tmp_path), "--kv-cache-memory", "12Gi",
            "--context-length", "40960", "--device", "cuda"]  # fmt: skip
    assert main([*base, "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "KV bytes per token: 49152 (bfloat16, K and V, every layer, of the rank" in out
    assert "tokens per rank (2 per engine, 2 KV heads)" in out
    assert main([*base, "--tensor-parallel-size", "8"]) == 0
    assert "KV bytes per token: 24576" in capsys.readouterr().out
    assert main([*base, "--tensor-parallel-size", "6"]) == 2
    assert "ranks are not a multiple of them" in capsys.readouterr().err


def test_preflight_against_an_unreachable_target_exits_2(capsys):
    code = main(["preflight", "--context-length", "512", "--target", "http://127.0.0.1:9"])
    assert code == 2
    assert "kvfence preflight:" in capsys.readouterr().err


def test_preflight_over_the_models_positions_does_not_fit(capsys):
    code = main(
        ["preflight", "--model", "builtin:tiny-random", "--kv-cache-memory", "1Gi",
         "--context-length", "8192"]
    )  # fmt: skip
    assert code == 1
    assert "DOES NOT FIT the model's 4096 positions" in capsys.readouterr().out


HUB_CONFIGS = Path(__file__).resolve().parents[2] / "helpers/samples/hub_configs"


@pytest.mark.parametrize(
    ("name", "shape", "bytes_per_token", "pool_tokens"),
    [
        # 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes: all 128 dims are cached, the 32
        # its partial RoPE leaves unrotated too
        ("phi-4-mini-instruct", "32 layers x 8 KV heads x 128 dims", 131072, 8192),
        # 2 x 32 x 32 x 96 x 2; its window of 2047 frees no page (docs/engine.md)
        ("phi-3-mini-4k-instruct", "32 layers x 32 KV heads x 96 dims", 393216, 2720),
    ],
)
def test_preflight_sizes_a_phi_models_kv_from_its_config(
    name, shape, bytes_per_token, pool_tokens, tmp_path, capsys
):
    (tmp_path / "config.json").write_text((HUB_CONFIGS / f"{name}.json").read_text())
    code = main(
        ["preflight", "--model", str(tmp_path), "--kv-cache-memory", "1Gi",
         "--kv-cache-dtype", "bfloat16", "--context-length", "2048"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert shape in out
    assert f"KV bytes per token: {bytes_per_token} (bfloat16," in out
    assert f"= {pool_tokens} tokens per engine" in out


TINY = ["preflight", "--model", "builtin:tiny-random", "--kv-cache-memory", "1Mi"]


WHOLE = "must be a whole number >= 1, got"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--context-length", "0"], f"argument --context-length: {WHOLE} '0'"),
        (["--context-length", "-5"], f"argument --context-length: {WHOLE} '-5'"),
        (["--context-length", "many"], f"argument --context-length: {WHOLE} 'many'"),
        (["--context-length", "512", "--page-size", "0"], f"argument --page-size: {WHOLE} '0'"),
        (["--context-length", "512", "--page-size", "-16"], f"argument --page-size: {WHOLE} '-16'"),
        (
            ["--context-length", "512", "--kv-cache-memory", "0"],
            "argument --kv-cache-memory: must be at least 1 byte, got '0'",
        ),
        (
            ["--context-length", "512", "--kv-cache-memory", "lots"],
            f"argument --kv-cache-memory: cannot read size 'lots': {SIZE_GRAMMAR}",
        ),
        (
            ["--context-length", "512", "--device", "tpu"],
            "argument --device: must be cpu, cuda or cuda:N, got 'tpu'",
        ),
        (
            ["--context-length", "512", "--target", "http://:80"],
            "argument --target: must be a kvfence server's URL, e.g. http://127.0.0.1:8000, got "
            "'http://:80'",
        ),
    ],
)
def test_preflight_input_that_is_not_a_number_it_can_use_is_a_usage_error(flags, error, capsys):
    """Issue 18, item 6: 0 gave a ZeroDivisionError traceback and exit 1 ("does not fit"),
    -5 "fit", and `lots` said `invalid parse_size value`."""
    with pytest.raises(SystemExit) as exited:
        main(TINY + flags)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"kvfence preflight: error: {error}"
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("device", "weight_dtype", "kv_dtype", "bytes_per_token"),
    [
        ([], [], "float32", 768),  # 2 x 3 layers x 2 heads x 16 dims x 4 bytes
        (["--device", "cuda"], [], "bfloat16", 384),
        (["--device", "cuda:1"], ["--weight-dtype", "float16"], "float16", 384),
        ([], ["--weight-dtype", "int8"], "float32", 768),
        ([], ["--weight-dtype", "int4"], "float32", 768),
        ([], ["--weight-dtype", "auto"], "float32", 768),
        (["--device", "cuda"], ["--weight-dtype", "auto"], "bfloat16", 384),
    ],
)
def test_preflight_resolves_kv_dtype_auto_as_the_engine_does(
    device, weight_dtype, kv_dtype, bytes_per_token, capsys
):
    """`auto` is the CRD's default: preflight took only explicit dtypes."""
    code = main(
        [*TINY, "--context-length", "512", "--kv-cache-dtype", "auto", *device, *weight_dtype]
    )
    assert code == 0
    assert f"KV bytes per token: {bytes_per_token} ({kv_dtype}," in capsys.readouterr().out


def test_preflights_auto_kv_dtype_is_the_engines_compute_dtype():
    """One rule, two places: preflight runs without torch, the engine with it."""
    import torch

    from kvfence_engine.core.quantization import WeightDtype, resolve_precision
    from kvfence_engine.preflight import WEIGHT_DTYPES, resolve_kv_dtype

    assert ["auto", *(k for k in WeightDtype if k is not WeightDtype.AUTO)] == WEIGHT_DTYPES
    for device in ("cpu", "cuda", "cuda:0"):
        for weight_dtype in (None, *WEIGHT_DTYPES):
            try:  # a GGUF with 4-bit tensors: the one source int4 takes (preflight reads no file)
                precision = resolve_precision(weight_dtype, torch.device(device), gguf_int4=True)
                engine = str(precision.compute)
            except ValueError as refused:
                with pytest.raises(ValueError, match=re.escape(str(refused))):
                    resolve_kv_dtype("auto", weight_dtype, device)
                continue
            assert engine == f"torch.{resolve_kv_dtype('auto', weight_dtype, device)}"
            assert resolve_kv_dtype("float16", weight_dtype, device) == "float16"
