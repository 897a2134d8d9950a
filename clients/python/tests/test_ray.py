"""Rollouts across Ray nodes (issue 23; ``layerstack.ray``): a local Ray
cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, told
apart by the custom resources ``layerstack-a`` / ``layerstack-b``), each with a
LayerStack daemon and store of its own and a :class:`layerstack.ray.Worker`
next to it; a third daemon coordinates (the run's records); checkpoints move
through Debian's ``docker-registry`` started privately on 127.0.0.1. The
base is imported (``import_base``): no containerd.

- A step of samples spread over both workers: every sample rewarded once,
  its checkpoint pulled into the coordinator as a child of the task node,
  the audit clean; each worker pulled the task node once. A checkpoint made
  on worker a, expanded on both: only worker b pulls it, once.
- A task failure and a rejected result on a worker: recorded as a local
  attempt's are (``task_failed``; ``completed`` with reward 0, no node kept),
  not retried.
- A worker killed mid-step (``ray.kill`` of its actor): its attempts end
  ``infra_failed(node-lost)`` and are retried on the other worker, each
  sample's reward applied once.
- A worker's daemon killed mid-step (SIGKILL): its attempts end
  ``infra_failed(unavailable)`` and are retried on the other worker, each
  sample's reward applied once.

Needs root, ``busybox``, ``docker-registry``, the built daemon and ``ray``
(``pip install 'layerstack[ray]'``); skips without them, except with
``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple

import pytest

import layerstack
import layerstack.aio
from conftest import in_ci
from layerstack.fabric import Grader, RolloutResult
from test_registry import _missing, registry_and_daemons
from test_sandbox import _rootfs

try:
    import ray
    from ray.cluster_utils import Cluster

    # The actions below travel to the workers by value (their processes
    # cannot import this test module).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except ImportError:  # a CI without it fails below, never skips
    ray = None

#: Bytes of each Ray node's object store (the minimum Ray takes is 75 MiB).
OBJECT_STORE = 80 * 1024 * 1024

GRADER = Grader(["sh", "-c", "test -s /work/answer"], name="answer-written", version="1")


class Env(NamedTuple):
    dir: Path
    registry: str
    coordinator: Path
    #: Ray node id → its daemon's admin socket.
    admins: Dict[str, Path]
    #: "a" / "b" → Ray node id.
    nodes: Dict[str, str]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    missing = _missing()
    if ray is None:
        missing.append("ray (pip install 'layerstack[ray]')")
    if missing:
        msg = "the Ray tests need " + ", ".join(missing)
        if in_ci():
            pytest.fail("CI=true and " + msg, pytrace=False)
        pytest.skip(msg)
    with registry_and_daemons("lst-py-ray-", ("coord", "a", "b")) as e:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {"layerstack-a": 1},
                            "object_store_memory": OBJECT_STORE, "include_dashboard": False},
        )
        try:
            cluster.add_node(num_cpus=1, resources={"layerstack-b": 1}, object_store_memory=OBJECT_STORE)
            ray.init(address=cluster.address, log_to_driver=False)
            nodes = {}
            for n in ray.nodes():
                for name in ("a", "b"):
                    if f"layerstack-{name}" in n["Resources"]:
                        nodes[name] = n["NodeID"]
            assert set(nodes) == {"a", "b"}, ray.nodes()
            yield Env(e.dir, e.registry, e.admins[0],
                      {nodes["a"]: e.admins[1], nodes["b"]: e.admins[2]}, nodes)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()


async def write_answer(r: Any) -> None:
    """The policy's action: the sample's number into /work/answer."""
    out = await r.exec(["sh", "-c", f"echo {r.key.sample} > /work/answer"])
    assert out.ok, out


async def write_answer_slowly(r: Any) -> None:
    """As :func:`write_answer`, a second later: attempts are in flight when a
    worker is killed."""
    await r.exec(["sleep", "1"])
    await write_answer(r)


def _setup(env: Env, run: str) -> str:
    """The coordinator's graph (over an imported busybox base) and run ``run``;
    returns the graph's root node."""
    with layerstack.connect(env.coordinator) as c:
        stack = c.import_base(_rootfs(env.dir / f"rootfs-{run}"))
        g = c.create_graph(f"g-{run}", stack)

    async def create_run() -> None:
        async with layerstack.aio.connect(env.coordinator) as ac:
            await ac.create_run(run, g.name)

    asyncio.run(create_run())
    return g.root


async def _step(env: Env, run: str, root: str, step: int, n: int, act: Any, workers: List[Any],
                during: Any = None) -> "tuple[List[RolloutResult], Any]":
    import layerstack.ray as lsray

    async with layerstack.aio.connect(env.coordinator) as c:
        bg = asyncio.ensure_future(during(c)) if during is not None else None
        results = [
            r async for r in lsray.fan_out_ray(
                c, run, root, n, act, workers=workers, registry=f"{env.registry}/rl/{run}",
                step=step, prompt="answer", grader=GRADER, per_worker=2, max_attempts=3,
            )
        ]
        if bg is not None:
            await bg
        audit = await c.audit_run(run)
        attempts = [a async for a in c.rollouts(run, step=step)]
        return results, (audit, attempts)


async def _when_running_on(c: layerstack.aio.AsyncClient, run: str, worker: str) -> None:
    """Returns once the coordinator records a running attempt of ``run`` on
    ``worker`` (AssertionError after 60 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if [a async for a in c.rollouts(run, step=0) if a.status == "running" and a.worker == worker]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker {worker} never ran an attempt of {run}")


def _check_step(env: Env, root: str, results: List[RolloutResult], n: int) -> None:
    assert sorted(r.sample for r in results) == list(range(n))
    with layerstack.connect(env.coordinator) as c:
        for r in results:
            # The sample's errors in full (a repr of the result cuts them).
            assert r.attempt is not None, "\n".join(r.errors) or repr(r)
            assert (r.status, r.reward, r.attempt.applied) == ("completed", 1.0, True), r
            assert r.attempt.worker in env.admins, r.attempt
            kid = r.attempt.result_node
            assert kid is not None, r.attempt
            # The worker's checkpoint lives in the coordinator's graph, a child of the task node.
            node = c.show_node(kid)
            assert node.parents == (root,), node


def test_a_step_spreads_over_two_workers_and_rewards_each_sample_once(env: Env) -> None:
    import layerstack.ray as lsray

    run = f"ray-step-{os.getpid()}"
    root = _setup(env, run)
    workers = [lsray.start_worker(node_id, str(admin)) for node_id, admin in env.admins.items()]
    caps = ray.get([w.capabilities.remote() for w in workers])
    assert {c.node_id for c in caps} == set(env.admins), caps
    assert all(c.backends == ("linux", "wasi") and c.cores >= 1 and c.memory_bytes > 0 for c in caps), caps
    assert all(root not in c.nodes for c in caps), "the workers' stores start empty"
    n = 8
    t0 = time.monotonic()
    results, (audit, attempts) = asyncio.run(_step(env, run, root, 0, n, write_answer, workers))
    _check_step(env, root, results, n)
    used = {r.attempt.worker for r in results if r.attempt is not None}
    assert used == set(env.admins), f"both workers ran attempts: {used}"
    assert audit.violations == () and (audit.samples, audit.rewarded, audit.attempts) == (n, n, n), audit
    assert set(audit.by_worker) == set(env.admins) and sum(audit.by_worker.values()) == n, audit
    assert all(a.worker in env.admins and a.session is None for a in attempts), attempts
    # Each worker pulled the task node once and holds it now (hot for the next step).
    caps = ray.get([w.capabilities.remote() for w in workers])
    assert all(root in c.nodes and c.pulls == 1 for c in caps), caps
    # A checkpoint worker a made, expanded on both workers: b pulls it once,
    # a holds it already; the new checkpoints are its children.
    a_id = env.nodes["a"]
    kid = next(r.attempt.result_node for r in results if r.attempt is not None and r.attempt.worker == a_id)
    assert kid is not None
    deeper, (audit1, _) = asyncio.run(_step(env, run, kid, 1, n, write_answer, workers))
    _check_step(env, kid, deeper, n)
    assert {r.attempt.worker for r in deeper if r.attempt is not None} == set(env.admins), deeper
    assert audit1.violations == () and audit1.rewarded == 2 * n, audit1
    pulls = {c.node_id: c.pulls for c in ray.get([w.capabilities.remote() for w in workers])}
    assert pulls == {a_id: 1, env.nodes["b"]: 2}, pulls
    # The same step again reruns nothing: every sample was rewarded.
    again, (audit2, _) = asyncio.run(_step(env, run, root, 0, n, write_answer, workers))
    assert all(r.rewarded_before and r.reward == 1.0 for r in again), again
    assert audit2.attempts == 2 * n, f"steps 0 and 1, none new: {audit2}"
    print(f"ray step of {n}: {time.monotonic() - t0:.1f}s")


def test_a_worker_killed_mid_step_is_retried_elsewhere_with_rewards_once(env: Env) -> None:
    import layerstack.ray as lsray

    run = f"ray-kill-{os.getpid()}"
    root = _setup(env, run)
    victim = env.nodes["b"]
    workers = {node_id: lsray.start_worker(node_id, str(admin)) for node_id, admin in env.admins.items()}

    async def kill_when_busy(c: layerstack.aio.AsyncClient) -> None:
        await _when_running_on(c, run, victim)
        ray.kill(workers[victim], no_restart=True)

    n = 8
    results, (audit, attempts) = asyncio.run(
        _step(env, run, root, 0, n, write_answer_slowly, list(workers.values()), during=kill_when_busy)
    )
    _check_step(env, root, results, n)
    lost = [a for a in attempts if a.status == "infra_failed"]
    assert lost and all(a.infra_kind == lsray.NODE_LOST and a.worker == victim for a in lost), attempts
    for a in lost:
        applied = [b for b in attempts if b.key == a.key and b.applied]
        assert len(applied) == 1 and applied[0].attempt > a.attempt and applied[0].worker == env.nodes["a"], (a, applied)
    assert audit.violations == () and (audit.samples, audit.rewarded) == (n, n), audit
    assert audit.infra_failed.get(lsray.NODE_LOST) == len(lost) and audit.attempts == n + len(lost), audit
    # The next step is given the dead worker too: it is not used.
    nxt, _ = asyncio.run(_step(env, run, root, 1, 2, write_answer, list(workers.values())))
    assert all(r.reward == 1.0 and r.attempt and r.attempt.worker == env.nodes["a"] for r in nxt), nxt
    # With no worker alive, nothing is begun: NoWorkerError (kind unavailable).
    ray.kill(workers[env.nodes["a"]], no_restart=True)
    with pytest.raises(lsray.NoWorkerError) as e:
        asyncio.run(_step(env, run, root, 2, 2, write_answer, list(workers.values())))
    assert e.value.kind == "unavailable" and "start_worker" in str(e.value), e.value


async def fail_reject_or_answer(r: Any) -> None:
    """Sample 0: the task fails; sample 1: nothing written (the grader
    rejects it); the others: the answer."""
    from layerstack.fabric import TaskFailed

    if r.key.sample == 0:
        raise TaskFailed("the edit broke the build")
    if r.key.sample > 1:
        await write_answer(r)


def test_task_failures_and_rejected_results_on_workers_are_recorded_as_locally(env: Env) -> None:
    import layerstack.ray as lsray

    run = f"ray-mixed-{os.getpid()}"
    root = _setup(env, run)
    workers = [lsray.start_worker(node_id, str(admin)) for node_id, admin in env.admins.items()]
    results, (audit, attempts) = asyncio.run(_step(env, run, root, 0, 4, fail_reject_or_answer, workers))
    by = {r.sample: r for r in results}
    assert by[0].status == "task_failed" and by[0].reward is None and by[0].attempt is not None, by[0]
    assert by[0].attempt.message == "the edit broke the build", by[0].attempt
    rejected = by[1].attempt
    assert rejected is not None and (rejected.status, rejected.reward, rejected.accepted) == ("completed", 0.0, False)
    assert rejected.result_node is None and by[1].grade_output is not None and not by[1].grade_output.ok
    assert all(by[i].reward == 1.0 and by[i].attempt.result_node for i in (2, 3)), results  # type: ignore[union-attr]
    # One attempt each: a task failure and a rejection are results, not retried.
    assert audit.violations == () and (audit.attempts, audit.rewarded, audit.task_failed) == (4, 3, 1), audit
    assert all(a.worker in env.admins for a in attempts), attempts


def test_a_workers_daemon_killed_mid_step_fails_its_attempts_and_they_are_retried(env: Env) -> None:
    """The last test of the module: worker b's daemon stays dead after it."""
    import layerstack.ray as lsray

    run = f"ray-daemon-{os.getpid()}"
    root = _setup(env, run)
    victim = env.nodes["b"]
    with layerstack.connect(env.admins[victim]) as b:
        pid = b.status().pid  # a daemon this test module started
    workers = {node_id: lsray.start_worker(node_id, str(admin)) for node_id, admin in env.admins.items()}

    async def kill_daemon_when_busy(c: layerstack.aio.AsyncClient) -> None:
        await _when_running_on(c, run, victim)
        await asyncio.sleep(0.3)  # its sandbox is up
        os.kill(pid, signal.SIGKILL)

    n = 8
    results, (audit, attempts) = asyncio.run(
        _step(env, run, root, 0, n, write_answer_slowly, list(workers.values()), during=kill_daemon_when_busy)
    )
    _check_step(env, root, results, n)
    failed = [a for a in attempts if a.status == "infra_failed"]
    assert failed and all(a.worker == victim and a.infra_kind != lsray.NODE_LOST for a in failed), attempts
    for a in failed:
        applied = [x for x in attempts if x.key == a.key and x.applied]
        assert len(applied) == 1 and applied[0].worker == env.nodes["a"], (a, applied)
    assert audit.violations == () and (audit.samples, audit.rewarded) == (n, n), audit
    # The worker's actor outlived its daemon: it answers, its daemon does not.
    with pytest.raises(layerstack.UnavailableError):
        ray.get(workers[victim].capabilities.remote())
