"""Who may call (issue 20), against a real daemon with no containerd: the
client over the daemon's TCP listener (TLS, a bearer token) — a listed token
works, a wrong or missing one is ``UnauthenticatedError`` — and over the admin
socket as a non-root uid: one ``[api] allowed_uids`` lists may call, another
gets ``PermissionDeniedError``.

Needs root, the built daemon (``$LAYERSTACK_BIN_DIR``, default
``<repo>/target/debug``), ``setpriv`` and ``openssl``
(integration/fixtures/make_tls.sh). Without them the tests skip, except with
``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import layerstack
from conftest import DAEMON_BIN, REPO, _terminate, bin_dir, in_ci

TOKEN = "py-right-token"
ALLOWED_UID = 65534
REFUSED_UID = 65533


def _missing() -> List[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    for b in ("setpriv", "openssl"):
        if shutil.which(b) is None:
            missing.append(f"`{b}` on PATH")
    if not (bin_dir() / DAEMON_BIN).is_file():
        missing.append(f"{bin_dir() / DAEMON_BIN} (cargo build --workspace --bins, or set LAYERSTACK_BIN_DIR)")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def daemon() -> Iterator[Tuple[Path, Path, int]]:
    """(admin socket, TLS dir, TCP port) of a daemon allowing uid 65534 on its
    admin socket and token ``TOKEN`` on TCP."""
    missing = _missing()
    if missing:
        msg = "these tests need " + ", ".join(missing)
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)
    d = Path(tempfile.mkdtemp(prefix="lst-py-auth-", dir="/var/tmp"))
    d.chmod(0o755)  # uid 65534 must reach the socket
    tls = d / "tls"
    subprocess.run(["bash", str(REPO / "integration" / "fixtures" / "make_tls.sh"), str(tls)], check=True)
    (d / "tokens").write_text(f"# test\n{TOKEN}\n")
    port = _free_port()
    cfg = d / "config.toml"
    cfg.write_text(
        f"[api]\nallowed_uids = [{ALLOWED_UID}]\n"
        f'[api.tcp]\naddress = "127.0.0.1:{port}"\ncert = "{tls}/server.pem"\nkey = "{tls}/server.key"\n'
        f'tokens_file = "{d}/tokens"\n'
    )
    admin = d / "s" / "admin.sock"
    log = d / "daemon.log"
    with open(log, "ab") as logf:
        p = subprocess.Popen(
            [
                str(bin_dir() / DAEMON_BIN),
                "--config", str(cfg),
                "--root", str(d / "root"),
                "--address", str(d / "s" / "snapshotter.sock"),
                "--admin-address", str(admin),
                "--containerd-address", str(d / "s" / "containerd.sock"),
                "--metrics-address", "127.0.0.1:0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"the daemon exited ({p.returncode}):\n{log.read_text(errors='replace')}")
            try:
                with layerstack.connect(admin) as c:
                    c.status()
                break
            except layerstack.LayerStackError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield admin, tls, port
    finally:
        _terminate(p)
        shutil.rmtree(d, ignore_errors=True)


def test_tcp_with_a_listed_token_works(daemon: Tuple[Path, Path, int]) -> None:
    _, tls, port = daemon
    with layerstack.connect(target=f"127.0.0.1:{port}", root_certificates=tls / "ca.pem", token=TOKEN) as c:
        st = c.status()
        assert st.version
        with pytest.raises(layerstack.CommandError) as e:
            c.create_session("some-stack")
        assert "over TCP" in e.value.message


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_tcp_with_a_wrong_or_missing_token_is_unauthenticated(
    daemon: Tuple[Path, Path, int], token: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tls, port = daemon
    monkeypatch.delenv("LAYERSTACK_TOKEN", raising=False)
    with layerstack.connect(
        target=f"127.0.0.1:{port}", root_certificates=(tls / "ca.pem").read_bytes(), token=token  # type: ignore[arg-type]
    ) as c:
        with pytest.raises(layerstack.UnauthenticatedError) as e:
            c.status()
    assert e.value.kind == "unauthenticated"
    assert "tokens_file" in e.value.message


def test_the_token_may_come_from_the_environment(
    daemon: Tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tls, port = daemon
    monkeypatch.setenv("LAYERSTACK_TOKEN", TOKEN)
    with layerstack.connect(target=f"127.0.0.1:{port}", root_certificates=tls / "ca.pem") as c:
        assert c.status().version


def test_tls_options_without_a_target_are_refused() -> None:
    with pytest.raises(ValueError, match="target"):
        layerstack.connect("/nonexistent.sock", token="x")


_AS_UID = """
import sys, layerstack
try:
    with layerstack.connect(sys.argv[1]) as c:
        c.status()
    print("ok")
except layerstack.LayerStackError as e:
    print(type(e).__name__, e.kind, e.message)
"""


def _status_as(uid: int, admin: Path) -> str:
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", _AS_UID, str(admin)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_non_root_uid_the_config_allows_may_call(daemon: Tuple[Path, Path, int]) -> None:
    admin, _, _ = daemon
    assert _status_as(ALLOWED_UID, admin) == "ok"


def test_a_uid_not_allowed_is_permission_denied(daemon: Tuple[Path, Path, int]) -> None:
    admin, _, _ = daemon
    out = _status_as(REFUSED_UID, admin)
    assert out.startswith("PermissionDeniedError permission_denied "), out
    assert f"uid {REFUSED_UID}" in out and "[api] allowed_uids" in out, out
