"""A Hugging Face folder as the Hub ships it: safetensors in shards named by
model.safetensors.index.json (loaded exactly as the index says, refused in one line where the
files disagree with it), and generation_config.json, whose eos ids all end generation and whose
sampling defaults are not applied (kvfence_engine/loading/generation_config.py)."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.transformers_reference import hf_model, our_greedy, our_prefill_logits, random_prompt
from kvfence_engine.core.engine import EngineArgs, LLMEngine
from kvfence_engine.core.request import SamplingParams
from kvfence_engine.loading.generation_config import folder_eos_ids, read_generation_config
from kvfence_engine.loading.hf_weights import INDEX, load_hf_weights
from kvfence_engine.loading.loader import load_model
from kvfence_engine.loading.tokenizer_source import load_tokenizer


def engine_for(folder: Path) -> LLMEngine:
    return LLMEngine(load_model(str(folder)), EngineArgs(kv_cache_memory=4 << 20, page_size=8))


# --- sharded safetensors ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_sharded_folder_gives_the_single_file_folders_logits_exactly(tmp_path: Path) -> None:
    """transformers' own shards and index (save_pretrained with a small max_shard_size), beside
    the same model saved as one model.safetensors: the same tensors, the same logits."""
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    import transformers  # here, not at collection: test-fast collects this module too

    model = hf_model(single, "LlamaConfig")
    assert isinstance(model, transformers.PreTrainedModel)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((single / name).read_bytes())
    weight_map = json.loads((sharded / INDEX).read_text())["weight_map"]
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(weight_map.values())) == shards
    assert not (sharded / "model.safetensors").exists()
    ours = load_hf_weights(sharded)
    assert sorted(ours) == sorted(weight_map)
    expected = load_hf_weights(single)
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    assert sorted(ours) == sorted(expected)
    ids = random_prompt(40)
    logits = our_prefill_logits(engine_for(sharded), ids)
    assert torch.equal(logits, our_prefill_logits(engine_for(single), ids))


def tensors(*names: str) -> dict[str, torch.Tensor]:
    return {name: torch.full((2, 2), float(i)) for i, name in enumerate(names)}


def shard(folder: Path, file: str, *names: str) -> None:
    save_file(tensors(*names), str(folder / file))


def index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def test_an_index_loads_exactly_the_tensors_it_names_and_no_other_file(tmp_path: Path) -> None:
    shard(tmp_path, A, "x", "y")
    shard(tmp_path, B, "z")
    shard(tmp_path, "consolidated.safetensors", "layers.0.wq")  # Mistral's, beside the shards
    index(tmp_path, {"x": A, "y": A, "z": B})
    assert sorted(load_hf_weights(tmp_path)) == ["x", "y", "z"]


def test_a_shard_the_index_names_and_the_folder_lacks_is_refused(tmp_path: Path) -> None:
    shard(tmp_path, A, "x")
    index(tmp_path, {"x": A, "z": B})
    with pytest.raises(FileNotFoundError, match=f"{INDEX}: its shard {B} is not in"):
        load_hf_weights(tmp_path)


def test_a_tensor_a_shard_holds_and_the_index_does_not_map_there_is_refused(
    tmp_path: Path,
) -> None:
    shard(tmp_path, A, "x", "stray")
    shard(tmp_path, B, "z")
    index(tmp_path, {"x": A, "z": B})
    with pytest.raises(ValueError, match=f"^{A}: holds tensor 'stray', which {INDEX} maps to no"):
        load_hf_weights(tmp_path)
    index(tmp_path, {"x": A, "stray": B, "z": B})
    with pytest.raises(ValueError, match=f"{A}: holds tensor 'stray', which {INDEX} maps to {B}"):
        load_hf_weights(tmp_path)


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    shard(tmp_path, A, "x", "z")
    shard(tmp_path, B, "z", "w")
    index(tmp_path, {"x": A, "z": A, "w": B})
    with pytest.raises(ValueError, match=f"tensor 'z' is in both {A} and {B}"):
        load_hf_weights(tmp_path)


def test_a_tensor_the_index_maps_to_a_shard_without_it_is_refused(tmp_path: Path) -> None:
    shard(tmp_path, A, "x")
    shard(tmp_path, B, "z")
    index(tmp_path, {"x": A, "y": B, "z": B})
    with pytest.raises(ValueError, match=f"{INDEX}: maps tensor 'y' to {B}, which does not hold"):
        load_hf_weights(tmp_path)


@pytest.mark.parametrize("shard_name", ["../model.safetensors", "sub/a.safetensors", "a.bin", 3])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(
    shard_name: object, tmp_path: Path
) -> None:
    shard(tmp_path, A, "x")
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"x": shard_name}}))
    with pytest.raises(ValueError, match=r"weight_map\['x'\]=.* is not a .safetensors file's"):
        load_hf_weights(tmp_path)


def test_without_an_index_every_file_is_read_and_a_tensor_in_two_is_refused(
    tmp_path: Path,
) -> None:
    shard(tmp_path, A, "x")
    shard(tmp_path, B, "z")
    assert sorted(load_hf_weights(tmp_path)) == ["x", "z"]
    shard(tmp_path, "model.safetensors", "z")
    with pytest.raises(ValueError, match=f"tensor 'z' is in both {B} and model.safetensors"):
        load_hf_weights(tmp_path)


def test_a_single_model_safetensors_loads_as_float32(tmp_path: Path) -> None:
    save_file({"x": torch.ones(3, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    weights = load_hf_weights(tmp_path)
    assert weights["x"].dtype == torch.float32
    assert torch.equal(weights["x"], load_file(str(tmp_path / "model.safetensors"))["x"].float())


# --- generation_config.json ------------------------------------------------------------------


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


@pytest.mark.parametrize(
    ("generation_eos", "expected"),
    [
        ([128001, 128008, 128009], (128001, 128008, 128009)),  # Llama 3.x instruct's
        (128001, (128001,)),  # Llama 3.x base
        ([151645, 151643], (151645, 151643)),  # Qwen2.5's
    ],
)
def test_generation_configs_eos_ids_join_the_configs(
    generation_eos: object, expected: tuple[int, ...], tmp_path: Path
) -> None:
    write_json(tmp_path / "config.json", {"eos_token_id": 128001})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": generation_eos})
    assert folder_eos_ids(tmp_path) == tuple(dict.fromkeys((128001, *expected)))


@pytest.mark.parametrize("eos", ["</s>", [1, "2"], True, -1])
def test_an_eos_token_id_that_is_not_an_id_is_refused_by_name(eos: object, tmp_path: Path) -> None:
    write_json(tmp_path / "generation_config.json", {"eos_token_id": eos})
    with pytest.raises(ValueError, match=r"^generation_config\.json: field 'eos_token_id'="):
        read_generation_config(tmp_path)


def test_the_sampling_defaults_are_named_and_not_applied(tmp_path: Path) -> None:
    # Qwen2.5-7B-Instruct's generation_config.json
    qwen = {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "transformers_version": "4.37.0",
    }
    write_json(tmp_path / "generation_config.json", qwen)
    generation = read_generation_config(tmp_path)
    assert generation.not_applied == {
        "do_sample": True,
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
    }


@pytest.mark.slow
def test_a_folder_whose_generation_config_lists_two_eos_ids_stops_on_the_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny model's greedy answer, run past eos, picks the id to stop on: the token it emits
    at the 6th step. Listed second in generation_config.json's eos_token_id (after one it never
    emits), it ends the answer there, "stop", as the tokenizer's eos would; ignore_eos runs on."""
    hf_model(tmp_path, "LlamaConfig")
    ids = random_prompt(40)
    free_run, _ = our_greedy(engine_for(tmp_path), ids, 16)
    tokenizer_eos = 1  # t1, tokenizer_config.json's eos_token
    step = next(i for i in range(5, 16) if free_run[i] not in {*free_run[:i], tokenizer_eos})
    never = next(t for t in range(2, 256) if t not in free_run)
    generation = {"eos_token_id": [never, free_run[step]], "temperature": 0.6, "top_p": 0.9}
    write_json(tmp_path / "generation_config.json", generation)
    with caplog.at_level(logging.INFO, logger="kvfence_engine.loading.loader"):
        engine = engine_for(tmp_path)
    assert "request defaults not applied" in caplog.text
    assert "temperature=0.6, top_p=0.9" in caplog.text
    stopped = engine.admit(ids, SamplingParams(max_tokens=16), max_tokens=16)
    engine.add(stopped)
    while engine.has_work():
        engine.step()
    assert stopped.output_ids == free_run[: step + 1]
    assert stopped.finish_reason == "stop"
    assert {never, free_run[step], tokenizer_eos} <= engine.tokenizer.eos_ids
    assert load_tokenizer(str(tmp_path))[1].eos_ids == engine.tokenizer.eos_ids  # the router's
    assert our_greedy(engine, ids, 16)[0] == free_run  # ignore_eos
