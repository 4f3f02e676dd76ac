"""What the canary learns from the target before it sends a probe: the model, the context it
advertises, and every engine's real pool and context (the router summarises its backends')."""

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.observations import TENANT_A, TENANT_B
from kvfence_engine.canary.target import CannotRun, TargetClient
from kvfence_engine.contracts import EnginePoolSize, PoolSize, Role, RouterPoolSizes


@dataclass(frozen=True, slots=True)
class EnginePool:
    role: Role
    url: str  # "" when the target is itself a combined engine; "#N" from a tenant's view
    pool_tokens: int
    context_length_effective: int
    page_size: int
    prefix_cache: bool = False  # reuses a tenant's cached prompt pages (/v1/kvpool)

    @property
    def limit(self) -> int:
        """The longest prompt this engine can hold: its context, or its whole pool if smaller."""
        return min(self.context_length_effective, self.pool_tokens)


@dataclass(frozen=True, slots=True)
class TargetFacts:
    model: str
    advertised_context: int  # max_model_len of GET /v1/models
    context_length: int  # the context the canary holds the target to
    context_source: str  # "--context-length" or "max_model_len"
    engines: tuple[EnginePool, ...]
    unreachable: tuple[str, ...] = ()  # backends the router could not read

    @property
    def limit(self) -> int:
        """The longest prompt that must be answered; anything longer must be refused."""
        return min(self.context_length, *(engine.limit for engine in self.engines))

    @property
    def pool_tokens(self) -> int:
        return min(engine.pool_tokens for engine in self.engines)

    @property
    def page_size(self) -> int:
        return min(engine.page_size for engine in self.engines)

    @property
    def decode_pool_tokens(self) -> int:
        """KV slots that hold requests while they generate: what pollution has to fill."""
        pools = [e.pool_tokens for e in self.engines if e.role in (Role.DECODE, Role.COMBINED)]
        return sum(pools) if pools else self.pool_tokens

    @property
    def prefix_cache(self) -> bool:
        """Whether an engine that computes prompts (prefill or combined) says its cache is on."""
        return any(e.prefix_cache for e in self.engines if e.role is not Role.DECODE)

    @property
    def prompt_engines(self) -> int:
        """Engines that compute prompts: where one tenant's repeated prompt may land."""
        return sum(1 for e in self.engines if e.role is not Role.DECODE)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "limit": self.limit,
            "pool_tokens": self.pool_tokens,
            "page_size": self.page_size,
            "decode_pool_tokens": self.decode_pool_tokens,
            "prefix_cache": self.prefix_cache,
        }


async def discover(target: TargetClient, config: CanaryConfig) -> TargetFacts:
    models: dict[str, Any] = {}
    for tenant in (TENANT_A, TENANT_B):
        r = await target.get("/v1/models", tenant)
        if r.status_code in (401, 403):
            raise CannotRun(
                f"tenant {tenant}'s key was refused by {target.base}/v1/models "
                f"({r.status_code}): check --tenant-{tenant.lower()}-key"
            )
        if r.status_code != 200:
            raise CannotRun(f"{target.base}/v1/models answered {r.status_code}: {r.text[:200]}")
        models = r.json()
    try:
        model = models["data"][0]
        target.model = str(model["id"])
        advertised = int(model["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CannotRun(f"{target.base}/v1/models has no model with a max_model_len") from exc
    r = await target.get("/v1/kvpool", TENANT_B)
    if r.status_code != 200:
        raise CannotRun(
            f"{target.base}/v1/kvpool answered {r.status_code}: the canary needs every engine's "
            "real pool size to place its probes (point --target at a kvfence router or engine)"
        )
    engines, unreachable = parse_pools(r.json())
    if config.context_length is not None:
        context, source = config.context_length, "--context-length"
    else:
        context, source = advertised, "max_model_len"
    return TargetFacts(target.model, advertised, context, source, engines, unreachable)


def parse_pools(report: object) -> tuple[tuple[EnginePool, ...], tuple[str, ...]]:
    """An engine's own /v1/kvpool, or the router's summary with one entry per backend."""
    try:
        if not (isinstance(report, dict) and "backends" in report):
            engine = EnginePoolSize.model_validate(report)
            return (_pool(engine.role, "", engine),), ()
        backends = RouterPoolSizes.model_validate(report).backends
    except ValidationError as exc:
        raise CannotRun(f"cannot read the target's /v1/kvpool: {exc}") from exc
    # A tenant's view of the router names no URL: the canary names a backend by its place.
    names = [b.url or f"#{i}" for i, b in enumerate(backends, 1)]
    engines = tuple(
        _pool(b.role, name, b.report)
        for b, name in zip(backends, names, strict=True)
        if b.report is not None
    )
    unreachable = tuple(
        f"{b.role} {name}" for b, name in zip(backends, names, strict=True) if b.error is not None
    )
    if not engines:
        raise CannotRun("the target's /v1/kvpool lists no engine that reported its pool")
    return engines, unreachable


def _pool(role: Role, url: str, size: PoolSize) -> EnginePool:
    return EnginePool(
        role,
        url,
        size.pool_tokens,
        size.context_length_effective,
        size.page_size,
        size.prefix_cache,
    )
