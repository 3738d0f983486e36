# The make commands README.md opens with (demo, test). Both create .venv from Python 3.11 and install the pinned set.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
# Test files spread over this many processes (pytest-xdist, whole files per process, the slowest first:
# tests/conftest.py, docs/design.md). Three on two cores: a process waiting on a server or a schedule leaves its core
# to the others' compute.
TEST_WORKERS ?= 3

.PHONY: setup demo test lint bench clean docs faults

# pip installs without compiling (one file at a time); compileall then writes the installed packages' bytecode on every
# core, leaving out their own test suites, which nothing imports (docs/design.md, "Tests"). pip is upgraded only when
# the venv's own is older than 24.
$(STAMP): pyproject.toml requirements.lock
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"ortflow needs Python 3.11, found {sys.version.split()[0]}: set PYTHON=/path/to/python3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c 'import pip, sys; sys.exit(int(pip.__version__.split(".")[0]) < 24)' 2>/dev/null \
		|| $(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip install --quiet --no-compile -c requirements.lock -e ".[dev,text]"
	$(BIN)/python -m compileall -q -j 0 -x 'site-packages/.*/tests?/' \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

setup: $(STAMP)

# The GPT example trains on the standard library's own source files (their folder differs between machines).
STDLIB_GLOB = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/*.py

# Everything the demo writes (its run folder, Prefect's run history) lives under .demo/, but for the model it builds,
# examples/gpt/model.onnx; `make clean` removes both, with .venv.
DEMO := .demo

demo: setup
	@mkdir -p $(DEMO)/prefect
	@$(BIN)/python examples/gpt/build_model.py
	@PREFECT_HOME=$(CURDIR)/$(DEMO)/prefect $(BIN)/ortflow run examples/gpt/config.yaml \
		--set 'data.train=$(STDLIB_GLOB)' --set output_dir=$(CURDIR)/$(DEMO)/gpt
	@echo "ortflow sample $(DEMO)/gpt/export/model.onnx --prompt 'def ' --max-new-tokens 200"
	@$(BIN)/ortflow sample $(DEMO)/gpt/export/model.onnx --prompt 'def ' --max-new-tokens 200

# Bytecode of ortflow's own modules (an editable install: pip compiles only site-packages) is written first, so the
# hundreds of rank and CLI processes the suite starts read it even where PYTHONDONTWRITEBYTECODE is set; so is pytest's
# cache of the assertion-rewritten test modules (tools/rewrite_tests.py), which each worker would otherwise rewrite.
test: setup
	$(BIN)/python -m compileall -q ortflow tests bench >/dev/null
	$(BIN)/python tools/rewrite_tests.py tests >/dev/null
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check ortflow tests bench tools

bench: setup
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[dev,text,bench]"
	$(BIN)/python -m bench

# The long fault-injection campaign (tests/faults/campaign.py, about 30 min on 2 cores); figures in bench/out/ (the curated report: bench/reports/faults-campaign.md).
faults: setup
	$(BIN)/python -m tests.faults.campaign $(FAULTS_ARGS)

clean:
	rm -rf $(VENV) $(DEMO) runs examples/*/runs examples/gpt/model.onnx

docs: setup
	$(BIN)/python tools/update_config_reference.py
