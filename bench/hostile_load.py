"""Hostile load: 16 tenants share one router + prefill + decode, each sending a mix of valid
requests and hostile ones for a bounded time. What a tenant must never see: a valid request
answered wrongly or not at all, a 5xx, or a KV page that never comes back.

Processes: `kvfence serve --role prefill`, `kvfence serve --role decode` and `kvfence router`
on loopback (kvfence_engine.tools.localproc), an API-keys file with one key per tenant and an
internal token shared by the three. The model is builtin:tiny-random (--model
builtin:smollm2-135m-instruct for the real one).

Valid requests are greedy or seeded (completions and chat), so each has one right answer: the
text a warm-up run gets with each request alone on the idle deployment. Under load, a valid
request is correct only if it is answered 200 with exactly that text.

Hostile classes (each tenant draws its next request from a seeded generator, half valid):
  bad_field         temperature 3, top_p 0, n 2, seed 2**64, logprobs 99 ...   -> 400
  lone_surrogate    "\\ud800" in a prompt, chat content or stop string         -> 400
  huge_body         a 5 MiB prompt (over the 4 MiB --max-request-bytes)        -> 413
  long_prompt       a prompt far over the served context, under the byte cap   -> 400
  bad_key           an unknown key, a non-ASCII key, no key                    -> 401
  invalid_json      a body that is not JSON, or JSON that is not an object     -> 400
  disconnect        a stream abandoned after its first token, or a request
                    whose connection closes before any answer                  -> (none)
  tiny_temperature  temperature 1e-300, 5e-324 or 1e-45: greedy, so it must equal the
                    greedy reference                                           -> 200

Report: requests by tenant and class, answers by class (status and error code), valid
requests answered correctly, 5xx, pages leaked (each engine's free_pages on /v1/kvpool, idle,
before and after), and each tenant's answered share of its valid requests. Exit status 1 if a
valid (or tiny-temperature) request was answered wrongly or not at all, any 5xx, or any page
leaked.

    python bench/hostile_load.py --seconds 30
"""

import argparse
import collections
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.tools.localproc import LocalProcess

TENANTS = 16
CONTEXT = 512
HUGE_BODY_BYTES = 5 * 1024 * 1024  # over the default --max-request-bytes (4 MiB)
SETTLE_SECONDS = 15.0  # deferred release: aborted transfers free their pages when they end
TOKEN = "hostile-load-internal-token"
CLASSES = [
    "valid",
    "bad_field",
    "lone_surrogate",
    "huge_body",
    "long_prompt",
    "bad_key",
    "invalid_json",
    "disconnect",
    "tiny_temperature",
]
PROMPTS = [
    "The quick brown fox",
    "Tenant isolation means",
    "Once upon a time, in a data center",
    "The capital of France is",
    "def fibonacci(n):",
    "KV caches are paged because",
]
CHATS = [
    [{"role": "user", "content": "What is a hash table?"}],
    [{"role": "user", "content": "Name three colours."}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


@dataclass(frozen=True)
class Valid:
    """A request with one right answer: greedy, or sampled with a fixed seed."""

    path: str
    body: dict[str, Any]

    @property
    def key(self) -> str:
        return json.dumps([self.path, self.body], sort_keys=True)


def valid_requests() -> list[Valid]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append(Valid("/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0}))
        seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        out.append(Valid("/v1/completions", {"prompt": prompt, "max_tokens": 16, **seeded}))
    for i, messages in enumerate(CHATS):
        greedy = {"temperature": 0, "max_tokens": 16}
        out.append(Valid("/v1/chat/completions", {"messages": messages, **greedy}))
        seeded = {"temperature": 0.7, "seed": 7 + i, "max_tokens": 16}
        out.append(Valid("/v1/chat/completions", {"messages": messages, **seeded}))
    return out


def answer_text(path: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(
        choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    )


@dataclass
class Outcome:
    tenant: int
    klass: str
    status: int | None  # None: no answer (the client left, or the server closed the connection)
    code: str | None = None
    correct: bool | None = None  # for valid and tiny_temperature requests


@dataclass
class Results:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


def error_code(r: httpx.Response) -> str | None:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "not-openai-shape"


class Tenant:
    """One tenant's loop: its own key, connection pool and seeded mix of requests."""

    def __init__(
        self,
        index: int,
        url: str,
        key: str,
        references: dict[str, str | None],
        results: Results,
    ) -> None:
        self.index = index
        self.url = url
        self.key = key
        self.references = references
        self.results = results
        self.rng = random.Random(index)
        self.requests = valid_requests()
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120
        )

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                klass = "valid" if self.rng.random() < 0.5 else self.rng.choice(CLASSES[1:])
                try:
                    outcome = getattr(self, klass)()
                except Exception as exc:  # no answer at all: wrong for a valid request
                    checked = klass in ("valid", "tiny_temperature")
                    correct = False if checked else None
                    outcome = Outcome(self.index, klass, None, type(exc).__name__, correct)
                    if not isinstance(exc, httpx.HTTPError):
                        outcome.code = f"bench error {exc!r}"  # this script's bug: a FAIL
                self.results.add(outcome)
        finally:
            self.client.close()

    def outcome(self, klass: str, r: httpx.Response, correct: bool | None = None) -> Outcome:
        code = error_code(r) if r.status_code >= 400 else None
        return Outcome(self.index, klass, r.status_code, code, correct)

    def check_valid(self, klass: str, request: Valid, body: dict[str, Any]) -> Outcome:
        r = self.client.post(request.path, json=body)
        reference = self.references[request.key]
        correct = (
            r.status_code == 200
            and reference is not None
            and (answer_text(request.path, r.json()) == reference)
        )
        return self.outcome(klass, r, correct)

    def valid(self) -> Outcome:
        request = self.rng.choice(self.requests)
        return self.check_valid("valid", request, request.body)

    def tiny_temperature(self) -> Outcome:
        greedy = [v for v in self.requests if "seed" not in v.body]
        request = self.rng.choice(greedy)
        body = request.body | {"temperature": self.rng.choice([1e-300, 5e-324, 1e-45])}
        return self.check_valid("tiny_temperature", request, body)

    def bad_field(self) -> Outcome:
        bad = self.rng.choice([
            {"temperature": 3.0}, {"top_p": 0.0}, {"n": 2}, {"seed": 2**64},
            {"seed": -(2**63) - 1}, {"logprobs": 99}, {"max_tokens": 0}, {"top_k": -1},
            {"stop": ["a", "b", "c", "d", "e"]}, {"presence_penalty": 1.0},
        ])  # fmt: skip
        return self.outcome("bad_field", self.client.post("/v1/completions", json={
            "prompt": self.rng.choice(PROMPTS), "max_tokens": 4, **bad,
        }))  # fmt: skip

    def lone_surrogate(self) -> Outcome:
        body = self.rng.choice([
            {"prompt": "a\ud800b", "max_tokens": 4},
            {"prompt": "hi", "stop": ["\udfff"], "max_tokens": 4},
            {"messages": [{"role": "user", "content": "\ud83d"}], "max_tokens": 4},
        ])  # fmt: skip
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        content = json.dumps(body)  # \\ud800 escaped: valid JSON, invalid Unicode
        headers = {"content-type": "application/json"}
        return self.outcome(
            "lone_surrogate", self.client.post(path, content=content, headers=headers)
        )

    def huge_body(self) -> Outcome:
        content = json.dumps({"prompt": "a " * (HUGE_BODY_BYTES // 2), "max_tokens": 4})
        headers = {"content-type": "application/json"}
        try:
            r = self.client.post("/v1/completions", content=content, headers=headers)
        except httpx.TransportError:
            # refused before it was read: the server answered and closed while we still sent
            return Outcome(self.index, "huge_body", None, "closed-while-sending")
        return self.outcome("huge_body", r)

    def long_prompt(self) -> Outcome:
        words = " ".join(self.rng.choice(["token", "isolation", "page", "tenant"]) for _ in range(
            CONTEXT * 4
        ))  # fmt: skip
        return self.outcome(
            "long_prompt", self.client.post("/v1/completions", json={"prompt": words})
        )

    def bad_key(self) -> Outcome:
        headers: dict[str, str | bytes] = self.rng.choice([
            {"Authorization": "Bearer not-a-key"},
            {"Authorization": b"Bearer caf\xe9"},  # one Latin-1 byte: not ASCII
            {"Authorization": ""},
        ])  # fmt: skip
        r = self.client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=headers
        )
        return self.outcome("bad_key", r)

    def invalid_json(self) -> Outcome:
        content = self.rng.choice(['{"prompt": "hi", ', "[1, 2, 3]", "null", "\xff\xfe", '"x"'])
        headers = {"content-type": "application/json"}
        r = self.client.post("/v1/completions", content=content.encode("latin-1"), headers=headers)
        return self.outcome("invalid_json", r)

    def disconnect(self) -> Outcome:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
        if self.rng.random() < 0.5:  # abandon a stream after its first token
            with self.client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
            return Outcome(self.index, "disconnect", None, "left-mid-stream")
        # send a whole request, then close the socket before any answer
        payload = json.dumps(body).encode()
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {self.key}\r\nContent-Length: {len(payload)}\r\n\r\n"
            )
            sock.sendall(head.encode() + payload)
            time.sleep(self.rng.uniform(0.0, 0.3))
        return Outcome(self.index, "disconnect", None, "left-before-answer")


@contextmanager
def deployment(
    model: str, logs: Path, keys: Path, token: Path, faults: list[str]
) -> Iterator[tuple[LocalProcess, list[LocalProcess]]]:
    """prefill + decode + router on loopback: the router, and the engines."""
    common = [
        "--model",
        model,
        "--context-length",
        str(CONTEXT),
        "--internal-token-file",
        str(token),
    ]
    engine = [*common, "--kv-cache-memory", "256Mi", "--transfer-port", "0", "--threads", "1"]
    for fault in faults:
        engine += ["--unsafe-fault", fault]
    env = {"KVFENCE_ALLOW_UNSAFE": "1"} if faults else None
    prefill = LocalProcess(
        ["serve", "--role", "prefill", *engine], env=env, log_path=logs / "prefill.log"
    )
    decode = LocalProcess(
        ["serve", "--role", "decode", *engine], env=env, log_path=logs / "decode.log"
    )
    router = LocalProcess(
        ["router", *common, "--api-keys", str(keys), "--prefill", prefill.url, "--decode",
         decode.url],
        log_path=logs / "router.log",
    )  # fmt: skip
    procs = [prefill, decode, router]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_ready(timeout=300)
        yield router, [prefill, decode]
    finally:
        for proc in procs:
            proc.stop()


def free_pages(engines: list[str]) -> dict[str, int]:
    return {
        url: int(httpx.get(url + "/v1/kvpool", headers={TOKEN_HEADER: TOKEN}).json()["free_pages"])
        for url in engines
    }


def settled_free_pages(engines: list[str], before: dict[str, int]) -> dict[str, int]:
    """Free pages once idle: aborted transfers release theirs when they end, a moment later."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        now = free_pages(engines)
        if all(now[u] >= before[u] for u in engines) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def warm_up(url: str, key: str) -> dict[str, str | None]:
    """Each valid request alone on the idle deployment, twice: its one right answer (None if
    it has none: an error, or two different answers; every such request counts as wrong)."""
    references: dict[str, str | None] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        for request in valid_requests():
            answers = set()
            for _ in range(2):
                r = c.post(request.path, json=request.body)
                answers.add(answer_text(request.path, r.json()) if r.status_code == 200 else None)
            if len(answers) != 1 or None in answers:
                print(f"warm-up: {request.key} has no one answer alone: {answers}")
            references[request.key] = answers.pop() if len(answers) == 1 else None
    return references


def report(results: Results, leaked: dict[str, int], seconds: float) -> bool:
    outcomes = results.outcomes
    by_tenant_class: dict[int, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    answers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_tenant_class[o.tenant][o.klass] += 1
        what = "no answer" if o.status is None else str(o.status)
        answers[o.klass][f"{what} {o.code}" if o.code else what] += 1
    checked = [o for o in outcomes if o.correct is not None]
    wrong = [o for o in checked if not o.correct]
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]

    print(f"\n{len(outcomes)} requests from {TENANTS} tenants in {seconds:.0f} s\n")
    print("requests by tenant and class")
    short = [c.replace("_", " ") for c in CLASSES]
    print("| tenant | " + " | ".join(short) + " | valid answered |")
    print("|---" * (len(CLASSES) + 2) + "|")
    shares = []
    for tenant in range(TENANTS):
        counts = by_tenant_class[tenant]
        mine = [o for o in checked if o.tenant == tenant and o.klass == "valid"]
        share = sum(o.status == 200 for o in mine) / len(mine) if mine else 1.0
        shares.append(share)
        cells = " | ".join(str(counts[c]) for c in CLASSES)
        print(f"| {tenant:02d} | {cells} | {share:.0%} |")
    print("\nanswers by class (status and error code)")
    for klass in CLASSES:
        spread = ", ".join(f"{k}: {n}" for k, n in sorted(answers[klass].items()))
        print(f"  {klass:17} {spread}")

    def right(klass: str) -> str:
        mine = [o for o in checked if o.klass == klass]
        return f"{sum(bool(o.correct) for o in mine)}/{len(mine)}"

    print(f"\nvalid requests answered correctly: {right('valid')}")
    print(f"tiny-temperature requests equal to the greedy answer: {right('tiny_temperature')}")
    print(f"5xx: {len(server_errors)}")
    print("pages leaked: " + ", ".join(f"{role} {n}" for role, n in leaked.items()))
    print(
        f"answered share of valid requests per tenant: min {min(shares):.0%}, max {max(shares):.0%}"
    )
    bench_errors = [o for o in outcomes if (o.code or "").startswith("bench error")]
    if bench_errors:
        print(f"this script failed {len(bench_errors)} times, e.g. {bench_errors[0].code}")
    ok = not wrong and not server_errors and not any(leaked.values()) and not bench_errors
    print("\nverdict: " + ("PASS" if ok else "FAIL"))
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument(
        "--unsafe-fault",
        action="append",
        default=[],
        metavar="NAME",
        help="negative control: run the engines with this isolation bug (the verdict must FAIL)",
    )
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvfence-hostile-"))
    keys = [f"key-{i:02d}-{random.Random(i).getrandbits(64):016x}" for i in range(TENANTS)]
    (folder / "keys").write_text("".join(f"{k} tenant-{i:02d}\n" for i, k in enumerate(keys)))
    (folder / "token").write_text(TOKEN + "\n")
    faults = f", unsafe faults {args.unsafe_fault}" if args.unsafe_fault else ""
    print(f"model {args.model}, {TENANTS} tenants, {args.seconds:.0f} s{faults}; logs in {folder}")
    files = (folder / "keys", folder / "token")
    with deployment(args.model, folder, *files, args.unsafe_fault) as (router, procs):
        engines = [p.url for p in procs]
        references = warm_up(router.url, keys[0])
        before = free_pages(engines)
        results = Results()
        deadline = time.monotonic() + args.seconds
        started = time.monotonic()
        tenants = [Tenant(i, router.url, keys[i], references, results) for i in range(TENANTS)]
        threads = [threading.Thread(target=t.run, args=(deadline,)) for t in tenants]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        after = settled_free_pages(engines, before)
    roles = dict(zip(engines, ["prefill", "decode"], strict=True))
    leaked = {roles[u]: max(0, before[u] - after[u]) for u in engines}
    return 0 if report(results, leaked, elapsed) else 1


if __name__ == "__main__":
    sys.exit(main())
