"""OpenAI request bodies (the subset kvfence serves), validated with pydantic.

Shared by the engine and the router, so both refuse the same bodies with the same 400. Every
field has the range the engine's arithmetic supports:

- `temperature` in [0, 2]; below `MIN_TEMPERATURE` (1e-5; 0 included) sampling is greedy: at
  that temperature float32 softmax already gives every token more than 0.001 below the top
  logit a probability of exactly 0 (kvfence_engine.core.request.MIN_TEMPERATURE says why).
- `seed`: a signed or unsigned 64-bit integer, what torch.Generator takes.
- text (prompt, chat content, stop strings, model, user) must be valid Unicode: a lone UTF-16
  surrogate such as "\\ud800" (JSON allows the escape) is refused, since no tokenizer or
  UTF-8 output can carry it.
- lists of objects or strings (messages, content parts, prompts, stop strings) hold at most
  `MAX_ITEMS`: pydantic refuses a longer one at its first item past the bound, so a body of
  200,000 messages costs one error, not 200,000 validations (issue 33, finding 2).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from kvfence_engine.contracts import Sampling, Seed

# OpenAI's own bound on `messages` ("array too long ... maximum length 2048").
MAX_ITEMS = 2048
Bounded = Field(max_length=MAX_ITEMS)


def valid_unicode(value: Any) -> Any:
    """Refuse a string, or a list of strings, holding a lone surrogate; pass anything else."""
    items = value if isinstance(value, list) else [value]
    for index, text in enumerate(items):
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"item {index}, " if isinstance(value, list) else ""
            raise ValueError(
                f"text must be valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at "
                f"{where}character {exc.start}"
            ) from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # < MIN_TEMPERATURE: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (vLLM-style); 0 = off
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Bounded] | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False  # extension, for benchmarks
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    user: str | None = None
    # Extension (vLLM's name): narrows prefix-cache sharing to requests with the same salt,
    # within the tenant; it can never widen it (docs/isolation.md, invariant 11).
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    _unicode = field_validator("model", "stop", "user", "cache_salt")(valid_unicode)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


def _prompt_kind(value: Any) -> str | None:
    """Which form a prompt takes, by its first item: a list is validated as ids or as strings,
    never as both (a failed branch of a plain union costs an error per item)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    return "list[str]" if value and isinstance(value[0], str) else "list[int]"


Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[str], Bounded, Tag("list[str]")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a valid string, or Input should be a valid list",
    ),
]


class CompletionRequest(_Common):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None

    _prompt_unicode = field_validator("prompt")(valid_unicode)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no logprobs; 0: the chosen token's; N: also the top N."""
        return self.logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str  # checked by ChatMessage, so an error names the message's content


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Bounded] | None = ""

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: str | list[TextPart] | None) -> str | list[TextPart] | None:
        valid_unicode([part.text for part in content] if isinstance(content, list) else content)
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """Chat asks with a flag, and a count of top tokens beside it."""
        return (self.top_logprobs or 0) if self.logprobs else None


def sampling_of(body: CompletionRequest | ChatCompletionRequest) -> Sampling:
    """What a body asks of the sampler: the one mapping, for the combined engine and for the
    router, which sends it to prefill and decode."""
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        logprobs=body.logprob_count(),
        ignore_eos=body.ignore_eos,
    )


# --- what the API answers on error (for the OpenAPI schema; errors.EngineError.body writes it)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail
