#!/usr/bin/env bash
# Runs the multi-process suites again and again under `make test`'s parallel settings and
# stops at the first failure: a test that fails without a defect shows up here. Prints how
# many passes in a row succeeded. Run it beside a `make test` to add load.
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
for i in $(seq 1 "$passes"); do
  log=$(mktemp -t soak-XXXX.log)
  start=$(date +%s)
  if ! .venv/bin/python -m pytest -q -n "${WORKERS:-auto}" --dist worksteal -p no:cacheprovider \
      "${suites[@]}" "$@" > "$log" 2>&1; then
    tail -40 "$log"
    echo "soak: pass $i failed after $((i - 1)) passes in a row (log: $log)"
    exit 1
  fi
  echo "soak: pass $i ok in $(($(date +%s) - start)) s ($(tail -1 "$log"))"
  rm -f "$log"
done
echo "soak: $passes passes in a row"
