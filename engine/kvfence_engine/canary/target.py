"""The canary's only way to the target: HTTP with the tenants' keys, a request budget, and
streamed completions recorded as Answers (first-token time, tokens, logprobs, usage)."""

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from aiolimiter import AsyncLimiter

from kvfence_engine.canary.config import CanaryConfig
from kvfence_engine.canary.observations import TENANT_A, TENANT_B, Answer
from kvfence_engine.contracts import TOKEN_HEADER


class CannotRun(Exception):
    """The canary could not do its job (target down, key refused, out of time or requests):
    no verdict about isolation, exit code 2."""


def describe_http_error(exc: httpx.HTTPError) -> str:
    detail = str(exc).strip()
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def lost_target(request: str, probe: str, context: str, exc: httpx.HTTPError) -> CannotRun:
    return CannotRun(
        f"lost the target during {request} ({probe}, {context}): {describe_http_error(exc)}"
    )


class TargetClient:
    def __init__(self, config: CanaryConfig) -> None:
        self.base = config.target.rstrip("/")
        self.keys = {TENANT_A: config.tenant_a_key, TENANT_B: config.tenant_b_key}
        self.internal_token = config.internal_token
        self.max_requests = config.max_requests
        self.requests = 0
        # --rate: on average `rate` requests a second, with one pollution burst at once (A's
        # burst must land while B decodes, or the run cannot see a page B lost to it)
        burst = config.max_pollution_requests
        self.limiter = None if config.rate is None else AsyncLimiter(burst, burst / config.rate)
        self.model = "default"  # set from /v1/models at discovery
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    async def __aenter__(self) -> "TargetClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def _spend(self) -> None:
        if self.limiter is not None:
            await self.limiter.acquire()
        self.requests += 1
        if self.requests > self.max_requests:
            raise CannotRun(
                f"the budget of {self.max_requests} requests is spent; the plan should need far "
                "fewer (is the pool much larger than the context?)"
            )

    def _auth(self, tenant: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"} if tenant else {}

    async def get(self, path: str, tenant: str | None = None) -> httpx.Response:
        await self._spend()
        headers = self._auth(tenant)
        if path == "/metrics" and self.internal_token:
            headers[TOKEN_HEADER] = self.internal_token
        try:
            return await self.http.get(self.base + path, headers=headers)
        except httpx.HTTPError as exc:
            raise CannotRun(
                f"cannot reach the target at {self.base}{path}: {describe_http_error(exc)}"
            ) from exc

    async def complete(
        self,
        tenant: str,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        probe: str,
        context: str,
        flavour: str | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> Answer:
        """One greedy completion, streamed so the first token's arrival can be timed."""
        body = {
            "model": self.model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = Answer(
            tenant=tenant,
            probe=probe,
            context=context,
            prompt_tokens=None if isinstance(prompt, str) else len(prompt),
            status=0,
            seconds=0.0,
            flavour=flavour,
        )
        await self._spend()
        start = time.monotonic()

        def first_token() -> None:
            answer.ttft = time.monotonic() - start
            if on_first_token is not None:
                on_first_token()

        try:
            async with self.http.stream(
                "POST", self.base + "/v1/completions", json=body, headers=self._auth(tenant)
            ) as r:
                answer.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    _read_error(answer, r)
                elif r.headers.get("content-type", "").startswith("application/json"):
                    await r.aread()  # a target that ignored stream=True: one whole completion
                    _read_chunk(answer, r.json(), first_token)
                else:
                    await _read_stream(answer, r, first_token)
        except httpx.HTTPError as exc:
            raise lost_target("a completion", probe, context, exc) from exc
        answer.seconds = time.monotonic() - start
        return answer

    async def chat(
        self, tenant: str, content: str, *, probe: str, context: str, repeats: int | None
    ) -> Answer:
        """One greedy chat completion of one user message, a token long, whole: what is
        recorded is its status and usage."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
            "temperature": 0,
        }
        answer = Answer(tenant, probe, context, None, status=0, seconds=0.0, repeats=repeats)
        await self._spend()
        start = time.monotonic()
        try:
            r = await self.http.post(
                self.base + "/v1/chat/completions", json=body, headers=self._auth(tenant)
            )
        except httpx.HTTPError as exc:
            raise lost_target("a chat completion", probe, context, exc) from exc
        answer.seconds = time.monotonic() - start
        answer.status = r.status_code
        if r.status_code != 200:
            _read_error(answer, r)
            return answer
        try:
            whole = r.json()
        except ValueError:
            whole = None
        if isinstance(whole, dict):
            _read_usage(answer, whole)
        return answer


async def _events(response: httpx.Response) -> AsyncIterator[str]:
    """Server-sent events' data fields (multi-line data joined, comments skipped)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


async def _read_stream(answer: Answer, r: httpx.Response, first_token: Callable[[], None]) -> None:
    async for data in _events(r):
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            _stream_failed(answer, "malformed_stream", f"not JSON: {data[:80]!r}")
            return
        if isinstance(chunk, dict) and "error" in chunk:
            error = chunk.get("error") or {}
            _stream_failed(answer, str(error.get("code")), str(error.get("message")))
            return
        _read_chunk(answer, chunk, first_token)


def _stream_failed(answer: Answer, code: str, message: str) -> None:
    answer.stream_error = True
    answer.error_code = code
    answer.error_message = message


def _read_usage(answer: Answer, body: dict[str, Any]) -> None:
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        answer.usage_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            answer.usage_cached_tokens = details["cached_tokens"]


def _read_chunk(answer: Answer, chunk: Any, first_token: Callable[[], None]) -> None:
    if not isinstance(chunk, dict):
        return
    _read_usage(answer, chunk)
    for choice in chunk.get("choices") or ():
        logprobs = choice.get("logprobs") or {}
        tokens = [str(t) for t in logprobs.get("tokens") or ()]
        text = str(choice.get("text") or "")
        if (tokens or text) and answer.ttft is None:
            first_token()
        answer.text += text
        answer.tokens += tokens
        answer.logprobs += [float(x) for x in logprobs.get("token_logprobs") or () if x is not None]
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason


def _read_error(answer: Answer, r: httpx.Response) -> None:
    try:
        error = r.json()["error"]
        answer.error_code = str(error.get("code"))
        answer.error_message = str(error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        answer.error_code = "unparsed_error"
        answer.error_message = r.text[:200]
