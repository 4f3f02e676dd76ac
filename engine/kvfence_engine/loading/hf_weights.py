"""A Hugging Face folder's tensors, strictly: each comes from exactly one file, and a sharded
checkpoint's index is the truth about which.

A checkpoint past a few GB is shipped as shards (`model-00001-of-00004.safetensors`, ...) and
`model.safetensors.index.json`, whose `weight_map` names each tensor's shard (transformers'
`save_pretrained(max_shard_size=...)` writes the same). With an index, the tensors loaded are
exactly those it names, each from its shard; other *.safetensors beside them are not read
(Mistral's repositories ship `consolidated.safetensors`, the same weights in other names, next
to the shards). A shard it names that is missing, a tensor a shard holds that the index does not
map to it, a tensor it maps that its shard lacks: each refused in one line naming the file and
the tensor. Without an index, every *.safetensors is read (one `model.safetensors`, or shards
whose index was left behind), and a tensor in two of them is refused: which copy the model would
get depends on the order the files are read."""

import logging
from pathlib import Path

import torch

from kvfence_engine.loading.generation_config import read_json_object

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


def load_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors as float32, in their Hugging Face names."""
    from safetensors import safe_open

    index = folder / INDEX
    weight_map = _weight_map(index) if index.exists() else None
    if weight_map is None:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files")
    else:
        files = sorted(set(weight_map.values()))
        for shard in files:
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{INDEX}: its shard {shard} is not in {folder}")
        unread = sorted({p.name for p in folder.glob("*.safetensors")} - set(files))
        if unread:
            log.info("%s: not reading %s (the index names no tensor there)", INDEX, unread)
    holder: dict[str, str] = {}  # tensor -> the file it is read from
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            names = list(f.keys())
        for name in names:
            if name in holder:
                raise ValueError(f"{folder}: tensor {name!r} is in both {holder[name]} and {file}")
            if weight_map is not None and weight_map.get(name) != file:
                mapped = f"to {weight_map[name]}" if name in weight_map else "to no shard"
                raise ValueError(f"{file}: holds tensor {name!r}, which {INDEX} maps {mapped}")
            holder[name] = file
    if weight_map is not None:
        absent = [name for name in weight_map if name not in holder]
        if absent:
            raise ValueError(
                f"{INDEX}: maps tensor {absent[0]!r} to {weight_map[absent[0]]}, which does not "
                f"hold it ({len(absent)} such tensors)"
            )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            weights.update({name: f.get_tensor(name).float() for name in f.keys()})  # noqa: SIM118
    return weights


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map; a shard is a file beside the index, nowhere else."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{INDEX}: no 'weight_map' of tensor names to shard files")
    for name, shard in weight_map.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors")) or (
            Path(shard).name != shard
        ):
            raise ValueError(
                f"{INDEX}: weight_map[{name!r}]={shard!r} is not a .safetensors file's name"
            )
    return weight_map
