"""A real daemon for the client's tests: a private containerd and our
``containerd-layerstack-grpc`` on temp roots under ``/var/tmp`` (the shape of
integration/src/lib.rs ``TestEnv::new``: the daemon first, then containerd with
the ``layerstack`` proxy snapshotter pointing at it), with the Debian test image
(integration/fixtures/make_debian_image.sh, cached in /var/cache/layerstack-test)
imported for the layerstack snapshotter. Both are stopped by pid at teardown.

Needs root, containerd and ctr on PATH, and the built binaries
(``$LAYERSTACK_BIN_DIR``, default ``<repo>/target/debug``). Without them the
tests skip, except with ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

import layerstack

REPO = Path(__file__).resolve().parents[3]
NS = "lst-py"
DEBIAN_IMAGE = "docker.io/layerstack/debian:bookworm"
DAEMON_BIN = "containerd-layerstack-grpc"
CLI_BIN = "layerstack"


def record_reliability(id: str, guarantee: str, test: str, figures: dict) -> None:  # type: ignore[type-arg]
    """The reliability suite's record of one guarantee (the format of
    ``layerstack_store::reliability::record``): ``$LAYERSTACK_RELIABILITY_OUT/<id>.json``
    when that variable names a directory; nothing otherwise."""
    out = os.environ.get("LAYERSTACK_RELIABILITY_OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    doc = {"id": id, "guarantee": guarantee, "test": test, "figures": figures}
    (Path(out) / f"{id}.json").write_text(json.dumps(doc, indent=2))


def in_ci() -> bool:
    return os.environ.get("CI", "") in ("true", "1")


def bin_dir() -> Path:
    d = os.environ.get("LAYERSTACK_BIN_DIR")
    return Path(d) if d else REPO / "target" / "debug"


def missing_requirements() -> List[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    for b in ("containerd", "ctr", "runc"):
        if shutil.which(b) is None:
            missing.append(f"`{b}` on PATH")
    for b in (DAEMON_BIN, CLI_BIN):
        if not (bin_dir() / b).is_file():
            missing.append(f"{bin_dir() / b} (cargo build --workspace --bins, or set LAYERSTACK_BIN_DIR)")
    return missing


def require_env() -> None:
    """Skip (or fail under CI=true) without what a real daemon needs."""
    missing = missing_requirements()
    if missing:
        msg = "the client's tests need " + ", ".join(missing) + "; run scripts/install-deps.sh as root"
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)


def _wait_for(what: str, ok, timeout_s: float, log: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            if ok():
                return
        except Exception as e:
            last = e
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-60:] if log.exists() else []
            raise RuntimeError(
                f"{what} not ready after {timeout_s}s (last error: {last}); last log lines:\n" + "\n".join(tail)
            )
        time.sleep(0.1)


def _terminate(p: subprocess.Popen, grace_s: float = 10.0) -> None:  # type: ignore[type-arg]
    """SIGTERM to this pid only, SIGKILL after ``grace_s``; reaps it."""
    if p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _mounts_under(d: Path) -> List[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == str(d) or mp.startswith(str(d) + "/"):
                out.append(mp)
    return sorted(out, reverse=True)


@dataclass
class Env:
    """The running pair and what the tests need of them."""

    dir: Path
    admin_socket: Path
    containerd_socket: Path
    daemon_log: Path
    containerd_log: Path
    image: str
    namespace: str
    bin_dir: Path

    def client(self) -> layerstack.Client:
        return layerstack.connect(self.admin_socket, namespace=self.namespace, bin_dir=self.bin_dir)

    def ctr(self, *args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run(
            ["ctr", "--address", str(self.containerd_socket), "--namespace", self.namespace, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
        )

    def layerstack(self, *args: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run(
            [str(self.bin_dir / CLI_BIN), "--admin-address", str(self.admin_socket), "-n", self.namespace, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
        )

    def scratch(self, name: str) -> Path:
        p = self.dir / "scratch" / name
        p.mkdir(parents=True, exist_ok=True)
        return p


def debian_image_tar(work: Path) -> Path:
    """The Debian fixture archive: ``$LAYERSTACK_TEST_DEBIAN_TAR``, else the fixture
    script's output (it reuses its cache and serializes concurrent builders)."""
    given = os.environ.get("LAYERSTACK_TEST_DEBIAN_TAR")
    if given:
        return Path(given)
    out = work / "debian-image.tar"
    p = subprocess.run(
        ["bash", str(REPO / "integration" / "fixtures" / "make_debian_image.sh"), str(out)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=1800,
    )
    if p.returncode != 0:
        raise RuntimeError("make_debian_image.sh failed:\n" + p.stderr.decode(errors="replace"))
    return out


@pytest.fixture(scope="session")
def env() -> Iterator[Env]:
    require_env()
    base = Path(os.environ.get("LAYERSTACK_TEST_TMP", "/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="lst-py-", dir=base))
    os.chmod(d, 0o755)
    # The Rust harness's stale sweep removes it once this process is gone.
    (d / "owner.pid").write_text(str(os.getpid()))
    for sub in ("ls", "c", "scratch", "store"):
        (d / sub).mkdir()
    snap = d / "ls" / "snap.sock"
    admin = d / "ls" / "admin.sock"
    csock = d / "c" / "containerd.sock"
    daemon_log = d / "daemon.log"
    clog = d / "c" / "containerd.log"
    bins = bin_dir()
    daemon: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
    containerd: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
    e = Env(d, admin, csock, daemon_log, clog, DEBIAN_IMAGE, NS, bins)
    try:
        # The daemon first, as systemd orders them (containerd dials the proxy at start).
        with open(daemon_log, "ab") as log:
            daemon = subprocess.Popen(
                [
                    str(bins / DAEMON_BIN),
                    "--root", str(d / "store"),
                    "--address", str(snap),
                    "--admin-address", str(admin),
                    "--containerd-address", str(csock),
                    "--metrics-address", "127.0.0.1:0",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info"), "RUST_BACKTRACE": "1"},
            )
        (d / "daemon.pid").write_text(str(daemon.pid))

        def sockets_up() -> bool:
            if daemon is not None and daemon.poll() is not None:
                raise RuntimeError(f"{DAEMON_BIN} exited with {daemon.returncode}")
            return snap.exists() and admin.exists()

        _wait_for(DAEMON_BIN, sockets_up, 30, daemon_log)
        config = (
            "version = 2\n"
            f'root = "{d / "c" / "root"}"\n'
            f'state = "{d / "c" / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\naddress = "{csock}"\n'
            f'[ttrpc]\naddress = "{d / "c" / "containerd.sock.ttrpc"}"\n'
            '[debug]\nlevel = "info"\n'
            f'[proxy_plugins.layerstack]\ntype = "snapshot"\naddress = "{snap}"\n'
        )
        (d / "c" / "containerd.toml").write_text(config)
        with open(clog, "ab") as log:
            containerd = subprocess.Popen(
                ["containerd", "--config", str(d / "c" / "containerd.toml")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={
                    **os.environ,
                    "LAYERSTACK_ADMIN_ADDRESS": str(admin),
                    "PATH": f"{bins}:{os.environ.get('PATH', '')}",
                },
            )
        (d / "c" / "containerd.pid").write_text(str(containerd.pid))

        def containerd_up() -> bool:
            if containerd is not None and containerd.poll() is not None:
                raise RuntimeError(f"containerd exited with {containerd.returncode}")
            return csock.exists() and subprocess.run(
                ["ctr", "--address", str(csock), "version"], capture_output=True, timeout=10
            ).returncode == 0

        _wait_for("containerd", containerd_up, 30, clog)
        c = e.client()
        _wait_for("the daemon's events subscription", lambda: c.status().events_subscribed, 30, daemon_log)
        _wait_for(
            "the layerstack snapshotter through containerd",
            lambda: e.ctr("snapshots", "--snapshotter", "layerstack", "ls").returncode == 0,
            30,
            clog,
        )
        tar = debian_image_tar(d)
        p = e.ctr("images", "import", "--snapshotter", "layerstack", str(tar))
        if p.returncode != 0:
            raise RuntimeError("ctr images import: " + p.stderr.decode(errors="replace"))
        names = e.ctr("images", "ls", "-q").stdout.decode().split()
        assert DEBIAN_IMAGE in names, names
        c.close()
        yield e
    except BaseException:
        for log in (daemon_log, clog):
            if log.exists():
                print(f"===== {log} (last 60 lines) =====")
                print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
        raise
    finally:
        _teardown(e, daemon, containerd)


def _teardown(e: Env, daemon, containerd) -> None:  # type: ignore[no-untyped-def]
    # Sessions a failed test left open: their holders are ours; end them by close.
    if daemon is not None and daemon.poll() is None:
        try:
            c = e.client()
            for s in c.list_sessions(owner_kind="sandbox"):
                if not s.released:
                    try:
                        c.close_session(s.id, action="discard", timeout_s=30)
                    except layerstack.LayerStackError:
                        pass
            c.close()
        except Exception:
            pass
    if containerd is not None:
        _terminate(containerd)
    if daemon is not None:
        _terminate(daemon)
    for m in _mounts_under(e.dir):
        subprocess.run(["umount", "-l", m], capture_output=True)
    if os.environ.get("LAYERSTACK_TEST_KEEP") != "1":
        subprocess.run(["rm", "-rf", "--one-file-system", str(e.dir)], capture_output=True)


@pytest.fixture
def ls(env: Env) -> Iterator[layerstack.Client]:
    c = env.client()
    yield c
    c.close()


def unique(prefix: str) -> str:
    """A name no other test (or run against the same daemon) uses."""
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def graph_json(env: Env, name: str) -> dict:  # type: ignore[type-arg]
    p = env.layerstack("graph", "show", name, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)  # type: ignore[no-any-return]
