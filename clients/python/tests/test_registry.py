"""Push and pull (issue 23) from Python: two daemons with empty stores and
Debian's ``docker-registry`` (distribution 2.8) started privately on
127.0.0.1. A node checkpointed on the first is pushed (every blob sent),
pushed again (nothing sent), pulled by the second from the asyncio client
(the node keeps its id and state; the imported base comes from the image), a
sandbox on it sees its files, and a pull again fetches nothing.

Needs root, ``busybox`` (busybox-static), ``docker-registry`` and the built
daemon; skips without them, except with ``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, NamedTuple, Sequence

import pytest

import layerstack
import layerstack.aio
from conftest import DAEMON_BIN, _terminate, _wait_for, bin_dir, in_ci
from test_sandbox import _rootfs

REGISTRY_BIN = "docker-registry"


class Env(NamedTuple):
    dir: Path
    registry: str
    admins: List[Path]


def _missing() -> List[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    for b in ("busybox", REGISTRY_BIN):
        if shutil.which(b) is None:
            missing.append(f"`{b}` on PATH")
    if not (bin_dir() / DAEMON_BIN).is_file():
        missing.append(f"{bin_dir() / DAEMON_BIN} (cargo build --workspace --bins)")
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _registry_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def registry_and_daemons(prefix: str, names: Sequence[str]) -> Iterator[Env]:
    """Debian's ``docker-registry`` on a free port of 127.0.0.1 and one daemon
    per name (empty stores, no containerd, the registry named insecure) under
    a new directory; all stopped by pid, the directory removed, on exit."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("LAYERSTACK_TEST_TMP", "/var/tmp")))
    d.chmod(0o755)
    (d / "owner.pid").write_text(str(os.getpid()))
    procs: List[subprocess.Popen] = []  # type: ignore[type-arg]
    try:
        port = _free_port()
        (d / "data").mkdir()
        (d / "registry.yml").write_text(
            "version: 0.1\nlog:\n  level: info\n"
            f"storage:\n  filesystem:\n    rootdirectory: {d / 'data'}\n"
            f"http:\n  addr: 127.0.0.1:{port}\n  secret: {secrets.token_hex(8)}\n"
        )
        renv = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        with open(d / "registry.log", "ab") as f:
            procs.append(subprocess.Popen([REGISTRY_BIN, "serve", str(d / "registry.yml")],
                                          stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=renv))
        _wait_for(REGISTRY_BIN, lambda: _registry_up(port), 30, d / "registry.log")
        host = f"127.0.0.1:{port}"
        admins = []
        for name in names:
            root = d / name
            (root / "ls").mkdir(parents=True)
            (root / "config.toml").write_text(f'[registry]\ninsecure = ["{host}"]\n')
            admin = root / "ls" / "admin.sock"
            with open(root / "daemon.log", "ab") as f:
                p = subprocess.Popen(
                    [
                        str(bin_dir() / DAEMON_BIN),
                        "--config", str(root / "config.toml"),
                        "--root", str(root / "store"),
                        "--address", str(root / "ls" / "snap.sock"),
                        "--admin-address", str(admin),
                        "--containerd-address", str(root / "ls" / "containerd.sock"),  # none runs
                        "--metrics-address", "127.0.0.1:0",
                    ],
                    stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                )
            procs.append(p)
            _wait_for(DAEMON_BIN, lambda: admin.exists() and p.poll() is None, 30, root / "daemon.log")
            admins.append(admin)
        yield Env(d, host, admins)
    finally:
        for p in reversed(procs):
            _terminate(p)
        subprocess.run(["umount", "-R", "-l", str(d)], capture_output=True)
        if not os.environ.get("LAYERSTACK_TEST_KEEP"):
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    missing = _missing()
    if missing:
        msg = "push/pull tests need " + ", ".join(missing)
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)
    with registry_and_daemons("lst-py-reg-", ("a", "b")) as e:
        yield e


def test_a_node_pushed_from_one_daemon_is_pulled_into_another(env: Env) -> None:
    with layerstack.connect(env.admins[0]) as a:
        stack = a.import_base(_rootfs(env.dir / "rootfs"))
        root = a.create_graph(f"reg-{os.getpid()}", stack).root
        with a.sandbox(node=root) as sb:
            sb.files.write("/work/answer", "42\n")
            node = sb.close(checkpoint=True, state={"reward": 1.0}).node
        assert node
        ref = f"{env.registry}/py/task:{node}"
        first = a.push(ref, node=node)
        assert (first.node, first.layers, first.blobs_sent, first.blobs_present) == (node, 2, 3, 0), first
        assert first.manifest_digest.startswith("sha256:") and len(first.diff_ids) == 2
        again = a.push(ref, node=node)
        assert (again.blobs_sent, again.blobs_present, again.layers_packed) == (0, 3, 0), again
        with pytest.raises(ValueError):
            a.push(ref)
        with pytest.raises(layerstack.InvalidArgumentError):
            a.push(f"{env.registry}/py/task@sha256:{'0' * 64}", node=node)

    async def pull_on_b() -> layerstack.PullResult:
        async with layerstack.aio.connect(env.admins[1]) as b:
            got = await b.pull(ref)
            async with b.sandbox(node=got.node) as sb:
                assert await sb.files.read("/work/answer") == b"42\n"
            return got

    got = asyncio.run(pull_on_b())
    assert (got.node, got.created, got.base_imported, got.layers_fetched) == (node, True, True, 1), got
    assert got.stack == stack and got.manifest_digest == first.manifest_digest, got
    with layerstack.connect(env.admins[1]) as b:
        shown = b.show_node(node)
        assert shown.state == {"reward": 1.0}
        # Pulled before its parent (the graph's root): kept as declared, no edge;
        # pushed from here it is the same image.
        assert (shown.parents, shown.missing_parents, shown.declared_parents) == ((), (root,), (root,)), shown
        from_b = b.push(f"{env.registry}/py/task-from-b:{node}", node=node)
        assert from_b.manifest_digest == first.manifest_digest, (from_b, first)
        again_pulled = b.pull(ref)
        assert (again_pulled.created, again_pulled.layers_fetched, again_pulled.bytes_fetched > 0) == (False, 0, True)
        # The parent arrives: this pull links the node to it.
        with layerstack.connect(env.admins[0]) as a:
            a.push(f"{env.registry}/py/task:{root}", node=root)
        parent = b.pull(f"{env.registry}/py/task:{root}")
        assert parent.linked_children == (node,), parent
        shown = b.show_node(node)
        assert (shown.parents, shown.missing_parents, shown.declared_parents) == ((root,), (), (root,)), shown
        with pytest.raises(layerstack.LayerStackError) as e:
            b.pull(f"{env.registry}/py/none:x")
        assert e.value.kind in ("not_found", "invalid_argument"), e.value
        # A graph of the pulled node's graph name with another root here:
        # refused naming --graph, then pulled into a graph named by the caller.
        clash = f"clash-{os.getpid()}"
        b.create_graph(clash, stack)
        with layerstack.connect(env.admins[0]) as a:
            theirs = a.create_graph(clash, stack).root
            a.push(f"{env.registry}/py/task:{theirs}", node=theirs)
        with pytest.raises(layerstack.FailedPreconditionError) as e:
            b.pull(f"{env.registry}/py/task:{theirs}")
        assert "--graph" in str(e.value) and clash in str(e.value), e.value
        moved = b.pull(f"{env.registry}/py/task:{theirs}", graph=f"{clash}-a")
        assert (moved.node, moved.graph, moved.created) == (theirs, f"{clash}-a", True), moved
        assert b.show_node(theirs).id == theirs


def test_a_branch_head_pushed_from_one_daemon_lands_on_a_branch_of_another(env: Env) -> None:
    """``push(stack=…)`` then ``pull``: the head lands on a branch made for it
    (``branch=``) or on the branch it was pushed from (fast-forward here), a
    pull after one more layer fetches that layer only, and a conflicting head
    is refused whole (ConflictError, the branch unchanged)."""
    work = f"work-{os.getpid()}"

    def publish(c: layerstack.Client, stack: str, on: str, path: str, text: str) -> None:
        with c.sandbox(stack, branch=on) as sb:
            sb.files.write(path, text)
            sb.close(publish=True)

    with layerstack.connect(env.admins[0]) as a, layerstack.connect(env.admins[1]) as b:
        stack = a.import_base(_rootfs(env.dir / "rootfs-heads"))
        publish(a, stack, "main", "/work/one", "1\n")
        ref = f"{env.registry}/py/head:main"
        pushed = a.push(ref, stack=stack, branch="main")
        assert pushed.node == "" and pushed.layers >= 2, pushed
        got = b.pull(ref, branch=work)
        assert (got.node, got.graph, got.branch, got.branch_result) == ("", "", work, "created"), got
        assert got.created and got.branch_head > 0, got
        with b.sandbox(stack, branch=work) as sb:
            assert sb.files.read("/work/one") == b"1\n"
        publish(a, stack, "main", "/work/two", "2\n")
        a.push(ref, stack=stack, branch="main")
        ff = b.pull(ref, branch=work)
        assert (ff.branch_result, ff.layers_fetched) == ("fast-forward", 1), ff
        # No branch named: the one it was pushed from.
        onto_main = b.pull(ref)
        assert (onto_main.branch, onto_main.branch_result, onto_main.layers_fetched) == ("main", "fast-forward", 0), onto_main
        publish(b, stack, work, "/work/c", "mine\n")
        publish(a, stack, "main", "/work/c", "theirs\n")
        a.push(ref, stack=stack, branch="main")
        with pytest.raises(layerstack.ConflictError) as e:
            b.pull(ref, branch=work)
        assert "/work/c" in str(e.value) and e.value.kind == "conflict", e.value
        with b.sandbox(stack, branch=work) as sb:
            assert sb.files.read("/work/c") == b"mine\n"
        with pytest.raises(layerstack.InvalidArgumentError):
            b.pull(ref, graph="g")


def test_a_remote_attempt_ends_with_the_checkpoint_its_worker_pushed(env: Env) -> None:
    """The fabric's remote attempts over the wire (docs/fabric.md "Remote
    attempts"): daemon a records the attempt for worker "b" with no sandbox
    there; b pulls the task node, checkpoints a child and pushes it; a pulls
    it and ends the attempt with it as result_node, once."""

    from layerstack.fabric import SampleKey

    with layerstack.connect(env.admins[0]) as sync_a:
        stack = sync_a.import_base(_rootfs(env.dir / "rootfs-remote"))

    async def main() -> None:
        async with layerstack.aio.connect(env.admins[0]) as a, layerstack.aio.connect(env.admins[1]) as b:
            g = await a.create_graph(f"remote-{os.getpid()}", stack)
            run = f"remote-run-{os.getpid()}"
            await a.create_run(run, g.name)
            task_ref = f"{env.registry}/py/remote:{g.root}"
            await a.push(task_ref, node=g.root)
            key = SampleKey(run, 0, "t", 0)
            r = await a.begin_rollout(key, 1, g.root, worker="b")
            assert r.sandbox is None and r.attempt is not None
            assert (r.attempt.worker, r.attempt.session, r.attempt.status) == ("b", None, "running")
            again = await a.begin_rollout(key, 1, g.root, worker="b")
            assert again.attempt is not None and again.attempt.id == r.attempt.id and not again.created
            with pytest.raises(layerstack.FailedPreconditionError) as e:
                await a.begin_rollout(key, 1, g.root, worker="c")
            assert '"b"' in str(e.value) and '"c"' in str(e.value), e.value
            # The worker's side: pull, sandbox, checkpoint, push.
            assert (await b.pull(task_ref)).node == g.root
            async with b.sandbox(node=g.root) as sb:
                await sb.files.write("/work/answer", "42\n")
                child = (await sb.close(checkpoint=True, state={"by": "b"})).node
            assert child
            # Not pulled yet: refused, naming what to do; the attempt still runs.
            with pytest.raises(layerstack.NotFoundError) as nf:
                await r.end(reward=1.0, result_node=child)
            assert "pull it first" in str(nf.value), nf.value
            child_ref = f"{env.registry}/py/remote:{child}"
            await b.push(child_ref, node=child)
            pulled = await a.pull(child_ref)
            assert (pulled.node, pulled.missing_parents) == (child, ()), pulled
            ended = await r.end(reward=1.0, backprop=1.0, result_node=child)
            assert (ended.status, ended.applied, ended.result_node, ended.worker) == ("completed", True, child, "b")
            assert await r.end(reward=1.0, backprop=1.0, result_node=child) == ended
            s = await a.sample(key)
            assert s is not None and (s.reward, s.reward_attempt) == (1.0, 1)
            # A local attempt given a result node is refused.
            local = await a.begin_rollout(SampleKey(run, 0, "t", 1), 1, g.root)
            with pytest.raises(layerstack.FailedPreconditionError) as e:
                await local.end(reward=0.0, result_node=child)
            assert "is local" in str(e.value), e.value
            # The refusal touched nothing: its sandbox still runs.
            assert (await local.exec(["true"])).ok
            await local.end(infra_failed="test", keep="discard")
            audit = await a.audit_run(run)
            assert audit.violations == () and audit.completed == 1, audit

    asyncio.run(main())
