"""The best-of-N demo (examples/best_of_n.py) end to end, so it cannot rot."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import layerstack
from conftest import Env, unique

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "best_of_n.py"


def load_demo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("best_of_n", EXAMPLE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["best_of_n"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_best_of_n_promotes_the_best_passing_attempt(env: Env, ls: layerstack.Client) -> None:
    demo = load_demo()
    out = os.environ.get("LAYERSTACK_DEMO_DOT")
    # The picture in docs/ names the branch main; a test run names its own.
    branch = "main" if out else unique("bon")
    graph = "best-of-n" if out else unique("best-of-n")
    r = demo.best_of_n(
        ls, image=env.image, branch=branch, graph=graph, workspace=env.scratch(graph), key_prefix=graph
    )
    assert len(r.trials) == 8
    passing = {t.candidate.name for t in r.trials if t.node}
    assert passing == {"average-middles", "stdlib", "selection-loop"}, r.trials
    assert r.best.candidate.name == "stdlib", "score first, then the smallest edit"
    assert r.promote.result == "fast-forward"

    g = ls.show_graph(graph)
    attempts = [a for a in g.attempts if a.node == r.root]
    assert len(attempts) == 8
    assert sorted(a.status for a in attempts) == ["checkpointed"] * 3 + ["failed"] * 5
    best = g.node(r.best.node)
    assert best.state == {"candidate": "stdlib", "score": 1.0, "lines": 4}
    assert {n.state.get("candidate") for n in g.children(r.root)} == passing
    # The branch holds the best candidate's file, byte for byte.
    cat = ls.run(["cat", "/work/calc/stats.py"], stack=env.image, branch=branch, publish="never")
    assert cat.stdout.decode() == r.best.candidate.source
    for t in r.trials:
        if t.node:
            assert f'"{r.root}" -> "{t.node}"' in r.dot
    assert f'"branch" -> "{r.best.node}"' in r.picture and r.picture.count("discarded-") == 10
    # docs/best_of_n.svg is rendered from this (README "Python"):
    # LAYERSTACK_DEMO_DOT=docs/best_of_n.dot pytest …; dot -Tsvg docs/best_of_n.dot > docs/best_of_n.svg
    if out:
        Path(out).write_text(r.picture)
