"""``Client.import_base`` against the daemon alone — no containerd: a directory
made here becomes a stack, the same content again is the same stack, a session
runs on it (busybox as /bin/sh), and bad input raises typed errors.

Needs root, ``/bin/busybox`` (static) and the built binaries; skips without
them, except with ``CI=true``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

import layerstack

from conftest import (
    CLI_BIN,
    DAEMON_BIN,
    _mounts_under,
    _terminate,
    _wait_for,
    bin_dir,
    in_ci,
)


def _require() -> None:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    if shutil.which("busybox") is None:
        missing.append("busybox (busybox-static)")
    for b in (DAEMON_BIN, CLI_BIN):
        if not (bin_dir() / b).is_file():
            missing.append(str(bin_dir() / b))
    if missing:
        msg = "base import tests need " + ", ".join(missing)
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def alone() -> Iterator[Path]:
    """The daemon with no containerd; yields its temp dir (admin socket in ls/)."""
    _require()
    base = Path(os.environ.get("LAYERSTACK_TEST_TMP", "/var/tmp"))
    d = Path(tempfile.mkdtemp(prefix="lst-py-", dir=base))
    os.chmod(d, 0o755)
    (d / "owner.pid").write_text(str(os.getpid()))
    (d / "ls").mkdir()
    log = d / "daemon.log"
    with open(log, "ab") as f:
        daemon = subprocess.Popen(
            [
                str(bin_dir() / DAEMON_BIN),
                "--root", str(d / "store"),
                "--address", str(d / "ls" / "snap.sock"),
                "--admin-address", str(d / "ls" / "admin.sock"),
                # Never created: no containerd runs.
                "--containerd-address", str(d / "ls" / "containerd.sock"),
                "--metrics-address", "127.0.0.1:0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
        )
    try:
        _wait_for(DAEMON_BIN, lambda: (d / "ls" / "admin.sock").exists() and daemon.poll() is None, 30, log)
        yield d
    finally:
        _terminate(daemon)
        for m in _mounts_under(d):
            subprocess.run(["umount", "-l", m], capture_output=True)
        if os.environ.get("LAYERSTACK_TEST_KEEP") != "1":
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], capture_output=True)


def _rootfs(d: Path) -> Path:
    root = d / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    shutil.copy(shutil.which("busybox") or "/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "cat"):
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc" / "motd").write_text("imported from python\n")
    return root


def test_import_base_makes_a_stack_sessions_run_on(alone: Path) -> None:
    c = layerstack.connect(alone / "ls" / "admin.sock", bin_dir=bin_dir())
    try:
        root = _rootfs(alone / "src")
        stack = c.import_base(root)
        assert stack.startswith("import:sha256:") and len(stack) == len("import:sha256:") + 64
        # The same content, named relative to the working directory: the same stack.
        here = os.getcwd()
        os.chdir(alone / "src")
        try:
            assert c.import_base("rootfs", kind="dir") == stack
        finally:
            os.chdir(here)
        r = c.run(["cat", "/etc/motd"], stack=stack, publish="never")
        assert r.exit_status == 0 and r.stdout == b"imported from python\n", r
    finally:
        c.close()


def test_bad_input_raises_typed_errors_and_keeps_nothing(alone: Path) -> None:
    c = layerstack.connect(alone / "ls" / "admin.sock", bin_dir=bin_dir())
    try:
        with pytest.raises(layerstack.NotFoundError):
            c.import_base(alone / "no-such-dir")
        bad = alone / "bad.tar"
        with tarfile.open(bad, "w") as t:
            info = tarfile.TarInfo("../escaped")
            info.size = 4
            t.addfile(info, io.BytesIO(b"evil"))
        with pytest.raises(layerstack.InvalidArgumentError) as e:
            c.import_base(bad)
        assert "refused entry ../escaped" in e.value.message
        assert not (alone / "escaped").exists()
        # (A closed session's trees pass through staging as reap-*.)
        assert [p for p in (alone / "store" / "staging").iterdir() if p.name.startswith("import-")] == []
        with pytest.raises(ValueError):
            c.import_base(bad, kind="zip")
    finally:
        c.close()


def test_lists_are_paged(alone: Path) -> None:
    """ListStacks, ListBranches, ListGraphs and ListAttempts answer pages of
    ``page_size`` in key order with a ``next_page_token``; walking the tokens
    gives every item once; a bad token is INVALID_ARGUMENT. The client's list
    methods walk the pages."""
    from layerstack._pb import admin_pb2 as pb

    c = layerstack.connect(alone / "ls" / "admin.sock", bin_dir=bin_dir())
    try:
        stack = c.import_base(_rootfs(alone / "paged"))
        for b in ("b1", "b2", "b3", "b4"):
            c._stub.CreateBranch(pb.CreateBranchRequest(stack=stack, name=b))
        graphs = [unique_name(f"pg{i}") for i in range(3)]
        roots = [c.create_graph(g, stack=stack).root for g in graphs]
        for i in range(3):
            c.start_attempt(roots[0], owner=f"paged-{i}")

        def walk(rpc, make, field: str, size: int) -> list:  # type: ignore[no-untyped-def,type-arg]
            seen, token, pages = [], "", 0
            while True:
                r = rpc(make(page_size=size, page_token=token))
                items = list(getattr(r, field))
                assert len(items) <= size
                seen.extend(items)
                pages += 1
                if not r.next_page_token:
                    return seen
                token = r.next_page_token
                assert pages < 100, "the tokens must end"

        branches = walk(c._stub.ListBranches, lambda **k: pb.ListBranchesRequest(stack=stack, **k), "branches", 2)
        assert [b.name for b in branches] == ["b1", "b2", "b3", "b4", "main"]
        stacks = walk(c._stub.ListStacks, pb.ListStacksRequest, "stacks", 1)
        ids = [s.id for s in stacks]
        assert stack in ids and ids == sorted(ids) and len(set(ids)) == len(ids)
        assert not [s for s in stacks if s.id == stack][0].HasField("namespace"), "an imported base has no namespace"
        names = [g.name for g in walk(c._stub.ListGraphs, pb.ListGraphsRequest, "graphs", 2)]
        assert [n for n in names if n in graphs] == sorted(graphs)
        attempts = walk(c._stub.ListAttempts, lambda **k: pb.ListAttemptsRequest(node=roots[0], **k), "attempts", 2)
        assert len(attempts) == 3 and [a.id for a in attempts] == sorted(a.id for a in attempts)
        assert len(c.list_attempts(roots[0])) == 3
        assert set(graphs) <= {g.name for g in c.list_graphs()}
        with pytest.raises(layerstack.InvalidArgumentError) as e:
            c._call(c._stub.ListBranches, pb.ListBranchesRequest(stack=stack, page_token="zz"))
        assert "page_token" in e.value.message
    finally:
        c.close()


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{os.urandom(3).hex()}"


def test_ignore_mtime_publishes_content_changes_only(alone: Path) -> None:
    """A command that rewrites a file with the same bytes (``sed -i`` matching
    nothing) publishes a layer by default (its mtime moved) and nothing with
    ``ignore_mtime=True``."""
    c = layerstack.connect(alone / "ls" / "admin.sock", bin_dir=bin_dir())
    try:
        stack = c.import_base(_rootfs(alone / "mtime"))
        rewrite = ["sh", "-c", "cat /etc/motd > /motd.tmp && cat /motd.tmp > /etc/motd && rm /motd.tmp"]
        quiet = c.run(rewrite, stack=stack, branch="quiet", publish="on-exit", ignore_mtime=True)
        loud = c.run(rewrite, stack=stack, branch="loud", publish="on-exit")

        def published(r: layerstack.RunResult) -> set:  # type: ignore[type-arg]
            assert r.exit_status == 0 and r.session.outcome_id, r
            return {v.path.lstrip("/") for v in c.outcome_paths(r.session.outcome_id)}

        # (This tree has no /dev, /proc, /run, /sys: root mode's mount points are
        # published by both.)
        assert "etc/motd" not in published(quiet), "the same bytes with a new mtime: no change"
        assert "etc/motd" in published(loud), "an mtime is a change by default"
    finally:
        c.close()
