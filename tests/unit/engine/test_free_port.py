"""free_port and loopback_socket never hand out a port free_port handed out lately, in any
process: the kernel's bind(0) may offer a port again the moment it is let go, before whatever
it was for has bound it (a parallel test's engine then finds it taken)."""

import subprocess
import sys
import tempfile

import pytest

from kvfence_engine.tools import localproc
from kvfence_engine.tools.localproc import free_port, loopback_socket


class Kernel:
    """bind(0) answers from a script: the kernel offering the same port twice in a row."""

    def __init__(self, offers: list[int]) -> None:
        self.offers = offers

    def socket(self) -> "Kernel.Socket":
        return Kernel.Socket(self)

    class Socket:
        def __init__(self, kernel: "Kernel") -> None:
            self.kernel, self.port = kernel, 0

        def bind(self, address: tuple[str, int]) -> None:
            self.port = address[1] or self.kernel.offers.pop(0)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass

        def __enter__(self) -> "Kernel.Socket":
            return self

        def __exit__(self, *exc: object) -> None:
            pass


@pytest.fixture(autouse=True)
def own_book(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_a_port_offered_again_is_passed_over_by_free_port_and_loopback_socket(monkeypatch):
    kernel = Kernel([40001, 40001, 40003, 40001, 40003, 40005])
    monkeypatch.setattr(localproc.socket, "socket", kernel.socket)
    assert free_port() == 40001
    assert free_port() == 40003, "40001 was just handed out"
    assert loopback_socket().getsockname()[1] == 40005, "40001 and 40003 were"


def test_the_ports_handed_out_are_shared_by_every_process(tmp_path):
    code = "from kvfence_engine.tools.localproc import free_port; print(free_port())"
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    child = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, check=True).stdout)  # fmt: skip
    with localproc._handed_out() as recent:
        assert child in recent
