"""Issue 26 item 7, end to end: `kvfence operator` on a cluster whose installed CRD is an older
release's (as `helm upgrade` leaves it: Helm never upgrades a chart's CRDs) says so in its log
and on the InferenceDeployment (Degraded, CrdOutdated, one Warning Event) and creates nothing;
once the CRD is upgraded with `kubectl apply -f crds/`, it reconciles without a restart."""

from pathlib import Path

import pytest
import yaml

from helpers.operators import start_operator
from helpers.tiny_infd import api_keys_secret, events, manifest, wait_condition
from kvfence_devcluster.fixtures import start_cluster
from kvfence_operator.crd.schema import build_crd

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_an_older_crd_stops_the_operator_with_a_condition_until_it_is_upgraded(
    tmp_path: Path,
) -> None:
    crd = build_crd()
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    del status["properties"]["progress"]  # as an earlier release's CRD had it
    del status["properties"]["revision"]["properties"]["retiring"]
    older = tmp_path / "older-crd.yaml"
    older.write_text(yaml.safe_dump(crd))
    with start_cluster(tmp_path / "cluster", kubelet=False, crds=(older,)) as cluster:
        cluster.create(api_keys_secret())
        operator = start_operator(cluster)
        try:
            cluster.create(manifest())
            degraded = wait_condition(cluster, "Degraded", "True", 60, reason="CrdOutdated")
            message = next(c["message"] for c in degraded["status"]["conditions"]
                           if c["type"] == "Degraded")  # fmt: skip
            assert "status.progress" in message and "kubectl apply -f crds/" in message
            operator.wait_passes(3, "tiny")
            assert len(events(cluster, "CrdOutdated")) == 1
            assert "is older than this operator" in operator.log()
            assert not cluster.list("Deployment", "default")

            cluster.kubectl("apply", "-f", str(ROOT / "crds"))
            cluster.wait_for(
                lambda: cluster.list("Deployment", "default"), "the operator to reconcile", 60
            )
            assert operator.running
        finally:
            operator.stop()
