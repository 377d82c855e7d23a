# Each target sets itself up from a fresh clone: a .venv is created when missing and the package is installed
# with the tested versions pinned in constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.opkit-installed
LOGDIR ?= lightning_logs

.PHONY: install test lint typecheck demo bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/train.py fit --config examples/config.yaml --trainer.default_root_dir $(LOGDIR) \
		--trainer.logger.init_args.save_dir $(LOGDIR)
	@echo
	@echo "Open the logs with:"
	@echo "  $(VENV)/bin/tensorboard --logdir $(LOGDIR)"

bench: $(STAMP)
	$(PY) benchmarks/overhead.py --suite all

clean:
	rm -rf $(VENV) $(LOGDIR) .pytest_cache .ruff_cache .mypy_cache
