"""What crosses a process boundary, defined once and used by both ends.

The engine's GET /v1/kvpool report and the router's summary of it; the router's backends file,
which the operator writes; the router's calls to /internal/* and their replies; the HELLO that
opens a KV transfer; the engine roles; and the error codes every process writes and reads
(`ErrorCode`; core/errors.py builds the errors). Nothing but pydantic and the standard library:
the router, the canary and the operator image import this without torch.

Two kinds of model. A message (frozen, unknown keys refused) is written and read by kvfence at
both ends, so an unknown key is a typo or a version mismatch and fails loudly. A reading
(frozen, unknown keys ignored) is a /v1/kvpool report, or the part of one a reader uses: the
report gains fields over time and is read by tools of other versions (the operator, preflight,
the canary), so each reader requires only what it uses. The JSON field names are the wire's;
renaming one breaks those readers.
"""

import hashlib
import json
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ErrorCode(StrEnum):
    """The `code` of an error body, and of an error one kvfence process reports to another
    (a decode stream's `WireError`, a KV transfer's refusal)."""

    # the request
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"  # the body did not arrive within the deadline
    NOT_FOUND = "not_found"  # no such route
    HTTP_ERROR = "http_error"  # any other HTTP-level refusal (405, ...)
    # who asks
    INVALID_API_KEY = "invalid_api_key"
    UNAUTHORIZED = "unauthorized"  # no internal token, or a wrong one
    FORBIDDEN = "forbidden"
    # limits: retry later
    TENANT_LIMIT = "tenant_limit"
    TENANT_POOL_SHARE = "tenant_pool_share"
    OVERLOADED = "overloaded"
    NOT_READY = "not_ready"
    # failures inside kvfence
    INTERNAL_ERROR = "internal_error"
    KV_ISOLATION_VIOLATION = "kv_isolation_violation"
    # the router and its backends
    BACKEND_UNREACHABLE = "backend_unreachable"
    BAD_GATEWAY = "bad_gateway"
    STALE_BACKENDS = "stale_backends"
    INVALID_BACKENDS = "invalid_backends"
    # the internal API (decode's reservations)
    WRONG_ROLE = "wrong_role"
    UNKNOWN_REQUEST = "unknown_request"
    RESERVATION_EXPIRED = "reservation_expired"
    HANDLE_MISMATCH = "handle_mismatch"
    DUPLICATE_TRANSFER = "duplicate_transfer"
    # the KV transfer (disagg/transfer.py's TransferError, the receiver's refusals)
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_INCOMPLETE = "transfer_incomplete"
    TIMEOUT = "timeout"
    BAD_FRAME = "bad_frame"
    COUNT_MISMATCH = "count_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    CHECKSUM_SETTING = "checksum_setting"
    CHECKSUM_FAILED = "checksum_failed"
    TOO_MANY_CONNECTIONS = "too_many_connections"


TOKEN_HEADER = "X-Kvfence-Internal-Token"  # the shared internal token on /internal/* calls
# The canary's termination message: its one-line summary, then, after a finding, this prefix
# and the backend URLs whose isolation counters rose during the run (the operator quarantines
# the pods they are: spec.canary.onFailure Quarantine).
IMPLICATED_BACKENDS = "implicated backends:"

Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Port = Annotated[int, Field(ge=1, le=65535)]
REQUEST_ID_CHARS = "A-Za-z0-9_.:-"  # a regex class; the router's ids start with the tenant
REQUEST_ID_MAX = 128
RequestId = Annotated[str, Field(pattern=rf"^[{REQUEST_ID_CHARS}]{{1,{REQUEST_ID_MAX}}}$")]
# A tenant name starts each of its request ids ("TENANT-" and 32 hex digits): the keys file's
# names (router/keys.py) and the tenant the router names on the internal API.
TENANT_MAX = REQUEST_ID_MAX - 33
TenantName = Annotated[str, Field(pattern=rf"^[{REQUEST_ID_CHARS}]{{1,{TENANT_MAX}}}$")]
DEFAULT_TENANT = "default"  # without API keys every request is this tenant's
# What torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Reading(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Role(StrEnum):
    """What `kvfence serve --role` runs. Not the operator's crd.types.Role, which names the
    parts of an InferenceDeployment (prefill, decode, router, canary): the router and the
    canary are no engines, and the operator never runs a combined one."""

    COMBINED = "combined"
    PREFILL = "prefill"
    DECODE = "decode"


def _check_whole_pages(pool_tokens: int, num_pages: int, page_size: int) -> None:
    if pool_tokens != num_pages * page_size:
        raise ValueError(
            f"pool_tokens {pool_tokens} != num_pages {num_pages} x page_size {page_size}"
        )


# --- GET /v1/kvpool of an engine ---------------------------------------------------------


class KvPoolReport(_Reading):
    """An engine's KV pool as it really allocated it, and which isolation defences are on.
    The engine writes all of it and the router passes it on whole."""

    role: Role
    revision: str
    pool_tokens: Count
    page_size: Positive
    num_pages: Count
    free_pages: Count
    kv_bytes_per_token: Positive
    kv_dtype: str
    weight_dtype: str
    # how --weight-dtype auto chose it, with what it measured (core/weight_choice.py); None
    # where nothing was chosen (an explicit dtype, or one path only) or from an older engine
    weight_choice: str | None = None
    context_length_requested: Positive
    context_length_effective: Count
    context_policy: str
    model_max_positions: Positive
    tag_check: bool
    kv_checksum: bool  # on this engine's transfers; False in the combined role (none there)
    transfer_port: Annotated[int, Field(ge=0, le=65535)] | None  # decode role only
    deferred_release: bool
    scrub_on_free: bool
    unsafe_faults: list[str]
    # What the engine serves: the model id it answers to (GET /v1/models) and the source it
    # was loaded from (--model). None from engines older than these fields.
    model_name: str | None = None
    model_source: str | None = None
    # the tenant-scoped prefix cache (docs/isolation.md); defaults: an older engine's report
    prefix_cache: bool = False
    cached_pages: Count = 0
    # the cache's partition, not in pool_tokens or num_pages (no request's pages are in it)
    prefix_cache_pages: Count = 0
    # the ranks the model is split over (--tensor-parallel-size); each rank's pool has
    # num_pages pages of its KV heads, kv_bytes_per_token its largest share (core/build.py)
    tensor_parallel_size: Positive = 1

    @model_validator(mode="after")
    def _pool_is_whole_pages(self) -> "KvPoolReport":
        _check_whole_pages(self.pool_tokens, self.num_pages, self.page_size)
        return self


# --- GET /v1/load of an engine -------------------------------------------------------------


Seconds = Annotated[float, Field(ge=0)]


class LoadReport(_Reading):
    """An engine's load now, and its latencies over the last minute: the signals an autoscaler
    scales prefill and decode on (the same figures are Prometheus metrics). At most a quarter
    of a second old: the engine thread takes it between steps."""

    role: Role
    revision: str
    waiting_requests: Count
    # prompt tokens still to compute: of waiting requests and of those being prefilled
    queued_prompt_tokens: Count
    running_sequences: Count
    pages_used: Count
    pages_total: Positive
    # p90 over the last window_seconds; None: no sample in it
    time_to_first_token_p90_seconds: Seconds | None
    inter_token_latency_p90_seconds: Seconds | None
    window_seconds: Seconds

    @property
    def pool_utilization(self) -> float:
        return self.pages_used / self.pages_total


class PoolSize(_Reading):
    """The numbers that bound a request, which every reader of a report needs."""

    pool_tokens: Count
    page_size: Positive
    context_length_effective: Count
    # Whether this engine reuses a tenant's cached prompt pages: a tenant may know, since its
    # own hits show in its usage and timing. False from engines older than the field.
    prefix_cache: bool = False


class EnginePoolSize(PoolSize):
    """The canary's reading of an engine it targets directly."""

    role: Role


class PoolGateReport(_Reading):
    """The part of a report the operator trusts to open a pod's kv-pool readiness gate (in
    the report's order: the first field that is wrong is the one the pod's gate names)."""

    role: Role
    revision: str
    pool_tokens: Count
    page_size: Positive
    num_pages: Count
    context_length_effective: Count
    tag_check: bool
    deferred_release: bool
    unsafe_faults: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pool_is_whole_pages(self) -> "PoolGateReport":
        _check_whole_pages(self.pool_tokens, self.num_pages, self.page_size)
        return self


class ModelReport(_Reading):
    """The router's reading of an engine's report at start: which model it serves."""

    model_name: str | None = None
    model_source: str | None = None


class ProgressReport(_Reading):
    """Long work under way: `done` of `total` units or named steps (tools/progress.Progress)."""

    label: str  # what is being done, e.g. "converting model.gguf"
    done: Count
    total: Positive
    unit: str  # e.g. "tensor"
    line: str  # the same in words: "converting model.gguf: 136/272 tensors"
    # named steps: the one under way, `done` its number ("saving the converted weights");
    # empty for counted units
    step: str = ""
    # the work this is part of, itself a report (a GGUF's conversion is within a load step)
    within: "ProgressReport | None" = None


class EngineReadiness(_Reading):
    """GET /readyz of an engine: 200 "ready"; 503 "loading", with the work under way when it
    can say, or "failed", with why."""

    status: Literal["ready", "loading", "failed"]
    error: str | None = None
    progress: ProgressReport | None = None


class PoolPlanReport(PoolSize):
    """`kvfence preflight --target`: the live pool next to its estimate."""

    num_pages: Count
    kv_bytes_per_token: Positive
    role: Role | None = None
    revision: str | None = None
    kv_dtype: str | None = None
    free_pages: Count | None = None


# --- GET /v1/kvpool of the router --------------------------------------------------------


class BackendReport(_Message):
    role: Role
    url: str
    report: KvPoolReport


class BackendUnread(_Message):
    role: Role
    url: str
    error: str


class _PoolBounds(_Message):
    """The numbers that bound a request whichever instances it lands on: the smallest pool
    and context, defences on everywhere."""

    role: Literal["router"] = "router"
    context_length_served: Positive
    context_length_effective: Count
    pool_tokens: Count
    page_size: Positive
    tag_check: bool
    kv_checksum: bool
    deferred_release: bool


class RouterPoolSummary(_PoolBounds):
    """The operator's view (with the internal token): each backend's whole report, with its
    URL, transfer port and free pages, or why there is none."""

    backends: list[BackendReport | BackendUnread]


class BackendPool(_Message):
    """One backend as a tenant sees it: its role and pool size, not where it is or how full."""

    role: Role
    report: PoolSize | None = None
    error: str | None = None


class TenantPoolSummary(_PoolBounds):
    """A tenant's view: the same bounds and one entry per backend, in the same order."""

    backends: list[BackendPool]


class BackendPoolSize(_Reading):
    """The canary's reading of one backend in the router's summary (either view)."""

    role: Role
    url: str | None = None  # the operator's view only
    report: PoolSize | None = None
    error: str | None = None


class RouterPoolSizes(_Reading):
    """The canary's reading of the router's summary: every engine behind it."""

    backends: list[BackendPoolSize]


# --- the router's backends file, written by the operator ----------------------------------


class ServedModel(_Message):
    source: str
    name: str | None = None


class BackendsFile(_Message):
    """The engines the router may send to, and the context it serves (under LowerContext,
    what every pool holds). The operator rewrites it as pods pass or fail the pool check, in
    the router's ConfigMap and by PUT /internal/v1/backends; a hand-written file may give only
    the URLs.

    `version` orders what the operator wrote: the router keeps the newest set it was given,
    so a ConfigMap volume the kubelet refreshes late never rolls back a newer push. 0 (a
    hand-written or older file) is older than any push."""

    model_config = ConfigDict(populate_by_name=True)

    version: Count = 0
    revision: str | None = None
    model: ServedModel | None = None
    context_length: Positive | None = Field(None, alias="contextLength")
    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)

    def file_text(self) -> str:
        data = self.model_dump(mode="json", by_alias=True)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def digest(self) -> str:
        """sha256 of file_text(): equal digests, equal sets."""
        return hashlib.sha256(self.file_text().encode()).hexdigest()


BackendsSource = Literal["flags", "file", "push"]


class BackendsInForce(_Message):
    """The router's GET and PUT /internal/v1/backends: the set it sends to now, where it came
    from (--prefill/--decode, the backends file, a push) and the sha256 of its file text (what
    the operator compares with the set it means)."""

    source: BackendsSource
    digest: str
    backends: BackendsFile


# --- /internal/*: the router calls decode and prefill --------------------------------------


class Sampling(_Message):
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: Seed | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False


class ReserveBody(_Message):
    """POST /internal/reserve (decode): admit the prompt and allocate its pages now."""

    request_id: RequestId
    prompt_ids: list[int] = Field(min_length=1)
    max_tokens: Positive | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    tenant: TenantName = DEFAULT_TENANT  # whose share of decode's pool it reserves


class TransferHandle(_Message):
    """Where and into which pages prefill writes a reserved prompt's KV."""

    request_id: RequestId
    seq_id: int
    pages: list[int]
    tags: list[int]
    reserved_tokens: int
    transfer_port: Port
    transfer_host: str = "127.0.0.1"


class ReserveReply(TransferHandle):
    """The handle, and how many tokens decode will generate at most."""

    max_tokens: Positive


class PrefillBody(_Message):
    """POST /internal/prefill: compute the prompt's KV and first token, stream the KV."""

    handle: TransferHandle
    prompt_ids: list[int] = Field(min_length=1)
    sampling: Sampling = Field(default_factory=Sampling)
    tenant: TenantName = DEFAULT_TENANT  # whose share of prefill's pool it reserves
    # The client's cache_salt, passed on as sent: it narrows prefix-cache sharing within the
    # tenant above (which the router authenticated); it can never name another tenant.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)


class FirstToken(_Message):
    """A sampled token with its logprob and the top alternatives (when asked for)."""

    token_id: Count
    logprob: float = 0.0
    top: list[tuple[int, float]] = Field(default_factory=list)


class PrefillReply(_Message):
    first: FirstToken
    prompt_tokens: int
    kv_tokens: int
    # Prompt tokens prefill read from its prefix cache (the tenant's own pages) instead of
    # computing: the client's usage.prompt_tokens_details.cached_tokens. 0 from older engines.
    cached_tokens: Count = 0


class DecodeBody(_Message):
    """POST /internal/decode: continue from prefill's first token once the KV is verified;
    the reply is a stream of DeltaLine, one JSON object per line."""

    request_id: RequestId
    first: FirstToken


class AbortBody(_Message):
    request_id: RequestId


class AbortReply(_Message):
    aborted: bool


class TenantRequests(_Reading):
    """GET /internal/v1/tenant-requests?since=&until= of a router (router/tenant_activity.py):
    the requests it answered per tenant in [since, until) (unix seconds, whole minutes), and
    the earliest time it knows of (its start, or the end of its retention)."""

    since: float
    until: float
    covered_since: float
    tenants: dict[str, int]


class UnsafeFaultSwitch(_Message):
    """POST /internal/unsafe-fault: a fault of core/faults.py::RUNTIME to switch on in a
    running engine (test-only)."""

    fault: str = Field(max_length=64)


class UnsafeFaultsOn(_Message):
    unsafe_faults: list[str]  # every fault now on in the engine


class WireError(_Message):
    """An engine error in a delta stream: the HTTP status and the OpenAI error fields."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: ErrorCode


class DeltaLine(_Message):
    token_ids: list[int]
    logprobs: list[FirstToken]
    finish_reason: str | None = None
    error: WireError | None = None


# --- the KV transfer's opening frame (disagg/transfer.py has the framing) -----------------


class TransferLayout(_Message):
    """The shape of a page; both ends must agree or the bytes mean different things."""

    layers: Positive
    page_size: Positive
    kv_heads: Positive
    head_dim: Positive
    dtype: str


class TransferHello(_Message):
    request_id: str
    seq_id: int
    pages: list[int]
    tags: list[int]
    token: str | None = None
    layout: TransferLayout
    checksum: bool = True  # whether pages carry checksums; both ends must agree
