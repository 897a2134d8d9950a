"""The sandbox SDK (issue 20) against a real daemon with no containerd: a base
imported from a busybox tree, daemon-owned sandboxes driven over gRPC alone —
exec with streamed output, exit codes and timeouts; files, tar up and down,
a symlink to the host's /etc/passwd that never leads out; the live diff;
checkpoint with the node id as a field; discard leaving nothing mounted; the
asyncio client fanning out; a non-root uid the config allows; a remote client
over TCP+TLS with a token; a memory limit that OOM-kills what allocates past
it (sync and asyncio).

Needs root, ``busybox`` (busybox-static), ``setpriv``, ``openssl`` and the
built daemon; skips without them, except with ``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import tempfile
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional

import pytest

import layerstack
import layerstack.aio
from layerstack.sandbox import ExecChunk, ExecError, ExecOutput
from conftest import DAEMON_BIN, REPO, _mounts_under, _terminate, _wait_for, bin_dir, in_ci, record_reliability

TOKEN = "sdk-token"
CGROUP_PARENT = f"/layerstack-py-{os.getpid()}"
USER_UID = 65534
# Sandboxes alive at once in the isolation test (issue 22: 1,000).
ISOLATION_N = int(os.environ.get("LAYERSTACK_ISOLATION_N", "1000"))


class Daemon(NamedTuple):
    dir: Path
    admin: Path
    port: int
    tls: Path
    stack: str


def _missing() -> List[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    for b in ("busybox", "setpriv", "openssl"):
        if shutil.which(b) is None:
            missing.append(f"`{b}` on PATH")
    if not (bin_dir() / DAEMON_BIN).is_file():
        missing.append(f"{bin_dir() / DAEMON_BIN} (cargo build --workspace --bins)")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rootfs(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "work").mkdir()
    shutil.copy(shutil.which("busybox") or "/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "ls", "sleep", "true", "kill", "mkdir", "rm", "dd"):
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc" / "passwd").write_text("root:x:0:0:session root:/root:/bin/sh\n")
    (root / "etc" / "motd").write_text("base\n")
    # A symlink that would lead to the daemon's host if it were followed there.
    os.symlink("/etc/passwd", root / "work" / "hostile")
    return root


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    missing = _missing()
    if missing:
        msg = "sandbox SDK tests need " + ", ".join(missing)
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)
    d = Path(tempfile.mkdtemp(prefix="lst-py-sdk-", dir=os.environ.get("LAYERSTACK_TEST_TMP", "/var/tmp")))
    d.chmod(0o755)
    (d / "owner.pid").write_text(str(os.getpid()))
    tls = d / "tls"
    subprocess.run(["bash", str(REPO / "integration" / "fixtures" / "make_tls.sh"), str(tls)], check=True)
    (d / "tokens").write_text(f"{TOKEN}\n")
    port = _free_port()
    (d / "config.toml").write_text(
        f"[api]\nallowed_uids = [{USER_UID}]\n"
        f'[api.tcp]\naddress = "127.0.0.1:{port}"\ncert = "{tls}/server.pem"\nkey = "{tls}/server.key"\n'
        f'tokens_file = "{d}/tokens"\n'
        # Session cgroups under the hierarchy's root: the daemon's own cgroup
        # (this test's) has other processes and cannot enable controllers.
        f'[sandbox]\ncgroup_parent = "{CGROUP_PARENT}"\nmax_sessions = {ISOLATION_N + 64}\n'
    )
    (d / "ls").mkdir()
    admin = d / "ls" / "admin.sock"
    log = d / "daemon.log"
    with open(log, "ab") as f:
        p = subprocess.Popen(
            [
                str(bin_dir() / DAEMON_BIN),
                "--config", str(d / "config.toml"),
                "--root", str(d / "store"),
                "--address", str(d / "ls" / "snap.sock"),
                "--admin-address", str(admin),
                "--containerd-address", str(d / "ls" / "containerd.sock"),  # none runs
                "--metrics-address", "127.0.0.1:0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
        )
    try:
        _wait_for(DAEMON_BIN, lambda: admin.exists() and p.poll() is None, 30, log)
        with layerstack.connect(admin) as c:
            stack = c.import_base(_rootfs(d / "rootfs"))
        yield Daemon(d, admin, port, tls, stack)
    finally:
        _terminate(p)
        left = _mounts_under(d)
        for m in left:
            subprocess.run(["umount", "-l", m], capture_output=True)
        for h in ("", "unified", "memory", "cpu", "cpuacct", "pids"):
            try:
                os.rmdir(Path("/sys/fs/cgroup") / h / CGROUP_PARENT.lstrip("/"))
            except OSError:
                pass
        if os.environ.get("LAYERSTACK_TEST_KEEP") != "1":
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], capture_output=True)
        assert not left, f"mounts left under the test's directory after the daemon stopped: {left}"


def _graph(c: layerstack.Client, stack: str) -> str:
    return c.create_graph(f"sdk-{os.getpid()}-{os.urandom(3).hex()}", stack).root


def test_exec_streams_output_and_reports_how_a_command_ended(daemon: Daemon) -> None:
    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack) as sb:
        assert sb.created and sb.id > 0
        out = sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (out.exit_code, out.signal, out.timed_out) == (3, 0, False), out
        assert (out.stdout, out.stderr) == (b"out\n", b"err\n")
        assert sb.exec("cat /etc/motd").stdout == b"base\n", "a string runs under /bin/sh -c"
        assert sb.exec(["cat"], stdin=b"piped").stdout == b"piped"
        assert sb.exec(["sh", "-c", "echo $GREETING"], env={"GREETING": "hi"}).stdout == b"hi\n"
        assert sb.exec(["sh", "-c", "pwd"], cwd="/etc").stdout == b"/etc\n"
        assert sb.exec(["sh", "-c", "id -u 2>/dev/null || echo $(cat /proc/self/status | grep Uid)"], user=(1000, 1000)).ok
        missing = sb.exec(["no-such-command"])
        assert missing.exit_code == 127 and missing.stderr, missing
        killed = sb.exec(["sh", "-c", "kill -9 $$"])
        assert (killed.exit_code, killed.signal) == (137, 9), killed
        slow = sb.exec(["sleep", "30"], timeout_s=0.5)
        assert slow.timed_out and slow.signal == 9 and slow.duration_ms < 10_000, slow
        with pytest.raises(ExecError) as e:
            sb.exec("exit 5", check=True)
        assert e.value.output.exit_code == 5
        # Streamed: chunks as they come, then the exit.
        items = list(sb.exec_stream(["sh", "-c", "echo a; sleep 0.2; echo b"]))
        chunks = [i for i in items if isinstance(i, ExecChunk)]
        assert isinstance(items[-1], ExecOutput) and items[-1].ok
        assert b"".join(ch.data for ch in chunks if ch.stream == "stdout") == b"a\nb\n"
        with pytest.raises(ValueError):
            sb.exec([])
    assert sb.outcome is not None and sb.outcome.outcome == "discarded", "leaving the block unclosed discards"


def test_a_sandbox_on_a_branch_that_did_not_exist_says_it_created_it(daemon: Daemon) -> None:
    branch = f"new-{os.urandom(3).hex()}"
    with layerstack.connect(daemon.admin) as c:
        with c.sandbox(daemon.stack) as sb:
            assert not sb.session.branch_created, "the default branch exists"
        with c.sandbox(daemon.stack, branch=branch) as sb:
            assert sb.session.branch == branch
            assert sb.session.branch_created, "a misspelt or new name makes a branch: said as a field"
        with c.sandbox(daemon.stack, branch=branch) as sb:
            assert not sb.session.branch_created, "it exists now"


def test_files_stay_beneath_the_sandbox_root(daemon: Daemon) -> None:
    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack) as sb:
        st = sb.files.write("/work/a/b.txt", "hello\n", mode=0o600)
        assert (st.kind, st.size, st.mode & 0o777) == ("file", 6, 0o600), st
        # mode=0 is mode 0 (proto3's 0 was taken as "the default", 0o644).
        st = sb.files.write("/work/a/none.txt", "x", mode=0)
        assert st.mode & 0o7777 == 0 and sb.files.write("/work/a/dflt.txt", "x").mode & 0o777 == 0o644, st
        assert sb.files.read("/work/a/b.txt") == b"hello\n"
        assert sb.files.read("/work/a/b.txt", offset=1, limit=3) == b"ell"
        assert sb.exec("cat /work/a/b.txt").stdout == b"hello\n", "the command sees what the file API wrote"
        big = os.urandom(300_000)
        sb.files.write("work/big.bin", big)
        assert sb.files.read("/work/big.bin") == big
        names = [e.name for e in sb.files.list("/work")]
        assert names == sorted(names) and {"a", "big.bin", "hostile"} <= set(names)
        link = sb.files.stat("/work/hostile")
        assert (link.kind, link.link_target) == ("symlink", "/etc/passwd")
        # Followed inside the sandbox: its own /etc/passwd, never the host's.
        assert sb.files.read("/work/hostile") == b"root:x:0:0:session root:/root:/bin/sh\n"
        with pytest.raises(layerstack.InvalidArgumentError):
            sb.files.write("/work/../../../tmp/escaped", b"x")
        with pytest.raises(layerstack.NotFoundError):
            sb.files.read("/no/such/file")
        assert not sb.files.exists("/work/nothing") and sb.files.exists("/work/hostile")
        assert sb.files.remove("/work/a", recursive=True) == 4
        assert not sb.files.exists("/work/a")
        # Tar up and down.
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            data = b"from a tar\n"
            info = tarfile.TarInfo("pkg/readme")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        up = sb.files.upload("/work/up", buf.getvalue())
        assert (up.files, up.bytes) == (1, len(b"from a tar\n")), up
        assert sb.exec("cat /work/up/pkg/readme").stdout == b"from a tar\n"
        with tarfile.open(fileobj=io.BytesIO(sb.files.download("/work/up")), mode="r") as t:
            got = {m.name: m for m in t.getmembers()}
            assert "up/pkg/readme" in got, sorted(got)
        bad = io.BytesIO()
        with tarfile.open(fileobj=bad, mode="w") as t:
            for name in ("before.txt", "../escaped"):
                info = tarfile.TarInfo(name)
                info.size = 1
                t.addfile(info, io.BytesIO(b"x"))
        with pytest.raises(layerstack.InvalidArgumentError) as e:
            sb.files.upload("/work", bad.getvalue())
        # An upload is not atomic: the refusal says what stays.
        assert "../escaped" in e.value.message and "were written and stay" in e.value.message, e.value.message
        assert sb.files.exists("/work/before.txt")
    assert not Path("/tmp/escaped").exists()


def test_checkpoint_returns_the_node_and_discard_leaves_nothing_mounted(daemon: Daemon) -> None:
    with layerstack.connect(daemon.admin) as c:
        root = _graph(c, daemon.stack)
        with c.sandbox(node=root, key=f"ck-{os.urandom(4).hex()}") as sb:
            sb.files.write("/work/result.txt", "42\n")
            sb.exec("rm /etc/motd")
            diff = {c.path: c.change for c in sb.diff()}
            assert diff.get("/work/result.txt") == "added" and diff.get("/etc/motd") == "deleted", diff
            patched = [c for c in sb.diff(patch=True) if c.path == "/work/result.txt"]
            assert patched and patched[0].patch and "+42" in patched[0].patch, patched
            # A state that is not JSON is refused before anything ends.
            with pytest.raises(layerstack.InvalidArgumentError, match="state"):
                sb.close(checkpoint=True, state="not json")
            # Nor is JSON that is not an object (a node's state is named values).
            with pytest.raises(layerstack.InvalidArgumentError, match="not an object"):
                sb.close(checkpoint=True, state="[1, 2]")
            assert sb.outcome is None and sb.exec("cat /work/result.txt").stdout == b"42\n"
            end = sb.close(checkpoint=True, state={"reward": 1.0}, labels={"evaluator": "unit"})
        assert end.outcome == "checkpointed" and end.node, end
        node = c.show_node(end.node)
        assert node.parents == (root,) and node.kind == "checkpoint", node
        assert node.state == {"reward": 1.0}, node
        assert node.labels.get("evaluator") == "unit", node
        with c.sandbox(node=end.node) as child:
            assert child.files.read("/work/result.txt") == b"42\n", "the child node holds the checkpoint's writes"
            assert not child.files.exists("/etc/motd")
            upper_mounts = [m for m in _mounts_under(daemon.dir) if f"/{child.id}/" in m]
            child.discard()
        assert child.outcome is not None and child.outcome.outcome == "discarded"
        assert not [m for m in _mounts_under(daemon.dir) if m in upper_mounts]
        assert not (daemon.dir / "store" / "s" / str(child.id)).exists(), "a discarded sandbox's directories go"


def test_the_clients_discard_ends_a_live_sandbox(daemon: Daemon) -> None:
    """``Client.discard(id)`` (Publish DISCARD) of a live daemon-owned
    sandbox ends it as its own discard does (was refused: "still mounted")."""
    with layerstack.connect(daemon.admin) as c:
        sb = c.sandbox(daemon.stack)
        sb.files.write("/work/x", b"x")
        s = c.discard(sb.id)
        assert s.outcome == "discarded" and s.released, s
        assert not [m for m in _mounts_under(daemon.dir) if f"/{sb.id}/" in m]


def test_an_exception_in_the_block_discards(daemon: Daemon) -> None:
    with layerstack.connect(daemon.admin) as c:
        with pytest.raises(RuntimeError):
            with c.sandbox(daemon.stack) as sb:
                sb.files.write("/work/half-done", b"x")
                raise RuntimeError("the harness failed")
        assert sb.outcome is not None and sb.outcome.outcome == "discarded" and sb.outcome.layer is None


def test_the_asyncio_client_fans_out(daemon: Daemon) -> None:
    async def main() -> List[str]:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(f"sdk-aio-{os.urandom(3).hex()}", daemon.stack)

            async def rollout(i: int) -> str:
                async with ls.sandbox(node=g.root, key=f"aio-{g.root}-{i}") as sb:
                    await sb.files.write("/work/i", str(i))
                    out = await sb.exec(["cat", "/work/i"])
                    assert out.stdout == str(i).encode()
                    end = await sb.close(checkpoint=True, state={"reward": i})
                    assert end.node
                    return end.node

            return await asyncio.gather(*(rollout(i) for i in range(16)))

    nodes = asyncio.run(main())
    assert len(set(nodes)) == 16, nodes


def test_a_request_larger_than_grpcs_default_is_carried_and_one_over_the_limit_named(daemon: Daemon) -> None:
    """A 6 MiB stdin (gRPC's default limit is 4 MiB: it was refused with
    out_of_range) reaches the command; a request over the daemon's limit is a
    ValueError naming the argument, sent nowhere; a ListDir answer over 4 MiB
    is read."""
    from layerstack._channel import MAX_MESSAGE_BYTES

    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack) as sb:
        r = sb.exec(["sh", "-c", "cat > /work/in"], stdin=b"x" * (6 << 20), check=True)
        assert sb.files.stat("/work/in").size == 6 << 20
        with pytest.raises(ValueError, match="stdin= is"):
            sb.exec(["true"], stdin=b"x" * (MAX_MESSAGE_BYTES + 1))
        many = io.BytesIO()
        with tarfile.open(fileobj=many, mode="w") as t:
            for i in range(40000):
                t.addfile(tarfile.TarInfo(f"a-rather-long-file-name-of-a-big-directory-{i}"))
        sb.files.upload("/work/many", many.getvalue())
        names = sb.files.list("/work/many")
        assert len(names) == 40000, len(names)


def test_a_refused_upload_is_answered_with_its_refusal(daemon: Daemon) -> None:
    """A WriteFile or UploadTar the daemon refuses after its first message
    (a path on the session's /proc) while the client still streams 1 MiB:
    every call raises the refusal (PermissionDeniedError naming the path),
    none grpcio's own INTERNAL, which its asyncio client reports when a
    write fails because the answer came first (grpc/grpc#36066); and the
    connection still serves calls afterwards."""

    async def main() -> dict:
        kinds: dict = {}
        async with layerstack.aio.connect(daemon.admin) as ls, ls.sandbox(daemon.stack) as sb:
            data = b"x" * (1 << 20)
            tar = io.BytesIO()
            with tarfile.open(fileobj=tar, mode="w") as t:
                info = tarfile.TarInfo("big")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    try:
                        if i % 4 == 0:
                            await sb.files.upload(f"/proc/refused-{i}", tar.getvalue())
                        else:
                            await sb.files.write(f"/proc/refused-{i}", data)
                        kinds["ok"] = kinds.get("ok", 0) + 1
                    except layerstack.PermissionDeniedError as e:
                        assert f"refused-{i}" in e.message, e.message
                        kinds["refused"] = kinds.get("refused", 0) + 1
                    except layerstack.LayerStackError as e:
                        kinds[f"{e.code}: {e.message}"] = kinds.get(f"{e.code}: {e.message}", 0) + 1

            await asyncio.gather(*(one(i) for i in range(400)))
            assert (await sb.files.stat("/")).kind == "dir"
        return kinds

    assert asyncio.run(main()) == {"refused": 400}


def test_a_refusal_reaches_a_client_that_pauses_its_upload(daemon: Daemon) -> None:
    """A write whose content comes from a pipe nobody writes to yet: the
    daemon refuses its path (on the session's /proc) without waiting for
    more of the stream; the client gets the refusal while its data is still
    paused (before the pipe is closed 5 s later)."""
    import threading
    import time

    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack) as sb:
        r, w = os.pipe()
        closer = threading.Timer(5.0, os.close, (w,))
        closer.start()
        try:
            with os.fdopen(r, "rb") as paused:
                t0 = time.monotonic()
                with pytest.raises(layerstack.PermissionDeniedError) as e:
                    sb.files.write("/proc/paused", paused)
                took = time.monotonic() - t0
        finally:
            closer.join()
        assert "/proc/paused" in e.value.message
        assert took < 3.0, f"the refusal came after {took:.1f} s, when the client's stream ended"


def test_a_bad_or_failing_data_source_raises_its_own_error(daemon: Daemon) -> None:
    """A write or upload whose data is of the wrong type raises TypeError
    naming the argument before anything is sent; a file object whose read
    fails raises that OSError — neither grpcio's "Exception iterating
    requests!" (blocking client) nor a bare CancelledError (asyncio)."""

    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            raise OSError(5, "the source broke")

    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack) as sb:
        for bad in (123, None, 1.5):
            with pytest.raises(TypeError, match="data must be bytes"):
                sb.files.write("/work/t", bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="tar must be bytes"):
            sb.files.upload("/work", 123)  # type: ignore[arg-type]
        with pytest.raises(OSError, match="the source broke"):
            sb.files.write("/work/t", Failing())
        # Other arguments of the wrong type name themselves (None was sent
        # as "" — the root —, an int in an argv quietly became a string).
        with pytest.raises(TypeError, match="path must be a str"):
            sb.files.read(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"command\[1\] is int"):
            sb.exec(["sleep", 1])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="state= must be a mapping"):
            sb.close(checkpoint=True, state=object())  # type: ignore[arg-type]
        for bad_call, named in (
            (lambda: sb.exec("true", user=1000), "user"),  # type: ignore[arg-type]
            (lambda: sb.exec("true", env=["A=1"]), "env"),  # type: ignore[arg-type]
            (lambda: sb.exec("true", env={"A": 1}), "env"),  # type: ignore[dict-item]
            (lambda: sb.exec("true", timeout_s="1"), "timeout_s"),  # type: ignore[arg-type]
            (lambda: sb.exec("true", cwd=1), "cwd"),  # type: ignore[arg-type]
            (lambda: sb.files.write("/work/m", b"", mode="0755"), "mode"),  # type: ignore[arg-type]
            (lambda: sb.files.read("/work/p", limit=None), "limit"),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match=named):
                bad_call()
        for bad_call, named in (
            (lambda: sb.files.write("/work/m", b"", mode=0o77777), "mode"),
            (lambda: sb.files.write("/work/m", b"", owner=(-1, 0)), "owner"),
            (lambda: sb.files.read("/work/p", limit=-1), "limit"),
            (lambda: sb.exec(""), "blank"),
            (lambda: sb.exec([""]), "first item"),
            (lambda: sb.exec("  "), "blank"),
            (lambda: sb.exec("true", timeout_s=float("inf")), "timeout_s"),
            (lambda: sb.exec("true", timeout_s=5e6), "timeout_s"),
        ):
            with pytest.raises(ValueError, match=named):
                bad_call()
        # Below a millisecond is a limit still (rounded up), never "none".
        tiny = sb.exec("sleep 3; echo finished", timeout_s=0.0001)
        assert tiny.timed_out and tiny.stdout == b"", tiny
        sb.files.write("/work/p", b"x")
        assert sb.files.read(Path("/work/p")) == b"x" and sb.files.read(b"/work/p") == b"x"
        # At the largest offset there is nothing to read (no read past it).
        assert sb.files.read("/work/p", offset=2**63 - 1) == b""
        assert sb.exec(iter(["cat", Path("/work/p")])).stdout == b"x"
        with pytest.raises(ExecError, match="command 'exit 3' failed: exit code 3") as failed:
            sb.exec("exit 3", check=True)
        assert failed.value.command == "exit 3" and failed.value.output.exit_code == 3
    with layerstack.connect(daemon.admin) as c:
        with pytest.raises(TypeError, match="stack must be a str"):
            c.sandbox(123)  # type: ignore[arg-type]
    # A call on a closed client: a typed error that says to connect again.
    with pytest.raises(layerstack.FailedPreconditionError, match="client is closed"):
        c.status()

    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls, ls.sandbox(daemon.stack) as sb:
            with pytest.raises(TypeError, match="data must be bytes"):
                await sb.files.write("/work/t", 123)  # type: ignore[arg-type]
            with pytest.raises(OSError, match="the source broke"):
                await sb.files.write("/work/t", Failing())
            with pytest.raises(OSError, match="the source broke"):
                await sb.files.upload("/work", Failing())
            assert (await sb.files.stat("/")).kind == "dir"
            with pytest.raises(TypeError, match="path must be a str"):
                await sb.files.stat(None)  # type: ignore[arg-type]
            with pytest.raises(ExecError, match=r"command false failed: exit code 1"):
                await sb.exec(["false"], check=True)
        with pytest.raises(layerstack.FailedPreconditionError, match="client is closed"):
            await ls.status()

    asyncio.run(main())


def test_an_asyncio_write_from_a_slow_file_leaves_the_loop_running(daemon: Daemon) -> None:
    """The asyncio client reads a file object on a worker thread: while a
    write waits 1 s for a pipe's data, another task of the loop keeps
    running (it ticked nothing before: the read blocked the loop)."""
    import threading

    async def main() -> int:
        async with layerstack.aio.connect(daemon.admin) as ls, ls.sandbox(daemon.stack) as sb:
            r, w = os.pipe()
            feeder = threading.Timer(1.0, lambda: (os.write(w, b"late data"), os.close(w)))
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            t = asyncio.create_task(tick())
            feeder.start()
            with os.fdopen(r, "rb") as f:
                st = await sb.files.write("/work/from-pipe", f)
            t.cancel()
            feeder.join()
            assert st.size == len(b"late data")
            assert await sb.files.read("/work/from-pipe") == b"late data"
            return ticks

    ticks = asyncio.run(main())
    assert ticks >= 8, f"the event loop ticked {ticks} times in the 1 s the write waited"


def test_an_interrupted_sandbox_is_discarded_by_its_with_block(daemon: Daemon) -> None:
    """A sandbox whose init is killed from outside ends ``interrupted`` with
    its writes kept. Asked again by its key (the way a harness resumes), the
    asyncio client: an exec on it says it was interrupted and to discard it,
    a checkpoint is refused (FailedPreconditionError saying to discard and
    retry), and its ``async with`` exit sends the
    DISCARD that drops the kept writes (before, an object that carried an
    outcome sent nothing and the writes stayed on disk)."""
    import signal
    import time

    key = f"interrupted-{os.getpid()}-{os.urandom(3).hex()}"
    marker = os.urandom(8).hex()

    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            sb = await ls.sandbox(daemon.stack, key=key)
            await sb.files.write("/work/marker", marker)
            inits = [
                int(p)
                for p in os.listdir("/proc")
                if p.isdigit() and _read_or_none(f"/proc/{p}/root/work/marker") == marker.encode()
            ]
            assert len(inits) >= 1, "the sandbox's processes on the host"
            init = min(inits)
            os.kill(init, signal.SIGKILL)
            t0 = time.monotonic()
            while True:
                s = await ls.wait(sb.id, timeout_ms=200)
                if s.outcome == "interrupted":
                    break
                assert time.monotonic() - t0 < 10, f"not interrupted: {s}"
            with pytest.raises(layerstack.FailedPreconditionError, match="ended interrupted .*discard it"):
                await sb.exec(["true"])
            # The harness's own object, which saw no end: a publish raises
            # (it published nothing) and the object then carries the outcome.
            with pytest.raises(layerstack.FailedPreconditionError, match="cannot publish: its run ended interrupted"):
                await sb.close(publish=True)
            assert sb.outcome is not None and sb.outcome.outcome == "interrupted", sb.outcome
            again = await ls.sandbox(daemon.stack, key=key)
            assert not again.created and again.outcome is not None, again
            with pytest.raises(layerstack.FailedPreconditionError, match="discard"):
                await again.close(checkpoint=True)
            async with again:
                pass
            s = await ls.wait(sb.id, timeout_ms=1000)
            assert s.state == "discarded" and s.released, s

    asyncio.run(main())


def _read_or_none(p: str) -> Optional[bytes]:
    try:
        with open(p, "rb") as f:
            return f.read()
    except OSError:
        return None


def test_live_sandboxes_never_see_each_others_writes(daemon: Daemon) -> None:
    """Issue 22: ``ISOLATION_N`` sandboxes alive at once on one base, each
    writing a unique marker; once all have written, each lists the marker
    directory through its own mount (a process inside it) and sees its own
    marker only; after all are discarded, a fresh sandbox sees none."""
    import time

    started = time.monotonic()

    async def main() -> int:
        async with layerstack.aio.connect(daemon.admin) as ls:
            gate = asyncio.Semaphore(64)
            written = asyncio.Event()
            pending = [ISOLATION_N]
            seen_ok = [0]

            async def one(i: int) -> None:
                token = f"{i}-{os.urandom(6).hex()}"
                async with gate:
                    sb = await ls.sandbox(daemon.stack, key=f"iso-{os.getpid()}-{i}")
                    out = await sb.exec(["sh", "-c", f"mkdir -p /work/markers && echo {token} > /work/markers/{i}"])
                    assert out.ok, out
                pending[0] -= 1
                if pending[0] == 0:
                    written.set()
                await written.wait()
                async with gate:
                    out = await sb.exec(["sh", "-c", "cd /work/markers && for f in *; do echo $f $(cat $f); done"])
                    assert out.ok, out
                    assert out.stdout.decode().split() == [str(i), token], (
                        f"sandbox {i} sees {out.stdout!r}: another sandbox's marker leaked"
                    )
                    seen_ok[0] += 1
                    await sb.discard()

            await asyncio.gather(*(one(i) for i in range(ISOLATION_N)))
            async with ls.sandbox(daemon.stack) as fresh:
                after = await fresh.exec(["sh", "-c", "ls /work/markers 2>/dev/null | wc -l"])
                assert after.stdout.strip() == b"0", after
            return seen_ok[0]

    checked = asyncio.run(main())
    assert checked == ISOLATION_N
    secs = time.monotonic() - started
    record_reliability(
        "sandbox-isolation",
        "Live sandboxes on one base never see each other's unpublished writes",
        "LAYERSTACK_BIN_DIR=$PWD/target/debug python3 -m pytest clients/python/tests/test_sandbox.py -k never_see",
        {"sandboxes alive at once": ISOLATION_N, "markers checked": checked, "seconds": round(secs, 1)},
    )


def test_a_memory_limit_kills_what_allocates_past_it(daemon: Daemon) -> None:
    # 128 MiB in a 32 MiB sandbox: the kernel's OOM killer ends the command.
    alloc = ["dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=1"]
    with layerstack.connect(daemon.admin) as c:
        with c.sandbox(daemon.stack, memory_bytes=32 << 20, pids=64) as sb:
            assert sb.session.limits == layerstack.SandboxLimits(
                cpu_millis=0, memory_bytes=32 << 20, pids=64, network=False
            ), sb.session
            listed = {x.id: x for x in c.list_sessions(all_namespaces=True, owner_kind="sandbox")}
            assert listed[sb.id].limits == sb.session.limits
            out = sb.exec(alloc)
            assert (out.exit_code, out.signal, out.oom_killed) == (137, 9, True), out
            assert 0 < out.session_memory_peak_bytes <= 33 << 20, out
            alive = sb.exec(["echo", "alive"])
            assert alive.stdout == b"alive\n" and not alive.oom_killed, alive
        with c.sandbox(daemon.stack) as sb:
            out = sb.exec(["echo", "unlimited"])
            assert out.ok and out.session_memory_peak_bytes == 0, "no limit, no cgroup"
            assert sb.session.limits == layerstack.SandboxLimits(0, 0, 0, False)
            sid = sb.id
        assert c.wait(sid).limits is None, "an ended session has no live limits"
        with pytest.raises(layerstack.InvalidArgumentError, match="sandbox.memory_bytes"):
            c.sandbox(daemon.stack, memory_bytes=1 << 20)
        with pytest.raises(ValueError):
            c.sandbox(daemon.stack, pids=-1)

    async def main() -> ExecOutput:
        async with layerstack.aio.connect(daemon.admin) as ls:
            async with ls.sandbox(daemon.stack, memory_bytes=32 << 20) as sb:
                return await sb.exec(alloc)

    out = asyncio.run(main())
    assert (out.signal, out.oom_killed) == (9, True), out


def test_an_id_map_runs_the_sandbox_as_an_unprivileged_host_uid(daemon: Daemon) -> None:
    m = (100000, 100000, 65536)
    with layerstack.connect(daemon.admin) as c:
        root = _graph(c, daemon.stack)
        with c.sandbox(node=root, id_map=m, user=(1000, 1000)) as sb:
            assert sb.session.id_map == m, sb.session
            out = sb.exec(["cat", "/proc/self/uid_map"], user=(0, 0))
            assert out.stdout.split() == [b"0", b"100000", b"65536"], out
            st = sb.files.write("/work/mine", "x")
            assert (st.uid, st.gid) == (1000, 1000), st
            assert sb.exec(["ls", "-ln", "/work/mine"]).stdout.split()[2:4] == [b"1000", b"1000"]
            end = sb.close(checkpoint=True)
        assert end.node, end
        # The node's layer holds the sandbox's ids: an unmapped sandbox sees them.
        with c.sandbox(node=end.node) as child:
            assert child.session.id_map is None
            assert child.files.stat("/work/mine").uid == 1000
            assert child.exec(["ls", "-ln", "/work/mine"]).stdout.split()[2:4] == [b"1000", b"1000"]
        with pytest.raises(layerstack.InvalidArgumentError, match="id_map.host_uid 10 "):
            c.sandbox(daemon.stack, id_map=(10, 100000, 65536))
        with pytest.raises(layerstack.InvalidArgumentError, match="outside"):
            c.sandbox(daemon.stack, id_map=m, user=(70000, 0))
        with pytest.raises(ValueError):
            c.sandbox(daemon.stack, id_map=(100000, 100000))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="id_map"):
            c.sandbox(daemon.stack, id_map=(2**32, 100000, 65536))


_AS_USER = """
import json, sys, layerstack
with layerstack.connect(sys.argv[1]) as c, c.sandbox(sys.argv[2]) as sb:
    out = sb.exec(["sh", "-c", "echo as-user"])
    sb.files.write("/work/by-user", "x")
    print(json.dumps({"stdout": out.stdout.decode(), "id": sb.id, "read": sb.files.read("/work/by-user").decode()}))
"""


def test_a_non_root_uid_the_config_allows_drives_a_sandbox(daemon: Daemon) -> None:
    r = subprocess.run(
        ["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups",
         sys.executable, "-c", _AS_USER, str(daemon.admin), daemon.stack],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert (v["stdout"], v["read"]) == ("as-user\n", "x"), v


def test_a_remote_client_over_tls_with_a_token(daemon: Daemon) -> None:
    with layerstack.connect(
        target=f"127.0.0.1:{daemon.port}", root_certificates=daemon.tls / "ca.pem", token=TOKEN
    ) as c:
        with c.sandbox(daemon.stack) as sb:
            assert sb.exec(["echo", "remote"]).stdout == b"remote\n"
    with layerstack.connect(
        target=f"127.0.0.1:{daemon.port}", root_certificates=daemon.tls / "ca.pem", token="wrong"
    ) as c:
        with pytest.raises(layerstack.UnauthenticatedError):
            c.sandbox(daemon.stack)


def test_the_fan_out_example_runs(daemon: Daemon, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "fanout_async.py"
    spec = importlib.util.spec_from_file_location("fanout_async", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fanout_async"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    run = f"ex-{os.urandom(3).hex()}"
    args = ["--admin-address", str(daemon.admin), "--stack", daemon.stack, "--rollouts", "32",
            "--concurrency", "8", "--run", run]
    assert asyncio.run(mod.main(args)) == 0
    out = capsys.readouterr().out
    assert "32 rollouts" in out and "32 scored" in out and "2 solved" in out, out
    # The same run again (a harness restarted mid-step): the keys answer the
    # sandboxes already ended with their records; nothing runs twice.
    assert asyncio.run(mod.main(args)) == 0
    again = capsys.readouterr().out
    assert "32 scored" in again and "2 solved" in again, again
    assert out.split("a solving node: ")[1] == again.split("a solving node: ")[1]


def test_a_refused_close_raises_and_the_block_still_discards(daemon: Daemon) -> None:
    """A checkpoint of a sandbox that is not a graph attempt is refused: raised
    as FailedPreconditionError, the sandbox stays live (not ``ended``), and
    leaving the block discards it. Placement and stack mistakes are named."""
    with layerstack.connect(daemon.admin) as c:
        with c.sandbox(daemon.stack) as sb:
            sb.files.write("/work/x", "x")
            with pytest.raises(layerstack.FailedPreconditionError) as e:
                sb.close(checkpoint=True)
            assert "not a running attempt" in e.value.message, e.value.message
            assert not sb.ended
            assert sb.exec(["cat", "/work/x"]).stdout == b"x", "still live after the refusal"
        assert sb.outcome is not None and sb.outcome.outcome == "discarded" and sb.outcome.released
        with pytest.raises(layerstack.InvalidArgumentError) as e:
            c.sandbox(daemon.stack, mount_at=str(daemon.dir / "no-such-dir"))
        assert "no-such-dir" in e.value.message and "existing directory" in e.value.message
        # A stack id unknown to the store is not found, containerd or not.
        with pytest.raises(layerstack.NotFoundError):
            c.sandbox("import:sha256:" + "0" * 64)


# --------------------------------------------------------------------- WASI


@pytest.fixture(scope="module")
def fsops(daemon: Daemon) -> Path:
    """``integration/wasm/fsops.c`` built for wasm32-wasi with clang + wasi-libc
    (scripts/install-deps.sh): a WASI command applying file operations."""
    out = daemon.dir / "fsops.wasm"
    cmd = ["clang", "--target=wasm32-wasi", "--sysroot=/usr", "-fuse-ld=lld", "-O2", "-o", str(out),
           str(REPO / "integration" / "wasm" / "fsops.c")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        ok, why = r.returncode == 0, r.stderr
    except FileNotFoundError as e:
        ok, why = False, str(e)
    if not ok:
        msg = f"WASI tests need clang, lld-14, wasi-libc and libclang-rt-14-dev-wasm32: {why}"
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)
    return out


def test_a_wasi_sandbox_runs_modules_over_its_tree_and_publishes(daemon: Daemon, fsops: Path) -> None:
    with layerstack.connect(daemon.admin) as c:
        with pytest.raises(ValueError, match="network"):
            c.sandbox(daemon.stack, executor="wasi", network=True)
        with pytest.raises(ValueError, match="executor"):
            c.sandbox(daemon.stack, executor="jvm")
        branch = f"wasi-{os.urandom(3).hex()}"
        with c.sandbox(daemon.stack, branch=branch, executor="wasi", env={"X": "1"}) as sb:
            assert sb.session.owner_kind == "wasi" and sb.session.owner.startswith("wasi:"), sb.session
            first = sb.exec(["fsops", "write", "/work/w.txt", "from wasm\n", "cat", "/etc/motd"], module=fsops)
            assert first.ok and first.stdout == b"base\n" and first.module_compiled, first
            assert first.module_digest.startswith("sha256:") and first.fuel_used > 0, first
            # Again by digest: nothing sent, nothing compiled.
            again = sb.exec([first.module_digest, "cat", "/work/w.txt"])
            assert again.stdout == b"from wasm\n" and not again.module_compiled, again
            # The file calls serve the same tree.
            assert sb.files.read("/work/w.txt") == b"from wasm\n"
            sb.files.write("/work/from-py.txt", "py\n")
            assert sb.exec([first.module_digest, "cat", "/work/from-py.txt"]).stdout == b"py\n"
            spun = sb.exec([first.module_digest, "spin"], timeout_s=0.3)
            assert spun.trap == "deadline" and spun.timed_out and spun.exit_code == 134, spun
            end = sb.close(publish=True)
        assert end.outcome == "committed" and end.layer, end
    with layerstack.connect(daemon.admin) as c, c.sandbox(daemon.stack, branch=branch) as linux:
        assert linux.exec("cat /work/w.txt /work/from-py.txt").stdout == b"from wasm\npy\n", "published to the branch"


def test_asyncio_wasi_sandboxes_checkpoint_nodes_with_their_rewards(daemon: Daemon, fsops: Path) -> None:
    module = fsops.read_bytes()

    async def main() -> List[str]:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(f"sdk-wasi-{os.urandom(3).hex()}", daemon.stack)

            async def rollout(i: int) -> str:
                async with ls.sandbox(node=g.root, executor="wasi", fuel=10**9, key=f"wasi-{g.root}-{i}") as sb:
                    out = await sb.exec(["fsops", "write", "/work/answer", str(i)], module=module)
                    assert out.ok, out
                    end = await sb.close(checkpoint=True, state={"reward": i / 8}, exit_status=out.exit_code)
                    assert end.outcome == "checkpointed" and end.node, end
                    return end.node

            nodes = await asyncio.gather(*(rollout(i) for i in range(8)))
            async with ls.sandbox(node=nodes[3], executor="wasi") as sb:
                got = await sb.exec(["fsops", "cat", "/work/answer"], module=module)
                assert got.stdout == b"3", got
            return list(nodes)

    nodes = asyncio.run(main())
    assert len(set(nodes)) == 8, nodes
    with layerstack.connect(daemon.admin) as c:
        assert c.show_node(nodes[5]).state == {"reward": 5 / 8}


def test_run_session_creates_runs_and_ends_in_one_call(daemon: Daemon, fsops: Path) -> None:
    module = fsops.read_bytes()
    branch = f"run-{os.urandom(3).hex()}"
    with layerstack.connect(daemon.admin) as c:
        # WASI, published: the write is on the branch after the one call.
        r = c.run_session(["fsops", "write", "/work/one-call", "wasm\n"], daemon.stack, branch=branch,
                          executor="wasi", module=module, end="publish")
        assert r.created and r.output is not None and r.output.ok and r.output.module_digest, r
        assert r.outcome.outcome == "committed" and r.outcome.layer and r.outcome.released, r
        assert r.outcome.id == r.session.id and r.session.owner_kind == "wasi", r
        # Linux, AUTO with on-success: the command's exit decides; exit 3 discards.
        failed = c.run_session("echo no > /work/auto; echo oops >&2; exit 3", daemon.stack, branch=branch,
                               end="auto", exit_policy="on-success")
        assert failed.output is not None and failed.output.exit_code == 3 and failed.output.stderr == b"oops\n"
        assert failed.outcome.outcome == "discarded", failed
        with pytest.raises(layerstack.ExecError):
            c.run_session("exit 4", daemon.stack, branch=branch, check=True)
        # The default end is discard: nothing of it reaches the branch.
        kept = c.run_session("cat /work/one-call; echo x > /work/gone", daemon.stack, branch=branch)
        assert kept.output is not None and kept.output.stdout == b"wasm\n", kept
        assert kept.outcome.outcome == "discarded" and kept.outcome.layer is None, kept
        # A retry of a key whose session ended answers its end; nothing runs again.
        key = f"once-{os.urandom(3).hex()}"
        first = c.run_session("echo 1 >> /work/once", daemon.stack, branch=branch, key=key, end="publish")
        again = c.run_session("echo 1 >> /work/once", daemon.stack, branch=branch, key=key, end="publish")
        assert first.outcome.outcome == "committed" and not again.created and again.output is None, again
        assert again.outcome.id == first.outcome.id and again.outcome.layer == first.outcome.layer, again
        seen = c.run_session("cat /work/once /work/gone 2>&1", daemon.stack, branch=branch)
        assert seen.output is not None and seen.output.stdout.startswith(b"1\n") and b"No such file" in seen.output.stdout
        # A module that does not compile: the session is discarded, the error raised.
        with pytest.raises(layerstack.InvalidArgumentError, match="compile"):
            c.run_session(["bad"], daemon.stack, executor="wasi", module=b"\0asm-not-really")
        # A refused request leaves nothing made: the reserved name, a session without an executor's options.
        with pytest.raises(layerstack.InvalidArgumentError, match="reserved"):
            c.run_session("true", daemon.stack, name="(ready)")
        # A close that would be refused (a state that is no JSON, a checkpoint
        # off a node) is refused before a session exists.
        with pytest.raises(layerstack.InvalidArgumentError, match="state"):
            c.run_session("true", daemon.stack, branch=branch, end="auto", exit_policy="checkpoint", state="not json")
        with pytest.raises(layerstack.FailedPreconditionError, match="graph node"):
            c.run_session("true", daemon.stack, branch=branch, end="checkpoint")
        with pytest.raises(TypeError, match="JSON"):
            c.run_session("true", daemon.stack, branch=branch, end="checkpoint", state={"r": float("nan")})
        live = [s for s in c.list_sessions(all_namespaces=True) if s.branch == branch and not s.released]
        assert live == [], f"sessions of the branch left live: {live}"

    async def checkpoints() -> List[str]:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(f"sdk-run-{os.urandom(3).hex()}", daemon.stack)
            ends = await asyncio.gather(*(
                ls.run_session(["fsops", "write", "/work/answer", str(i)], node=g.root, executor="wasi",
                               module=module, end="checkpoint", state={"i": i})
                for i in range(4)
            ))
            assert all(e.outcome.outcome == "checkpointed" and e.outcome.node for e in ends), ends
            return [e.outcome.node for e in ends]

    nodes = asyncio.run(checkpoints())
    with layerstack.connect(daemon.admin) as c:
        assert [c.show_node(n).state for n in nodes] == [{"i": i} for i in range(4)]
        # A command that does not run under a checkpoint with a state: its
        # session is discarded (the discard carries no state), not left live.
        g = c.create_graph(f"sdk-bad-{os.urandom(3).hex()}", daemon.stack)
        with pytest.raises(layerstack.InvalidArgumentError, match="compile"):
            c.run_session(["bad"], node=g.root, executor="wasi", module=b"\0asm-not-really",
                          end="checkpoint", state={"r": 1}, name="bad-ckpt")
        # AUTO with a state on no node: refused before a session exists.
        with pytest.raises(layerstack.FailedPreconditionError, match="graph node"):
            c.run_session("true", daemon.stack, branch=branch, end="auto", state={"r": 1}, name="auto-state")
        live = [s for s in c.list_sessions(all_namespaces=True)
                if s.owner in ("wasi:bad-ckpt", "sandbox:auto-state") and not s.released]
        assert live == [], f"left live: {live}"

    # A caller that goes away mid-run: the command is stopped, the session
    # discarded (never published), whatever end it asked for.
    name = f"abandoned-{os.urandom(3).hex()}"

    async def abandon(c: layerstack.Client) -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            call = asyncio.ensure_future(ls.run_session("echo x > /work/abandoned; sleep 60", daemon.stack,
                                                        branch=branch, name=name, end="publish"))
            for _ in range(300):
                listed = await asyncio.to_thread(c.list_sessions, all_namespaces=True)
                if any(s.owner == f"sandbox:{name}" for s in listed):
                    break
                await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    with layerstack.connect(daemon.admin) as c:
        asyncio.run(abandon(c))
        s = next(s for s in c.list_sessions(all_namespaces=True) if s.owner == f"sandbox:{name}")
        end = c.wait(s.id, timeout_ms=30_000)
        assert end.outcome == "discarded" and "went away" in end.message, end
        assert c.run_session("test -e /work/abandoned", daemon.stack, branch=branch).output.exit_code == 1


def test_a_module_file_is_read_only_up_to_the_limit() -> None:
    """A device or FIFO given as a module is refused after 64 MiB + 1 byte,
    never read whole (no daemon needed: the request is refused first)."""
    from layerstack.sandbox import MAX_WASI_MODULE_BYTES, exec_request

    with pytest.raises(ValueError, match=f"more than {MAX_WASI_MODULE_BYTES} bytes"):
        exec_request(1, ["m"], module=Path("/dev/zero"), env=None, cwd=None, user=None, stdin=None,
                     timeout_s=None)


def _daemon_pid(daemon: Daemon) -> int:
    """The fixture daemon's pid, from its `serving` log line."""
    import re

    m = re.search(rb" pid=(\d+)", (daemon.dir / "daemon.log").read_bytes())
    assert m, "no `serving … pid=` line in the daemon's log"
    return int(m.group(1))


def _zombie_children(pid: int) -> List[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            st = _read_or_none(f"/proc/{c}/stat") or b""
            if st.rpartition(b")")[2].split()[:1] == [b"Z"]:
                out.append(int(c))
    return out


def test_a_cancelled_create_leaves_no_sandbox_and_no_process(daemon: Daemon) -> None:
    """A CreateSession whose caller goes away (a cancelled task, a deadline)
    runs to its end in the daemon, which then discards the sandbox nobody
    was told of: no live session, no init left unreaped. With an idempotency
    key the sandbox stays, and the key's retry answers it."""
    name = f"cancel-{os.urandom(3).hex()}"
    pid = _daemon_pid(daemon)

    def live() -> List[int]:
        with layerstack.connect(daemon.admin) as c:
            return [s.id for s in c.list_sessions(all_namespaces=True, owner_kind="sandbox")
                    if name in s.owner and not s.released]

    async def cancelled() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            for delay in (0.0005, 0.001, 0.002, 0.005, 0.01):
                tasks = [asyncio.ensure_future(ls.sandbox(daemon.stack, name=f"{name}-{i}")) for i in range(12)]
                await asyncio.sleep(delay)
                for t in tasks:
                    t.cancel()
                for r in await asyncio.gather(*tasks, return_exceptions=True):
                    if isinstance(r, layerstack.aio.AsyncSandbox):
                        await r.discard()

    async def cancelled_beside_a_call() -> None:
        # Cancelled creates are not reset on the wire (a burst of resets
        # made the daemon's HTTP/2 layer close the connection, GOAWAY
        # too_many_resets, failing every other call on it).
        async with layerstack.aio.connect(daemon.admin) as ls:
            async with ls.sandbox(daemon.stack, name=f"{name}-busy") as sb:
                running = asyncio.ensure_future(sb.exec(["sleep", "1"]))
                waits = [asyncio.wait_for(ls.sandbox(daemon.stack, name=f"{name}-w"), 0.003) for _ in range(60)]
                for made in await asyncio.gather(*waits, return_exceptions=True):
                    if isinstance(made, layerstack.aio.AsyncSandbox):
                        await made.discard()
                    else:
                        assert isinstance(made, asyncio.TimeoutError), made
                assert (await running).ok

    async def past_their_deadline() -> None:
        # A create whose call ran out of time (no answer): found by its key
        # and discarded.
        async with layerstack.aio.connect(daemon.admin, timeout_s=0.005) as ls:
            for r in await asyncio.gather(*(ls.sandbox(daemon.stack, name=f"{name}-d") for _ in range(12)),
                                          return_exceptions=True):
                if isinstance(r, layerstack.aio.AsyncSandbox):
                    await r.discard()
                else:
                    assert isinstance(r, (layerstack.DeadlineExceededError, layerstack.UnavailableError)), r

    asyncio.run(cancelled())
    asyncio.run(cancelled_beside_a_call())
    asyncio.run(past_their_deadline())
    deadline = time.monotonic() + 20
    while (left := live()) or _zombie_children(pid):
        assert time.monotonic() < deadline, f"live sandboxes {left}, zombie children {_zombie_children(pid)}"
        time.sleep(0.1)

    async def keyed() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            first = asyncio.ensure_future(ls.sandbox(daemon.stack, name=f"{name}-keyed", key=f"{name}-k"))
            await asyncio.sleep(0.001)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            again = await ls.sandbox(daemon.stack, name=f"{name}-keyed", key=f"{name}-k")
            assert (await again.exec(["true"])).ok
            # By id, from the asyncio client: listed, then closed.
            listed = {x.id: x for x in await ls.list_sessions(all_namespaces=True, owner_kind="sandbox")}
            assert not listed[again.id].released, listed[again.id]
            end = await ls.close_session(again.id, action="discard")
            assert end.outcome == "discarded", end

    asyncio.run(keyed())
