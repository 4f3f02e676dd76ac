#!/usr/bin/env bash
# Ready for a GPU: `kvfence serve` against transformers on one GPU, random weights of
# Llama-3.2-1B's shape, no network, under 8 minutes: tokens/s and TTFT at concurrency 1, 32 and
# 128, long prompts, greedy agreement, the read check's cost (host and device) and a fault
# probe (bench/gpu_check.py's docstring). Arguments go to bench/gpu_check.py, e.g.
#   bash bench/gpu_check.sh --out "$OUT/gpu_check.json"
#   bash bench/gpu_check.sh --device cpu --shape tiny --new-tokens 8      (CPU smoke test)
# Runs from a checkout, nothing installed: PYTHONPATH holds cli, engine and operator.
#
# Wheels a machine with only torch + transformers may lack: what `kvfence serve` imports
# (carry them in .whl/ at the repository root; they are installed into /tmp/site):
#   fastapi 0.165.0, starlette 1.10.0, uvicorn 0.54.0,
#   pydantic 2.14.4, pydantic-core 2.50.5 (cp312 manylinux x86_64), annotated-types 0.8.0,
#   typing-inspection 0.4.5, annotated-doc 0.0.7 (fastapi), opentelemetry-api 1.45.2 (fastapi
#   imports it), typing-extensions 4.16.0 (pydantic and pydantic-core need >= 4.16.0).
# Expected there already: torch, transformers, safetensors, tokenizers, xxhash, httpx,
# prometheus-client, jinja2, numpy, anyio, h11, click, pyyaml. Optional: triton (torch's CUDA
# wheels bring it), for the device read check; without it that phase records why and the run
# goes on.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SITE=/tmp/site
HARD_LIMIT_S=480 # gpu_check.py stops itself before (--deadline); this catches a hang in C code

export PYTHONPATH="$PWD/cli:$PWD/engine:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
# Carried wheels only where the serving stack is missing (a dev machine has it in its venv).
if compgen -G ".whl/*.whl" >/dev/null && ! "$PYTHON" -c "import fastapi, pydantic, uvicorn" 2>/dev/null; then
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl
  else # no pip: a wheel is a zip laid out for site-packages
    for wheel in .whl/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
# Nothing outside the machine can be reached: never try.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 # progress lines show up as they happen, even if the run is cut

exec timeout --kill-after=15 "$HARD_LIMIT_S" "$PYTHON" bench/gpu_check.py "$@"
