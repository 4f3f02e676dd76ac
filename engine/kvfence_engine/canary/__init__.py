"""The canary isolation check: tenant B tries to see tenant A's data through a deployment.

    report = run_canary(CanaryConfig(target=URL, tenant_a_key=K1, tenant_b_key=K2))
    report.exit_code   # 0 pass, 1 an isolation or status check failed, 2 could not run

It talks HTTP only (httpx) and never imports torch: it runs in a small Job."""

from kvfence_engine.canary.checks import CheckResult
from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.report import (
    EXIT_CANNOT_RUN,
    EXIT_FAIL,
    EXIT_PASS,
    CanaryReport,
    write_report,
    write_termination_message,
)
from kvfence_engine.canary.run import planned_steps, run_canary, run_canary_async

__all__ = [
    "EXIT_CANNOT_RUN",
    "EXIT_FAIL",
    "EXIT_PASS",
    "CanaryConfig",
    "CanaryReport",
    "CheckResult",
    "planned_steps",
    "run_canary",
    "run_canary_async",
    "write_report",
    "write_termination_message",
]
