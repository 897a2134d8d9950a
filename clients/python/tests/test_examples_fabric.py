"""The rollout fabric's demos (issue 21) run small against a real daemon:
examples/rl_step.py (an RL step of graded rollouts of a repository task) and
examples/mcts_puzzle.py (MCTS over a sliding puzzle whose state is the
filesystem). Each example's ``main(argv)`` returns its summary, asserted here.

Same requirements as test_sandbox.py (its daemon fixture: root, busybox, the
built daemon; skipped without them, failed with ``CI=true``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import layerstack
from conftest import REPO
from test_sandbox import Daemon, daemon  # noqa: F401 — the module's daemon fixture

sys.path.insert(0, str(REPO / "clients" / "python" / "examples"))

import mcts_puzzle  # noqa: E402
import rl_step  # noqa: E402


def test_rl_step_grades_every_rollout_and_rewards_each_sample_once(daemon: Daemon, tmp_path: Path) -> None:  # noqa: F811
    dot = tmp_path / "rl.dot"
    n = 16
    s = rl_step.main([str(daemon.admin), "--n", str(n), "--concurrency", "8", "--name", "rl-test",
                      "--store", str(daemon.dir / "store"), "--dot", str(dot)])
    # Two samples per scripted edit: 3 edits fix the bug, 3 miss it, 2 break the build.
    assert s["samples"] == n and s["errors"] == [], s["errors"]
    assert s["status"] == {"completed": 12, "task_failed": 4}, s["status"]
    assert (s["rewarded"], s["accepted"]) == (12, 6)
    # Rewards are the checks passed / 4: fixes 1.0, swapped operands 0.5, the special case 0.75, a comment 0.5.
    assert abs(s["mean_reward"] - (6 * 1.0 + 2 * 0.5 + 2 * 0.75 + 2 * 0.5) / 12) < 1e-9, s["mean_reward"]
    for c in rl_step.CANDIDATES:
        got = s["by_candidate"][c.name]
        want = {"accepted": {"accepted": 2}, "rejected": {"completed": 2}, "task_failed": {"task_failed": 2}}
        assert got == want[c.outcome], (c.name, got)
    a = s["audit"]
    # A grading whose output was lost (the daemon answered an exec's exit with no stdout: seen
    # under load) is an infrastructure failure, retried — never a zero.
    lost = sum(a["infra_failed"].values())
    assert set(a["infra_failed"]) <= {"grader-output-lost"}, a
    assert (a["samples"], a["rewarded"], a["attempts"], a["task_failed"], a["running"], a["backprops"]) == (
        16, 12, 16 + lost, 4, 0, 12), a
    assert a["violations"] == [], a
    assert s["kept_nodes"] == 6 and s["kept_private_bytes"] > 0
    assert s["store_bytes_added"] is not None and s["store_bytes_added"] > 0
    text = dot.read_text()
    assert text.startswith("digraph") and text.count("->") >= 1 + n - 4, text[:500]
    # The accepted checkpoints hold the fix: a fresh sandbox on one passes the tests.
    with layerstack.connect(daemon.admin) as c:
        g = c.show_graph(s["graph"])
        kept = [x for x in g.nodes if x.parents == (s["task_node"],) and not x.pruned]
        with c.sandbox(node=kept[0].id) as sb:
            out = sb.exec(["sh", "-c", "sh /work/proj/build.sh && sh /work/proj/test.sh"])
            assert out.ok and b"passed 4/4" in out.stdout, out
    # The step again under the same name: every sample answers as recorded and runs nothing — a
    # rewarded one its reward, a task_failed one its failure (as final as a reward).
    again = rl_step.main([str(daemon.admin), "--n", str(n), "--name", "rl-test", "--stack", s["stack"],
                          "--dot", str(dot)])
    assert again["status"] == {"completed": 12, "task_failed": 4}, again["status"]
    assert again["mean_reward"] == s["mean_reward"]
    a = again["audit"]
    lost = sum(a["infra_failed"].values())
    assert (a["rewarded"], a["attempts"], a["completed"], a["task_failed"], a["backprops"]) == (
        12, 16 + lost, 12, 4, 12), a
    assert a["violations"] == []


def test_mcts_solves_a_filesystem_puzzle_through_the_graph(daemon: Daemon, tmp_path: Path) -> None:  # noqa: F811
    dot = tmp_path / "mcts.dot"
    for select in ("uct", "puct"):
        s = mcts_puzzle.main([str(daemon.admin), "--width", "3", "--height", "2", "--scramble", "4",
                              "--seed", "3", "--select", select, "--dot", str(dot)])
        assert s["solved"] and s["verified"], s
        assert 1 <= s["solution_depth"] <= 4 and len(s["solution_moves"]) == s["solution_depth"]
        # Every expansion is one attempt and one backpropagation through the start node.
        assert s["iterations"] >= s["solution_depth"]
        assert s["attempts"] == s["backprops"] == s["iterations"] == s["root_visits"], s
        assert s["nodes"] == s["iterations"] + 1
        assert s["audit_violations"] == [] and s["frontier_left"] == [], s
        assert s["rollback_ms_median"] is not None and s["rollback_ms_median"] > 0
        assert dot.read_text().startswith("digraph")


def test_mcts_prunes_dead_ends_and_releases_their_leases(daemon: Daemon, tmp_path: Path) -> None:  # noqa: F811
    """On a 3×2 board scrambled by 8 moves the search runs into
    transpositions: nodes left with no new move are dead ends, pruned (their
    leases released first — a prune refuses a leased node)."""
    s = mcts_puzzle.main([str(daemon.admin), "--width", "3", "--height", "2", "--scramble", "8",
                          "--seed", "1", "--c", "1.0", "--dot", str(tmp_path / "m.dot")])
    assert s["solved"] and s["verified"], s
    assert s["dead_ends"] >= 1 and s["pruned"] >= s["dead_ends"], s
    assert s["frontier_left"] == [] and s["audit_violations"] == []
    with layerstack.connect(daemon.admin) as c:
        g = c.show_graph(s["graph"])
        pruned = {n.id for n in g.nodes if n.pruned}
    assert set(s["pruned_nodes"]) <= pruned, (s["pruned_nodes"], pruned)
