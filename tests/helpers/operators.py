"""`kvfence operator` as the end-to-end tests run it: against a test cluster, with its
`--metrics` URL, so that a test waits for "N more reconcile passes" of an InferenceDeployment
(the counter kvfence_operator_reconcile_passes_total, app/metrics.py) instead of sleeping and
hoping that the passes ran."""

from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from kvfence_devcluster.fixtures import Cluster
from kvfence_devcluster.processes import ManagedProcess
from kvfence_engine.tools import http_clients
from kvfence_engine.tools.localproc import free_port
from kvfence_operator.app.handlers import RECONCILE_INTERVAL_ENV
from kvfence_operator.app.metrics import PASSES

from .waits import GiveUp, eventually

IN_DEFAULT = ("--standalone", "--namespace", "default")
INTERVAL = "1"  # seconds between passes (KVFENCE_RECONCILE_INTERVAL), unless a test says


class Operator:
    """A running `kvfence operator`: the process, and its pass counter."""

    def __init__(self, process: ManagedProcess, metrics_url: str) -> None:
        self.process, self.metrics_url = process, metrics_url

    def passes(self, name: str, namespace: str = "default") -> int:
        """Passes of namespace/name that have ended (0 before the first)."""
        if self.process.poll() is not None:
            raise GiveUp(f"the operator exited {self.process.poll()}:\n{self.log()[-3000:]}")
        text = http_clients.get(self.metrics_url, timeout=5).raise_for_status().text
        for family in text_string_to_metric_families(text):
            if family.name == PASSES:
                for sample in family.samples:
                    if sample.labels == {"namespace": namespace, "name": name}:
                        return int(sample.value)
        return 0

    def wait_passes(
        self, n: int, name: str, namespace: str = "default", timeout: float | None = None
    ) -> int:
        """Wait until `n` whole passes of namespace/name have run since this call (a pass
        under way at the call is not one of them), and return the count. Every pass but the
        last has its writes in: kopf writes a pass's status patch before the next one starts."""
        start = eventually(
            lambda: self.passes(name, namespace), "the operator's metrics", 60, until=_any
        )
        return eventually(
            lambda: self.passes(name, namespace),
            f"{n} more reconcile passes of {namespace}/{name} (after {start})",
            timeout if timeout is not None else 60 + 10 * n,
            until=lambda count: count >= start + n + 1,
            interval=0.2,
        )

    # the process's own verbs, as the tests use them
    def stop(self, grace: float = 5.0) -> int | None:
        return self.process.stop(grace)

    def kill(self) -> int | None:
        return self.process.kill()

    def poll(self) -> int | None:
        return self.process.poll()

    @property
    def running(self) -> bool:
        return self.process.running

    def log(self) -> str:
        return self.process.log()


def _any(count: int) -> bool:
    return True  # any answer: the endpoint serves


def start_operator(
    cluster: Cluster,
    args: Sequence[str] = IN_DEFAULT,
    env: Mapping[str, str] | None = None,
) -> Operator:
    """`kvfence operator ARGS --metrics http://127.0.0.1:<free port>/metrics` against the
    cluster, a pass a second unless `env` sets KVFENCE_RECONCILE_INTERVAL."""
    url = f"http://127.0.0.1:{free_port()}/metrics"
    process = cluster.start_operator(
        [*args, "--metrics", url], env={RECONCILE_INTERVAL_ENV: INTERVAL, **(env or {})}
    )
    return Operator(process, url)
