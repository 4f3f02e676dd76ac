"""spec.canary.schedule: when the standing canary runs. A five-field cron expression, in UTC
(a CronJob's, read by cronsim), one of the CronJob's descriptors (@hourly, @daily, @weekly,
@monthly, @yearly), or `@every DURATION` in Go's form (90s, 15m, 1h30m): that long after the
last run started."""

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from cronsim import CronSim, CronSimError

DESCRIPTORS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
EVERY = re.compile(r"^@every\s+(?=\d)(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
MIN_EVERY_SECONDS = 10  # a run itself takes a minute or more; runs never overlap
# the shape the CRD's schema admits, loosely: parse() says what is wrong with the rest
PATTERN = r"^(@[a-z]+( +[0-9a-z]+)?|[^ @]+( +[^ ]+){0,6})$"
EXAMPLES = "'*/30 * * * *', '@hourly' or '@every 15m'"


@dataclass(frozen=True, slots=True)
class Schedule:
    text: str
    every: timedelta | None  # @every; else the cron expression below
    cron: str | None

    def next_after(self, moment: datetime) -> datetime:
        """The first time the schedule fires after `moment` (an aware datetime)."""
        if self.every is not None:
            return moment + self.every
        assert self.cron is not None
        return next(CronSim(self.cron, moment))


def parse(text: str) -> Schedule:
    """A ValueError naming what is wrong, with examples."""
    text = " ".join(text.split())
    if text in DESCRIPTORS:
        return Schedule(text, None, DESCRIPTORS[text])
    if text.startswith("@every"):
        match = EVERY.match(text)
        if match is None:
            raise ValueError(f"schedule {text!r}: @every takes a duration such as 90s, 15m, 1h30m")
        hours, minutes, seconds = (int(g or 0) for g in match.groups())
        every = timedelta(hours=hours, minutes=minutes, seconds=seconds)
        if every.total_seconds() < MIN_EVERY_SECONDS:
            raise ValueError(f"schedule {text!r}: at least @every {MIN_EVERY_SECONDS}s")
        return Schedule(text, every, None)
    if text.startswith("@"):
        raise ValueError(
            f"schedule {text!r}: unknown descriptor; one of {', '.join(DESCRIPTORS)} or @every"
        )
    try:
        CronSim(text, datetime(2026, 1, 1))
    except CronSimError as exc:
        raise ValueError(f"schedule {text!r}: {exc}; e.g. {EXAMPLES}") from None
    return Schedule(text, None, text)
