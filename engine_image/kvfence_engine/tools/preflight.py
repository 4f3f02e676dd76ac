"""`kvfence preflight`: will this model's KV pool hold the context, before anything starts?

The same arithmetic the engine runs at start-up (pool_plan), from the model's metadata alone
(no weights, no torch); given a running target, its live /v1/kvpool instead of the estimate.
"""

import argparse
import sys
from dataclasses import dataclass

import httpx

from kvfence_engine.contracts import TOKEN_HEADER, PoolPlanReport
from kvfence_engine.core.pool_plan import (
    ContextPolicy,
    budget_raise_percent,
    effective_context,
    plan_pool,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Verdict:
    lines: list[str]
    fits: bool


def estimate(
    source: str, budget_bytes: int, context_length: int, page_size: int, kv_dtype: str
) -> Verdict:
    from kvfence_engine.loading.config import load_config

    config = load_config(source)
    plan = plan_pool(
        config, page_size=page_size, dtype_bytes=DTYPE_BYTES[kv_dtype], budget_bytes=budget_bytes
    )
    lowered = effective_context(context_length, plan.pool_tokens, page_size, ContextPolicy.LOWER)
    lines = [
        f"model {source}: {config.num_layers} layers x {config.num_kv_heads} KV heads x "
        f"{config.head_dim} dims, {config.max_positions} positions",
        f"KV bytes per token: {plan.kv_bytes_per_token} ({kv_dtype}, K and V, every layer)",
        f"pool: {budget_bytes} bytes -> {plan.num_pages} pages x {page_size} tokens = "
        f"{plan.pool_tokens} tokens per engine (prefill and decode alike)",
    ]
    return _verdict(
        lines, context_length, plan.pool_tokens, page_size, lowered, config.max_positions
    )


def live(target: str, context_length: int, internal_token: str | None = None) -> Verdict:
    headers = {TOKEN_HEADER: internal_token} if internal_token else {}
    response = httpx.get(target.rstrip("/") + "/v1/kvpool", headers=headers, timeout=10.0)
    if response.status_code == 401:
        raise ValueError(
            f"{target}/v1/kvpool answered 401: "
            + (
                "the internal token was refused"
                if internal_token
                else "this engine needs its internal token (--internal-token-file)"
            )
        )
    response.raise_for_status()
    pool = PoolPlanReport.model_validate_json(response.content)
    lines = [
        f"target {target}: role {pool.role}, revision {pool.revision}",
        f"KV bytes per token: {pool.kv_bytes_per_token} ({pool.kv_dtype})",
        f"pool: {pool.num_pages} pages x {pool.page_size} tokens = {pool.pool_tokens} "
        f"tokens ({pool.free_pages} pages free); serves {pool.context_length_effective}",
    ]
    lowered = effective_context(
        context_length, pool.pool_tokens, pool.page_size, ContextPolicy.LOWER
    )
    return _verdict(lines, context_length, pool.pool_tokens, pool.page_size, lowered, None)


def _verdict(
    lines: list[str],
    context: int,
    pool_tokens: int,
    page_size: int,
    lowered: int,
    max_positions: int | None,
) -> Verdict:
    if max_positions is not None and context > max_positions:
        lines.append(f"context {context}: DOES NOT FIT the model's {max_positions} positions")
        return Verdict(lines, False)
    if pool_tokens >= context:
        lines.append(f"context {context}: fits ({pool_tokens / context:.2f}x of it in the pool)")
        return Verdict(lines, True)
    lines.append(
        f"context {context}: DOES NOT FIT. poolPolicy Refuse keeps such pods unready; "
        f"LowerContext would serve {lowered} tokens; or raise kvCacheMemory by "
        f"{budget_raise_percent(pool_tokens, context, page_size)}%"
    )
    return Verdict(lines, False)


def run_preflight(args: argparse.Namespace) -> int:
    """0: the context fits; 1: it does not; 2: nothing to check or the target is unreachable."""
    if not args.target and not (args.model and args.kv_cache_memory):
        print("kvfence preflight: give --model and --kv-cache-memory, or --target", file=sys.stderr)
        return 2
    verdicts = []
    try:
        if args.model and args.kv_cache_memory:
            verdicts.append(
                estimate(
                    args.model,
                    args.kv_cache_memory,
                    args.context_length,
                    args.page_size,
                    args.kv_cache_dtype,
                )
            )
        if args.target:
            verdicts.append(live(args.target, args.context_length, args.internal_token))
    except (httpx.HTTPError, KeyError, ValueError, OSError) as exc:
        print(f"kvfence preflight: {exc}", file=sys.stderr)
        return 2
    for verdict in verdicts:
        print("\n".join(verdict.lines))
    return 0 if all(v.fits for v in verdicts) else 1
