# Two commands do all set-up (README): `make demo` runs the main job, `make test` the tests.
# Each creates or reuses .venv; the install re-runs only when requirements.lock or pyproject.toml change.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export JAX_PLATFORMS := cpu
# torch_tpu loads libtpu on `import torch`: never let it ask the cloud metadata server (no network here)
export TPU_SKIP_MDS_QUERY := 1
PYTEST_ARGS ?=

.PHONY: demo test test-slow check bench clean-venv

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.lock
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(BIN)/pallas-hub demo

check: $(STAMP)
	$(BIN)/pallas-hub check

bench: $(STAMP)
	$(BIN)/pallas-hub bench

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m slow $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
