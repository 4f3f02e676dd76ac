"""A revision as the rollout plan observes it: its replicas, one decode pool, its canary."""

from kvfence_operator.crd.types import PoolPolicy, RoleReplicas
from kvfence_operator.decisions.canary import CanaryOutcome
from kvfence_operator.decisions.pool_gate import PodPool, judge_pools, parse_pool
from kvfence_operator.decisions.rollout import RevisionObservation


def decode_pools(revision: str, pool_tokens: int = 1024) -> list[PodPool]:
    """The revision's one decode pod `<revision>-d`, as its /v1/kvpool reported it."""
    return [
        parse_pool(
            f"{revision}-d",
            "decode",
            revision,
            {
                "role": "decode",
                "revision": revision,
                "pool_tokens": pool_tokens,
                "page_size": 16,
                "num_pages": pool_tokens // 16,
                "context_length_effective": 512,
                "tag_check": True,
                "deferred_release": True,
            },
        )
    ]


def observation(
    revision: str,
    ready: int = 1,
    pool_tokens: int = 1024,
    canary: CanaryOutcome | None = None,
) -> RevisionObservation:
    pools = decode_pools(revision, pool_tokens)
    replicas = {
        role: RoleReplicas(ready=ready, desired=1) for role in ("prefill", "decode", "router")
    }
    return RevisionObservation(
        revision, replicas, judge_pools(pools, PoolPolicy.REFUSE, 512, None), canary
    )
