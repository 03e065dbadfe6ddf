#!/usr/bin/env bash
# One command for a machine with a CUDA GPU and no network: the CUDA tests, then the GPU
# benchmark, with the Python (and torch) that the machine already has.
#
#   make gpu-wheels               # here, with network: fills scripts/gpu_wheels/
#   bash scripts/gpu_check.sh     # there: the wheels travel with the working tree
#
# Nothing is downloaded: the project runs from the source tree (PYTHONPATH), and each
# module the image lacks (zstandard, zlib-ng, matplotlib, ...) is installed from
# scripts/gpu_wheels/ with `pip install --no-index --no-deps --target` into a temporary
# directory, never into the image's own environment.
#
# Environment:
#   PY             the interpreter (default: python3; it must hold a CUDA build of torch)
#   WHEELS         where the wheels are (default scripts/gpu_wheels)
#   OUT            where bench_gpu.json/.png go (default benchmarks/results)
#   BENCH_ARGS     arguments for benchmarks/bench_gpu.py (default: --repeats 2; 1 GiB fp32
#                  and bf16, the training loop and the Python-speed row)
#   TEST_TIMEOUT   seconds allowed for the CUDA tests (default 150)
#   BENCH_TIMEOUT  seconds allowed for the benchmark (default 330)
#   DRY_RUN=1      without a CUDA device, go on: the CUDA tests (they skip) and the
#                  benchmark's CPU dry run (`--device cpu --quick`, figures meaningless), then
#                  still exit 3 (to rehearse the script on a machine without a GPU)
#
# Exit status: 0 all passed; 2 the environment could not be set up (a module missing with
# no wheel for it, or the package does not import); 3 no usable CUDA device (every step
# before the tests still ran); otherwise the tests' or the benchmark's failure. Everything
# fits in about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
WHEELS="${WHEELS:-scripts/gpu_wheels}"
OUT="${OUT:-benchmarks/results}"
BENCH_ARGS="${BENCH_ARGS:---repeats 2}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}"
started=$SECONDS

say() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)); }

say "interpreter: $PY"
if ! "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)'; then
    echo "gpu_check: $PY cannot import torch (set PY to the interpreter that has it)" >&2
    exit 2
fi

# Modules the project, its tests and the benchmark import, and the wheel that provides each.
# Only the missing ones are installed, each without its dependencies: the image's numpy and
# torch stay the ones it was built with.
DEPS="$(mktemp -d "${TMPDIR:-/tmp}/asyncckpt-gpu-deps.XXXXXX")"
trap 'rm -rf "$DEPS"' EXIT
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
say "dependencies (missing ones from $WHEELS)"
missing=()
while read -r module wheel; do
    [ -z "$module" ] && continue
    if "$PY" -c "import $module" 2>/dev/null; then
        echo "  $module: present"
    else
        echo "  $module: missing, from $WHEELS: $wheel"
        missing+=("$wheel")
    fi
done <<'EOF'
numpy numpy
fsspec fsspec
zstandard zstandard
zlib_ng zlib-ng
safetensors safetensors
pytest pytest
pytest_timeout pytest-timeout
iniconfig iniconfig
pluggy pluggy
packaging packaging
matplotlib matplotlib
contourpy contourpy
cycler cycler
fontTools fonttools
kiwisolver kiwisolver
PIL pillow
pyparsing pyparsing
dateutil python-dateutil
six six
EOF
if [ ${#missing[@]} -gt 0 ] && ! "$PY" -m pip install --quiet --no-index --no-deps \
    --find-links "$WHEELS" --target "$DEPS" "${missing[@]}"; then
    echo "gpu_check: no wheel in $WHEELS for one of: ${missing[*]} (run make gpu-wheels here," \
        "then carry $WHEELS)" >&2
    exit 2
fi

say "the package (from the source tree)"
if ! "$PY" -c 'import asyncckpt, asyncckpt.dcp, asyncckpt._engine.writer_process; print("asyncckpt", asyncckpt.__version__, "from", asyncckpt.__file__)'; then
    echo "gpu_check: asyncckpt does not import with this torch" >&2
    exit 2
fi

say "device"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
if ! "$PY" - <<'EOF'
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    print("torch sees no CUDA device (" + ("a CPU-only build" if torch.version.cuda is None
          else "driver? CUDA_VISIBLE_DEVICES?") + ")", file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB")
EOF
then
    echo "gpu_check: no usable CUDA device" >&2
    if [ "${DRY_RUN:-0}" != 1 ]; then
        exit 3
    fi
    no_device=1
    BENCH_ARGS="--device cpu --quick $BENCH_ARGS"
    echo "DRY_RUN=1: going on without a device (exit 3 at the end)"
fi

say "CUDA tests: pytest -m cuda tests/engine/test_cuda.py"
timeout --kill-after=10 "$TEST_TIMEOUT" "$PY" -m pytest -m cuda -rA -p no:cacheprovider \
    -o addopts="" tests/engine/test_cuda.py
tests_rc=$?

say "GPU benchmark: bench_gpu.py $BENCH_ARGS"
mkdir -p "$OUT"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
timeout --kill-after=10 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py $BENCH_ARGS --out "$OUT"
bench_rc=$?
[ -f "$OUT/bench_gpu.json" ] && echo "results: $OUT/bench_gpu.json and $OUT/bench_gpu.png"

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
if [ "${no_device:-0}" = 1 ]; then
    exit 3
fi
exit $bench_rc
