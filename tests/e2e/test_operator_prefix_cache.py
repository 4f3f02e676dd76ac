"""spec.engine.prefixCache through the operator (issue 17), end to end: `kvfence operator`
against the test cluster, every pod a real engine, router or canary process with
builtin:tiny-random. With the field on, the prefill engines cache (their page-key secret and
the routers' placement secret come from the revision's Secret), the canary's prefix-cache
check passes with the cache on (a tenant's repeat hits, another tenant's copy does not), and a
user's repeated prompt is reported as cached."""

import pytest

from helpers.openai_usage import cached_tokens
from helpers.tiny_infd import (
    ENOUGH,
    NAME,
    check_first_rollout,
    container_args,
    manifest,
    router_client,
)
from kvfence_operator.builders.secret import (
    PREFIX_CACHE_SECRET_FILE,
    PREFIX_CACHE_SECRET_KEY,
    ROUTING_SECRET_FILE,
    ROUTING_SECRET_KEY,
    secret_name,
)
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.meta import Instance
from kvfence_operator.revision import revision_of

PROMPT = [11 + i % 50 for i in range(70)]  # 4 full pages of 16 tokens, and 6 more


@pytest.mark.usefixtures("operator")
def test_the_prefix_cache_field_caches_per_tenant_and_the_canary_passes_with_it(cluster):
    engine = {"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1"]}
    created = cluster.create(
        manifest(engine={**engine, "prefixCache": {"enabled": True, "tenants": 3}})
    )
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    # the canary's prefix-cache check included; the prefill pods' pool is the requests' 72 of
    # 96 pages, the cache's partition (a quarter) not among them
    check_first_rollout(cluster, created, revision, min_pool_tokens=72 * 16)

    prefill = container_args(cluster, revision, "prefill")
    assert "--prefix-cache" in prefill
    assert prefill[prefill.index("--prefix-cache-secret-file") + 1] == PREFIX_CACHE_SECRET_FILE
    assert "--prefix-cache" not in container_args(cluster, revision, "decode")
    router = container_args(cluster, revision, "router")
    assert router[router.index("--routing-secret-file") + 1] == ROUTING_SECRET_FILE
    instance = Instance(NAME, "default", created["metadata"]["uid"])
    secret = cluster.get("Secret", secret_name(instance, revision))
    assert {PREFIX_CACHE_SECRET_KEY, ROUTING_SECRET_KEY} <= set(secret["data"])

    client = router_client(cluster, revision)
    first = client.completions.create(
        model="tiny-random", prompt=PROMPT, max_tokens=2, temperature=0
    )
    again = client.completions.create(
        model="tiny-random", prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert cached_tokens(first.usage) == 0
    assert cached_tokens(again.usage) == 64  # every full page
    assert again.choices[0].text == first.choices[0].text
