#!/usr/bin/env bash
# Install what LayerStack's build and tests need on Debian bookworm:
#   containerd, runc       a real containerd 1.6 + runc for the integration tests
#   protobuf-compiler      protoc, for the containerd API crates
#   debootstrap            builds the Debian test image
#   busybox-static         builds the busybox test image
#   python3                packs the test images into OCI archives
#   python3-venv           the venv scripts/test.sh installs the Python client into
#   git                    the text-merge tests compare with git's own merge
#   systemd                systemd-analyze, to verify layerstack.service (present on
#                          any systemd host; in a container it only adds files)
#   openssl                makes the throwaway CA of the TCP listener's tests
#                          (integration/fixtures/make_tls.sh)
#   util-linux             setpriv, runs clients as a non-root uid (tests/auth.rs);
#                          mount -o loop (tests/reliability.rs)
#   e2fsprogs              mkfs.ext4: the disk-full test's small store filesystem
#                          (tests/reliability.rs)
#   docker-registry        distribution 2.8, the private OCI registry of the push/pull
#                          tests (integration/src/registry.rs, registry/tests)
#   apache2-utils          htpasswd -B: that registry's basic-auth accounts
#   clang lld-14 wasi-libc libclang-rt-14-dev-wasm32
#                          build the WASI test modules from C (integration/wasm/,
#                          tests/wasi.rs): clang --target=wasm32-wasi, wasm-ld,
#                          the WASI libc and compiler-rt's wasm32 builtins
# Only missing packages are installed (apt-get update only then). Needs root
# when something is missing. Rust (cargo) is not installed here: it must exist.
#
# No system-wide containerd or registry is left running: on a systemd host,
# Debian's containerd and docker-registry packages enable and start their
# services. When this script installs one itself, it masks the unit for the
# install (runtime mask, gone at reboot even if the script dies), then unmasks
# it and disables it: the package is installed, the service stopped and not
# enabled. A package that was installed before is never touched.
set -euo pipefail

PACKAGES=(containerd runc protobuf-compiler debootstrap busybox-static python3 python3-venv git ca-certificates systemd openssl util-linux e2fsprogs docker-registry apache2-utils clang lld-14 wasi-libc libclang-rt-14-dev-wasm32)

# systemd is the running init when this directory exists (sd_booted(3)).
SYSTEMD_RUN_DIR=${LAYERSTACK_SYSTEMD_RUN_DIR:-/run/systemd/system}

log() { printf 'install-deps: %s\n' "$*" >&2; }

installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" == installed ]]
}

command -v dpkg-query >/dev/null || { log "error: not a Debian system (no dpkg-query)"; exit 1; }

missing=()
for p in "${PACKAGES[@]}"; do
    installed "$p" || missing+=("$p")
done

if ((${#missing[@]})); then
    if [[ "$(id -u)" != 0 ]]; then
        log "error: missing packages ${missing[*]}; run this script as root"
        exit 1
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Packages whose postinst enables and starts a system-wide service.
    units=()
    [[ " ${missing[*]} " == *" containerd "* ]] && units+=(containerd.service)
    [[ " ${missing[*]} " == *" docker-registry "* ]] && units+=(docker-registry.service)
    masked=""
    if [[ -d "$SYSTEMD_RUN_DIR" ]] && ((${#units[@]})); then
        log "masking ${units[*]} while installing: the packages would start system-wide services"
        systemctl mask --runtime --quiet "${units[@]}"
        masked=1
        trap 'systemctl unmask --runtime --quiet "${units[@]}" || true' EXIT
    fi
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
    if [[ -n "$masked" ]]; then
        systemctl unmask --runtime --quiet "${units[@]}"
        trap - EXIT
        for unit in "${units[@]}"; do
            # The package enabled it for boot; this script wanted only the binaries.
            systemctl disable --quiet "$unit"
            if systemctl is-active --quiet "$unit"; then
                systemctl stop "$unit"
            fi
            log "$unit left disabled and stopped (systemctl enable --now $unit to use it)"
        done
    fi
else
    log "all packages present: ${PACKAGES[*]}"
fi

for bin in containerd ctr runc containerd-shim-runc-v2 protoc debootstrap busybox python3 git; do
    command -v "$bin" >/dev/null || { log "error: $bin not on PATH after install"; exit 1; }
done

if ! command -v cargo >/dev/null; then
    if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
        log "error: cargo is in $HOME/.cargo/bin but not on PATH; run: . \"\$HOME/.cargo/env\""
    else
        log "error: cargo not found; install a Rust toolchain (>= 1.88) first"
    fi
    exit 1
fi
log "$(cargo --version), $(containerd --version | cut -d' ' -f1,3)"
