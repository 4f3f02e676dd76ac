"""The device an engine runs on, checked before anything is loaded: a typo or a CPU build of
torch asked for CUDA is one line at start-up, not a failure deep in moving the weights."""

import torch


def resolve_device(name: str) -> torch.device:
    """`name` as a torch device this process can use; ValueError says why not."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if torch.version.cuda is None:
        raise ValueError(
            f"--device {name}: this torch ({torch.__version__}) is a CPU build; use --device cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--device {name}: no CUDA device is visible; use --device cpu")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: only {count} CUDA device(s) are visible")
    return device
