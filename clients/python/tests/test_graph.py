"""The SandboxGraph through the client, against the real daemon (conftest.py):
sibling attempts isolated, checkpoint, merge, promote (fast-forward, and a stale
one refused whole), prune, retry, and the same key twice giving one effect."""

from __future__ import annotations

import pytest

import layerstack
from conftest import Env, unique


def sh(script: str) -> list:  # type: ignore[type-arg]
    return ["sh", "-c", script]


def look(ls: layerstack.Client, script: str, **target: str) -> str:
    """What ``sh -c script`` prints in a throwaway session on a node or a branch."""
    r = ls.run(sh(script), publish="never", **target)  # type: ignore[arg-type]
    assert r.exit_status == 0, r
    return r.stdout.decode().strip()


def test_attempts_checkpoint_merge_promote_prune_retry(env: Env, ls: layerstack.Client) -> None:
    main = unique("gmain")
    seed = ls.run(sh("echo base > /base.txt"), stack=env.image, branch=main)
    assert seed.session.outcome == "committed"
    name = unique("g")
    k = unique("k")

    # Same key, same graph; a taken name without it is refused, naming it.
    g = ls.create_graph(name, env.image, branch=main, key=f"{k}-g")
    again = ls.create_graph(name, env.image, branch=main, key=f"{k}-g")
    assert again.root == g.root and g.info.branch == main
    with pytest.raises(layerstack.AlreadyExistsError) as e:
        ls.create_graph(name, env.image, branch=main)
    assert name in e.value.message and e.value.kind == "already_exists"
    assert name in [x.name for x in ls.list_graphs()]
    root = g.root
    assert ls.show_node(root).kind == "root"

    # Two sibling attempts of the root; each checkpoints into its own child.
    ra = ls.run(sh("echo a > /a.txt"), node=root, state={"score": 0.5}, key=f"{k}-ra")
    rb = ls.run(sh("test ! -e /a.txt && echo b > /b.txt"), node=root, state={"score": 0.9}, key=f"{k}-rb")
    assert ra.exit_status == 0 and rb.exit_status == 0, "b must not see a's writes"
    a, b = ra.node, rb.node
    assert a and b and a != b, (ra.session, rb.session)
    # The node is a field of the outcome (``--outcome``'s "node"), not words.
    assert ra.session.node == a and ra.session.checkpoint_node == a
    assert ra.session.outcome == "checkpointed" and ra.session.layer is not None
    shown = ls.show_graph(name)
    kids = {n.id: n for n in shown.children(root)}
    assert set(kids) == {a, b}
    assert kids[a].state == {"score": 0.5} and kids[b].state == {"score": 0.9}
    assert look(ls, "cat /a.txt /base.txt; test ! -e /b.txt && echo isolated", node=a) == "a\nbase\nisolated"
    na = ls.show_node(a)
    assert na.kind == "checkpoint" and na.parents == (root,) and na.exit_status == 0
    assert na.command is not None and "/a.txt" in na.command and na.attempt is not None

    # Merge (disjoint) with a key, twice: one node.
    before = len(ls.show_graph(name).nodes)
    m1 = ls.merge(a, b, key=f"{k}-m", state={"merged": True})
    m2 = ls.merge(a, b, key=f"{k}-m", state={"merged": True})
    assert m1.node is not None and m2.node is not None and m1.node.id == m2.node.id
    assert len(ls.show_graph(name).nodes) == before + 1, "the same key made one merge node"
    m = m1.node.id
    assert m1.node.kind == "merge" and set(m1.node.parents) == {a, b}
    assert look(ls, "cat /a.txt /b.txt", node=m) == "a\nb"

    # Promote: main has not moved since the graph was made -> fast-forward; the
    # same key again is the same answer.
    with pytest.raises(layerstack.InvalidArgumentError):
        ls.promote(m, "bad..name")
    p = ls.promote(m, main, key=f"{k}-p")
    assert p.result == "fast-forward" and not p.refused, p
    assert ls.promote(m, main, key=f"{k}-p") == p
    assert look(ls, "cat /a.txt /b.txt", stack=env.image, branch=main) == "a\nb"

    # A stale node conflicting with newer work on main is refused whole.
    rc = ls.run(sh("echo node > /base.txt"), node=root)
    c = rc.node
    assert c is not None
    assert rc.session.outcome == "checkpointed", rc.session
    newer = ls.run(sh("echo main > /base.txt"), stack=env.image, branch=main)
    assert newer.session.outcome == "committed"
    stale = ls.promote(c, main)
    assert stale.refused and stale.result == "conflict", stale
    assert look(ls, "cat /base.txt", stack=env.image, branch=main) == "main", "main keeps the newer work"
    with pytest.raises(layerstack.LayerStackError):
        ls.promote(c, main, stack="docker.io/library/other:1")

    # Prune the stale leaf, twice with one key; an attempt of it is refused.
    pruned = ls.prune(c, key=f"{k}-prune")
    assert c in pruned and ls.prune(c, key=f"{k}-prune") == pruned
    assert ls.show_node(c).pruned
    with pytest.raises(layerstack.InvalidArgumentError) as e2:
        ls.run(["true"], node=c)
    assert "pruned" in e2.value.message

    # Retry: a new attempt of the same node; the same key twice, one attempt.
    attempts = ls.list_attempts(root)
    first = attempts[0]
    assert first.status == "checkpointed" and first.result_node in (a, b)
    r1 = ls.retry(first.id, key=f"{k}-r")
    r2 = ls.retry(first.id, key=f"{k}-r")
    assert r1.created and not r2.created and r1.attempt.id == r2.attempt.id
    assert r1.attempt.node == root and r1.attempt.status == "running"
    assert len(ls.list_attempts(root)) == len(attempts) + 1
    ls.close_session(r1.session.id, action="discard")
    assert {x.id: x.status for x in ls.list_attempts(root)}[r1.attempt.id] == "failed"

    # The picture.
    dot = ls.graph_dot(name)
    for parent, child in [(root, a), (root, b), (a, m), (b, m)]:
        assert f'"{parent}" -> "{child}"' in dot


def test_checkpoint_of_an_attempt_a_client_mounts_itself_is_keyed(env: Env, ls: layerstack.Client) -> None:
    main = unique("ckmain")
    assert ls.run(sh("echo base > /base.txt"), stack=env.image, branch=main).session.outcome == "committed"
    g = ls.create_graph(unique("gck"), env.image, branch=main)
    k = unique("k-ck")
    s1 = ls.start_attempt(g.root, key=f"{k}-start", owner="py-ck")
    s2 = ls.start_attempt(g.root, key=f"{k}-start", owner="py-ck")
    assert s1.created and not s2.created and s1.attempt.id == s2.attempt.id
    assert s1.mounts and s1.mounts[0].type == "overlay"
    upper = next(o.split("=", 1)[1] for o in s1.mounts[0].options if o.startswith("upperdir="))
    with open(f"{upper}/ck.txt", "w") as f:
        f.write("checkpointed\n")
    n1 = ls.checkpoint(s1.session.id, state={"step": 1}, key=f"{k}-ck", command="python wrote ck.txt")
    n2 = ls.checkpoint(s1.session.id, state={"step": 1}, key=f"{k}-ck", command="python wrote ck.txt")
    assert n1.id == n2.id and n1.state == {"step": 1} and n1.parents == (g.root,)
    assert [n.id for n in ls.show_graph(g.name).children(g.root)] == [n1.id]
    assert look(ls, "cat /ck.txt /base.txt", node=n1.id) == "checkpointed\nbase"
    assert {x.id: x.status for x in ls.list_attempts(g.root)}[s1.attempt.id] == "checkpointed"
    # Over gRPC too, the session's outcome names the node it made.
    listed = {x.id: x for x in ls.list_sessions(owner_kind="sandbox")}[s1.session.id]
    assert (listed.outcome, listed.node) == ("checkpointed", n1.id), listed
    # Nothing of it reached the branch.
    assert look(ls, "test ! -e /ck.txt && echo clean", stack=env.image, branch=main) == "clean"
