#!/usr/bin/env bash
# Runs the multi-process suites again and again under `make test`'s parallel settings and
# stops at the first failure: a test that fails without a defect shows up here. Prints how
# many passes in a row succeeded. Run it beside a `make test` to add load. Each pass's log
# is kept (with the slowest tests) in $SOAK_LOGS (default: a new directory under /tmp).
#
#   scripts/soak.sh [PASSES] [PYTEST ARGS...]      (default 20 passes)
set -u
cd "$(dirname "$0")/.."
passes=${1:-20}
shift || true
suites=(
  tests/api/test_dropin_processes.py
  tests/api/test_fork.py
  tests/integrations/test_teardown.py
  tests/api/test_distributed.py
  tests/versions/test_roles.py
  tests/versions/test_roles_processes.py
  tests/api/test_sharded.py
  tests/api/test_crash.py
  tests/api/test_checkpointer_crash.py
  tests/testing/test_crash_points.py
)
logs=${SOAK_LOGS:-$(mktemp -d -t soak-XXXX)}
mkdir -p "$logs"
for i in $(seq 1 "$passes"); do
  log=$logs/pass-$i.log
  start=$(date +%s)
  if ! .venv/bin/python -m pytest -q -n "${WORKERS:-auto}" --dist worksteal -p no:cacheprovider \
      --durations=15 "${suites[@]}" "$@" > "$log" 2>&1; then
    tail -40 "$log"
    echo "soak: pass $i failed after $((i - 1)) passes in a row (log: $log)"
    exit 1
  fi
  echo "soak: pass $i ok in $(($(date +%s) - start)) s ($(tail -1 "$log"), load $(cut -d' ' -f1-3 /proc/loadavg))"
done
echo "soak: $passes passes in a row"
