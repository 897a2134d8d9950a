#!/usr/bin/env python3
"""Monte Carlo tree search over a sliding puzzle whose state is the
filesystem, on the rollout fabric (issue 21).

The puzzle: ``/work/puzzle/board`` holds a ``--width`` × ``--height`` board as
one line of numbers, ``0`` the blank (the goal: ``1 2 … 0``);
``/work/puzzle/move.sh U|D|L|R`` moves the blank inside the sandbox (busybox
``sh``), rewriting the board and appending the move to
``/work/puzzle/moves``. The start is the goal scrambled by ``--scramble``
random moves (``--seed``). Every search node is a graph node: a checkpoint of
the filesystem after a move.

Each iteration:

1. **select** — from the start node, while every useful move of a node has
   been expanded, descend to the child :func:`layerstack.fabric.uct` (or
   ``--select puct``, with the heuristic as each child's prior, ``SetPrior``)
   picks over ``GetNodeStats(children=True)``: the statistics live in the
   daemon, beside the immutable nodes;
2. **expand** — lease the node as frontier (``LeaseFrontier``: neither GC nor
   a prune frees it while this search holds it), then ``BeginRollout`` on it
   (a sandbox on that node: the rollback to an arbitrary earlier state), run
   ``move.sh`` with an untried move, read the board back;
3. **evaluate** — a heuristic value, ``1 / (1 + Manhattan distance to the
   goal)`` (1 when solved);
4. **backpropagate** — ``EndRollout`` with that reward, ``backprop`` = the
   value and ``keep=CHECKPOINT``: the child node, its reward and the visits
   and value sums of every ancestor are one transaction, once per attempt.

A move into a board the tree already holds is not expanded (a transposition);
a node left with no useful move and no live child is a dead end: its lease is
released and its subtree pruned (``Prune``: its layers freed). The search
stops when a board equals the goal; every lease of the search is released at
the end. The solution is checked in a fresh sandbox on the solution node.
Prints a summary table (iterations, nodes, depth of the solution, visits at
the start node, …) and writes the graph picture (``--dot``).

    sudo python3 mcts_puzzle.py /run/layerstack/admin.sock --scramble 10 --dot mcts.dot

:func:`main` returns the summary as a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import layerstack
import layerstack.aio
from layerstack.fabric import NodeStats, SampleKey, puct, uct

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step import graph_picture, import_busybox  # noqa: E402 — the example beside this one

DIR = "/work/puzzle"
MOVES = ("U", "D", "L", "R")
REVERSE = {"U": "D", "D": "U", "L": "R", "R": "L"}

MOVE_SH = f"""\
# move.sh DIR: moves the blank (0) of {DIR}/board up, down, left or right.
set -e
W=$(cat {DIR}/width); H=$(cat {DIR}/height)
set -- $1 $(cat {DIR}/board)
dir=$1; shift
i=0; for t in "$@"; do [ "$t" = 0 ] && b=$i; i=$((i + 1)); done
r=$((b / W)); c=$((b % W))
case $dir in
    U) [ $r -gt 0 ] || {{ echo "cannot move U from row $r" >&2; exit 3; }}; s=$((b - W)) ;;
    D) [ $r -lt $((H - 1)) ] || {{ echo "cannot move D from row $r" >&2; exit 3; }}; s=$((b + W)) ;;
    L) [ $c -gt 0 ] || {{ echo "cannot move L from column $c" >&2; exit 3; }}; s=$((b - 1)) ;;
    R) [ $c -lt $((W - 1)) ] || {{ echo "cannot move R from column $c" >&2; exit 3; }}; s=$((b + 1)) ;;
    *) echo "move $dir: use U, D, L or R" >&2; exit 4 ;;
esac
i=0; for t in "$@"; do [ $i = $s ] && tile=$t; i=$((i + 1)); done
out=""; i=0
for t in "$@"; do
    if [ $i = $b ]; then v=$tile; elif [ $i = $s ]; then v=0; else v=$t; fi
    out="$out $v"; i=$((i + 1))
done
echo $out > {DIR}/board
echo $dir >> {DIR}/moves
"""

Board = Tuple[int, ...]


@dataclass(frozen=True)
class Puzzle:
    """The rules, for move generation and the heuristic (the moves themselves
    run in the sandboxes)."""

    width: int
    height: int

    @property
    def goal(self) -> Board:
        n = self.width * self.height
        return tuple(list(range(1, n)) + [0])

    def apply(self, b: Board, m: str) -> Optional[Board]:
        """The board after move ``m``, ``None`` when it leaves the board."""
        i = b.index(0)
        r, c = divmod(i, self.width)
        if m == "U" and r > 0:
            s = i - self.width
        elif m == "D" and r < self.height - 1:
            s = i + self.width
        elif m == "L" and c > 0:
            s = i - 1
        elif m == "R" and c < self.width - 1:
            s = i + 1
        else:
            return None
        x = list(b)
        x[i], x[s] = x[s], 0
        return tuple(x)

    def distance(self, b: Board) -> int:
        """Sum of the tiles' Manhattan distances to their goal places."""
        d = 0
        for i, t in enumerate(b):
            if t:
                g = t - 1
                d += abs(i // self.width - g // self.width) + abs(i % self.width - g % self.width)
        return d

    def value(self, b: Board) -> float:
        """The heuristic value in (0, 1]: 1 / (1 + distance)."""
        return 1.0 / (1.0 + self.distance(b))

    def scramble(self, moves: int, seed: int) -> Board:
        """The goal after ``moves`` random moves (never back to a board seen)."""
        rng = random.Random(seed)
        b = self.goal
        seen = {b}
        for _ in range(moves):
            opts = [x for x in (self.apply(b, m) for m in MOVES) if x is not None and x not in seen]
            if not opts:
                break
            b = rng.choice(opts)
            seen.add(b)
        return b


def fmt(b: Board) -> str:
    return " ".join(map(str, b))


@dataclass
class TreeNode:
    """What the search keeps of a node (its board: the node's state, also in
    the node's ``state`` JSON; the statistics stay in the daemon)."""

    id: str
    board: Board
    depth: int
    move: str
    parent: Optional[str]
    tried: Set[str] = field(default_factory=set)
    children: List[str] = field(default_factory=list)


class Search:
    def __init__(self, ls: "layerstack.aio.AsyncClient", admin: str, run: str, puzzle: Puzzle,
                 select: str, c: float, holder: str) -> None:
        self.ls, self.admin, self.run, self.p = ls, admin, run, puzzle
        self.select_fn = puct if select == "puct" else uct
        self.c, self.holder = c, holder
        self.nodes: Dict[str, TreeNode] = {}
        self.seen: Dict[Board, str] = {}
        self.dead: Set[str] = set()
        self.leased: Set[str] = set()
        self.pruned: Set[str] = set()
        self.rollback_ms: List[float] = []
        self.iterations = 0

    def untried(self, n: TreeNode) -> List[str]:
        """Moves of ``n`` not expanded yet that lead to a board the tree lacks."""
        out = []
        for m in MOVES:
            if m in n.tried:
                continue
            b = self.p.apply(n.board, m)
            if b is not None and b not in self.seen:
                out.append(m)
        return out

    def live_children(self, n: TreeNode) -> List[str]:
        return [c for c in n.children if c not in self.dead]

    async def select(self, root: str) -> Optional[TreeNode]:
        """The node to expand, ``None`` when the whole tree is dead."""
        n = self.nodes[root]
        while True:
            if self.untried(n):
                return n
            kids = self.live_children(n)
            if not kids:
                if n.id == root:
                    return None
                await self.kill(n)
                n = self.nodes[root]  # select again from the top
                continue
            stats, children = await self.ls.node_stats(n.id, children=True)
            alive = set(kids)
            choices: List[NodeStats] = [s for s in children if s.node in alive]
            n = self.nodes[self.select_fn(stats, choices, c=self.c).node]

    async def kill(self, n: TreeNode) -> None:
        """Marks ``n`` a dead end, releases its lease and prunes its subtree;
        its parent may die with it."""
        self.dead.add(n.id)
        if n.id in self.leased:
            await self.ls.release_frontier(self.holder, [n.id])
            self.leased.discard(n.id)
        with layerstack.connect(self.admin) as c:
            self.pruned.update(c.prune(n.id, key=f"prune:{self.run}:{n.id}"))
        parent = self.nodes.get(n.parent or "")
        if parent is not None and parent.parent is not None and not self.untried(parent) \
                and not self.live_children(parent):
            await self.kill(parent)

    async def expand(self, n: TreeNode) -> TreeNode:
        """One move from ``n`` in a sandbox on it; the child node, evaluated
        and backpropagated by its EndRollout."""
        if n.id not in self.leased:
            await self.ls.lease_frontier(self.holder, [n.id])
            self.leased.add(n.id)
        m = self.untried(n)[0]
        n.tried.add(m)
        want = self.p.apply(n.board, m)
        assert want is not None
        key = SampleKey(self.run, 0, "expand", self.iterations)
        t0 = time.perf_counter()
        r = await self.ls.begin_rollout(key, 1, n.id, policy=f"mcts-{self.select_fn.__name__}")
        out = await r.exec(["sh", f"{DIR}/move.sh", m])
        self.rollback_ms.append((time.perf_counter() - t0) * 1e3)
        if not out.ok:
            await r.end(task_failed=True, message=out.stderr.decode(errors="replace"), keep="discard")
            raise RuntimeError(f"move {m} on node {n.id} failed: exit {out.exit_code}: {out.stderr!r}")
        board = tuple(int(x) for x in (await r.files.read_text(f"{DIR}/board")).split())
        if board != want:
            await r.end(task_failed=True, message="unexpected board", keep="discard")
            raise RuntimeError(f"move {m} on {fmt(n.board)} gave {fmt(board)}, the rules say {fmt(want)}")
        v = self.p.value(board)
        end = await r.end(reward=v, accepted=board == self.p.goal, backprop=v, keep="checkpoint",
                          state={"board": fmt(board), "move": m, "depth": n.depth + 1})
        assert end.result_node is not None, end
        child = TreeNode(end.result_node, board, n.depth + 1, m, n.id)
        self.nodes[child.id] = child
        self.seen[board] = child.id
        n.children.append(child.id)
        if self.select_fn is puct:
            await self.ls.set_prior(child.id, v)
        if not self.untried(n) and n.id in self.leased:
            await self.ls.release_frontier(self.holder, [n.id])  # fully expanded
            self.leased.discard(n.id)
        if board != self.p.goal and not self.untried(child):
            await self.kill(child)  # a dead end as soon as it is made
        return child

    async def solve(self, root: TreeNode, max_iterations: int) -> Optional[TreeNode]:
        self.nodes[root.id] = root
        self.seen[root.board] = root.id
        if root.board == self.p.goal:
            return root
        while self.iterations < max_iterations:
            n = await self.select(root.id)
            if n is None:
                return None
            child = await self.expand(n)
            self.iterations += 1
            if child.board == self.p.goal:
                return child
        return None


async def setup(ls: "layerstack.aio.AsyncClient", stack: str, name: str, p: Puzzle, start: Board) -> "tuple[str, str]":
    """Graph ``name`` over ``stack`` and the start node: the puzzle's files
    written by a first sandbox, checkpointed. (graph, start node)."""
    g = await ls.create_graph(name, stack, key=f"graph:{name}")
    async with ls.sandbox(node=g.root, name=f"{name}-setup", key=f"setup:{name}") as sb:
        if sb.ended:
            assert sb.outcome is not None and sb.outcome.node
            return g.name, sb.outcome.node
        for f, text in (("board", fmt(start) + "\n"), ("width", f"{p.width}\n"), ("height", f"{p.height}\n"),
                        ("moves", ""), ("move.sh", MOVE_SH)):
            await sb.files.write(f"{DIR}/{f}", text.encode())
        end = await sb.close(checkpoint=True, state={"board": fmt(start), "move": "", "depth": 0})
    assert end.node
    return g.name, end.node


async def search(admin: str, *, puzzle: Puzzle, scramble: int, seed: int, select: str, c: float,
                 max_iterations: int, stack: Optional[str], name: str) -> Dict[str, Any]:
    start = puzzle.scramble(scramble, seed)
    with layerstack.connect(admin) as sync:
        base = stack or import_busybox(sync)
    holder = f"mcts:{name}"
    async with layerstack.aio.connect(admin) as ls:
        graph, start_node = await setup(ls, base, name, puzzle, start)
        run = (await ls.create_run(name, graph, labels={"demo": "mcts_puzzle"})).name
        s = Search(ls, admin, run, puzzle, select, c, holder)
        t0 = time.perf_counter()
        try:
            solution = await s.solve(TreeNode(start_node, start, 0, "", None), max_iterations)
        finally:
            await ls.release_frontier(holder)  # every lease of this search
        wall_s = time.perf_counter() - t0
        root_stats, _ = await ls.node_stats(start_node, children=True)
        moves: List[str] = []
        verified = None
        if solution is not None:
            n: Optional[TreeNode] = solution
            while n is not None and n.parent is not None:
                moves.append(n.move)
                n = s.nodes[n.parent]
            moves.reverse()
            # The solution node's filesystem, in a fresh sandbox.
            async with ls.sandbox(node=solution.id, name=f"{name}-check") as sb:
                board = (await sb.files.read_text(f"{DIR}/board")).split()
                log = (await sb.files.read_text(f"{DIR}/moves")).split()
                verified = [int(x) for x in board] == list(puzzle.goal) and log == moves
        audit = await ls.audit_run(run)
        leases = root_stats.frontier
    with layerstack.connect(admin) as sync:
        dot = graph_picture(sync, graph)
    return {
        "graph": graph,
        "run": run,
        "start": fmt(start),
        "goal": fmt(puzzle.goal),
        "solved": solution is not None,
        "verified": verified,
        "iterations": s.iterations,
        "nodes": len(s.nodes),
        "dead_ends": len(s.dead),
        "pruned": len(s.pruned),
        "pruned_nodes": sorted(s.pruned),
        "solution_depth": solution.depth if solution is not None else None,
        "solution_moves": moves,
        "root_visits": root_stats.visits,
        "root_mean": root_stats.mean,
        "frontier_left": list(leases),
        "rollback_ms_median": statistics.median(s.rollback_ms) if s.rollback_ms else None,
        "wall_s": wall_s,
        "audit_violations": list(audit.violations),
        "attempts": audit.attempts,
        "backprops": audit.backprops,
        "dot": dot,
    }


def table(s: Dict[str, Any]) -> str:
    rows = [
        ("start → goal", f"{s['start']} → {s['goal']}"),
        ("solved (checked in a fresh sandbox)", f"{s['solved']} ({s['verified']})"),
        ("iterations (expansions)", s["iterations"]),
        ("nodes in the tree", s["nodes"]),
        ("dead ends / nodes pruned", f"{s['dead_ends']} / {s['pruned']}"),
        ("depth of the solution", s["solution_depth"]),
        ("solution", " ".join(s["solution_moves"]) or "–"),
        ("visits at the start node", f"{s['root_visits']} (mean value {s['root_mean']:.3f})"),
        ("attempts / backpropagations", f"{s['attempts']} / {s['backprops']}"),
        ("audit violations", len(s["audit_violations"])),
        ("frontier leases left", len(s["frontier_left"])),
        ("rollback (BeginRollout → move answered), median",
         "–" if s["rollback_ms_median"] is None else f"{s['rollback_ms_median']:.2f} ms"),
        ("wall time", f"{s['wall_s']:.2f} s"),
    ]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs the search; prints the summary table; returns the summary (keys:
    solved, verified, iterations, nodes, dead_ends, pruned, pruned_nodes, solution_depth,
    solution_moves, root_visits, frontier_left, rollback_ms_median, wall_s,
    audit_violations, attempts, backprops, graph, run, dot_path, dot)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("admin", help="the daemon's admin socket")
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--height", type=int, default=3)
    ap.add_argument("--scramble", type=int, default=8, help="random moves from the goal (default 8)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--select", choices=("uct", "puct"), default="uct")
    ap.add_argument("--c", type=float, default=0.5, help="exploration constant (default 0.5)")
    ap.add_argument("--max-iterations", type=int, default=2000)
    ap.add_argument("--stack", default=None, help="an existing stack with busybox applets (default: import one)")
    ap.add_argument("--name", default=None, help="graph and run name (default mcts-<time>-<pid>-<random>)")
    ap.add_argument("--dot", default="mcts_puzzle.dot", help="write the graph picture here")
    a = ap.parse_args(argv)
    if a.width < 2 or a.height < 2:
        ap.error("--width and --height must be at least 2")
    name = a.name or f"mcts-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
    s = asyncio.run(search(a.admin, puzzle=Puzzle(a.width, a.height), scramble=a.scramble, seed=a.seed,
                           select=a.select, c=a.c, max_iterations=a.max_iterations, stack=a.stack, name=name))
    Path(a.dot).write_text(s["dot"])
    s["dot_path"] = str(Path(a.dot).resolve())
    print(table(s))
    print(f"graph picture: {a.dot} (render: dot -Tsvg {a.dot} > mcts.svg)")
    return s


if __name__ == "__main__":
    sys.exit(0 if main()["verified"] else 1)
