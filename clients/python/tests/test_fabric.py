"""The rollout fabric (issue 21) against a real daemon: a step fanned out over
sandboxes from one node, each attempt graded in a clean sandbox over its
checkpoint, its reward applied once per sample whatever the retries and
repeated calls; infrastructure failures recorded as such and retried; search
statistics, selection and frontier leases.

Same requirements as test_sandbox.py (its daemon fixture: root, busybox, the
built daemon; skipped without them, failed with ``CI=true``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Optional

import pytest

import layerstack
import layerstack.aio
from layerstack.fabric import Grader, NodeStats, RolloutResult, SampleKey, TaskFailed, fan_out, puct, uct
from conftest import DAEMON_BIN, _mounts_under, _terminate, _wait_for, bin_dir, record_reliability
from test_sandbox import Daemon, _rootfs, daemon, fsops  # noqa: F401 — the module's daemon and WASI fixtures

GRADER = Grader(["sh", "-c", "grep -q good /work/answer"], name="grep-good", version="1")


def _names(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{os.urandom(3).hex()}"


async def _step(ls: layerstack.aio.AsyncClient, run: str, node: str, n: int, **kw) -> List[RolloutResult]:  # type: ignore[no-untyped-def]
    async def act(r: layerstack.aio.AsyncRollout) -> None:
        i = r.key.sample
        out = await r.exec(["sh", "-c", f"mkdir -p /work && echo {'good' if i % 2 else 'bad'} > /work/answer"])
        assert out.ok, out

    return [res async for res in fan_out(ls, run, node, n, act, step=3, prompt="t1", policy="pi-3", **kw)]


def test_a_step_grades_each_sample_in_a_clean_sandbox_and_rewards_it_once(daemon: Daemon) -> None:  # noqa: F811
    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            assert (await ls.create_run(run, g.name)).name == run, "the same run again is the run"
            results = await _step(ls, run, g.root, 8, grader=GRADER)
            assert sorted(r.sample for r in results) == list(range(8))
            for r in results:
                assert r.status == "completed" and r.attempt is not None, r.errors
                want = 1.0 if r.sample % 2 else 0.0
                assert (r.reward, r.attempt.reward, r.attempt.applied) == (want, want, True), r
                assert r.attempt.evaluator == GRADER.evaluator()
                # Accepted results keep their checkpoint; rejected ones are pruned.
                node = await ls.show_node(r.attempt.result_node) if r.attempt.result_node else None
                if want:
                    assert node is not None and not node.pruned and node.parents == (g.root,), r
                else:
                    assert node is None or node.pruned, r
                assert r.grade_output is not None and r.grade_output.ok == bool(want)
                traj = json.loads(await ls.read_blob(r.attempt.trajectory or ""))
                assert traj[0]["argv"][0] == "sh" and traj[0]["exit_code"] == 0, traj
            # A rejected result's end again (its node pruned by the first):
            # the same end, answered as recorded.
            rejected = [r for r in results if not r.reward][0].attempt
            assert rejected is not None
            again_end = await ls.end_rollout(rejected.id, reward=0.0, accepted=False, evaluator=GRADER.evaluator(),
                                             backprop=0.0, keep="discard")
            assert (again_end.id, again_end.status, again_end.reward) == (rejected.id, "completed", 0.0)
            audit = await ls.audit_run(run)
            assert audit.violations == ()
            assert (audit.samples, audit.rewarded, audit.attempts, audit.completed, audit.backprops) == (8, 8, 8, 8, 8)
            root, kids = await ls.node_stats(g.root, children=True)
            assert (root.visits, root.value_sum) == (8, 4.0), root
            assert len(kids) == 4 and all(k.visits == 1 and k.value_sum == 1.0 for k in kids), kids
            # The step again (a harness restarted): nothing runs, rewards as recorded.
            again = await _step(ls, run, g.root, 8, grader=GRADER)
            assert all(r.rewarded_before for r in again), again
            assert {r.sample: r.reward for r in again} == {r.sample: r.reward for r in results}
            assert (await ls.audit_run(run)).attempts == 8, "a repeated step starts no attempt"

    asyncio.run(main())


def test_wasi_attempts_are_graded_and_rewarded_once(daemon: Daemon, fsops: Path) -> None:  # noqa: F811
    module = fsops.read_bytes()

    async def act(r: layerstack.aio.AsyncRollout) -> None:
        verdict = "good" if r.key.sample % 2 else "bad"
        out = await r.exec(["fsops", "write", "/work/answer", verdict + "\n"], module=module)
        assert out.ok and out.module_digest, out

    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab-wasi"), daemon.stack)
            run = (await ls.create_run(_names("run-wasi"), g.name)).name
            results = [
                res
                async for res in fan_out(
                    ls, run, g.root, 6, act, step=1, prompt="w", policy="pi-w", grader=GRADER,
                    sandbox={"executor": "wasi", "fuel": 10**9},
                )
            ]
            assert sorted(r.sample for r in results) == list(range(6))
            for r in results:
                # A WASI attempt's checkpoint, graded by a Linux evaluator in a
                # clean sandbox over it; its reward applied once.
                assert r.status == "completed" and r.attempt is not None, r.errors
                assert (r.reward, r.attempt.applied) == (1.0 if r.sample % 2 else 0.0, True), r
            audit = await ls.audit_run(run)
            assert audit.violations == () and (audit.rewarded, audit.attempts) == (6, 6), audit
            with pytest.raises(ValueError, match="pids"):
                await ls.begin_rollout(SampleKey(run, 2, "w", 0), 1, g.root, executor="wasi", pids=4)

    asyncio.run(main())


def test_infrastructure_failures_are_retried_and_never_scored_zero(daemon: Daemon) -> None:  # noqa: F811
    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            seen: List[int] = []

            async def act(r: layerstack.aio.AsyncRollout) -> float:
                seen.append(r.attempt.attempt if r.attempt else 0)
                if r.key.sample == 0 and r.attempt is not None and r.attempt.attempt == 1:
                    raise ConnectionError("worker lost")  # an infrastructure failure
                if r.key.sample == 1:
                    raise TaskFailed("the edit does not build")
                await r.exec("echo done > /work/out")
                return 0.5

            res = {x.sample: x async for x in fan_out(ls, run, g.root, 2, act, policy="pi")}
            assert (res[0].status, res[0].reward, res[0].attempt and res[0].attempt.attempt) == ("completed", 0.5, 2)
            assert (res[1].status, res[1].reward) == ("task_failed", None), res[1]
            attempts = [a async for a in ls.rollouts(run)]
            first = [a for a in attempts if a.key.sample == 0 and a.attempt == 1][0]
            assert (first.status, first.infra_kind, first.reward) == ("infra_failed", "ConnectionError", None)
            audit = await ls.audit_run(run)
            assert (audit.rewarded, audit.task_failed, audit.infra_failed, audit.violations) == (
                1, 1, {"ConnectionError": 1}, ()), audit
            assert (await ls.node_stats(g.root))[0].visits == 1, "task failures and infra failures backpropagate nothing"
            # The step again (a harness restarted): the failed task is as final
            # as the reward — nothing runs, no attempt is begun.
            seen.clear()
            again = {x.sample: x async for x in fan_out(ls, run, g.root, 2, act, policy="pi")}
            assert seen == [], f"a repeated step ran samples again: {seen}"
            assert (again[0].status, again[0].reward, again[0].rewarded_before) == ("completed", 0.5, True)
            assert (again[1].status, again[1].task_failed_before) == ("task_failed", True), again[1]
            s1 = await ls.sample(again[1].key)
            assert s1 is not None and (s1.task_failed_attempt, s1.reward) == (1, None), s1
            assert (await ls.audit_run(run)).attempts == 3, "a repeated step begins no attempt"

    asyncio.run(main())


_HARNESS = """
import asyncio, os, sys
import layerstack.aio
from layerstack.fabric import SampleKey

async def main():
    admin, run, node = sys.argv[1:4]
    async with layerstack.aio.connect(admin) as ls:
        r = await ls.begin_rollout(SampleKey(run, 0, "p", 0), 1, node, policy="pi")
        await r.exec(["sh", "-c", "echo built; echo warn >&2"])
        await r.exec(["sh", "-c", "exit 3"])
        print(r.id, r.sandbox.id, flush=True)
        # Killed here (SIGKILL from the test): the attempt is never ended.
        await asyncio.sleep(3600)

asyncio.run(main())
"""


def _seeing(probe: str) -> "dict[int, tuple[int, str]]":
    """Host processes whose root holds the file ``probe`` (an absolute path):
    pid → (parent pid, command name)."""
    seen = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if not os.path.exists(f"{p}/root{probe}"):
                continue
            ppid = [l for l in (p / "status").read_text().splitlines() if l.startswith("PPid:")]
            comm = (p / "comm").read_text().strip()
        except OSError:
            continue
        seen[int(p.name)] = (int(ppid[0].split()[1]), comm)
    return seen


def _init_of(probe: str) -> int:
    """The host pid of the init of the sandbox whose root holds ``probe``:
    the topmost process that sees it."""
    seen = _seeing(probe)
    tops = [pid for pid, (parent, _) in seen.items() if parent not in seen]
    assert len(tops) == 1, f"the processes that see {probe}: {seen}"
    return tops[0]


def test_a_crashed_harness_leaves_the_commands_it_ran_in_its_attempts_trajectory(daemon: Daemon) -> None:  # noqa: F811
    """The daemon records each command of an attempt's sandbox before it
    answers its exit: a harness killed mid-attempt (SIGKILL, nothing sent
    after) leaves an attempt whose trajectory holds them, whoever ends it —
    the next harness (no trajectory of its own) or an infrastructure
    failure (the sandbox's init killed, the attempt ended by the daemon)."""

    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            harness = subprocess.Popen(
                [os.environ.get("PYTHON", sys.executable), "-c", _HARNESS, daemon.admin, run, g.root],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            try:
                assert harness.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(harness.stdout.readline), 60)
                assert line, harness.stderr.read() if harness.stderr else b""
                attempt_id, session_id = (int(x) for x in line.split())
            finally:
                harness.kill()
                harness.wait()
            a = (await ls.sample(SampleKey(run, 0, "p", 0)))
            assert a is not None and a.running == (attempt_id,), a
            # The next harness takes the sample over: it ends the dead one's
            # attempt without a trajectory of its own.
            assert await ls.sample_attempts(SampleKey(run, 0, "p", 0)) == 1
            ended = [x async for x in ls.rollouts(run)][0]
            assert (ended.id, ended.status, ended.infra_kind) == (attempt_id, "infra_failed", "abandoned")
            traj = json.loads(await ls.read_blob(ended.trajectory or ""))
            assert [(t["argv"], t["exit_code"]) for t in traj] == [
                (["sh", "-c", "echo built; echo warn >&2"], 0), (["sh", "-c", "exit 3"], 3)], traj
            assert (traj[0]["stdout"], traj[0]["stderr"]) == ("built\n", "warn\n"), traj
            assert all(t["duration_ms"] >= 0 and not t["timed_out"] for t in traj), traj
            # An infrastructure failure: the sandbox's init killed under a
            # running attempt; the daemon ends it and keeps its commands.
            r = await ls.begin_rollout(SampleKey(run, 0, "p", 1), 1, g.root, policy="pi")
            assert (await r.exec(["sh", "-c", "echo before"])).ok
            probe = f"/init-probe-{os.urandom(4).hex()}"
            await r.files.write(probe, b"")
            # A caller that goes away mid-command: the command is killed at
            # once (it writes nothing that would tell), and recorded so.
            call = asyncio.ensure_future(r.exec(["sleep", "60"]))
            for _ in range(100):
                if any(comm == "sleep" for _, comm in _seeing(probe).values()):
                    break
                await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(100):
                if not any(comm == "sleep" for _, comm in _seeing(probe).values()):
                    break
                await asyncio.sleep(0.05)
            assert not any(comm == "sleep" for _, comm in _seeing(probe).values()), _seeing(probe)
            os.kill(_init_of(probe), signal.SIGKILL)
            for _ in range(100):
                await ls.audit_run(run)  # ends what infrastructure failures ended
                lost = [x async for x in ls.rollouts(run) if x.id == r.id][0]
                if lost.status != "running":
                    break
                await asyncio.sleep(0.1)
            assert lost.status == "infra_failed", lost
            traj = json.loads(await ls.read_blob(lost.trajectory or ""))
            assert [t["argv"] for t in traj] == [["sh", "-c", "echo before"], ["sleep", "60"]], traj
            assert traj[0]["stdout"] == "before\n" and traj[1]["exit_code"] is None, traj
            assert "went away" in traj[1]["error"], traj
            # A harness that sends a trajectory of its own: its end keeps it.
            r2 = await ls.begin_rollout(SampleKey(run, 0, "p", 2), 1, g.root, policy="pi")
            assert (await r2.exec("true")).ok
            # A checkpoint state that is no JSON is refused before the
            # sandbox is touched: the attempt runs on.
            with pytest.raises(layerstack.InvalidArgumentError, match="state"):
                await r2.end(reward=1.0, accepted=True, keep="checkpoint", state="not json")
            assert (await r2.exec("true")).ok
            # A state or labels with a discard would be dropped: refused,
            # the attempt runs on.
            with pytest.raises(layerstack.InvalidArgumentError, match="keep CHECKPOINT"):
                await r2.end(reward=1.0, keep="discard", state={"a": 1})
            with pytest.raises(layerstack.InvalidArgumentError, match="keep CHECKPOINT"):
                await r2.end(reward=1.0, keep="discard", labels={"k": "v"})
            assert (await r2.exec("true")).ok
            mine = await r2.end(reward=1.0, keep="discard", trajectory=b'[{"argv": ["mine"]}]')
            assert json.loads(await ls.read_blob(mine.trajectory or "")) == [{"argv": ["mine"]}]

    asyncio.run(main())


def test_an_attempt_ends_once_and_a_repeated_call_answers_it(daemon: Daemon) -> None:  # noqa: F811
    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            key = SampleKey(run, 0, "p", 0)
            r = await ls.begin_rollout(key, 1, g.root, policy="pi", seed=5)
            again = await ls.begin_rollout(key, 1, g.root, policy="pi", seed=5)
            assert r.created and not again.created and again.id == r.id
            assert again.sandbox is not None and r.sandbox is not None and again.sandbox.id == r.sandbox.id
            with pytest.raises(layerstack.FailedPreconditionError):
                await ls.begin_rollout(key, 1, g.root, policy="pi-other", seed=5)
            await r.files.write("/work/x", b"x\n")
            # Two identical ends at once (a retry after a timeout): one end,
            # both answered with it.
            end, twin = await asyncio.gather(
                ls.end_rollout(r.id, reward=0.9, backprop=0.9, state={"reward": 0.9}),
                ls.end_rollout(r.id, reward=0.9, backprop=0.9, state={"reward": 0.9}),
            )
            assert twin == end, (twin, end)
            assert (end.status, end.applied, end.backprop) == ("completed", True, 0.9)
            assert end.result_node is not None
            node = await ls.show_node(end.result_node)
            assert node.state == {"reward": 0.9} and node.parents == (g.root,)
            # The same end again: the recorded end, one effect.
            assert await ls.end_rollout(r.id, reward=0.9, backprop=0.9) == end
            with pytest.raises(layerstack.FailedPreconditionError):
                await ls.end_rollout(r.id, reward=0.1)
            with pytest.raises(layerstack.FailedPreconditionError, match="backprop 0.9"):
                await ls.end_rollout(r.id, reward=0.9, backprop=0.5)
            # A repeated end that would discard: refused, the kept node stays.
            with pytest.raises(layerstack.FailedPreconditionError, match="keeping node"):
                await ls.end_rollout(r.id, reward=0.9, backprop=0.9, keep="discard")
            assert not (await ls.show_node(end.result_node)).pruned
            with pytest.raises(layerstack.InvalidArgumentError):
                await ls.end_rollout(r.id, infra_failed="timeout", backprop=0.0)
            # Ended with its sandbox discarded: a repeat asking for the
            # checkpoint is refused (nothing could be kept now); the same
            # discard is answered.
            d = await ls.begin_rollout(SampleKey(run, 0, "p", 1), 1, g.root, policy="pi")
            await d.files.write("/work/y", b"y\n")
            dropped = await ls.end_rollout(d.id, task_failed=True, keep="discard")
            with pytest.raises(layerstack.FailedPreconditionError, match="keep DISCARD"):
                await ls.end_rollout(d.id, task_failed=True, state={"late": True})
            assert await ls.end_rollout(d.id, task_failed=True, keep="discard") == dropped
            assert dropped.result_node is None
            rewarded = await ls.begin_rollout(key, 2, g.root, policy="pi", seed=5)
            assert rewarded.rewarded and rewarded.sample is not None and rewarded.sample.reward == 0.9
            assert (await ls.node_stats(g.root))[0].visits == 1
            # The sandbox ended with the attempt: nothing stays live.
            with pytest.raises(layerstack.LayerStackError):
                await r.sandbox.exec("true")

    asyncio.run(main())


def test_leaving_a_fan_out_early_ends_its_attempts_and_caller_mistakes_are_raised(daemon: Daemon) -> None:  # noqa: F811
    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("fab"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            started = asyncio.Event()

            async def slow(r: layerstack.aio.AsyncRollout) -> float:
                if r.key.sample == 0:
                    return 1.0
                started.set()
                await r.exec(["sleep", "30"])
                return 0.0

            def live_sandboxes() -> set:
                with layerstack.connect(daemon.admin) as c:
                    return {x.id for x in c.list_sessions(all_namespaces=True, owner_kind="sandbox")
                            if not x.released}

            live_before = live_sandboxes()
            async for first in fan_out(ls, run, g.root, 4, slow, policy="pi", concurrency=4):
                await asyncio.wait_for(started.wait(), 30)
                assert first.sample == 0 and first.status == "completed", first
                break
            # The generator is closed when the loop is left: its attempts end.
            for _ in range(200):
                running = [a async for a in ls.rollouts(run) if a.status == "running"]
                if not running:
                    break
                await asyncio.sleep(0.05)
            attempts = [a async for a in ls.rollouts(run)]
            assert [a.status for a in attempts if a.status == "running"] == [], attempts
            cancelled = [a for a in attempts if a.status == "infra_failed"]
            assert cancelled and all(a.infra_kind == "cancelled" for a in cancelled), attempts
            live = live_sandboxes() - live_before
            assert live == set(), f"sandboxes left live by a fan-out left early: {live}"
            assert (await ls.audit_run(run)).violations == ()
            # Timed out at any point — begins in flight, acts running,
            # graders being made or running: nothing stays running or live.
            async def graded(r: layerstack.aio.AsyncRollout) -> None:
                await r.exec(["sh", "-c", "mkdir -p /work && echo good > /work/answer"])

            for n, timeout_s in enumerate((0.02, 0.1, 0.3, 0.6)):
                async def step(n: int = n) -> None:
                    async for _ in fan_out(ls, run, g.root, 6, graded, step=10 + n, policy="pi",
                                           grader=GRADER, concurrency=6):
                        pass

                try:
                    await asyncio.wait_for(step(), timeout_s)
                except asyncio.TimeoutError:
                    pass
            for _ in range(200):
                running = [a async for a in ls.rollouts(run) if a.status == "running"]
                live = live_sandboxes() - live_before
                if not running and not live:
                    break
                await asyncio.sleep(0.05)
            assert running == [] and live == set(), (running, live)
            assert (await ls.audit_run(run)).violations == ()
            # A wrong node, a non-number from act: raised, not yielded per sample.
            with pytest.raises(layerstack.NotFoundError):
                async for _ in fan_out(ls, run, "n0000000000000000", 3, slow, step=1, policy="pi"):
                    pass

            async def words(r: layerstack.aio.AsyncRollout) -> str:
                return "0.7"

            with pytest.raises(layerstack.fabric.HarnessError, match="act returned '0.7'"):
                async for _ in fan_out(ls, run, g.root, 1, words, step=2, policy="pi"):
                    pass
            ended = [a async for a in ls.rollouts(run, step=2)]
            assert [(a.status, a.infra_kind) for a in ended] == [("infra_failed", "harness-error")], ended
            # A grader that cannot be started is a broken evaluator: each
            # attempt ends infra_failed(grader-not-started), never a reward.
            broken = Grader(["/no/such/grader"], name="broken", version="1")

            async def quick(r: layerstack.aio.AsyncRollout) -> None:
                await r.exec("true")

            res = [x async for x in fan_out(ls, run, g.root, 1, quick, step=4, policy="pi", grader=broken,
                                            max_attempts=2)]
            assert [(x.status, x.reward) for x in res] == [("infra_failed", None)], res
            tried = [a async for a in ls.rollouts(run, step=4)]
            assert [(a.status, a.infra_kind, a.reward) for a in tried] == [
                ("infra_failed", "grader-not-started", None)] * 2, tried
            assert "could not be started" in tried[0].message, tried[0]
            # A reward function that raises is the harness's bug: raised.
            divides = Grader(["true"], name="div", version="1", reward=lambda out: (1 / 0, True))
            with pytest.raises(layerstack.fabric.HarnessError, match="ZeroDivisionError"):
                async for _ in fan_out(ls, run, g.root, 1, quick, step=5, policy="pi", grader=divides):
                    pass
            with pytest.raises(ValueError, match="max_attempts=0"):
                async for _ in fan_out(ls, run, g.root, 1, words, step=3, max_attempts=0):
                    pass

    asyncio.run(main())


def test_search_statistics_select_children_and_frontier_leases_hold_nodes(daemon: Daemon) -> None:  # noqa: F811
    async def main() -> None:
        async with layerstack.aio.connect(daemon.admin) as ls:
            g = await ls.create_graph(_names("mcts"), daemon.stack)
            run = (await ls.create_run(_names("run"), g.name)).name
            values = {0: 0.2, 1: 0.9, 2: 0.4}
            children = {}
            for i, v in values.items():
                r = await ls.begin_rollout(SampleKey(run, 0, "expand", i), 1, g.root)
                await r.exec(f"echo {i} > /work/move")
                end = await r.end(reward=v, backprop=v)
                children[i] = end.result_node
            root, kids = await ls.node_stats(g.root, children=True)
            assert root.visits == 3 and abs(root.value_sum - 1.5) < 1e-9
            assert uct(root, kids, c=0.0).node == children[1], "greedy UCT picks the best mean"
            await ls.set_prior(children[2], 0.99)
            await ls.set_prior(children[1], 0.0)
            _, kids = await ls.node_stats(g.root, children=True)
            assert puct(root, kids, c=100.0).node == children[2], "a strong prior dominates with a large c"
            with pytest.raises(ValueError):
                uct(NodeStats("x", 0, 0.0, None, ()), [])
            # Frontier leases keep a node from being pruned until released.
            assert await ls.lease_frontier("search-1", [children[0]]) == [children[0]]
            with pytest.raises(layerstack.FailedPreconditionError) as e:
                await ls.prune(children[0])
            assert "frontier of search-1" in str(e.value)
            assert await ls.release_frontier("search-1") == []
            assert children[0] in await ls.prune(children[0])
            graph = await ls.show_graph(g.name)
            assert {n.id for n in graph.nodes if n.pruned} == {children[0]}

    asyncio.run(main())


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class _Restartable:
    """A daemon of its own that the test kills with SIGKILL and starts again
    on the same store and sockets."""

    def __init__(self, d: "Path") -> None:
        self.d = d
        self.admin = d / "ls" / "admin.sock"
        self.p: "Optional[subprocess.Popen[bytes]]" = None

    def start(self) -> None:
        (self.d / "ls").mkdir(exist_ok=True)
        log = open(self.d / "daemon.log", "ab")
        self.p = subprocess.Popen(
            [
                str(bin_dir() / DAEMON_BIN),
                "--root", str(self.d / "store"),
                "--address", str(self.d / "ls" / "snap.sock"),
                "--admin-address", str(self.admin),
                "--containerd-address", str(self.d / "ls" / "containerd.sock"),  # none runs
                "--metrics-address", "127.0.0.1:0",
            ],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
        p = self.p
        _wait_for(DAEMON_BIN, lambda: self.admin.exists() and p.poll() is None, 30, self.d / "daemon.log")

    def kill_inits(self, n: int) -> int:
        """SIGKILLs ``n`` of the daemon's children (sandbox inits) at random;
        returns how many it killed."""
        assert self.p is not None
        kids: List[int] = []
        for t in Path(f"/proc/{self.p.pid}/task").iterdir():
            try:
                kids += [int(x) for x in (t / "children").read_text().split()]
            except OSError:
                pass
        # Not the daemon's process spawner: its death is the daemon's (it is
        # replaced, a create caught in between fails), not a sandbox's.
        kids = [k for k in kids if _comm(k) != "ls-spawner"]
        killed = 0
        for pid in random.sample(kids, min(n, len(kids))):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        return killed

    def kill9(self) -> None:
        assert self.p is not None
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()
        self.admin.unlink(missing_ok=True)


def test_exactly_once_through_daemon_kills_mid_step(daemon: Daemon) -> None:  # noqa: F811
    """A step of graded samples (24; ``LAYERSTACK_EXACTLY_ONCE_SAMPLES``, the
    full run 1,024) while the daemon is killed with SIGKILL three times and
    random sandbox inits are killed between: every sample ends with one reward
    (the right one) and one backpropagation, every attempt a kill ended is
    infra_failed, the audit finds no violation, nothing stays mounted and no
    rollout sandbox stays unreleased. Then the client repeats its calls with
    the same keys (the whole step again, an EndRollout again): nothing runs
    twice, nothing is applied twice. A frontier leased mid-step survives the
    kills and a prune."""
    n = int(os.environ.get("LAYERSTACK_EXACTLY_ONCE_SAMPLES", "24"))
    d = Path(tempfile.mkdtemp(prefix="lst-py-crash-", dir=os.environ.get("LAYERSTACK_TEST_TMP", "/var/tmp")))
    srv = _Restartable(d)
    srv.start()
    try:
        with layerstack.connect(srv.admin) as c:
            stack = c.import_base(_rootfs(d / "rootfs"))

        async def main() -> None:
            async with layerstack.aio.connect(srv.admin) as ls:
                g = await ls.create_graph("crash", stack)
                run = (await ls.create_run("crash-run", g.name)).name

                async def act(r: layerstack.aio.AsyncRollout) -> None:
                    i = r.key.sample
                    out = await r.exec(["sh", "-c", f"sleep 0.3; echo {'good' if i % 2 else 'bad'} > /work/answer"])
                    if not out.ok:  # its init was killed under it
                        raise ConnectionError(f"sandbox lost: {out}")

                inits_killed = 0
                daemon_kills = 0
                results: List[Any] = []
                frontier: List[str] = []

                async def killer() -> None:
                    # Three kills spread over the first half of the step: at
                    # the start, then a quarter and a half of the samples done
                    # (each at least 1 s after the last), random sandbox inits
                    # killed before each — so each kill finds attempts running.
                    nonlocal inits_killed, daemon_kills
                    for k in range(3):
                        while len(results) < k * n // 4:
                            await asyncio.sleep(0.05)
                        await asyncio.sleep(0.5)
                        inits_killed += srv.kill_inits(2)
                        if k == 1:
                            # A search leases some nodes the step made.
                            kept = [x.attempt.result_node for x in results
                                    if x.attempt is not None and x.attempt.result_node][:2]
                            frontier.extend(await ls.lease_frontier("search-1", kept))
                        await asyncio.sleep(0.5)
                        srv.kill9()
                        daemon_kills += 1
                        await asyncio.sleep(0.3)
                        await asyncio.get_running_loop().run_in_executor(None, srv.start)

                k = asyncio.ensure_future(killer())
                async for x in fan_out(ls, run, g.root, n, act, policy="pi", grader=GRADER,
                                       max_attempts=12, concurrency=8 if n <= 64 else 32):
                    results.append(x)
                await k
                for x in results:
                    want = 1.0 if x.sample % 2 else 0.0
                    assert (x.status, x.reward) == ("completed", want), (
                        x.sample, x.errors, x.attempt, x.grade_output)
                audit = await ls.audit_run(run)
                assert audit.violations == (), audit
                assert (audit.samples, audit.rewarded, audit.running) == (n, n, 0), audit
                assert inits_killed >= 1, "no sandbox init was there to kill"
                assert sum(audit.infra_failed.values()) >= 3, f"three kills mid-step ended no attempt: {audit}"
                # The daemon's own kinds, and what the harness saw (an error's
                # kind, an exception's class) — each named, none a reward.
                assert "daemon-restart" in audit.infra_failed and all(audit.infra_failed), audit
                attempts = [a async for a in ls.rollouts(run)]
                applied = [a for a in attempts if a.applied]
                assert len(applied) == n and len({a.key for a in applied}) == n
                assert all(a.reward is None for a in attempts if a.status == "infra_failed")
                # One backpropagation per rewarded sample: the root's visits and
                # value are the applied rewards', counted once.
                assert audit.backprops == n, audit
                root, _ = await ls.node_stats(g.root)
                assert (root.visits, root.value_sum) == (n, float(n // 2)), root

                # The client repeats its calls with the same keys: the whole
                # step (nothing runs: each sample answers its recorded reward)
                # and one attempt's end (its recorded end comes back).
                again = [x async for x in fan_out(ls, run, g.root, n, act, policy="pi", grader=GRADER,
                                                  max_attempts=12, concurrency=32)]
                assert sorted((x.sample, x.status, x.reward) for x in again) == sorted(
                    (x.sample, x.status, x.reward) for x in results)
                one = applied[0]
                replay = await ls.end_rollout(
                    one.id, reward=one.reward, accepted=bool(one.accepted), evaluator=GRADER.evaluator(),
                    backprop=one.backprop, keep="checkpoint" if one.accepted else "discard")
                assert (replay.status, replay.reward, replay.applied) == (one.status, one.reward, True), replay
                with pytest.raises(layerstack.FailedPreconditionError, match="ended already"):
                    await ls.end_rollout(one.id, reward=0.5)
                after = await ls.audit_run(run)
                assert (after.attempts, after.rewarded, after.backprops, after.violations) == (
                    audit.attempts, n, n, ()), after
                root2, _ = await ls.node_stats(g.root)
                assert (root2.visits, root2.value_sum) == (root.visits, root.value_sum), root2

                # The frontier leased mid-step survived the kills: still held,
                # and a prune of a leased node is refused.
                assert len(frontier) == 2, frontier
                for node in frontier:
                    st, _ = await ls.node_stats(node)
                    assert st.frontier == ("search-1",), st
                with pytest.raises(layerstack.LayerStackError):
                    await ls.prune(frontier[0])
                assert sorted(await ls.release_frontier("search-1")) == []
                # Every rollout sandbox was released.
                with layerstack.connect(srv.admin) as c:
                    live = [s for s in c.list_sessions(all_namespaces=True, owner_kind="sandbox")
                            if s.owner.startswith("sandbox:rollout-") and not s.released]
                    assert live == [], live
                    # The store agrees with its filesystem after all of it.
                    report = c.fsck()
                    assert report.unrepaired == 0 and report.runs >= 1 and report.paths > 0, report.problems
                    assert report.outcomes >= n, report
                record_reliability(
                    "exactly-once",
                    "A sample's reward is applied exactly once, with one backpropagation, through daemon SIGKILLs and "
                    "sandbox-init kills mid-step and the client repeating its calls with the same keys; infrastructure "
                    "failures end attempts infra_failed, never as a reward; a frontier leased mid-step survives",
                    "LAYERSTACK_BIN_DIR=$PWD/target/debug python3 -m pytest clients/python/tests/test_fabric.py -k exactly_once",
                    {
                        "samples": audit.samples,
                        "daemon SIGKILLs": daemon_kills,
                        "sandbox inits killed": inits_killed,
                        "attempts": len(attempts),
                        "infra_failed attempts": sum(audit.infra_failed.values()),
                        "rewards applied": len(applied),
                        "backpropagations": audit.backprops,
                        "repeated calls that ran or applied anything": (after.attempts - audit.attempts)
                        + (after.backprops - audit.backprops) + (root2.visits - root.visits),
                        "frontier nodes kept": len(frontier),
                        "audit violations": len(audit.violations),
                    },
                )

        asyncio.run(main())
        left = [m for m in _mounts_under(d) if "/s/" in m]
        assert left == [], f"session mounts left: {left}"
    finally:
        if srv.p is not None and srv.p.poll() is None:
            _terminate(srv.p)
        for m in _mounts_under(d):
            subprocess.run(["umount", "-l", m], capture_output=True)
        if os.environ.get("LAYERSTACK_TEST_KEEP") != "1":
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], capture_output=True)
