"""Where `--weight-dtype auto` keeps what it measured (core/weight_choice.py), so that the next
start of the same model on the same machine packs its weights as measured, without measuring
again (about 10 s of a SmolLM2 engine's start on 2 cores).

A file holds one measurement: each candidate's step times and int4+float16's switches. Its name
is a digest of everything those times depend on, never of the weights' values: the model's
shapes (its config), the candidates, the rows measured, the CPU (its model name and flags,
the instruction set torch runs, the variables that narrow what torch's libraries may use),
torch's version, the threads, the int4 kernel (kvfence's build of native/blocks.c, or aten's), and
FORMAT. Anything else (another CPU, another torch, 8 threads
instead of 2) is another file. A file that does not parse, or does not answer the question
asked, is measured again and rewritten; a write that fails (a read-only filesystem in a pod)
is logged, never fatal. `kvfence serve --weight-choice-cache` names the directory
($XDG_CACHE_HOME/kvfence/weight-choice by default). Every candidate serves the file's
weights (weight_choice says how exactly), so a stale or edited file can make a start choose
a slower packing, never a wrong one.
"""

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.quantization import WeightDtype, int4_kernel

log = logging.getLogger(__name__)

FORMAT = 1
# what narrows the instruction sets torch's libraries use (the bench's --emulate-avx2 sets them)
ISA_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def cpu_identity() -> dict[str, str]:
    """The CPU as the times depend on it: /proc/cpuinfo's model name and flags (elsewhere,
    what platform says), the capability torch dispatches to, and any ISA_VARIABLES set."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    narrowed = {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ}
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "capability": torch.backends.cpu.get_cpu_capability(),
        "narrowed": json.dumps(narrowed, sort_keys=True),
    }


class _Times(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decode_one: float = Field(gt=0, allow_inf_nan=False)
    decode_many: float = Field(gt=0, allow_inf_nan=False)
    rows: int = Field(gt=0)
    prefill: float = Field(gt=0, allow_inf_nan=False)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: int
    key: dict[str, str]
    measured_at: str
    times: dict[WeightDtype, _Times]
    switches: list[tuple[int, int, int]]  # int4+float16: out, in features -> int4 up to rows


@dataclass(frozen=True, slots=True)
class Recalled:
    """A measurement read back: each candidate's times (as weight_choice.StepTimes takes them)
    and int4+float16's switches, when and where it was kept."""

    times: dict[WeightDtype, dict[str, float]]
    switches: dict[tuple[int, int], int]
    measured_at: str
    path: Path


class ChoiceCache:
    """One question's file: `config`'s model, these candidates, measured at `rows` rows."""

    def __init__(
        self, directory: Path, config: ModelConfig, candidates: tuple[WeightDtype, ...], rows: int
    ) -> None:
        self.key = {
            "model": json.dumps(asdict(config), sort_keys=True, default=str),
            "candidates": ",".join(candidates),
            "rows": str(rows),
            "torch": torch.__version__,
            "threads": str(torch.get_num_threads()),
            "int4_kernel": int4_kernel(),
            **cpu_identity(),
        }
        digest = hashlib.sha256(json.dumps([FORMAT, self.key], sort_keys=True).encode())
        self.path = directory / f"{digest.hexdigest()[:32]}.json"
        self.candidates = candidates
        self.rows = rows

    def load(self) -> Recalled | None:
        """The kept measurement, or None (none yet, or one that does not answer this question:
        logged, measured again)."""
        try:
            text = self.path.read_text()
        except OSError:
            return None
        try:
            kept = _File.model_validate_json(text)
        except ValidationError as exc:
            log.warning("weight choice cache %s: unreadable, measuring again: %s", self.path, exc)
            return None
        answers = (
            kept.key == self.key
            and set(kept.times) == set(self.candidates)
            and all(t.rows == self.rows for t in kept.times.values())
        )
        if kept.format != FORMAT or not answers:
            log.warning(
                "weight choice cache %s: another question's answer, measuring again", self.path
            )
            return None
        return Recalled(
            times={kind: t.model_dump() for kind, t in kept.times.items()},
            switches={(n, k): above for n, k, above in kept.switches},
            measured_at=kept.measured_at,
            path=self.path,
        )

    def save(
        self, times: dict[WeightDtype, dict[str, float]], switches: dict[tuple[int, int], int]
    ) -> None:
        """Keep a measurement (written whole, then renamed: a reader never sees half a file)."""
        kept = _File(
            format=FORMAT,
            key=self.key,
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
            times={kind: _Times.model_validate(t) for kind, t in times.items()},
            switches=[(n, k, above) for (n, k), above in switches.items()],
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as out:
                    out.write(kept.model_dump_json(indent=1))
                os.replace(scratch, self.path)
            finally:
                Path(scratch).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("weight choice cache %s: not kept (%s)", self.path, exc)
