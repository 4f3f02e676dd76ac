"""A model source that names no model says why in the words that fix it (issue 34, item 3): a
.gguf path that does not exist is "no such file", not a list of what a source may be, both
where the pool arithmetic reads it (load_config: `kvfence preflight`, `kvfence up`) and where
the engine loads it (load_model: the termination message of a crash-looping pod)."""

from pathlib import Path

import pytest

from kvfence_engine.loading.config import load_config
from kvfence_engine.loading.loader import load_model


@pytest.mark.parametrize(("read", "verb"), [(load_config, "read"), (load_model, "load")])
def test_a_missing_gguf_path_says_no_such_file(tmp_path: Path, read, verb) -> None:
    missing = str(tmp_path / "models" / "tiny.gguf")
    with pytest.raises(ValueError) as refused:
        read(missing)
    said = str(refused.value)
    assert said.startswith(f"cannot {verb} model {missing!r}: no such file ("), said
    assert "spec.model.volume" in said
    assert "expected one of" not in said


@pytest.mark.parametrize(("read", "verb"), [(load_config, "read"), (load_model, "load")])
def test_a_folder_without_config_json_and_an_unknown_builtin_say_what_they_lack(
    tmp_path: Path, read, verb
) -> None:
    with pytest.raises(ValueError, match=r"the folder has no config\.json"):
        read(str(tmp_path))
    missing = str(tmp_path / "weights")
    with pytest.raises(ValueError, match=r"no such file or folder"):
        read(missing)
    with pytest.raises(ValueError) as unknown:
        read("builtin:tiny-randm")
    assert str(unknown.value).startswith(
        f"cannot {verb} model 'builtin:tiny-randm': expected one of "
        "builtin:smollm2-135m-instruct, builtin:tiny-random, a .gguf file, or a folder with "
    ), unknown.value
