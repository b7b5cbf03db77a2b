# Set-up is part of every target: a virtual environment in .venv with torch (the one
# already importable, else torch==2.13.0), conveyor with its extras and dev tools.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train demo test test-all test-torch docs typecheck bench faults chaos fuzz fuzz-compile zoo mesh clean

train: $(VENV)/.installed
	$(BIN)/conveyor train --out runs/default-$$(date +%Y%m%d-%H%M%S) $(ARGS)

demo: $(VENV)/.installed
	$(BIN)/conveyor demo

# Every extra is installed here, so a test that needs one fails rather than skips.
# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole test files
# (a file's module fixtures, such as one torchrun launch shared by its tests, run once):
# on 2 cores 2 of them took a fresh clone's quick tier from 10.5-11.3 minutes to 8.6-9.0,
# every test passing. TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
IN_WORKERS := -n $(TEST_WORKERS) --dist loadfile
PYTEST := $(BIN)/python -m pytest $(IN_WORKERS)
test: $(VENV)/.installed
	CONVEYOR_REQUIRE_EXTRAS=1 $(PYTEST) $(ARGS)

# The whole suite: also the tests marked long (more seeds, other launchers, larger
# samples of what CI checks). Before a release, and after a change to the runtime.
test-all: $(VENV)/.installed
	CONVEYOR_REQUIRE_EXTRAS=1 CONVEYOR_WHOLE_SUITE=1 $(PYTEST) $(ARGS)

# The suite against another torch, in a venv of its own (.venv-torch-VERSION: torch from
# pip, a CUDA build of several GB on Linux, which runs on the CPU too). Not part of
# `make test` or CI; run it before a release and whenever torch moves:
#     make test-torch TORCH=2.14.1 [TESTS=tests/test_compile.py]
TORCH ?=
TESTS ?= tests
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.14.1 [TESTS=...]"; exit 2; }
	$(MAKE) .venv-torch-$(TORCH)/.installed
	CONVEYOR_REQUIRE_EXTRAS=1 .venv-torch-$(TORCH)/bin/python -m pytest $(IN_WORKERS) $(TESTS)

.venv-torch-%/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/pip install --quiet torch==$*
	.venv-torch-$*/bin/pip install --quiet -e ".[dev,all,docs]"
	touch $@

# Every generated fault case (tests/faults): launchers x faults x phases x ranks, one
# after the other; CI runs a fixed sample of them (tests/test_faults.py).
FAULTS_JOBS ?= 1
faults: $(VENV)/.installed
	$(BIN)/python -m tests.faults --all --jobs $(FAULTS_JOBS)

# Every generated fault of a whole conveyor train run (tests/runs): one process, torchrun
# and env://, tied and untied, kill, freeze, NaN, a full disk, differing options, a damaged
# checkpoint, a slow stage; each resumed where it can be. CI runs a sample (test_runs).
chaos: $(VENV)/.installed
	$(BIN)/python -m tests.runs --all --json benchmarks/results/chaos.json

# Every family of the zoo (tests/zoo): Hugging Face models from tiny configs, pipelined by
# stages=2 and by a named split, under 1f1b and zero-bubble; CI runs a sample (test_zoo).
zoo: $(VENV)/.installed
	$(BIN)/python -m tests.zoo --json benchmarks/results/zoo.json

# Pipeline x data x tensor parallelism on 8 processes (2 x 2 x 2, replicated and FSDP
# replicas): too costly for CI's launch budget, which runs 2 stages x 2 tensor ranks.
mesh: $(VENV)/.installed
	CONVEYOR_MESH_8=1 $(BIN)/python -m pytest tests/test_tensor_parallel.py -k 8_processes

# The documentation site (docs/, mkdocs.yml) in site/; --strict fails on a broken link,
# anchor or API reference. CI builds it too.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

typecheck: $(VENV)/.installed
	$(BIN)/python -m mypy

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/memory.py

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the torch already installed"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e ".[dev,all,docs]"
	touch $@

clean:
	rm -rf $(VENV) .venv-torch-* build site *.egg-info .pytest_cache .mypy_cache

# Generated models against the plain model: FUZZ_COUNT seeds (4 cases each) from FUZZ_START.
FUZZ_START ?= 0
FUZZ_COUNT ?= 2500
FUZZ_JOBS ?= 2
fuzz: $(VENV)/.installed
	$(BIN)/python -m tests.generated --start $(FUZZ_START) --count $(FUZZ_COUNT) \
		--jobs $(FUZZ_JOBS) --json benchmarks/results/fuzz.json

# The same, each case with compile=True (CI runs seed 1): FUZZ_COMPILE_COUNT seeds.
FUZZ_COMPILE_COUNT ?= 100
fuzz-compile: $(VENV)/.installed
	$(BIN)/python -m tests.generated --start $(FUZZ_START) --count $(FUZZ_COMPILE_COUNT) \
		--jobs $(FUZZ_JOBS) --compile --json benchmarks/results/fuzz-compile.json
