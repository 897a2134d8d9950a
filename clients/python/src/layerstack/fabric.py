"""The rollout fabric (docs/fabric.md): runs, attempts of samples in sandboxes,
rewards applied exactly once, and search statistics beside the graph.

A **sample** is ``(run, step, prompt, sample)``; each try of it is an
**attempt** (numbered from 1) in its own daemon-owned sandbox on the sample's
node. An attempt ends ``completed`` (a reward), ``task_failed`` or
``infra_failed`` (a kind: ``daemon-restart``, ``init-gone``, ``abandoned``,
``sandbox-start``, ``checkpoint-failed``, ``unavailable``, …) — never a silent
zero. The daemon applies a sample's reward once: the first completed attempt's;
a repeated end answers the recorded one, a retry is a new attempt number.

The step API for RL is :func:`fan_out` (asyncio): ``n`` samples of one node,
each attempt run by your coroutine, graded in a clean sandbox over the
attempt's checkpoint when a :class:`Grader` is given, retried on
infrastructure failures, results yielded as they finish::

    async with layerstack.aio.connect() as ls:
        await ls.create_run("rl-7", graph="task-17")
        async def act(r: layerstack.aio.AsyncRollout) -> None:
            await r.exec(["sh", "-c", edits[r.sample]])
        grader = Grader(["sh", "-c", "make test"], name="make-test", version="1")
        async for res in fan_out(ls, "rl-7", node, 64, act, step=7, prompt="t17",
                                 policy="ckpt-120", grader=grader):
            print(res.sample, res.status, res.reward)

MCTS helpers: :func:`uct` and :func:`puct` pick a child from
:class:`NodeStats` (``GetNodeStats``); statistics are updated by each
attempt's end (``backprop``), once per attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from layerstack._pb import admin_pb2 as pb
from layerstack.errors import BusyError, FailedPreconditionError, LayerStackError

if TYPE_CHECKING:
    from layerstack.aio import AsyncClient, AsyncRollout
    from layerstack.sandbox import ExecOutput

__all__ = [
    "SampleKey",
    "Run",
    "Sample",
    "Evaluator",
    "Artifact",
    "RolloutAttempt",
    "RunAudit",
    "NodeStats",
    "Grader",
    "RolloutResult",
    "TaskFailed",
    "GraderLost",
    "GraderNotStarted",
    "HarnessError",
    "uct",
    "puct",
    "fan_out",
    "end_request",
]

#: The infrastructure-failure kinds the daemon itself records.
INFRA_KINDS = ("daemon-restart", "init-gone", "abandoned", "sandbox-start", "checkpoint-failed")


@dataclass(frozen=True)
class SampleKey:
    """A sample's coordinates: ``run``, ``step`` (from 0), ``prompt`` (the
    task's id), ``sample`` (from 0)."""

    run: str
    step: int
    prompt: str
    sample: int

    def to_pb(self) -> pb.SampleKey:
        return pb.SampleKey(run=self.run, step=self.step, prompt=self.prompt, sample=self.sample)

    @classmethod
    def from_pb(cls, k: pb.SampleKey) -> "SampleKey":
        return cls(run=k.run, step=k.step, prompt=k.prompt, sample=k.sample)


@dataclass(frozen=True)
class Run:
    """A run over graph ``graph`` (its samples start from its nodes)."""

    name: str
    graph: str
    labels: Dict[str, str]
    created_ns: int

    @classmethod
    def from_pb(cls, r: pb.Run) -> "Run":
        return cls(name=r.name, graph=r.graph, labels=dict(r.labels), created_ns=r.created_ns)


@dataclass(frozen=True)
class Sample:
    """A sample: its node, its reward (``None`` until an attempt completes)
    and which attempt gave it, how many attempts it has had."""

    key: SampleKey
    node: str
    reward: Optional[float]
    reward_attempt: Optional[int]
    attempts: int
    max_attempt: int
    running: Tuple[int, ...]
    #: The first attempt that ended ``task_failed`` (``None``: none) — as final
    #: as a reward: :func:`fan_out` called again does not run the sample again.
    task_failed_attempt: Optional[int] = None

    @classmethod
    def from_pb(cls, s: pb.Sample) -> "Sample":
        return cls(
            key=SampleKey.from_pb(s.key),
            node=s.node,
            reward=s.reward if s.has_reward else None,
            reward_attempt=s.reward_attempt or None,
            attempts=s.attempts,
            max_attempt=s.max_attempt,
            running=tuple(s.running),
            task_failed_attempt=s.task_failed_attempt or None,
        )


@dataclass(frozen=True)
class Evaluator:
    """A versioned evaluator, recorded with the reward it gave: ``digest`` is
    the content digest of what ran (e.g. ``sha256:`` of its script)."""

    name: str
    version: str
    digest: str = ""

    def to_pb(self) -> pb.Evaluator:
        return pb.Evaluator(name=self.name, version=self.version, digest=self.digest)


@dataclass(frozen=True)
class Artifact:
    """A named blob of an attempt (``digest``: ``blake3:<hex>``; ``size`` in bytes)."""

    name: str
    digest: str
    size: int


@dataclass(frozen=True)
class RolloutAttempt:
    """One attempt of a sample, as the daemon recorded it.

    Attributes:
        id: the attempt's id (EndRollout, ListRollouts).
        key: its sample.
        attempt: its number, from 1.
        node: the node it started from.
        session: its sandbox session, ``None`` if none.
        status: ``running`` | ``completed`` | ``task_failed`` | ``infra_failed``.
        infra_kind: what failed (``infra_failed`` only).
        reward: its reward (``completed`` only); ``accepted`` the evaluator's verdict.
        applied: this attempt's reward is its sample's (one attempt per sample).
        evaluator: the evaluator recorded with the reward.
        result_node: the checkpoint kept for it, ``None`` if none.
        trajectory: digest of its trajectory blob (``read_blob``), ``None`` if none.
        backprop: the value backpropagated for it, ``None`` if none.
        worker: a remote attempt's worker (e.g. the Ray node id it ran on;
            :mod:`layerstack.ray`), ``None`` for a local attempt (its sandbox
            is this daemon's).
    """

    id: int
    key: SampleKey
    attempt: int
    node: str
    session: Optional[int]
    policy: str
    seed: Optional[int]
    status: str
    infra_kind: Optional[str]
    reward: Optional[float]
    accepted: bool
    applied: bool
    evaluator: Optional[Evaluator]
    result_node: Optional[str]
    trajectory: Optional[str]
    artifacts: Tuple[Artifact, ...]
    backprop: Optional[float]
    message: str
    created_ns: int
    ended_ns: Optional[int]
    worker: Optional[str] = None

    @property
    def ended(self) -> bool:
        return self.status != "running"

    @classmethod
    def from_pb(cls, a: pb.RolloutAttempt) -> "RolloutAttempt":
        ev = a.evaluator if a.HasField("evaluator") else None
        return cls(
            id=a.id,
            key=SampleKey.from_pb(a.sample),
            attempt=a.attempt,
            node=a.node,
            session=a.session or None,
            policy=a.policy,
            seed=a.seed if a.has_seed else None,
            status=a.status,
            infra_kind=a.infra_kind or None,
            reward=a.reward if a.has_reward else None,
            accepted=a.accepted,
            applied=a.applied,
            evaluator=Evaluator(ev.name, ev.version, ev.digest) if ev is not None else None,
            result_node=a.result_node or None,
            trajectory=a.trajectory or None,
            artifacts=tuple(Artifact(x.name, x.digest, x.size) for x in a.artifacts),
            backprop=a.backprop if a.backpropagated else None,
            message=a.message,
            created_ns=a.created_ns,
            ended_ns=a.ended_ns or None,
            worker=a.worker or None,
        )


@dataclass(frozen=True)
class RunAudit:
    """A run's exactly-once audit: counts, and ``violations`` (empty when every
    invariant holds: one applied reward per rewarded sample, equal to its
    attempt's; no completed attempt of an unrewarded sample; backpropagations
    only of attempts that ended with a value)."""

    samples: int
    rewarded: int
    attempts: int
    running: int
    completed: int
    task_failed: int
    infra_failed: Dict[str, int]
    backprops: int
    violations: Tuple[str, ...]
    #: Remote attempts by worker (:mod:`layerstack.ray`); local ones are not counted.
    by_worker: Dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, a: pb.RunAudit) -> "RunAudit":
        return cls(
            samples=a.samples,
            rewarded=a.rewarded,
            attempts=a.attempts,
            running=a.running,
            completed=a.completed,
            task_failed=a.task_failed,
            infra_failed=dict(a.infra_failed),
            backprops=a.backprops,
            violations=tuple(a.violations),
            by_worker=dict(a.by_worker),
        )


@dataclass(frozen=True)
class NodeStats:
    """Search statistics of a node: ``visits``, ``value_sum``, ``prior``
    (``None`` if never set) and the holders of frontier leases on it."""

    node: str
    visits: int
    value_sum: float
    prior: Optional[float]
    frontier: Tuple[str, ...]

    @property
    def mean(self) -> float:
        """``value_sum / visits`` (0 for an unvisited node)."""
        return self.value_sum / self.visits if self.visits else 0.0

    @classmethod
    def from_pb(cls, s: pb.NodeStats) -> "NodeStats":
        return cls(
            node=s.node,
            visits=s.visits,
            value_sum=s.value_sum,
            prior=s.prior if s.has_prior else None,
            frontier=tuple(s.frontier),
        )


def uct(parent: NodeStats, children: Sequence[NodeStats], c: float = math.sqrt(2)) -> NodeStats:
    """The child maximizing UCT (Kocsis & Szepesvári 2006): ``mean + c *
    sqrt(ln(N) / n)``; an unvisited child first (lowest id). ValueError when
    ``children`` is empty."""
    if not children:
        raise ValueError(f"node {parent.node} has no children to select from: expand it first")
    unvisited = [ch for ch in children if ch.visits == 0]
    if unvisited:
        return min(unvisited, key=lambda ch: ch.node)
    ln_n = math.log(max(parent.visits, 1))
    return max(children, key=lambda ch: (ch.mean + c * math.sqrt(ln_n / ch.visits), ch.node))


def puct(parent: NodeStats, children: Sequence[NodeStats], c: float = 1.0) -> NodeStats:
    """The child maximizing PUCT (AlphaZero): ``mean + c * prior * sqrt(N) /
    (1 + n)``; a child with no prior counts as ``1 / len(children)``.
    ValueError when ``children`` is empty."""
    if not children:
        raise ValueError(f"node {parent.node} has no children to select from: expand it first")
    uniform = 1.0 / len(children)
    sqrt_n = math.sqrt(max(parent.visits, 1))

    def score(ch: NodeStats) -> Tuple[float, str]:
        p = ch.prior if ch.prior is not None else uniform
        return (ch.mean + c * p * sqrt_n / (1 + ch.visits), ch.node)

    return max(children, key=score)


class GraderLost(Exception):
    """The grader's sandbox or process was lost (killed by a signal it did not
    cause): the attempt ends ``infra_failed(grader-lost)`` and is retried."""

    kind = "grader-lost"


class GraderNotStarted(GraderLost):
    """The grader's command could not be started in its sandbox (not found,
    not executable: ``ExecOutput.start_failed``): the evaluator is broken,
    not the task — the attempt ends ``infra_failed(grader-not-started)``,
    never with a reward."""

    kind = "grader-not-started"


class TaskFailed(Exception):
    """Raise it from a rollout coroutine: the attempt ends ``task_failed``
    (the policy's fault), not an infrastructure failure, and is not retried."""


class HarnessError(TypeError):
    """The harness's own mistake found in a rollout — ``act`` returned no
    number where it gives the reward, or a reward is not finite: a retry
    would repeat it, so it is no infrastructure failure. :func:`fan_out`
    ends the attempt ``infra_failed(harness-error)`` (nothing stays running)
    and raises it. (A ``TypeError``.)"""

    kind = "harness-error"


def _reward_of(value: Any, what: str) -> float:
    """``value`` as a finite reward (any real number: ``int``, ``float``, a
    numpy scalar; ``bool`` counts as 0/1); :class:`HarnessError` naming
    ``what`` otherwise."""
    if not isinstance(value, numbers.Real):
        raise HarnessError(
            f"{what} returned {value!r} ({type(value).__name__}): it must return the reward, a number "
            "(give a grader= to score the sandbox instead)"
        )
    v = float(value)
    if not math.isfinite(v):
        raise HarnessError(f"{what} returned reward {v}: a reward is a finite number")
    return v


@dataclass
class Grader:
    """An evaluator run in a clean sandbox over the attempt's checkpoint.

    ``command`` runs there; ``reward`` maps its output to ``(reward,
    accepted)`` (default: ``(1.0, True)`` on exit 0, else ``(0.0, False)``).
    ``digest`` defaults to ``sha256:`` of the command's JSON, so a changed
    command is a changed evaluator. ``timeout_s`` bounds the command.
    """

    command: Union[str, Sequence[str]]
    name: str
    version: str
    digest: str = ""
    reward: Optional[Callable[["ExecOutput"], Tuple[float, bool]]] = None
    timeout_s: Optional[float] = 600.0
    env: Optional[Mapping[str, str]] = None

    def evaluator(self) -> Evaluator:
        d = self.digest or "sha256:" + hashlib.sha256(json.dumps(self.command).encode()).hexdigest()
        return Evaluator(self.name, self.version, d)

    def score(self, out: "ExecOutput") -> Tuple[float, bool]:
        """``(reward, accepted)`` for the grader's output; :class:`HarnessError`
        when ``reward`` raises or gives no finite number."""
        if self.reward is not None:
            what = f"grader {self.name!r}'s reward function"
            try:
                reward, accepted = self.reward(out)
            except Exception as e:  # the harness's bug: every sample would repeat it
                raise HarnessError(f"{what} raised {e!r}") from e
            return _reward_of(reward, what), bool(accepted)
        return (1.0, True) if out.ok else (0.0, False)


@dataclass(frozen=True)
class RolloutResult:
    """What :func:`fan_out` yields per sample: its last attempt (``attempt``),
    the sample's reward as applied (``reward``, ``None`` if none), whether this
    call applied it or found it applied before (``rewarded_before``), and the
    evaluator's output when graded."""

    sample: int
    key: SampleKey
    attempt: Optional[RolloutAttempt]
    reward: Optional[float]
    rewarded_before: bool = False
    grade_output: Optional["ExecOutput"] = None
    errors: Tuple[str, ...] = field(default_factory=tuple)
    #: The sample had ended ``task_failed`` in an earlier call (not run again).
    task_failed_before: bool = False

    @property
    def status(self) -> str:
        """The last attempt's status (``completed`` for a sample rewarded before,
        ``task_failed`` for one that failed its task before)."""
        if self.rewarded_before:
            return "completed"
        if self.task_failed_before:
            return "task_failed"
        return self.attempt.status if self.attempt is not None else "infra_failed"


def end_request(
    attempt_id: int,
    *,
    reward: Optional[float] = None,
    accepted: bool = True,
    task_failed: bool = False,
    infra_failed: Optional[str] = None,
    evaluator: Optional[Evaluator] = None,
    backprop: Optional[float] = None,
    keep: str = "checkpoint",
    state: Union[Mapping[str, Any], str, None] = None,
    labels: Optional[Mapping[str, str]] = None,
    artifacts: Optional[Mapping[str, bytes]] = None,
    trajectory: bytes = b"",
    message: str = "",
    result_node: Optional[str] = None,
) -> pb.EndRolloutRequest:
    """The EndRollout request (exactly one of ``reward``, ``task_failed``,
    ``infra_failed``; ValueError otherwise, or for a ``keep`` other than
    "checkpoint" and "discard"). ``result_node``: a remote attempt's
    checkpoint, a node already pulled into the daemon's store whose parent is
    the attempt's node (not with ``infra_failed`` or ``keep="discard"``).
    ``state`` and ``labels`` are the checkpoint's: with ``keep="discard"`` the
    daemon refuses them (``InvalidArgumentError``), since no node records them."""
    given = [reward is not None, task_failed, infra_failed is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of reward=, task_failed=True, infra_failed='kind'")
    if keep not in ("checkpoint", "discard"):
        raise ValueError(f"keep {keep!r}: use 'checkpoint' or 'discard'")
    if reward is not None:
        status = "completed"
    elif task_failed:
        status = "task_failed"
    else:
        status = "infra_failed"
    req = pb.EndRolloutRequest(
        attempt=attempt_id,
        status=status,
        reward=float(reward) if reward is not None else 0.0,
        accepted=accepted,
        infra_kind=infra_failed or "",
        has_backprop=backprop is not None,
        backprop=float(backprop) if backprop is not None else 0.0,
        message=message,
        keep=pb.EndRolloutRequest.DISCARD if keep == "discard" else pb.EndRolloutRequest.CHECKPOINT,
        state=json.dumps(state) if isinstance(state, Mapping) else (state or ""),
        labels=dict(labels or {}),
        trajectory=trajectory,
        result_node=result_node or "",
    )
    if evaluator is not None:
        req.evaluator.CopyFrom(evaluator.to_pb())
    for name, data in (artifacts or {}).items():
        req.artifacts.add(name=name, data=data)
    return req


async def _through_restarts(what: Callable[[], Awaitable[Any]], reconnect_s: float) -> Any:
    """``await what()``, again while the daemon is unreachable (UnavailableError:
    a restart) for at most ``reconnect_s`` seconds. Only for idempotent calls
    (a begin names its attempt; a sample read changes nothing)."""
    from layerstack.errors import UnavailableError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + reconnect_s
    delay = 0.05
    while True:
        try:
            return await what()
        except UnavailableError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


#: Error kinds of a begin that are the caller's to fix, not worth a retry.
_CALLER_ERRORS = frozenset({"invalid_argument", "failed_precondition", "not_found", "already_exists",
                            "permission_denied", "unauthenticated", "unsupported"})


def _check_counts(*, n: int, max_attempts: int, concurrency: int) -> None:
    """ValueError for a negative ``n`` or a ``max_attempts`` or
    ``concurrency`` below 1, naming it."""
    if n < 0:
        raise ValueError(f"n={n}: give the number of samples, 0 or more")
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts}: give 1 or more (attempts per sample)")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: give 1 or more (samples run at once)")


def _infra_kind(e: BaseException) -> str:
    """The infra_failed kind of an exception a rollout raised (a LayerStack
    error's kind, else the exception's class name)."""
    kind = getattr(e, "kind", None)
    if isinstance(kind, str) and kind:
        return kind
    return type(e).__name__


async def fan_out(
    client: "AsyncClient",
    run: str,
    node: str,
    n: int,
    act: Callable[["AsyncRollout"], Awaitable[Any]],
    *,
    step: int = 0,
    prompt: str = "task",
    policy: str = "policy",
    grader: Optional[Grader] = None,
    samples: Optional[Sequence[int]] = None,
    max_attempts: int = 3,
    concurrency: int = 64,
    seed: Optional[int] = None,
    backprop: bool = True,
    keep: str = "checkpoint",
    sandbox: Optional[Mapping[str, Any]] = None,
    reconnect_s: float = 60.0,
) -> AsyncIterator[RolloutResult]:
    """Runs ``n`` samples of ``node`` (``samples``: their numbers, default
    ``range(n)``) in run ``run``, at most ``concurrency`` at once, and yields a
    :class:`RolloutResult` per sample as it finishes.

    Per sample: attempt 1, 2, … up to ``max_attempts``: a sandbox on ``node``
    (``BeginRollout``; a sample rewarded before yields its recorded reward
    and starts nothing; a ``busy`` answer — ``sandbox={"wait_s": 0}`` —
    asks again for the same attempt, with backoff), ``await act(rollout)`` —
    without a ``grader`` it must return the reward, a finite number;
    raising :class:`TaskFailed` ends the attempt ``task_failed``. With a ``grader``,
    the attempt's sandbox is checkpointed, the grader runs in a fresh sandbox
    on that checkpoint and is discarded, and its reward ends the attempt (its
    node kept when accepted, else pruned, ``keep`` permitting). Any other
    exception is an infrastructure failure: the attempt ends
    ``infra_failed(kind)`` and the sample is tried again. ``backprop``: the
    reward is backpropagated from the attempt's leaf (once per attempt).

    Raised, not yielded — every sample would repeat them: ``ValueError`` for
    a bad argument; a LayerStack error of the caller's kind (a node or run
    that does not exist, a closed client: ``NotFoundError``,
    ``FailedPreconditionError``, …); :class:`HarnessError` when ``act``
    returns no number (without a grader) or a reward is not finite (its
    attempt ends ``infra_failed(harness-error)`` first). Leaving the loop
    early (``break``, a timeout, a raise) ends every attempt still running
    ``infra_failed(cancelled)`` and discards its sandbox.

    Calling it again after a crash is safe: samples rewarded before are not
    run again and keep their reward, nor are samples whose task failed before
    (``task_failed_before``; only ``infra_failed`` attempts are retried);
    attempt numbers continue after the
    highest one recorded (a crashed attempt is ended by the daemon, or by
    this call as ``infra_failed(abandoned)``). While the daemon is away (a
    restart), begins and sample reads are repeated for up to
    ``reconnect_s`` seconds — they are idempotent; an attempt the restart
    ended is ended ``infra_failed`` by the daemon and the sample goes on
    with the next attempt; an end whose answer was lost is found applied
    by the next begin (the sample answers "rewarded").
    """
    if keep not in ("checkpoint", "discard"):
        raise ValueError(f"keep {keep!r}: use 'checkpoint' or 'discard'")
    _check_counts(n=n, max_attempts=max_attempts, concurrency=concurrency)

    def one(i: int) -> Awaitable[RolloutResult]:
        return _run_sample(
            client, run, node, i, act, step=step, prompt=prompt, policy=policy,
            grader=grader, max_attempts=max_attempts, seed=seed, backprop=backprop,
            keep=keep, sandbox=sandbox or {}, reconnect_s=reconnect_s,
        )

    todo = list(samples) if samples is not None else list(range(n))
    async for res in _as_finished(todo, one, concurrency, lambda i: SampleKey(run, step, prompt, i),
                                  raise_callers=True):
        yield res


async def _as_finished(
    todo: Sequence[int],
    one: Callable[[int], Awaitable[RolloutResult]],
    concurrency: int,
    key: Callable[[int], SampleKey],
    raise_callers: bool = False,
) -> AsyncIterator[RolloutResult]:
    """Runs ``one(i)`` for every sample ``i`` of ``todo``, at most
    ``concurrency`` at once, and yields the results as they finish; an
    exception becomes the sample's result (``errors``), never lost — except,
    with ``raise_callers`` (:func:`fan_out`), the caller's own mistakes (a
    LayerStack error of a kind in ``_CALLER_ERRORS`` — a wrong node or run, a
    closed client — and :class:`HarnessError`), which are raised here: every
    sample would repeat them. (``fan_out_ray`` keeps them per sample: its
    attempts end ``infra_failed(kind)`` on the worker that refused.) Leaving the loop early (``break``, a cancellation, a raise) cancels
    what still runs; each sample ends its running attempt first."""
    gate = asyncio.Semaphore(max(1, concurrency))
    queue: "asyncio.Queue[Union[RolloutResult, BaseException]]" = asyncio.Queue()
    closing = False

    async def run_one(i: int) -> None:
        async with gate:
            res: Union[RolloutResult, BaseException]
            try:
                res = await one(i)
            except asyncio.CancelledError as e:
                if closing:
                    raise
                # Not ours (a call grpc cut off, a future something else
                # cancelled): the sample's result, or the loop would wait
                # for it forever.
                res = RolloutResult(sample=i, key=key(i), attempt=None, reward=None, errors=(repr(e),))
            except BaseException as e:  # noqa: BLE001 — reported, never lost
                if raise_callers and _is_callers(e):
                    res = e
                else:
                    res = RolloutResult(sample=i, key=key(i), attempt=None, reward=None, errors=(repr(e),))
            await queue.put(res)

    tasks = [asyncio.ensure_future(run_one(i)) for i in todo]
    try:
        for _ in todo:
            got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        closing = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_callers(e: BaseException) -> bool:
    """Whether ``e`` is the caller's mistake (see :func:`_as_finished`)."""
    if isinstance(e, HarnessError):
        return True
    return isinstance(e, LayerStackError) and getattr(e, "kind", None) in _CALLER_ERRORS


async def _run_sample(
    client: "AsyncClient",
    run: str,
    node: str,
    i: int,
    act: Callable[["AsyncRollout"], Awaitable[Any]],
    *,
    step: int,
    prompt: str,
    policy: str,
    grader: Optional[Grader],
    max_attempts: int,
    seed: Optional[int],
    backprop: bool,
    keep: str,
    sandbox: Mapping[str, Any],
    reconnect_s: float,
) -> RolloutResult:
    key = SampleKey(run, step, prompt, i)
    first = await _first_attempt(client, key, reconnect_s)
    if first is None:
        return RolloutResult(i, key, None, None, task_failed_before=True)
    errors: List[str] = []
    last: Optional[RolloutAttempt] = None
    for number in range(first, first + max_attempts):
        busy = 0
        while True:
            # The begin runs as its own task: cancelled meanwhile (the loop
            # was left), this sample waits for what it made and ends it.
            begin = asyncio.ensure_future(_through_restarts(
                lambda: client.begin_rollout(
                    key, number, node, policy=policy, seed=None if seed is None else seed + i, **sandbox
                ),
                reconnect_s,
            ))
            try:
                r = await asyncio.shield(begin)
                break
            except asyncio.CancelledError:
                await _settle(asyncio.shield(_abandon_begin(client, key, begin)))
                raise
            except BusyError:
                # No slot now (asked not to wait, `wait_s`): the daemon keeps
                # the attempt, to be asked again — the same attempt number,
                # later; a busy pool is no failure of the attempt.
                busy += 1
                try:
                    await asyncio.sleep(min(0.02 * 2 ** min(busy, 7), 2.0))
                except asyncio.CancelledError:
                    # The kept attempt has no sandbox: ended, not left running.
                    await _settle(asyncio.shield(_abandon_begin(client, key, None)))
                    raise
            except LayerStackError as e:
                if e.kind in _CALLER_ERRORS:
                    raise
                # The sandbox could not be made: the daemon ended the attempt
                # infra_failed(sandbox-start); the next attempt.
                errors.append(f"attempt {number} begin: {e!r}")
                r = None
                break
        if r is None:
            await asyncio.sleep(min(0.05 * 2 ** (number - first), 2.0))
            continue
        if r.rewarded:
            s = r.sample
            return RolloutResult(i, key, last, s.reward if s else None, rewarded_before=True, errors=tuple(errors))
        assert r.attempt is not None
        last = r.attempt
        if last.ended:
            # A repeated begin of an attempt that ended (by a restart).
            continue
        try:
            value = await act(r)
            if grader is None:
                reward = _reward_of(value, "act")
                last = await r.end(reward=reward, accepted=True, backprop=reward if backprop else None,
                                   keep=keep)
                return RolloutResult(i, key, last, reward if last.applied else await _reward(client, key),
                                     errors=tuple(errors))
            node_id = await r.checkpoint_for_grading()
            try:
                g = await client.sandbox(node=node_id, name=f"grade-{r.id}", key=f"grade:{r.id}")
            except asyncio.CancelledError:
                # It may have been made: its key finds it, and it goes.
                await _settle(asyncio.shield(_discard_grader(client, node_id, r.id)))
                raise
            try:
                out = await g.exec(grader.command, env=grader.env, timeout_s=grader.timeout_s)
            finally:
                # Discarded even across a daemon restart (a close is idempotent).
                await _through_restarts(lambda: g.discard("grading done"), reconnect_s)
            if out.start_failed:
                raise GraderNotStarted(
                    f"grader {grader.name!r} could not be started (exit {out.exit_code}): "
                    + out.stderr.decode("utf-8", "replace").strip()[:500]
                )
            if out.signal and not out.timed_out and not out.oom_killed:
                # Killed from outside (its sandbox lost): not the task's
                # result — never a silent zero.
                raise GraderLost(f"the grader was killed by signal {out.signal}")
            reward, accepted = grader.score(out)
            last = await r.end(
                reward=reward, accepted=accepted, evaluator=grader.evaluator(),
                backprop=reward if backprop else None,
                keep=keep if accepted else "discard",
            )
            applied = reward if last.applied else await _reward(client, key)
            return RolloutResult(i, key, last, applied, grade_output=out, errors=tuple(errors))
        except TaskFailed as e:
            try:
                last = await _through_restarts(
                    lambda: r.end(task_failed=True, message=str(e), keep="discard"), reconnect_s
                )
            except FailedPreconditionError as e2:  # a restart ended it first: try again
                errors.append(f"attempt {number} end: {e2!r}")
                continue
            return RolloutResult(i, key, last, None, errors=tuple(errors))
        except asyncio.CancelledError:
            # Left before it ended (the caller broke out of the loop, a
            # timeout): the attempt ends and its sandbox goes — nothing of it
            # stays running. A first end that landed keeps its result (this
            # one is then refused).
            await _end_quietly(r, "cancelled", "the fan-out was left (cancelled) before this attempt ended")
            raise
        except HarnessError as e:
            await _end_quietly(r, HarnessError.kind, str(e)[:1000])
            raise
        except Exception as e:  # an infrastructure failure: retry the sample
            errors.append(f"attempt {number}: {e!r}")
            kind = _infra_kind(e)
            try:
                # Through a restart too: an attempt whose sandbox was already
                # checkpointed for grading is not ended by the restart.
                last = await _through_restarts(
                    lambda: r.end(infra_failed=kind, message=repr(e)[:1000], keep="discard"), reconnect_s
                )
            except FailedPreconditionError as e2:  # ended otherwise meanwhile (the restart)
                errors.append(f"attempt {number} end: {e2!r}")
            except Exception as e2:
                errors.append(f"attempt {number} end: {e2!r}")
            await asyncio.sleep(min(0.05 * 2 ** (number - first), 2.0))
    return RolloutResult(i, key, last, None, errors=tuple(errors))


async def _settle(aw: Awaitable[Any]) -> None:
    """Awaits clean-up ``aw`` on the way out of a cancelled sample; a second
    cancellation leaves it running (shielded) rather than raising here."""
    try:
        await aw
    except (Exception, asyncio.CancelledError):  # best effort on the way out
        pass


async def _abandon_begin(client: "AsyncClient", key: SampleKey, begin: "Optional[asyncio.Future[Any]]") -> None:
    """A sample left during its begin: the attempt the begin made (waited
    for, up to 30 s) and any other attempt of the sample still running — a
    ``busy`` begin's, which has no sandbox — end ``infra_failed(cancelled)``."""
    why = "the fan-out was left (cancelled) while this attempt began"
    if begin is not None:
        try:
            r = await asyncio.wait_for(begin, 30)
        except BaseException:  # noqa: BLE001 — it made nothing, or we cannot know
            r = None
        if r is not None and r.attempt is not None and not r.attempt.ended:
            await _end_quietly(r, "cancelled", why)
    try:
        s = await client.sample(key)
        for attempt_id in (s.running if s is not None else ()):
            try:
                await client.end_rollout(attempt_id, infra_failed="cancelled", message=why, keep="discard")
            except LayerStackError:
                pass
    except LayerStackError:
        pass


async def _discard_grader(client: "AsyncClient", node: str, attempt_id: int) -> None:
    """Discards attempt ``attempt_id``'s grading sandbox (found, or made and
    at once discarded, by its key)."""
    try:
        g = await client.sandbox(node=node, name=f"grade-{attempt_id}", key=f"grade:{attempt_id}")
        await g.discard("grading cancelled")
    except LayerStackError:
        pass


async def _end_quietly(r: "AsyncRollout", kind: str, message: str) -> None:
    """Ends attempt ``r`` ``infra_failed(kind)`` and discards its sandbox,
    shielded from a cancellation of the caller; a refusal (it ended before)
    or any failure is ignored — the daemon's audit ends what is left."""
    try:
        await asyncio.shield(r.end(infra_failed=kind, message=message, keep="discard"))
    except (Exception, asyncio.CancelledError):  # best effort on the way out
        pass


async def _first_attempt(client: "AsyncClient", key: SampleKey, reconnect_s: float) -> Optional[int]:
    """The number of sample ``key``'s next attempt, after those an earlier
    call made (its attempts still running end ``infra_failed(abandoned)``:
    nobody follows them now); ``None`` when its task failed in an earlier
    call — final, as a reward is (BeginRollout answers that one): the policy
    does not get another try."""
    before = await _through_restarts(lambda: client.sample(key), reconnect_s)
    if before is not None and before.reward is None and before.task_failed_attempt is not None:
        return None
    return 1 + int(await _through_restarts(lambda: client.sample_attempts(key), reconnect_s))


async def _reward(client: "AsyncClient", key: SampleKey) -> Optional[float]:
    s = await _through_restarts(lambda: client.sample(key), 60.0)
    return s.reward if s is not None else None
