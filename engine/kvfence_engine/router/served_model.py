"""Which model the router serves: the one its engines report in GET /v1/kvpool (`model_name`,
`model_source`). The router tokenizes with the source's tokenizer (to refuse over-long prompts
and apply the chat template) and advertises the name, so a router that guessed would count and
template with the wrong tokenizer and answer to the wrong id.

Without --model the engines decide, and must agree; with --model, the engines that answer must
serve that source. Engines older than the report's model fields say nothing and are not
counted.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvfence_engine.contracts import TOKEN_HEADER, ModelReport

MODEL_WAIT_SECONDS = 120.0  # without --model: how long to wait for engines still loading
POLL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class RouterModel:
    source: str
    name: str | None  # None: the engines did not say; the tokenizer source's own name


def read_engine_models(
    urls: Sequence[str], token: str | None, wait: float
) -> dict[str, ModelReport]:
    """Each engine's model report, polling those not ready yet until all answered or `wait`
    seconds passed (0: one pass). An engine that never answered is absent."""
    headers = {TOKEN_HEADER: token} if token else {}
    deadline = time.monotonic() + wait
    read: dict[str, ModelReport] = {}
    with httpx.Client(timeout=2.0, headers=headers) as client:
        while True:
            for url in urls:
                if url in read:
                    continue
                try:
                    r = client.get(url + "/v1/kvpool")
                    if r.status_code == 200:
                        read[url] = ModelReport.model_validate_json(r.content)
                except (httpx.HTTPError, ValueError):  # ValidationError is a ValueError
                    continue
            if set(read) == set(urls) or time.monotonic() >= deadline:
                return read
            time.sleep(POLL_SECONDS)


def agreed_model(
    urls: Sequence[str], reports: dict[str, ModelReport], given: str | None, wait: float
) -> RouterModel:
    """The model to serve, or ValueError saying in one line why there is none: the engines
    disagree, disagree with `given`, or (without `given`) none said within `wait` seconds."""
    said = {url: r.model_source for url, r in reports.items() if r.model_source is not None}
    sources = set(said.values())
    serving = ", ".join(f"{url} serves {source}" for url, source in sorted(said.items()))
    names = {reports[url].model_name for url in said}
    name = names.pop() if len(names) == 1 else None
    if given is not None:
        if sources - {given}:
            raise ValueError(f"--model is {given}, but {serving}: give the engines' model")
        return RouterModel(given, name)
    if not said:
        silent = ", ".join(u for u in urls if u not in reports) or "none listed"
        raise ValueError(
            f"no engine reported its model within {wait:.0f}s (not answering: {silent}); "
            "give --model"
        )
    if len(sources) > 1:
        raise ValueError(f"the engines serve different models ({serving}): give them one model")
    return RouterModel(sources.pop(), name)
