"""The address a new Service gets as its `spec.clusterIP`: a loopback address that the test
kube-proxy (proxy.py) can listen on."""

import random
import socket
from collections.abc import Collection, Iterable


def _bindable(address: str, ports: Iterable[int]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                return False
    return True


def allocate_cluster_ip(taken: Collection[str], ports: Iterable[int]) -> str:
    """A loopback address 127.0.x.y for a new Service: none another Service has, and if it can
    be found, one nothing on this machine listens on at the Service's ports (another test
    cluster's proxy, say). x >= 1 keeps clear of 127.0.0.1 and systemd-resolved's 127.0.0.53."""
    wanted = [int(p) for p in ports]
    fallback = None
    for _ in range(100):
        address = f"127.0.{random.randint(1, 255)}.{random.randint(1, 254)}"
        if address in taken:
            continue
        if _bindable(address, wanted):
            return address
        fallback = fallback or address
    if fallback is None:
        raise RuntimeError("no free loopback address for a Service")
    # A port taken on every address (a listener on 0.0.0.0): the proxy cannot serve it
    # anywhere, and says so; the Service is still created, as a real one would be.
    return fallback
