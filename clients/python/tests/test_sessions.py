"""Mode B sessions through the client, against the real daemon (conftest.py)."""

from __future__ import annotations

import grpc
import pytest

import layerstack
from conftest import Env, unique


def sh(script: str) -> list:  # type: ignore[type-arg]
    return ["sh", "-c", script]


def test_run_passes_exit_status_and_output_and_the_next_session_sees_the_publish(
    env: Env, ls: layerstack.Client
) -> None:
    b = unique("run")
    r = ls.run(
        sh("echo out; echo err >&2; echo hello > /py-marker; exit 7"),
        stack=env.image,
        branch=b,
        name="py-run",
    )
    assert r.exit_status == 7
    assert r.stdout == b"out\n"
    assert r.stderr == b"err\n", "the binary's outcome line is not the command's stderr"
    assert r.session.outcome == "committed", r.session
    assert r.session.owner_kind == "sandbox" and r.session.owner == "sandbox:py-run"
    assert r.session.layer is not None and r.session.counts.clean >= 1
    assert r.node is None
    assert r.session.branch_created, "the branch did not exist: the run's start made it, said as a field"

    seen = ls.run(sh("cat /py-marker"), stack=env.image, branch=b, publish="never")
    assert (seen.exit_status, seen.stdout) == (0, b"hello\n")
    assert not seen.session.branch_created, "the branch exists now"

    # on-success with a failing command discards: the next session does not see it.
    r = ls.run(sh("echo no > /py-marker; exit 3"), stack=env.image, branch=b, publish="on-success")
    assert r.exit_status == 3 and r.session.outcome == "discarded", r.session
    seen = ls.run(sh("cat /py-marker"), stack=env.image, branch=b, publish="never")
    assert seen.stdout == b"hello\n"

    # stdin reaches the command.
    r = ls.run(["cat"], stack=env.image, branch=b, publish="never", input=b"piped\n")
    assert r.stdout == b"piped\n"


def test_create_exec_close_keeps_one_session_mounted(env: Env, ls: layerstack.Client) -> None:
    b = unique("cec")
    s = ls.create_session(env.image, branch=b, publish="on-success", name="py-harness")
    assert s.state == "active" and s.owner == "sandbox:py-harness"
    r = ls.exec(s.id, sh("echo one > /step1; hostname"))
    assert (r.exit_status, r.stdout) == (0, f"ls-{s.id}\n".encode())
    r = ls.exec(s.id, sh("cat /step1; echo two >> /step1; exit 4"))
    assert (r.exit_status, r.stdout) == (4, b"one\n")

    other = ls.run(sh("cat /step1 2>/dev/null || echo absent"), stack=env.image, branch=b, publish="never")
    assert other.stdout == b"absent\n", "another session does not see a live session's writes"

    listed = {x.id: x for x in ls.list_sessions(owner_kind="sandbox")}
    assert s.id in listed and listed[s.id].policy == "on-success" and listed[s.id].outcome is None

    # Publishing (or a dry run) needs the upper unmounted everywhere: refused, typed.
    for call in (ls.dry_run, ls.publish):
        with pytest.raises(layerstack.FailedPreconditionError) as e:
            call(s.id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "still mounted" in e.value.message

    closed = ls.close_session(s.id, exit_status=0)
    assert closed.outcome == "committed" and closed.released, closed
    assert ls.wait(s.id, timeout_ms=5000).outcome == "committed"
    assert [v.path for v in ls.outcome_paths(closed.outcome_id or 0)] == ["/step1"]

    # exec in a closed session: the binary's own failure (exit 125), typed.
    with pytest.raises(layerstack.FailedPreconditionError) as fe:
        ls.exec(s.id, ["true"])
    assert str(s.id) in fe.value.message and "closed" in fe.value.message, fe.value.message
    assert fe.value.kind == "failed_precondition" and fe.value.code is None
    assert fe.value.returncode == 125 and fe.value.argv is not None

    seen = ls.run(sh("cat /step1"), stack=env.image, branch=b, publish="never")
    assert seen.stdout == b"one\ntwo\n"


def test_publish_and_discard_of_an_unmounted_session(env: Env, ls: layerstack.Client) -> None:
    b = unique("pub")
    base = ls.run(sh("echo base > /base"), stack=env.image, branch=b)
    assert base.session.outcome == "committed"
    g = ls.create_graph(unique("g-pub"), env.image, branch=b)
    # An attempt whose session nobody mounts: the client writes its upper itself.
    started = ls.start_attempt(g.root, policy="on-exit", key=unique("k-sa"))
    upper = next(o.split("=", 1)[1] for m in started.mounts for o in m.options if o.startswith("upperdir="))
    with open(f"{upper}/written-by-python", "w") as f:
        f.write("direct\n")
    # What a publish would do now, changing nothing.
    dry = ls.dry_run(started.session.id)
    assert dry.session.dry_run, dry.session
    assert [(v.path, v.status) for v in dry.paths] == [("/written-by-python", "clean")]
    gone = ls.discard(started.session.id)
    assert gone.outcome == "discarded", gone
    assert [a.status for a in ls.list_attempts(g.root) if a.id == started.attempt.id] == ["failed"]


def test_errors_are_typed_with_the_grpc_code_and_the_daemons_message(env: Env, ls: layerstack.Client) -> None:
    # An unknown node id is NOT_FOUND (errdefs not_found), with the daemon's message.
    with pytest.raises(layerstack.LayerStackError) as e:
        ls.show_node("no-such-node")
    assert isinstance(e.value, layerstack.NotFoundError)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.kind == "not_found"
    assert "no-such-node" in e.value.message and "does not exist" in e.value.message
    name = unique("no-such-graph")
    with pytest.raises(layerstack.LayerStackError) as e:
        ls.show_graph(name)
    assert e.value.code is not None and name in e.value.message
    # Failures of the binary (session run|create|exec) raise the same classes
    # as the RPCs', by the kind it prints.
    with pytest.raises(layerstack.NotFoundError) as nf:
        ls.run(["true"], node="no-such-node")
    assert "no-such-node" in nf.value.message and nf.value.returncode == 125
    assert nf.value.kind == "not_found" and nf.value.code is None
    with pytest.raises(layerstack.NotFoundError) as nf:
        ls.create_session(node="no-such-node")
    assert "no-such-node" in nf.value.message
    with pytest.raises(layerstack.NotFoundError) as nf:
        ls.run(["true"], stack="docker.io/library/no-such-image:0")
    assert "no-such-image" in nf.value.message
    with pytest.raises(layerstack.NotFoundError) as nf:
        ls.exec(987654321, ["true"])
    assert "987654321" in nf.value.message
    with pytest.raises(layerstack.InvalidArgumentError) as ia:
        ls.run(["true"], stack=env.image, user="bob")
    assert "--user" in ia.value.message
    # The command's own 125 is an exit status, not an error.
    r = ls.run(["sh", "-c", "echo mine >&2; exit 125"], stack=env.image, publish="never")
    assert r.exit_status == 125 and r.stderr == b"mine\n"
    with pytest.raises(ValueError):
        ls.run(["true"], stack=env.image, publish="sometimes")
    bad = layerstack.connect(env.dir / "nothing-here.sock")
    with pytest.raises(layerstack.UnavailableError):
        bad.status()
    assert ls.status().events_subscribed
