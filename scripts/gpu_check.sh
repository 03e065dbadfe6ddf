#!/usr/bin/env bash
# One command for a machine with a CUDA GPU and no network (issue 28's proof): every test
# marked `cuda`, the GPU checks (scripts/gpu_checks.py), then the GPU benchmark (training
# loop and Python-speed rows), with the Python (and torch) that the machine already has.
#
#   make gpu-wheels               # here, with network: fills scripts/gpu_wheels/
#   bash scripts/gpu_check.sh     # there: the wheels travel with the working tree
#
# Nothing is downloaded: the project runs from the source tree (PYTHONPATH), and each
# module the image lacks (zstandard, zlib-ng, matplotlib, ...) is installed from
# scripts/gpu_wheels/ with `pip install --no-index --no-deps --target` into a temporary
# directory, never into the image's own environment.
#
# Results stream as they come: one JSON line per test and per check is appended to
# $OUT/gpu_check.jsonl (flushed at once), so a timeout loses nothing already measured.
#
# Environment:
#   PY             the interpreter (default: python3; it must hold a CUDA build of torch)
#   WHEELS         where the wheels are (default scripts/gpu_wheels)
#   OUT            where gpu_check.jsonl, bench_gpu.json/.png go (default benchmarks/results)
#   TEST_TIMEOUT   seconds allowed for `pytest -m cuda tests/` (default 140)
#   CHECK_TIMEOUT  seconds allowed for scripts/gpu_checks.py (default 300)
#   CHECK_ARGS     its arguments (default: stall at 1 and 16 GiB, control 2 GiB)
#   BENCH_ARGS     arguments for benchmarks/bench_gpu.py (default: 256 MiB fp32, 1 repeat,
#                  the training loop and the Python-speed row; the checks measure 1 GiB)
#   BENCH_TIMEOUT  seconds allowed for the benchmark (default 70)
#   DRY_RUN=1      without a CUDA device, go on: the CUDA tests (they skip), the checks and
#                  the benchmark on the CPU (`--device cpu`, figures meaningless), then
#                  still exit 3 (to rehearse the script on a machine without a GPU)
#
# Exit status: 0 all passed; 2 the environment could not be set up (a module missing with
# no wheel for it, or the package does not import); 3 no usable CUDA device (every step
# before the tests still ran); otherwise the tests', the checks' or the benchmark's
# failure. The timeouts add up to under 9 minutes (5 s of set-up before them).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
WHEELS="${WHEELS:-scripts/gpu_wheels}"
OUT="${OUT:-benchmarks/results}"
BENCH_ARGS="${BENCH_ARGS:---repeats 1 --dtypes fp32 --size-mib 256 --speed-mib 256 --train 4096 4 24 8 1}"
CHECK_ARGS="${CHECK_ARGS:---stall-gib 1 16 --control-gib 2 --load-gib 1}"
TEST_TIMEOUT="${TEST_TIMEOUT:-140}"
CHECK_TIMEOUT="${CHECK_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-70}"
started=$SECONDS
JSONL="$OUT/gpu_check.jsonl"  # $OUT is made once there is a device to measure
export GPU_CHECK_JSONL="$JSONL"

say() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)); }
# A JSON line of the script's own (a step's exit status): printf only, no interpreter.
note() { printf '{"check": "%s", "rc": %d, "at_s": %d}\n' "$1" "$2" $((SECONDS - started)) >>"$JSONL"; }

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
export PYTHONPATH="$PWD:$PWD/scripts:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
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
    CHECK_ARGS="--device cpu"
    BENCH_ARGS="--device cpu --quick"
    echo "DRY_RUN=1: going on without a device (exit 3 at the end)"
fi
device_flag=cuda
[ "${no_device:-0}" = 1 ] && device_flag=cpu

mkdir -p "$OUT"
say "CUDA tests: pytest -m cuda tests/ (one JSON line each in $JSONL)"
# --continue-on-collection-errors: a test module whose import needs what this image lacks
# (an S3 server, hypothesis) holds no cuda test; it must not stop the others.
timeout --kill-after=10 "$TEST_TIMEOUT" "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider \
    -p pytest_jsonl -o addopts="" --continue-on-collection-errors tests/
tests_rc=$?
note pytest_exit $tests_rc

say "GPU checks: gpu_checks.py $CHECK_ARGS"
# shellcheck disable=SC2086  # CHECK_ARGS is a list of words on purpose
timeout --kill-after=10 "$CHECK_TIMEOUT" "$PY" scripts/gpu_checks.py --out "$JSONL" $CHECK_ARGS
checks_rc=$?
note gpu_checks_exit $checks_rc

say "GPU benchmark: bench_gpu.py $BENCH_ARGS"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
timeout --kill-after=10 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py $BENCH_ARGS --out "$OUT"
bench_rc=$?
note bench_exit $bench_rc
[ -f "$OUT/bench_gpu.json" ] && echo "results: $OUT/bench_gpu.json and $OUT/bench_gpu.png"

say "summary (device: $device_flag; every result: $JSONL)"
status() {
    case $1 in
        0) echo ok ;;
        124 | 137) echo "TIMED OUT" ;;
        *) echo "FAILED (exit $1)" ;;
    esac
}
echo "CUDA tests: $(status $tests_rc)"
echo "GPU checks: $(status $checks_rc)"
echo "benchmark: $(status $bench_rc)"
for rc in $tests_rc $checks_rc; do
    if [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
done
if [ "${no_device:-0}" = 1 ]; then
    exit 3
fi
exit $bench_rc
