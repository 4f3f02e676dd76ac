"""bench/gpu_check.sh, the GPU readiness check, on CPU with the tiny shape: the same steps the GPU
run takes (model folder, a real `kvfence serve` process, transformers, throughput, agreement,
the read check's share, the JSON summary), and its helpers."""

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """bench/gpu_check.py as a module (it imports its bench neighbours by plain name)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_folder(gpu_check: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-check") / "tiny"
    gpu_check.write_model(
        folder, gpu_check.SHAPES["tiny"], torch.float32, torch.device("cpu"), seed=0
    )
    return folder


def test_every_token_id_has_its_own_name(gpu_check: ModuleType) -> None:
    """The engine names tokens by their text in logprobs: each name must give back one id,
    BOS and EOS must sit where config.json says, and no prompt word may be unknown."""
    vocab = gpu_check.SHAPES["tiny"].vocab
    texts = gpu_check.prompt_texts(40)
    tokenizer = gpu_check.build_tokenizer(vocab, texts)
    assert tokenizer.get_vocab_size() == vocab
    assert len(gpu_check.ids_by_name(tokenizer)) == vocab
    bos, eos = gpu_check.special_ids(vocab)
    assert tokenizer.token_to_id(gpu_check.BOS) == bos
    assert tokenizer.token_to_id(gpu_check.EOS) == eos
    prompts = gpu_check.encode_prompts(tokenizer, texts)
    assert all(p[0] == bos and len(p) > 5 for p in prompts)
    assert len({tuple(p) for p in prompts}) == len(prompts)


def test_folder_is_what_engine_and_transformers_both_load(
    gpu_check: ModuleType, tiny_folder: Path
) -> None:
    from kvfence_engine.loading.loader import load_model

    shape = gpu_check.SHAPES["tiny"]
    loaded = load_model(str(tiny_folder))
    assert set(loaded.weights) == set(gpu_check.weight_shapes(shape))
    assert loaded.config.rope_theta == gpu_check.LLAMA_3_2_1B["rope_theta"] == 500000.0
    assert loaded.config.rope.type == "llama3"  # Llama 3.2's own scaling, at the tiny size too
    assert loaded.config.tie_embeddings
    assert loaded.tokenizer.eos_ids == {gpu_check.special_ids(shape.vocab)[1]}
    reference = gpu_check.Reference(tiny_folder, torch.device("cpu"), torch.float32, 4)
    gpu_check.same_config(tiny_folder, reference)  # raises on any difference


def test_divergence_gap_is_transformers_margin_over_our_token(
    gpu_check: ModuleType, tiny_folder: Path
) -> None:
    reference = gpu_check.Reference(tiny_folder, torch.device("cpu"), torch.float32, 4)
    prompt = [gpu_check.special_ids(gpu_check.SHAPES["tiny"].vocab)[0], 5, 6, 7]
    theirs = reference.generate([prompt])
    ours = [[*theirs[0][:2], (theirs[0][2] + 1) % 100, *theirs[0][3:]]]
    assert gpu_check.agreement(ours, theirs) == {
        "prompts": 1,
        "identical": 0,
        "first_divergence": [2],
    }
    (gap,) = gpu_check.divergence_gaps(reference, [prompt], ours, theirs)
    assert (gap["prompt"], gap["at"], gap["theirs"]) == (0, 2, theirs[0][2])
    assert gap["logit_gap"] > 0  # transformers' greedy token beats the one we forced
    assert gap["gap_in_spacings"] > 0


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path: Path) -> None:
    """The command a GPU machine runs, on CPU with the tiny shape: a real engine process."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    command = ["bash", str(BENCH / "gpu_check.sh"), "--device", "cpu", "--shape", "tiny"]
    result = subprocess.run(
        [*command, "--new-tokens", "8", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert "error" not in summary
    rows = {(r["system"], r["concurrency"]): r for r in summary["throughput"]}
    assert set(rows) == {(s, c) for s in ("kvfence", "transformers") for c in (1, 32)}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows[("kvfence", 32)]["ratio"] > 0
    # float32 on CPU: both systems compute the same function, token for token
    assert summary["agreement"]["1"]["identical"] == 8
    assert summary["agreement"]["32"]["identical"] == 32
    for share in summary["read_check"].values():
        assert 0 < share["check_seconds"] < share["step_seconds"]
    assert summary["engine"]["weight_dtype"] == "float32"
    assert "greedy agreement (token ids): c=1 8/8" in result.stdout
    assert "listening on http://127.0.0.1:" in (tmp_path / "gpu_check.engine.log").read_text()
