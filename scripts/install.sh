#!/usr/bin/env bash
# Install LayerStack: build release binaries and install them where containerd
# finds the runtime shim, with the default config, the systemd unit and the
# operations guide. Uninstall removes exactly what an install recorded.
#
#   sudo ./scripts/install.sh                 # build (cargo --release) and install
#   sudo ./scripts/install.sh --uninstall     # remove what was installed
#   ./scripts/install.sh --bin-dir DIR        # install binaries already built in DIR
#
# Variables (GNU conventions):
#   PREFIX      /usr/local            binaries in $PREFIX/bin (on containerd's PATH under
#                                     systemd), docs in $PREFIX/share/doc/layerstack
#   SYSCONFDIR  /etc                  $SYSCONFDIR/layerstack/config.toml
#   UNITDIR     /etc/systemd/system   layerstack.service
#   DESTDIR     (empty)               staging root prepended to every path (packaging,
#                                     tests); with DESTDIR set, systemctl is never run
#
# Installed files (paths without DESTDIR):
#   $PREFIX/bin/containerd-layerstack-grpc      the daemon
#   $PREFIX/bin/containerd-shim-layerstack-v1   the runtime shim (io.containerd.layerstack.v1)
#   $PREFIX/bin/layerstack                      the CLI
#   $SYSCONFDIR/layerstack/config.toml          commented defaults; never overwritten
#   $UNITDIR/layerstack.service                 ExecStart= and paths rewritten for these
#   $PREFIX/share/doc/layerstack/operations.md
#   $PREFIX/share/layerstack/install-manifest   "sha256  path" of each file above
#
# Uninstall removes a file only if it still has the content the install wrote (an
# edited config.toml stays, and is named), then the manifest and the LayerStack
# directories left empty. Neither direction touches the store (/var/lib/layerstack)
# or containerd's config. On a live systemd host (no DESTDIR) install runs
# `systemctl daemon-reload`; uninstall first runs `systemctl disable --now
# layerstack.service`. Nothing is enabled or started by install.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
SYSCONFDIR=${SYSCONFDIR:-/etc}
UNITDIR=${UNITDIR:-/etc/systemd/system}
DESTDIR=${DESTDIR:-}
SYSTEMD_RUN_DIR=${LAYERSTACK_SYSTEMD_RUN_DIR:-/run/systemd/system}

BINARIES=(containerd-layerstack-grpc containerd-shim-layerstack-v1 layerstack)
MANIFEST="$PREFIX/share/layerstack/install-manifest"

log() { printf 'install.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

mode=install
bin_dir=""
while (($#)); do
    case "$1" in
        --uninstall) mode=uninstall ;;
        --bin-dir) bin_dir=${2:?--bin-dir needs a directory}; shift ;;
        --bin-dir=*) bin_dir=${1#--bin-dir=} ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument $1 (--help)" ;;
    esac
    shift
done

for v in PREFIX SYSCONFDIR UNITDIR; do
    [[ "${!v}" == /* ]] || die "$v must be an absolute path, not ${!v}"
done
[[ -z "$DESTDIR" || "$DESTDIR" == /* ]] || die "DESTDIR must be an absolute path, not $DESTDIR"

live_systemd() { [[ -z "$DESTDIR" && -d "$SYSTEMD_RUN_DIR" ]] && command -v systemctl >/dev/null; }

# The manifest lines of the previous install, if any: "sha256  path".
previous=()
if [[ -f "$DESTDIR$MANIFEST" ]]; then
    mapfile -t previous <"$DESTDIR$MANIFEST"
fi

uninstall() {
    ((${#previous[@]})) || die "nothing to uninstall: no manifest at $DESTDIR$MANIFEST"
    if live_systemd && systemctl cat layerstack.service >/dev/null 2>&1; then
        log "systemctl disable --now layerstack.service"
        systemctl disable --now --quiet layerstack.service || true
    fi
    local line sum path kept=0
    for line in "${previous[@]}"; do
        sum=${line%%  *}
        path=${line#*  }
        [[ -n "$path" && "$path" == /* ]] || die "malformed manifest line: $line"
        if [[ ! -e "$DESTDIR$path" ]]; then
            log "already gone: $path"
        elif [[ "$(sha256sum "$DESTDIR$path" | cut -d' ' -f1)" != "$sum" ]]; then
            log "kept (changed since install): $path"
            kept=1
        else
            rm -f -- "$DESTDIR$path"
            log "removed $path"
        fi
    done
    rm -f -- "$DESTDIR$MANIFEST"
    log "removed $MANIFEST"
    # Only LayerStack's own directories, and only when empty.
    local d
    for d in "$PREFIX/share/layerstack" "$PREFIX/share/doc/layerstack" "$SYSCONFDIR/layerstack"; do
        rmdir -- "$DESTDIR$d" 2>/dev/null || true
    done
    if live_systemd; then
        systemctl daemon-reload
    fi
    ((kept)) && log "changed files were kept; remove them by hand if they are not wanted"
    log "uninstalled (the store at /var/lib/layerstack and containerd's config are untouched)"
}

# Installs $1 as $2 (no DESTDIR) with mode $3, atomically (a running binary is
# replaced by rename, never rewritten), and records it in the new manifest.
new_manifest=()
put() {
    local src=$1 dst=$2 mode=$3 tmp
    mkdir -p -- "$(dirname -- "$DESTDIR$dst")"
    tmp="$DESTDIR$dst.layerstack-new"
    install -m "$mode" -- "$src" "$tmp"
    mv -f -- "$tmp" "$DESTDIR$dst"
    new_manifest+=("$(sha256sum "$DESTDIR$dst" | cut -d' ' -f1)  $dst")
    log "installed $dst"
}

install_all() {
    if [[ -z "$bin_dir" ]]; then
        if ! command -v cargo >/dev/null && [[ -f "$HOME/.cargo/env" ]]; then
            # shellcheck disable=SC1091
            . "$HOME/.cargo/env"
        fi
        command -v cargo >/dev/null || die "cargo not found (install Rust >= 1.88, or give --bin-dir)"
        command -v protoc >/dev/null || die "protoc not found: apt-get install protobuf-compiler"
        log "building release binaries (cargo build --release --locked)"
        (cd "$repo" && cargo build --release --locked --bins)
        bin_dir="${CARGO_TARGET_DIR:-$repo/target}/release"
    fi
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "$bin_dir/$b" ]] || die "$bin_dir/$b is missing (build the workspace first)"
    done

    for b in "${BINARIES[@]}"; do
        put "$bin_dir/$b" "$PREFIX/bin/$b" 0755
    done

    # The config is the administrator's once installed: never overwritten. If the
    # previous install wrote it, its manifest line is kept (uninstall then removes
    # it only if unchanged); one found otherwise is not ours and is not recorded.
    local cfg="$SYSCONFDIR/layerstack/config.toml" line
    if [[ -e "$DESTDIR$cfg" ]]; then
        log "kept existing $cfg (the shipped defaults: layerstack config daemon)"
        for line in "${previous[@]}"; do
            [[ "${line#*  }" == "$cfg" ]] && new_manifest+=("$line")
        done
    else
        put "$repo/config/snippets/layerstack.toml" "$cfg" 0644
    fi

    local unit tmpdir
    tmpdir=$(mktemp -d)
    trap 'rm -rf -- "$tmpdir"' RETURN
    unit="$tmpdir/layerstack.service"
    sed -e "s|/usr/local/bin/containerd-layerstack-grpc|$PREFIX/bin/containerd-layerstack-grpc|" \
        -e "s|/etc/layerstack/config.toml|$cfg|" \
        -e "s|file:/usr/local/share/doc/layerstack/|file:$PREFIX/share/doc/layerstack/|" \
        "$repo/config/systemd/layerstack.service" >"$unit"
    grep -q "^ExecStart=$PREFIX/bin/containerd-layerstack-grpc --config $cfg\$" "$unit" \
        || die "could not rewrite ExecStart= in layerstack.service"
    put "$unit" "$UNITDIR/layerstack.service" 0644
    put "$repo/docs/operations.md" "$PREFIX/share/doc/layerstack/operations.md" 0644

    mkdir -p -- "$(dirname -- "$DESTDIR$MANIFEST")"
    printf '%s\n' "${new_manifest[@]}" >"$DESTDIR$MANIFEST.layerstack-new"
    mv -f -- "$DESTDIR$MANIFEST.layerstack-new" "$DESTDIR$MANIFEST"
    log "recorded $MANIFEST"
    if live_systemd; then
        systemctl daemon-reload
    fi
    log "installed. Next: register the snapshotter with containerd"
    log "  ($PREFIX/bin/layerstack config containerd, merged into /etc/containerd/config.toml),"
    log "  then: systemctl enable --now layerstack.service && systemctl restart containerd"
}

case "$mode" in
    install) install_all ;;
    uninstall) uninstall ;;
esac
