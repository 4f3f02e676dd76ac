"""What a pod in a container needs to reach the API server as a real pod does: an HTTPS
listener with a cluster CA (made with trustme), the KUBERNETES_SERVICE_* variables, and the
service account folder (token, ca.crt, namespace) that `config.load_incluster_config()` and
kopf read at /var/run/secrets/kubernetes.io/serviceaccount.

The process runtime needs none of it: its pods are processes on this machine that tests give
a kubeconfig. The token, as every token here, is never checked (the emulator has no authn or
RBAC; the chart's RBAC is tested against the operator's calls in tests/e2e/test_chart.py).
"""

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp.test_utils
import aiohttp.web
import trustme

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN = "kvfence-test-service-account-token"


@dataclass(frozen=True)
class InClusterAccess:
    host: str
    port: int
    ca_pem: bytes

    def env(self) -> dict[str, str]:
        """The variables the kubelet gives every container for the `kubernetes` Service."""
        return {
            "KUBERNETES_SERVICE_HOST": self.host,
            "KUBERNETES_SERVICE_PORT": str(self.port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.port),
        }

    def write_service_account(self, folder: Path, namespace: str) -> Path:
        """The files of a pod's service account volume, readable by any uid (as the kubelet's
        projected volume is, 0644), in `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in (
            ("token", TOKEN.encode()),
            ("ca.crt", self.ca_pem),
            ("namespace", namespace.encode()),
        ):
            (folder / name).write_bytes(content)
            (folder / name).chmod(0o644)
        return folder


Handler = Callable[[aiohttp.web.BaseRequest], Awaitable[aiohttp.web.StreamResponse]]


@contextlib.asynccontextmanager
async def https_listener(
    handler: Handler, host: str = "127.0.0.1"
) -> AsyncIterator[InClusterAccess]:
    """Serve `handler` (the API server's raw handler) over HTTPS on a free port of `host`,
    with a certificate for that address from a fresh CA; yields the access pods get."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(host, "localhost", "kubernetes.default.svc").configure_cert(context)
    server = aiohttp.test_utils.RawTestServer(handler, host=host)
    await server.start_server(ssl=context)
    try:
        yield InClusterAccess(host, int(server.port or 0), ca.cert_pem.bytes())
    finally:
        await server.close()
