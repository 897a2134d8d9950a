"""Errors of the LayerStack client.

Every failure of the daemon reaches Python as a :class:`LayerStackError` (or one
of its subclasses, one per errdefs kind) carrying the gRPC status code and the
daemon's own message. The daemon maps its errors to gRPC codes after
containerd's errdefs (STYLE.md "Ours"); this module maps them back to a kind:

=====================  ======================  ==============================
gRPC code              ``kind``                subclass
=====================  ======================  ==============================
NOT_FOUND              ``not-found``           :class:`NotFoundError`
ALREADY_EXISTS         ``already-exists``      :class:`AlreadyExistsError`
FAILED_PRECONDITION    ``failed-precondition`` :class:`FailedPreconditionError`
INVALID_ARGUMENT       ``invalid-argument``    :class:`InvalidArgumentError`
ABORTED                ``conflict``            :class:`ConflictError`
UNAVAILABLE            ``unavailable``         :class:`UnavailableError`
RESOURCE_EXHAUSTED     ``resource-exhausted``  :class:`ResourceExhaustedError`
anything else          the code's name         :class:`LayerStackError`
=====================  ======================  ==============================

A failure of the ``layerstack`` binary that the client drives for the parts
that need namespaces (``session run|create|exec``) is a :class:`CommandError`
(``code`` is ``None`` there; ``kind`` is ``"command"``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Type

import grpc

__all__ = [
    "LayerStackError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "ConflictError",
    "UnavailableError",
    "ResourceExhaustedError",
    "CommandError",
]


class LayerStackError(Exception):
    """A refusal or failure of the daemon.

    Attributes:
        code: the gRPC status code (``None`` for a :class:`CommandError`).
        kind: the errdefs kind, e.g. ``"not-found"`` (table in the module doc).
        message: the daemon's message, unchanged (lowercase, actionable).
    """

    def __init__(self, code: Optional[grpc.StatusCode], kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.code = code
        self.kind = kind
        self.message = message


class NotFoundError(LayerStackError):
    """No such session, stack, branch, graph, node or attempt."""


class AlreadyExistsError(LayerStackError):
    """The name is taken (a graph, a branch)."""


class FailedPreconditionError(LayerStackError):
    """Not now: e.g. the session is still mounted, not a running attempt, pruned."""


class InvalidArgumentError(LayerStackError):
    """A malformed request: a bad policy, state that is not a JSON object, another stack."""


class ConflictError(LayerStackError):
    """errdefs Conflict (gRPC ABORTED): a concurrent change won."""


class UnavailableError(LayerStackError):
    """The daemon (or containerd behind it) cannot be reached."""


class ResourceExhaustedError(LayerStackError):
    """The cap of live sandbox sessions is full (``wait_ms`` ran out)."""


class CommandError(LayerStackError):
    """The ``layerstack`` binary failed before the command ran (exit 125, or an error
    exit of ``session create``), or could not be started.

    Attributes:
        argv: the command line run.
        returncode: its exit status (``None`` when it could not start).
        stderr: what it wrote on stderr (decoded, replacement characters for bad bytes).
    """

    def __init__(self, argv: Sequence[str], returncode: Optional[int], stderr: str) -> None:
        msg = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
        if msg.startswith("layerstack: "):
            msg = msg[len("layerstack: ") :]
        super().__init__(None, "command", msg)
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


_BY_CODE: Dict[grpc.StatusCode, "tuple[str, Type[LayerStackError]]"] = {
    grpc.StatusCode.NOT_FOUND: ("not-found", NotFoundError),
    grpc.StatusCode.ALREADY_EXISTS: ("already-exists", AlreadyExistsError),
    grpc.StatusCode.FAILED_PRECONDITION: ("failed-precondition", FailedPreconditionError),
    grpc.StatusCode.INVALID_ARGUMENT: ("invalid-argument", InvalidArgumentError),
    grpc.StatusCode.ABORTED: ("conflict", ConflictError),
    grpc.StatusCode.UNAVAILABLE: ("unavailable", UnavailableError),
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("resource-exhausted", ResourceExhaustedError),
}


def from_rpc_error(e: grpc.RpcError) -> LayerStackError:
    """The typed error for a failed call (``grpc.RpcError`` is also a ``grpc.Call``)."""
    code: Optional[grpc.StatusCode] = e.code() if isinstance(e, grpc.Call) else None
    details = e.details() if isinstance(e, grpc.Call) else None
    message = details or str(e)
    if code is None:
        return LayerStackError(None, "unknown", message)
    kind, cls = _BY_CODE.get(code, (code.name.lower().replace("_", "-"), LayerStackError))
    return cls(code, kind, message)
