#!/usr/bin/env python3
"""One RL step on the rollout fabric (issue 21): ``--n`` rollouts (default
1,024) of a small repository task, each graded by a real test run in a clean
sandbox over the attempt's checkpoint, its reward applied once.

The task is a tiny shell project, ``/work/proj`` (busybox only):
``lib.sh`` defines ``add`` and ``mul`` and ``add`` subtracts (the bug);
``build.sh`` syntax-checks ``lib.sh`` (``sh -n``) and writes
``out/lib.built``; ``test.sh`` sources the build and prints ``passed K/4``,
exiting 0 only when all four checks pass.

1. The base: a busybox tree imported with ``Client.import_base`` (no
   containerd; the daemon reads the directory, so this program runs on the
   daemon's host) — or ``--stack`` (an existing stack with busybox's applets
   on ``PATH``). A graph over it; a first sandbox writes the project and is
   checkpointed: the **task node** every rollout forks from.
2. The step: :func:`layerstack.fabric.fan_out` — per sample a
   ``BeginRollout`` (a daemon-owned sandbox on the task node), then the
   policy's scripted turn: five execs (read the code, build + test to see the
   failure, the edit, the build, the tests again) and one file write (its
   notes). The candidate edits (:data:`CANDIDATES`, sample ``i`` takes
   ``CANDIDATES[i % 8]``) fix the bug, fix it another way, miss it, or break
   the build — a failed build raises :class:`TaskFailed`: the attempt ends
   ``task_failed``, no reward. Otherwise the attempt is checkpointed and the
   :class:`Grader` runs ``build.sh && test.sh`` in a fresh sandbox over that
   checkpoint; reward = passed / 4, accepted when all pass (the accepted
   checkpoints are kept as child nodes of the task node, the others pruned).
3. The summary: samples, rewarded, mean reward, attempts by status (the
   run's audit, which must show no exactly-once violation), wall time of the
   step, bytes the step added (the store's allocated bytes, ``du`` of
   ``--store`` when given; the kept nodes' own layers always), and the
   graph picture (``layerstack graph show NAME --dot`` when the binary is
   found, else built here from ``ShowGraph``) written to ``--dot``.

    sudo python3 rl_step.py /run/layerstack/admin.sock --n 1024 --concurrency 64 \\
        --store /var/lib/layerstack --dot rl_step.dot

:func:`main` returns the summary as a dict (what the tests and benchmark P9
read); ``--json FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import layerstack
import layerstack.aio
from layerstack.fabric import Grader, RolloutResult, TaskFailed, fan_out

PROJ = "/work/proj"

LIB_SH = """\
# lib.sh: the project's arithmetic.
add() { echo $(( $1 - $2 )); }
mul() { echo $(( $1 * $2 )); }
"""

BUILD_SH = f"""\
set -e
mkdir -p {PROJ}/out
sh -n {PROJ}/lib.sh
cp {PROJ}/lib.sh {PROJ}/out/lib.built
echo built
"""

TEST_SH = f"""\
. {PROJ}/out/lib.built || {{ echo "not built"; exit 2; }}
pass=0; total=0
t() {{
    total=$((total + 1))
    got=$($1 $2 $3)
    if [ "$got" = "$4" ]; then pass=$((pass + 1)); else echo "FAIL: $1 $2 $3 = $got, want $4"; fi
}}
t add 2 3 5
t add 10 -4 6
t add 0 0 0
t mul 3 4 12
echo "passed $pass/$total"
[ $pass -eq $total ]
"""

#: Checks in TEST_SH.
N_CHECKS = 4


@dataclass(frozen=True)
class Candidate:
    """A scripted edit of ``lib.sh``: a shell command (``sed``) or the file's
    new content (a write). ``outcome`` is what it should earn: ``accepted``,
    ``rejected`` (graded below 1) or ``task_failed`` (the build breaks)."""

    name: str
    outcome: str
    sed: Optional[str] = None
    content: Optional[str] = None


CANDIDATES: Sequence[Candidate] = (
    Candidate("fix: $1 + $2", "accepted", sed=r"s/\$1 - \$2/$1 + $2/"),
    Candidate("swap the operands", "rejected", sed=r"s/\$1 - \$2/$2 - $1/"),
    Candidate("special-case the failing test", "rejected",
              content=LIB_SH.replace("add() { echo $(( $1 - $2 )); }",
                                     'add() { if [ "$1" = 2 ]; then echo 5; else echo 0; fi; }')),
    Candidate("drop a closing brace", "task_failed", sed=r"s/ \$2 )); }$/ $2 ));/"),
    Candidate("fix: $2 + $1", "accepted", sed=r"s/\$1 - \$2/$2 + $1/"),
    Candidate("edit only the comment", "rejected", sed=r"s/arithmetic/arithmetic (reviewed)/"),
    Candidate("rewrite the file", "accepted",
              content=LIB_SH.replace("$1 - $2", "$1 + $2").replace("arithmetic", "arithmetic, fixed")),
    Candidate("half-written function", "task_failed",
              content=LIB_SH.replace("add() { echo $(( $1 - $2 )); }", "add() { echo $(( $1 + $2 ))")),
)


def candidate(sample: int) -> Candidate:
    """The edit sample ``sample`` makes."""
    return CANDIDATES[sample % len(CANDIDATES)]


def _passed(stdout: bytes) -> int:
    m = re.search(rb"passed (\d+)/(\d+)", stdout)
    return int(m.group(1)) if m else 0


class GraderOutputLost(RuntimeError):
    """The grader's run answered no ``passed K/4`` line: its output did not
    reach us, so there is no reward to give. :func:`fan_out` ends the attempt
    ``infra_failed(grader-output-lost)`` and tries the sample again — never
    a silent zero. (Seen under load: an exec answered its exit with no
    stdout at all.)"""

    kind = "grader-output-lost"


def reward_of(out: "layerstack.ExecOutput") -> "tuple[float, bool]":
    """The grader's reward: checks passed / 4, accepted when the test exits 0.
    :class:`GraderOutputLost` when its output has no ``passed K/4`` line."""
    if re.search(rb"passed \d+/\d+", out.stdout) is None:
        raise GraderOutputLost(
            f"the grader exited {out.exit_code} (signal {out.signal}, timed out {out.timed_out}) without "
            f"a 'passed K/4' line: stdout {out.stdout[-200:]!r}, stderr {out.stderr[-200:]!r}")
    return _passed(out.stdout) / N_CHECKS, out.exit_code == 0


GRADER = Grader(
    ["sh", "-c", f"sh {PROJ}/build.sh >/dev/null && sh {PROJ}/test.sh"],
    name="proj-tests",
    version="1",
    reward=reward_of,
    timeout_s=60.0,
)


async def act(r: "layerstack.aio.AsyncRollout") -> None:
    """The policy's turn in sample ``r.key.sample``'s sandbox: 5 execs and a
    write; :class:`TaskFailed` when its edit breaks the build."""
    c = candidate(r.key.sample)
    await r.exec(["cat", f"{PROJ}/lib.sh"], check=True)
    await r.exec(["sh", "-c", f"sh {PROJ}/build.sh && sh {PROJ}/test.sh"])  # the failure it must fix
    if c.sed is not None:
        await r.exec(["sed", "-i", c.sed, f"{PROJ}/lib.sh"], check=True)
    else:
        assert c.content is not None
        await r.files.write(f"{PROJ}/lib.sh", c.content.encode())
        await r.exec(["grep", "-n", "add", f"{PROJ}/lib.sh"])
    await r.files.write(f"{PROJ}/NOTES", f"sample {r.key.sample}: {c.name}\n".encode())
    build = await r.exec(["sh", f"{PROJ}/build.sh"])
    if not build.ok:
        raise TaskFailed(f"build failed (exit {build.exit_code}): {build.stderr[-300:].decode(errors='replace')}")
    await r.exec(["sh", f"{PROJ}/test.sh"])  # its own check; the reward is the grader's


# --------------------------------------------------------------- the base


def busybox_tree(root: Path) -> Path:
    """A root filesystem of busybox and its applets (``/bin/<applet>``), for
    ``import_base``. RuntimeError when the host has no busybox."""
    bb = shutil.which("busybox")
    if bb is None:
        raise RuntimeError("no `busybox` on PATH: install busybox-static, or pass --stack STACK")
    for d in ("bin", "etc", "work", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(bb, root / "bin" / "busybox")
    applets = subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a != "busybox" and not (root / "bin" / a).exists():
            os.symlink("busybox", root / "bin" / a)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return root


def import_busybox(ls: layerstack.Client) -> str:
    """Imports :func:`busybox_tree` as a base; its stack id."""
    with tempfile.TemporaryDirectory(prefix="ls-busybox-", dir=os.environ.get("TMPDIR", "/var/tmp")) as d:
        Path(d).chmod(0o755)
        return ls.import_base(busybox_tree(Path(d) / "rootfs"))


def du_bytes(path: Optional[str]) -> Optional[int]:
    """Allocated bytes under ``path`` (``du -s -B1 -x``), ``None`` without a path."""
    if not path:
        return None
    p = subprocess.run(["du", "-s", "-B1", "-x", path], capture_output=True, text=True)
    if p.returncode not in (0, 1) or not p.stdout:
        raise RuntimeError(f"du -s {path}: exit {p.returncode}: {p.stderr.strip()}")
    return int(p.stdout.split()[0])


def graph_picture(ls: layerstack.Client, name: str) -> str:
    """``layerstack graph show NAME --dot``; built from ``ShowGraph`` when the
    binary is not found."""
    try:
        return ls.graph_dot(name)
    except layerstack.CommandError:
        return dot_from_graph(ls.show_graph(name))


def dot_from_graph(g: "layerstack.Graph", labels: Optional[Dict[str, str]] = None) -> str:
    """Graphviz dot of graph ``g``: a box per node (pruned ones dashed grey),
    an edge per parent; ``labels``: extra text per node id."""
    out = [f'digraph "{g.name}" {{', "  rankdir=LR;", '  node [shape=box, fontname="monospace", fontsize=9];']
    for n in g.nodes:
        text = f"{n.id[:12]}\\n{n.kind}"
        if n.state:
            text += "\\n" + json.dumps(n.state, sort_keys=True).replace('"', "'")[:60]
        if labels and n.id in labels:
            text += "\\n" + labels[n.id]
        style = ', style=dashed, color=grey' if n.pruned else ""
        out.append(f'  "{n.id}" [label="{text}"{style}];')
        for p in n.parents:
            out.append(f'  "{p}" -> "{n.id}";')
    out.append("}")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------- the step


async def setup_task(ls: "layerstack.aio.AsyncClient", stack: str, graph: str) -> "tuple[str, str]":
    """Graph ``graph`` over ``stack`` and the task node (the project written by
    a first sandbox, checkpointed). Returns (graph name, task node)."""
    g = await ls.create_graph(graph, stack, key=f"graph:{graph}")
    async with ls.sandbox(node=g.root, name=f"{graph}-setup", key=f"setup:{graph}") as sb:
        if sb.ended:  # a rerun: the setup was checkpointed before
            assert sb.outcome is not None and sb.outcome.node
            return g.name, sb.outcome.node
        for name, text in (("lib.sh", LIB_SH), ("build.sh", BUILD_SH), ("test.sh", TEST_SH)):
            await sb.files.write(f"{PROJ}/{name}", text.encode())
        out = await sb.exec(["sh", "-c", f"sh {PROJ}/build.sh && sh {PROJ}/test.sh"])
        if _passed(out.stdout) != 2 or out.ok:
            raise RuntimeError(f"the task's tests should fail 2 of 4 before any edit: {out.stdout!r} {out.stderr!r}")
        await sb.exec(["rm", "-rf", f"{PROJ}/out"], check=True)
        end = await sb.close(checkpoint=True, state={"task": "fix add()"})
    assert end.node
    return g.name, end.node


async def step(
    admin: str,
    *,
    n: int,
    concurrency: int,
    stack: Optional[str],
    name: str,
    store: Optional[str],
    daemon_pid: Optional[int] = None,
) -> Dict[str, Any]:
    """The step; the summary (see :func:`main`)."""
    with layerstack.connect(admin) as sync:
        base = stack or import_busybox(sync)
    async with layerstack.aio.connect(admin) as ls:
        graph, task = await setup_task(ls, base, name)
        run = (await ls.create_run(name, graph, labels={"demo": "rl_step"})).name
        du_before = du_bytes(store)
        peak = _Peak(daemon_pid)
        peak.start()
        t0 = time.perf_counter()
        results: List[RolloutResult] = []
        async for res in fan_out(ls, run, task, n, act, step=0, prompt="fix-add", policy="scripted-v1",
                                 grader=GRADER, concurrency=concurrency):
            results.append(res)
        wall_s = time.perf_counter() - t0
        peak.stop()
        du_after = du_bytes(store)
        audit = await ls.audit_run(run)
    with layerstack.connect(admin) as sync:
        g = sync.show_graph(graph)
        dot = graph_picture(sync, graph)
    kept = [x for x in g.nodes if x.parents == (task,) and not x.pruned]
    rewards = [r.reward for r in results if r.reward is not None]
    by_candidate: Dict[str, "Counter[str]"] = {}
    for r in results:
        accepted = r.attempt is not None and r.attempt.accepted and r.reward is not None
        by_candidate.setdefault(candidate(r.sample).name, Counter())["accepted" if accepted else r.status] += 1
    reward_of_candidate: Dict[str, List[float]] = {}
    for r in results:
        if r.reward is not None:
            reward_of_candidate.setdefault(candidate(r.sample).name, []).append(r.reward)
    summary: Dict[str, Any] = {
        "run": run,
        "graph": graph,
        "task_node": task,
        "stack": base,
        "samples": len(results),
        "rewarded": sum(1 for r in results if r.reward is not None),
        "accepted": sum(1 for r in results if r.attempt is not None and r.attempt.accepted and r.reward is not None),
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "status": dict(Counter(r.status for r in results)),
        "errors": [e for r in results for e in r.errors][:10],
        "by_candidate": {k: dict(v) for k, v in by_candidate.items()},
        "reward_by_candidate": {k: sorted(Counter(v).items()) for k, v in reward_of_candidate.items()},

        "audit": {
            "samples": audit.samples,
            "rewarded": audit.rewarded,
            "attempts": audit.attempts,
            "completed": audit.completed,
            "task_failed": audit.task_failed,
            "infra_failed": audit.infra_failed,
            "running": audit.running,
            "backprops": audit.backprops,
            "violations": list(audit.violations),
        },
        "wall_s": wall_s,
        "rollouts_per_s": len(results) / wall_s if wall_s else 0.0,
        "kept_nodes": len(kept),
        "kept_private_bytes": sum(x.private_bytes for x in kept),
        "store_bytes_added": None if du_before is None or du_after is None else du_after - du_before,
        "daemon_rss_kib": peak.summary(),
        "dot": dot,
    }
    return summary


class _Peak:
    """Samples a process's VmRSS every 50 ms on a thread (KiB); nothing without a pid."""

    def __init__(self, pid: Optional[int]) -> None:
        import threading

        self.pid = pid
        self.samples: List[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> Optional[int]:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            v = self._read()
            if v is not None:
                self.samples.append(v)

    def start(self) -> None:
        if self.pid:
            v = self._read()
            if v is not None:
                self.samples.append(v)
            self._t.start()

    def stop(self) -> None:
        if self.pid:
            self._stop.set()
            self._t.join()
            v = self._read()
            if v is not None:
                self.samples.append(v)

    def summary(self) -> Optional[Dict[str, int]]:
        if not self.samples:
            return None
        return {"before": self.samples[0], "peak": max(self.samples), "after": self.samples[-1]}


def table(s: Dict[str, Any]) -> str:
    """The summary as a two-column text table."""
    rows = [
        ("samples", s["samples"]),
        ("rewarded (one reward each)", s["rewarded"]),
        ("accepted (all 4 checks pass)", s["accepted"]),
        ("mean reward", f"{s['mean_reward']:.3f}"),
        ("samples by status", ", ".join(f"{k} {v}" for k, v in sorted(s["status"].items()))),
        ("attempts (audit)", f"{s['audit']['attempts']}: completed {s['audit']['completed']}, "
                             f"task_failed {s['audit']['task_failed']}, infra_failed {s['audit']['infra_failed'] or 0} "
                             f"(retried), "
                             f"running {s['audit']['running']}"),
        ("backpropagations", s["audit"]["backprops"]),
        ("audit violations", len(s["audit"]["violations"])),
        ("wall time of the step", f"{s['wall_s']:.2f} s ({s['rollouts_per_s']:.1f} rollouts/s)"),
        ("kept nodes (accepted checkpoints)", f"{s['kept_nodes']}, own layers {s['kept_private_bytes']} B"),
        ("store bytes added", "(give --store)" if s["store_bytes_added"] is None else f"{s['store_bytes_added']} B"),
    ]
    if s.get("daemon_rss_kib"):
        m = s["daemon_rss_kib"]
        rows.append(("daemon RSS before / peak / after", f"{m['before']} / {m['peak']} / {m['after']} KiB"))
    for name, c in s["by_candidate"].items():
        rows.append((f"  edit: {name}", ", ".join(f"{k} {v}" for k, v in sorted(c.items()))))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs the step; prints the summary table; returns the summary (keys:
    run, graph, task_node, samples, rewarded, accepted, mean_reward, status
    (samples by status), by_candidate, audit, wall_s, kept_nodes,
    kept_private_bytes, store_bytes_added (None without --store),
    daemon_rss_kib (None without --daemon-pid), dot_path, dot)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("admin", help="the daemon's admin socket")
    ap.add_argument("--n", type=int, default=1024, help="rollouts (samples) in the step (default 1024)")
    ap.add_argument("--concurrency", type=int, default=64, help="rollouts at once (default 64)")
    ap.add_argument("--stack", default=None, help="an existing stack with busybox applets (default: import one)")
    ap.add_argument("--name", default=None, help="graph and run name (default rl-step-<time>-<pid>-<random>)")
    ap.add_argument("--store", default=None, help="the daemon's store root: bytes added are du of it")
    ap.add_argument("--daemon-pid", type=int, default=None, help="sample the daemon's RSS during the step")
    ap.add_argument("--dot", default="rl_step.dot", help="write the graph picture here (default rl_step.dot)")
    ap.add_argument("--json", default=None, help="write the summary as JSON here")
    a = ap.parse_args(argv)
    if a.n < 1 or a.concurrency < 1:
        ap.error("--n and --concurrency must be at least 1")
    name = a.name or f"rl-step-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
    s = asyncio.run(step(a.admin, n=a.n, concurrency=a.concurrency, stack=a.stack, name=name,
                         store=a.store, daemon_pid=a.daemon_pid))
    Path(a.dot).write_text(s["dot"])
    s["dot_path"] = str(Path(a.dot).resolve())
    print(table(s))
    print(f"graph picture: {a.dot} (render: dot -Tsvg {a.dot} > rl_step.svg)")
    if a.json:
        Path(a.json).write_text(json.dumps({k: v for k, v in s.items() if k != "dot"}, indent=2))
    return s


if __name__ == "__main__":
    s = main()
    sys.exit(0 if not s["audit"]["violations"] and s["samples"] else 1)
