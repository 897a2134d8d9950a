#!/usr/bin/env bash
# Build and test the whole workspace, integration tests included (they start a
# private containerd + our daemon and need root; with CI=true they refuse to
# skip). Exits non-zero on any failure. The full log is kept in
# target/test-logs/; a summary is printed at the end.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

./scripts/install-deps.sh

LOG_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/test-logs"
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/test-$(date +%Y%m%d-%H%M%S).log"
echo "test.sh: full log in $LOG"

# The reliability suite's tests record their figures here; rendered at the end
# (scripts/reliability.py; the full run is scripts/reliability.sh).
export LAYERSTACK_RELIABILITY_OUT="${CARGO_TARGET_DIR:-$ROOT/target}/reliability/records"
rm -rf "$LAYERSTACK_RELIABILITY_OUT"

start=$SECONDS
set +e
(
    set -e
    echo "== cargo build --workspace --bins"
    cargo build --workspace --bins
    echo "== cargo test --workspace"
    cargo test --workspace --no-fail-fast
    # The Python client (clients/python) against a real daemon, from the package
    # as `pip install` makes it, in a venv under target/. pytest's exit 5 (no test
    # collected) is a failure, as any other non-zero one.
    echo "== python client (pytest clients/python/tests)"
    PY_VENV="${CARGO_TARGET_DIR:-$ROOT/target}/py-venv"
    python3 -m venv "$PY_VENV"
    "$PY_VENV/bin/pip" install -q --disable-pip-version-check "./clients/python[test]" pytest
    py_status=0
    LAYERSTACK_BIN_DIR="${LAYERSTACK_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/debug}" \
        "$PY_VENV/bin/python" -m pytest clients/python/tests -q -p no:cacheprovider || py_status=$?
    if ((py_status == 5)); then
        echo "error: pytest collected no test in clients/python/tests"
        exit 1
    elif ((py_status != 0)); then
        echo "error: the python client's tests failed (pytest exit $py_status)"
        exit "$py_status"
    fi
    # The benchmark program, in seconds, to keep it compiling and running. It
    # fails only when a scenario cannot run, never on a ratio. Needs root.
    if [[ $(id -u) -eq 0 ]]; then
        echo "== benchmarks (scripts/bench.sh --quick --debug)"
        ./scripts/bench.sh --quick --debug --out "${CARGO_TARGET_DIR:-$ROOT/target}/bench-quick"
    elif [[ "${CI:-}" == true ]]; then
        echo "error: CI=true and the benchmarks need root"
        exit 1
    else
        echo "bench: SKIPPED (needs root)"
    fi
    echo "== reliability table (scripts/reliability.py)"
    python3 scripts/reliability.py --records "$LAYERSTACK_RELIABILITY_OUT" \
        --out "${CARGO_TARGET_DIR:-$ROOT/target}/reliability/reliability.md" \
        --run "scripts/test.sh (CI-sized) of $(git rev-parse --short HEAD 2>/dev/null || echo 'an unknown commit'), $(date -u +%Y-%m-%d), $(nproc) CPUs, debug build" --require-all
) 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e

echo
echo "================ summary ($((SECONDS - start))s) ================"
grep -E '^\s+Running |^test result:|^error(\[|:)|^\s+--> |^    [A-Za-z0-9_:]+$|FAILED|panicked at|^layerstack-bench: (wrote|FAILED|p[0-9] failed)|^bench:|^reliability:|^[0-9]+ (passed|failed)|^(FAILED|ERROR) |^error: ' "$LOG" \
    | grep -v ' \.\.\. ok$' | tail -n 80 || true
if ((status != 0)); then
    echo "test.sh: FAILED (exit $status); full log: $LOG"
    exit "$status"
fi
echo "test.sh: all passed"
