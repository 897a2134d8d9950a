#!/usr/bin/env bash
# LayerStack benchmarks: start, fan-out, publish, read path, gate contention,
# reset, Mode B sessions (P7), sandboxes from Python (P7b), apply isolation (P8), the rollout
# fabric's RL step (P9), beyond one machine (P10: a checkpoint pushed, pulled and run on a
# second daemon by diff size; rollouts/s on 1 vs 2 Ray worker nodes — needs docker-registry
# and Ray, installed into the bench's venv from clients/python[ray]), WASI sessions beside
# Mode B (P11), the daemon's memory with a graph of 1,000,000 nodes against 1,000 (P12; N from
# LAYERSTACK_GRAPH_SCALE_NODES, 20,000 with --quick). Each figure is a
# ratio against a baseline measured in the same run, interleaved. Starts its own
# PRIVATE containerd (layerstack proxy + overlayfs + native snapshotters) and our
# daemon under /var/tmp/lst-*, stops them on exit, never touches another
# containerd. Writes benchmarks.md, bench/*.svg and bench/results.json.
#
#   sudo ./scripts/bench.sh                    # every scenario (tens of minutes) -> docs/
#   sudo ./scripts/bench.sh --quick            # seconds: small tree, few rounds -> target/bench/
#   sudo ./scripts/bench.sh --scenario p3      # only P3 (p1..p12, p7b or start, fan-out,
#                                              #   publish, read-path, gate, reset, mode-b, sdk,
#                                              #   apply-isolation, fabric, cluster, wasi, graph-scale;
#                                              #   repeatable)
#   sudo ./scripts/bench.sh --out DIR          # write DIR/benchmarks.md and DIR/bench/
#   sudo ./scripts/bench.sh --no-profile       # skip the perf profiles
#   sudo ./scripts/bench.sh --debug …          # use the debug build (scripts/test.sh uses this)
#
# Build: release by default — the figures describe the binaries a user deploys
# (a debug daemon spends several times longer in capture and gate work, which
# would distort every ratio with our code in it). --debug reuses what
# scripts/test.sh built, so CI does not compile the workspace twice; its figures
# only show that every scenario still runs.
#
# The first full run builds the source-tree image (apt-get download of Debian's
# linux-source, ~140 MB, unpacked to ~1.3 GB; cached in /var/cache/layerstack-test)
# and the Debian image (debootstrap). perf comes from Debian's linux-perf
# (installed if missing; without it the profiles are skipped and the page says so).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

profile=release
args=()
for a in "$@"; do
    case "$a" in
        --debug) profile=debug ;;
        -h|--help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) args+=("$a") ;;
    esac
done

if [[ $(id -u) -ne 0 ]]; then
    echo "bench.sh: run as root (it starts containerd and mounts overlays)" >&2
    exit 1
fi
if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
    # sudo's PATH hides ~/.cargo/bin
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi

./scripts/install-deps.sh
if ! command -v perf >/dev/null; then
    echo "bench.sh: installing linux-perf for the profiles" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends linux-perf >&2 \
        || echo "bench.sh: no perf; the profiles are skipped" >&2
fi

echo "bench.sh: building ($profile)" >&2
if [[ $profile == release ]]; then
    cargo build --release --workspace --bins
else
    cargo build --workspace --bins
fi
bin="${CARGO_TARGET_DIR:-$ROOT/target}/$profile"
export LAYERSTACK_BIN_DIR="$bin"
exec "$bin/layerstack-bench" "${args[@]}"
