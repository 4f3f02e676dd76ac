"""`kvfence preflight`: the engine's own pool arithmetic, before anything starts (and against
a running engine: tests/integration/test_commands.py)."""

from kvfence_cli.main import main


def test_preflight_says_a_context_does_not_fit_and_what_lower_context_would_serve(capsys):
    code = main(
        [
            "preflight",
            "--model", "builtin:smollm2-135m-instruct",
            "--kv-cache-memory", "64Mi",
            "--context-length", "2048",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "KV bytes per token: 46080" in out  # 2 x 30 layers x 3 heads x 64 dims x 4 bytes
    assert "DOES NOT FIT" in out and "LowerContext would serve 1456 tokens" in out


def test_preflight_against_an_unreachable_target_exits_2(capsys):
    code = main(["preflight", "--context-length", "512", "--target", "http://127.0.0.1:9"])
    assert code == 2
    assert "kvfence preflight:" in capsys.readouterr().err


def test_preflight_over_the_models_positions_does_not_fit(capsys):
    code = main(
        ["preflight", "--model", "builtin:tiny-random", "--kv-cache-memory", "1Gi",
         "--context-length", "8192"]
    )  # fmt: skip
    assert code == 1
    assert "DOES NOT FIT the model's 4096 positions" in capsys.readouterr().out
