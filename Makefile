# make demo: set up .venv and run the main job on the bundled default.
# make test: set up .venv and run the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UNAME_S := $(shell uname -s)
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)

ifeq ($(UNAME_S),Darwin)
  MLX_EXTRA :=
else ifeq ($(HAS_NVIDIA),yes)
  MLX_EXTRA := cuda,
else
  MLX_EXTRA := cpu,
endif

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test setup clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(MLX_EXTRA)test]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python -m turboquant.demo

# test files run on this many processes at once (pytest-xdist, a file per worker: its
# fixtures built once); TEST_WORKERS=0 runs them all in this one
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(4, os.cpu_count() or 1))')

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
