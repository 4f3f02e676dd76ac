"""Byte sizes as users write them: plain bytes or Ki/Mi/Gi (and K/M/G) suffixes."""

import re

_SUFFIXES = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'512Mi' -> 536870912. Raises ValueError with the offending text."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read size {text!r}: use bytes or a Ki/Mi/Gi suffix, e.g. 512Mi")
    number, suffix = match.groups()
    factor = _SUFFIXES.get((suffix or "").lower())
    if factor is None:
        raise ValueError(f"unknown size suffix in {text!r}")
    return int(float(number) * factor)


def format_size(num_bytes: int) -> str:
    for unit, factor in (("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.1f}{unit}"
    return f"{num_bytes}B"
