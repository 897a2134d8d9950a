#!/usr/bin/env python3
"""One RL step's fan-out from one asyncio harness: N rollouts of one task,
each in its own daemon-owned sandbox forked from the task's node.

    python3 fanout_async.py --admin-address /run/layerstack/admin.sock \\
        --stack import:sha256:… --rollouts 256 --concurrency 64

    # or from another machine, over the daemon's TLS listener:
    LAYERSTACK_TOKEN=… python3 fanout_async.py --target sandboxes:7443 \\
        --ca ca.pem --stack import:sha256:…

The task: ``/work/answer`` must hold the number the grader expects. Each
rollout (a stand-in for a policy's actions) writes its guess with the file
API, runs the grader with ``exec`` in the same sandbox, and ends with a
checkpoint whose state is the reward — or, when the sandbox itself failed,
with no checkpoint and an ``infra_failed`` record: an infrastructure failure is
never scored as a zero. Every sandbox is created with an idempotency key
``<run>/<step>/<sample>``: rerunning a crashed step with the same ``--run``
answers the sandboxes already made instead of making more.

Needs nothing on this host but the ``layerstack`` package (pure gRPC): no root,
no binary. The stack needs ``/bin/sh`` (busybox is enough).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import layerstack
import layerstack.aio

GRADER = 'test "$(cat /work/answer 2>/dev/null)" = "$EXPECTED"'


@dataclass(frozen=True)
class Rollout:
    """One sample's end: its node (checkpoint) and reward, or why it has none."""

    sample: int
    node: Optional[str]
    reward: Optional[float]
    infra_failed: Optional[str] = None
    ms: float = 0.0


async def rollout(
    ls: layerstack.aio.AsyncClient, root: str, run: str, step: int, sample: int, expected: int, gate: asyncio.Semaphore
) -> Rollout:
    t0 = time.perf_counter()
    async with gate:
        try:
            async with ls.sandbox(node=root, key=f"{run}/{step}/{sample}") as sb:
                if sb.ended:
                    # A rerun of this step: the sample ended before; its record
                    # stands (nothing runs or is scored twice).
                    assert sb.outcome is not None
                    if sb.outcome.outcome == "interrupted":
                        # The daemon restarted under it: an infrastructure
                        # failure as recorded, not a reward.
                        return Rollout(sample, None, None, infra_failed=sb.outcome.interrupted_by, ms=(time.perf_counter() - t0) * 1000)
                    node = sb.outcome.node
                    reward = (await ls.show_node(node)).state.get("reward") if node else None
                    return Rollout(sample, node, reward, ms=(time.perf_counter() - t0) * 1000)
                guess = sample % 16  # the "policy"
                await sb.files.write("/work/answer", f"{guess}\n", make_parents=True)
                graded = await sb.exec(["sh", "-c", GRADER], env={"EXPECTED": str(expected)}, timeout_s=30)
                reward = 1.0 if graded.ok else 0.0
                end = await sb.close(checkpoint=True, state={"reward": reward, "sample": sample, "guess": guess})
                if end.outcome == "interrupted":
                    return Rollout(sample, None, None, infra_failed=end.interrupted_by, ms=(time.perf_counter() - t0) * 1000)
                return Rollout(sample, end.node, reward, ms=(time.perf_counter() - t0) * 1000)
        except (layerstack.UnavailableError, layerstack.InternalError, layerstack.BusyError) as e:
            # The sandbox failed, not the policy: recorded as such, never as reward 0.
            return Rollout(sample, None, None, infra_failed=e.kind, ms=(time.perf_counter() - t0) * 1000)


async def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--admin-address", default="/run/layerstack/admin.sock")
    ap.add_argument("--target", help="host:port of the daemon's TLS listener (instead of the admin socket)")
    ap.add_argument("--ca", help="CA certificate (PEM) of the daemon's TLS listener")
    ap.add_argument("--stack", required=True, help="stack id, image reference or base digest of the task")
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64, help="sandboxes live at once from this harness")
    ap.add_argument("--run", default=f"run-{os.getpid()}", help="run id: the idempotency keys' prefix")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--expected", type=int, default=7)
    a = ap.parse_args(argv)

    kw = {"target": a.target, "root_certificates": a.ca} if a.target else {}
    async with layerstack.aio.connect(a.admin_address, **kw) as ls:
        g = await ls.create_graph(f"{a.run}-task", a.stack, key=f"{a.run}/graph")
        gate = asyncio.Semaphore(a.concurrency)
        t0 = time.perf_counter()
        ends = await asyncio.gather(
            *(rollout(ls, g.root, a.run, a.step, i, a.expected, gate) for i in range(a.rollouts))
        )
        wall = time.perf_counter() - t0
    scored = [r for r in ends if r.reward is not None]
    failed = [r for r in ends if r.infra_failed]
    best = [r for r in scored if r.reward == 1.0]
    print(
        f"{len(ends)} rollouts in {wall:.2f} s ({len(ends) / wall:.0f}/s): {len(scored)} scored, "
        f"{len(best)} solved, {len(failed)} infrastructure failures; "
        f"median rollout {statistics.median(r.ms for r in ends):.1f} ms"
    )
    if best:
        print(f"a solving node: {best[0].node}")
    return 0 if scored else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
