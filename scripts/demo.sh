#!/usr/bin/env bash
# LayerStack demo: installs what is needed, builds, and shows containers sharing
# one LayerStack on a PRIVATE containerd (temp root, state and sockets; the
# system containerd, if any, is never touched).
#
#   sudo ./scripts/demo.sh            # Debian bookworm minbase image (built once, cached)
#   sudo ./scripts/demo.sh --busybox  # a tiny busybox image instead
#
# Everything it starts is stopped on exit, by pid.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

image_kind=debian
[[ "${1:-}" == "--busybox" ]] && image_kind=busybox

if [[ $(id -u) -ne 0 ]]; then
  echo "demo.sh: run as root (it starts containerd and mounts overlayfs)" >&2
  exit 1
fi

if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
  # sudo's PATH hides ~/.cargo/bin
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
./scripts/install-deps.sh
echo "==> building LayerStack"
cargo build --workspace --bins --quiet
bin="${CARGO_TARGET_DIR:-$repo/target}/debug"

work=$(mktemp -d /var/tmp/layerstack-demo.XXXXXX)
ctd_pid="" daemon_pid=""
# Stops everything the demo started, by pid only: the daemon and containerd it
# spawned, and the shims of its containers (containerd-shim-runc-v2 writes its pid
# to <state>/io.containerd.runtime.v2.task/<ns>/<id>/shim.pid).
cleanup() {
  set +e
  if [[ -n "$ctd_pid" ]]; then
    local ids
    ids=$(command ctr --address "$work/c.sock" -n layerstack-demo tasks ls -q 2>/dev/null)
    for id in $ids; do
      command ctr --address "$work/c.sock" -n layerstack-demo tasks kill -s KILL "$id" 2>/dev/null
      command ctr --address "$work/c.sock" -n layerstack-demo tasks rm -f "$id" >/dev/null 2>&1
    done
  fi
  [[ -n "$daemon_pid" ]] && kill "$daemon_pid" 2>/dev/null
  [[ -n "$ctd_pid" ]] && kill "$ctd_pid" 2>/dev/null
  sleep 1
  local f pid
  for f in "$work"/ctd/state/io.containerd.runtime.v2.task/*/*/shim.pid; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f")
    # Only if that pid is still our shim (not a reused pid).
    if [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$work/c.sock"; then
      kill -KILL "$pid" 2>/dev/null
    fi
  done
  [[ -n "$daemon_pid" ]] && kill -KILL "$daemon_pid" 2>/dev/null
  [[ -n "$ctd_pid" ]] && kill -KILL "$ctd_pid" 2>/dev/null
  awk -v w="$work" 'index($5, w) == 1 {print $5}' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/ctd/root" "$work/ctd/state"
cat > "$work/ctd/config.toml" <<EOF
version = 2
root = "$work/ctd/root"
state = "$work/ctd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$work/c.sock"
[ttrpc]
  address = "$work/c.sock.ttrpc"
[proxy_plugins]
  [proxy_plugins.layerstack]
    type = "snapshot"
    address = "$work/snap.sock"
EOF
echo "==> starting containerd-layerstack-grpc and a private containerd under $work"
# The daemon first (as systemd orders them): containerd 1.6 dials the proxy
# socket at startup and backs off if it is not there yet.
"$bin/containerd-layerstack-grpc" --root "$work/store" --address "$work/snap.sock" \
  --admin-address "$work/admin.sock" --containerd-address "$work/c.sock" \
  --metrics-address 127.0.0.1:0 >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do [[ -S "$work/snap.sock" && -S "$work/admin.sock" ]] && break; sleep 0.1; done
containerd --config "$work/ctd/config.toml" >"$work/containerd.log" 2>&1 &
ctd_pid=$!
for _ in $(seq 100); do
  command ctr --address "$work/c.sock" snapshots --snapshotter layerstack ls >/dev/null 2>&1 && break
  sleep 0.1
done

ns=layerstack-demo
ctr() { command ctr --address "$work/c.sock" -n "$ns" "$@"; }
ls_() { "$bin/layerstack" --admin-address "$work/admin.sock" -n "$ns" "$@"; }
# --runc-root: runc's default state dir is shared with any other containerd.
run() { ctr run --runc-root "$work/runc" --snapshotter layerstack "$@"; }
# ctr 1.6 has no `tasks wait`: poll until the task stopped, then delete it
# (deleting the task is what publishes its session).
finish() {
  for _ in $(seq 300); do
    ctr tasks ls | awk -v id="$1" '$1 == id {print $3}' | grep -q STOPPED && break
    sleep 0.1
  done
  ctr tasks rm "$1" >/dev/null
}

echo "==> building and importing the $image_kind test image"
tar="$work/image.tar"
"./integration/fixtures/make_${image_kind}_image.sh" "$tar" >/dev/null
img=$(ctr images import "$tar" | sed -n 's/^unpacking \([^ ]*\) .*/\1/p' | head -1)
[[ -n "$img" ]] || img=$(ctr images ls -q | head -1)
echo "    image: $img"

say() { printf '\n\033[1m%s\033[0m\n' "$*"; }

say "1. a container writes /root/notes.txt; its writes are published when its task is deleted"
run --rm "$img" writer sh -c 'echo "written by writer" > /root/notes.txt'
ls_ wait writer --timeout 60
say "   the next container reads it:"
run --rm "$img" reader cat /root/notes.txt
ls_ wait reader --timeout 60 >/dev/null

say "2. a container deletes /etc/issue and replaces /etc/apt (rm -rf, mkdir): the next one sees exactly that"
run --rm "$img" deleter sh -c 'rm /etc/issue; rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only-this'
ls_ wait deleter --timeout 60 | sed -n 1p
run --rm "$img" looker sh -c 'ls /etc/issue 2>&1; ls /etc/apt'
ls_ wait looker --timeout 60 >/dev/null

say "3. two containers from the same head, at the same time, edit different files: both land"
run -d "$img" left sh -c 'sleep 1; echo left > /root/left.txt' >/dev/null
run -d "$img" right sh -c 'sleep 1; echo right > /root/right.txt' >/dev/null
finish left; finish right
ls_ wait left --timeout 60 | sed -n 1p
ls_ wait right --timeout 60 | sed -n 1p
run --rm "$img" both sh -c 'cat /root/left.txt /root/right.txt'
ls_ wait both --timeout 60 >/dev/null

say "4. two containers edit the same file: the first to finish commits, the second is rejected whole"
run -d "$img" first sh -c 'sleep 1; echo first > /root/notes.txt' >/dev/null
run -d "$img" second sh -c 'sleep 2; echo second > /root/notes.txt; echo extra > /root/second-only.txt' >/dev/null
finish first
ls_ wait first --timeout 60 | sed -n 1p
finish second
ls_ wait second --timeout 60 || echo "   (layerstack wait exits 3 on conflict)"
run --rm "$img" check sh -c 'cat /root/notes.txt; ls /root/second-only.txt 2>&1 || true'
ls_ wait check --timeout 60 >/dev/null

say "5. while two sessions run, a marker written in one is never visible in the other"
run -d "$img" iso-a sh -c 'echo a > /root/marker-a; sleep 1; { test -e /root/marker-b && echo "iso-a SAW marker-b" || echo "iso-a did not see marker-b"; } > /root/iso-a.txt' >/dev/null
run -d "$img" iso-b sh -c 'echo b > /root/marker-b; sleep 1; { test -e /root/marker-a && echo "iso-b SAW marker-a" || echo "iso-b did not see marker-a"; } > /root/iso-b.txt' >/dev/null
finish iso-a; finish iso-b
ls_ wait iso-a --timeout 60 >/dev/null; ls_ wait iso-b --timeout 60 >/dev/null
run --rm "$img" iso-check cat /root/iso-a.txt /root/iso-b.txt
ls_ wait iso-check --timeout 60 >/dev/null

say "6. a store root on tmpfs is refused before anything is written"
mkdir -p "$work/tmpfs"
mount -t tmpfs tmpfs "$work/tmpfs"
"$bin/containerd-layerstack-grpc" --root "$work/tmpfs/store" --address "$work/t.sock" \
  --admin-address "$work/t-admin.sock" --metrics-address 127.0.0.1:0 2>&1 | sed 's/^/   /' || true
echo "   files written on the tmpfs: $(find "$work/tmpfs" -mindepth 1 | wc -l)"
umount "$work/tmpfs"

say "sessions:"
ls_ session ls
say "history of main (newest first):"
ls_ log "$img"
metrics=$(ls_ status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["metrics_address"] or "")')
if [[ -n "$metrics" ]]; then
  say "metrics (http://$metrics/metrics):"
  python3 - "$metrics" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen("http://%s/metrics" % sys.argv[1], timeout=10).read().decode()
for line in text.splitlines():
    if line.startswith(("layerstack_publishes_total", "layerstack_sessions{", "layerstack_publish_duration_seconds_count")):
        print("   " + line)
PY
fi
echo
echo "demo finished; stopping everything it started"
