#!/usr/bin/env bash
# The reliability suite's full run (issue 22): every test of a guarantee, with
# the full-size parameters, each recording its figures; then docs/reliability.md
# is rendered from those records (scripts/reliability.py). scripts/test.sh (CI)
# runs the same tests with CI-sized parameters and renders its copy to
# target/reliability/reliability.md.
#
#   sudo ./scripts/reliability.sh              # full run (tens of minutes) -> docs/reliability.md
#   sudo ./scripts/reliability.sh --out FILE   # render elsewhere
#
# Needs root (overlay mounts, loop devices, setpriv) and what scripts/test.sh
# installs (scripts/install-deps.sh). Starts only private daemons on temporary
# roots; stops what it starts.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
OUT="$ROOT/docs/reliability.md"
while (($#)); do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "reliability.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ $(id -u) -ne 0 ]]; then
    echo "reliability.sh: run as root (overlay mounts, loop devices, other uids)" >&2
    exit 1
fi
if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
./scripts/install-deps.sh

TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
export LAYERSTACK_RELIABILITY_OUT="$TARGET/reliability/full-records"
rm -rf "$LAYERSTACK_RELIABILITY_OUT"
mkdir -p "$LAYERSTACK_RELIABILITY_OUT"

# Full-size parameters (the tests' defaults are CI-sized).
export LAYERSTACK_MODEL_PUBLISHERS=1024
export LAYERSTACK_MODEL_PROCESSES=256
export LAYERSTACK_EXACTLY_ONCE_SAMPLES=1024
export LAYERSTACK_HOSTILE_FILES=1000000
export LAYERSTACK_ISOLATION_N=1000
export LAYERSTACK_FUZZ_CASES=10000

start=$SECONDS
echo "== build"
cargo build --workspace --bins

echo "== engine: crash points, I/O errors, power cuts, concurrency model, hostile uppers, whole-import fuzz"
cargo test -p layerstack-engine --lib -- \
    tests::crash tests::model tests::powercut tests::hostile a_hostile_upper_never_steers \
    import::tests::hostile_tars_make_one_whole_base_or_nothing

echo "== store, publisher: fuzzed parsers and admin inputs"
cargo test -p layerstack-publisher --test fuzz_import
cargo test -p layerstack-store --test fuzz_admin

echo "== integration: callers, disk full, memory, publisher processes against the model, session file calls fuzzed"
cargo test -p layerstack-integration --test auth --test reliability
cargo test -p layerstack-integration --test wasi session_file_calls

echo "== python: exactly-once through daemon kills in a 1,024-rollout step, 1,000 isolated sandboxes"
PY_VENV="$TARGET/py-venv"
python3 -m venv "$PY_VENV"
"$PY_VENV/bin/pip" install -q --disable-pip-version-check "./clients/python[test]" pytest
LAYERSTACK_BIN_DIR="${LAYERSTACK_BIN_DIR:-$TARGET/debug}" "$PY_VENV/bin/python" -m pytest \
    clients/python/tests/test_fabric.py clients/python/tests/test_sandbox.py \
    -q -p no:cacheprovider -k "exactly_once or never_see"

echo "== render"
python3 scripts/reliability.py --records "$LAYERSTACK_RELIABILITY_OUT" --out "$OUT" --require-all \
    --run "scripts/reliability.sh (full) of $(git rev-parse --short HEAD 2>/dev/null || echo 'an unknown commit')$(git diff --quiet HEAD -- . 2>/dev/null || echo ' with local changes'), $(date -u +%Y-%m-%d), $(nproc) CPUs, $(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576 )) GiB, kernel $(uname -r), debug build, $((SECONDS - start)) s"
