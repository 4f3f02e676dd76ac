"""`kvfence preflight`: will this model's KV pool hold the context, before anything starts?

The same arithmetic the engine runs at start-up (pool_plan), from the model's metadata alone
(no weights, no torch); given a running target, its live /v1/kvpool instead of the estimate.
"""

import argparse
import sys
from dataclasses import dataclass

import httpx

from kvfence_engine.contracts import (
    TOKEN_HEADER,
    ErrorCode,
    PoolPlanReport,
    PoolSize,
    RouterPoolSizes,
)
from kvfence_engine.core.pool_plan import (
    ContextPolicy,
    budget_raise_percent,
    effective_context,
    plan_pool,
)
from kvfence_engine.core.shards import pool_shape
from kvfence_engine.tools import http_clients

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_DTYPES = ["auto", *DTYPE_BYTES]
WEIGHT_DTYPES = ["auto", "float32", "bfloat16", "float16", "int8", "int4", "int4+float16"]


def resolve_kv_dtype(kv_cache_dtype: str, weight_dtype: str | None, device: str) -> str:
    """The dtype `kvfence serve` allocates its pool in: `auto` is the model's compute dtype,
    core.quantization.resolve_precision's rule without torch (a test pins them equal). Weights
    `auto` is int4, int4+float16 or float32 on CPU (all compute float32) and bfloat16 on
    CUDA."""
    cuda = device.partition(":")[0] == "cuda"
    if weight_dtype == "auto":
        weight_dtype = None
    if cuda and weight_dtype in ("int8", "int4", "int4+float16"):
        raise ValueError(
            f"--weight-dtype {weight_dtype} is a CPU path; on CUDA use bfloat16 or float16"
        )
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if cuda:
        return weight_dtype or "bfloat16"
    return "bfloat16" if weight_dtype == "bfloat16" else "float32"  # packed weights: float32


@dataclass(frozen=True, slots=True)
class Verdict:
    lines: list[str]
    fits: bool


def estimate(
    source: str,
    budget_bytes: int,
    context_length: int,
    page_size: int,
    kv_dtype: str,
    ranks: int = 1,
) -> Verdict:
    """The engine's pool plan for `source`; with ranks > 1 (--tensor-parallel-size), a rank's
    pool: its KV heads in its budget, every rank as many pages (core/shards.pool_shape)."""
    from kvfence_engine.loading.config import load_config

    config = load_config(source)
    rank = pool_shape(config, ranks)  # ValueError: a model that does not split so
    plan = plan_pool(
        rank, page_size=page_size, dtype_bytes=DTYPE_BYTES[kv_dtype], budget_bytes=budget_bytes
    )
    lowered = effective_context(context_length, plan.pool_tokens, page_size, ContextPolicy.LOWER)
    per = "engine" if ranks == 1 else f"rank ({ranks} per engine, {rank.num_kv_heads} KV heads)"
    lines = [
        f"model {source}: {config.num_layers} layers x {config.num_kv_heads} KV heads x "
        f"{config.head_dim} dims, {config.max_positions} positions",
        f"KV bytes per token: {plan.kv_bytes_per_token} ({kv_dtype}, K and V, every layer"
        f"{'' if ranks == 1 else ', of the rank with the most KV heads'})",
        f"pool: {budget_bytes} bytes -> {plan.num_pages} pages x {page_size} tokens = "
        f"{plan.pool_tokens} tokens per {per} (prefill and decode alike)",
    ]
    return _verdict(
        lines, context_length, plan.pool_tokens, page_size, lowered, config.max_positions
    )


def live(
    target: str,
    context_length: int,
    internal_token: str | None = None,
    api_key: str | None = None,
) -> Verdict:
    """Ask a running engine or router (`target`: a URL without /v1) for its pool."""
    url = f"{target}/v1/kvpool"
    headers = {TOKEN_HEADER: internal_token} if internal_token else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        response = http_clients.get(url, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    if response.status_code == 401:
        raise ValueError(f"{url} answered 401: {_refusal(response, internal_token, api_key)}")
    if response.status_code != 200:
        raise ValueError(f"{url} answered {response.status_code}: {response.text[:200]}")
    try:
        report = response.json()
        if isinstance(report, dict) and report.get("role") == "router":
            return _router_verdict(target, response.content, context_length)
        pool = PoolPlanReport.model_validate(report)
    except ValueError as exc:  # JSONDecodeError and ValidationError are ValueErrors
        first = str(exc).splitlines()[0]
        raise ValueError(f"{url} did not answer as a kvfence engine or router: {first}") from None
    lines = [
        f"target {target}: role {pool.role}, revision {pool.revision}",
        f"KV bytes per token: {pool.kv_bytes_per_token} ({pool.kv_dtype})",
        f"pool: {pool.num_pages} pages x {pool.page_size} tokens = {pool.pool_tokens} "
        f"tokens ({pool.free_pages} pages free); serves {pool.context_length_effective}",
    ]
    return _live_verdict(lines, context_length, pool.pool_tokens, pool.page_size)


def _refusal(response: httpx.Response, internal_token: str | None, api_key: str | None) -> str:
    """Which credential a 401 asks for: a router's tenant key, or an engine's internal token."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code == ErrorCode.INVALID_API_KEY:
        if api_key:
            return "the API key was refused"
        return "an API key is needed (--api-key or $KVFENCE_API_KEY)"
    if internal_token:
        return "the internal token was refused"
    return "this engine needs its internal token (--internal-token-file)"


def _router_verdict(target: str, content: bytes, context_length: int) -> Verdict:
    """A router's /v1/kvpool: the smallest pool behind it bounds every request."""
    bounds = PoolSize.model_validate_json(content)
    engines = len(RouterPoolSizes.model_validate_json(content).backends)
    lines = [
        f"target {target}: router over {engines} engines",
        f"smallest pool: {bounds.pool_tokens} tokens in pages of {bounds.page_size}; "
        f"serves {bounds.context_length_effective}",
    ]
    return _live_verdict(lines, context_length, bounds.pool_tokens, bounds.page_size)


def _live_verdict(lines: list[str], context: int, pool_tokens: int, page_size: int) -> Verdict:
    """A running server's pool: whether it holds the context, and what LowerContext would
    serve if not (a live pool has no model positions to check: the server did that)."""
    lowered = effective_context(context, pool_tokens, page_size, ContextPolicy.LOWER)
    return _verdict(lines, context, pool_tokens, page_size, lowered, None)


def positions_problem(context: int, max_positions: int) -> str | None:
    """A model attends to no more than its positions, whatever the pool holds."""
    if context > max_positions:
        return f"context {context}: DOES NOT FIT the model's {max_positions} positions"
    return None


def _verdict(
    lines: list[str],
    context: int,
    pool_tokens: int,
    page_size: int,
    lowered: int,
    max_positions: int | None,
) -> Verdict:
    if max_positions is not None and (problem := positions_problem(context, max_positions)):
        lines.append(problem)
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
            kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, args.weight_dtype, args.device)
            verdicts.append(
                estimate(
                    args.model,
                    args.kv_cache_memory,
                    args.context_length,
                    args.page_size,
                    kv_dtype,
                    args.tensor_parallel_size,
                )
            )
        if args.target:
            verdicts.append(
                live(args.target, args.context_length, args.internal_token, args.api_key)
            )
    except (httpx.HTTPError, KeyError, ValueError, OSError) as exc:
        print(f"kvfence preflight: {exc}", file=sys.stderr)
        return 2
    for verdict in verdicts:
        print("\n".join(verdict.lines))
    return 0 if all(v.fits for v in verdicts) else 1
