"""One canary run: discover the target, size A's marker prompt, calibrate prefill time; then a
baseline and several rounds of two phases, A (tenant A's marker) and N (neutral ids of the same
lengths). A phase: B's long answer while A's burst fills the pool around it, then B's boundary
probes into the polluted pool. Calibrate again. Every request is recorded; the checks judge the
records."""

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kvfence_engine.canary.checks import (
    ENGINE_COUNTERS,
    CheckResult,
    check_chat_markup,
    check_differential_replay,
    check_engine_counters,
    check_honest_usage,
    check_latency_floor,
    check_marker,
    check_prefix_cache,
    check_status_codes,
)
from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.counters import CounterSnapshot, parse_counters, unreadable_reasons
from kvfence_engine.canary.discovery import TargetFacts, discover
from kvfence_engine.canary.latency import decode_seconds_per_token
from kvfence_engine.canary.observations import (
    BASELINE,
    CALIBRATION,
    CHAT_CONTROLS,
    MARKER_SIZING,
    POLLUTION_FILL,
    POLLUTION_MARKER,
    PREFIX_INTRUDER,
    PREFIX_OWNER,
    TENANT_A,
    TENANT_B,
    Answer,
    after,
    during,
)
from kvfence_engine.canary.prompts import (
    CONTROL_COPIES,
    CONTROL_STRINGS,
    MARKER_SHARE,
    Probe,
    boundary_probes,
    chat_markup_content,
    concurrent_probe,
    make_marker,
    marker_unit,
    pollution_lengths,
    token_prompt,
)
from kvfence_engine.canary.report import CanaryReport, decide
from kvfence_engine.canary.target import CannotRun, TargetClient

log = logging.getLogger(__name__)
# B's answer during a burst is sent again, up to this many times in all, while it ends before
# the burst does (on a machine that got faster or busier since calibration): only B's tokens
# decoded after A's KV is in the pool can show a page B lost to A.
OVERLAP_TRIES = 3
FLAVOURS = ("A", "N")  # A: tenant A's marker prompts; N: neutral token ids of the same lengths


def planned_steps(rounds: int) -> list[str]:
    """The steps `CanaryRun.execute` announces, in order (a progress display counts them)."""
    return [
        "discovering the target",
        "reading engine counters",
        "sizing tenant A's marker prompt",
        "calibrating prefill time",
        "probing the prefix cache",
        "probing chat markup",
        "baseline",
        *(f"round {r} of {rounds}, {f} pollution" for r in range(1, rounds + 1) for f in FLAVOURS),
        "calibrating prefill time again",
        "reading engine counters",
    ]


class CanaryRun:
    def __init__(self, config: CanaryConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.marker = make_marker(seed)
        self.target = TargetClient(config)
        self.answers: list[Answer] = []
        self.step = "starting"
        self.steps = planned_steps(config.rounds)
        self.steps_started = 0
        self.facts: TargetFacts | None = None
        self.probes: tuple[Probe, ...] = ()
        self.concurrent: Probe | None = None
        self.overlapped: list[str] = []  # B's answers during a burst that outlived it
        self.marker_prompt: str | None = None
        self.marker_tokens: int | None = None
        self.before: CounterSnapshot | None = None
        self.after: CounterSnapshot | None = None
        self.counters_unread: str | None = None  # why /metrics could not be read, if it was not
        self._prompts: dict[str, list[int]] = {}  # B's probes, replayed identically

    async def execute(self) -> None:
        async with self.target:
            self._at("discovering the target")
            facts = self.facts = await discover(self.target, self.config)
            self.probes = boundary_probes(
                facts.limit,
                facts.context_length,
                facts.advertised_context,
                facts.pool_tokens,
                self.config.answer_tokens,
            )
            self._at("reading engine counters")
            self.before = await self.read_counters()
            self.say_if_counters_cannot_be_judged()
            self._at("sizing tenant A's marker prompt")
            await self.size_marker_prompt(facts.limit)
            self._at("calibrating prefill time")
            await self.calibrate(facts.limit, "calibration-start")
            self._at("probing the prefix cache")
            await self.probe_prefix_cache(facts)
            self._at("probing chat markup")
            await self.probe_chat_markup()
            per_token = decode_seconds_per_token(self.answers) or 0.05
            decode_tokens = math.ceil(self.config.concurrent_decode_seconds / per_token)
            self.concurrent = concurrent_probe(facts.limit, facts.page_size, decode_tokens)
            self._at("baseline")
            await self.phase(None, 0)
            for round_ in range(1, self.config.rounds + 1):
                for flavour in FLAVOURS:
                    self._at(f"round {round_} of {self.config.rounds}, {flavour} pollution")
                    await self.phase(flavour, round_)
            self._at("calibrating prefill time again")
            await self.calibrate(facts.limit, "calibration-end")
            self._at("reading engine counters")
            self.after = await self.read_counters()

    def _at(self, step: str) -> None:
        """A step starts: the caller's progress display is told (the CLI's narrative is not a
        log line); the log keeps it at debug level."""
        assert step == self.steps[self.steps_started], f"{step!r} is not in planned_steps"
        self.steps_started += 1
        self.step = step
        log.debug("canary: %s", step)
        if self.config.progress is not None:
            self.config.progress(step)

    def say_if_counters_cannot_be_judged(self) -> None:
        """The first reading of the counters already tells whether their check can run: say so
        now, not at the end of a run that may take many minutes. The run goes on, because a
        leak the other checks see is still a finding (exit 1); but it can no longer pass."""
        if self.config.notice is None:
            return
        if self.before is None:
            why = self.counters_unread or "/metrics could not be read"
        else:
            reasons = unreadable_reasons(self.before)
            if not reasons:
                return
            why = "; ".join(reasons)
        self.config.notice(
            f"{ENGINE_COUNTERS} could not run: {why}. The other checks go on (a leak they see "
            "still fails the run), but without this one the run ends 'could not run' (exit 2) "
            "at best"
        )

    async def read_counters(self) -> CounterSnapshot | None:
        r = await self.target.get("/metrics")
        if r.status_code in (401, 403):
            self.counters_unread = (
                f"/metrics answered {r.status_code}: it needs the internal token "
                "(--internal-token-file)"
                if self.config.internal_token is None
                else f"/metrics answered {r.status_code}: the internal token was refused"
            )
            return None
        if r.status_code != 200:
            self.counters_unread = f"/metrics answered {r.status_code}"
            return None
        try:
            return parse_counters(r.text)
        except ValueError:
            self.counters_unread = "/metrics is not Prometheus text"
            return None

    async def ask(
        self,
        tenant: str,
        prompt: str | list[int],
        max_tokens: int,
        probe: str,
        context: str,
        flavour: str | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> Answer:
        answer = await self.target.complete(
            tenant,
            prompt,
            max_tokens=max_tokens,
            probe=probe,
            context=context,
            flavour=flavour,
            on_first_token=on_first_token,
        )
        self.answers.append(answer)
        return answer

    async def ask_b(
        self, probe: Probe, context: str, on_first_token: Callable[[], None] | None = None
    ) -> Answer:
        prompt = self._prompts.get(probe.name)
        if prompt is None:
            prompt = self._prompts[probe.name] = token_prompt(self.seed, probe.name, probe.length)
        return await self.ask(
            TENANT_B, prompt, probe.max_tokens, probe.name, context, None, on_first_token
        )

    async def size_marker_prompt(self, limit: int) -> None:
        """Repeat A's marker sentence to about MARKER_SHARE of the context, measured by usage."""
        unit = marker_unit(self.marker)
        goal = int(limit * MARKER_SHARE)

        async def tokens(repeats: int) -> int | None:
            a = await self.ask(TENANT_A, unit * repeats, 1, MARKER_SIZING, CALIBRATION)
            return a.usage_prompt_tokens if a.ok else None

        one = await tokens(1)
        if one is None or one > goal:
            return  # the context is too short for a marker sentence: the marker check says so
        five = await tokens(5) if 5 * one <= limit else None
        per_unit = max(1.0, (five - one) / 4) if five is not None else float(one)
        repeats = max(1, int((goal - one) / per_unit) + 1)
        for _ in range(3):
            n = await tokens(repeats)
            if n is not None and n <= goal:
                self.marker_prompt, self.marker_tokens = unit * repeats, n
                return
            repeats = max(1, repeats - 1 - int(((n or limit + 1) - goal) / per_unit))
        self.marker_prompt, self.marker_tokens = unit, one

    async def calibrate(self, limit: int, label: str) -> None:
        """First-token times of fresh prompts: 1 token (the overhead; 8 tokens out, for the
        decode rate), half the limit and the limit, interleaved so noise spreads over all.
        Done before and after the probes: the floor keeps the fastest of each length, so a
        machine that was busy during one calibration does not raise it."""
        lengths = [1, limit // 2, limit] * 2 + [1]
        for i, length in enumerate(n for n in lengths if n >= 1):
            prompt = token_prompt(self.seed, f"{label}-{i}", length)
            await self.ask(TENANT_B, prompt, 8 if length == 1 else 1, CALIBRATION, CALIBRATION)

    async def probe_prefix_cache(self, facts: TargetFacts) -> None:
        """Tenant A sends a fresh prompt as long as the limit, then repeats it until it hits
        its own cache (at most once per engine that computes prompts, where it may land);
        then tenant B sends the same token ids. Sent whatever the target says about its
        cache: a cache that is on but reported off is a cache B must still miss."""
        prompt = token_prompt(self.seed, PREFIX_OWNER, facts.limit)
        first = await self.ask(TENANT_A, prompt, 1, PREFIX_OWNER, "prefix-cold")
        if not first.ok:
            return
        for i in range(facts.prompt_engines if facts.prefix_cache else 0):
            again = await self.ask(TENANT_A, prompt, 1, PREFIX_OWNER, f"prefix-repeat-{i + 1}")
            if again.usage_cached_tokens:
                break
        await self.ask(TENANT_B, prompt, 1, PREFIX_INTRUDER, "prefix-intruder")

    async def probe_chat_markup(self) -> None:
        """Tenant B's chat messages: one plain, then one per control string of the usual chat
        templates, repeating it CONTROL_COPIES times (check_chat_markup judges their usage)."""
        for control in (None, *CONTROL_STRINGS):
            answer = await self.target.chat(
                TENANT_B,
                chat_markup_content(control),
                probe=CHAT_CONTROLS,
                context=control or "plain",
                repeats=CONTROL_COPIES if control else None,
            )
            self.answers.append(answer)

    async def phase(self, flavour: str | None, round_: int) -> None:
        """B's long answer with a pollution burst filling the pool around it (none at
        baseline); then a top-up of the same flavour into the pages B's answer just released,
        which the LIFO free list hands out first; then B's boundary probes, longest first, into
        a pool that holds this phase's pollution throughout."""
        probe = self.concurrent
        assert probe is not None
        if flavour is None:
            await self.ask_b(probe, BASELINE)
            context = BASELINE
        else:
            await self.concurrent_answers(probe, flavour, round_)
            context = after(flavour, round_)
            assert self.facts is not None
            top_up = min(probe.length + probe.max_tokens, self.facts.limit)
            await self.pollute(flavour, context, [top_up])
        for boundary in self.probes:
            await self.ask_b(boundary, context)

    async def concurrent_answers(self, probe: Probe, flavour: str, round_: int) -> None:
        """B's answer during a burst, sent again while it ends before the burst does."""
        for attempt in range(1, OVERLAP_TRIES + 1):
            if await self.concurrent_answer(probe, flavour, during(flavour, round_, attempt)):
                return

    async def concurrent_answer(self, probe: Probe, flavour: str, context: str) -> bool:
        """B's answer, with the burst sent the moment its first token arrives. True if B was
        still decoding when every request of the burst had been answered."""
        first = asyncio.Event()
        answer = asyncio.ensure_future(self.ask_b(probe, context, first.set))
        started = asyncio.ensure_future(first.wait())
        outlived = False
        try:
            await asyncio.wait({answer, started}, return_when=asyncio.FIRST_COMPLETED)
            if first.is_set():
                keep_free = probe.length + probe.max_tokens
                await self.pollute(flavour, context, self.burst_lengths(keep_free))
                outlived = not answer.done()
                if outlived:
                    self.overlapped.append(context)
            await answer
            return outlived
        finally:
            for task in (answer, started):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, CannotRun):
                    await task

    def burst_lengths(self, keep_free: int) -> list[int]:
        """Prompt lengths that fill the decode pools at once, but `keep_free` tokens' pages."""
        facts = self.facts
        assert facts is not None
        page = facts.page_size
        fill = facts.decode_pool_tokens - math.ceil(keep_free / page) * page
        size = self.marker_tokens or int(facts.limit * MARKER_SHARE)
        return pollution_lengths(fill, size, page, self.config.max_pollution_requests)

    async def pollute(self, flavour: str, context: str, lengths: list[int]) -> None:
        """Tenant A's requests, all at once: the marker prompt where its length fits (A), or
        token ids (N, and the rest of A's): the two flavours differ in content only."""
        requests = []
        for i, length in enumerate(lengths):
            if flavour == "A" and self.marker_prompt is not None and length == self.marker_tokens:
                requests.append(
                    self.ask(TENANT_A, self.marker_prompt, 1, POLLUTION_MARKER, context, flavour)
                )
            else:
                ids = token_prompt(self.seed, f"{context}-{flavour}-{i}", length)
                requests.append(self.ask(TENANT_A, ids, 1, POLLUTION_FILL, context, flavour))
        # every request ends before a failure is raised: none is left running behind the run
        for result in await asyncio.gather(*requests, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def checks(self) -> list[CheckResult]:
        if self.facts is None:
            return []
        c = self.config
        return [
            check_marker(self.answers, self.marker),
            check_differential_replay(self.answers, c.logprob_tolerance),
            check_status_codes(self.answers, self.facts.limit),
            check_honest_usage(self.answers),
            check_latency_floor(self.answers, c.latency_factor, c.latency_min_prefill),
            check_engine_counters(self.before, self.after, self.counters_unread),
            check_prefix_cache(
                self.answers, self.facts.prefix_cache, c.latency_factor, c.latency_min_prefill
            ),
            check_chat_markup(self.answers),
        ]

    def plan(self) -> dict[str, Any] | None:
        if self.facts is None:
            return None
        c = self.config
        return {
            "rounds": c.rounds,
            "marker": self.marker,
            "marker_prompt_tokens": self.marker_tokens,
            "probes": [_probe_dict(p) for p in self.probes],
            "concurrent_probe": _probe_dict(self.concurrent) if self.concurrent else None,
            "concurrent_outlived_burst": self.overlapped,
            "logprob_tolerance": c.logprob_tolerance,
            "latency_factor": c.latency_factor,
            "latency_min_prefill": c.latency_min_prefill,
            "timeout": c.timeout,
            "max_requests": c.max_requests,
            "rate": c.rate,
        }


def _probe_dict(probe: Probe) -> dict[str, Any]:
    return {
        "name": probe.name,
        "length": probe.length,
        "within_limit": probe.within_limit,
        "why": probe.why,
        "max_tokens": probe.max_tokens,
    }


async def run_canary_async(config: CanaryConfig) -> CanaryReport:
    """Run the canary against config.target; never raises for a target's misbehaviour, which
    is what the report is for."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    start = time.monotonic()
    seed = config.seed if config.seed is not None else secrets.randbits(32)
    run = CanaryRun(config, seed)
    error = None
    try:
        async with asyncio.timeout(config.timeout):
            await run.execute()
    except TimeoutError:
        error = f"timed out after {config.timeout:g}s (--timeout) while {run.step}"
    except CannotRun as exc:
        error = f"could not run: {exc} (while {run.step})"
    seconds = time.monotonic() - start
    checks = run.checks()
    outcome, exit_code, reason = decide(checks, error, seconds, run.target.requests)
    log.debug("canary: %s", reason)  # the verdict is the caller's to say (report.summary)
    return CanaryReport(
        target=config.target,
        outcome=outcome,
        exit_code=exit_code,
        reason=reason,
        complete=error is None,
        started_at=started_at,
        seconds=round(seconds, 3),
        requests=run.target.requests,
        seed=seed,
        facts=run.facts.as_dict() if run.facts else None,
        plan=run.plan(),
        checks=checks,
        answers=[a.compact() for a in run.answers],
    )


def run_canary(config: CanaryConfig) -> CanaryReport:
    """The blocking entry point (CLI, `kvfence up`); async callers use run_canary_async."""
    return asyncio.run(run_canary_async(config))
