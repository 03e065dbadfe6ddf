#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: the CUDA-only tests, then the GPU benchmark.
#
#   bash scripts/gpu_check.sh
#
# Sets up the virtualenv as the Makefile does (`make .venv/.installed`). The Makefile's
# default TORCH_SPEC (torch from PyPI) is a CUDA build on Linux x86-64; override it for
# another CUDA version, e.g. TORCH_SPEC="torch==2.13.0 --index-url <a CUDA wheel index>".
# An existing .venv with a CPU-only torch is refused (see the message); use VENV=.venv-gpu.
#
# Environment:
#   VENV        the virtualenv (default .venv)
#   TORCH_SPEC  what pip installs for torch (default: the Makefile's)
#   BENCH_ARGS  arguments for benchmarks/bench_gpu.py
#               (default: --size-mib 1024 --dtypes fp32 bf16 --repeats 3)
#   BENCH_TIMEOUT  seconds allowed for the benchmark (default 300)
#   OUT         where bench_gpu.json/.png go (default benchmarks/results)
#
# Exits non-zero if the tests fail, if there is no usable CUDA device, or if the benchmark
# fails. Everything fits in about 8 minutes once torch is installed.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
BENCH_ARGS="${BENCH_ARGS:---size-mib 1024 --dtypes fp32 bf16 --repeats 3}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
OUT="${OUT:-benchmarks/results}"
started=$SECONDS

say() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)); }

say "environment: make $VENV/.installed"
make_args=(VENV="$VENV")
if [ -n "${TORCH_SPEC:-}" ]; then
    make_args+=(TORCH_SPEC="$TORCH_SPEC")
fi
if ! make "${make_args[@]}" "$VENV/.installed"; then
    echo "gpu_check: setting up $VENV failed" >&2
    exit 2
fi
PY="$VENV/bin/python"

say "device"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
if ! "$PY" - <<'EOF'
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    if torch.version.cuda is None:
        print("this torch is a CPU-only build: install a CUDA build, e.g. "
              "VENV=.venv-gpu bash scripts/gpu_check.sh (a fresh venv with the default "
              "TORCH_SPEC), or set TORCH_SPEC", file=sys.stderr)
    else:
        print("torch has CUDA but sees no device (driver? CUDA_VISIBLE_DEVICES?)",
              file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB")
EOF
then
    echo "gpu_check: no usable CUDA device" >&2
    exit 3
fi

say "CUDA tests: pytest -m cuda tests/test_cuda.py"
"$PY" -m pytest -m cuda -rA -p no:cacheprovider tests/test_cuda.py
tests_rc=$?

say "GPU benchmark: bench_gpu.py $BENCH_ARGS"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
timeout --kill-after=10 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py $BENCH_ARGS --out "$OUT"
bench_rc=$?
if [ -f "$OUT/bench_gpu.json" ]; then
    echo "results: $OUT/bench_gpu.json and $OUT/bench_gpu.png"
fi

say "summary"
echo "CUDA tests: $([ $tests_rc -eq 0 ] && echo passed || echo "FAILED (exit $tests_rc)")"
case $bench_rc in
    0) echo "benchmark: ok" ;;
    124 | 137) echo "benchmark: TIMED OUT after ${BENCH_TIMEOUT}s (smaller BENCH_ARGS?)" ;;
    *) echo "benchmark: FAILED (exit $bench_rc)" ;;
esac
if [ $tests_rc -ne 0 ]; then
    exit $tests_rc
fi
exit $bench_rc
