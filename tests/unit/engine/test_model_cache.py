"""What kvfence keeps of a GGUF file in its cache: the tokenizer (a GGUF header takes seconds
to parse) and the dequantized weights with the 4-bit blocks (seconds more), each keyed by the
file; a cache entry that cannot be read is rebuilt, never trusted, and a cache that cannot be
written only costs time."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvfence_engine.loading import loader as model_loader
from kvfence_engine.loading.config import load_config
from kvfence_engine.loading.loader import CACHE_READ_STEP, LoadedModel, load_gguf, plan_load
from kvfence_engine.loading.tokenizer_source import (
    SMOLLM2,
    gguf_tokenizer,
    remember_tokenizer,
    smollm2_gguf_path,
)
from kvfence_engine.tools import cache_dir as kvfence_cache

TEXT = "Hello, world! 12345 héllo <|im_start|>user"
# every test here converts or reads the real SmolLM2 GGUF (98 MB; seconds per header parse)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """SmolLM2 converted from its GGUF into an empty cache (the slow path, once): weights and
    tokenizer, both built from the GGUF itself."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFENCE_CACHE_DIR", str(cache))
        return cache, load_gguf(smollm2_gguf_path(), name="smollm2")


@pytest.fixture
def cache_dir(
    converted: tuple[Path, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(converted[0]))
    gguf_tokenizer.cache_clear()
    yield converted[0]
    gguf_tokenizer.cache_clear()


def test_the_cached_tokenizer_behaves_like_the_one_built_from_the_gguf(
    cache_dir: Path, converted: tuple[Path, LoadedModel]
) -> None:
    built = converted[1].tokenizer
    assert len(list(cache_dir.glob("tokenizer-*.json"))) == 1
    loaded = gguf_tokenizer(smollm2_gguf_path())
    assert loaded is not built
    assert loaded.encode(TEXT) == built.encode(TEXT)
    assert loaded.decode(built.encode(TEXT)) == built.decode(built.encode(TEXT))
    assert loaded.eos_ids == built.eos_ids and loaded.chat_template == built.chat_template


def test_a_corrupt_cache_file_is_rebuilt_not_trusted(cache_dir: Path) -> None:
    (cached,) = cache_dir.glob("tokenizer-*.json")
    cached.write_text("{not json")
    assert gguf_tokenizer(smollm2_gguf_path()).encode("Paris") == [38634]
    assert cached.read_text().startswith('{"tokenizer"')


def test_a_cached_tokenizer_is_written_once_not_at_every_conversion(
    cache_dir: Path, converted: tuple[Path, LoadedModel]
) -> None:
    """A conversion to another weight type builds the same tokenizer again: the file a running
    engine (or `kvfence up` restarting from its caches) reads stays as it was."""
    (cached,) = cache_dir.glob("tokenizer-*.json")
    os.utime(cached, ns=(1, 1))
    remember_tokenizer(smollm2_gguf_path(), converted[1].tokenizer)
    assert cached.stat().st_mtime_ns == 1
    assert not list(cache_dir.glob("*.partial"))


def test_an_unwritable_cache_location_only_costs_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfence_cache, "writable_cache_dir", lambda: None)
    gguf_tokenizer.cache_clear()
    try:
        assert gguf_tokenizer(smollm2_gguf_path()).encode("Paris") == [38634]
    finally:
        gguf_tokenizer.cache_clear()


def test_converted_weights_load_from_the_cache_exactly_as_converted(
    cache_dir: Path, converted: tuple[Path, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = converted[1]
    monkeypatch.setattr(model_loader, "_convert_gguf", _must_not_convert)
    cached = load_gguf(smollm2_gguf_path())
    assert fresh.name == "smollm2" and cached.name.startswith("Smollm2 135M")  # the GGUF's
    assert cached.config == fresh.config == load_config(str(smollm2_gguf_path()))
    assert cached.weights.keys() == fresh.weights.keys()
    for key, tensor in fresh.weights.items():
        assert torch.equal(cached.weights[key], tensor), key
    # the file's 4-bit blocks too (every Q4_1 tensor of SmolLM2), not as weights
    assert cached.int4.keys() == fresh.int4.keys() and len(fresh.int4) == 30 * 7
    for key, groups in fresh.int4.items():
        for part in ("q", "scale", "zero"):
            assert torch.equal(getattr(cached.int4[key], part), getattr(groups, part)), key
    assert cached.tokenizer.encode(TEXT) == fresh.tokenizer.encode(TEXT)
    assert not list(cache_dir.glob("*.partial"))


def test_a_cached_conversion_is_one_step_read_from_the_cache(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a restart's /readyz shows: the cache read, not a conversion."""
    monkeypatch.setattr(model_loader, "_convert_gguf", _must_not_convert)
    plan = plan_load(SMOLLM2)
    told: list[str] = []
    loaded = plan.run(told.append)
    assert plan.steps == (CACHE_READ_STEP,) and told == list(plan.steps)
    assert loaded.source == SMOLLM2 and loaded.name == "smollm2-135m-instruct"


def test_a_corrupt_weights_cache_is_converted_again_and_replaced(
    cache_dir: Path, converted: tuple[Path, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = converted[1]
    (stored,) = cache_dir.glob("weights-*.safetensors")
    conversions: list[Path] = []

    # the conversion itself is the test above
    def convert(path: Path, step: object = None) -> LoadedModel:
        conversions.append(path)
        return LoadedModel(fresh.name, fresh.config, dict(fresh.weights), fresh.tokenizer)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    for damage in (b"{not safetensors", stored.read_bytes()[: stored.stat().st_size // 2]):
        stored.write_bytes(damage)
        loaded = load_gguf(smollm2_gguf_path())
        assert torch.equal(loaded.weights["model.norm.weight"], fresh.weights["model.norm.weight"])
        replaced = load_file(stored)  # a whole conversion again
        assert replaced.keys() == fresh.weights.keys()
    assert len(conversions) == 2


def _must_not_convert(path: Path, step: object = None) -> LoadedModel:
    raise AssertionError(f"{path} was converted again despite a valid cache entry")


def test_with_the_weights_cache_off_no_weights_are_written_or_read(
    tmp_path: Path, converted: tuple[Path, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What engine pods run with: their scratch volume is far smaller than a converted model.
    The tokenizer (small) is still cached."""
    fresh = converted[1]
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVFENCE_WEIGHTS_CACHE", "off")
    # a valid entry from the cache with weights on: not read either
    for stored in converted[0].glob("weights-*.safetensors"):
        (tmp_path / stored.name).write_bytes(stored.read_bytes())
    kept = {p.name for p in tmp_path.iterdir()}
    conversions: list[Path] = []

    def convert(path: Path, step: object = None) -> LoadedModel:
        conversions.append(path)
        return LoadedModel(fresh.name, fresh.config, dict(fresh.weights), fresh.tokenizer)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    loaded = load_gguf(smollm2_gguf_path())
    assert torch.equal(loaded.weights["model.norm.weight"], fresh.weights["model.norm.weight"])
    assert conversions == [smollm2_gguf_path()]
    assert {p.name for p in tmp_path.iterdir()} == kept
