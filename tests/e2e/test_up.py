"""`kvfence up` runs a manifest as local processes with the operator's decisions."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import yaml

import kvfence_engine
from helpers.openai_usage import cached_tokens
from helpers.waits import FACT_S, READY_S, GiveUp, eventually
from kvfence_engine.tools import cache_dir
from kvfence_operator.local.up import (
    STARTING_STEP,
    UpError,
    canary_cache_file,
    engine_code_identity,
    load_manifest,
    override_flags,
    source_digest,
)

TINY: dict[str, Any] = {
    "apiVersion": "kvfence.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"source": "builtin:tiny-random"},
        "engine": {"kvCacheMemory": "512Ki"},  # 680 tokens of tiny-random KV
        "contextLength": 1024,
        "router": {"apiKeysSecret": "tiny-keys"},
        "canary": {"enabled": False},
    },
}


def manifest(tmp_path: Path, **spec) -> Path:
    doc = {**TINY, "spec": {**TINY["spec"], **spec}}
    path = tmp_path / "infd.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Up:
    """`kvfence up` as a user runs it: a process whose output we read line by line."""

    def __init__(
        self,
        path: Path,
        tmp_path: Path,
        log: str = "up.out",
        port: int | None = None,
        extra: Sequence[str] = (),
        split_stderr: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.asked_port = port or 0  # 0: any free port; `up` says which in its serving line
        self.log = tmp_path / log
        self.err_log = tmp_path / f"{log}.err"  # stderr, when split_stderr
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfence_cli", "up", str(path), "--port",
             str(self.asked_port), "--state-dir", str(tmp_path / "state"), *extra],
            stdout=open(self.log, "wb"),  # noqa: SIM115
            stderr=open(self.err_log, "wb") if split_stderr else subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )  # fmt: skip

    @property
    def output(self) -> str:
        return self.log.read_text()

    @property
    def port(self) -> int:
        """The router's port, from the serving line (so only once serving)."""
        found = re.search(r"serving: http://127\.0\.0\.1:(\d+)/v1", self.output)
        assert found, f"not serving:\n{self.output}"
        return int(found[1])

    @property
    def errors(self) -> str:
        return self.err_log.read_text()

    def wait_for(self, text: str, timeout: float = READY_S) -> None:
        def output() -> str:
            said = self.output
            if text not in said and self.proc.poll() is not None:
                raise GiveUp(f"kvfence up exited {self.proc.returncode}:\n{said}")
            return said

        eventually(output, repr(text), timeout, until=lambda said: text in said, interval=0.2)

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(FACT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_refuse_with_a_pool_smaller_than_the_context_exits_non_zero_said_once_with_the_remedy(
    tmp_path,
):
    up = Up(manifest(tmp_path, poolPolicy="Refuse"), tmp_path)
    try:
        code = up.proc.wait(180)
    finally:
        up.kill()
    out = up.output
    assert code == 1, out
    assert "pool check (Refuse) refused" in out
    assert "tiny-" in out and "KV pool of 672 tokens, smaller than contextLength 1024" in out
    assert "not serving" in out
    assert "serving: http" not in out
    # said once, naming each pod, with the remedy
    for role in ("prefill", "decode"):
        assert out.count(f"-{role}-0 ({role}) has a KV pool of 672 tokens, smaller") == 1, out
    assert out.count("raise kvCacheMemory by 53% or lower contextLength to 672") == 1, out
    # refused from the model's metadata (preflight's arithmetic) before any engine loads
    assert "before any engine loads" in out, out
    assert "starting" not in out, out
    assert not list((tmp_path / "state").glob("*/*.log")), "no process was started"


def table_cell(out: str, column: str) -> str:
    """One cell of the status table `up` prints (the row of the manifest `tiny`)."""
    lines = out.splitlines()
    header = next(line.split() for line in lines if line.startswith("NAME "))
    row = next(line.split() for line in lines if line.startswith("tiny "))
    return row[header.index(column)]


def test_a_canary_that_will_not_run_is_not_run_not_pending(tmp_path):
    """Refused pools: the canary (enabled or not) never runs; a disabled canary never runs."""
    refused = Up(manifest(tmp_path, poolPolicy="Refuse", canary={"enabled": True}), tmp_path)
    try:
        assert refused.proc.wait(180) == 1, refused.output
    finally:
        refused.kill()
    assert table_cell(refused.output, "CANARY") == "NotRun", refused.output
    assert "canary:" not in refused.output

    disabled = Up(manifest(tmp_path, poolPolicy="Refuse"), tmp_path, "disabled.out")
    try:
        assert disabled.proc.wait(180) == 1, disabled.output
    finally:
        disabled.kill()
    assert table_cell(disabled.output, "CANARY") == "NotRun", disabled.output


def test_the_canary_says_each_step_once_and_a_prefix_cached_deployment_passes_and_serves_hits(
    tmp_path,
):
    """`kvfence up ... 2>/dev/null` still shows every canary step, numbered, and the verdict.
    engine.prefixCache.enabled reaches the prefill engine (with the page-key secret `up`
    writes) and the router (prefix-aware routing). The canary's prefix_cache check passes,
    which with the cache reported on needs tenant A's repeat to hit; a repeated prompt through
    the router reports its cached tokens."""
    engine = {"kvCacheMemory": "1Mi", "prefixCache": {"enabled": True, "tenants": 3}}
    path = manifest(tmp_path, engine=engine, canary={"enabled": True})
    up = Up(path, tmp_path, split_stderr=True)
    try:
        up.wait_for("serving: http")
        out = up.output
        steps = [line.strip() for line in out.splitlines() if line.strip().startswith("canary [")]
        assert len(steps) == 15, out
        assert steps[0] == "canary [1/15] discovering the target"
        assert steps[4] == "canary [5/15] probing the prefix cache"
        assert steps[-1] == "canary [15/15] reading engine counters"
        assert "kvfence canary PASS: all 8 checks passed" in out
        assert "canary" not in up.errors, up.errors
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="kvfence-local", max_retries=0
        )
        (model,) = client.models.list().data
        prompt = list(range(1000, 1100))  # 6 full pages of 16
        ask = lambda: client.completions.create(model=model.id, prompt=prompt, max_tokens=2)  # noqa: E731
        first, again = ask(), ask()
        assert cached_tokens(first.usage) == 0
        assert cached_tokens(again.usage) == 96
        assert up.interrupt() == 130
    finally:
        up.kill()


def test_lower_context_serves_the_lowered_context_and_rejects_above_it(tmp_path):
    up = Up(manifest(tmp_path, poolPolicy="LowerContext", minContextLength=256), tmp_path)
    try:
        up.wait_for("serving: http")
        assert "served context 672 (lowered from 1024)" in up.output
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="kvfence-local", max_retries=0
        )
        (model,) = client.models.list().data
        assert model.model_extra is not None and model.model_extra["max_model_len"] == 672
        served = client.completions.create(
            model=model.id, prompt=[5] * 600, max_tokens=4, temperature=0
        )
        assert served.usage is not None and served.usage.prompt_tokens == 600
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model.id, prompt=[5] * 700, max_tokens=4)
        assert refused.value.code == "context_length_exceeded"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{up.port}/v1", api_key="wrong", max_retries=0
            ).models.list()
        assert up.interrupt() == 130
        assert "stopping" in up.output
    finally:
        up.kill()


def test_lower_context_below_min_context_length_refuses(tmp_path):
    up = Up(manifest(tmp_path, poolPolicy="LowerContext", minContextLength=1024), tmp_path)
    try:
        code = up.proc.wait(180)
    finally:
        up.kill()
    assert code == 1, up.output
    assert "below minContextLength 1024" in up.output
    assert "before any engine loads" in up.output and "starting" not in up.output


def test_a_manifest_without_an_inference_deployment_is_a_clear_error(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(UpError, match="exactly one InferenceDeployment, found 0"):
        load_manifest(path)
    path.write_text(yaml.safe_dump({**TINY, "spec": {**TINY["spec"], "contextLength": 0}}))
    with pytest.raises(UpError, match="contextLength"):
        load_manifest(path)


@pytest.mark.parametrize("source", ["./tiny.gguf", "models/tiny.gguf", "tiny.gguf"])
def test_a_relative_model_path_is_resolved_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """`kvfence serve --model ./x.gguf` reads it from here; so does `kvfence up` (a cluster's
    CRD takes builtin:NAME or an absolute path, a pod has no working directory of yours)."""
    monkeypatch.chdir(tmp_path)
    loaded = load_manifest(manifest(tmp_path, model={"source": source}))
    assert loaded.spec.model.source == str(tmp_path / source.removeprefix("./"))


def test_builtin_and_absolute_model_sources_are_kept_as_written(tmp_path: Path) -> None:
    for source in ("builtin:tiny-random", "/models/tiny.gguf"):
        assert load_manifest(manifest(tmp_path, model={"source": source})).spec.model.source == (
            source
        )


def test_pod_paths_and_ports_are_replaced_not_duplicated():
    args = ["router", "--port", "8000", "--api-keys", "/a", "--api-keys=/b", "--model", "m"]
    assert override_flags(args, {"--api-keys": ["/local"], "--port": []}) == [
        "router", "--model", "m", "--api-keys", "/local",
    ]  # fmt: skip


@pytest.mark.slow
def test_make_up_on_a_new_machine_shows_its_phases_serves_paris_and_restarts_from_its_caches(
    tmp_path, monkeypatch
):
    """The README's first command: examples/smollm2-local.yaml through `kvfence up`, on a
    first start (an empty cache, as on a new machine): it shows each engine's phases to the
    end, passes its canary and answers. Started again, it neither runs the canary nor converts
    the weights again: what makes a restart quicker than a first start, said as facts (how
    long either takes is bench/'s)."""
    monkeypatch.setenv("KVFENCE_CACHE_DIR", str(tmp_path / "cache"))  # `up` and cached_files
    example = Path(__file__).parents[2] / "examples" / "smollm2-local.yaml"
    up = Up(example, tmp_path)
    try:
        up.wait_for("serving: http", timeout=900)
        out = up.output
        assert "pool check (Refuse): every engine pool holds the served context 512" in out
        assert "canary: tenant B tries to see tenant A's secret" in out
        assert "kvfence canary PASS" in out or "Passed" in out
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{up.port}/v1", api_key="kvfence-local", max_retries=0
        )
        answer = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        assert up.interrupt() == 130
    finally:
        up.kill()
    assert_every_phase_shown(up.output)

    # same state dir: the revision's canary already passed, the weights are converted
    cached = cached_files()
    assert any(name.startswith("weights-") for name in cached), cached
    again = Up(example, tmp_path, "again.out")
    try:
        again.wait_for("serving: http")
        assert "canary: passed for this revision" in again.output
        assert "canary: tenant B tries" not in again.output, "the canary ran again"
        assert "converting" not in again.output, again.output
        now = cached_files()
        assert now == cached, "cached files written again"
        assert again.interrupt() == 130
    finally:
        again.kill()


SMOLLM2_LOAD_STEPS = (
    "reading SmolLM2-135M-Instruct.Q4_1.gguf (header and vocabulary)",
    "dequantizing the weights",
    "building the tokenizer",
    "saving the converted weights to the cache",
    "building the model on cpu and allocating its KV pool",
)


def assert_every_phase_shown(out: str) -> None:
    """The engines log to files; `up` shows what their /readyz says they are doing, from the
    process starting to ready: each load step, and the conversion's tensors within its step,
    said to the last tensor (the engine moves on between two polls: it once stayed at 94%)."""
    for role in ("prefill", "decode"):
        name = re.search(rf"(\S+-{role}-0): starting \[1/1\] ", out)
        assert name, out
        mine = [line.strip() for line in out.splitlines() if name[1] in line]
        phases = [line for line in mine if "(still at it after" not in line]
        said = [f"{name[1]}: starting [1/1] {STARTING_STEP}"] + [
            f"{name[1]}: loading builtin:smollm2-135m-instruct [{i}/5] {step}"
            for i, step in enumerate(SMOLLM2_LOAD_STEPS, 1)
        ]
        # in order; a step shorter than `up`'s poll (0.5 s) may pass unseen, but not the
        # conversion (its tensors are shown) nor the last, which `up` waits on
        seen = [line for line in phases if line in said]
        assert seen == [line for line in said if line in seen], mine
        assert said[0] in seen and said[2] in seen and said[-1] in seen, mine
        shown = re.findall(
            rf"{name[1]}: converting SmolLM2-135M-Instruct\.Q4_1\.gguf: (\d+)/(\d+) tensors", out
        )
        assert shown and len(shown) <= 11, out  # a line every tenth of the way at most
        assert shown[-1][0] == shown[-1][1], out  # to the end
        converted = phases.index(f"{name[1]}: converting SmolLM2-135M-Instruct.Q4_1.gguf: "
                                 f"{shown[-1][0]}/{shown[-1][1]} tensors")  # fmt: skip
        after = [phases.index(line) for line in said[3:] if line in phases]  # the next step seen
        assert phases.index(said[2]) < converted < after[0], mine
        ready = [i for i, line in enumerate(phases) if line.startswith(f"{name[1]} ready (")]
        assert ready and phases.index(said[-1]) < ready[0], mine


def cached_files() -> dict[str, int]:
    """The converted weights and tokenizers in the cache, by name: when each was written."""
    root = cache_dir.weights_cache_dir()
    assert root is not None, "the weights cache is off"
    return {p.name: p.stat().st_mtime_ns for p in root.iterdir() if p.is_file()}


# ---- failing fast, one `up` per state folder, signals -----------------------------------


SERVES = {"poolPolicy": "LowerContext", "minContextLength": 256}


def finished(up: Up, timeout: float = READY_S) -> int:
    """The exit code, waiting at most `timeout` (a hang guard: on a loaded machine an `up`
    that fails at once still imports torch and may start engines first)."""
    try:
        return up.proc.wait(timeout)
    finally:
        up.kill()


def test_an_engine_that_cannot_start_ends_up_quoting_its_error_and_log(tmp_path):
    """Its pool budget holds no page: only the engine finds that out, after it starts. `up`
    ends on the engine's own failure, not on its start timeout (which would say "not ready
    after")."""
    up = Up(manifest(tmp_path, engine={"kvCacheMemory": "1Ki"}), tmp_path)
    code = finished(up)
    assert code == 2, up.output
    assert "not ready after" not in up.output, up.output
    assert "failed to start" in up.output and "holds no page" in up.output, up.output
    assert "-0.log)" in up.output, "names the engine's log"
    assert "Traceback" not in up.output
    for log in (tmp_path / "state").glob("*/*-0.log"):
        assert "GET /readyz" not in log.read_text(), "probes are not logged"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"model": {"source": "builtin:tiny-randm"}},
         "spec.model.source: cannot read model 'builtin:tiny-randm': expected one of "
         "builtin:smollm2-135m-instruct, builtin:tiny-random"),
        ({"contextLength": 9000},
         "spec.contextLength: context 9000: DOES NOT FIT the model's 4096 positions"),
    ],
)  # fmt: skip
def test_a_model_or_context_the_engines_cannot_serve_is_refused_before_any_starts(
    tmp_path, spec, expected
):
    up = Up(manifest(tmp_path, **spec), tmp_path)
    assert finished(up) == 2, up.output
    assert expected in up.output
    assert "starting" not in up.output
    assert not list((tmp_path / "state").glob("*/*.log")), "no process was started"


def test_what_only_a_cluster_does_is_said_before_the_checks(tmp_path):
    """A manifest written for a cluster runs as it is: `up` says in one line each what it
    leaves to the cluster (autoscaling, the standing canary's schedule)."""
    cluster_only = {
        "contextLength": 9000,  # refused by the checks, after the notes: nothing starts
        "autoscaling": {"decode": {"maxReplicas": 2, "signal": "RunningSequences", "target": 2}},
        "canary": {"schedule": "@every 15m"},
    }
    up = Up(manifest(tmp_path, **cluster_only), tmp_path)
    assert finished(up) == 2, up.output
    assert "spec.autoscaling (Operator) is a cluster's" in up.output
    assert (
        "spec.canary.schedule ('@every 15m') is a cluster's: kvfence up runs the canary once"
        in up.output
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_before_any_engine_starts(tmp_path):
    up = Up(manifest(tmp_path), tmp_path, extra=["--device", "cuda"])
    assert finished(up) == 2, up.output
    assert "kvfence up: --device cuda: " in up.output and "use --device cpu" in up.output
    assert "starting" not in up.output


def test_a_router_port_in_use_is_refused_before_any_engine_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = Up(manifest(tmp_path, **SERVES), tmp_path, port=port)
        assert finished(up) == 2, up.output
    assert f"the router's port {port} is not free (address already in use)" in up.output
    assert "choose another with --port N (make up PORT=N)" in up.output
    assert "starting" not in up.output


def test_a_second_up_of_the_same_manifest_says_already_running_and_leaves_the_first_alone(
    tmp_path,
):
    first = Up(manifest(tmp_path, **SERVES), tmp_path)
    try:
        first.wait_for("serving: http")
        (workdir,) = (tmp_path / "state").glob("tiny-*")
        secrets = {f: (workdir / f).read_text() for f in ("internal-token", "api-keys")}
        second = Up(manifest(tmp_path, **SERVES), tmp_path, "second.out")
        assert finished(second) == 2, second.output
        assert f"tiny is already running (pid {first.proc.pid})" in second.output
        assert {f: (workdir / f).read_text() for f in secrets} == secrets
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{first.port}/v1", api_key="kvfence-local", max_retries=0
        )
        assert client.models.list().data, "the first still serves with its own token"
        assert first.proc.poll() is None
    finally:
        first.kill()


def engines_of(parent: int) -> dict[int, list[str]]:
    """The `kvfence serve` children of a process and their command lines, from /proc."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if "serve" in argv:
            found[int(stat.parent.name)] = argv
    return found


def wait_for_engines(parent: int, count: int, timeout: float = FACT_S) -> dict[int, list[str]]:
    """The engines once `count` of them run: `up` says "starting N engine processes" just
    before it starts them, one after another."""
    engines = eventually(
        lambda: engines_of(parent),
        f"{count} engine processes",
        timeout,
        until=lambda found: len(found) >= count,
    )
    assert len(engines) == count, engines
    return engines


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_threads_reach_every_engine_and_sigterm_while_serving_exits_143(tmp_path):
    up = Up(manifest(tmp_path, **SERVES), tmp_path, extra=["--threads", "1"])
    try:
        up.wait_for("serving: http")
        engines = engines_of(up.proc.pid)
        assert len(engines) == 2, engines
        for argv in engines.values():
            assert argv[argv.index("--threads") + 1] == "1", argv
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(FACT_S) == 143, up.output
    finally:
        up.kill()
    assert "interrupted (SIGTERM)" in up.output
    assert "stopped tiny-" in up.output and "router" in up.output
    assert "Traceback" not in up.output


@pytest.mark.parametrize(
    ("phase", "spec"),
    [
        ("starting 2 engine processes", SERVES),  # TINY's own pool is refused before start
        ("canary: tenant B tries", {**SERVES, "canary": {"enabled": True}}),
    ],
)
def test_ctrl_c_while_loading_or_in_the_canary_stops_everything_and_exits_130(
    tmp_path, phase, spec
):
    up = Up(manifest(tmp_path, **spec), tmp_path)
    try:
        up.wait_for(phase)
        engines = wait_for_engines(up.proc.pid, 2)
        assert up.interrupt() == 130, up.output
    finally:
        up.kill()
    assert "interrupted (SIGINT)" in up.output
    assert "stopped tiny-" in up.output, up.output
    assert "Traceback" not in up.output
    assert not [pid for pid in engines if running(pid)], "every engine was stopped"


def test_the_canary_cache_key_changes_with_the_engine_code(tmp_path):
    package = tmp_path / "kvfence_engine"
    shutil.copytree(Path(kvfence_engine.__file__).parent, package)
    before = source_digest(package)
    assert source_digest(package) == before, "stable"
    (package / "core" / "engine.py").write_text(
        (package / "core" / "engine.py").read_text() + "\n# changed\n"
    )
    after = source_digest(package)
    assert after != before
    assert canary_cache_file(tmp_path, "rev", before) != canary_cache_file(tmp_path, "rev", after)
    assert engine_code_identity() == source_digest(Path(kvfence_engine.__file__).parent)
