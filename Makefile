# Each target sets itself up from a fresh clone: a .venv is created when missing and the package is installed
# with the tested versions pinned in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.opkit-installed
LOGDIR ?= lightning_logs

.PHONY: install test test-torch lint typecheck demo bench docs docs-tags docs-args screenshots clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,fp8]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q

# The suite on another torch release: `make test-torch TORCH=2.11.0` builds $(TORCH_VENV) with that torch and
# everything else as constraints.txt pins it, then runs the tests but the slow tier. The registry's torch wheels other
# than 2.13.0+cpu are CUDA builds: 5-8 GB with their nvidia packages, several minutes to install, and they run on a
# CPU. The machine's pip constraints may cap torch: they are set aside (PIP_CONSTRAINT=/dev/null) for this venv only.
TORCH ?= 2.11.0
# torchao 0.18 does not import with torch 2.9 (it needs torch.nn.functional.ScalingType): 0.17.0 there
TORCHAO ?= $(if $(filter 2.9.%,$(TORCH)),0.17.0,0.18.0)
TORCH_VENV ?= .venv-torch-$(TORCH)
TORCH_STAMP := $(TORCH_VENV)/.opkit-installed

$(TORCH_STAMP): pyproject.toml constraints.txt
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	grep -v '^torch==\|^torchao==' constraints.txt > $(TORCH_VENV)/constraints.txt
	PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python -m pip install --quiet -c $(TORCH_VENV)/constraints.txt \
		torch==$(TORCH) torchao==$(TORCHAO) -e '.[dev,fp8]'
	touch $(TORCH_STAMP)

test-torch: $(TORCH_STAMP)
	$(TORCH_VENV)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider

demo: $(STAMP)
	$(PY) examples/train.py fit --config examples/config.yaml --trainer.default_root_dir $(LOGDIR) \
		--trainer.logger.init_args.save_dir $(LOGDIR)
	@echo
	@echo "Open the logs with:"
	@echo "  $(VENV)/bin/tensorboard --logdir $(LOGDIR)"

# the docs site into docs/_build/html (tests/test_docs.py builds it with warnings as errors)
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "Open docs/_build/html/index.html"

# the tag reference page, from lightning_opkit/core/logging.py (a test fails while it is stale)
docs-tags: $(STAMP)
	$(PY) -c "from lightning_opkit.core.logging import tags_markdown; print(tags_markdown(), end='')" > docs/tags.md

# the pictures on the docs pages: trains the example briefly, serves the logs, headless Chromium takes them
screenshots: $(STAMP)
	$(PY) docs/screenshots.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py --suite all

clean:
	rm -rf $(VENV) $(LOGDIR) .pytest_cache .ruff_cache .mypy_cache docs/_build

# each callback page's Arguments table, from the callback's signature and docstring (a test fails while one is stale)
docs-args: $(STAMP)
	$(PY) -m lightning_opkit.arguments docs/callbacks
