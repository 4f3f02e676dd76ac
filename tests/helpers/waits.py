"""How a test waits: `eventually(observe, what, timeout, until=...)` polls a fact until it
holds, and fails saying what it waited for and what it saw last; an observation that can no
longer come true raises `GiveUp` to fail at once. Never a sleep that hopes enough happened,
and never an assertion on how long it took: a timeout is a hang guard (FACT_S by default,
READY_S for a process or deployment becoming ready), and speed belongs in bench/.

The loop itself is kvfence_devcluster/waiting.py, where `Cluster.wait_for` (the same loop, with
the cluster's state in its failure) can use it; the installed package cannot import tests/."""

from kvfence_devcluster.waiting import FACT_S, READY_S, GiveUp, eventually

__all__ = ["FACT_S", "READY_S", "GiveUp", "eventually"]
