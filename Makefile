# jaxrl_term: two commands on a fresh machine.
#   make train   set up (venv, Docker engine, base images) and run the embedded default end to end
#   make test    set up and run the test suite (under CI=true nothing that needs Docker may skip)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: setup sandbox browser train test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is only a test reference (transformers' Qwen3 for parity): the local CPU wheel, installed first
	# so that nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

# Docker engine (installed and started as root on Debian) and the locally built base images.
sandbox: setup
	$(BIN)/python -m jaxrl_term.sandbox.images setup $$( [ "$${CI:-}" = true ] && echo --require )

# Chromium for the report's browser test (Playwright drives the system browser; nothing is downloaded by it).
browser: setup
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
		echo "[jaxrl_term] chromium missing: the report's browser test skips (and fails under CI=true)"

train: sandbox
	$(BIN)/python -m jaxrl_term.train +experiment=tiny_cpu $(ARGS)

test: sandbox browser
	$(BIN)/python -m pytest -q --timeout=900 --durations=25 $(PYTEST_ARGS)

bench: setup
	$(BIN)/python experiments/bench/forward.py

clean:
	rm -rf $(VENV) runs .pytest_cache
