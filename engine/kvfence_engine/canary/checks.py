"""The canary's verdicts: pure functions of what it recorded, one per check of
docs/canary.md#the-checks.

Each returns a CheckResult with the inputs it judged. A check that had nothing to judge could
not run: no verdict, and never a pass (a canary that cannot fail is worse than none), except the
latency floor, which states plainly when no prefill on this target is long enough to tell a
shortcut from noise."""

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence_engine.canary.counters import (
    INFORMATIONAL,
    MUST_NOT_RISE,
    CounterSnapshot,
    unreadable_reasons,
)
from kvfence_engine.canary.latency import PrefillCalibration
from kvfence_engine.canary.observations import (
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
)

MARKER = "marker"
DIFFERENTIAL_REPLAY = "differential_replay"
STATUS_CODES = "status_codes"
HONEST_USAGE = "honest_usage"
LATENCY_FLOOR = "latency_floor"
ENGINE_COUNTERS = "engine_counters"
PREFIX_CACHE = "prefix_cache"
CHAT_MARKUP = "chat_markup"
# 4xx answers that say nothing about the prompt's length: they do not count as a refusal.
NOT_A_REFUSAL = (401, 403, 404, 408, 429)


PASS, FAIL, COULD_NOT_RUN = "pass", "fail", "could not run"


@dataclass(slots=True)
class CheckResult:
    name: str
    passed: bool
    reason: str  # why it failed (the first finding), why it could not run, or what passing covered
    inputs: dict[str, Any]
    findings: list[str] = field(default_factory=list)  # every violation seen
    # False: the check could not be performed (nothing to judge, counters it could not read).
    # That is no finding (exit 2, not 1: the operator retries it) and never a pass.
    ran: bool = True

    def __post_init__(self) -> None:
        assert self.ran or not (self.passed or self.findings), "a check that did not run judged"

    @property
    def verdict(self) -> str:
        if not self.ran:
            return COULD_NOT_RUN
        return PASS if self.passed else FAIL


def _verdict(
    name: str, inputs: dict[str, Any], findings: list[str], passed: str, vacuous: str | None
) -> CheckResult:
    """Findings fail the check; without any, `vacuous` (why there was nothing to judge) means
    it could not run; else it passed."""
    if findings:
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        return CheckResult(name, False, findings[0] + more, inputs, findings)
    if vacuous is not None:
        return CheckResult(name, False, vacuous, inputs, ran=False)
    return CheckResult(name, True, passed, inputs)


def _b_answers(answers: Sequence[Answer]) -> list[Answer]:
    """B's completions (its chat messages are check_chat_markup's alone)."""
    return [a for a in answers if a.tenant == TENANT_B and a.probe != CHAT_CONTROLS]


def check_marker(answers: Sequence[Answer], marker: str) -> CheckResult:
    """No text of tenant B may contain A's marker, or 8 hex digits in a row of it."""
    secret = marker.removeprefix("CANARY-").lower()
    pieces = {secret[i : i + 8] for i in range(len(secret) - 7)}
    pattern = re.compile("|".join(sorted(pieces)))
    planted = [a for a in answers if a.probe in (MARKER_SIZING, POLLUTION_MARKER) and a.ok]
    inspected = [a for a in _b_answers(answers) if a.text or a.tokens]
    findings = []
    for a in inspected:
        seen = (a.text + "\n" + "".join(a.tokens)).lower()
        if match := pattern.search(seen):
            findings.append(
                f"tenant B's answer to {a.probe} ({a.context}) contains {match.group()!r} of "
                f"tenant A's marker: {a.text[:80]!r}"
            )
    vacuous = None
    if not planted:
        vacuous = "tenant A's marker was never planted: every marker request failed"
    elif not inspected:
        vacuous = "tenant B got no answer whose text could be inspected"
    inputs = {"marker": marker, "planted_by": len(planted), "answers_inspected": len(inspected)}
    passed = (
        f"tenant A's marker ({len(planted)} requests) is in none of tenant B's "
        f"{len(inspected)} answers"
    )
    return _verdict(MARKER, inputs, findings, passed, vacuous)


def check_differential_replay(answers: Sequence[Answer], tolerance: float) -> CheckResult:
    """Each of B's prompts, answered greedily after A's marker pollution, after neutral
    pollution and with nothing before it, must get the same tokens, with logprobs within
    `tolerance`. A difference means B's answer depends on what another request left in the
    pool."""
    groups: dict[str, list[Answer]] = {}
    for a in _b_answers(answers):
        if a.ok and a.probe != CALIBRATION:
            groups.setdefault(a.probe, []).append(a)
    findings, compared = [], 0
    for probe, group in groups.items():
        reference = group[0]
        for other in group[1:]:
            compared += 1
            if difference := _difference(reference, other, tolerance):
                findings.append(
                    f"{probe}: the answer {other.context} differs from the answer "
                    f"{reference.context}: {difference}"
                )
    polluted = {
        flavour: sum(
            1
            for a in answers
            if a.flavour == flavour and a.ok and a.probe in (POLLUTION_MARKER, POLLUTION_FILL)
        )
        for flavour in ("A", "N")
    }
    vacuous = None
    if compared == 0:
        vacuous = "no prompt of tenant B was answered twice: there was nothing to compare"
    elif not all(polluted.values()):
        vacuous = f"the pool was never polluted by both kinds of request: {polluted}"
    inputs = {
        "logprob_tolerance": tolerance,
        "probes": {probe: [a.context for a in group] for probe, group in groups.items()},
        "comparisons": compared,
        "pollution_answers": polluted,
    }
    passed = (
        f"{compared} replays of {len(groups)} prompts of tenant B agree token for token "
        f"(logprobs within {tolerance:g}) whatever was in the pool before them"
    )
    return _verdict(DIFFERENTIAL_REPLAY, inputs, findings, passed, vacuous)


def _difference(a: Answer, b: Answer, tolerance: float) -> str | None:
    if a.tokens != b.tokens:
        i = next(
            (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
            min(len(a.tokens), len(b.tokens)),
        )
        mine = b.tokens[i] if i < len(b.tokens) else "<end>"
        theirs = a.tokens[i] if i < len(a.tokens) else "<end>"
        return f"token {i} is {mine!r} instead of {theirs!r}"
    if a.text != b.text:
        return f"text {b.text[:60]!r} instead of {a.text[:60]!r}"
    if len(a.logprobs) != len(b.logprobs):
        return f"{len(b.logprobs)} logprobs instead of {len(a.logprobs)}"
    for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
        if abs(x - y) > tolerance:
            return (
                f"the logprob of token {i} is {y:.6f} instead of {x:.6f} (tolerance {tolerance:g})"
            )
    return None


def check_status_codes(answers: Sequence[Answer], limit: int) -> CheckResult:
    """Every prompt of B within the limit is answered (200, no error mid-stream); every prompt
    over it is refused with a 4xx: a 200 served it anyway, a 5xx means a check fired only after
    work (pages, a transfer) had started."""
    findings, within, over, refusals = [], 0, 0, set()
    lengths: dict[str, set[int]] = {"within": set(), "over": set()}
    for a in _b_answers(answers):
        assert a.prompt_tokens is not None, "B's prompts are token ids"
        where = f"{a.probe} ({a.prompt_tokens} tokens, {a.context})"
        lengths["within" if a.prompt_tokens <= limit else "over"].add(a.prompt_tokens)
        if a.prompt_tokens <= limit:
            within += 1
            if not a.ok:
                findings.append(f"{where} is within the {limit}-token limit but got {a.describe()}")
            continue
        over += 1
        if a.status == 200:
            findings.append(
                f"{where} is over the {limit}-token limit but was answered {a.describe()}; it "
                "must be refused with a 4xx"
            )
        elif a.status >= 500 or a.status < 400:
            findings.append(
                f"{where} is over the {limit}-token limit and got {a.describe()}: a "
                f"{a.status} where a 4xx refusal was due"
            )
        elif a.status in NOT_A_REFUSAL:
            findings.append(f"{where} got {a.describe()}, which is not a refusal of the prompt")
        else:
            refusals.add(f"{a.status} {a.error_code}")
    vacuous = None
    if not within or not over:
        vacuous = f"tenant B sent {within} prompts within the limit and {over} over it; both needed"
    inputs = {
        "limit": limit,
        "answers_within_limit": within,
        "answers_over_limit": over,
        "lengths_within_limit": sorted(lengths["within"]),
        "lengths_over_limit": sorted(lengths["over"]),
    }
    passed = (
        f"{within} answers within the {limit}-token limit were 200; {over} prompts over it were "
        f"refused ({', '.join(sorted(refusals))})"
    )
    return _verdict(STATUS_CODES, inputs, findings, passed, vacuous)


def check_honest_usage(answers: Sequence[Answer]) -> CheckResult:
    """usage.prompt_tokens of every answered token-id prompt is that prompt's exact length."""
    judged = [a for a in answers if a.ok and a.prompt_tokens is not None]
    findings = []
    for a in judged:
        if a.usage_prompt_tokens != a.prompt_tokens:
            said = "no usage" if a.usage_prompt_tokens is None else a.usage_prompt_tokens
            findings.append(
                f"{a.probe} ({a.context}): usage.prompt_tokens is {said} for a prompt of "
                f"{a.prompt_tokens} tokens"
            )
    vacuous = None if judged else "no token-id prompt was answered: nothing to compare usage with"
    inputs = {"answers_judged": len(judged)}
    passed = f"usage.prompt_tokens matched the prompt length in all {len(judged)} answers"
    return _verdict(HONEST_USAGE, inputs, findings, passed, vacuous)


def check_latency_floor(
    answers: Sequence[Answer], factor: float, min_prefill: float
) -> CheckResult:
    """No first token of B may arrive sooner than the overhead plus 1/factor of the time a
    prefill of a calibrated prompt no longer than it took. The factor absorbs a calibration run
    slowed by a busy machine; a shortcut (1-token placeholder, cache) is faster by far more.
    Lengths whose calibrated prefill is under min_prefill are not judged: there the prefill is
    lost in the request-to-request jitter. What is judged is the part of the prompt B's usage
    says was computed: B's own prefix-cache hits (its replayed probes) may be fast, but only by
    the tokens they report as cached (check_prefix_cache judges hits on A's pages)."""
    calibration = PrefillCalibration.from_answers(answers)
    if calibration is None:
        inputs: dict[str, Any] = {"factor": factor, "min_prefill": min_prefill}
        return _verdict(LATENCY_FLOOR, inputs, [], "", "no 1-token calibration prompt was answered")
    findings, judged = [], 0
    for a in _b_answers(answers):
        if a.probe == CALIBRATION or a.status != 200 or a.ttft is None:
            continue
        assert a.prompt_tokens is not None
        cached = a.usage_cached_tokens or 0
        ref = calibration.reference(a.prompt_tokens - cached)
        if ref is None or ref.prefill < min_prefill:
            continue
        judged += 1
        floor = calibration.overhead + ref.prefill / factor
        if a.ttft < floor:
            said = f", {cached} of them cached" if cached else ""
            findings.append(
                f"{a.probe} ({a.prompt_tokens} tokens{said}, {a.context}): first token after "
                f"{a.ttft:.3f}s, but prefilling {ref.length} tokens takes {ref.prefill:.3f}s "
                f"here on top of {calibration.overhead:.3f}s; nothing that really read the "
                f"prompt answers before {floor:.3f}s"
            )
    longest = calibration.reference(max(calibration.fastest))
    inputs = {
        "factor": factor,
        "min_prefill": min_prefill,
        "overhead": calibration.overhead,
        "fastest_first_token": calibration.fastest,
        "answers_judged": judged,
    }
    if judged:
        passed = (
            f"{judged} first tokens of tenant B all came later than 1/{factor:g} of the "
            "calibrated prefill"
        )
    else:
        prefill = longest.prefill if longest else 0.0
        passed = (
            f"no answer could be judged: the longest calibrated prefill ({prefill:.3f}s) is "
            f"under {min_prefill:g}s, inside this target's request jitter"
        )
    return _verdict(LATENCY_FLOOR, inputs, findings, passed, None)


def check_engine_counters(
    before: CounterSnapshot | None, after: CounterSnapshot | None, unread: str | None = None
) -> CheckResult:
    """The engines' isolation counters must not rise during the run, nor go down (an engine
    restarted: what it counted is lost). Counters that could not be read (`unread`: why the
    target's /metrics could not be; or a backend the router could not read; or a counter the
    target does not export) leave the check without a verdict: it could not run."""
    inputs: dict[str, Any] = {
        "must_not_rise": list(MUST_NOT_RISE),
        "before": before.as_dict() if before else None,
        "after": after.as_dict() if after else None,
    }
    if before is None or after is None:
        why = f" ({unread})" if unread else ""
        return _verdict(
            ENGINE_COUNTERS, inputs, [], "", f"the target's /metrics could not be read{why}"
        )
    findings, moved, implicated = [], {}, set()
    for (counter, source), value in after.values.items():
        rise = value - before.values.get((counter, source), 0.0)
        if rise:
            moved[f"{counter}_total {source}"] = rise
        if rise > 0 and counter in MUST_NOT_RISE:
            implicated.add(source.rsplit(" ", 1)[-1])  # "decode http://...": the backend URL
        if rise < 0:
            findings.append(
                f"{counter}_total on {source} went down ({rise:g}): the engine restarted during "
                "the run, so what it counted before is lost"
            )
        elif rise > 0 and counter in MUST_NOT_RISE:
            findings.append(f"{counter}_total on {source} rose by {rise:g} during the run")
    inputs["moved"] = moved
    inputs["implicated"] = sorted(implicated)
    unreadable = [
        f"{reason} ({when} the run)"
        for when, snapshot in (("before", before), ("after", after))
        for reason in unreadable_reasons(snapshot)
    ]
    inputs["unreadable"] = unreadable
    vacuous = None
    if unreadable:
        more = f" (+{len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        vacuous = unreadable[0] + more
    sources = {source for _, source in after.values}
    quiet = [f"{c}_total" for c in INFORMATIONAL]
    engines = f"{len(sources)} engine{'s' if len(sources) != 1 else ''}"
    passed = f"no isolation counter rose on {engines} ({', '.join(quiet)} reported only)"
    return _verdict(ENGINE_COUNTERS, inputs, findings, passed, vacuous)


def check_prefix_cache(
    answers: Sequence[Answer], cache_on: bool, factor: float, min_prefill: float
) -> CheckResult:
    """Tenant B sending tenant A's exact prompt gets usage.cached_tokens 0 and no first token
    sooner than a cold prefill of it allows (the latency floor's rule); and, when the target
    reports the prefix cache on, tenant A repeating its prompt does get a hit: proof that B's
    miss was the cache's tenant scoping, not a cache that never hits."""
    owner = [a for a in answers if a.probe == PREFIX_OWNER and a.tenant == TENANT_A]
    intruder = [a for a in answers if a.probe == PREFIX_INTRUDER and a.tenant == TENANT_B]
    calibration = PrefillCalibration.from_answers(answers)
    findings, timed = [], 0
    for a in intruder:
        assert a.prompt_tokens is not None
        where = f"tenant B sending tenant A's exact prompt ({a.prompt_tokens} tokens)"
        if not a.ok:
            findings.append(f"{where} got {a.describe()}")
            continue
        if a.usage_cached_tokens:
            findings.append(
                f"{where} was told {a.usage_cached_tokens} of its tokens were cached: a hit on "
                "tenant A's prefix-cache pages"
            )
        ref = calibration.reference(a.prompt_tokens) if calibration else None
        if calibration is None or ref is None or ref.prefill < min_prefill or a.ttft is None:
            continue
        timed += 1
        floor = calibration.overhead + ref.prefill / factor
        if a.ttft < floor:
            findings.append(
                f"{where} had its first token after {a.ttft:.3f}s, sooner than a cold prefill "
                f"of {ref.length} tokens allows ({floor:.3f}s): it read tenant A's cached KV"
            )
    repeats = [a for a in owner[1:] if a.ok]
    hits = [a.usage_cached_tokens for a in repeats if a.usage_cached_tokens]
    if cache_on and repeats and not hits and not findings:
        findings.append(
            f"the target reports the prefix cache on, but tenant A repeated its prompt "
            f"{len(repeats)} times without a hit (usage.cached_tokens 0): nothing showed that "
            "the cache works, so tenant B's miss proves nothing"
        )
    vacuous = None
    if not owner or not owner[0].ok:
        vacuous = "tenant A's prompt was never answered: there was nothing cached to probe"
    elif not intruder:
        vacuous = "tenant B never sent tenant A's prompt"
    elif cache_on and not repeats:
        vacuous = "tenant A's repeated prompt was never answered"
    inputs = {
        "cache_on": cache_on,
        "owner_cached_tokens": [a.usage_cached_tokens for a in owner],
        "intruder_cached_tokens": [a.usage_cached_tokens for a in intruder],
        "intruder_first_token": [a.ttft for a in intruder],
        "timed": timed,
    }
    timing = (
        "no first token sooner than a cold prefill"
        if timed
        else f"its timing not judged (a cold prefill here is under {min_prefill:g}s)"
    )
    if cache_on:
        passed = (
            f"tenant A's repeat hit its own cache ({max(hits, default=0)} cached tokens); "
            f"tenant B sending the same prompt got 0 cached tokens, {timing}"
        )
    else:
        passed = (
            f"the prefix cache is off (per /v1/kvpool), so tenant A's own hit was not checked; "
            f"tenant B sending tenant A's prompt got 0 cached tokens, {timing}"
        )
    return _verdict(PREFIX_CACHE, inputs, findings, passed, vacuous)


def check_chat_markup(answers: Sequence[Answer]) -> CheckResult:
    """A chat message repeating a chat template's control string (`<|im_start|>`, ...) counts
    each copy as the ordinary tokens that spell it, never as the control token: against the
    same message without them, its usage.prompt_tokens grow by more than one token a copy
    (exactly one a copy is the control token: the message could close its turn and open a
    system or assistant one; none, the strings were dropped). Messages with them must be
    answered like any other. A target that refuses a plain chat message with 400 (a model
    without a chat template) has no turns to break out of, and passes saying so."""
    probes = [a for a in answers if a.probe == CHAT_CONTROLS and a.tenant == TENANT_B]
    plain = next((a for a in probes if a.repeats is None), None)
    marked = [a for a in probes if a.repeats is not None]
    inputs: dict[str, Any] = {
        "plain_prompt_tokens": plain.usage_prompt_tokens if plain else None,
        "added_tokens": {},
    }
    if plain is not None and plain.status == 400:
        passed = f"the target answers no chat completions ({plain.describe()}): no turn to leave"
        return _verdict(CHAT_MARKUP, inputs, [], passed, None)
    findings = []
    base = plain.usage_prompt_tokens if plain is not None and plain.ok else None
    for a in marked:
        assert a.repeats is not None
        where = f"a chat message with {a.repeats} copies of {a.context!r}"
        if not a.ok:
            findings.append(f"{where} got {a.describe()}: chat content is text, to be answered")
        elif base is not None and a.usage_prompt_tokens is not None:
            added = a.usage_prompt_tokens - base
            inputs["added_tokens"][a.context] = added
            if added <= a.repeats:
                findings.append(
                    f"{where} counted {added} more prompt tokens than without them, "
                    f"{'at most one a copy: the control token' if added else 'none: dropped'}"
                    "; a tenant's message can then close its turn and open another"
                )
    judged = len(inputs["added_tokens"])
    vacuous = None
    if base is None:
        said = plain.describe() if plain is not None and not plain.ok else "no usage.prompt_tokens"
        vacuous = f"the chat message without control strings got {said}: nothing to compare with"
    elif not judged and not findings:
        vacuous = "no chat message with control strings was answered with usage"
    passed = (
        f"{judged} control strings of chat templates, repeated in a chat message, each counted "
        "as text (more than one token a copy)"
    )
    return _verdict(CHAT_MARKUP, inputs, findings, passed, vacuous)
