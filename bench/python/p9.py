#!/usr/bin/env python3
"""P9's driver (bench/src/scenarios/p9_fabric.rs): the rollout fabric's RL step
and its latencies, from Python over the admin API.

1. The step: ``clients/python/examples/rl_step.py``'s :func:`step` — ``--n``
   rollouts of its repository task (fork by ``BeginRollout``, 5 execs and a
   write, the grade in a clean sandbox over the attempt's checkpoint, the
   reward), ``--concurrency`` at once, on a busybox base imported with
   ``ImportBase``; its wall time, the store's allocated bytes added (``du`` of
   ``--store``) and the daemon's VmRSS sampled every 50 ms (``--daemon-pid``).
2. Rollback to a node: ``--probes`` times (after 3 untimed), sequentially,
   ``BeginRollout`` on one of the step's kept nodes (a new sample of a run of
   its own) and ``exec ["true"]`` in its sandbox — the time from the call to
   the exec's answer, split into the begin and the exec; each attempt then
   ends (reward 0, discard; nothing backpropagated).
3. Grading session start: ``--probes`` times, a sandbox on a kept node
   (``CreateSession``, what the grader of :func:`layerstack.fabric.fan_out`
   starts) — the time to its answer; then the grader's command (the
   project's build and tests) and the discard, timed apart.

Prints one JSON line on stdout (ms and bytes, raw samples included); errors
on stderr with a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "clients" / "python" / "examples"))

import layerstack  # noqa: E402
import layerstack.aio  # noqa: E402
from layerstack.fabric import SampleKey  # noqa: E402

import rl_step  # noqa: E402


def ms(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


async def probes(admin: str, graph: str, nodes: List[str], n: int, run: str) -> Dict[str, Any]:
    warm = 3
    out: Dict[str, List[float]] = {"begin_ms": [], "first_exec_ms": [], "rollback_ms": [],
                                   "grade_start_ms": [], "grade_command_ms": [], "grade_discard_ms": []}
    async with layerstack.aio.connect(admin) as ls:
        await ls.create_run(run, graph)
        for i in range(warm + n):
            node = nodes[i % len(nodes)]
            t0 = time.perf_counter()
            r = await ls.begin_rollout(SampleKey(run, 0, "rollback", i), 1, node, policy="p9-probe")
            t1 = time.perf_counter()
            res = await r.exec(["true"])
            t2 = time.perf_counter()
            if not res.ok:
                raise RuntimeError(f"`true` in a rollout on {node} exited {res.exit_code}: {res.stderr[-300:]!r}")
            await r.end(reward=0.0, accepted=False, keep="discard", message="P9 rollback probe")
            if i >= warm:
                out["begin_ms"].append((t1 - t0) * 1e3)
                out["first_exec_ms"].append((t2 - t1) * 1e3)
                out["rollback_ms"].append((t2 - t0) * 1e3)
        grade = rl_step.GRADER.command
        for i in range(warm + n):
            node = nodes[i % len(nodes)]
            t0 = time.perf_counter()
            sb = await ls.sandbox(node=node, name=f"{run}-grade-{i}")
            t1 = time.perf_counter()
            res = await sb.exec(grade, timeout_s=60)
            t2 = time.perf_counter()
            end = await sb.discard("P9 grading probe")
            t3 = time.perf_counter()
            if not res.ok or end.outcome != "discarded":
                raise RuntimeError(f"grading on {node}: exit {res.exit_code} {res.stdout[-300:]!r}; {end.outcome}")
            if i >= warm:
                out["grade_start_ms"].append((t1 - t0) * 1e3)
                out["grade_command_ms"].append((t2 - t1) * 1e3)
                out["grade_discard_ms"].append((t3 - t2) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--admin", required=True, help="the daemon's admin socket")
    p.add_argument("--store", required=True, help="the daemon's store root (du before and after the step)")
    p.add_argument("--daemon-pid", type=int, required=True)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--probes", type=int, default=100)
    a = p.parse_args()
    name = f"p9-{time.strftime('%Y%m%d-%H%M%S')}"
    s = asyncio.run(rl_step.step(a.admin, n=a.n, concurrency=a.concurrency, stack=None, name=name,
                                 store=a.store, daemon_pid=a.daemon_pid))
    with layerstack.connect(a.admin) as c:
        g = c.show_graph(s["graph"])
    kept = [x.id for x in g.nodes if x.parents == (s["task_node"],) and not x.pruned]
    if not kept:
        raise RuntimeError(f"the step kept no node (accepted {s['accepted']}): nothing to roll back to")
    pr = asyncio.run(probes(a.admin, s["graph"], kept, a.probes, f"{name}-probes"))
    s.pop("dot", None)
    s["probes"] = pr
    s["python"] = sys.version.split()[0]
    print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
