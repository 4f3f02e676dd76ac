"""The canary against real router + prefill + decode processes (tiny-random): it passes a
healthy deployment, and fails each deliberately broken one with the check and reason that
caught it. Broken fronts (a truncating router, lying usage, a shared cache, a leaking front) are
small proxies in this file that forward to the healthy deployment and alter one behaviour."""

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from helpers.deployments import Deployment, start_deployment
from helpers.engines import prompt_of
from helpers.waits import GiveUp, eventually
from kvfence_engine.canary import CanaryConfig, CanaryReport, run_canary
from kvfence_engine.canary.prompts import CONTROL_STRINGS
from kvfence_engine.contracts import TOKEN_HEADER
from kvfence_engine.disagg.transfer import Handle, Layout, Sender, page_views
from kvfence_engine.loading.loader import TINY_CONFIG
from kvfence_engine.loading.tokenizer_source import TINY_RANDOM, load_tokenizer
from kvfence_engine.tools.localproc import free_port

KEY_A, KEY_B = "canary-key-a", "canary-key-b"
TOKEN = "canary-internal-token"
# Long enough that a tiny-random prefill stands out of request jitter: through the router, a
# 3,072-token prompt takes about 0.1 s on a quiet 2-core machine. The canary's default floor
# judges only prefills of at least 0.15 s (a real model's; tiny-random's is faster than any);
# here, on loopback, it judges those of at least 0.04 s: a replayed answer comes in a few ms.
HEALTHY_CONTEXT = 3072
MIN_PREFILL = 0.04
HEALTHY_PAGES = 2 * HEALTHY_CONTEXT // 16  # a pool of twice the context
PAGE = 16


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The router's keys, and its internal token: with tenants, its /metrics (where the canary
    reads the engines' isolation counters) needs the token."""
    folder = tmp_path_factory.mktemp("canary")
    path, token = folder / "api-keys", folder / "internal-token"
    path.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    token.write_text(TOKEN + "\n")
    return ["--api-keys", str(path), "--internal-token-file", str(token)]


@pytest.fixture(scope="module")
def healthy(logs_dir: Path, keys: list[str]) -> Iterator[Deployment]:
    d = start_deployment(
        logs_dir, "canary-healthy", context=HEALTHY_CONTEXT, pages=HEALTHY_PAGES, router_args=keys
    )
    yield d
    d.stop()


# Broken targets are run with one round (baseline, A and neutral pollution): each fault here
# shows in the first round, and the suite's time budget is shared. Healthy targets get the
# default rounds, which is where a false alarm would show.
BROKEN_ROUNDS = 1


def canary(target: str, **overrides: object) -> CanaryReport:
    overrides = {"internal_token": TOKEN, "latency_min_prefill": MIN_PREFILL, **overrides}
    report = run_canary(CanaryConfig(target, KEY_A, KEY_B, **overrides))  # type: ignore[arg-type]
    print(report.human())  # shown when a test fails
    return report


def failed(report: CanaryReport) -> dict[str, str]:
    return {c.name: c.reason for c in report.checks if not c.passed}


def test_a_healthy_deployment_passes_every_check(healthy: Deployment) -> None:
    """How long the canary takes is bench/'s to measure: on a loaded 2-core machine this run
    took 86 s, on a quiet one under a minute (issue 34)."""
    report = canary(healthy.router.url)
    assert report.exit_code == 0 and report.outcome == "pass", report.reason
    assert failed(report) == {}
    checks = {c.name: c for c in report.checks}
    assert checks["latency_floor"].inputs["answers_judged"] > 0  # the floor really judged
    assert checks["differential_replay"].inputs["comparisons"] >= 18
    assert len(checks["chat_markup"].inputs["added_tokens"]) == len(CONTROL_STRINGS)
    assert report.facts is not None and report.facts["limit"] == HEALTHY_CONTEXT


# --- broken engines -----------------------------------------------------------------------

ENGINE_CONTEXT = 128
ROUTER_CONTEXT = 1024  # the router lets prompts the engines cannot serve reach them


def placeholder(logs: Path, name: str, keys: list[str], *decode_faults: str) -> Deployment:
    return start_deployment(
        logs,
        name,
        context=ENGINE_CONTEXT,
        router_args=[*keys, "--context-length", str(ROUTER_CONTEXT)],
        prefill_faults=["reject-placeholder"],
        decode_faults=["reject-placeholder", *decode_faults],
    )


def test_reject_placeholder_without_its_checks_leaks_and_is_caught(
    logs_dir: Path, keys: list[str]
) -> None:
    d = placeholder(logs_dir, "canary-placeholder-leak", keys, "skip-count-check", "no-tag-check")
    try:
        report = canary(d.router.url, rounds=BROKEN_ROUNDS)
    finally:
        d.stop()
    assert report.exit_code == 1
    reasons = failed(report)
    # B's over-long prompts were answered from whatever A left in the pool ...
    assert "differs from the answer" in reasons["differential_replay"]
    # ... with a 200 where the engines' 128-token limit called for a refusal
    assert "over the 128-token limit but was answered 200" in reasons["status_codes"]


def test_reject_placeholder_with_its_checks_fails_closed_with_a_5xx_instead_of_a_4xx(
    logs_dir: Path, keys: list[str]
) -> None:
    d = placeholder(logs_dir, "canary-placeholder-closed", keys)
    try:
        report = canary(d.router.url, rounds=BROKEN_ROUNDS)
    finally:
        d.stop()
    assert report.exit_code == 1
    reasons = failed(report)
    assert (
        "got 500 kv_isolation_violation: a 500 where a 4xx refusal was due"
        in (reasons["status_codes"])
    )
    assert "kvfence_transfer_count_mismatch_total on decode" in reasons["engine_counters"]
    assert "differential_replay" not in reasons  # nothing leaked: the defences held


def test_early_release_without_the_tag_check_leaks_into_bs_running_answer(
    logs_dir: Path, keys: list[str]
) -> None:
    d = start_deployment(
        logs_dir,
        "canary-early-leak",
        router_args=keys,
        decode_faults=["early-release", "no-tag-check"],
    )
    try:
        # the leak needs B's request to land while A's released pages still hold A's KV: one
        # round missed it twice in cold-cache fresh-clone runs on a loaded 2-core machine
        report = canary(d.router.url, rounds=3)
    finally:
        d.stop()
    assert report.exit_code == 1
    # what the leak shows as: B's answer changed (the replay). The latency floor may fail
    # besides, as it did once in a fresh-clone run on a loaded 2-core machine (a first token
    # of B sooner than 1/4 of the calibrated prefill); it is not what this test is about
    assert "differential_replay" in failed(report)
    assert failed(report).keys() <= {"differential_replay", "latency_floor"}
    assert failed(report)["differential_replay"].startswith("concurrent: the answer during-")


def test_early_release_with_the_tag_check_fails_b_closed_and_moves_the_counter(
    logs_dir: Path, keys: list[str]
) -> None:
    d = start_deployment(
        logs_dir, "canary-early-closed", router_args=keys, decode_faults=["early-release"]
    )
    try:
        report = canary(d.router.url, rounds=BROKEN_ROUNDS)
    finally:
        d.stop()
    reasons = failed(report)
    assert "whose stream ended in error kv_isolation_violation" in reasons["status_codes"]
    assert "kvfence_kv_tag_mismatch_total on decode" in reasons["engine_counters"]


LAYOUT = Layout(
    TINY_CONFIG.num_layers, PAGE, TINY_CONFIG.num_kv_heads, TINY_CONFIG.head_dim, "float32"
)


class Straggler:
    """A prefill whose KV transfer outlives its request: it reserves pages on decode, starts the
    transfer, sees the request aborted, and keeps writing into the pages it was handed until
    stopped. A correct router never aborts mid-transfer, so the canary cannot cause this through
    it; a timeout or a partition can, and here the test plays that part."""

    def __init__(self, decode_url: str, tokens: int) -> None:
        r = httpx.post(
            decode_url + "/internal/reserve",
            json={"request_id": "straggler", "prompt_ids": prompt_of(tokens, 3)},
        )
        assert r.status_code == 200, r.text
        handle = r.json()
        handle.pop("max_tokens")
        self.handle = Handle(**handle)
        shape = (16, LAYOUT.layers, PAGE, LAYOUT.kv_heads, LAYOUT.head_dim)
        gen = torch.Generator().manual_seed(3)
        self.kv = page_views(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        self.sender = Sender(self.handle, LAYOUT, token=None)
        self.sender.send_pages(0, self.kv[:1], [PAGE])  # the transfer is in flight ...
        aborted = httpx.post(decode_url + "/internal/abort", json={"request_id": "straggler"})
        assert aborted.json()["aborted"]  # ... when its request is aborted
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.write_late, daemon=True)
        self.thread.start()

    def write_late(self) -> None:
        writes = 0
        while not self.stop.is_set():
            page = writes % len(self.handle.pages)
            self.sender.send_pages(page, [self.kv[writes % len(self.kv)]], [PAGE])
            writes += 1
            time.sleep(0.002)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sender.close()


def test_late_writes_without_the_tag_check_corrupt_bs_answers_and_are_caught(
    logs_dir: Path, keys: list[str]
) -> None:
    d = start_deployment(
        logs_dir, "canary-late-leak", router_args=keys, decode_faults=["late-write", "no-tag-check"]
    )
    straggler = Straggler(d.decodes[0].url, 512)
    try:
        report = canary(d.router.url, rounds=BROKEN_ROUNDS)
    finally:
        straggler.close()
        d.stop()
    assert report.exit_code == 1
    assert "differs from the answer" in failed(report)["differential_replay"]


# --- deliberately wrong fronts ------------------------------------------------------------


# What a front passes on: the tenant's key, the body's type, and the internal token the canary
# reads the router's /metrics with.
FORWARDED_HEADERS = ("authorization", "content-type", TOKEN_HEADER.lower())


def wrong_front(upstream: str, behaviour: str) -> FastAPI:
    """Forwards everything to `upstream` except one deliberate fault:
    truncate: over-limit token-id prompts are cut to the context and answered (200);
    usage:    usage.prompt_tokens is reported one short (as if a BOS were not counted);
    cache:    answers are cached by prompt for everyone and replayed at once (shared cache);
    leak:     the last text prompt any tenant sent is added to the next answers;
    markup:   a chat is rendered with the model's template here and sent as one completion
              prompt, whose special tokens' texts are read as those tokens (content included)."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=120)
    tokenizer = load_tokenizer(TINY_RANDOM)[1]
    cache: dict[str, list[str]] = {}
    last_text = [""]

    def alter(line: str) -> str:
        if not line.startswith("data: {"):
            return line
        chunk = json.loads(line.removeprefix("data: "))
        if behaviour == "usage" and chunk.get("usage"):
            chunk["usage"]["prompt_tokens"] -= 1
        if behaviour == "leak" and chunk.get("choices") and chunk["choices"][0].get("text"):
            chunk["choices"][0]["text"] += last_text[0]
        return "data: " + json.dumps(chunk)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        body = await request.body()
        if behaviour == "markup" and path == "v1/chat/completions":
            chat = json.loads(body)
            prompt = tokenizer.apply_chat_template(chat["messages"])
            completion = {"prompt": prompt, "max_tokens": chat["max_tokens"], "temperature": 0}
            r = await client.post("/v1/completions", json=completion, headers=headers)
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if path != "v1/completions":
            r = await client.request(request.method, "/" + path, content=body, headers=headers)
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        payload = json.loads(body)
        prompt = payload["prompt"]
        if behaviour == "truncate" and isinstance(prompt, list):
            payload["prompt"] = prompt[:HEALTHY_CONTEXT]
        if behaviour == "leak" and isinstance(prompt, str):
            last_text[0] = prompt[:200]
        key = json.dumps(prompt)
        if behaviour == "cache" and key in cache:
            return StreamingResponse(iter(cache[key]), media_type="text/event-stream")
        upstream_request = client.build_request(
            "POST", "/v1/completions", json=payload, headers=headers
        )
        r = await client.send(upstream_request, stream=True)
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            return Response(content, r.status_code, media_type=r.headers.get("content-type"))

        async def relay() -> AsyncIterator[str]:
            lines = []
            try:
                async for line in r.aiter_lines():
                    lines.append(alter(line) + "\n")
                    yield lines[-1]
            finally:
                await r.aclose()
            cache[key] = lines

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not server.started and not thread.is_alive():
            raise GiveUp("the proxy's server thread ended")
        return server.started

    eventually(started, "the proxy to start", interval=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_front_that_truncates_over_limit_prompts_instead_of_refusing_fails(
    healthy: Deployment,
) -> None:
    with serving(wrong_front(healthy.router.url, "truncate")) as url:
        report = canary(url, rounds=BROKEN_ROUNDS)
    reasons = failed(report)
    over = f"is over the {HEALTHY_CONTEXT}-token limit but was answered 200"
    assert over in reasons["status_codes"]
    assert f"usage.prompt_tokens is {HEALTHY_CONTEXT} for a prompt of" in reasons["honest_usage"]


def test_a_target_that_misreports_prompt_tokens_fails_only_honest_usage(
    healthy: Deployment,
) -> None:
    with serving(wrong_front(healthy.router.url, "usage")) as url:
        report = canary(url, rounds=BROKEN_ROUNDS)
    assert report.exit_code == 1
    assert failed(report).keys() == {"honest_usage"}
    usage = next(c for c in report.checks if c.name == "honest_usage")
    c = HEALTHY_CONTEXT
    finding = f"in-limit-{c} (after-A-1): usage.prompt_tokens is {c - 1} for a prompt of {c} tokens"
    assert finding in usage.findings


def test_answers_served_from_a_shared_cache_come_faster_than_prefill_and_fail(
    healthy: Deployment,
) -> None:
    with serving(wrong_front(healthy.router.url, "cache")) as url:
        report = canary(url, rounds=BROKEN_ROUNDS)
    assert report.exit_code == 1
    # B's probes come back too fast; so does B sending A's exact prompt (the prefix-cache
    # check), which judges timing only where a cold prefill here takes long enough to tell
    # (its inputs say whether it did: on a busy machine the same prompt may fall either side)
    # (judged on B's one copy of A's prompt, which this front may or may not answer from its
    # cache in time: the check's own timing rule is tested with fixed timings in
    # tests/unit/engine/test_canary_prefix_cache.py). The latency floor always catches it.
    reasons = failed(report)
    assert "latency_floor" in reasons and reasons.keys() <= {"latency_floor", "prefix_cache"}
    assert "nothing that really read the prompt answers before" in reasons["latency_floor"]
    if "prefix_cache" in reasons:
        assert "sooner than a cold prefill of" in reasons["prefix_cache"]


def test_a_front_that_reads_control_strings_in_chat_content_as_control_tokens_fails(
    healthy: Deployment,
) -> None:
    """What the router did before issue 33: the chat rendered and tokenized as one string, so
    that a tenant's `<|im_end|>` closed its turn. The canary sees it in usage.prompt_tokens."""
    with serving(wrong_front(healthy.router.url, "markup")) as url:
        report = canary(url, rounds=BROKEN_ROUNDS)
    assert report.exit_code == 1
    assert failed(report).keys() == {"chat_markup"}
    markup = next(c for c in report.checks if c.name == "chat_markup")
    chatml = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # SmolLM2's, of those sent
    assert [f.split("'")[1] for f in markup.findings] == list(chatml)
    assert "at most one a copy: the control token" in markup.reason


def test_a_front_that_leaks_a_tenants_text_into_another_answer_fails_the_marker(
    healthy: Deployment, tmp_path: Path
) -> None:
    report_file = tmp_path / "report.json"
    with serving(wrong_front(healthy.router.url, "leak")) as url:
        cli = subprocess.run(
            [
                sys.executable, "-m", "kvfence_cli", "canary", "--target", url,
                "--tenant-a-key", KEY_A, "--tenant-b-key", KEY_B, "--rounds", str(BROKEN_ROUNDS),
                "--report", str(report_file),
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "FAIL marker" in cli.stdout
    report = json.loads(report_file.read_text())
    marker = next(c for c in report["checks"] if c["name"] == "marker")
    assert not marker["passed"] and "of tenant A's marker" in marker["reason"]
    assert marker["inputs"]["planted_by"] > 0 and report["exit_code"] == 1


# --- could not run ------------------------------------------------------------------------


def test_a_target_that_is_down_is_exit_code_2_with_each_step_and_the_verdict_on_stdout() -> None:
    """Could not run: exit 2 with the reason. Nothing of the canary's own narrative is a log
    line: `2>/dev/null` hides none of it."""
    url = f"http://127.0.0.1:{free_port()}"
    cli = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "canary", "--target", url,
         "--tenant-a-key", KEY_A, "--tenant-b-key", KEY_B],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 2
    steps = [line for line in cli.stdout.splitlines() if line.startswith("canary [")]
    assert steps == ["canary [1/15] discovering the target"], cli.stdout
    assert f"kvfence canary against {url}: ERROR (exit 2)" in cli.stdout
    assert f"could not run: cannot reach the target at {url}/v1/models: ConnectError" in cli.stdout
    assert cli.stderr == ""


def test_a_refused_key_is_exit_code_2_naming_the_tenant(healthy: Deployment) -> None:
    report = run_canary(CanaryConfig(healthy.router.url, KEY_A, "not-a-key"))
    assert report.exit_code == 2 and report.outcome == "error"
    assert "tenant B's key was refused" in report.reason and report.checks == []


def test_the_timeout_bounds_the_run_and_is_exit_code_2(healthy: Deployment) -> None:
    """The reason is the fact: only the deadline's cancellation says "timed out" (a run that
    finished, however slowly, has a verdict), and the run stopped at a step, not complete."""
    report = run_canary(CanaryConfig(healthy.router.url, KEY_A, KEY_B, timeout=2.0))
    assert report.exit_code == 2 and report.reason.startswith("timed out after 2s (--timeout)")
    assert not report.complete and report.seconds >= 2.0


def test_counters_it_cannot_read_are_said_at_the_second_step_and_end_the_run_could_not_run(
    healthy: Deployment,
) -> None:
    """Issue 34: without the internal token, the counters' check was printed FAIL (a finding)
    after the whole run, though the first reading of /metrics, step 2, had already answered
    403. Now it is said right after that step, the run goes on (a leak would still fail it),
    and it ends without a verdict: exit 2, "could not run"."""
    cli = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "canary", "--target", healthy.router.url,
         "--tenant-a-key", KEY_A, "--tenant-b-key", KEY_B, "--rounds", str(BROKEN_ROUNDS)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert cli.returncode == 2, cli.stdout + cli.stderr
    lines = cli.stdout.splitlines()
    second = lines.index("canary [2/11] reading engine counters")
    said = "it needs the internal token (--internal-token-file). The other checks go on"
    assert lines[second + 1].startswith("engine_counters could not run: /metrics answered 40")
    assert said in lines[second + 1], cli.stdout
    assert lines[second + 2] == "canary [3/11] sizing tenant A's marker prompt"
    assert "  COULD NOT RUN engine_counters " in cli.stdout
    assert "FAIL" not in cli.stdout  # nothing failed: the other seven checks passed
    assert lines[-1].startswith("  no verdict: could not run 1 of 8 checks: engine_counters: ")
