"""The tokenizer of a router that has no model files (`kvfence router --tokenizer-from-engines`):
read from one of its engines (GET /internal/v1/tokenizer, internal token), which must serve
the source the router was given, if it was given one. The tokenizer is then the engines' own by
construction. A router on a cluster so mounts no model volume, which a ReadWriteOnce claim
could not attach on a second node.

Why no engine gave it is told to callers (/readyz, a 503) by the engine's place in the list,
never its address (issue 33, finding 6); the addresses go to the router's log."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvfence_engine.loading.tokenizer import Tokenizer, tokenizer_of_data

TOKENIZER_PATH = "/internal/v1/tokenizer"


@dataclass(frozen=True, slots=True)
class EngineTokenizer:
    name: str | None  # the model's name as the engine reports it
    tokenizer: Tokenizer


async def fetch_tokenizer(
    client: httpx.AsyncClient, urls: Sequence[str], headers: dict[str, str], source: str | None
) -> EngineTokenizer:
    """The tokenizer of the first engine in `urls` that serves `source` (None: any source);
    ValueError saying in one line, without an address, why none could give it."""
    if not urls:
        raise ValueError("no engine listed yet to read the tokenizer from")
    problems: list[str] = []
    for number, url in enumerate(urls, 1):
        engine = f"engine {number} of {len(urls)}"
        try:
            response = await client.get(url + TOKENIZER_PATH, headers=headers, timeout=30.0)
        except httpx.HTTPError as exc:
            problems.append(f"{engine}: {type(exc).__name__}")
            continue
        if response.status_code != 200:
            problems.append(f"{engine}: HTTP {response.status_code}")
            continue
        try:
            body: dict[str, Any] = response.json()
            served = body["model_source"]
            if source is not None and served != source:
                problems.append(f"{engine} serves {served}, not {source}")
                continue
            return EngineTokenizer(body.get("model_name"), tokenizer_of_data(body["tokenizer"]))
        except Exception as exc:  # tokenizers raises a plain Exception for a bad model
            problems.append(f"{engine}: unreadable tokenizer ({type(exc).__name__})")
    raise ValueError("no engine gave the tokenizer: " + "; ".join(problems))
