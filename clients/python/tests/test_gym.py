"""The Gymnasium environment over the rollout fabric (issue 21): it passes
Gymnasium's own ``check_env``, an episode's reward comes from the grader in a
clean sandbox and is recorded once per episode, and an episode cut short by
``reset`` is recorded as abandoned, never as a zero.

Same requirements as test_sandbox.py (its daemon fixture).
"""

from __future__ import annotations

import asyncio
import os

from gymnasium.utils.env_checker import check_env

import layerstack
import layerstack.aio
from layerstack.fabric import Grader, RolloutAttempt
from layerstack.gym import SUBMIT, SandboxEnv
from test_sandbox import Daemon, daemon  # noqa: F401 — the module's daemon fixture

ACTIONS = ["echo 1 > /work/x", "echo 2 > /work/x", "cat /work/x", SUBMIT]
GRADER = Grader(["sh", "-c", "grep -q 2 /work/x"], name="x-is-2", version="1")


def _env(daemon: Daemon, run: str, root: str, **kw) -> SandboxEnv:  # type: ignore[no-untyped-def]
    return SandboxEnv(daemon.admin, node=root, run=run, actions=ACTIONS, grader=GRADER, **kw)


def test_the_environment_passes_gymnasiums_checker_and_rewards_each_episode_once(daemon: Daemon) -> None:  # noqa: F811
    with layerstack.connect(daemon.admin) as c:
        g = c.create_graph(f"gym-{os.getpid()}-{os.urandom(3).hex()}", daemon.stack)
    run = f"gym-run-{os.urandom(3).hex()}"
    # The checker's episodes (random actions, "submit" among them) in a run of their own.
    env = _env(daemon, run + "-check", g.root)
    check_env(env, skip_render_check=True)
    env.close()

    env = _env(daemon, run, g.root, max_steps=3)
    try:
        obs, info = env.reset(seed=1)
        assert obs == "" and info["episode"] >= 0 and env.attempt_id and env.session_id
        obs, reward, term, trunc, info = env.step(1)
        assert (reward, term, trunc, info["exit_code"]) == (0.0, False, False, 0)
        obs, *_ = env.step(2)
        assert obs == "2\n", obs
        obs, reward, term, trunc, info = env.step(3)
        assert (reward, term, trunc, info["accepted"], info["applied"]) == (1.0, True, False, True, True), info
        assert env.last_attempt is not None and env.last_attempt.attempt == 1
        good_node = env.last_attempt.result_node
        # A wrong episode: graded 0, its checkpoint pruned; truncated after 3 actions.
        env.reset(seed=2)
        env.step(0)
        env.step(2)
        obs, reward, term, trunc, info = env.step(0)
        assert (reward, term, trunc, info["accepted"]) == (0.0, False, True, False), info
        # Cut short by reset: abandoned, not zero.
        env.reset(seed=3)
        env.step(1)
        env.reset(seed=4)
    finally:
        env.close()

    async def audit() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            a = await ls.audit_run(run)
            assert a.violations == (), a
            assert a.completed == 2 and a.infra_failed.get("abandoned", 0) >= 2, a
            rewards = sorted(x.reward for x in [r async for r in ls.rollouts(run)] if x.status == "completed")
            assert rewards == [0.0, 1.0]
            assert not (await ls.show_node(good_node)).pruned

    asyncio.run(audit())


def test_a_broken_evaluator_ends_the_episode_and_is_raised(daemon: Daemon) -> None:  # noqa: F811
    """A grader that cannot be started, or whose reward function raises:
    step() raises, the episode's attempt ends infra_failed, never a reward."""
    import pytest

    from layerstack.fabric import GraderNotStarted, HarnessError

    with layerstack.connect(daemon.admin) as c:
        g = c.create_graph(f"gym-{os.getpid()}-{os.urandom(3).hex()}", daemon.stack)
    cases = [
        (Grader(["/no/such/grader"], name="none", version="1"), GraderNotStarted, "grader-not-started"),
        (Grader(["true"], name="div", version="1", reward=lambda out: (1 / 0, True)), HarnessError, "harness-error"),
    ]
    for grader, raised, kind in cases:
        env = SandboxEnv(daemon.admin, node=g.root, run=f"gym-bad-{os.urandom(3).hex()}", actions=ACTIONS,
                         grader=grader)
        try:
            env.reset(seed=1)
            with pytest.raises(raised):
                env.step(3)
            assert env.last_attempt is not None, kind
            assert (env.last_attempt.status, env.last_attempt.infra_kind, env.last_attempt.reward) == (
                "infra_failed", kind, None), env.last_attempt
        finally:
            env.close()


def test_a_dropped_environment_ends_its_episode_within_a_bound(daemon: Daemon, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """An environment dropped without close() ends its running episode
    (infra_failed(abandoned), its sandbox discarded) from its finalizer; a
    finalizer whose daemon does not answer gives up after FINALIZER_WAIT_S
    instead of blocking the thread that dropped it."""
    import gc
    import time

    import layerstack.gym

    with layerstack.connect(daemon.admin) as c:
        g = c.create_graph(f"gym-{os.getpid()}-{os.urandom(3).hex()}", daemon.stack)
    run = f"gym-drop-{os.urandom(3).hex()}"
    env = _env(daemon, run, g.root)
    env.reset(seed=1)
    first = env.attempt_id
    del env
    gc.collect()

    async def ended(attempt: int) -> RolloutAttempt:
        async with layerstack.aio.connect(daemon.admin) as ls:
            return next(a for a in [r async for r in ls.rollouts(run)] if a.id == attempt)

    a = asyncio.run(ended(first))
    assert (a.status, a.infra_kind) == ("infra_failed", "abandoned"), a

    # A daemon that does not answer (an end that never returns): bounded.
    monkeypatch.setattr(layerstack.gym, "FINALIZER_WAIT_S", 0.3)
    env = _env(daemon, run, g.root)
    env.reset(seed=2)
    stuck = env.attempt_id

    async def never() -> None:
        await asyncio.sleep(3600)

    env._abandon = never  # type: ignore[method-assign]
    t0 = time.monotonic()
    del env
    gc.collect()
    assert time.monotonic() - t0 < 5, "the finalizer waited for a daemon that does not answer"
    left = asyncio.run(ended(stuck))
    assert left.status == "running", left

    # What it left: ended by hand, as the constant's docs say.
    async def end_it() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            await ls.end_rollout(stuck, infra_failed="abandoned", keep="discard")

    asyncio.run(end_it())
