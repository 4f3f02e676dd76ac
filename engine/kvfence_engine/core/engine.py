"""The engine: admission, then a step loop of schedule -> prepare -> check reads -> run ->
postprocess."""

import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from kvfence_engine.contracts import DEFAULT_TENANT, KvPoolReport, LoadReport, Role
from kvfence_engine.core import errors
from kvfence_engine.core.build import build_rank
from kvfence_engine.core.decoder import Decoder
from kvfence_engine.core.device import resolve_device
from kvfence_engine.core.device_decode import DeviceDecoder, unsupported
from kvfence_engine.core.errors import EngineError
from kvfence_engine.core.faults import EarlyRelease, Fault, Faults
from kvfence_engine.core.isolation import ReadCheck
from kvfence_engine.core.leader import Leader
from kvfence_engine.core.metrics import EngineMetrics
from kvfence_engine.core.model_config import ModelConfig
from kvfence_engine.core.page_manager import PageManager
from kvfence_engine.core.pool_plan import (
    PREFIX_CACHE_IDLE_SECONDS,
    PREFIX_CACHE_SHARE,
    PREFIX_CACHE_TENANTS,
    ContextPolicy,
    PoolPlan,
    admission_limit,
    cache_partition,
    effective_context,
)
from kvfence_engine.core.prefix_cache import DECODE_HAS_NO_PREFIX_CACHE, PrefixKeys
from kvfence_engine.core.quantization import Int4Groups
from kvfence_engine.core.recent import RecentQuantile
from kvfence_engine.core.request import (
    Request,
    SamplingParams,
    TokenLogprob,
    is_terminal,
)
from kvfence_engine.core.runner import ModelRunner, PreparedStep, check_step
from kvfence_engine.core.sampler import sample
from kvfence_engine.core.scheduler import Scheduler
from kvfence_engine.core.tenants import TenantShares

if TYPE_CHECKING:
    from kvfence_engine.core.rank_orders import RankGroup

log = logging.getLogger(__name__)


LOAD_EVERY = 0.25  # seconds between the load figures the engine thread takes while busy


@dataclass(frozen=True, slots=True)
class Load:
    """The queues' figures the engine thread took last (LLMEngine._take_load)."""

    at: float
    waiting: int
    queued_prompt_tokens: int
    running: int


@dataclass(slots=True)
class EngineArgs:
    role: str = "combined"
    page_size: int = 16
    kv_cache_memory: int | None = None
    memory_fraction: float | None = None
    context_length: int | None = None
    context_policy: ContextPolicy = ContextPolicy.REFUSE
    device: str = "cpu"
    weight_dtype: str | None = None  # None = auto (quantization.resolve_precision)
    # where auto keeps what it measured (core/choice_cache); None: measure at every start
    weight_choice_cache: str | None = None
    kv_cache_dtype: str | None = None  # None: the compute dtype; else float32|float16|bfloat16
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096
    max_waiting: int = 512
    scrub_on_free: bool = False
    revision: str = "dev"
    transfer_port: int = 0  # decode role: where prefill streams KV to
    kv_checksum: bool = True  # per-page XXH3-64 checksum on KV transfers (both ends must agree)
    reserve_timeout: float = 60.0  # decode role: a reservation whose KV never starts expires
    max_pool_share_per_tenant: float = 1.0  # of the pool, reserved by one tenant; 1.0: no cap
    # Reuse the KV of a prompt's leading full pages across requests of one tenant (combined
    # and prefill roles: decode computes no prompt). Off by default: docs/isolation.md, #11.
    prefix_cache: bool = False
    prefix_cache_secret_file: str | None = None  # None: a random secret for this process
    # The cache's partition of the pool (core/page_book): this share of the pages, in slots
    # of share / tenants each, a page idle this long leaving it.
    prefix_cache_share: float = PREFIX_CACHE_SHARE
    prefix_cache_tenants: int | None = None  # None: PREFIX_CACHE_TENANTS, 1 when combined
    prefix_cache_idle_seconds: float = PREFIX_CACHE_IDLE_SECONDS
    # Decode as device kernels (core/device_decode); None: on CUDA. On CPU tensors they run
    # only under Triton's interpreter (TRITON_INTERPRET=1), which is for tests.
    device_decode: bool | None = None
    # Those kernels without capturing CUDA graphs (vLLM's --enforce-eager)
    enforce_eager: bool = False
    faults: Faults = field(default_factory=Faults)


def cache_tenants_of(role: Role) -> int:
    """--prefix-cache-tenants unless given: the combined role serves one tenant ('default')."""
    return 1 if role is Role.COMBINED else PREFIX_CACHE_TENANTS


class EosTokens(Protocol):
    """What the engine asks of a tokenizer: the tokens that end a sequence."""

    @property
    def eos_ids(self) -> frozenset[int]: ...


TokenizerT_co = TypeVar("TokenizerT_co", bound=EosTokens, covariant=True)
TokenizerT = TypeVar("TokenizerT", bound=EosTokens)


class ModelFiles(Protocol[TokenizerT_co]):
    """What an engine is built from: a model as loading/loader.py::load_model gives it (the
    core knows no loader). The engine takes the weights (and empties their dicts)."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def config(self) -> ModelConfig: ...

    @property
    def weights(self) -> dict[str, torch.Tensor]: ...

    @property
    def int4(self) -> dict[str, Int4Groups]: ...

    @property
    def tokenizer(self) -> TokenizerT_co: ...


class LLMEngine(Generic[TokenizerT]):
    def __init__(
        self,
        loaded: ModelFiles[TokenizerT],
        args: EngineArgs,
        metrics: EngineMetrics | None = None,
        group: "RankGroup | None" = None,
    ) -> None:
        """group: this engine is rank 0 of a tensor-parallel group, whose other ranks follow
        its steps (parallel/follower.py)."""
        self.args = args
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer: TokenizerT = loaded.tokenizer
        self.faults = args.faults
        self.metrics = metrics or EngineMetrics()
        self.device = resolve_device(args.device)
        self._device_decode = (
            args.device_decode if args.device_decode is not None else self.device.type == "cuda"
        )
        self.group = group
        if group is not None and self._device_decode:
            log.warning("decode runs on the host path: tensor parallelism has no device decode")
            self._device_decode = False
        built = build_rank(loaded.config, loaded.weights, loaded.int4, args, self.device, group)
        model, self.precision, requested = built.model, built.precision, built.context
        self.plan: PoolPlan = built.plan
        kv_dtype = built.kv_dtype
        # the early-release fault's hook, which the page book takes free pages through
        self.early_release = EarlyRelease() if Fault.EARLY_RELEASE in self.faults else None
        # core/device_decode's failed rows write a scratch page
        kv = built.kv_cache(loaded.config, self.device, scratch_page=self._device_decode)
        self.prefix = self._prefix_keys(args)
        self.pages = PageManager(
            kv,
            scrub_on_free=args.scrub_on_free,
            early_release=self.early_release,
            shared_cache_eviction=Fault.SHARED_CACHE_EVICTION in self.faults,
            cache=None
            if self.prefix is None
            else cache_partition(
                self.plan.num_pages,
                args.prefix_cache_share,
                args.prefix_cache_tenants or cache_tenants_of(Role(args.role)),
                args.prefix_cache_idle_seconds,
            ),
        )
        self.kv_dtype = str(kv_dtype).removeprefix("torch.")
        self.context_requested = requested
        self.context_effective = effective_context(
            requested, self.pages.pool_tokens, args.page_size, args.context_policy
        )
        if self.context_effective < 1:
            raise ValueError(
                f"the KV pool ({self.pages.pool_tokens} tokens) holds less than one page of context"
            )
        self.limit = admission_limit(self.context_effective, self.pages.pool_tokens)
        self.shares = TenantShares(self.pages.num_pages, args.max_pool_share_per_tenant)
        self.scheduler = Scheduler(
            self.pages,
            max_num_seqs=args.max_num_seqs,
            max_batched_tokens=args.max_batched_tokens,
            shares=self.shares,
        )
        self.runner = ModelRunner(model, self.pages, self.device, self.faults)
        self.device_decoder = self._device_decoder(model)
        # the other ranks' side of each step (core/leader.py), with tensor parallelism
        self.leader = None if group is None else Leader(group, self.pages, loaded.config)
        self._ids = itertools.count(1)
        # the load an autoscaler reads (load_report): the queues as of the last step, the
        # latencies of the last minute
        self._load = Load(0.0, 0, 0, 0)
        self.recent_ttft = RecentQuantile()
        self.recent_itl = RecentQuantile()
        m = self.metrics
        m.pool_tokens.set(self.pages.pool_tokens)
        m.pages_total.set(self.pages.num_pages)
        m.context_length.set(self.context_effective)
        m.pages_used.set_function(lambda: self.pages.num_used)
        m.watch_tenants(self.shares.by_tenant)

    def _device_decoder(self, model: torch.nn.Module) -> DeviceDecoder | None:
        """Decode as device kernels in CUDA graphs where the model and device allow it; the
        host path (core/runner, core/isolation) otherwise, and for every prefill."""
        assert isinstance(model, Decoder)
        if not self._device_decode:
            return None
        reason = unsupported(model.config)
        if reason is not None:
            log.warning("decode runs on the host path: %s", reason)
            return None
        started = time.perf_counter()
        try:
            decoder = DeviceDecoder(
                model,
                self.pages,
                max_seqs=self.args.max_num_seqs,
                # the most tokens one request holds (the reject-placeholder fault: the pool)
                table_tokens=self.pages.pool_tokens
                if Fault.REJECT_PLACEHOLDER in self.faults
                else self.limit,
                check=Fault.NO_TAG_CHECK not in self.faults,
                graphs=not self.args.enforce_eager,
            )
        except Exception:  # e.g. a Triton or graph-capture failure: the host path still serves
            log.exception(
                "decode on %s as device kernels failed to start; decode runs on the host path",
                self.device,
            )
            return None
        log.info(
            "decode on %s: %s for batch sizes %s (%.1fs)",
            self.device,
            "CUDA graphs" if decoder.graphs else "device kernels",
            decoder.buckets,
            time.perf_counter() - started,
        )
        return decoder

    @staticmethod
    def _prefix_keys(args: EngineArgs) -> PrefixKeys | None:
        if not args.prefix_cache:
            return None
        if Role(args.role) is Role.DECODE:
            log.warning(DECODE_HAS_NO_PREFIX_CACHE)
            return None
        scoped = Fault.CROSS_TENANT_PREFIX not in args.faults
        if args.prefix_cache_secret_file is not None:
            path = Path(args.prefix_cache_secret_file)
            return PrefixKeys.from_file(path, args.page_size, scope_by_tenant=scoped)
        return PrefixKeys.random(args.page_size, scope_by_tenant=scoped)

    # --- admission (any thread; allocates nothing) ---------------------------------------------

    def admit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        max_tokens: int | None,
        tenant: str = DEFAULT_TENANT,
        cache_salt: str | None = None,
    ) -> Request:
        """Build a sequence and decide whether it may run. A rejected sequence comes back
        terminal (finish_reason "error") and must not be scheduled; nothing was allocated."""
        params = params or SamplingParams(max_tokens=1)
        seq = Request(next(self._ids), list(prompt_ids), params, tenant=tenant)
        n = len(prompt_ids)
        error: EngineError | None = None
        if n == 0:
            error = errors.invalid_request("the prompt is empty", "prompt")
        elif min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            # checked here, for every role: a bad id would otherwise fail the whole batch
            error = errors.invalid_request(
                f"prompt token ids must be in [0, {self.config.vocab_size})", "prompt"
            )
        elif max_tokens is not None and max_tokens < 1:
            error = errors.invalid_request("max_tokens must be at least 1", "max_tokens")
        elif n > self.limit:
            what = "the served context" if self.limit == self.context_effective else "the KV pool"
            error = errors.context_length_exceeded(n, self.limit, what)
            if Fault.REJECT_PLACEHOLDER in self.faults and n <= self.pages.pool_tokens:
                # The incident: the rejection lands in a field is_terminal() does not read.
                seq.placeholder_rejection = error
                room = self.pages.pool_tokens - n + 1
                seq.params = _with_max_tokens(params, min(max_tokens or 16, room))
                return seq
        elif self.scheduler.num_waiting >= self.args.max_waiting:
            error = errors.overloaded(
                f"{self.scheduler.num_waiting} requests are already waiting; retry shortly"
            )
        if error is not None:
            seq.finish("error", error)
            self.metrics.rejected.labels(reason=error.code).inc()
            return seq
        # A sequence may hold at most `limit` KV slots: prompt + generated - 1.
        room = self.limit - n + 1
        seq.params = _with_max_tokens(params, min(max_tokens or room, room))
        error = self._refuse_over_share(seq, explicit_max_tokens=max_tokens is not None)
        if error is not None:
            seq.finish("error", error)
            self.metrics.rejected.labels(reason=error.code).inc()
            return seq
        if params.seed is not None or not params.greedy:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4))
            seq.generator = torch.Generator().manual_seed(seed)
            seq.seed = seed
        if self.prefix is not None:
            seq.cache_keys = self.prefix.page_keys(tenant, cache_salt, seq.prompt_ids)
        return seq

    def _refuse_over_share(self, seq: Request, *, explicit_max_tokens: bool) -> EngineError | None:
        """Whether the request's worst case fits its tenant's share of the pool (core/tenants).
        One that could never fit is a 400 (retrying would not help): a max_tokens left to the
        engine shrinks to fit instead. One that does not fit now, beside the tenant's other
        requests, is a 429."""
        if not self.shares.capped:
            return None
        cap_tokens = self.shares.cap_pages * self.pages.page_size
        n = len(seq.prompt_ids)
        if n > cap_tokens:
            return errors.invalid_request(
                f"the prompt has {n} tokens; one tenant may reserve at most {cap_tokens} "
                "(its share of the KV pool). Shorten the prompt.",
                "messages",
            )
        room = cap_tokens - n + 1
        if seq.params.max_tokens > room:
            if explicit_max_tokens:
                return errors.invalid_request(
                    f"prompt ({n} tokens) plus max_tokens ({seq.params.max_tokens}) is more than "
                    f"one tenant may reserve ({cap_tokens} tokens, its share of the KV pool); "
                    f"set max_tokens to at most {room}",
                    "max_tokens",
                )
            seq.params = _with_max_tokens(seq.params, room)
        return self.shares.refusal(seq.tenant, self.footprint(seq))

    def footprint(self, seq: Request) -> int:
        """The pages a request holds at most: its prompt and every token it may generate."""
        return self.pages.pages_for(len(seq.prompt_ids) + seq.params.max_tokens - 1)

    def _take_share(self, seq: Request) -> None:
        """(engine thread) Reserve the request's worst case in its tenant's share; the
        admission check ran before, but other requests of the tenant may have come in since."""
        try:
            self.shares.take(seq.seq_id, seq.tenant, self.footprint(seq))
        except EngineError as exc:
            self.metrics.rejected.labels(reason=exc.code).inc()
            raise

    # --- the step loop (engine thread only) ----------------------------------------------------

    def add(self, seq: Request) -> None:
        assert not is_terminal(seq)
        self._take_share(seq)
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))

    def abort(self, seq: Request) -> None:
        """The scheduler drops it, releasing its pages, at the next step."""
        seq.finish("abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One scheduler step. Returns every sequence whose state changed.

        A step that raises while running its batch fails exactly that batch: each of its
        requests ends with a 500 internal_error and its pages go back to the pool; every
        other request is untouched and the next step runs as usual."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.metrics.step_seconds.inc(time.perf_counter() - started)

    def _step(self) -> list[Request]:
        changed = self.scheduler.remove_finished()  # aborted since the last step
        seqs, is_prefill = self.scheduler.schedule()  # every one of them is in `running` now
        if seqs:
            if is_prefill:
                self._count_prefill(seqs)
            try:
                if not is_prefill:
                    self.metrics.decode_steps.inc()
                if is_prefill or self.device_decoder is None:
                    self._run_on_host(seqs, is_prefill)
                else:
                    self._decode_on_device(self.device_decoder, seqs)
            except Exception:
                if self.leader is not None:  # the other ranks may wait in a collective for good
                    self.leader.abandon(f"a {'prefill' if is_prefill else 'decode'} step raised")
                self._fail_batch(seqs, is_prefill)
            changed += seqs
        changed += self.scheduler.remove_finished()  # finished, refused or failed: pages back
        m = self.metrics
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.preemptions.inc(self.scheduler.take_preemptions())
        m.stale_releases.inc(self.pages.take_stale_releases())
        self._take_load()
        return list(dict.fromkeys(changed))

    def _take_load(self) -> None:
        """(engine thread) The queues' figures for load_report, at most every LOAD_EVERY
        seconds while there is work, and always once it runs out (an idle engine's last
        figures are its true ones)."""
        now = time.monotonic()
        if self.has_work() and now - self._load.at < LOAD_EVERY:
            return
        waiting = list(self.scheduler.waiting)
        queued = sum(s.num_tokens for s in waiting if not is_terminal(s))
        self.metrics.queued_prompt_tokens.set(queued)
        self._load = Load(now, len(waiting), queued, self.scheduler.num_running)

    def _run_on_host(self, seqs: list[Request], is_prefill: bool) -> None:
        """Prepare the batch's tensors, check its reads (core/isolation), run it (core/runner)."""
        step: PreparedStep | None = self.runner.prepare(seqs, is_prefill)
        assert step is not None
        safe = self._refuse_unsafe_reads(seqs, step)
        if len(safe) < len(seqs):
            # page tables only change between steps: the checked batch is the one that runs
            step = self.runner.prepare(safe, is_prefill) if safe else None
            if self.leader is not None:
                self.leader.narrow(step)  # the other ranks run it instead of the checked one
        if step is not None:
            self._postprocess(safe, is_prefill, self.runner.run(step))

    def _decode_on_device(self, decoder: DeviceDecoder, seqs: list[Request]) -> None:
        """One decode step as device kernels: the read check ran on the device over the pages
        each row holds (a row it failed wrote only the scratch page and read nothing), and
        the tokens were drawn there (core/device_sampler)."""
        result = decoder.step(seqs)
        check = result.read_check()
        passed = (~check.failed).tolist()
        if not all(passed):
            self._fail_closed(seqs, check)
        keep = [i for i, ok in enumerate(passed) if ok]
        safe = [seqs[i] for i in keep]
        page = self.pages.page_size
        written = [s.num_tokens - 1 for s in safe]
        self.pages.record_writes(
            torch.tensor([s.pages[p // page] for s, p in zip(safe, written, strict=True)]),
            torch.tensor([p % page for p in written]),
        )
        self._advance(safe, [result.tokens[i] for i in keep], [result.logprobs[i] for i in keep])

    def _count_prefill(self, seqs: list[Request]) -> None:
        """A prefill batch's size, and its prefix-cache hits: a request's first prefill decides
        its cached_tokens (a recompute after preemption does not count again)."""
        self.metrics.prefill_batch.observe(len(seqs))
        if self.prefix is None:
            return
        for seq in seqs:
            if not seq.output_ids:
                seq.cached_tokens = seq.prefill_start
                self.metrics.prefix_queried_tokens.inc(len(seq.prompt_ids))
                self.metrics.prefix_hit_tokens.inc(seq.prefill_start)

    def _fail_batch(self, seqs: list[Request], is_prefill: bool) -> None:
        """(inside an except) The step running `seqs` raised: each ends with a 500 naming an
        incident id that the log line with the traceback carries too; they are in `running`,
        so the step's remove_finished releases their pages. A request this step already failed
        closed (an isolation refusal) keeps that error; a finish this step decided did not
        complete and is void."""
        incident = errors.new_incident()
        error = errors.internal_error(f"incident {incident}")
        log.exception(
            "incident %s: an engine step failed; its %s batch of %d ends with internal_error: %s",
            incident,
            "prefill" if is_prefill else "decode",
            len(seqs),
            ", ".join(seq.request_id or f"seq {seq.seq_id}" for seq in seqs),
        )
        self.metrics.step_failures.inc()
        for seq in seqs:
            if seq.finish_reason != "error":
                seq.finish_reason = None  # void: the step that decided it never completed
                seq.finish("error", error)

    def fail_all(self, error: EngineError) -> list[Request]:
        """Finish every request the scheduler holds with `error` and release its pages: for a
        failure the engine cannot attribute to one batch (its scheduler's own state)."""
        seqs = self.scheduler.queued()
        for seq in seqs:
            seq.finish("error", error)
        self.scheduler.remove_finished()
        return seqs

    def _refuse_unsafe_reads(self, seqs: list[Request], step: PreparedStep) -> list[Request]:
        """Fail closed every sequence whose page table does not cover what it will read;
        returns the others."""
        started = time.perf_counter()
        check = None if Fault.NO_TAG_CHECK in self.faults else check_step(self.pages.book, step)
        if self.leader is not None:  # every rank's check, against its own pool's tags
            check = self.leader.check(step, check)
        if check is None:
            return seqs
        failed = bool(check.failed.any())
        self.metrics.read_check_seconds.inc(time.perf_counter() - started)
        return self._fail_closed(seqs, check) if failed else seqs

    def _fail_closed(self, seqs: list[Request], check: ReadCheck) -> list[Request]:
        """Finish every sequence the read check failed, naming why; returns the others."""
        safe = []
        for seq, tag_bad, foreign, unwritten in zip(
            seqs,
            check.tag_mismatch.tolist(),
            check.foreign.tolist(),
            check.unwritten.tolist(),
            strict=True,
        ):
            if tag_bad:
                self.metrics.tag_mismatch.inc()
                seq.finish("error", errors.isolation_violation("a KV page it held was reassigned"))
            elif foreign:
                self.metrics.foreign_tenant_read.inc()
                seq.finish(
                    "error", errors.isolation_violation("a cached KV page of another tenant")
                )
            elif unwritten:
                self.metrics.unwritten_read.inc()
                seq.finish("error", errors.isolation_violation("KV slots never written for it"))
            else:
                safe.append(seq)
        return safe

    def _postprocess(self, seqs: list[Request], is_prefill: bool, logits: torch.Tensor) -> None:
        """Sample each sequence's next token and finish those that are done; after a prefill,
        publish its full pages, copy out the KV the prefill role sends."""
        if is_prefill:  # before the sampled token is appended: what this step really wrote
            written = [len(self.runner.prefill_tokens(seq)) for seq in seqs]
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        self._advance(seqs, tokens, logprobs)
        if is_prefill:
            for seq, count in zip(seqs, written, strict=True):
                if self.prefix is not None:
                    self.pages.publish(seq)
                if seq.export_kv:  # prefill role: the KV leaves before the pages are freed
                    seq.exported = (*self.pages.export(seq, count), count)
            self._maybe_release_early(seqs)

    def _advance(
        self, seqs: list[Request], tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> None:
        """Each sequence's step wrote its KV and chose its next token."""
        now = time.monotonic()
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.num_cached = seq.num_tokens  # what the engine believes is now in the pool
            seq.output_ids.append(token)
            if logprob is not None:
                seq.output_logprobs.append(logprob)
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.ttft.observe(now - seq.arrival)
                self.recent_ttft.observe(now - seq.arrival)
            elif seq.last_token_at is not None:
                self.metrics.inter_token_latency.observe(now - seq.last_token_at)
                self.recent_itl.observe(now - seq.last_token_at)
            seq.last_token_at = now
            self.metrics.generation_tokens.inc()
            self._finish_if_done(seq, token)

    def _finish_if_done(self, seq: Request, token: int) -> None:
        if not seq.params.ignore_eos and token in self.tokenizer.eos_ids:
            seq.finish("stop")
        elif len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish("length")

    def switch_on(self, fault: Fault) -> None:
        """(engine thread, between steps) A fault of core/faults.py::RUNTIME, switched on in
        this running engine: test-only, as --unsafe-fault is. The kvpool report names it."""
        self.faults = self.faults.with_(fault)
        self.runner.faults = self.faults
        if fault is Fault.EARLY_RELEASE and self.early_release is None:
            self.early_release = EarlyRelease()
            with self.pages.lock:
                self.pages.book.take_free_through(self.early_release)
        log.warning("unsafe fault %s switched on in a running engine: %s", fault, fault.description)

    def _maybe_release_early(self, seqs: list[Request]) -> None:
        """The early-release fault (core/faults.py::EarlyRelease): a sibling owner hands each
        running request's first page back while it is in use."""
        if self.early_release is not None:
            self.early_release.rob(self.pages, seqs)

    # --- decode role: a prompt whose KV another engine computes ------------------------------
    # The reservation protocol around these (kvfence_engine.disagg.reservations) decides when;
    # these verbs are what the engine does to the request and its pages.

    def allocate_prompt(self, seq: Request) -> None:
        """(engine thread) Give an admitted request pages for its whole prompt now, outside the
        scheduler: its KV will be written into them by a transfer, not computed here."""
        assert not is_terminal(seq)
        n = len(seq.prompt_ids)
        self._take_share(seq)
        if not self.pages.allocate(seq):
            self.shares.give_back(seq.seq_id)
            self.metrics.rejected.labels(reason="overloaded").inc()
            raise errors.overloaded(
                f"no free KV pages for {n} tokens: need {self.pages.pages_for(n)} pages, "
                f"{self.pages.num_free} free"
            )
        self.metrics.prompt_tokens.inc(n)

    def continue_decode(self, seq: Request, first: TokenLogprob) -> None:
        """(engine thread) A request whose prompt KV is verified in its pages continues from
        prefill's first token: it joins the running set, or finishes at once and its pages
        are released."""
        seq.num_cached = len(seq.prompt_ids)
        seq.last_token_at = time.monotonic()  # decode's first token is timed from here
        seq.output_ids.append(first.token_id)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(first)
        self.metrics.generation_tokens.inc()
        self._finish_if_done(seq, first.token_id)
        if is_terminal(seq):
            self.scheduler.release(seq)
            return
        self.scheduler.add_running(seq)
        self._maybe_release_early([seq])

    def release(self, seq: Request) -> None:
        """(any thread) Return the pages of a request the scheduler does not hold (reserved, or
        fenced while its transfer was still writing)."""
        self.scheduler.release(seq)

    # --- reports ---------------------------------------------------------------------------

    def load_report(self) -> LoadReport:
        """(any thread) The engine's load: its queues as of the last step (_take_load), its
        pool now, its latencies over the last minute."""
        load = self._load
        return LoadReport(
            role=Role(self.args.role),
            revision=self.args.revision,
            waiting_requests=load.waiting,
            queued_prompt_tokens=load.queued_prompt_tokens,
            running_sequences=load.running,
            pages_used=self.pages.num_used,
            pages_total=self.pages.num_pages,
            time_to_first_token_p90_seconds=self.recent_ttft.quantile(0.9),
            inter_token_latency_p90_seconds=self.recent_itl.quantile(0.9),
            window_seconds=self.recent_ttft.window,
        )

    def kvpool_report(self) -> KvPoolReport:
        role = Role(self.args.role)
        return KvPoolReport(
            role=role,
            revision=self.args.revision,
            pool_tokens=self.pages.pool_tokens,
            page_size=self.pages.page_size,
            num_pages=self.pages.num_pages,
            free_pages=self.pages.num_free,
            kv_bytes_per_token=self.plan.kv_bytes_per_token,
            kv_dtype=self.kv_dtype,
            weight_dtype=str(self.precision.weights),
            weight_choice=self.precision.why,
            context_length_requested=self.context_requested,
            context_length_effective=self.context_effective,
            context_policy=str(self.args.context_policy),
            model_max_positions=self.config.max_positions,
            tag_check=Fault.NO_TAG_CHECK not in self.faults,
            # no transfer in the combined role, so nothing to checksum there
            kv_checksum=self.args.kv_checksum and role is not Role.COMBINED,
            transfer_port=self.args.transfer_port if role is Role.DECODE else None,
            deferred_release=True,
            scrub_on_free=self.pages.scrub_on_free,
            unsafe_faults=sorted(fault.value for fault in self.faults.enabled),
            prefix_cache=self.prefix is not None,
            cached_pages=self.pages.num_cached,
            prefix_cache_pages=self.pages.cache_pages,
            model_name=self.loaded.name,
            model_source=self.loaded.source or None,
            tensor_parallel_size=1 if self.group is None else self.group.world,
        )


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return replace(params, max_tokens=max_tokens)
