#!/usr/bin/env python3
"""Best-of-N over a small repository with a failing test, on the SandboxGraph.

The repository is ``calc/`` beside this file: ``stats.median`` is wrong for
even lengths and two of its five unittests fail. The demo

1. publishes the repository onto ``IMAGE@BRANCH`` with a first sandbox
   (workspace mode, ``mount_at``: the sandbox's tree is mounted at a directory
   of the daemon's host and the host's ``cp`` copies the files in);
2. makes a graph whose root node is that branch head;
3. starts 8 attempts from the root node, each a daemon-owned sandbox
   (``Client.sandbox(node=…)``) whose file API writes one scripted candidate
   of ``stats.py`` and whose ``exec`` runs the evaluator, ``python3 -m
   unittest`` (workspace mode again: the host's interpreter on the sandbox's
   tree; the Debian test image has no python3);
4. checkpoints the passing attempts into child nodes whose state carries the
   score, discards the others with the evaluator's exit status (their
   attempts end ``failed``);
5. promotes the best node (score, then the smallest edit) to the branch: a
   fast-forward, since nothing else moved it;
6. checks that the branch now passes the test in a last sandbox, and writes
   the graph as Graphviz dot (``layerstack graph show --dot``).

    python3 best_of_n.py --admin-address /run/layerstack/admin.sock \\
        --image docker.io/library/debian:bookworm --dot graph.dot

Every mutating call carries an idempotency key derived from ``--key-prefix``:
rerunning with the same prefix after a crash gives the same graph, not a
second one (an attempt that ended answers its recorded end). Pure gRPC: the
caller needs the ``layerstack`` package and a uid the daemon allows; the
daemon's host needs python3 (the evaluator) and the workspace directory.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import layerstack

HERE = Path(__file__).resolve().parent
REPO_DIR = HERE / "calc"
ORIGINAL = (REPO_DIR / "stats.py").read_text()
N_TESTS = (REPO_DIR / "test_stats.py").read_text().count("    def test_")

_HEAD = ORIGINAL.split("def median(xs):")[0] + 'def median(xs):\n    """The median of a non-empty sequence."""\n'


@dataclass(frozen=True)
class Candidate:
    """A scripted edit: a name and the body of ``median`` it writes."""

    name: str
    body: str

    @property
    def source(self) -> str:
        return _HEAD + self.body

    @property
    def lines_changed(self) -> int:
        d = difflib.unified_diff(ORIGINAL.splitlines(), self.source.splitlines(), lineterm="", n=0)
        return sum(1 for line in d if line[:1] in "+-" and line[:3] not in ("+++", "---"))


CANDIDATES: Sequence[Candidate] = (
    Candidate("unchanged", "    s = sorted(xs)\n    return s[len(s) // 2]\n"),
    Candidate("lower-middle", "    s = sorted(xs)\n    return s[(len(s) - 1) // 2]\n"),
    Candidate(
        "average-middles",
        "    s = sorted(xs)\n    n = len(s)\n    mid = n // 2\n    if n % 2:\n        return s[mid]\n"
        "    return (s[mid - 1] + s[mid]) / 2\n",
    ),
    Candidate(
        "no-sort",
        "    n = len(xs)\n    mid = n // 2\n    if n % 2:\n        return xs[mid]\n    return (xs[mid - 1] + xs[mid]) / 2\n",
    ),
    Candidate("mean-instead", "    return mean(xs)\n"),
    Candidate("syntax-error", "    s = sorted(xs\n    return s[len(s) // 2]\n"),
    Candidate("stdlib", "    import statistics\n    return statistics.median(xs)\n"),
    Candidate(
        "selection-loop",
        "    s = list(xs)\n    for i in range(len(s)):\n        for j in range(i + 1, len(s)):\n"
        "            if s[j] < s[i]:\n                s[i], s[j] = s[j], s[i]\n"
        "    n = len(s)\n    if n % 2:\n        return s[n // 2]\n    return (s[n // 2 - 1] + s[n // 2]) / 2\n",
    ),
)


@dataclass(frozen=True)
class Trial:
    """One attempt's result: the candidate, tests passed, its score (passed / total),
    the session, and the child node when it passed (else None: discarded)."""

    candidate: Candidate
    passed: int
    score: float
    session: int
    node: Optional[str]


@dataclass(frozen=True)
class Result:
    """What the demo did; ``dot`` is ``layerstack graph show --dot`` as the daemon
    drew it, ``picture`` that plus the discarded attempts and the branch."""

    graph: str
    root: str
    branch: str
    trials: List[Trial]
    best: Trial
    promote: layerstack.PromoteResult
    dot: str

    @property
    def picture(self) -> str:
        extra = []
        for i, t in enumerate(self.trials):
            if t.node is None:
                extra.append(
                    f'  "discarded-{i}" [label="attempt {i}: {t.candidate.name}\\n'
                    f'{t.passed}/{N_TESTS} tests, discarded", shape=ellipse, style=dashed, '
                    f"color=gray, fontcolor=gray];"
                )
                extra.append(f'  "{self.root}" -> "discarded-{i}" [style=dashed, color=gray];')
        assert self.best.node is not None
        extra.append(f'  "branch" [label="{self.branch}\\n({self.promote.result})", shape=cds, style=filled, fillcolor=palegreen];')
        extra.append(f'  "branch" -> "{self.best.node}" [style=bold, color=darkgreen];')
        body = self.dot.rstrip().rstrip("}")
        return body + "\n".join(extra) + "\n}\n"


def tests_passed(exit_status: int, stderr: bytes) -> int:
    """Passing tests from unittest's summary ("Ran 5 tests", "FAILED (failures=2)")."""
    text = stderr.decode(errors="replace")
    m = re.search(r"^Ran (\d+) tests?", text, re.M)
    ran = int(m.group(1)) if m else 0
    bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", text))
    if exit_status == 0:
        return ran
    # An import error is one "test" that errors: nothing of the real suite ran.
    return 0 if ran <= bad else ran - bad


def evaluate(sb: layerstack.Sandbox, workspace: Path) -> layerstack.ExecOutput:
    """The evaluator: the repository's unittests, run in the sandbox (the host's
    interpreter on the sandbox's tree, mounted at ``workspace``)."""
    return sb.exec(
        [sys.executable, "-m", "unittest", "-q"],
        cwd=str(workspace / "work" / "calc"),
        env={"PYTHONDONTWRITEBYTECODE": "1"},
        timeout_s=120,
    )


def best_of_n(
    ls: layerstack.Client,
    *,
    image: str,
    branch: str,
    graph: str,
    workspace: Path,
    key_prefix: str,
    log: Callable[[str], None] = print,
) -> Result:
    """Runs the demo (module doc) and returns what it did."""
    ws = str(workspace)
    with ls.sandbox(image, branch=branch, mount_at=ws, key=f"{key_prefix}-seed", name="best-of-n-seed") as sb:
        if not sb.ended:
            cp = sb.exec(
                ["sh", "-c", f"rm -rf work/calc && mkdir -p work && cp -r {REPO_DIR} work/calc && rm -rf work/calc/__pycache__"],
                cwd=ws,
            )
            sb.close(publish=True, exit_status=cp.exit_code, reason="best-of-n seed")
        seeded = sb.outcome
    if seeded is None or seeded.outcome not in ("committed", "merged", "no-change"):
        raise RuntimeError(f"seeding {image}@{branch}: {seeded}")
    log(f"seeded {image}@{branch}: session {seeded.id} {seeded.outcome}")

    g = ls.create_graph(graph, image, branch=branch, key=f"{key_prefix}-graph")
    log(f"graph {graph}: root node {g.root}")

    trials: List[Trial] = []
    for i, cand in enumerate(CANDIDATES):
        node: Optional[str] = None
        with ls.sandbox(node=g.root, mount_at=ws, key=f"{key_prefix}-attempt-{i}", name=f"best-of-n-{i}") as sb:
            if sb.ended:
                # A rerun with the same keys: this attempt's end as recorded.
                assert sb.outcome is not None
                node = sb.outcome.node
                score = float(ls.show_node(node).state.get("score", 0.0)) if node else 0.0
                trials.append(Trial(cand, round(score * N_TESTS), score, sb.id, node))
                continue
            sb.files.write("/work/calc/stats.py", cand.source)
            ev = evaluate(sb, workspace)
            passed = tests_passed(ev.exit_code, ev.stderr)
            score = round(passed / N_TESTS, 3)
            if ev.ok:
                closed = sb.close(
                    checkpoint=True,
                    exit_status=ev.exit_code,
                    state={"candidate": cand.name, "score": score, "lines": cand.lines_changed},
                    command=f"apply {cand.name}; python3 -m unittest",
                )
                node = closed.node
                if node is None:
                    raise RuntimeError(f"{cand.name}: the close made no node: {closed}")
            else:
                # The evaluator's status goes with the end: the attempt is `failed`.
                sb.close(action="discard", exit_status=ev.exit_code)
        trials.append(Trial(cand, passed, score, sb.id, node))
        log(f"attempt {i} {cand.name:16} {passed}/{N_TESTS} tests  " + (f"-> node {node}" if node else "discarded"))

    passing = [t for t in trials if t.node is not None]
    if not passing:
        raise RuntimeError("no candidate passes the tests")
    best = max(passing, key=lambda t: (t.score, -t.candidate.lines_changed))
    assert best.node is not None
    p = ls.promote(best.node, branch, key=f"{key_prefix}-promote")
    log(f"promote {best.candidate.name} ({best.node}) to {branch}: {p.result} {p.message}")
    if p.refused:
        raise RuntimeError(f"promote refused: {p.message}")

    with ls.sandbox(image, branch=branch, mount_at=ws, name="best-of-n-check") as sb:
        check = evaluate(sb, workspace)  # discarded on leaving the block
    if not check.ok:
        raise RuntimeError(f"{branch} does not pass after the promote: {check.stderr.decode(errors='replace')}")
    log(f"{image}@{branch} passes its tests")
    return Result(graph, g.root, branch, trials, best, p, ls.graph_dot(graph))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--admin-address", default=layerstack.DEFAULT_ADMIN_ADDRESS)
    ap.add_argument("--namespace", "-n", default="default")
    ap.add_argument("--image", required=True, help="the stack: an image reference, stack id or base digest")
    ap.add_argument("--branch", default="main")
    ap.add_argument("--graph", default=None, help="the graph's name [default: best-of-n-<time>]")
    ap.add_argument("--key-prefix", default=None, help="idempotency keys' prefix [default: the graph's name]")
    ap.add_argument("--workspace", default=None, help="an empty directory to mount sessions at")
    ap.add_argument("--dot", default=None, help="write the graph in Graphviz dot here (with the discarded attempts and the branch)")
    a = ap.parse_args(argv)
    graph = a.graph or f"best-of-n-{int(time.time())}"
    with layerstack.connect(a.admin_address, namespace=a.namespace) as ls:
        with tempfile.TemporaryDirectory(prefix="best-of-n-", dir="/var/tmp") as tmp:
            ws = Path(a.workspace) if a.workspace else Path(tmp)
            r = best_of_n(
                ls, image=a.image, branch=a.branch, graph=graph, workspace=ws, key_prefix=a.key_prefix or graph
            )
    if a.dot:
        Path(a.dot).write_text(r.picture)
        print(f"wrote {a.dot} (render: dot -Tsvg {a.dot} > graph.svg)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
