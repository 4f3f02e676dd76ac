"""spec.engine.tensorParallelSize through the operator, end to end: `kvfence operator` against
the test cluster, every pod a real process with builtin:tiny-random on CPU. With 2, each engine
pod runs `kvfence serve --tensor-parallel-size 2` (two processes in the pod, gloo between
them), its pool is its rank's (one of tiny-random's two KV heads: twice the tokens in the same
budget), the pool gate opens on the report, the canary passes, and the router answers."""

import pytest

from helpers.tiny_infd import (
    ENOUGH,
    check_first_rollout,
    container_args,
    manifest,
    router_client,
)
from kvfence_operator.crd.types import InferenceDeploymentSpec
from kvfence_operator.revision import revision_of


@pytest.mark.usefixtures("operator")
def test_a_tensor_parallel_deployment_rolls_out_with_two_ranks_per_engine_pod(cluster):
    engine = {"kvCacheMemory": ENOUGH, "extraArgs": ["--threads", "1"], "tensorParallelSize": 2}
    created = cluster.create(manifest(engine=engine))
    revision = revision_of(InferenceDeploymentSpec.model_validate(created["spec"]))
    # each rank holds one of the two KV heads: 192 pages of 16 in the budget of 96 whole ones
    check_first_rollout(cluster, created, revision, min_pool_tokens=192 * 16)
    for role in ("prefill", "decode"):
        args = container_args(cluster, revision, role)
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
    client = router_client(cluster, revision)
    answer = client.completions.create(
        model="tiny-random", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 8
