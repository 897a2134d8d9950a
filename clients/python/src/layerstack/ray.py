"""Rollouts across machines on Ray (issue 23; docs/cluster.md "Workers on Ray").

A store belongs to one machine, so a cluster runs one LayerStack daemon per
Ray node, and one :class:`Worker` actor next to each daemon
(:func:`start_worker` pins it to its node with Ray's
``NodeAffinitySchedulingStrategy``). Workers register with Ray itself: each is
a named actor, ``layerstack-worker:<Ray node id>`` in the Ray namespace
``layerstack`` (:data:`NAMESPACE`), so a node has at most one, a second
:func:`start_worker` there answers the first, and any driver of the cluster
finds the live ones with :func:`discover_workers` (Ray's
``list_named_actors``). :func:`start_workers` starts one on every alive node
that carries the custom resource (or node label) ``layerstack-daemon``
(:data:`DAEMON_RESOURCE`). The rollout records — runs, attempts,
rewards — stay with one **coordinating** daemon, the one the run was created
on. Checkpoints move between the machines as OCI images through a registry
(``push`` / ``pull``; node ids are global and a pulled node keeps its id).

:func:`fan_out_ray` is :func:`layerstack.fabric.fan_out` over workers. Per
sample, attempt 1, 2, …:

1. ``BeginRollout(worker=…)`` on the coordinator: a remote attempt, recorded
   there with no sandbox there (docs/fabric.md "Remote attempts");
2. the attempt runs on a worker chosen by locality — one whose daemon holds
   the sample's node, else the least busy, which pulls the node once —:
   ``Worker.run_attempt`` runs ``act`` in a sandbox on the node, checkpoints
   it, grades it with the :class:`~layerstack.fabric.Grader` in a clean
   sandbox over the checkpoint, and pushes the checkpoint;
3. the coordinator pulls the checkpoint and ends the attempt with it
   (``EndRollout(result_node=…)``): the reward is applied once, by the
   coordinator's records.

A worker lost mid-attempt (its actor or its Ray node dies:
``ray.exceptions.RayActorError``, ``NodeDiedError``) ends the attempt
``infra_failed(node-lost)``; the sample is retried on another worker with the
next attempt number. So does any other failure of the worker (its daemon, the
registry; an error's kind is the attempt's ``infra_kind``) or of the
coordinator's pull or end of the attempt: only a refusal of the attempt's
own sandbox options (:class:`AttemptRefused`) or of the coordinator's begin
with a kind that is the caller's to fix is raised. Workers keep no writable
shared state: their daemon's store, nothing else.

Needs ``ray`` (``pip install 'layerstack[ray]'``); ``import layerstack``
does not import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import (
    Any, AsyncIterator, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union,
)

try:
    import ray
    import ray.exceptions
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover — the message is the point
    raise ImportError(
        f"layerstack.ray needs Ray ({e}): pip install 'layerstack[ray]'"
    ) from e

import layerstack.aio
from layerstack._pb import admin_pb2 as pb
from layerstack.aio import AsyncClient, AsyncSandbox, trajectory_record
from layerstack.errors import LayerStackError, NotFoundError, UnavailableError
from layerstack.fabric import (
    _CALLER_ERRORS,
    _as_finished,
    _first_attempt,
    Evaluator,
    Grader,
    GraderLost,
    GraderNotStarted,
    RolloutAttempt,
    RolloutResult,
    SampleKey,
    TaskFailed,
    _infra_kind,
    _through_restarts,
)
from layerstack.sandbox import Command, ExecOutput

__all__ = [
    "Worker",
    "WorkerInfo",
    "WorkerHandle",
    "RegisteredWorker",
    "Discovery",
    "RemoteRollout",
    "AttemptTask",
    "AttemptOutcome",
    "NoWorkerError",
    "AttemptRefused",
    "NODE_LOST",
    "NAMESPACE",
    "DAEMON_RESOURCE",
    "SLOTS_RESOURCE",
    "worker_actor_name",
    "start_worker",
    "start_workers",
    "discover_workers",
    "fan_out_ray",
]

_log = logging.getLogger(__name__)

#: The Ray namespace workers register in (their actors' names:
#: :func:`worker_actor_name`).
NAMESPACE = "layerstack"

#: The prefix of a worker's Ray actor name; the Ray node id (hex) follows.
WORKER_PREFIX = "layerstack-worker:"

#: The custom resource (or node label key) of a Ray node that runs a
#: LayerStack daemon: ``ray start --resources='{"layerstack-daemon": 1}'``.
#: :func:`start_workers` starts a worker on each alive node carrying it; a
#: worker does not consume it.
DAEMON_RESOURCE = "layerstack-daemon"

#: The custom resource of a Ray node that sets how many attempts its worker
#: runs at once (:attr:`WorkerInfo.slots`):
#: ``ray start --resources='{"layerstack-daemon": 1, "layerstack-slots": 8}'``.
#: Without it a worker's slots are the node's Ray ``CPU`` resource (what
#: ``ray start --num-cpus`` declared), else the machine's cores. Attempts do
#: not consume it: the worker's slots are counted by :func:`fan_out_ray`.
SLOTS_RESOURCE = "layerstack-slots"

#: The infra_failed kind of an attempt whose worker was lost.
NODE_LOST = "node-lost"

#: Seconds a worker whose daemon was unavailable is passed over while another
#: worker is alive.
SUSPECT_S = 10.0

#: The sandbox backends (``executor`` of a sandbox) a daemon can serve; a
#: worker reports those its daemon's ``Status.executors`` names.
BACKENDS = ("linux", "wasi")

#: What a lost worker raises at its caller: its actor died (killed, its process
#: crashed, its Ray node removed) or its node died.
_LOST = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError)


class NoWorkerError(UnavailableError):
    """No live worker to run an attempt on: none is registered, none of those
    registered or given answers, none serves the sandbox's executor, or every
    one was lost mid-step; or :func:`start_workers` found no node to start one
    on. Kind ``unavailable``; the message names what to do (start workers:
    :func:`start_workers`, :func:`start_worker`)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, "unavailable", message)


#: Kinds of a worker's refused sandbox that the attempt's own options cause:
#: the same on every worker, so the caller's to fix.
_OPTION_ERRORS = frozenset({"invalid_argument", "unsupported"})


class AttemptRefused(Exception):
    """A worker's daemon refused the attempt's sandbox (the ``sandbox``
    options of :func:`fan_out_ray`: kind ``invalid_argument`` or
    ``unsupported``; or the client's own check of them, ``ValueError`` /
    ``TypeError``) — the caller's mistake, the same on every worker.
    :meth:`Worker.run_attempt` raises it; :func:`fan_out_ray` ends the attempt
    ``infra_failed(<kind>)`` and raises :attr:`error` (the sample's result
    holds it), with no retry. Every other failure of a worker is an
    infrastructure failure, retried elsewhere.

    Attributes:
        error: the refusal, as the worker's client raised it.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"the worker's daemon refused the attempt's sandbox: {error}")
        self.error = error

    def __reduce__(self) -> Tuple[Any, ...]:
        return (AttemptRefused, (self.error,))


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's capabilities, as :meth:`Worker.capabilities` answers them.

    Attributes:
        name: the worker's name, recorded as the ``worker`` of its attempts
            (default: its Ray node id).
        node_id: the Ray node id (hex) it runs on, next to its daemon.
        admin: its daemon's admin socket path.
        backends: the sandbox backends its daemon serves now (``linux``,
            ``wasi``: its ``Status.executors``); :func:`fan_out_ray` places
            an attempt only on a worker serving the sandbox's ``executor``.
        cores: CPU cores of the machine (``os.cpu_count()``).
        slots: how many attempts :func:`fan_out_ray` runs on it at once
            (unless its ``per_worker`` says otherwise): its Ray node's
            custom resource :data:`SLOTS_RESOURCE` when declared, else the
            node's Ray ``CPU`` resource (``ray start --num-cpus``) when it
            is at least 1, else ``cores``.
        memory_bytes: the machine's memory, bytes (``MemTotal``).
        nodes: the graph nodes its store holds (not pruned), by id: an attempt
            on one of them needs no pull.
        running: attempts it runs now.
        pulls: graph nodes it pulled from the registry since it started (a
            node it holds is never pulled again).
        stacks: the stacks (bases) its store holds, by id: a pull of a node
            on one of them fetches no base layer.
        actor: its Ray actor name (:func:`worker_actor_name`: registered in
            :data:`NAMESPACE`), "" for an actor started without a name.
    """

    name: str
    node_id: str
    admin: str
    backends: Tuple[str, ...]
    cores: int
    memory_bytes: int
    nodes: Tuple[str, ...]
    running: int
    pulls: int = 0
    stacks: Tuple[str, ...] = ()
    actor: str = ""
    slots: int = 1


@dataclass(frozen=True)
class RegisteredWorker:
    """A live registered worker, as :func:`discover_workers` found it.

    Attributes:
        actor: its Ray actor name (in the namespace discovery searched).
        handle: its actor handle (``handle.run_attempt.remote(…)``).
        info: its capabilities, read during the discovery.
    """

    actor: str
    handle: "WorkerHandle"
    info: WorkerInfo


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover_workers` found.

    Attributes:
        workers: the live registered workers, by actor name.
        skipped: ``(actor name, why)`` of each registered worker not used: it
            died since it was listed, its actor or node is dead, it did not
            answer within the timeout, or its daemon does not answer (the
            error's repr). Each is logged too (``logging``, logger
            ``layerstack.ray``, level WARNING).
    """

    workers: Tuple[RegisteredWorker, ...]
    skipped: Tuple[Tuple[str, str], ...] = ()


@dataclass(frozen=True)
class AttemptTask:
    """One attempt for :meth:`Worker.run_attempt` (pickled to the worker).

    Attributes:
        key: the sample.
        attempt_id: the coordinator's attempt id (``RolloutAttempt.id``).
        attempt: the attempt's number, from 1.
        node: the node it starts from.
        reference: where the worker pulls ``node`` from when its store lacks
            it (``REGISTRY/REPOSITORY:TAG``).
        repository: where it pushes the checkpoint (``REGISTRY/REPOSITORY``;
            the tag is the checkpoint's node id).
        act: ``async act(rollout: RemoteRollout) -> reward | None``, as
            :func:`~layerstack.fabric.fan_out`'s (picklable: a module-level
            function, or registered with ``ray.cloudpickle``).
        grader: grades the checkpoint in a clean sandbox; ``None``: the
            reward is ``act``'s return value (1.0 if not a number).
        keep: ``checkpoint`` (push an accepted result) or ``discard``.
        sandbox: keyword arguments of the attempt's sandbox
            (:meth:`layerstack.aio.AsyncClient.sandbox`: ``network``,
            ``cpu_millis``, ``env``, …).
        state: the checkpoint's logical state (JSON-able).
    """

    key: SampleKey
    attempt_id: int
    attempt: int
    node: str
    reference: str
    repository: str
    act: Callable[["RemoteRollout"], Awaitable[Any]]
    grader: Optional[Grader] = None
    keep: str = "checkpoint"
    sandbox: Mapping[str, Any] = field(default_factory=dict)
    state: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class AttemptOutcome:
    """What :meth:`Worker.run_attempt` answers.

    Attributes:
        key, attempt_id: the attempt (as in its :class:`AttemptTask`).
        worker: the worker's name.
        status: ``completed`` or ``task_failed`` (infrastructure failures are
            raised, never answered).
        reward: the reward (``completed``); ``accepted`` the grader's verdict.
        evaluator: the grader's evaluator, ``None`` without a grader.
        result_node: the checkpoint (a child of the task's node) made in the
            worker's store (pruned there unless pushed), ``None`` when none
            (task failed).
        reference: where it was pushed (``REGISTRY/REPOSITORY:<node id>``),
            ``None`` when not pushed (task failed, rejected, or ``keep``
            ``discard``).
        pulled: the worker pulled the task's node for this attempt (it did
            not hold it).
        trajectory: the attempt's exec records, JSON bytes (a list of
            ``{argv, exit_code, signal, timed_out, duration_ms, stdout,
            stderr}``, outputs cut at 4 KiB).
        grade_output: the grader's output, ``None`` without a grader.
        message: why the task failed, or "".
        seconds: the attempt's wall time on the worker, seconds.
    """

    key: SampleKey
    attempt_id: int
    worker: str
    status: str
    reward: Optional[float]
    accepted: bool
    evaluator: Optional[Evaluator]
    result_node: Optional[str]
    reference: Optional[str]
    pulled: bool
    trajectory: bytes
    grade_output: Optional[ExecOutput]
    message: str
    seconds: float


class RemoteRollout:
    """The attempt as ``act`` sees it on a worker: the surface of
    :class:`layerstack.aio.AsyncRollout` that ``act`` uses — :meth:`exec`
    (recorded in :attr:`trajectory`), :attr:`files`, :attr:`key`, :attr:`id`
    (the coordinator's attempt id), :attr:`sandbox`."""

    #: Bytes of stdout/stderr kept per exec in the trajectory.
    KEEP_BYTES = 4096

    def __init__(self, task: AttemptTask, sandbox: AsyncSandbox) -> None:
        self.task = task
        self.sandbox = sandbox
        self.trajectory: List[Dict[str, Any]] = []

    @property
    def id(self) -> int:
        return self.task.attempt_id

    @property
    def key(self) -> SampleKey:
        return self.task.key

    @property
    def files(self) -> layerstack.aio.AsyncFiles:
        return self.sandbox.files

    async def exec(self, cmd: Command, **kw: Any) -> ExecOutput:
        """:meth:`layerstack.aio.AsyncSandbox.exec`, recorded in :attr:`trajectory`."""
        out = await self.sandbox.exec(cmd, **kw)
        self.trajectory.append(trajectory_record(cmd, out, self.KEEP_BYTES))
        return out


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _node_slots(node_id: str) -> int:
    """The attempt slots of Ray node ``node_id`` (:attr:`WorkerInfo.slots`)."""
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        if n["NodeID"] == node_id:
            res = n.get("Resources") or {}
            for key in (SLOTS_RESOURCE, "CPU"):
                if int(res.get(key, 0)) >= 1:
                    return int(res[key])
    return os.cpu_count() or 1


class Worker:
    """The worker actor's class: one per Ray node, next to that node's daemon
    (admin socket ``admin``). Start it with :func:`start_worker`, which makes
    it a Ray actor pinned to its node; its methods are then called as
    ``handle.capabilities.remote()``.

    It holds a client of its own daemon and, per node, a lock that makes
    concurrent attempts pull a missing node once — nothing another process
    writes."""

    def __init__(self, admin: str, name: Optional[str] = None) -> None:
        self.admin = admin
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.name = name or self.node_id
        self.actor = ctx.get_actor_name() or ""
        self._client: Optional[AsyncClient] = None
        self._pulls: Dict[str, asyncio.Lock] = {}
        self._running = 0
        self._pulled = 0
        # A node's resources are fixed while it lives.
        self.slots = _node_slots(self.node_id)

    def _ls(self) -> AsyncClient:
        # Made on first use, inside the actor's event loop (grpc.aio binds to it).
        if self._client is None:
            self._client = layerstack.aio.connect(self.admin)
        return self._client

    async def identity(self) -> Tuple[str, str, str]:
        """``(name, Ray node id, admin socket)``, without asking its daemon
        (what :func:`start_worker` checks of a registered worker)."""
        return self.name, self.node_id, self.admin

    async def capabilities(self) -> WorkerInfo:
        """The worker's :class:`WorkerInfo` (its daemon's nodes read now)."""
        ls = self._ls()
        nodes: List[str] = []
        for g in await ls.list_graphs():
            nodes.extend(n.id for n in (await ls.show_graph(g.name)).nodes if not n.pruned)
        status = await ls.status()
        stacks = await ls._call(ls._stub.ListStacks, pb.ListStacksRequest(all_namespaces=True, page_size=10000))
        return WorkerInfo(
            name=self.name,
            node_id=self.node_id,
            admin=self.admin,
            backends=tuple(b for b in BACKENDS if b in status.executors),
            stacks=tuple(sorted(st.id for st in stacks.stacks)),
            cores=os.cpu_count() or 1,
            memory_bytes=_memory_bytes(),
            nodes=tuple(sorted(nodes)),
            running=self._running,
            pulls=self._pulled,
            actor=self.actor,
            slots=self.slots,
        )

    async def _ensure(self, node: str, reference: str) -> bool:
        """Pulls ``node`` from ``reference`` unless the store holds it; True
        when it pulled."""
        ls = self._ls()
        lock = self._pulls.setdefault(node, asyncio.Lock())
        async with lock:
            try:
                n = await ls.show_node(node)
                if not n.pruned:
                    return False
            except NotFoundError:
                pass
            got = await ls.pull(reference)
            self._pulled += 1
            if got.node != node:
                raise LayerStackError(
                    None, "invalid_argument",
                    f"{reference} holds node {got.node}, not {node}: push the task's node to that reference",
                )
            return True

    async def run_attempt(self, task: AttemptTask) -> AttemptOutcome:
        """Runs one attempt (see the module docs) and answers its
        :class:`AttemptOutcome`.

        Raises the SDK's errors for infrastructure failures (the caller ends
        the attempt ``infra_failed`` with the error's kind and retries it on
        another worker): :class:`~layerstack.errors.LayerStackError`
        subclasses from its daemon or the registry, whatever their kind (a
        ``not_found`` or ``internal`` of its daemon is its store's state, not
        the caller's mistake), :class:`~layerstack.fabric.GraderLost`, or
        whatever ``act`` raised other than
        :class:`~layerstack.fabric.TaskFailed`. :class:`AttemptRefused` when
        its daemon refused the attempt's sandbox options (not retried).
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self._running += 1
        try:
            return await self._run(task, t0)
        finally:
            self._running -= 1

    async def _run(self, task: AttemptTask, t0: float) -> AttemptOutcome:
        ls = self._ls()
        pulled = await self._ensure(task.node, task.reference)
        try:
            sb = await ls.sandbox(node=task.node, name=f"ray-attempt-{task.attempt_id}", **dict(task.sandbox))
        except LayerStackError as e:
            if e.kind in _OPTION_ERRORS:
                raise AttemptRefused(e) from None
            raise
        except (TypeError, ValueError) as e:  # the client's own check of the options
            raise AttemptRefused(e) from None
        r = RemoteRollout(task, sb)

        def outcome(**kw: Any) -> AttemptOutcome:
            base: Dict[str, Any] = dict(
                key=task.key, attempt_id=task.attempt_id, worker=self.name, status="completed",
                reward=None, accepted=False, evaluator=None, result_node=None, reference=None,
                pulled=pulled, trajectory=json.dumps(r.trajectory).encode() if r.trajectory else b"",
                grade_output=None, message="", seconds=asyncio.get_running_loop().time() - t0,
            )
            base.update(kw)
            return AttemptOutcome(**base)

        try:
            value = await task.act(r)
        except TaskFailed as e:
            await sb.discard("the attempt's task failed")
            return outcome(status="task_failed", message=str(e))
        except BaseException:
            # The attempt's own error is the one to raise, not a failed
            # discard's (its daemon may be what failed).
            with contextlib.suppress(LayerStackError):
                await sb.discard("the attempt failed")
            raise
        try:
            closed = await sb.close(checkpoint=True, state=task.state or {}, reason="ray attempt checkpoint")
        except BaseException:
            # A refused checkpoint (a state that is no JSON, a run that had
            # ended interrupted) must not leave the sandbox or its writes.
            with contextlib.suppress(LayerStackError):
                await sb.discard("the attempt's checkpoint was refused")
            raise
        if not closed.node:
            raise LayerStackError(
                None, "checkpoint-failed",
                f"the checkpoint of attempt {task.attempt_id} made no node: {closed.outcome}: {closed.message}",
            )
        child = closed.node
        grade: Optional[ExecOutput] = None
        if task.grader is None:
            reward, accepted = (float(value) if isinstance(value, (int, float)) else 1.0), True
            evaluator = None
        else:
            g = await ls.sandbox(node=child, name=f"ray-grade-{task.attempt_id}")
            try:
                grade = await g.exec(task.grader.command, env=task.grader.env, timeout_s=task.grader.timeout_s)
            finally:
                await g.discard("grading done")
            if grade.start_failed:
                raise GraderNotStarted(
                    f"grader {task.grader.name!r} could not be started (exit {grade.exit_code}): "
                    + grade.stderr.decode("utf-8", "replace").strip()[:500]
                )
            if grade.signal and not grade.timed_out and not grade.oom_killed:
                raise GraderLost(f"the grader was killed by signal {grade.signal}")
            reward, accepted = task.grader.score(grade)
            evaluator = task.grader.evaluator()
        reference = None
        if accepted and task.keep == "checkpoint":
            reference = f"{task.repository}:{child}"
            await ls.push(reference, node=child)
        else:
            # Not kept: nothing will expand it here either.
            with contextlib.suppress(LayerStackError):
                await ls.prune(child)
        return outcome(reward=reward, accepted=accepted, evaluator=evaluator, result_node=child,
                       reference=reference, grade_output=grade)

    async def close(self) -> None:
        """Closes its client of the daemon."""
        if self._client is not None:
            await self._client.close()
            self._client = None


#: A Ray actor handle of a :class:`Worker` (``ray.actor.ActorHandle``).
WorkerHandle = Any


def worker_actor_name(node_id: str) -> str:
    """The Ray actor name of the worker on Ray node ``node_id`` (hex):
    ``layerstack-worker:<node_id>``, in the namespace :data:`NAMESPACE`."""
    return WORKER_PREFIX + node_id


def start_worker(node_id: str, admin: str, *, name: Optional[str] = None,
                 max_concurrency: int = 64, detached: bool = False,
                 namespace: str = NAMESPACE, timeout_s: float = 30.0) -> WorkerHandle:
    """Starts the :class:`Worker` actor of Ray node ``node_id`` (hex, as
    ``ray.nodes()`` names it; hard node affinity: it runs there or not at
    all), for the daemon whose admin socket is ``admin`` on that node, and
    answers its actor handle. It takes no CPU of the node (``num_cpus=0``:
    the sandboxes are the daemon's); up to ``max_concurrency`` attempts run
    on it at once. ``name``: recorded as its attempts' ``worker`` (default
    the node id).

    It registers as the named actor :func:`worker_actor_name` (``node_id``)
    in the Ray namespace ``namespace`` (:func:`discover_workers` finds it).
    ``detached``: Ray's ``lifetime="detached"`` — it outlives the driver
    that started it, until ``ray.kill`` or its node goes. Otherwise it lives
    as long as the driver process that started it (this module holds its
    original handle: Ray ends a non-detached actor when the last one goes,
    and handles found by name do not count), or until ``ray.kill``.

    One worker per node: when one is registered there already, that one is
    answered (Ray's ``get_if_exists``), not a second — after a check that it
    serves the same ``admin`` (and ``name``, when given), a call that waits
    up to ``timeout_s`` seconds for its answer. A registered worker found
    dead is replaced. Two drivers starting a node's worker at the same time
    get the same actor, whatever its admin.

    Raises:
        ValueError: the node's registered worker serves another daemon
            (``admin``) or has another ``name``; stop it first
            (``ray.kill(ray.get_actor(worker_actor_name(node_id),
            namespace=…))``).
        ray.exceptions.GetTimeoutError: the registered worker did not
            answer within ``timeout_s`` (all its slots busy, or its node
            unreachable); ``ray.exceptions.ActorUnavailableError``: Ray
            cannot reach it now. Nothing was started either way.
    """
    actor_name = worker_actor_name(node_id)
    try:
        existing = ray.get_actor(actor_name, namespace=namespace)
    except ValueError:  # none registered
        existing = None
    if existing is not None:
        try:
            ident: Any = ray.get(existing.identity.remote(), timeout=timeout_s)
            has_name, _, has_admin = ident
        except ray.exceptions.ActorUnavailableError:
            raise  # it may come back: not replaced
        except _LOST as e:
            _log.warning("layerstack.ray: replacing the dead worker %s: %r", actor_name, e)
            # Frees the name (ray.kill of a named actor releases it before it answers).
            ray.kill(existing, no_restart=True)
        else:
            if has_admin != admin or (name is not None and has_name != name):
                raise ValueError(
                    f"Ray node {node_id} has a worker already ({actor_name} in namespace {namespace!r}), "
                    f"named {has_name!r} for the daemon at {has_admin}, not {name or has_name!r} at {admin}: "
                    f"stop it first (ray.kill(ray.get_actor({actor_name!r}, namespace={namespace!r})))"
                )
            return existing
    actor = ray.remote(Worker)
    handle = actor.options(
        name=actor_name,
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached" if detached else None,
        num_cpus=0,
        max_concurrency=max_concurrency,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(admin, name)
    # Keeps a non-detached worker alive after the caller drops its handle
    # (one per name: a replaced worker's handle goes).
    _started[(namespace, actor_name)] = handle
    return handle


#: The original handles of the workers this process started, by (namespace,
#: actor name): what keeps a non-detached registered worker alive.
_started: Dict[Tuple[str, str], WorkerHandle] = {}


#: What :func:`start_workers` takes for the daemons' admin sockets.
AdminForNode = Union[str, Mapping[str, str], Callable[[Mapping[str, Any]], Optional[str]]]


def start_workers(admin_for_node: AdminForNode, *, resource: str = DAEMON_RESOURCE,
                  max_concurrency: int = 64, detached: bool = False,
                  namespace: str = NAMESPACE) -> Dict[str, WorkerHandle]:
    """Starts a worker (:func:`start_worker`) on each alive Ray node with a
    daemon, and answers their handles by Ray node id. Called again, it
    answers the workers registered already (one per node) and starts those
    missing — on nodes added since, or whose worker died.

    ``admin_for_node``: where each node's daemon listens —

    - a path (``str``): the same admin socket path on every alive node that
      carries the custom resource or node label ``resource`` (default
      :data:`DAEMON_RESOURCE`, ``layerstack-daemon``);
    - a mapping, Ray node id → admin socket: exactly those nodes (``resource``
      is not looked at);
    - a function of a node's ``ray.nodes()`` record (``NodeID``,
      ``Resources``, ``Labels``, …) → its admin socket, or ``None`` for no
      worker there: called for each alive node carrying ``resource``.

    Raises:
        NoWorkerError: no alive node carries ``resource`` (or the function
            answered ``None`` for every one): start Ray on the daemons'
            machines with ``--resources='{"layerstack-daemon": 1}'``, or
            pass a mapping.
        ValueError: a node of the mapping is not an alive Ray node; a node
            whose registered worker serves another daemon (:func:`start_worker`).
    """
    alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    chosen: Dict[str, str] = {}
    if isinstance(admin_for_node, Mapping):
        ids = {n["NodeID"] for n in alive}
        gone = sorted(set(admin_for_node) - ids)
        if gone:
            raise ValueError(f"not alive Ray nodes: {', '.join(gone)} (ray.nodes() lists the alive ones)")
        chosen = dict(admin_for_node)
    else:
        for n in alive:
            if resource not in n.get("Resources", {}) and resource not in (n.get("Labels") or {}):
                continue
            admin = admin_for_node if isinstance(admin_for_node, str) else admin_for_node(n)
            if admin:
                chosen[n["NodeID"]] = admin
        if not chosen:
            raise NoWorkerError(
                f"none of the {len(alive)} alive Ray node(s) carries the resource or label {resource!r} "
                f"(with an admin socket): start Ray on the daemons' machines with "
                f"--resources='{{\"{resource}\": 1}}', or pass start_workers a mapping node id -> admin socket"
            )
    return {
        node_id: start_worker(node_id, admin, max_concurrency=max_concurrency, detached=detached,
                              namespace=namespace)
        for node_id, admin in chosen.items()
    }


def discover_workers(*, namespace: str = NAMESPACE, timeout_s: float = 30.0) -> Discovery:
    """The live workers registered in the Ray namespace ``namespace`` (named
    ``layerstack-worker:*``: :func:`start_worker`), each with its
    :class:`WorkerInfo` read now (its daemon answers; up to ``timeout_s``
    seconds for all of them, waited on together).

    A registered worker is skipped — in :attr:`Discovery.skipped` with the
    reason, and logged (WARNING) — when it died since Ray listed it, its
    actor or node is dead (``RayActorError``, ``NodeDiedError``, …), it does
    not answer within ``timeout_s``, or its daemon does not answer
    (``UnavailableError``, …). A blocking call (Ray's GCS and the workers);
    :func:`fan_out_ray` runs it off its event loop.
    """
    skipped: List[Tuple[str, str]] = []

    def skip(actor: str, why: str) -> None:
        _log.warning("layerstack.ray: skipping worker %s: %s", actor, why)
        skipped.append((actor, why))

    names = sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(WORKER_PREFIX)
    )
    handles: Dict[str, WorkerHandle] = {}
    for actor in names:
        try:
            handles[actor] = ray.get_actor(actor, namespace=namespace)
        except ValueError:
            skip(actor, "it died after Ray listed it (no actor of that name any more)")
    refs = {actor: h.capabilities.remote() for actor, h in handles.items()}
    if refs:
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    found: List[RegisteredWorker] = []
    for actor, ref in refs.items():
        try:
            info = ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            skip(actor, f"no answer within {timeout_s} s")
        except _LOST as e:
            skip(actor, f"its actor or node is dead: {e!r}"[:2000])
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            skip(actor, f"its daemon does not answer: {cause!r}"[:2000])
        except ray.exceptions.RayError as e:
            skip(actor, f"{e!r}"[:2000])
        else:
            found.append(RegisteredWorker(actor, handles[actor], info))
    return Discovery(tuple(found), tuple(skipped))


class _Pool:
    """The coordinator's view of the workers: alive, busy, what they hold."""

    def __init__(self, infos: Sequence[Tuple[WorkerHandle, WorkerInfo]], per_worker: Optional[int]) -> None:
        self.infos = {i.name: i for _, i in infos}
        self.handles = {i.name: h for h, i in infos}
        self.holds: Dict[str, Set[str]] = {i.name: set(i.nodes) for _, i in infos}
        self.limit = {i.name: per_worker or max(1, i.slots) for _, i in infos}
        self.busy = {i.name: 0 for _, i in infos}
        self.lost: Set[str] = set()
        #: Worker → loop time until which it is passed over (its daemon was unavailable).
        self.suspect: Dict[str, float] = {}
        self.cond = asyncio.Condition()

    async def acquire(self, node: str, avoid: Set[str]) -> str:
        """A live worker with a free slot. Those in ``avoid`` (they failed
        this sample) and those whose daemon was unavailable lately are used
        only when no other worker is alive (it waits for another's slot
        rather); then one holding ``node`` comes first, then the least busy.
        NoWorkerError when every worker was lost."""
        async with self.cond:
            while True:
                alive = [w for w in self.infos if w not in self.lost]
                if not alive:
                    raise NoWorkerError(
                        f"every worker was lost ({', '.join(sorted(self.lost))}): "
                        "start workers again (start_workers, start_worker)"
                    )
                now = asyncio.get_running_loop().time()
                good = [w for w in alive if w not in avoid and self.suspect.get(w, 0.0) <= now]
                free = [w for w in (good or alive) if self.busy[w] < self.limit[w]]
                if free:
                    w = min(free, key=lambda w: (node not in self.holds[w], self.busy[w] / self.limit[w], w))
                    self.busy[w] += 1
                    return w
                try:
                    # Woken by a release; a suspect's time running out wakes no one.
                    await asyncio.wait_for(self.cond.wait(), SUSPECT_S)
                except asyncio.TimeoutError:
                    pass

    async def release(self, w: str, *, lost: bool = False, suspect: bool = False,
                      holds: Optional[str] = None) -> None:
        async with self.cond:
            self.busy[w] -= 1
            if lost:
                self.lost.add(w)
            if suspect:
                self.suspect[w] = asyncio.get_running_loop().time() + SUSPECT_S
            if holds is not None:
                self.holds[w].add(holds)
            self.cond.notify_all()


async def fan_out_ray(
    coordinator: AsyncClient,
    run: str,
    node: str,
    n: int,
    act: Callable[[RemoteRollout], Awaitable[Any]],
    *,
    workers: Optional[Sequence[WorkerHandle]] = None,
    registry: str,
    step: int = 0,
    prompt: str = "task",
    policy: str = "policy",
    grader: Optional[Grader] = None,
    samples: Optional[Sequence[int]] = None,
    max_attempts: int = 3,
    per_worker: Optional[int] = None,
    seed: Optional[int] = None,
    backprop: bool = True,
    keep: str = "checkpoint",
    sandbox: Optional[Mapping[str, Any]] = None,
    state: Optional[Mapping[str, Any]] = None,
    reconnect_s: float = 60.0,
    namespace: str = NAMESPACE,
) -> AsyncIterator[RolloutResult]:
    """Runs ``n`` samples of ``node`` (``samples``: their numbers, default
    ``range(n)``) of run ``run`` — recorded on ``coordinator`` — on
    ``workers`` (:func:`start_worker` handles; default: the live workers
    registered in the Ray namespace ``namespace``, :func:`discover_workers`),
    and yields a
    :class:`~layerstack.fabric.RolloutResult` per sample as it finishes
    (``attempt.worker`` names where its last attempt ran,
    ``attempt.result_node`` the checkpoint, now in the coordinator's store).

    The workers are those answering at the start of the call: one
    registered or started while it runs is not used by it (the next call
    finds it); one lost while it runs is not used again in it.

    ``registry``: ``REGISTRY/REPOSITORY`` (e.g. ``"10.0.0.5:5000/rl"``) the
    node and the checkpoints travel through (the daemons' ``[registry]``
    settings give credentials and plain-HTTP registries). The coordinator
    pushes ``node`` once (``REPOSITORY:<node>``), workers pull it when they
    lack it, and push their checkpoints (``REPOSITORY:<checkpoint id>``).

    Placement: each attempt goes to a live worker with a free slot (at most
    ``per_worker`` attempts at once, default its :attr:`WorkerInfo.slots`:
    its Ray node's :data:`SLOTS_RESOURCE` or ``CPU`` resource), preferring one whose
    store holds ``node`` (:attr:`WorkerInfo.nodes`, and those that pulled it
    since), then the least busy. ``act``, ``grader``, ``keep``, ``step``,
    ``prompt``, ``policy``, ``seed``, ``backprop``, ``max_attempts``,
    ``reconnect_s``: as :func:`~layerstack.fabric.fan_out`; ``sandbox``: the
    attempt's sandbox options; ``state``: its checkpoint's logical state.

    Failures: a lost worker (:data:`NODE_LOST`), an error of its daemon
    (whatever its kind: a ``not_found`` or ``internal`` there is that
    store's state) or of the registry, or of ``act`` other than
    ``TaskFailed``, and an error of the coordinator pulling the checkpoint
    or recording the end, ends the attempt ``infra_failed(kind)`` and the
    sample is retried with the next attempt number on a worker still alive
    (not on the one that failed it while another is alive; a lost one is not
    used again); the reward is applied exactly once by the coordinator's
    records, and a call again for the same step reruns nothing that has a
    reward. Raised into the sample's result (its ``errors``, no retry): the
    worker's refusal of the ``sandbox`` options (the error
    :class:`AttemptRefused` carries; its attempt ends
    ``infra_failed(<kind>)``), and a begin the coordinator refuses with a
    kind that is the caller's to fix (``invalid_argument``, ``not_found``,
    ``failed_precondition``, …; as :func:`~layerstack.fabric.fan_out`'s). When every
    worker is lost, the remaining samples yield results whose ``errors`` hold
    :class:`NoWorkerError`. A worker that does not answer its
    :meth:`Worker.capabilities` at the start (dead, or its daemon down) is
    not used (a registered one is logged, as :func:`discover_workers` does).

    Raises (before any attempt is begun): NoWorkerError when no worker is
    registered (``workers`` not given: start them with :func:`start_workers`
    or :func:`start_worker`), none answers, or none serves the sandbox's
    ``executor``; ValueError: a ``keep`` other than "checkpoint" and
    "discard", an empty ``workers``.
    """
    if keep not in ("checkpoint", "discard"):
        raise ValueError(f"keep {keep!r}: use 'checkpoint' or 'discard'")
    if workers is None:
        found = await asyncio.get_running_loop().run_in_executor(
            None, lambda: discover_workers(namespace=namespace))
        if not found.workers:
            why = "".join(f"; {actor}: {reason}" for actor, reason in found.skipped)
            raise NoWorkerError(
                (f"no live LayerStack worker is registered in Ray namespace {namespace!r}" + why)[:2000]
                + ": start them next to running daemons (start_workers(admin_for_node), "
                "or start_worker(node_id, admin) per Ray node)"
            )
        live = [(w.handle, w.info) for w in found.workers]
    else:
        if not workers:
            raise ValueError("fan_out_ray got an empty workers list: start_worker(node_id, admin) per Ray node, "
                             "or leave workers out to use the registered ones")
        answers = await asyncio.gather(*(w.capabilities.remote() for w in workers), return_exceptions=True)
        live = [(w, a) for w, a in zip(workers, answers) if isinstance(a, WorkerInfo)]
        if not live:
            raise NoWorkerError(
                f"none of the {len(workers)} worker(s) answered: {answers[0]!r}"[:2000]
                + "; start workers (start_workers, start_worker) next to running daemons"
            )
    executor = str((sandbox or {}).get("executor", "linux"))
    serving = [(w, a) for w, a in live if executor in a.backends]
    if not serving:
        raise NoWorkerError(
            f"none of the {len(live)} live worker(s) serves executor {executor!r} "
            f"(their backends: {sorted({b for _, a in live for b in a.backends})}); "
            "start workers next to daemons that can run it"
        )
    pool = _Pool(serving, per_worker)
    reference = f"{registry}:{node}"
    await coordinator.push(reference, node=node)

    def one(i: int) -> Awaitable[RolloutResult]:
        return _run_sample_ray(
            coordinator, pool, run, node, i, act, reference=reference, repository=registry, step=step,
            prompt=prompt, policy=policy, grader=grader, max_attempts=max_attempts, seed=seed,
            backprop=backprop, keep=keep, sandbox=sandbox or {}, state=state, reconnect_s=reconnect_s,
        )

    todo = list(samples) if samples is not None else list(range(n))
    # The pool bounds what runs at once (slots per worker); the gate only
    # bounds the samples waiting for a slot.
    async for res in _as_finished(todo, one, len(todo), lambda i: SampleKey(run, step, prompt, i)):
        yield res


async def _run_sample_ray(
    ls: AsyncClient,
    pool: _Pool,
    run: str,
    node: str,
    i: int,
    act: Callable[[RemoteRollout], Awaitable[Any]],
    *,
    reference: str,
    repository: str,
    step: int,
    prompt: str,
    policy: str,
    grader: Optional[Grader],
    max_attempts: int,
    seed: Optional[int],
    backprop: bool,
    keep: str,
    sandbox: Mapping[str, Any],
    state: Optional[Mapping[str, Any]],
    reconnect_s: float,
) -> RolloutResult:
    key = SampleKey(run, step, prompt, i)
    first = await _first_attempt(ls, key, reconnect_s)
    if first is None:
        return RolloutResult(i, key, None, None, task_failed_before=True)
    errors: List[str] = []
    last: Optional[RolloutAttempt] = None
    failed_on: Set[str] = set()
    for number in range(first, first + max_attempts):
        w = await pool.acquire(node, failed_on)
        lost = held = suspect = False
        try:
            try:
                r = await _through_restarts(
                    lambda: ls.begin_rollout(key, number, node, policy=policy,
                                             seed=None if seed is None else seed + i, worker=w),
                    reconnect_s,
                )
            except LayerStackError as e:
                if e.kind in _CALLER_ERRORS:
                    raise
                # As fan_out's: the coordinator could not record it now; the next attempt.
                errors.append(f"attempt {number} begin: {e!r}"[:2000])
                continue
            if r.rewarded:
                s = r.sample
                return RolloutResult(i, key, last, s.reward if s else None, rewarded_before=True,
                                     errors=tuple(errors))
            assert r.attempt is not None
            last = r.attempt
            if last.ended:
                continue
            task = AttemptTask(key=key, attempt_id=last.id, attempt=number, node=node, reference=reference,
                               repository=repository, act=act, grader=grader, keep=keep, sandbox=sandbox,
                               state=state)
            try:
                out: AttemptOutcome = await pool.handles[w].run_attempt.remote(task)
            except _LOST as e:
                lost = True
                failed_on.add(w)
                errors.append(f"attempt {number} on worker {w}: lost: {e!r}"[:2000])
                last = await _end_failed(r, last, reconnect_s, errors, number, NODE_LOST,
                                         f"worker {w} was lost: {type(e).__name__}")
                continue
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, AttemptRefused):
                    # The attempt's own sandbox options: the caller's to fix, on any worker.
                    refused = cause.error
                    await _end_failed(r, last, reconnect_s, errors, number, _infra_kind(refused),
                                      str(refused)[:1000])
                    raise refused from None
                # Anything else of the worker — its daemon (whatever the
                # kind: a not_found or internal there is its store's state),
                # the registry, act — is an infrastructure failure: retried
                # on another worker.
                errors.append(f"attempt {number} on worker {w}: {cause!r}"[:2000])
                failed_on.add(w)
                suspect = isinstance(cause, UnavailableError)
                last = await _end_failed(r, last, reconnect_s, errors, number, _infra_kind(cause),
                                         repr(cause)[:1000])
                continue
            except ray.exceptions.RayError as e:  # e.g. an error Ray could not carry back
                errors.append(f"attempt {number} on worker {w}: {e!r}"[:2000])
                failed_on.add(w)
                last = await _end_failed(r, last, reconnect_s, errors, number, type(e).__name__, repr(e)[:1000])
                continue
            held = True  # it ran there: its store holds the node now
            if out.status == "task_failed":
                try:
                    last = await _end(r, reconnect_s, task_failed=True, message=out.message, keep="discard",
                                      trajectory=out.trajectory)
                except LayerStackError as e:
                    # The coordinator could not record it (e.g. storing the
                    # trajectory failed): nothing was recorded, the next attempt.
                    errors.append(f"attempt {number} end: {e!r}"[:2000])
                    last = await _end_failed(r, last, reconnect_s, errors, number, e.kind, f"end: {e}"[:1000])
                    continue
                return RolloutResult(i, key, last, None, errors=tuple(errors))
            result_node = None
            if out.reference is not None:
                try:
                    got = await ls.pull(out.reference)
                except LayerStackError as e:
                    errors.append(f"attempt {number}: pull of {out.reference}: {e!r}"[:2000])
                    last = await _end_failed(r, last, reconnect_s, errors, number, e.kind,
                                             f"pull of {out.reference}: {e}"[:1000])
                    continue
                result_node = got.node
            assert out.reward is not None
            try:
                last = await _end(
                    r, reconnect_s, reward=out.reward, accepted=out.accepted, evaluator=out.evaluator,
                    backprop=out.reward if backprop else None, trajectory=out.trajectory,
                    keep="checkpoint" if result_node is not None else "discard", result_node=result_node,
                )
            except LayerStackError as e:
                # The coordinator failed to record the end (an internal error
                # storing its trajectory, …): as fan_out's, an infrastructure
                # failure — ended infra_failed if it can be, and the sample
                # goes on with the next attempt (should the end have been
                # recorded after all, the next begin answers "rewarded").
                errors.append(f"attempt {number} end: {e!r}"[:2000])
                last = await _end_failed(r, last, reconnect_s, errors, number, e.kind, f"end: {e}"[:1000])
                if last.status == "infra_failed" and result_node is not None:
                    # No attempt keeps the pulled checkpoint: not a child to search.
                    with contextlib.suppress(LayerStackError):
                        await ls.prune(result_node)
                continue
            applied = out.reward if last.applied else (await _reward(ls, key, reconnect_s))
            return RolloutResult(i, key, last, applied, grade_output=out.grade_output, errors=tuple(errors))
        except asyncio.CancelledError:
            raise
        finally:
            await pool.release(w, lost=lost, suspect=suspect, holds=node if held else None)
    return RolloutResult(i, key, last, None, errors=tuple(errors))


async def _end_failed(r: "layerstack.aio.AsyncRollout", last: RolloutAttempt, reconnect_s: float,
                      errors: List[str], number: int, kind: str, message: str) -> RolloutAttempt:
    """Ends the attempt ``infra_failed(kind)``; the attempt as recorded then,
    or ``last`` when the coordinator did not take the end (noted in
    ``errors``: the attempt ended otherwise meanwhile, or the coordinator
    fails; the sample goes on with its next attempt either way)."""
    try:
        return await _end(r, reconnect_s, infra_failed=kind, message=message)
    except LayerStackError as e:
        errors.append(f"attempt {number} end infra_failed({kind}): {e!r}"[:2000])
        return last


async def _end(r: "layerstack.aio.AsyncRollout", reconnect_s: float, **kw: Any) -> RolloutAttempt:
    """Ends the attempt, repeated through a coordinator restart (an end with
    the same result is answered as recorded)."""
    kw.setdefault("keep", "discard")
    attempt: RolloutAttempt = await _through_restarts(lambda: r.end(**kw), reconnect_s)
    return attempt


async def _reward(ls: AsyncClient, key: SampleKey, reconnect_s: float) -> Optional[float]:
    s = await _through_restarts(lambda: ls.sample(key), reconnect_s)
    return s.reward if s is not None else None

