"""The standing canary does not change a user's prefix-cache hit rate (issue 30): a run with the
standing profile (one round, a rate, a request budget; spec.canary.standingLoad) between two
rounds of a user's repeated prompts, against real router + prefill + decode processes with
--prefix-cache. Its tenants are its own, each with its own cache slot, and requests never take
the cache's partition, so the user's cached pages all survive the canary filling the pool.

The negative control: the same run with the user's key as its tenant A (a canary that shared
a user's tenant, as one given a user's key would) publishes its pool-filling prompts into the
user's own cache slot, whose quota then evicts the user's pages: the user's next round hits
less."""

from pathlib import Path

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from kvfence_engine.canary import CanaryConfig, run_canary

USER, KEY_A, KEY_B, TOKEN = "cache-user-key", "cache-canary-a", "cache-canary-b", "cache-token"
CONTEXT = 512
PROMPTS = [prompt_of(160, seed) for seed in range(3)]  # 10 pages each: 9 full ones are cached


def deployment(logs: Path, name: str) -> Deployment:
    folder = logs / f"{name}-credentials"
    folder.mkdir()
    (folder / "api-keys").write_text(
        f"{USER} team-a\n{KEY_A} kvfence-canary-a\n{KEY_B} kvfence-canary-b\n"
    )
    (folder / "internal-token").write_text(TOKEN + "\n")
    return start_deployment(
        logs,
        name,
        context=CONTEXT,
        pages=256,
        router_args=[
            "--api-keys", str(folder / "api-keys"),
            "--internal-token-file", str(folder / "internal-token"),
        ],
        # half the pool is the cache's: a slot of 42 pages for each of the 3 tenants, which
        # holds the user's 3 prompts (10 pages each)
        engine_args=["--prefix-cache", "--prefix-cache-tenants", "3",
                     "--prefix-cache-share", "0.5"],
    )  # fmt: skip


def user_round(d: Deployment) -> list[int]:
    """The user's prompts, each once: the tokens each took from the cache."""
    cached = []
    for prompt in PROMPTS:
        answer = d.client(USER).completions.create(
            model="tiny-random", prompt=prompt, max_tokens=1, temperature=0
        )
        assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
        details = answer.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details and details.cached_tokens else 0)
    return cached


def standing_run(d: Deployment, tenant_a_key: str) -> None:
    """One run as the operator's standing Job runs it (builders/canary_job.py::standing_args)."""
    config = CanaryConfig(
        d.router.url, tenant_a_key, KEY_B, internal_token=TOKEN, rounds=1, max_requests=400,
        rate=20.0,
    )  # fmt: skip
    report = run_canary(config)
    print(report.human())  # shown when a test fails
    assert report.requests <= 400


def hits_around_a_standing_run(d: Deployment, tenant_a_key: str) -> tuple[list[int], list[int]]:
    assert user_round(d) == [0, 0, 0]  # cold
    before = user_round(d)
    assert all(c >= 9 * 16 for c in before), before  # every full page from the cache
    standing_run(d, tenant_a_key)
    after = user_round(d)
    print(f"the user's cached tokens per prompt: {before} before the run, {after} after")
    return before, after


def test_a_standing_canary_run_leaves_a_users_prefix_cache_hits_as_they_were(
    logs_dir: Path,
) -> None:
    d = deployment(logs_dir, "standing-cache")
    try:
        before, after = hits_around_a_standing_run(d, KEY_A)
        assert after == before
    finally:
        d.stop()


def test_a_canary_sharing_the_users_tenant_would_evict_the_users_pages(logs_dir: Path) -> None:
    d = deployment(logs_dir, "standing-cache-shared-tenant")
    try:
        before, after = hits_around_a_standing_run(d, USER)
        assert sum(after) < sum(before), (before, after)
    finally:
        d.stop()
