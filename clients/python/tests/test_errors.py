"""The gRPC code → exception mapping covers every error kind the daemon sends,
each with the kind's one spelling. Needs no daemon.

``WIRE`` is the table of ``layerstack_api::code`` (api/src/lib.rs); the Rust
test ``the_wire_table_is_the_one_the_python_client_maps`` asserts the same
table. When the repository's sources are beside this package, the table is also
read from them (the kind → code match in api/src/lib.rs, the kind → name match
in types/src/error.rs), so a kind added in Rust fails here until the client
maps it.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import grpc
import pytest

import layerstack
from layerstack import errors

REPO = Path(__file__).resolve().parents[3]

#: gRPC code name → error kind, in ``ErrorKind::ALL`` order.
WIRE: List[Tuple[str, str]] = [
    ("NOT_FOUND", "not_found"),
    ("ALREADY_EXISTS", "already_exists"),
    ("FAILED_PRECONDITION", "failed_precondition"),
    ("INVALID_ARGUMENT", "invalid_argument"),
    ("ABORTED", "conflict"),
    ("UNAVAILABLE", "unavailable"),
    ("RESOURCE_EXHAUSTED", "busy"),
    ("UNIMPLEMENTED", "unsupported"),
    ("DATA_LOSS", "corrupt"),
    ("UNKNOWN", "internal"),
    ("PERMISSION_DENIED", "permission_denied"),
    ("UNAUTHENTICATED", "unauthenticated"),
]

#: Kinds that share their code with a kind of ``WIRE`` (told apart by the
#: ``layerstack-kind`` trailer), in ``ErrorKind::ALL`` order.
SHARED: List[Tuple[str, str]] = [
    ("RESOURCE_EXHAUSTED", "no_space"),
]


class FakeRpcError(grpc.RpcError, grpc.Call):
    """What a failed unary call raises: an RpcError that is also a Call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return self._trailers

    _trailers: Any = ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def _camel_to_upper_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _rust_wire() -> Optional[List[Tuple[str, str]]]:
    """The table as the Rust sources define it, or None when they are not here."""
    api = REPO / "api" / "src" / "lib.rs"
    kinds = REPO / "types" / "src" / "error.rs"
    if not (api.is_file() and kinds.is_file()):
        return None
    codes = re.findall(r"ErrorKind::(\w+) => Code::(\w+),", api.read_text())
    names: Dict[str, str] = dict(re.findall(r'Self::(\w+) => "(\w+)",', kinds.read_text()))
    assert codes and names, "the Rust tables moved: update this test's patterns"
    return [(_camel_to_upper_snake(code), names[variant]) for variant, code in codes]


def test_the_table_is_the_rusts() -> None:
    rust = _rust_wire()
    if rust is None:
        pytest.skip("the Rust sources are not beside this package")
    assert rust == WIRE + SHARED


def test_a_kind_named_in_the_trailer_wins_over_its_code() -> None:
    call = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "writing layer 3: No space left on device")
    call._trailers = (("layerstack-kind", "no_space"),)
    e = errors.from_rpc_error(call)
    assert type(e) is layerstack.NoSpaceError and e.kind == "no_space"
    assert not isinstance(e, layerstack.BusyError), "waiting does not free a disk"
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "cap full"))
    assert type(e) is layerstack.BusyError, "no trailer: the code's kind"
    e = errors.from_command(["layerstack"], 1, '{"error":{"kind":"no_space","message":"full"}}')
    assert type(e) is layerstack.NoSpaceError


@pytest.mark.parametrize("code_name,kind", WIRE)
def test_every_kind_on_the_wire_has_its_exception(code_name: str, kind: str) -> None:
    code = grpc.StatusCode[code_name]
    e = errors.from_rpc_error(FakeRpcError(code, "session 3 not found"))
    assert type(e) is not errors.LayerStackError, f"{code_name} has no class of its own"
    assert isinstance(e, layerstack.LayerStackError)
    assert e.kind == kind and type(e).kind == kind
    assert e.code == code
    assert e.message == "session 3 not found"
    assert str(e) == f"{kind}: session 3 not found"
    assert type(e).__name__ in layerstack.__all__ and type(e).__name__ in errors.__all__


def test_one_class_per_kind_and_the_old_name_is_kept() -> None:
    classes = [errors.BY_CODE[grpc.StatusCode[c]] for c, _ in WIRE]
    assert len(set(classes)) == len(WIRE)
    assert set(errors.BY_CODE) == {grpc.StatusCode[c] for c, _ in WIRE}
    assert layerstack.ResourceExhaustedError is layerstack.BusyError
    assert layerstack.BusyError.kind == "busy"
    assert layerstack.CorruptError.kind == "corrupt"
    assert layerstack.UnsupportedError.kind == "unsupported"
    assert layerstack.InternalError.kind == "internal"


def test_codes_no_kind_maps_to_keep_their_snake_case_name() -> None:
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.CANCELLED, "gone"))
    assert type(e) is errors.LayerStackError and e.kind == "cancelled"
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "h2 protocol error"))
    assert type(e) is errors.LayerStackError and e.kind == "grpc_internal"


def test_a_deadline_has_its_own_class() -> None:
    # A client's timeout= or the daemon's idle limit of a write stream: a
    # harness catches it apart from other failures (retry with the same key).
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    assert type(e) is layerstack.DeadlineExceededError and e.kind == "deadline_exceeded"
    assert isinstance(e, layerstack.LayerStackError) and e.message == "late"
    e = errors.from_command(["layerstack"], 1, '{"error":{"kind":"deadline_exceeded","message":"late"}}')
    assert type(e) is layerstack.DeadlineExceededError and e.argv == ["layerstack"]
    assert pickle.loads(pickle.dumps(e)).message == "late"


def test_a_command_error_is_kind_command() -> None:
    c = errors.CommandError(["layerstack", "session", "run"], 125, "layerstack: no such node (not_found)\n")
    assert c.kind == "command" and c.code is None and c.message == "no such node (not_found)"


def _rust_kind_names() -> Optional[List[str]]:
    """``ErrorKind::as_str``'s names as types/src/error.rs spells them, or None
    when the Rust sources are not beside this package."""
    kinds = REPO / "types" / "src" / "error.rs"
    if not kinds.is_file():
        return None
    names = re.findall(r'Self::\w+ => "(\w+)",', kinds.read_text())
    assert names, "the Rust table moved: update this test's pattern"
    return names


def test_every_rust_kind_has_its_class_and_no_class_is_extra() -> None:
    names = _rust_kind_names()
    if names is None:
        pytest.skip("the Rust sources are not beside this package")
    assert sorted(errors.BY_KIND) == sorted(names), "errors.py and layerstack_types disagree"
    for name in names:
        cls = errors.BY_KIND[name]
        assert cls.kind == name and cls.__name__ in layerstack.__all__
    # Every class of one kind in the module is in the table.
    own = {
        c.kind
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors._KindError) and c is not errors._KindError
    }
    assert own == set(names)


@pytest.mark.parametrize("code_name,kind", WIRE)
def test_a_kind_the_binary_prints_raises_its_class(code_name: str, kind: str) -> None:
    stderr = 'some output of the command\n{"error":{"kind":"%s","message":"no node n-1"}}\n' % kind
    e = errors.from_command(["layerstack", "session", "run"], 125, stderr)
    assert type(e) is errors.BY_CODE[grpc.StatusCode[code_name]]
    assert (e.kind, e.message, e.code) == (kind, "no node n-1", None)
    assert (e.argv, e.returncode, e.stderr) == (["layerstack", "session", "run"], 125, stderr)


def test_the_binary_without_an_error_line_is_a_command_error() -> None:
    e = errors.from_command(["layerstack"], 125, "layerstack: something\n")
    assert type(e) is errors.CommandError and e.message == "something"
    e = errors.from_command(["layerstack"], 1, '{"error":{"kind":"out_of_range","message":"late"}}')
    assert type(e) is errors.LayerStackError and e.kind == "out_of_range"
    assert errors.command_error_line('{"error": "flat"}') is None
    assert errors.command_error_line("") is None
    assert errors.command_error_line('[1]') is None


def test_the_node_of_an_outcome_is_a_field() -> None:
    from layerstack._pb import admin_pb2 as pb

    s = layerstack.Session.from_pb(
        pb.Session(id=3, outcome="checkpointed", node="n-7", message="checkpointed as node n-7")
    )
    assert (s.node, s.checkpoint_node) == ("n-7", "n-7")
    s = layerstack.Session.from_pb(pb.Session(id=3, outcome="checkpointed", message="checkpointed as node n-7"))
    assert s.node is None and s.checkpoint_node is None, "never parsed out of the message"
    v = {"id": 4, "outcome": "checkpointed", "node": "n-8", "message": "whatever"}
    assert layerstack.Session.from_json(v).node == "n-8"
    assert layerstack.Session.from_json({"id": 4, "node": None}).node is None


def test_an_asyncio_call_error_is_typed_like_a_blocking_one() -> None:
    # grpc.aio.AioRpcError is a grpc.RpcError but not a grpc.Call: its code
    # must still pick the class (it used to give LayerStackError "unknown").
    import grpc.aio

    e = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details="node n9 does not exist"
    )
    err = errors.from_rpc_error(e)
    assert isinstance(err, errors.NotFoundError)
    assert (err.kind, err.code, err.message) == ("not_found", grpc.StatusCode.NOT_FOUND, "node n9 does not exist")


def test_errors_survive_pickling_between_processes() -> None:
    """Ray (layerstack.ray) carries a worker's errors to the coordinator
    pickled: the class, kind, code, message and a command's fields survive."""
    import pickle

    e = errors.UnavailableError(grpc.StatusCode.UNAVAILABLE, "unavailable", "the daemon is gone")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.UnavailableError
    assert (back.code, back.kind, back.message, str(back)) == (e.code, e.kind, e.message, str(e))
    c = errors.CommandError(["layerstack", "x"], 2, "layerstack: no such command\n")
    cb = pickle.loads(pickle.dumps(c))
    assert (type(cb), cb.argv, cb.returncode, cb.message) == (errors.CommandError, ["layerstack", "x"], 2, "no such command")


def test_a_broken_connection_is_unavailable_and_a_kind_is_not_said_twice() -> None:
    # grpc-core's own INTERNAL when a TLS stream breaks mid-call (a daemon's
    # restart): retryable as any unavailable daemon, not an internal error.
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert type(e) is layerstack.UnavailableError and "call again" in e.message, e
    # The daemon's INTERNAL stays one.
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "cannot write a layer"))
    assert e.kind == "grpc_internal", e
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect: CERTIFICATE_VERIFY_FAILED"))
    assert type(e) is layerstack.UnavailableError and "root_certificates=" in str(e), e
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated: no bearer token"))
    assert str(e) == "unauthenticated: no bearer token", str(e)


@pytest.mark.parametrize("token", ["tok\n", "", "a b", "t\u00e9"])
def test_a_token_grpc_cannot_send_is_refused_by_name(token: str) -> None:
    with pytest.raises(ValueError, match="token"):
        layerstack.connect(target="127.0.0.1:1", token=token, root_certificates=b"-----BEGIN CERTIFICATE-----\n")
