"""How a test waits: `eventually(observe, what, timeout, until=...)` polls a fact until it
holds, and fails saying what it waited for and what it saw last; an observation that can no
longer come true raises `GiveUp` to fail at once. Never a sleep that hopes enough happened.

The loop itself is kvfence_devcluster/waiting.py, where `Cluster.wait_for` (the same loop, with
the cluster's state in its failure) can use it; the installed package cannot import tests/."""

from kvfence_devcluster.waiting import GiveUp, eventually

__all__ = ["GiveUp", "eventually"]
