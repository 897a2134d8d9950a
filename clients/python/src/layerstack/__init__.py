"""LayerStack's Python client: Mode B sessions and the SandboxGraph, over the
daemon's admin gRPC API (``api/proto/admin.proto``).

    import layerstack
    ls = layerstack.connect("/run/layerstack/admin.sock")
    g = ls.create_graph("rollouts", "docker.io/library/debian:bookworm@main", key="g1")
    r = ls.run(["sh", "-c", "echo hi > /x"], node=g.root, state={"reward": 1.0}, key="a1")
    ls.promote(r.node, "main", key="p1")

Sandboxes driven over gRPC alone (no root, no binary here):
:meth:`Client.sandbox` and :mod:`layerstack.sandbox`; the asyncio client is
:mod:`layerstack.aio`; docs/sdk.md is the harness author's guide.

See :mod:`layerstack.client` for every call, :mod:`layerstack.types` for the
answers and :mod:`layerstack.errors` for the errors.
"""

from layerstack.client import DEFAULT_ADMIN_ADDRESS, Client, State, connect
from layerstack.sandbox import (
    ExecChunk,
    ExecError,
    ExecOutput,
    FileInfo,
    Files,
    PathChange,
    RunSessionResult,
    Sandbox,
    UploadSummary,
)
from layerstack.errors import (
    AlreadyExistsError,
    BusyError,
    CommandError,
    ConflictError,
    CorruptError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    LayerStackError,
    NoSpaceError,
    DeadlineExceededError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnsupportedError,
)
from layerstack.types import (
    Attempt,
    AttemptStart,
    ConflictPath,
    DryRun,
    ExecResult,
    Graph,
    GraphInfo,
    MergeResult,
    Mount,
    Node,
    PathCounts,
    PathVerdict,
    PromoteResult,
    PullResult,
    PushResult,
    RunResult,
    SandboxLimits,
    Session,
    Status,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADMIN_ADDRESS",
    "Client",
    "State",
    "connect",
    "Sandbox",
    "Files",
    "ExecOutput",
    "ExecChunk",
    "ExecError",
    "RunSessionResult",
    "FileInfo",
    "PathChange",
    "UploadSummary",
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
    "Attempt",
    "AttemptStart",
    "ConflictPath",
    "DryRun",
    "ExecResult",
    "Graph",
    "GraphInfo",
    "MergeResult",
    "Mount",
    "Node",
    "PathCounts",
    "PathVerdict",
    "PromoteResult",
    "PullResult",
    "PushResult",
    "RunResult",
    "SandboxLimits",
    "Session",
    "Status",
]
