"""The typed contracts where they meet real processes: a running engine answers exactly the
report's fields, and the contracts module loads nothing heavy in a fresh interpreter."""

import subprocess
import sys

import httpx

from kvfence_engine.contracts import KvPoolReport, Role


def test_a_running_engines_kvpool_answers_exactly_the_pinned_fields(tiny_server) -> None:
    answer = httpx.get(tiny_server.url + "/v1/kvpool")
    assert list(answer.json()) == list(KvPoolReport.model_fields)  # pinned in unit/
    assert KvPoolReport.model_validate_json(answer.content).role is Role.COMBINED


def test_the_contracts_import_nothing_but_pydantic_and_the_standard_library() -> None:
    code = (
        "import sys, kvfence_engine.contracts\n"
        "heavy = {'torch', 'fastapi', 'httpx', 'numpy', 'kvfence_operator', 'kvfence_cli'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy\n"
        "             or m.startswith('kvfence_engine.') and m != 'kvfence_engine.contracts'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
