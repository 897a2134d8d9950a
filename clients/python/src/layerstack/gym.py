"""A Gymnasium environment over the rollout fabric (docs/fabric.md): each
episode is one sample — ``reset()`` forks ``node`` into a fresh sandbox (an
attempt of a new sample), ``step(action)`` runs the action's command in it,
and the episode's reward comes from a :class:`~layerstack.fabric.Grader` run in
a clean sandbox over the episode's checkpoint, recorded by the daemon exactly
once (``EndRollout``).

    import layerstack.gym
    env = layerstack.gym.SandboxEnv(
        "/run/layerstack/admin.sock", node=root, run="gym-1",
        actions=["echo 1 > /work/x", "echo 2 > /work/x", "submit"],
        grader=Grader(["sh", "-c", "grep -q 2 /work/x"], name="x-is-2", version="1"),
    )
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(1)

Spaces: ``action_space`` is ``Discrete(len(actions))``; ``observation_space``
is ``Text(max_obs_chars)`` over printable characters — the last
``max_obs_chars`` characters of the command's stdout and stderr, others
replaced by ``?``. The action named ``"submit"`` ends the episode
(``terminated``): the sandbox is checkpointed, graded, and the attempt ends
``completed`` with the grader's reward (its node kept when accepted). After
``max_steps`` actions the episode is ``truncated`` and graded alike. A
``reset()`` or ``close()`` during an episode ends its attempt
``infra_failed(abandoned)`` — never a silent zero. ``info`` carries the
episode number, the command's exit code and, at the end, whether the grader
accepted and whether the reward was applied; the ids of the running episode
are fields of the environment (``attempt_id``, ``session_id``) and the ended
episode's record is ``last_attempt`` (its ``result_node``, ``reward``, …) —
not in ``info``, which Gymnasium's checker requires to be the same for the
same seed and actions.

Gymnasium is synchronous: the environment drives :mod:`layerstack.aio` on a
private event loop, so call it from plain (non-async) code.
"""

from __future__ import annotations

import asyncio
import os
import string
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import gymnasium
from gymnasium import spaces

import layerstack.aio
from layerstack.fabric import Grader, GraderNotStarted, HarnessError, RolloutAttempt, SampleKey

__all__ = ["SandboxEnv", "SUBMIT"]

#: The action that ends an episode and grades it.
SUBMIT = "submit"

#: Seconds an environment dropped without :meth:`SandboxEnv.close` waits, in
#: its finalizer, for its unfinished episode to end (``infra_failed``) and its
#: connection to close. An episode that could not end in time (the daemon
#: unreachable) stays running: the daemon ends it when its sandbox is gone,
#: or end it with ``layerstack rollout end ATTEMPT --infra-failed abandoned --discard``.
FINALIZER_WAIT_S = 5.0

_CHARSET = frozenset(string.printable)


def _printable(text: str, limit: int) -> str:
    return "".join(c if c in _CHARSET else "?" for c in text[-limit:])


class SandboxEnv(gymnasium.Env[str, Any]):
    """See the module docs. ``admin_address``/``connect``: as
    :func:`layerstack.aio.connect`; ``node``: the node every episode starts
    from; ``run``: the fabric run the episodes belong to (created over
    ``node``'s graph when missing); ``step_id``/``prompt``: the samples'
    coordinates (episode ``k`` is sample ``k``); ``policy``: recorded with
    each attempt; ``exec_timeout_s``: per action."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        admin_address: Union[str, "os.PathLike[str]"],
        *,
        node: str,
        run: str,
        actions: Sequence[Union[str, Sequence[str]]],
        grader: Grader,
        max_steps: int = 16,
        max_obs_chars: int = 4096,
        prompt: str = "env",
        step_id: int = 0,
        policy: str = "gym",
        exec_timeout_s: Optional[float] = 60.0,
        connect: Optional[Dict[str, Any]] = None,
    ) -> None:
        if not actions:
            raise ValueError("actions must name at least one command (and usually 'submit')")
        self.actions: List[Union[str, Sequence[str]]] = list(actions)
        self.node, self.run, self.grader = node, run, grader
        self.max_steps, self.max_obs_chars = max_steps, max_obs_chars
        self.prompt, self.step_id, self.policy = prompt, step_id, policy
        self.exec_timeout_s = exec_timeout_s
        self.action_space = spaces.Discrete(len(self.actions))
        self.observation_space = spaces.Text(max_length=max_obs_chars, min_length=0, charset="".join(sorted(_CHARSET)))
        self._loop = asyncio.new_event_loop()
        self._admin, self._connect = admin_address, dict(connect or {})
        self._ls: Optional[layerstack.aio.AsyncClient] = None
        self._rollout: Optional[layerstack.aio.AsyncRollout] = None
        self._episode = -1
        self._steps = 0
        #: The running episode's rollout attempt id and sandbox session id.
        self.attempt_id: Optional[int] = None
        self.session_id: Optional[int] = None
        #: The record of the last episode that ended through grading.
        self.last_attempt: Optional[RolloutAttempt] = None

    # ------------------------------------------------------------ plumbing

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    async def _client(self) -> layerstack.aio.AsyncClient:
        if self._ls is None:
            self._ls = layerstack.aio.connect(self._admin, **self._connect)
            graph = (await self._ls.show_node(self.node)).graph
            await self._ls.create_run(self.run, graph)
            # Continue after the episodes of an earlier environment on this run.
            self._episode = -1
            while await self._ls.sample(SampleKey(self.run, self.step_id, self.prompt, self._episode + 1)) is not None:
                self._episode += 1
        return self._ls

    async def _abandon(self) -> None:
        r, self._rollout = self._rollout, None
        if r is not None and r.attempt is not None and not r.attempt.ended:
            await r.end(infra_failed="abandoned", message="the environment was reset or closed mid-episode", keep="discard")

    # ------------------------------------------------------------ gymnasium

    def reset(self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """Ends an unfinished episode (``infra_failed(abandoned)``) and forks
        ``node`` into the next episode's sandbox. ``seed`` is recorded with the
        attempt. Observation: ``""``."""
        super().reset(seed=seed)

        async def go() -> layerstack.aio.AsyncRollout:
            ls = await self._client()
            await self._abandon()
            self._episode += 1
            key = SampleKey(self.run, self.step_id, self.prompt, self._episode)
            return await ls.begin_rollout(key, 1, self.node, policy=self.policy, seed=seed)

        self._rollout = self._run(go())
        self._steps = 0
        a = self._rollout.attempt
        self.attempt_id = a.id if a else None
        self.session_id = self._rollout.sandbox.id if self._rollout.sandbox else None
        return "", {"episode": self._episode}

    def step(self, action: Any) -> Tuple[str, float, bool, bool, Dict[str, Any]]:
        """Runs action ``action``'s command; ``"submit"`` (or the
        ``max_steps``-th action) grades the episode: ``(obs, reward,
        terminated, truncated, info)``."""
        if self._rollout is None or self._rollout.attempt is None or self._rollout.attempt.ended:
            raise RuntimeError("step() needs a live episode: call reset() first")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        cmd = self.actions[int(action)]
        self._steps += 1
        r = self._rollout
        info: Dict[str, Any] = {"step": self._steps}
        if cmd == SUBMIT:
            obs, reward = self._grade(info)
            return obs, reward, True, False, info
        out = self._run(r.exec(cmd, timeout_s=self.exec_timeout_s))
        info["exit_code"] = out.exit_code
        obs = _printable((out.stdout + out.stderr).decode("utf-8", "replace"), self.max_obs_chars)
        if self._steps >= self.max_steps:
            _, reward = self._grade(info)
            return obs, reward, False, True, info
        return obs, 0.0, False, False, info

    def _grade(self, info: Dict[str, Any]) -> Tuple[str, float]:
        r = self._rollout
        assert r is not None and self._ls is not None
        ls = self._ls

        async def go() -> Tuple[str, float]:
            node = await r.checkpoint_for_grading()
            g = await ls.sandbox(node=node, name=f"grade-{r.id}", key=f"grade:{r.id}")
            try:
                out = await g.exec(self.grader.command, env=self.grader.env, timeout_s=self.grader.timeout_s)
            finally:
                await g.discard("grading done")
            if out.start_failed:
                # A broken evaluator, not the policy's result: never a reward.
                why = (f"grader {self.grader.name!r} could not be started (exit {out.exit_code}): "
                       + out.stderr.decode("utf-8", "replace").strip()[:500])
                self.last_attempt = await r.end(infra_failed=GraderNotStarted.kind, message=why, keep="discard")
                self._rollout = None
                raise GraderNotStarted(why)
            try:
                reward, accepted = self.grader.score(out)
            except HarnessError as e:
                # The harness's bug: the episode ends, nothing stays running.
                self.last_attempt = await r.end(infra_failed=HarnessError.kind, message=str(e)[:1000],
                                                keep="discard")
                self._rollout = None
                raise
            end = await r.end(reward=reward, accepted=accepted, evaluator=self.grader.evaluator(),
                              keep="checkpoint" if accepted else "discard")
            self.last_attempt = end
            info.update(accepted=accepted, applied=end.applied, grade_exit_code=out.exit_code)
            text = _printable((out.stdout + out.stderr).decode("utf-8", "replace"), self.max_obs_chars)
            return text, float(end.reward if end.reward is not None else reward)

        return self._run(go())  # type: ignore[no-any-return]

    def __del__(self) -> None:
        # Dropped without close(): the episode ends and its sandbox goes as
        # close() ends them — within FINALIZER_WAIT_S, since a finalizer runs
        # on whatever thread dropped the last reference (not at interpreter
        # exit, when the loop and gRPC may be gone).
        try:
            loop = self.__dict__.get("_loop")
            if loop is not None and not loop.is_closed() and not loop.is_running() and not sys.is_finalizing():
                self._close(FINALIZER_WAIT_S)
        except Exception:  # noqa: BLE001 — nothing to report to from a finalizer
            pass

    def close(self) -> None:
        """Ends an unfinished episode and closes the connection."""
        self._close(None)

    def _close(self, wait_s: Optional[float]) -> None:
        if self._loop.is_closed():
            return

        async def go() -> None:
            try:
                await self._abandon()
            finally:
                if self._ls is not None:
                    ls, self._ls = self._ls, None
                    await ls.close()

        try:
            self._run(go() if wait_s is None else asyncio.wait_for(go(), wait_s))
        finally:
            self._loop.close()
