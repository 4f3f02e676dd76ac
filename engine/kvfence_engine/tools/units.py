"""Byte sizes as users write them, one grammar for the command line and the CRD.

Kubernetes quantity style, as in a pod's `memory: 512Mi`: a whole or decimal number of bytes,
optionally with a decimal (k, M, G, T: powers of 1000) or binary (Ki, Mi, Gi, Ti: powers of
1024) suffix, case as written here. Anything else is refused with what it could have meant:
`64MB` is 64M or 64Mi, and `64m` would be 0.064 bytes to Kubernetes.
"""

import math
import re
from decimal import Decimal

_FACTORS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_FACTORS |= {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
# The CRD's schema carries this same pattern (kvfence_operator.crd.types).
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?(k|M|G|T|Ki|Mi|Gi|Ti)?$"
SIZE_GRAMMAR = (
    "a size is a number of bytes, optionally with a k/M/G/T (10^3, 10^6, 10^9, 10^12) or "
    "Ki/Mi/Gi/Ti (2^10, 2^20, 2^30, 2^40) suffix, e.g. 512Mi"
)
_SIZE = re.compile(SIZE_PATTERN)
_NEAR_MISS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt])(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'512Mi' -> 536870912; a fraction of a byte rounds up, as Kubernetes does.
    Raises ValueError naming the text and what it could have meant."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read size {text!r}: {_hint(text)}")
    suffix = match.group(2) or ""
    return math.ceil(Decimal(text.removesuffix(suffix)) * _FACTORS[suffix])


def _hint(text: str) -> str:
    near = _NEAR_MISS.match(text)
    if near is None:
        return SIZE_GRAMMAR
    number, letter, binary = near.groups()
    power = "kmgt".index(letter.lower()) + 1
    mebi = f"{number}{letter.upper()}i (2^{10 * power} bytes)"
    if binary:
        return f"did you mean {mebi}?"
    mega = f"{number}{'k' if power == 1 else letter.upper()} (10^{3 * power} bytes)"
    return f"did you mean {mega} or {mebi}?"


def format_size(num_bytes: int) -> str:
    for unit, factor in (("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.1f}{unit}"
    return f"{num_bytes}B"
