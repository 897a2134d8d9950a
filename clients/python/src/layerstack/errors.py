"""Errors of the LayerStack client.

Every failure of the daemon reaches Python as a :class:`LayerStackError` (or one
of its subclasses, one per errdefs kind) carrying the gRPC status code and the
daemon's own message. The daemon maps its error kinds to gRPC codes after
containerd's errdefs in one place (``layerstack_api::code``, STYLE.md "Ours");
this module maps them back. ``kind`` is the kind's one spelling, the same as in
Rust (``layerstack_types::ErrorKind::as_str``), the daemon's logs and metrics,
and the CLI's messages:

=====================  =========================  ================================
gRPC code              ``kind``                   subclass
=====================  =========================  ================================
NOT_FOUND              ``not_found``              :class:`NotFoundError`
ALREADY_EXISTS         ``already_exists``         :class:`AlreadyExistsError`
FAILED_PRECONDITION    ``failed_precondition``    :class:`FailedPreconditionError`
INVALID_ARGUMENT       ``invalid_argument``       :class:`InvalidArgumentError`
ABORTED                ``conflict``               :class:`ConflictError`
UNAVAILABLE            ``unavailable``            :class:`UnavailableError`
RESOURCE_EXHAUSTED     ``busy``                   :class:`BusyError`
UNIMPLEMENTED          ``unsupported``            :class:`UnsupportedError`
DATA_LOSS              ``corrupt``                :class:`CorruptError`
UNKNOWN                ``internal``               :class:`InternalError`
PERMISSION_DENIED      ``permission_denied``      :class:`PermissionDeniedError`
UNAUTHENTICATED        ``unauthenticated``        :class:`UnauthenticatedError`
RESOURCE_EXHAUSTED     ``no_space``               :class:`NoSpaceError`
+ trailer ``layerstack-kind: no_space``
DEADLINE_EXCEEDED      ``deadline_exceeded``      :class:`DeadlineExceededError`
anything else          the code's name, snake     :class:`LayerStackError`
                       case (``cancelled``;
                       INTERNAL is ``grpc_internal``)
=====================  =========================  ================================

RESOURCE_EXHAUSTED is the one code two kinds share (gRPC's code for "the
entire file system is out of space" is also containerd's for a limit): the
daemon names the kind of every error in the ``layerstack-kind`` trailer, and
:func:`from_rpc_error` takes the kind from it when present.

Each subclass also carries its ``kind`` as a class attribute
(``NotFoundError.kind == "not_found"``). ``ResourceExhaustedError`` is the
former name of :class:`BusyError` (the same class).

The ``layerstack`` binary that the client drives for the parts that need
namespaces (``session run|create|exec``) reports its failures with the same
kinds: the client runs it with ``--error-format json``, which prints the error
as one line ``{"error": {"kind": KIND, "message": MESSAGE}}`` on stderr, and
:func:`from_command` raises that kind's class above (``code`` ``None``; the
command line, exit status and stderr in ``argv``, ``returncode``, ``stderr``).
E.g. an unknown node or stack is :class:`NotFoundError`, ``exec`` in a closed
session :class:`FailedPreconditionError`, ``--user bob``
:class:`InvalidArgumentError`, a full cap with ``wait_timeout_s=0``
:class:`BusyError`. Only a binary that cannot be found or started, or that
printed no such line, is a :class:`CommandError` (``kind`` ``"command"``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import grpc

__all__ = [
    "LayerStackError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "ConflictError",
    "UnavailableError",
    "BusyError",
    "ResourceExhaustedError",
    "UnsupportedError",
    "CorruptError",
    "InternalError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "NoSpaceError",
    "DeadlineExceededError",
    "CommandError",
    "BY_CODE",
    "BY_KIND",
    "from_rpc_error",
    "from_command",
    "command_error_line",
    "is_closed_channel",
    "closed_client_error",
]


class LayerStackError(Exception):
    """A refusal or failure of the daemon.

    Attributes:
        code: the gRPC status code (``None`` when the ``layerstack`` binary
            reported the error).
        kind: the errdefs kind, e.g. ``"not_found"`` (table in the module doc).
        message: the daemon's message, unchanged (lowercase, actionable).
        argv, returncode, stderr: for an error the ``layerstack`` binary
            reported (:func:`from_command`): its command line, exit status
            and stderr; ``None`` for an RPC's.
    """

    kind: str
    argv: Optional[List[str]] = None
    returncode: Optional[int] = None
    stderr: Optional[str] = None

    def __init__(self, code: Optional[grpc.StatusCode], kind: str, message: str) -> None:
        # The daemon's message may name its kind already ("unauthenticated: …").
        super().__init__(message if message.startswith(f"{kind}:") else f"{kind}: {message}")
        self.code = code
        self.kind = kind
        self.message = message

    def __reduce__(self) -> Tuple[Any, ...]:
        # Picklable whatever a subclass's __init__ takes: Ray (layerstack.ray)
        # and multiprocessing carry errors between processes, and the default
        # would call __init__ with the message alone.
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(cls: Type[LayerStackError], args: Tuple[Any, ...], state: Dict[str, Any]) -> LayerStackError:
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class _KindError(LayerStackError):
    """A failure of one errdefs kind: ``kind`` (class and instance) is the class's."""


class NotFoundError(_KindError):
    """No such session, stack, branch, graph, node or attempt."""

    kind = "not_found"


class AlreadyExistsError(_KindError):
    """The name is taken (a graph, a branch)."""

    kind = "already_exists"


class FailedPreconditionError(_KindError):
    """Not now: e.g. the session is still mounted, not a running attempt, pruned."""

    kind = "failed_precondition"


class InvalidArgumentError(_KindError):
    """A malformed request: a bad policy, state that is not a JSON object, another stack."""

    kind = "invalid_argument"


class ConflictError(_KindError):
    """errdefs Conflict (gRPC ABORTED): a concurrent change won."""

    kind = "conflict"


class UnavailableError(_KindError):
    """The daemon (or containerd behind it) cannot be reached."""

    kind = "unavailable"


class BusyError(_KindError):
    """A limit is reached and the call asked not to wait: e.g. the cap of live
    sandbox sessions is full (``wait_ms`` ran out)."""

    kind = "busy"


#: The former name of :class:`BusyError` (gRPC RESOURCE_EXHAUSTED).
ResourceExhaustedError = BusyError


class UnsupportedError(_KindError):
    """Refused by design (gRPC UNIMPLEMENTED): a filesystem, a format, a store
    version the daemon does not take."""

    kind = "unsupported"


class CorruptError(_KindError):
    """A stored row or directory is not what it must be (gRPC DATA_LOSS); the
    message names the table and the row, which the daemon left as it is."""

    kind = "corrupt"


class InternalError(_KindError):
    """Anything else that failed in the daemon (gRPC UNKNOWN): i/o, the database,
    a squash that could not be built."""

    kind = "internal"


class PermissionDeniedError(_KindError):
    """The daemon knows the caller and does not allow it: on the admin socket, a
    uid (or effective gid) that the daemon's ``[api] allowed_uids`` /
    ``allowed_gids`` do not list; the message names the uid, the gid and the key
    to change."""

    kind = "permission_denied"


class UnauthenticatedError(_KindError):
    """The caller did not prove who it is: on the daemon's TCP listener, no
    ``authorization: Bearer <token>`` or a token the daemon's ``tokens_file`` does
    not list."""

    kind = "unauthenticated"


class NoSpaceError(_KindError):
    """The filesystem holding the daemon's store is full (``ENOSPC``, a quota,
    or SQLite's ``SQLITE_FULL``): nothing of the call was kept (no layer, no
    moved branch, no base); free space there, then call again. Not a
    :class:`BusyError`: waiting does not help. A Mode B publish that hits it is
    not raised: it ends with outcome ``failed`` whose message says so."""

    kind = "no_space"


class DeadlineExceededError(LayerStackError):
    """A time limit ran out before the call was answered: the ``timeout=``
    of the call (gRPC's deadline, set by the client) or one of the daemon's
    own (``[sandbox] file_stream_idle_s``: an upload or write stream that
    sent nothing for that long was refused and its partial file dropped; a
    read or download stream the client stopped reading was ended).
    Not one of the daemon's error kinds (``layerstack_types::ErrorKind``):
    gRPC's ``DEADLINE_EXCEEDED``; whether the call took effect is unknown
    when the client's deadline ran out, so retry with the same idempotency
    key."""

    kind = "deadline_exceeded"


class CommandError(LayerStackError):
    """The ``layerstack`` binary could not be found or started, or failed without
    printing an error line (:func:`from_command`): a failure it reported with its
    kind is that kind's class instead.

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


#: The gRPC code of every error kind the daemon produces → its class (the
#: inverse of ``layerstack_api::code``).
BY_CODE: Dict[grpc.StatusCode, Type[_KindError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.ABORTED: ConflictError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BusyError,
    grpc.StatusCode.UNIMPLEMENTED: UnsupportedError,
    grpc.StatusCode.DATA_LOSS: CorruptError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


#: Every error kind → its class: the kinds of ``layerstack_types::ErrorKind``,
#: spelled as ``ErrorKind::as_str`` (the ``kind`` of the binary's JSON errors).
_ALL_KINDS: List[Type[_KindError]] = [*BY_CODE.values(), NoSpaceError]
BY_KIND: Dict[str, Type[_KindError]] = {cls.kind: cls for cls in _ALL_KINDS}

#: The trailer in which the daemon names an error's kind (``layerstack_api::KIND_METADATA``).
KIND_METADATA = "layerstack-kind"


def _trailer_kind(e: grpc.RpcError) -> Optional[str]:
    """The kind named in the call's ``layerstack-kind`` trailer, if any."""
    md = getattr(e, "trailing_metadata", None)
    try:
        pairs = md() if callable(md) else None
    except Exception:  # noqa: BLE001 - a call without trailers
        return None
    for k, v in pairs or ():
        if k == KIND_METADATA:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def _code_kind(code: grpc.StatusCode) -> str:
    """The kind of a code no error kind maps to, as ``layerstack_api::kind_name``
    spells it."""
    if code == grpc.StatusCode.INTERNAL:
        return "grpc_internal"
    return code.name.lower()


def from_rpc_error(e: grpc.RpcError) -> LayerStackError:
    """The typed error for a failed call: a blocking call's ``grpc.RpcError``
    (also a ``grpc.Call``) or an asyncio call's ``grpc.aio.AioRpcError``
    (which is not a ``grpc.Call`` but has the same ``code()`` and
    ``details()``)."""
    code_of = getattr(e, "code", None)
    details_of = getattr(e, "details", None)
    code: Optional[grpc.StatusCode] = code_of() if callable(code_of) else None
    details = details_of() if callable(details_of) else None
    message = details or str(e)
    if code is None:
        return LayerStackError(None, "unknown", message)
    if code == grpc.StatusCode.UNAVAILABLE and "Permission denied" in message and "connect" in message:
        # The admin socket is 0660 with an ACL for the daemon's `[api]` uids
        # and gids: anyone else is refused by the kernel at connect(2), before
        # the daemon's own check could name the remedy.
        return PermissionDeniedError(
            code,
            PermissionDeniedError.kind,
            f"permission denied: uid {os.geteuid()} (gid {os.getegid()}) may not connect to the "
            "LayerStack daemon's admin socket: only root and the uids and gids in the daemon's "
            f"[api] allowed_uids / allowed_gids may; ask its operator to add yours, or run as root ({message})",
        )
    if code == grpc.StatusCode.INTERNAL and message.startswith("Internal error from Core"):
        # grpc-core's own error when the connection breaks mid-call (a TLS
        # stream cut by a daemon's restart): no status of the daemon's.
        return UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            UnavailableError.kind,
            f"the connection to the daemon broke during the call ({message}): call again once it answers",
        )
    if code == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in message:
        message += (
            " — the daemon's TLS certificate was not verified: pass root_certificates= (the CA that signed "
            "its [api.tcp] cert) and, if the certificate names another host, server_name="
        )
    named = BY_KIND.get(_trailer_kind(e) or "")
    if named is not None:
        return named(code, named.kind, message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(code, DeadlineExceededError.kind, message)
    cls = BY_CODE.get(code)
    if cls is None:
        return LayerStackError(code, _code_kind(code), message)
    return cls(code, cls.kind, message)


def is_closed_channel(e: BaseException) -> bool:
    """Whether ``e`` is grpc's refusal of a call on a channel this program
    closed (blocking: ``ValueError("Cannot invoke RPC on closed channel!")``;
    asyncio: ``grpc.aio.UsageError("Channel is closed.")``)."""
    return isinstance(e, (ValueError, getattr(grpc.aio, "UsageError", ValueError))) and "closed" in str(e)


def closed_client_error() -> LayerStackError:
    """The error of a call on a client that was closed: a
    :class:`FailedPreconditionError` that says to connect again."""
    return FailedPreconditionError(
        None,
        FailedPreconditionError.kind,
        "this LayerStack client is closed (its close() ran, or its with block ended): "
        "connect again (layerstack.connect / layerstack.aio.connect)",
    )


def command_error_line(stderr: str) -> Optional[Dict[str, str]]:
    """The error the ``layerstack`` binary printed with ``--error-format json``:
    ``{"kind": …, "message": …}`` from its last non-empty line on stderr, or
    ``None`` when that line is not such an object."""
    lines = [l for l in stderr.splitlines() if l.strip()]
    if not lines:
        return None
    try:
        v = json.loads(lines[-1])
    except ValueError:
        return None
    e = v.get("error") if isinstance(v, dict) else None
    if not (isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("message"), str)):
        return None
    return {"kind": e["kind"], "message": e["message"]}


def from_command(argv: Sequence[str], returncode: Optional[int], stderr: str) -> LayerStackError:
    """The typed error of a failed run of the ``layerstack`` binary (run with
    ``--error-format json``): the class of the printed ``kind``
    (:data:`BY_KIND`, and :class:`DeadlineExceededError` for
    ``deadline_exceeded``; another kind no class has is a plain
    :class:`LayerStackError`), or :class:`CommandError` when it printed no
    error line. ``argv``, ``returncode`` and ``stderr`` are kept on it."""
    line = command_error_line(stderr)
    if line is None:
        return CommandError(argv, returncode, stderr)
    cls: Optional[Type[LayerStackError]] = BY_KIND.get(line["kind"])
    if cls is None and line["kind"] == DeadlineExceededError.kind:
        cls = DeadlineExceededError
    e = cls(None, cls.kind, line["message"]) if cls else LayerStackError(None, line["kind"], line["message"])
    e.argv = list(argv)
    e.returncode = returncode
    e.stderr = stderr
    return e
