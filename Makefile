# Two entry points for a fresh clone: `make run` and `make test`.
# They create .venv, install the CPU build of torch (from this machine's wheel
# cache when there is one), then pdserve with its test extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PROMPT ?= def fibonacci(n):

.PHONY: setup run generate test bench clean

$(BIN)/pdserve: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/pdserve

run: setup
	$(BIN)/pdserve serve

generate: setup
	$(BIN)/pdserve generate "$(PROMPT)" --max-tokens 48

# The checks first (seconds), then the suite: lint, types (pyproject.toml says
# what each covers), tests.
test: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q

bench: setup
	$(BIN)/python bench/engine_vs_transformers.py

clean:
	rm -rf $(VENV) *.egg-info
