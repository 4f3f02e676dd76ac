"""The canary's report: a JSON document with every check, its inputs, verdict and reason; a
human summary; a one-line summary for /dev/termination-log; and the exit code."""

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from kvfence_engine.canary.checks import COULD_NOT_RUN, FAIL, CheckResult
from kvfence_engine.contracts import IMPLICATED_BACKENDS

EXIT_PASS = 0
EXIT_FAIL = 1  # an isolation or status check failed
EXIT_CANNOT_RUN = 2  # no verdict: target down, key refused, out of time, a check not run
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LIMIT = 4000  # bytes; Kubernetes keeps at most 4096 of a termination message


@dataclass(slots=True)
class CanaryReport:
    target: str
    outcome: str  # pass | fail | error
    exit_code: int
    reason: str  # one line: what failed, why it could not run, or what passing covered
    complete: bool  # every step ran (False after an error: the checks saw part of the run)
    started_at: str
    seconds: float
    requests: int
    seed: int
    facts: dict[str, Any] | None
    plan: dict[str, Any] | None
    checks: list[CheckResult]
    answers: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_PASS

    @property
    def summary(self) -> str:
        """One line: the verdict and its reason (what the termination log carries)."""
        head = {"pass": "PASS", "fail": "FAIL", "error": "ERROR"}[self.outcome]
        line = f"kvfence canary {head}: {self.reason}"
        return line.encode()[:TERMINATION_LIMIT].decode(errors="ignore")

    @property
    def implicated(self) -> list[str]:
        """The backends whose isolation counters rose during the run (engine_counters)."""
        return sorted(
            {url for check in self.checks for url in check.inputs.get("implicated") or []}
        )

    @property
    def termination_message(self) -> str:
        """The summary, then the implicated backends (contracts.IMPLICATED_BACKENDS): as many
        whole URLs as fit in half of what Kubernetes keeps, the summary in the rest."""
        urls: list[str] = []
        for url in self.implicated:
            if len(" ".join([*urls, url])) > TERMINATION_LIMIT // 2:
                break
            urls.append(url)
        if not urls:
            return self.summary
        tail = f"\n{IMPLICATED_BACKENDS} {' '.join(urls)}"
        head = self.summary.encode()[: TERMINATION_LIMIT - len(tail.encode())]
        return head.decode(errors="ignore") + tail

    def human(self) -> str:
        lines = [
            f"kvfence canary against {self.target}: {self.outcome.upper()} "
            f"(exit {self.exit_code}) in {self.seconds:.1f}s, {self.requests} requests",
        ]
        if self.facts:
            f = self.facts
            lines.append(
                f"  model {f['model']}: limit {f['limit']} tokens (context {f['context_length']} "
                f"from {f['context_source']}, engines' pools >= {f['pool_tokens']} tokens)"
            )
        for check in self.checks:
            mark = check.verdict.upper()  # PASS, FAIL, COULD NOT RUN
            lines.append(f"  {mark} {check.name:<20} {check.reason}")
            lines += [f"         - {finding}" for finding in check.findings[1:6]]
        if self.outcome == "error":  # complete: every step ran, but a check could not
            stopped = "no verdict" if self.complete else "could not finish"
            lines.append(f"  {stopped}: {self.reason}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def decide(
    checks: list[CheckResult], error: str | None, seconds: float, requests: int
) -> tuple[str, int, str]:
    """(outcome, exit code, reason). A finding fails the run (exit 1, never retried as "could
    not run"), even when the run then stopped or another check could not run: a timeout, a
    target that went away or a counter it could not read does not hide a leak. Without one, an
    error, or a check that could not run, leaves the run without a verdict (exit 2)."""
    failed = [c for c in checks if c.verdict == FAIL]
    not_run = [c for c in checks if c.verdict == COULD_NOT_RUN]
    found = "; ".join(f"{c.name}: {c.reason}" for c in failed)
    if error is not None:
        if failed:
            return "fail", EXIT_FAIL, f"{found} (then the run stopped: {error})"
        return "error", EXIT_CANNOT_RUN, error
    if failed:
        return "fail", EXIT_FAIL, found
    if not_run:
        why = "; ".join(f"{c.name}: {c.reason}" for c in not_run)
        count = f"{len(not_run)} of {len(checks)} checks"
        return "error", EXIT_CANNOT_RUN, f"could not run {count}: {why}"
    return (
        "pass",
        EXIT_PASS,
        f"all {len(checks)} checks passed in {seconds:.1f}s ({requests} requests)",
    )


def write_report(report: CanaryReport, path: str) -> None:
    """--report FILE: the JSON report, or the one-line summary when FILE is the termination log
    (what the operator's Job passes: the pod's status then carries the reason)."""
    is_log = os.path.abspath(path) == TERMINATION_LOG
    with open(path, "w") as f:
        f.write(report.summary if is_log else report.to_json() + "\n")


def write_termination_message(report: CanaryReport, path: str = TERMINATION_LOG) -> bool:
    """The one-line summary, when running where a termination log exists (a Kubernetes Job)."""
    if not (os.path.exists(path) and os.access(path, os.W_OK)):
        return False
    with open(path, "w") as f:
        f.write(report.termination_message)
    return True
