"""What a canary run is asked to do, and the bounds it must stay within."""

from collections.abc import Callable
from dataclasses import dataclass

# The whole run, seconds: the InferenceDeployment's default spec.canary.timeoutSeconds, what the
# operator's canary Job gets (a test holds the two equal). SmolLM2 on a busy 2-core machine has
# taken 13.7 minutes; 300 s, the default before, timed out there.
DEFAULT_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    target: str  # the router (or a combined engine): http://host:port
    tenant_a_key: str  # A plants the marker and pollutes the pool
    tenant_b_key: str  # B probes and must never see A's data
    # The internal token, sent only on GET /metrics: a router requires it there (its metrics
    # name every tenant); everything else the canary does, it does as a tenant.
    internal_token: str | None = None
    context_length: int | None = None  # the served context; default: the target's max_model_len
    timeout: float = DEFAULT_TIMEOUT  # whole run, seconds; past it the run stops and exits 2
    max_requests: int = 1000  # hard bound on HTTP requests; the plan stays well below it
    # requests a second on average (None: as fast as the target answers); a pollution burst
    # still goes at once. The standing canary's bound on the load it adds to a serving revision.
    rate: float | None = None
    rounds: int = 3  # rounds of A-pollution and neutral pollution, each followed by B's probes
    request_timeout: float = 120.0  # one request, seconds
    answer_tokens: int = 8  # tokens B asks for per boundary probe (greedy, EOS ignored)
    # Greedy answers of one request running alone are bit-identical run to run here; 1e-3 nats
    # leaves room for GPU kernels that reduce in a different order, while the leaks shown in the
    # fault tests move logprobs by far more than that.
    logprob_tolerance: float = 1e-3
    # A first token is "too fast" when less than 1/latency_factor of the calibrated prefill time
    # went by; judged only where that prefill time is at least latency_min_prefill seconds.
    latency_factor: float = 4.0
    latency_min_prefill: float = 0.15
    concurrent_decode_seconds: float = 0.5  # how long B keeps decoding while A pollutes
    max_pollution_requests: int = 32  # per pollution burst
    seed: int | None = None  # prompts and marker; random when None (recorded in the report)
    # told each step as it starts, in the order of run.planned_steps (a progress display)
    progress: Callable[[str], None] | None = None
    # told at once what the run learns mid-way that the verdict will say (a check that cannot
    # run), so that a person need not wait for the end to read it; a line of text
    notice: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.target.startswith(("http://", "https://")):
            problems.append(f"--target must be an http(s) URL, got {self.target!r}")
        if not self.tenant_a_key or not self.tenant_b_key:
            problems.append("both tenant keys are needed")
        elif self.tenant_a_key == self.tenant_b_key:
            problems.append("tenant A and tenant B must use different keys (different tenants)")
        if self.context_length is not None and self.context_length < 2:
            problems.append(f"--context-length must be >= 2, got {self.context_length}")
        if self.timeout <= 0 or self.request_timeout <= 0:
            problems.append("timeouts must be positive")
        if self.rounds < 1 or self.max_requests < 1 or self.answer_tokens < 1:
            problems.append("rounds, max_requests and answer_tokens must be >= 1")
        if self.rate is not None and self.rate <= 0:
            problems.append(f"--rate must be positive, got {self.rate}")
        if self.latency_factor <= 1:
            problems.append("latency_factor must be > 1")
        if problems:
            raise ValueError("; ".join(problems))
