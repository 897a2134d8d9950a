"""Rollouts across Ray nodes (issue 23; ``layerstack.ray``): a local Ray
cluster of three nodes on this machine (``ray.cluster_utils.Cluster``, told
apart by the custom resources ``layerstack-coord`` / ``layerstack-a`` /
``layerstack-b``), each with a LayerStack daemon and store of its own. The
head node is the coordinator's: the driver (this test) runs ``fan_out_ray``
there against the coordinating daemon (the run's records), with no worker
and no CPU for Ray to place anything on; nodes a and b each run a
:class:`layerstack.ray.Worker` next to their daemon, and the attempts go to
those two only (``fan_out_ray`` places attempts on the workers it is given,
or on those registered: none is started on the head).
Checkpoints move through Debian's ``docker-registry`` started privately on
127.0.0.1. The base is imported (``import_base``): no containerd. Each Ray
node's object store is the 80 MiB minimum.

- A step of 256 samples spread over both workers (4 attempts at once on
  each): every sample rewarded once, its checkpoint pulled into the
  coordinator as a child of the task node, the audit clean; each worker
  pulled the task node once. A checkpoint made on worker a, expanded on both:
  only worker b pulls it, once for all its attempts (then it is hot there).
- A worker killed mid-step (``ray.kill`` of its actor): its attempts end
  ``infra_failed(node-lost)`` and are retried on the other worker, each
  sample's reward applied once.
- A Ray node removed mid-step (``cluster.remove_node``, not graceful: its
  raylet, object store and worker processes killed): the same, though Ray
  takes another path (the driver sees ``ActorUnavailableError`` when the
  actor's process goes, before Ray's health checks mark the node dead); its
  daemon and store stay, and a replacement Ray node next to them gets a
  worker whose store holds the task node already.
- A task failure and a rejected result on a worker: recorded as a local
  attempt's are (``task_failed``; ``completed`` with reward 0, no node kept),
  not retried.
- A worker's daemon answering ``not_found`` (a store file gone) and the
  coordinator failing an end (``internal``): infrastructure failures, the
  attempts ended ``infra_failed(<kind>)`` and the samples retried — what once
  made a sample of the daemon-killed test end with no attempt. Sandbox
  options the workers' daemons refuse (``invalid_argument``): the caller's
  mistake, raised into the samples' results, not retried.
- Workers registered in Ray (named actors in the namespace ``layerstack``):
  ``start_workers`` twice starts one per node carrying ``layerstack-daemon``
  (a and b; the head has none); ``discover_workers`` finds both with their
  capabilities; ``fan_out_ray`` without a workers list runs on them; a killed
  worker is no longer found, and with none left a step raises
  ``NoWorkerError``.
- A worker's daemon killed mid-step (SIGKILL): its attempts end
  ``infra_failed(unavailable)`` and are retried on the other worker, each
  sample's reward applied once; discovery then skips that worker, saying
  its daemon does not answer.

Needs root, ``busybox``, ``docker-registry``, the built daemon and ``ray``
(``pip install 'layerstack[ray]'``); skips without them, except with
``CI=true``, where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

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
    #: The workers' Ray node ids → their daemon's admin socket (a and b; the
    #: coordinator's node has no worker).
    admins: Dict[str, Path]
    #: "coord" / "a" / "b" → Ray node id (a replaced node's new id).
    nodes: Dict[str, str]
    #: "coord" / "a" / "b" → that node's daemon's admin socket.
    daemons: Dict[str, Path]
    cluster: Any
    #: "a" / "b" → the Ray node (``cluster.remove_node``); the head is "coord".
    ray_nodes: Dict[str, Any]


#: The ``layerstack-slots`` resource declared on worker node a (b declares
#: none: its slots are its 1 Ray CPU).
SLOTS_A = 2


def _add_worker_node(cluster: Any, name: str) -> Any:
    """A Ray node with the custom resources ``layerstack-<name>`` and
    ``layerstack-daemon`` (the head has none: no worker is started there;
    nothing asks for CPUs of it: workers take none); node a also declares
    ``layerstack-slots``."""
    import layerstack.ray as lsray

    resources = {f"layerstack-{name}": 1, lsray.DAEMON_RESOURCE: 1}
    if name == "a":
        resources[lsray.SLOTS_RESOURCE] = SLOTS_A
    return cluster.add_node(num_cpus=1, resources=resources, object_store_memory=OBJECT_STORE)


def _node_ids() -> Dict[str, str]:
    """The live Ray nodes by the name in their ``layerstack-<name>`` resource."""
    ids = {}
    for n in ray.nodes():
        for name in ("coord", "a", "b"):
            if n["Alive"] and f"layerstack-{name}" in n["Resources"]:
                ids[name] = n["NodeID"]
    return ids


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
        # Three Ray nodes: the head (the driver's, where fan_out_ray talks to
        # the coordinating daemon; no worker, no CPU) and a node per worker.
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "resources": {"layerstack-coord": 1},
                            "object_store_memory": OBJECT_STORE, "include_dashboard": False},
        )
        try:
            ray_nodes = {name: _add_worker_node(cluster, name) for name in ("a", "b")}
            ray.init(address=cluster.address, log_to_driver=False)
            nodes = _node_ids()
            assert set(nodes) == {"coord", "a", "b"}, ray.nodes()
            assert nodes["coord"] == ray.get_runtime_context().get_node_id(), "the driver is on the head"
            daemons = {"coord": e.admins[0], "a": e.admins[1], "b": e.admins[2]}
            yield Env(e.dir, e.registry, e.admins[0],
                      {nodes["a"]: daemons["a"], nodes["b"]: daemons["b"]}, nodes, daemons, cluster, ray_nodes)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()


def _workers(env: Env) -> Dict[str, Any]:
    """A worker on each worker node (a, b), by Ray node id."""
    import layerstack.ray as lsray

    return {node_id: lsray.start_worker(node_id, str(admin)) for node_id, admin in env.admins.items()}


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


async def _step(env: Env, run: str, root: str, step: int, n: int, act: Any, workers: Optional[List[Any]],
                during: Any = None, per_worker: int = 2, coordinator: Any = None,
                sandbox: Any = None) -> "tuple[List[RolloutResult], Any]":
    """One step of ``n`` samples of ``root`` on ``workers`` (``None``: the
    registered ones): its results, the
    run's audit and the step's attempts. ``during(c)`` runs beside it;
    ``coordinator(c)`` is what fan_out_ray is given instead of the client."""
    import layerstack.ray as lsray

    async with layerstack.aio.connect(env.coordinator) as c:
        bg = asyncio.ensure_future(during(c)) if during is not None else None
        results = [
            r async for r in lsray.fan_out_ray(
                coordinator(c) if coordinator is not None else c, run, root, n, act, workers=workers,
                registry=f"{env.registry}/rl/{run}", step=step, prompt="answer", grader=GRADER,
                per_worker=per_worker, max_attempts=3, sandbox=sandbox,
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


#: Rollouts of the issue's step (issue 23: "a 256-rollout step spread over two workers").
BIG_STEP = 256


def test_a_step_of_256_spreads_over_two_workers_and_rewards_each_sample_once(env: Env) -> None:
    import layerstack.ray as lsray

    run = f"ray-step-{os.getpid()}"
    root = _setup(env, run)
    workers = list(_workers(env).values())
    caps = ray.get([w.capabilities.remote() for w in workers])
    assert {c.node_id for c in caps} == set(env.admins), caps
    assert env.nodes["coord"] not in env.admins, "no worker on the coordinator's node"
    assert all(c.backends == ("linux", "wasi") and c.cores >= 1 and c.memory_bytes > 0 for c in caps), caps
    assert all(root not in c.nodes and c.stacks == () for c in caps), "the workers' stores start empty"
    # Slots come from Ray: a's layerstack-slots resource, b's Ray CPU.
    slots = {c.node_id: c.slots for c in caps}
    assert slots == {env.nodes["a"]: SLOTS_A, env.nodes["b"]: 1}, slots
    with layerstack.connect(env.coordinator) as c:
        stack = next(g.stack for g in c.list_graphs() if g.root == root)
    n = BIG_STEP
    t0 = time.monotonic()
    results, (audit, attempts) = asyncio.run(_step(env, run, root, 0, n, write_answer, workers, per_worker=4))
    t_step = time.monotonic() - t0
    _check_step(env, root, results, n)
    by_worker = {w: sum(1 for r in results if r.attempt is not None and r.attempt.worker == w) for w in env.admins}
    assert all(by_worker.values()), f"both workers ran attempts: {by_worker}"
    assert audit.violations == () and (audit.samples, audit.rewarded, audit.attempts) == (n, n, n), audit
    assert audit.by_worker == by_worker, audit
    assert all(a.worker in env.admins and a.session is None for a in attempts), attempts
    # Each worker pulled the task node once and holds it now (hot for the next step).
    caps = ray.get([w.capabilities.remote() for w in workers])
    assert all(root in c.nodes and c.pulls == 1 and c.stacks == (stack,) for c in caps), caps
    # A checkpoint worker a made, expanded on both workers: b pulls it once,
    # a holds it already; the new checkpoints are its children.
    a_id, b_id = env.nodes["a"], env.nodes["b"]
    kid = next(r.attempt.result_node for r in results if r.attempt is not None and r.attempt.worker == a_id)
    assert kid is not None
    k = 8
    deeper, (audit1, _) = asyncio.run(_step(env, run, kid, 1, k, write_answer, workers))
    _check_step(env, kid, deeper, k)
    on_b = [r for r in deeper if r.attempt is not None and r.attempt.worker == b_id]
    # a holds the node: it takes its SLOTS_A slots first, b its one slot next.
    assert len(on_b) >= 1 and len(on_b) < k, deeper
    assert audit1.violations == () and audit1.rewarded == n + k, audit1
    # b pulled it once for all its attempts (then it was hot there).
    pulls = {c.node_id: c.pulls for c in ray.get([w.capabilities.remote() for w in workers])}
    assert pulls == {a_id: 1, b_id: 2}, pulls
    # The same step again reruns nothing: every sample was rewarded.
    again, (audit2, _) = asyncio.run(_step(env, run, root, 0, n, write_answer, workers, per_worker=4))
    assert all(r.rewarded_before and r.reward == 1.0 for r in again), again
    assert audit2.attempts == n + k, f"steps 0 and 1, none new: {audit2}"
    print(f"ray step of {n} on 2 workers: {t_step:.1f}s ({by_worker[a_id]} on a, {by_worker[b_id]} on b); "
          f"the test: {time.monotonic() - t0:.1f}s")


def test_a_worker_killed_mid_step_is_retried_elsewhere_with_rewards_once(env: Env) -> None:
    import layerstack.ray as lsray

    run = f"ray-kill-{os.getpid()}"
    root = _setup(env, run)
    victim = env.nodes["b"]
    workers = _workers(env)

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


def test_a_ray_node_removed_mid_step_is_node_lost_and_retried_elsewhere(env: Env) -> None:
    """Not the same as the actor killed above: the Ray node goes
    (``cluster.remove_node``: its raylet, object store and worker processes
    killed, nothing graceful), so Ray finds out by its health checks of the
    node, and the driver's call fails with whatever Ray raises for an actor
    on a node that died. Its daemon (not a Ray process) and its store stay:
    a replacement Ray node next to them gets a worker whose store holds the
    task node already."""
    import layerstack.ray as lsray

    run = f"ray-remove-{os.getpid()}"
    root = _setup(env, run)
    victim = env.nodes["b"]
    workers = _workers(env)
    removed: List[float] = []

    async def remove_when_busy(c: layerstack.aio.AsyncClient) -> None:
        await _when_running_on(c, run, victim)
        # Its worker pulled the task node (a removal mid-pull leaves its
        # daemon without it): its attempts are in their sandboxes now.
        async with layerstack.aio.connect(env.daemons["b"]) as b:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(layerstack.NotFoundError):
                    if not (await b.show_node(root)).pruned:
                        break
                assert time.monotonic() < deadline, f"worker b never pulled {root}"
                await asyncio.sleep(0.05)
        t = time.monotonic()
        # Blocking (it waits for the processes to die): off the event loop
        # the fan-out runs on.
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: env.cluster.remove_node(env.ray_nodes["b"], allow_graceful=False))
        removed.append(time.monotonic() - t)

    n = 8
    t0 = time.monotonic()
    try:
        results, (audit, attempts) = asyncio.run(
            _step(env, run, root, 0, n, write_answer_slowly, list(workers.values()), during=remove_when_busy)
        )
        t_step = time.monotonic() - t0
        _check_step(env, root, results, n)
        assert removed, "node b was removed mid-step"
        lost = [a for a in attempts if a.status == "infra_failed"]
        assert lost and all(a.infra_kind == lsray.NODE_LOST and a.worker == victim for a in lost), attempts
        for a in lost:
            applied = [x for x in attempts if x.key == a.key and x.applied]
            assert len(applied) == 1 and applied[0].worker == env.nodes["a"], (a, applied)
        assert audit.violations == () and (audit.samples, audit.rewarded) == (n, n), audit
        assert audit.infra_failed.get(lsray.NODE_LOST) == len(lost) and audit.attempts == n + len(lost), audit
        seen = sorted({e.split(": lost: ")[1].split("(")[0] for r in results for e in r.errors if ": lost: " in e})
        print(f"ray node removed mid-step: removal {removed[0]:.1f}s, step of {n} {t_step:.1f}s, "
              f"{len(lost)} attempt(s) node-lost ({', '.join(seen)})")
    finally:
        # Ray's health checks find the node dead (the attempts were retried
        # before: the driver saw its actor's process go).
        deadline = time.monotonic() + 120
        while victim in {x["NodeID"] for x in ray.nodes() if x["Alive"]} and time.monotonic() < deadline:
            time.sleep(0.2)
        dead_after = time.monotonic() - t0
        # A Ray node again next to b's daemon, for the tests after this one.
        del env.admins[victim]
        env.ray_nodes["b"] = _add_worker_node(env.cluster, "b")
        env.nodes["b"] = env.ray_nodes["b"].node_id
        env.admins[env.nodes["b"]] = env.daemons["b"]
    print(f"Ray marked node b dead {dead_after:.1f}s after the step began")
    assert victim not in {x["NodeID"] for x in ray.nodes() if x["Alive"]}, ray.nodes()
    assert _node_ids() == {"coord": env.nodes["coord"], "a": env.nodes["a"], "b": env.nodes["b"]}, ray.nodes()
    # Its worker there finds the task node in the store the lost node's worker pulled it into.
    w = lsray.start_worker(env.nodes["b"], str(env.daemons["b"]))
    info = ray.get(w.capabilities.remote())
    assert info.node_id == env.nodes["b"] != victim and root in info.nodes and info.pulls == 0, info


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
    workers = list(_workers(env).values())
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


#: What a daemon's store answered when a file it wrote was gone (the
#: coordinator's blob race that test_a_workers_daemon_killed_… hit once; its
#: kind is ``internal``): ``i/o on <root>/blobs/<64 hex>: No such file or directory``.
LOST_FILE = "i/o on {}/blobs/" + "0" * 64 + ": No such file or directory (os error 2)"


class _FailsFirstEnd:
    """The coordinator, as fan_out_ray sees it, except that the first end of a
    completed attempt fails as an internal error of its store (nothing
    recorded) — what the blob race made it answer."""

    def __init__(self, c: Any, root: Path) -> None:
        self.c = c
        self.root = root
        #: (attempt id, the checkpoint the end named) of the failed end.
        self.failed: List[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.c, name)

    async def begin_rollout(self, *a: Any, **kw: Any) -> Any:
        return _EndOf(await self.c.begin_rollout(*a, **kw), self)


class _EndOf:
    def __init__(self, r: Any, owner: _FailsFirstEnd) -> None:
        self.r = r
        self.owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.r, name)

    async def end(self, **kw: Any) -> Any:
        if kw.get("reward") is not None and not self.owner.failed:
            self.owner.failed.append((self.r.attempt.id, kw.get("result_node")))
            raise layerstack.errors.InternalError(None, "internal", LOST_FILE.format(self.owner.root))
        return await self.r.end(**kw)


def test_a_workers_store_error_and_a_failed_end_are_infrastructure_failures_retried(env: Env) -> None:
    """What made a sample end with no attempt (seen once in three runs of the
    daemon-killed test below): an error of a store that is no mistake of the
    caller's — a worker's daemon answering ``not_found`` (here: worker a's
    first pull), the coordinator failing an end (``internal``) — ends the
    attempt ``infra_failed(<kind>)`` and the sample is retried; before, the
    first was raised as the caller's and the second escaped the sample."""
    import layerstack.ray as lsray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run = f"ray-errors-{os.getpid()}"
    root = _setup(env, run)
    a_id, b_id = env.nodes["a"], env.nodes["b"]
    lost_file = LOST_FILE.format(env.dir / "a" / "store")

    class LosesAFileOnce(lsray.Worker):
        """Its daemon answers its first pull not_found."""

        lost = False

        async def _ensure(self, node: str, reference: str) -> bool:
            if not self.lost:
                self.lost = True
                raise layerstack.errors.NotFoundError(None, "not_found", lost_file)
            return await super()._ensure(node, reference)

    flaky = ray.remote(LosesAFileOnce).options(
        num_cpus=0, max_concurrency=64, scheduling_strategy=NodeAffinitySchedulingStrategy(a_id, soft=False),
    ).remote(str(env.admins[a_id]))
    workers = [flaky, lsray.start_worker(b_id, str(env.admins[b_id]))]
    coordinators: List[_FailsFirstEnd] = []

    def failing(c: Any) -> _FailsFirstEnd:
        coordinators.append(_FailsFirstEnd(c, env.dir / "coord" / "store"))
        return coordinators[-1]

    n = 4
    results, (audit, attempts) = asyncio.run(
        _step(env, run, root, 0, n, write_answer, workers, coordinator=failing)
    )
    _check_step(env, root, results, n)
    failed = sorted((a for a in attempts if a.status == "infra_failed"), key=lambda a: a.infra_kind or "")
    assert [(a.infra_kind, a.result_node) for a in failed] == [("internal", None), ("not_found", None)], attempts
    ended, lost = failed
    assert lost.worker == a_id and "No such file or directory" in lost.message, lost
    assert "No such file or directory" in ended.message, ended
    # Each failed sample's reward came from a later attempt, applied once; the
    # one the worker failed ran again on the other worker.
    for a in failed:
        applied = [x for x in attempts if x.key == a.key and x.applied]
        assert len(applied) == 1 and applied[0].attempt > a.attempt, (a, applied)
    assert [x.worker for x in attempts if x.key == lost.key and x.applied] == [b_id], attempts
    assert audit.violations == () and (audit.samples, audit.rewarded, audit.attempts) == (n, n, n + 2), audit
    # The checkpoint the failed end named (pulled into the coordinator) is
    # pruned: no attempt keeps it.
    [(attempt_id, kid)] = coordinators[0].failed
    assert attempt_id == ended.id and kid is not None
    with layerstack.connect(env.coordinator) as c:
        assert c.show_node(kid).pruned, kid
    errors = [e for r in results for e in r.errors]
    assert any("not_found" in e and a_id in e for e in errors) and any("internal" in e for e in errors), errors


#: Sandbox options a daemon refuses (``invalid_argument``: a workdir must be absolute).
REFUSED_OPTIONS = {"workdir": "relative/dir"}
REFUSED_KIND = "invalid_argument"


def test_the_callers_sandbox_options_refused_on_a_worker_are_raised_not_retried(env: Env) -> None:
    """A caller's own mistake still raises: sandbox options every worker's
    daemon refuses end the attempt infra_failed(<kind>) once, and the sample's
    result holds the error; nothing is retried."""
    run = f"ray-refused-{os.getpid()}"
    root = _setup(env, run)
    n = 2
    results, (audit, attempts) = asyncio.run(
        _step(env, run, root, 0, n, write_answer, list(_workers(env).values()), sandbox=REFUSED_OPTIONS)
    )
    assert sorted(r.sample for r in results) == list(range(n))
    assert all(r.attempt is None and r.reward is None and len(r.errors) == 1 for r in results), results
    assert all(REFUSED_KIND in r.errors[0] for r in results), results
    assert len(attempts) == n and all(a.status == "infra_failed" and a.infra_kind == REFUSED_KIND
                                      for a in attempts), attempts
    assert audit.violations == () and (audit.rewarded, audit.attempts) == (0, n), audit
    # An executor no worker serves: nothing is begun, NoWorkerError names it.
    import layerstack.ray as lsray

    with pytest.raises(lsray.NoWorkerError, match="executor 'jvm'"):
        asyncio.run(_step(env, run, root, 1, n, write_answer, list(_workers(env).values()),
                          sandbox={"executor": "jvm"}))

    async def audit() -> Any:
        async with layerstack.aio.connect(env.coordinator) as c:
            return await c.audit_run(run)

    assert asyncio.run(audit()).attempts == n, "no attempt begun for the executor no worker serves"


def test_workers_register_in_ray_once_per_node_and_fan_out_ray_finds_them(env: Env) -> None:
    """Registration on Ray's own names: start_workers twice starts one actor
    per daemon node (the head, without the ``layerstack-daemon`` resource, has
    none); discover_workers finds them with their capabilities; fan_out_ray
    with no workers list runs on them; a killed worker is no longer found,
    and with none left a step raises NoWorkerError naming start_workers."""
    import layerstack.ray as lsray

    run = f"ray-registry-{os.getpid()}"
    root = _setup(env, run)
    a_id, b_id = env.nodes["a"], env.nodes["b"]
    asked: List[str] = []

    def admin_for(node: Dict[str, Any]) -> str:
        asked.append(node["NodeID"])
        return str(env.admins[node["NodeID"]])

    first = lsray.start_workers(admin_for)
    again = lsray.start_workers(admin_for)
    assert sorted(asked) == sorted([a_id, b_id] * 2), "only the nodes carrying layerstack-daemon"
    assert set(first) == set(again) == {a_id, b_id}, (first, again)
    assert all(first[k]._actor_id == again[k]._actor_id for k in first), "a second start answers the first actor"
    assert lsray.start_worker(a_id, str(env.admins[a_id]))._actor_id == first[a_id]._actor_id
    registered = sorted(x["name"] for x in ray.util.list_named_actors(all_namespaces=True)
                        if x["namespace"] == lsray.NAMESPACE)
    assert registered == sorted(lsray.worker_actor_name(k) for k in (a_id, b_id)), registered
    # Another daemon for a node that has a worker: refused, nothing started.
    with pytest.raises(ValueError, match="has a worker already"):
        lsray.start_worker(a_id, str(env.daemons["coord"]))
    # The same with a mapping node id -> admin: the same actors.
    mapped = lsray.start_workers({a_id: str(env.admins[a_id])})
    assert list(mapped) == [a_id] and mapped[a_id]._actor_id == first[a_id]._actor_id

    found = lsray.discover_workers()
    assert found.skipped == (), found.skipped
    by_node = {w.info.node_id: w for w in found.workers}
    assert set(by_node) == {a_id, b_id}, found
    for node_id, w in by_node.items():
        i = w.info
        assert (w.actor, i.actor, i.name) == (lsray.worker_actor_name(node_id),) * 2 + (node_id,), w
        assert i.admin == str(env.admins[node_id]) and i.backends == ("linux", "wasi"), i
        assert i.cores >= 1 and i.memory_bytes > 0 and i.running == 0, i
        assert w.handle._actor_id == first[node_id]._actor_id

    # fan_out_ray with no workers list: the registered ones.
    n = 4
    results, (audit, attempts) = asyncio.run(_step(env, run, root, 0, n, write_answer, None))
    _check_step(env, root, results, n)
    assert audit.violations == () and (audit.samples, audit.rewarded, audit.attempts) == (n, n, n), audit
    ran = {a.worker for a in attempts}
    assert ran <= {a_id, b_id}, attempts
    # What discovery reports changed with the step: the workers that ran it
    # hold the task node and its stack now.
    with layerstack.connect(env.coordinator) as c:
        stack = next(g.stack for g in c.list_graphs() if g.root == root)
    infos = {w.info.node_id: w.info for w in lsray.discover_workers().workers}
    assert all(root in infos[w].nodes and stack in infos[w].stacks for w in ran), infos

    # A killed worker is no longer found; a step runs on the other one.
    ray.kill(first[b_id], no_restart=True)
    found = lsray.discover_workers()
    assert [w.info.node_id for w in found.workers] == [a_id], found
    nxt, (_, attempts1) = asyncio.run(_step(env, run, root, 1, 2, write_answer, None))
    assert all(r.reward == 1.0 for r in nxt) and {a.worker for a in attempts1} == {a_id}, (nxt, attempts1)
    # With none registered, nothing is begun: NoWorkerError says what to do.
    ray.kill(first[a_id], no_restart=True)
    assert lsray.discover_workers().workers == ()
    with pytest.raises(lsray.NoWorkerError, match="start_workers") as e:
        asyncio.run(_step(env, run, root, 2, 2, write_answer, None))
    assert e.value.kind == "unavailable" and repr(lsray.NAMESPACE) in str(e.value), e.value

    # Started again: new actors, registered under the same names.
    back = lsray.start_workers(admin_for)
    assert set(back) == {a_id, b_id} and all(back[k]._actor_id != first[k]._actor_id for k in back), back
    assert {w.info.node_id for w in lsray.discover_workers().workers} == {a_id, b_id}


def test_a_workers_daemon_killed_mid_step_fails_its_attempts_and_they_are_retried(env: Env) -> None:
    """The last test of the module: worker b's daemon stays dead after it."""
    import layerstack.ray as lsray

    run = f"ray-daemon-{os.getpid()}"
    root = _setup(env, run)
    victim = env.nodes["b"]
    with layerstack.connect(env.admins[victim]) as b:
        pid = b.status().pid  # a daemon this test module started
    workers = _workers(env)

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
    # Discovery skips it, saying why; the other worker is found.
    found = lsray.discover_workers()
    assert [w.info.node_id for w in found.workers] == [env.nodes["a"]], found
    assert [actor for actor, _ in found.skipped] == [lsray.worker_actor_name(victim)], found.skipped
    assert "its daemon does not answer" in found.skipped[0][1] and "navailable" in found.skipped[0][1], found
