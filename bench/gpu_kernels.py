"""The decode kernels (engine/kvfence_engine/core/paged_decode.py) alone on a GPU: paged decode
attention against the reference gather path of core/attention (relative error, in float32 from
the same bf16 inputs), and the time of each and of the read check, by batch and context, with
Llama-3.2-1B's attention shape (32 query heads, 8 KV heads, head dim 64, pages of 16).

    python3 bench/gpu_kernels.py --out $OUT/gpu_kernels.json
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton.testing

from kvfence_engine.core.attention import FULL, StepBatch, paged_attention
from kvfence_engine.core.paged_decode import check_decode, decode_parts, paged_decode_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 64, 16
CASES = [(1, 600), (1, 8192), (32, 600), (32, 8192), (128, 600)]
# on CPU (Triton's interpreter, TRITON_INTERPRET=1): errors only, on small cases, no timings,
# in float16 (the interpreter's tl.dot misreads bfloat16 operands: 2e10 off on a 16x16 product)
CPU_CASES = [(1, 40), (3, 100)]


def case(batch: int, context: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(batch * 7 + context)
    cuda = device.type == "cuda"
    low = torch.bfloat16 if cuda else torch.float16
    width = -(-context // PAGE)
    pages = batch * width + 1
    k_cache = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen, device=device).to(low)
    v_cache = torch.randn(pages, PAGE, KV_HEADS, DIM, generator=gen, device=device).to(low)
    table = torch.randperm(pages - 1, generator=gen, device=device)[: batch * width]
    table = table.view(batch, width).to(torch.int32)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, DIM, generator=gen, device=device).to(low)
    processors = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    parts = decode_parts(batch, KV_HEADS, processors)
    verdict = torch.zeros(batch, dtype=torch.int32, device=device)

    def kernel() -> torch.Tensor:
        return paged_decode_attention(
            q, k_cache, v_cache, table, rows, positions, verdict, scale=DIM**-0.5, parts=parts
        )

    keys = torch.arange(width * PAGE, device=device)
    step = StepBatch(
        is_prefill=False,
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        cu_seqlens=[],
        page_table=table.long(),
        key_mask=(keys[None, :] <= positions.long()[:, None])[:, None, None, :],
        query_positions=positions.long(),
    )
    empty = torch.zeros(0, KV_HEADS, DIM, device=device)

    def reference(dtype: torch.dtype) -> torch.Tensor:
        return paged_attention(
            q.to(dtype),
            empty.to(dtype),
            empty.to(dtype),
            k_cache.to(dtype),
            v_cache.to(dtype),
            step,
            FULL,
        )

    got = kernel().float()
    expected = reference(torch.float32)
    error = float((got - expected).norm() / expected.norm())
    state = torch.zeros(4, pages, dtype=torch.int32, device=device)
    state[0], state[1], state[2], state[3] = 1, PAGE, 1, -1
    held = torch.ones_like(table)
    num_held = torch.full((batch,), width, dtype=torch.int32, device=device)
    tenant = torch.zeros(batch, dtype=torch.int32, device=device)
    slots = torch.zeros(batch, dtype=torch.int64, device=device)

    def check() -> None:
        check_decode(
            state,
            table,
            held,
            num_held,
            rows,
            positions,
            tenant,
            page_size=PAGE,
            scratch_slot=(pages - 1) * PAGE,
            verdict=verdict,
            slots=slots,
        )

    check()
    assert int(verdict.abs().sum()) == 0, "a clean batch failed the check"
    found = {"batch": batch, "context": context, "parts": parts}
    found["rel_error_vs_fp32_reference"] = error
    if not cuda:
        return found
    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
    kernel_ms = triton.testing.do_bench(kernel, return_mode="median")
    return found | {
        "kernel_ms": kernel_ms,
        "kernel_gb_per_s": kv_bytes / kernel_ms / 1e6,
        "reference_bf16_ms": triton.testing.do_bench(lambda: reference(low), return_mode="median"),
        "check_ms": triton.testing.do_bench(check, return_mode="median"),
    }


def run_cases(device: torch.device) -> list[dict[str, Any]]:
    return [case(b, c, device) for b, c in (CASES if device.type == "cuda" else CPU_CASES)]


def table_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'batch':>6}{'context':>9}{'parts':>6}{'rel err':>10}{'kernel ms':>11}"
        f"{'GB/s':>8}{'ref ms':>9}{'check ms':>10}"
    ]
    for r in results:
        lines.append(
            f"{r['batch']:>6}{r['context']:>9}{r['parts']:>6}"
            f"{r['rel_error_vs_fp32_reference']:>10.2e}{r['kernel_ms']:>11.4f}"
            f"{r['kernel_gb_per_s']:>8.0f}{r['reference_bf16_ms']:>9.3f}{r['check_ms']:>10.4f}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = run_cases(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("\n".join(table_lines(results)))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    bad = [r for r in results if not r["rel_error_vs_fp32_reference"] < 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
