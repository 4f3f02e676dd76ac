"""kvfence's own CPU kernels: C sources in this package, compiled on first use with the machine's
C compiler and loaded with ctypes.

blocks.c: linears on a GGUF's own blocks for x86 CPUs with AVX2, FMA and F16C, float32
activations, products and sums (so the served weights are the file's exactly, where aten's int4
kernel rounds to bfloat16), threaded on torch's own OpenMP pool. Two block types: Q4 (the Q4_0
and Q4_1 linears) and Q8 (a Q8_0 lm_head, half the bytes of its float16 packing).

ops.c: the step's small operators in one call each where aten takes several: RMSNorm, RoPE,
SwiGLU's silu(gate) * up, and a decode step's attention read in place from the paged pool (no
gather).

The library is built once per source, compiler and flags, into $XDG_CACHE_HOME/kvfence/native
(or a private temporary directory where that cannot be written), by a compile to a temporary
name and a rename, so processes starting together never load half a file. Where it cannot be
had (no C compiler, a CPU without AVX2, FMA and F16C, a compile that fails, KVFENCE_NATIVE=0),
`kernels()` says why and the engine runs aten's int4 kernel and fbgemm's float16 instead: slower
(int4: rounded to bfloat16), never wrong. A deployment without a compiler can build the
libraries ahead (`python -m kvfence_engine.native DIR`) and point KVFENCE_NATIVE_DIR at them.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ABI = {"blocks": 3, "ops": 3}  # kvf_<source>_abi() of each source this module calls
# -ffp-contract=off: a product and a sum stay two roundings unless the source says FMA (RoPE is
# then aten's bits)
FLAGS = ("-O3", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32  # weights per block
MAX_HEAD_DIM = 256  # ops.c's widest head in decode attention
Q4_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 4-bit values (ggml's block_q4_1)
Q8_BYTES = 34  # fp16 d, 32 int8 values (ggml's block_q8_0)
SOURCES = tuple(ABI)
DISABLE = "KVFENCE_NATIVE"  # "0": never build or load (aten's kernel; an A/B of the two)
PREBUILT = "KVFENCE_NATIVE_DIR"  # a directory holding the library already built (images)


def _bind(fn: Any, *argtypes: Any, restype: Any = None) -> Any:
    """A C function of a loaded library, its argument and return types set."""
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why the native kernels are not used here (said in the log and the weight choice)."""

    reason: str


class Kernels:
    """blocks.c and ops.c, loaded: y = x @ W.T + bias on Q4 or Q8 blocks (pack_q4, pack_q8),
    RMSNorm, RoPE, silu(gate) * up, decode attention over the paged pool. Each can_* says
    whether an operator takes its input; the caller runs aten's where not."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        libs = {name: ctypes.CDLL(str(path)) for name, path in paths.items()}
        for name, lib in libs.items():
            abi = getattr(lib, f"kvf_{name}_abi")()
            if abi != ABI[name]:
                raise OSError(f"{paths[name]}: ABI {abi}, not {ABI[name]}")
        blocks, ops = libs["blocks"], libs["ops"]
        ptr, size, i32, i64, f32 = (
            ctypes.c_void_p,
            ctypes.c_ssize_t,
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_float,
        )
        self._q4 = _bind(blocks.kvf_q4_linear, ptr, ptr, ptr, ptr, i32, i32, i32, restype=i32)
        self._q8 = _bind(blocks.kvf_q8_linear, ptr, ptr, ptr, ptr, i32, i32, i32, restype=i32)
        self._rms_norm = _bind(ops.kvf_rms_norm, ptr, ptr, ptr, i32, i32, f32)
        self._rope = _bind(ops.kvf_rope, ptr, size, ptr, ptr, ptr, i32, i32, i32)
        self._silu_mul = _bind(ops.kvf_silu_mul, ptr, ptr, i32, i32)
        self._attend = _bind(
            ops.kvf_decode_attention,
            *(ptr, size, ptr, ptr, i64, ptr, i32, ptr),  # q, its row stride, pool, table, positions
            *(i32, i32, i32, i32, i32, i32, f32, ptr),  # B H Hkv D, page size, window, scale, out
            restype=i32,
        )

    @property
    def name(self) -> str:
        return f"kvfence AVX2 ({self.paths['blocks'].stem})"

    def q4_linear(
        self, blocks: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """blocks: uint8 [N, K/32, Q4_BYTES] (pack_q4); x: float32 [M, K]. Float32 [M, N]."""
        return self._run(self._q4, Q4_BYTES, blocks, bias, x)

    def q8_linear(
        self, blocks: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor:
        """blocks: uint8 [N, K/32, Q8_BYTES] (pack_q8); x: float32 [M, K]. Float32 [M, N]."""
        return self._run(self._q8, Q8_BYTES, blocks, bias, x)

    @staticmethod
    def can_norm(x: torch.Tensor) -> bool:
        """Whether rms_norm takes x (else aten's): float32 rows in place, a multiple of 8."""
        return x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] % 8 == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * weight over x's last dimension (can_norm(x); weight
        float32 [dim])."""
        dim = x.shape[-1]
        if not self.can_norm(x) or weight.dtype != torch.float32 or weight.shape != (dim,):
            raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype}")
        y = torch.empty_like(x)
        rows = x.numel() // dim if dim else 0
        if rows:
            w = weight.contiguous()
            self._rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, dim, eps)
        return y

    @staticmethod
    def can_rotate(x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether rope takes x [T, heads, D] (else aten's): float32 heads in place, every dim
        turning (cos [T, 1, D]), D a multiple of 16."""
        return (
            x.dtype == cos.dtype == torch.float32
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and cos.shape[-1] == x.shape[2]
            and x.shape[2] % 16 == 0
        )

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, aten's bits: x [T, heads, D] (can_rotate); cos and
        sin [T, 1, D]. A new contiguous [T, heads, D]."""
        tokens, heads, dim = x.shape
        if not self.can_rotate(x, cos) or cos.shape != (tokens, 1, dim) or sin.shape != cos.shape:
            raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)}, cos {tuple(cos.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        y = torch.empty(tokens, heads, dim, dtype=torch.float32)
        if tokens and heads:
            self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr(),
                       tokens, heads, dim)  # fmt: skip
        return y

    @staticmethod
    def can_silu_mul(gate_up: torch.Tensor) -> bool:
        """Whether silu_mul takes gate_up (else aten's): float32 rows in place, halves a
        multiple of 8 wide."""
        return (
            gate_up.dtype == torch.float32
            and gate_up.dim() == 2
            and gate_up.is_contiguous()
            and gate_up.shape[1] % 16 == 0
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gate_up [rows, 2 * inter] its gate then its up (can_silu_mul)."""
        if not self.can_silu_mul(gate_up):
            raise ValueError(f"silu_mul: {gate_up.dtype} {tuple(gate_up.shape)}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        if rows and inter:
            self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
        return out

    @staticmethod
    def can_attend(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether decode_attention takes this layer (else the gather and aten's attention):
        float32 queries whose heads lie in place, a float32 pool, heads a multiple of 8 wide
        and at most MAX_HEAD_DIM."""
        return (
            q.dtype == k_cache.dtype == torch.float32
            and q.stride(2) == 1
            and q.stride(1) == q.shape[2]
            and k_cache.is_contiguous()
            and q.shape[2] % 8 == 0
            and q.shape[2] <= MAX_HEAD_DIM
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q [B, H, D] (can_attend); k_cache, v_cache [pages, page_size, Hkv, D] (one layer);
        page_table int64 [B, W]; positions int64 [B]: row b attends to its positions 0 ..
        positions[b] (the last `window` of them), read from its pages. [B, H, D]."""
        rows, heads, dim = q.shape
        _, page_size, kv_heads, _ = k_cache.shape
        if (
            not self.can_attend(q, k_cache)
            or v_cache.shape != k_cache.shape
            or not v_cache.is_contiguous()
            or v_cache.dtype != torch.float32
            or heads % kv_heads
            or page_table.dtype != torch.int64
            or positions.dtype != torch.int64
            or page_table.shape[0] != rows
            or positions.shape != (rows,)
        ):
            raise ValueError(f"decode attention: q {q.dtype} {tuple(q.shape)}, {k_cache.dtype}")
        table, positions = page_table.contiguous(), positions.contiguous()
        out = torch.empty(rows, heads, dim, dtype=torch.float32)
        done = rows and self._attend(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
            table.data_ptr(), table.shape[1], positions.data_ptr(),
            rows, heads, kv_heads, dim, page_size, window or 0, scale, out.data_ptr(),
        )  # fmt: skip
        if done == -2:
            raise ValueError("decode attention: a position outside its table or a page outside")
        if done:
            raise MemoryError("decode attention: no memory for the scores")
        return out

    @staticmethod
    def _run(
        fn: "ctypes._NamedFuncPointer",
        size: int,
        blocks: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
    ) -> torch.Tensor:
        n, count, block_bytes = blocks.shape
        k = count * BLOCK
        if block_bytes != size or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"block linear: x {x.dtype} {tuple(x.shape)}, [{n}, {k}] W")
        x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0]:
            bias_ptr = None if bias is None else bias.data_ptr()
            if fn(blocks.data_ptr(), bias_ptr, x.data_ptr(), y.data_ptr(), x.shape[0], n, k):
                raise MemoryError("block linear: no memory for the dequantized panels")
        return y


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """q: uint8 [N, K] values 0..15; d, m: float32 [N, K/32], w = d * q + m. The blocks the
    kernel reads, or None where a d or m is not exactly an fp16 (then it would not serve these
    weights; a GGUF's Q4_0 and Q4_1 always are)."""
    d16, m16 = d.to(torch.float16), m.to(torch.float16)
    if not (torch.equal(d16.float(), d) and torch.equal(m16.float(), m)):
        return None
    n, k = q.shape
    values = q.view(n, k // BLOCK, BLOCK)
    nibbles = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)
    scales = torch.stack([d16, m16], dim=-1).view(torch.uint8)  # [N, K/32, 4]
    return torch.cat([scales, nibbles], dim=-1).contiguous()


def pack_q8(weight: torch.Tensor, rows: int = 1024) -> torch.Tensor | None:
    """A float32 weight [N, K] that is exactly a Q8_0 tensor's dequantization (every block of
    32 is d * q, d an fp16, q int8 in -127..127, as ggml quantizes: d = max |w| / 127), as
    those blocks; None where it is not (then these blocks would not serve it). `rows` at a
    time: an lm_head is large (SmolLM2's 49152 x 576), and an engine pod's memory limit is
    sized for its weights, not for float copies of them."""
    n, k = weight.shape
    if k % BLOCK or weight.dtype != torch.float32:
        return None
    out = torch.empty(n, k // BLOCK, Q8_BYTES, dtype=torch.uint8)
    for start in range(0, n, rows):
        w = weight[start : start + rows].detach().reshape(-1, k // BLOCK, BLOCK)
        d = (w.abs().amax(dim=-1) / 127).to(torch.float16)
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        q = torch.round(w / safe[..., None])
        if q.abs().max() > 127 or not torch.equal(q * d.float()[..., None], w):
            return None
        out[start : start + rows, :, :2] = d[..., None].view(torch.uint8)
        out[start : start + rows, :, 2:] = q.to(torch.int8).view(torch.uint8)
    return out


@functools.cache
def kernels() -> Kernels | Unavailable:
    """The kernels, built and loaded once a process; or why not."""
    why = _unsupported()
    if why:
        return Unavailable(why)
    try:
        paths = {name: _library(name) for name in SOURCES}
        loaded = Kernels(paths)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("kvfence's native kernels are unavailable, aten's are used: %s", e)
        return Unavailable(str(e).splitlines()[0] if str(e) else type(e).__name__)
    log.info("native kernels: %s", ", ".join(str(p) for p in paths.values()))
    return loaded


def _unsupported() -> str | None:
    if os.environ.get(DISABLE) == "0":
        return f"{DISABLE}=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no native kernel for {platform.machine()}"
    flags = _cpu_flags()
    if flags is not None and not {"avx2", "fma", "f16c"} <= flags:
        return "the CPU lacks AVX2, FMA or F16C"
    return None


def _cpu_flags() -> set[str] | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "flags":
                return set(value.split())
    except OSError:
        pass
    return None


def _source(name: str) -> bytes:
    return resources.files(__package__).joinpath(f"{name}.c").read_bytes()


def _library(name: str) -> Path:
    """The library built from `name`.c: prebuilt, kept in the cache, or compiled now."""
    compiler = os.environ.get("CC", "cc")
    if os.environ.get(PREBUILT):
        prebuilt = Path(os.environ[PREBUILT]) / library_name(name, _source(name))
        if prebuilt.exists():
            return prebuilt
    found = shutil.which(compiler)
    if not found:
        raise OSError(f"no C compiler ({compiler}) to build {name}.c")
    version = subprocess.run(
        [found, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout.splitlines()[:1]
    target = _cache_dir() / library_name(name, _source(name), *version)
    if not target.exists():
        build(name, target, found)
    return target


def build_all(directory: Path, compiler: str = "cc") -> list[Path]:
    """Every kernel built into `directory` under the names KVFENCE_NATIVE_DIR is read by (an
    image's build: `python -m kvfence_engine.native DIR`)."""
    built = []
    for name in SOURCES:
        target = Path(directory) / library_name(name, _source(name))
        build(name, target, compiler)
        built.append(target)
    return built


def library_name(name: str, source: bytes, *compiler: str) -> str:
    digest = hashlib.sha256(source + repr((FLAGS, compiler)).encode()).hexdigest()[:16]
    return f"{name}-{digest}.so"


def build(name: str, target: Path, compiler: str = "cc") -> None:
    """Compile `name`.c into `target` (a temporary name, then renamed into place)."""
    source = resources.files(__package__).joinpath(f"{name}.c")
    target.parent.mkdir(parents=True, exist_ok=True)
    with resources.as_file(source) as src, tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode:
            raise OSError(f"{compiler} {name}.c failed: {done.stderr.strip()[:500]}")
        os.replace(out, target)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    directory = Path(base) / "kvfence" / "native"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            return directory
    except OSError:
        return Path(tempfile.mkdtemp(prefix="kvfence-native-"))
