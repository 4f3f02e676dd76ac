"""bench/gpu_check.sh, the GPU readiness check, on CPU with the tiny shape: the same steps the GPU
run takes (model folder, a real `kvfence serve` process, transformers, throughput, TTFT, long
prompts, agreement, the read check's share, the fault probe, the JSON summary), and its
helpers."""

import asyncio
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvfence_engine.core.isolation import check_reads
from kvfence_engine.core.paged_decode import check_decode

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """bench/gpu_check.py as a module (it imports its bench neighbours by plain name)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_folder(gpu_check: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-check") / "tiny"
    gpu_check.write_model(
        folder, gpu_check.SHAPES["tiny"], torch.float32, torch.device("cpu"), seed=0
    )
    return folder


def test_every_token_id_has_its_own_name(gpu_check: ModuleType) -> None:
    """The engine names tokens by their text in logprobs: each name must give back one id,
    BOS and EOS must sit where config.json says, and no prompt word may be unknown."""
    vocab = gpu_check.SHAPES["tiny"].vocab
    texts = gpu_check.prompt_texts(40)
    tokenizer = gpu_check.build_tokenizer(vocab, texts)
    assert tokenizer.get_vocab_size() == vocab
    assert len(gpu_check.ids_by_name(tokenizer)) == vocab
    bos, eos = gpu_check.special_ids(vocab)
    assert tokenizer.token_to_id(gpu_check.BOS) == bos
    assert tokenizer.token_to_id(gpu_check.EOS) == eos
    prompts = gpu_check.encode_prompts(tokenizer, texts)
    assert all(p[0] == bos and len(p) > 5 for p in prompts)
    assert len({tuple(p) for p in prompts}) == len(prompts)


def test_folder_is_what_engine_and_transformers_both_load(
    gpu_check: ModuleType, tiny_folder: Path
) -> None:
    from kvfence_engine.loading.loader import load_model

    shape = gpu_check.SHAPES["tiny"]
    loaded = load_model(str(tiny_folder))
    assert set(loaded.weights) == set(gpu_check.weight_shapes(shape))
    assert loaded.config.rope_theta == gpu_check.LLAMA_3_2_1B["rope_theta"] == 500000.0
    assert loaded.config.rope.type == "llama3"  # Llama 3.2's own scaling, at the tiny size too
    assert loaded.config.tie_embeddings
    assert loaded.tokenizer.eos_ids == {gpu_check.special_ids(shape.vocab)[1]}
    reference = gpu_check.Reference(tiny_folder, torch.device("cpu"), torch.float32, 4)
    gpu_check.same_config(tiny_folder, reference)  # raises on any difference


def test_divergence_gap_is_transformers_margin_over_our_token(
    gpu_check: ModuleType, tiny_folder: Path
) -> None:
    reference = gpu_check.Reference(tiny_folder, torch.device("cpu"), torch.float32, 4)
    prompt = [gpu_check.special_ids(gpu_check.SHAPES["tiny"].vocab)[0], 5, 6, 7]
    theirs = reference.generate([prompt])
    ours = [[*theirs[0][:2], (theirs[0][2] + 1) % 100, *theirs[0][3:]]]
    assert gpu_check.agreement(ours, theirs) == {
        "prompts": 1,
        "identical": 0,
        "first_divergence": [2],
    }
    (gap,) = gpu_check.divergence_gaps(reference, [prompt], ours, theirs)
    assert (gap["prompt"], gap["at"], gap["theirs"]) == (0, 2, theirs[0][2])
    assert gap["logit_gap"] > 0  # transformers' greedy token beats the one we forced
    assert gap["gap_in_spacings"] > 0


def test_long_prompts_are_benchmark_words_of_the_asked_length(gpu_check: ModuleType) -> None:
    vocab = gpu_check.SHAPES["tiny"].vocab
    texts = gpu_check.prompt_texts(8)
    tokenizer = gpu_check.build_tokenizer(vocab, texts)
    prompts = gpu_check.encode_prompts(tokenizer, texts)
    bos, _ = gpu_check.special_ids(vocab)
    words = {w for p in prompts for w in p[1:]}
    first, second = (gpu_check.long_prompt(prompts, 700, i) for i in (0, 1))
    for long in (first, second):
        assert len(long) == 700 and long[0] == bos and bos not in long[1:]
        assert set(long[1:]) <= words
    assert first != second
    assert first[1 : len(prompts[0])] == prompts[0][1:]  # the words in their prompts' order


def test_long_runs_fit_the_served_context(gpu_check: ModuleType) -> None:
    long = gpu_check.long_runs(131072, 64)
    assert [(r.prompt_tokens, r.concurrency, r.requests) for r in long] == [
        (512, 1, 3),
        (8192, 1, 3),
        (512, 32, 32),
    ]
    assert [r.prompt_tokens for r in gpu_check.long_runs(2048, 8)] == [512, 2040, 512]


def test_capacity_check_refuses_a_batch_the_pool_or_context_cannot_hold(
    gpu_check: ModuleType,
) -> None:
    pool = {"page_size": 16, "num_pages": 6, "context_length_effective": 100}
    assert gpu_check.pages_needed([20, 36], 12, 16) == 2 + 3
    gpu_check.check_capacity(pool, [[20, 36], [40]], 12)
    with pytest.raises(ValueError, match="need 7 KV pages, the pool has 6"):
        gpu_check.check_capacity(pool, [[20, 36], [88]], 12)  # 100 tokens: 7 pages
    with pytest.raises(ValueError, match="exceed the served context of 100"):
        gpu_check.check_capacity(pool | {"num_pages": 100}, [[90]], 12)


def test_a_fault_counts_as_caught_only_by_its_isolation_errors(gpu_check: ModuleType) -> None:
    def streams(*codes: str | None) -> list[Any]:
        return [gpu_check.Streamed(0.1, 1.0, 32 if c is None else 3, c) for c in codes]

    caught, missed = gpu_check.FAULT_PROBES
    outcome = gpu_check.fault_outcome(caught, streams(None, "kv_isolation_violation", None))
    assert outcome == {
        "requests": 3,
        "caught": 1,
        "other_errors": [],
        "verdict": "caught",
        "expected": "caught",
        "as_expected": True,
    }
    assert gpu_check.fault_outcome(missed, streams(None, None))["as_expected"]
    # another failure is no evidence that the check was skipped
    other = gpu_check.fault_outcome(missed, streams(None, "internal_error"))
    assert other["verdict"] == "not caught" and not other["as_expected"]
    assert caught.serve_args() == ["--unsafe-fault", "early-release"]
    assert missed.name == "early-release,no-tag-check"


def engine_run(gpu_check: ModuleType, counters: dict[str, float], streams: list[Any]) -> Any:
    return gpu_check.EngineRun(4, [10] * 4, 2.0, 4 * 8, counters, streams)


def test_mean_decode_step_from_the_engines_counter_or_the_token_count(
    gpu_check: ModuleType,
) -> None:
    step, decode_steps = gpu_check.STEP, gpu_check.DECODE_STEPS
    counted = engine_run(gpu_check, {step: 0.5, decode_steps: 10.0}, [])
    assert gpu_check.mean_decode_step(counted) == (0.05, "kvfence_engine_decode_steps_total")
    estimated = engine_run(gpu_check, {step: 0.5}, [])  # 32 tokens over a batch of 4: 8 steps
    assert gpu_check.mean_decode_step(estimated) == (0.0625, "generated tokens / batch")


def test_latency_is_ttft_and_the_decode_rate_after_the_first_token(gpu_check: ModuleType) -> None:
    # first token at 0.1 .. 0.4 s; 8 tokens each, the 7 after the first in 0.7 s: 10 tokens/s
    streams = [gpu_check.Streamed(t, t + 0.7, 8, None) for t in (0.1, 0.2, 0.3, 0.4)]
    result = gpu_check.latency(engine_run(gpu_check, {}, streams))
    assert result["ttft_ms"] == pytest.approx({"median": 250.0, "p90": 400.0})
    assert result["decode_tokens_per_s"] == pytest.approx(4 * 10.0)  # 4 in flight
    assert result["streamed_tokens_per_s"] == 16.0


def test_send_all_keeps_at_most_concurrency_in_flight_and_the_order(
    gpu_check: ModuleType,
) -> None:
    def measure(concurrency: int) -> tuple[int, list[int]]:
        in_flight, most = 0, 0

        async def send(prompt: list[int]) -> int:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.01 * (5 - prompt[0]))  # the first sent ends last
            in_flight -= 1
            return prompt[0]

        _, results = asyncio.run(gpu_check.send_all([[i] for i in range(5)], send, concurrency))
        return most, results

    assert measure(1) == (1, [0, 1, 2, 3, 4])
    assert measure(5) == (5, [0, 1, 2, 3, 4])


def device_inputs(gpu_check: ModuleType) -> Any:
    return gpu_check.decode_check_inputs([13, 62, 40, 1], 64, num_pages=40, page_size=16)


def host_check(arguments: tuple[torch.Tensor, ...], page_size: int) -> Any:
    """core/isolation.check_reads, the host check check_decode mirrors, on its positional
    arguments."""
    pool_state, block_table, held_tags, num_held, rows, positions, seq_tenant = arguments
    state, table_rows = pool_state.long(), rows.long()
    return check_reads(
        state[0],
        state[1],
        state[2],
        block_table[table_rows].long(),
        held_tags[table_rows].long(),
        num_held[table_rows].long(),
        positions.long(),
        page_size,
        state[3],
        seq_tenant.long(),
    )


def test_device_check_state_is_one_the_host_check_passes(gpu_check: ModuleType) -> None:
    inputs = device_inputs(gpu_check)
    assert inputs.num_held.tolist() == [5, 8, 7, 5]  # ceil((prompt + 64) / 16)
    assert inputs.positions.tolist() == [76, 125, 103, 64]
    held = [
        p for row, n in enumerate(inputs.num_held.tolist()) for p in inputs.block_table[row, :n]
    ]
    assert len(set(map(int, held))) == len(held)  # no page held twice
    assert not host_check(inputs.arguments(), inputs.page_size).failed.any()
    pages = inputs.expected_slots // 16
    for row, page in enumerate(pages.tolist()):  # each row writes into its own last page
        assert page == int(inputs.block_table[row, inputs.num_held[row] - 1])
    assert (inputs.expected_slots % 16).tolist() == [12, 13, 7, 0]
    # the state is one the check reads: a reassigned page fails its holder
    inputs.pool_state[0, inputs.block_table[2, 0]] += 1
    assert host_check(inputs.arguments(), inputs.page_size).tag_mismatch.tolist() == [
        False,
        False,
        True,
        False,
    ]


def test_time_check_decode_checks_the_kernels_answer_then_times_it(gpu_check: ModuleType) -> None:
    def do_bench(fn: Any, return_mode: str) -> float:
        assert return_mode == "median"
        fn()
        return 0.02

    inputs = device_inputs(gpu_check)
    # the real kernel, in Triton's interpreter here (tests/conftest.py)
    timed = gpu_check.time_check_decode(check_decode, do_bench, inputs)
    assert timed == {
        "rows": 4,
        "pages_per_row_max": 8,
        "rows_failed": 0,
        "slots_wrong": 0,
        "check_ms": 0.02,
    }

    def stale_kernel(*args: Any, verdict: torch.Tensor, slots: torch.Tensor, **_: Any) -> None:
        verdict.zero_()
        slots.zero_()  # every row told to write slot 0

    wrong = gpu_check.time_check_decode(stale_kernel, do_bench, inputs)
    assert wrong["slots_wrong"] == 4


def test_device_check_off_cuda_says_why(gpu_check: ModuleType) -> None:
    assert gpu_check.device_check({}, {}, torch.device("cpu"), 8) == {
        "error": "CUDA only; this run is on cpu"
    }


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path: Path) -> None:
    """The command a GPU machine runs, on CPU with the tiny shape: a real engine process."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    command = ["bash", str(BENCH / "gpu_check.sh"), "--device", "cpu", "--shape", "tiny"]
    result = subprocess.run(
        [*command, "--new-tokens", "8", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert "error" not in summary
    rows = {(r["system"], r["concurrency"]): r for r in summary["throughput"]}
    assert set(rows) == {(s, c) for s in ("kvfence", "transformers") for c in (1, 32, 128)}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    for c in (1, 32, 128):
        ours = rows[("kvfence", c)]
        assert ours["ratio"] > 0 and ours["streamed_tokens_per_s"] > 0
        assert 0 < ours["ttft_ms"]["median"] <= ours["ttft_ms"]["p90"]
    # float32 on CPU: both systems compute the same function, token for token
    assert summary["agreement"]["1"]["identical"] == 8
    assert summary["agreement"]["32"]["identical"] == 32
    assert summary["agreement"]["128"]["identical"] == 128
    assert set(summary["read_check"]) == {"1", "32", "128"}
    for share in summary["read_check"].values():
        assert 0 < share["check_seconds"] < share["step_seconds"]
    long = [(r["prompt_tokens"], r["concurrency"], r["requests"]) for r in summary["long_prompts"]]
    assert long == [(512, 1, 3), (8192, 1, 3), (512, 32, 32)]  # the tiny shape's context: 131072
    assert all(r["decode_tokens_per_s"] > 0 for r in summary["long_prompts"])
    assert summary["device_check"] == {"error": "CUDA only; this run is on cpu"}
    probe = summary["fault_probe"]
    assert probe["early-release"]["verdict"] == "caught"  # the read check failed some closed
    assert probe["early-release,no-tag-check"] == probe["early-release,no-tag-check"] | {
        "caught": 0,
        "verdict": "not caught",
    }
    assert all(v["as_expected"] for v in probe.values())
    assert summary["engine"]["weight_dtype"] == "float32"
    assert "greedy agreement (token ids): c=1 8/8" in result.stdout
    assert "early-release,no-tag-check 0/8 not caught (as expected)" in result.stdout
    assert "listening on http://127.0.0.1:" in (tmp_path / "gpu_check.engine.log").read_text()


def test_the_kernel_bench_runs_its_cases_in_the_interpreter(gpu_check: ModuleType) -> None:
    """bench/gpu_kernels.py before it first meets a GPU: its cases build, the check passes a
    clean batch and the kernel's error against the float32 reference is small (bf16 inputs)."""
    gpu_kernels = importlib.import_module("gpu_kernels")  # beside gpu_check, on its path
    results = gpu_kernels.run_cases(torch.device("cpu"))
    assert [(r["batch"], r["context"]) for r in results] == gpu_kernels.CPU_CASES
    assert all(r["rel_error_vs_fp32_reference"] < 1e-2 for r in results)
