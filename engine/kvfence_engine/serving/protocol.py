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
- no field is ignored (issue 34, item 6): a field no model declares (`"max_tokns": 2`, a
  typo that would generate to the end of the context) is refused as OpenAI refuses it, "Unrecognized
  request argument supplied"; a field OpenAI defines and kvfence does not implement (`tools`,
  `response_format`, ...) is declared `Unimplemented`, so that its refusal says what it asks
  for. Such a field sent as null (OpenAI's "not given", what SDKs that write every field
  send), or as the value that asks for what kvfence does anyway (`store: false`), is served.
  tests/unit/engine/test_hostile_inputs.py checks that every field the installed `openai`
  client can send is declared.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

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


@dataclass(frozen=True, slots=True)
class Unimplemented:
    """Field metadata: OpenAI defines this field and kvfence does not implement `what` it asks
    for. Refused by name unless it is one of `served` (null, and whatever value asks for what
    kvfence does anyway); the OpenAPI schema says so in the field's description."""

    what: str
    served: tuple[object, ...] = (None,)

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.with_info_before_validator_function(self._refuse, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(schema) | {"description": f"not implemented by kvfence: {self.what}"}

    def _refuse(self, value: Any, info: ValidationInfo) -> Any:
        # `is` for False and None, so that 0 does not pass for false nor false for 0
        if any(value is ok or (type(value) is type(ok) and value == ok) for ok in self.served):
            return value
        shown = " or ".join("null" if ok is None else str(ok).lower() for ok in self.served)
        raise ValueError(
            f"kvfence does not implement {self.what}: leave `{info.field_name}` out (or send "
            f"{shown})"
        )


class _Strict(BaseModel):
    """A request body or part of one: a field it does not declare is refused."""

    model_config = ConfigDict(extra="forbid")


TOOLS = "tool calling"
AUDIO = "audio input or output"


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Annotated[
        Literal[False] | None, Unimplemented("stream obfuscation", (None, False))
    ] = None


class _Common(_Strict):
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
    logit_bias: Annotated[None, Unimplemented("logit bias")] = None

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
    best_of: Annotated[
        Literal[1] | None,
        Unimplemented("the best of several completions (best_of over 1)", (None, 1)),
    ] = None

    _prompt_unicode = field_validator("prompt")(valid_unicode)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no logprobs; 0: the chosen token's; N: also the top N."""
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str  # checked by ChatMessage, so an error names the message's content
    prompt_cache_breakpoint: Annotated[None, Unimplemented("OpenAI's prompt cache controls")] = None


def _content_kind(value: Any) -> str | None:
    """Which form a message's content takes: validated as that form only, so that an error in
    a part (an unknown field) is not hidden behind "should be a valid string"."""
    if value is None:
        return "none"
    return "str" if isinstance(value, str) else "list" if isinstance(value, list) else None


Content = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[TextPart], Bounded, Tag("list")]
    | Annotated[None, Tag("none")],
    Discriminator(
        _content_kind,
        custom_error_type="content_type",
        custom_error_message="Input should be a valid string, a list of text parts, or null",
    ),
]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = ""
    name: Annotated[None, Unimplemented("participant names (the chat template has none)")] = None
    refusal: Annotated[None, Unimplemented("refusals")] = None
    audio: Annotated[None, Unimplemented(AUDIO)] = None
    tool_calls: Annotated[None, Unimplemented(TOOLS)] = None
    tool_call_id: Annotated[None, Unimplemented(TOOLS)] = None
    function_call: Annotated[None, Unimplemented(TOOLS)] = None

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
    tools: Annotated[None, Unimplemented(TOOLS)] = None
    tool_choice: Annotated[None, Unimplemented(TOOLS)] = None
    parallel_tool_calls: Annotated[None, Unimplemented(TOOLS)] = None
    functions: Annotated[None, Unimplemented(TOOLS)] = None
    function_call: Annotated[None, Unimplemented(TOOLS)] = None
    response_format: Annotated[
        None, Unimplemented("structured output (JSON mode, JSON schema)")
    ] = None
    audio: Annotated[None, Unimplemented(AUDIO)] = None
    modalities: Annotated[None, Unimplemented("output modalities (text is the only one)")] = None
    prediction: Annotated[None, Unimplemented("predicted outputs")] = None
    web_search_options: Annotated[None, Unimplemented("web search")] = None
    reasoning_effort: Annotated[None, Unimplemented("reasoning effort")] = None
    verbosity: Annotated[None, Unimplemented("verbosity")] = None
    store: Annotated[Literal[False] | None, Unimplemented("stored completions", (None, False))] = (
        None
    )
    metadata: Annotated[None, Unimplemented("stored completions' metadata")] = None
    service_tier: Annotated[None, Unimplemented("service tiers")] = None
    moderation: Annotated[None, Unimplemented("moderation")] = None
    safety_identifier: Annotated[None, Unimplemented("safety identifiers")] = None
    prompt_cache_key: Annotated[
        None, Unimplemented("OpenAI's prompt cache controls (kvfence's is cache_salt)")
    ] = None
    prompt_cache_retention: Annotated[None, Unimplemented("OpenAI's prompt cache controls")] = None
    prompt_cache_options: Annotated[None, Unimplemented("OpenAI's prompt cache controls")] = None

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
