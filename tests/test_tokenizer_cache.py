"""The GGUF tokenizer is cached on disk (a GGUF header takes seconds to parse)."""

from pathlib import Path

import pytest

from kvfence_engine import model_loader
from kvfence_engine.model_loader import gguf_tokenizer, smollm2_gguf_path

TEXT = "Hello, world! 12345 héllo <|im_start|>user"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path))
    gguf_tokenizer.cache_clear()
    yield tmp_path
    gguf_tokenizer.cache_clear()


def test_the_cached_tokenizer_behaves_like_the_one_built_from_the_gguf(cache: Path) -> None:
    built = gguf_tokenizer(smollm2_gguf_path())
    assert len(list(cache.glob("tokenizer-*.json"))) == 1
    gguf_tokenizer.cache_clear()
    loaded = gguf_tokenizer(smollm2_gguf_path())
    assert loaded.encode(TEXT) == built.encode(TEXT)
    assert loaded.decode(built.encode(TEXT)) == built.decode(built.encode(TEXT))
    assert loaded.eos_ids == built.eos_ids and loaded.chat_template == built.chat_template


def test_a_corrupt_cache_file_is_rebuilt_not_trusted(cache: Path) -> None:
    gguf_tokenizer(smollm2_gguf_path())
    (cached,) = cache.glob("tokenizer-*.json")
    cached.write_text("{not json")
    gguf_tokenizer.cache_clear()
    assert gguf_tokenizer(smollm2_gguf_path()).encode("Paris") == [38634]
    assert cached.read_text().startswith('{"tokenizer"')


def test_an_unwritable_cache_location_only_costs_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader, "_cache_dir", lambda: None)
    gguf_tokenizer.cache_clear()
    try:
        assert gguf_tokenizer(smollm2_gguf_path()).encode("Paris") == [38634]
    finally:
        gguf_tokenizer.cache_clear()
