"""Sandboxes: daemon-owned sessions driven over gRPC alone — no subprocess, no
root and no ``layerstack`` binary on the caller's host.

    import layerstack
    with layerstack.connect(target="sandboxes:7443", root_certificates="ca.pem") as ls:
        with ls.sandbox(node=root, key="step7/p3/s12/a0") as sb:
            out = sb.exec(["python3", "-m", "pytest", "-q"], timeout_s=600)
            sb.files.write("/work/notes.txt", "tried the fix\\n")
            node = sb.close(checkpoint=True, state={"reward": 1.0 if out.ok else 0.0}).node

The daemon starts the session's init and owns it (``CreateSessionRequest.sandbox``,
api/proto/admin.proto "Daemon-owned sessions"); :class:`Sandbox` wraps the RPCs
that serve it: ``Exec`` (streamed output), the file RPCs (beneath the session's
root, resolved by the kernel inside it: a symlink never leads to the daemon's
host), the dry run of a publish as the live diff, and ``CloseSession`` with the
end action and the node's state in one call.

Leaving a ``with`` block without :meth:`Sandbox.close` discards the session's
writes (an exception inside the block included): nothing a failed step wrote is
published or checkpointed by accident. The asyncio twin is :mod:`layerstack.aio`.

Units: sizes in bytes, durations in milliseconds (``*_ms``) or seconds (``*_s``
arguments), times in nanoseconds since the Unix epoch (``*_ns``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import io
import json
import math
import numbers
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc

from layerstack._channel import MAX_MESSAGE_BYTES
from layerstack._pb import admin_pb2 as pb
from layerstack.errors import closed_client_error, from_rpc_error, is_closed_channel
from layerstack.types import Session

if TYPE_CHECKING:
    from layerstack.client import Client

__all__ = [
    "Sandbox",
    "Files",
    "ExecOutput",
    "ExecChunk",
    "RunSessionResult",
    "FileInfo",
    "PathChange",
    "UploadSummary",
    "CHUNK_BYTES",
]

#: Size of the chunks file content and tar streams are sent in (64 KiB, the
#: daemon's own chunk size).
CHUNK_BYTES = 64 * 1024

#: ``argv`` as a list, or one string run by ``/bin/sh -c``.
Command = Union[str, Sequence[str]]
#: ``(uid, gid)``.
User = Tuple[int, int]
#: File content: bytes, text (UTF-8) or an open binary file.
Content = Union[bytes, str, BinaryIO]

_END_ACTIONS = {
    "auto": pb.AUTO,
    "publish": pb.PUBLISH,
    "discard": pb.DISCARD,
    "checkpoint": pb.CHECKPOINT,
}


@dataclass(frozen=True)
class ExecChunk:
    """A piece of a running command's output: ``stream`` is ``"stdout"`` or
    ``"stderr"`` (the two are not ordered with each other)."""

    stream: str
    data: bytes


@dataclass(frozen=True)
class ExecOutput:
    """How a command ended, with its whole output.

    ``exit_code`` is a shell's ``$?`` (128 + n when signal n ended it; 127: not
    found, 126: not executable); ``start_failed`` says the command was never
    started (not found, not executable, or its working directory or user
    could not be set: code 125; stderr says why) — unlike a script's own
    ``exit 127``; ``signal`` the signal (0 if it exited);
    ``timed_out`` the command outlived ``timeout_s`` and was killed;
    ``duration_ms`` from its start to its end. With limits
    (``Client.sandbox(cpu_millis=, memory_bytes=, pids=)``): ``oom_killed``
    the kernel's OOM killer ended a process of the sandbox while the command
    ran (its memory limit was reached) and the command died of SIGKILL
    (``signal`` 9); ``session_memory_peak_bytes`` the sandbox's highest memory
    use so far (with a memory limit) and ``session_cpu_usec`` the CPU time of
    all its processes so far, microseconds (both 0 without a limit).

    In a WASI sandbox (``executor="wasi"``): ``trap`` says why the module
    stopped other than by exiting — ``out_of_fuel``, ``deadline`` (also
    ``timed_out``), ``memory_limit``, ``trap`` (a wasm trap) or ``cancelled``
    (the sandbox was closed meanwhile); "" when it exited. A trapped run has
    ``exit_code`` 134, as the wasmtime CLI. ``trap_message`` is wasmtime's
    text with the wasm backtrace; ``fuel_used`` the fuel the run used;
    ``module_digest`` ``sha256:<hex>`` of the module (pass it as ``cmd[0]`` to
    run it again without sending it); ``module_compiled`` whether this run
    compiled it (false: the daemon's cache had it); ``stdout_truncated`` /
    ``stderr_truncated``: the output reached the sandbox's bound (1 MiB by
    default) and what was written beyond it was dropped."""

    exit_code: int
    signal: int
    timed_out: bool
    duration_ms: int
    stdout: bytes = b""
    stderr: bytes = b""
    oom_killed: bool = False
    session_memory_peak_bytes: int = 0
    session_cpu_usec: int = 0
    trap: str = ""
    trap_message: str = ""
    fuel_used: int = 0
    module_digest: str = ""
    module_compiled: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    start_failed: bool = False

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.exit_code == 0

    def text(self, encoding: str = "utf-8") -> str:
        """stdout decoded (undecodable bytes replaced)."""
        return self.stdout.decode(encoding, errors="replace")

    @classmethod
    def _from_exit(cls, e: Any, stdout: bytes = b"", stderr: bytes = b"") -> "ExecOutput":
        return cls(
            exit_code=e.code,
            signal=e.signal,
            timed_out=e.timed_out,
            duration_ms=e.duration_ms,
            stdout=stdout,
            stderr=stderr,
            oom_killed=e.oom_killed,
            session_memory_peak_bytes=e.session_memory_peak_bytes,
            session_cpu_usec=e.session_cpu_usec,
            trap=e.trap,
            trap_message=e.trap_message,
            fuel_used=e.fuel_used,
            module_digest=e.module_digest,
            module_compiled=e.module_compiled,
            stdout_truncated=e.stdout_truncated,
            stderr_truncated=e.stderr_truncated,
            start_failed=e.start_failed,
        )


@dataclass(frozen=True)
class FileInfo:
    """A path's metadata (``lstat``: a symlink is described, not followed).

    ``kind``: file | dir | symlink | fifo | char | block | socket; ``mode`` the
    permission bits with setuid/setgid/sticky; ``raw_name`` the exact bytes of
    ``name``; ``link_target`` a symlink's target as stored."""

    name: str
    raw_name: bytes
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    link_target: Optional[str] = None

    @classmethod
    def from_pb(cls, s: Any) -> "FileInfo":
        return cls(
            name=s.name,
            raw_name=bytes(s.raw_name),
            kind=s.kind,
            size=s.size,
            mode=s.mode,
            uid=s.uid,
            gid=s.gid,
            mtime_ns=s.mtime_ns,
            link_target=s.link_target or None,
        )


@dataclass(frozen=True)
class PathChange:
    """One path a sandbox changed against the tree it started from.

    ``path`` display-escaped with a leading ``/`` (``raw_path`` its exact
    bytes, relative); ``change`` added | modified | deleted; kinds file | dir |
    symlink | fifo | char | block | socket, ``None`` where absent; sizes in
    bytes; modes the permission bits; ``patch`` the unified diff of a text file
    when asked for."""

    path: str
    raw_path: bytes
    change: str
    old_kind: Optional[str]
    new_kind: Optional[str]
    old_size: int
    new_size: int
    old_mode: int
    new_mode: int
    patch: Optional[str] = None

    @classmethod
    def from_pb(cls, e: Any) -> "PathChange":
        return cls(
            path=e.path,
            raw_path=bytes(e.raw_path),
            change=e.change,
            old_kind=e.old_kind or None,
            new_kind=e.new_kind or None,
            old_size=e.old_size,
            new_size=e.new_size,
            old_mode=e.old_mode,
            new_mode=e.new_mode,
            patch=e.patch or None,
        )


@dataclass(frozen=True)
class UploadSummary:
    """What an upload extracted: entries by kind and ``bytes`` of file content."""

    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    bytes: int


# ------------------------------------------------------------------ requests
# Shared by the blocking and the asyncio sandboxes: one place builds each
# request, so both refuse the same mistakes the same way.


def argv_of(cmd: Command) -> List[str]:
    """``cmd`` as an argv: a string runs under ``/bin/sh -c``; a sequence of
    str (or :class:`os.PathLike`, or bytes decoded as file names are) is the
    argv. TypeError naming the argument for anything else (an int in the
    argv is not quietly made a string: ``["sleep", 1]`` is a slip, not a
    command)."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("exec needs a command: give argv or a shell string (this one is blank)")
        return ["/bin/sh", "-c", cmd]
    if isinstance(cmd, (bytes, bytearray, collections.abc.Mapping)) or not isinstance(
        cmd, collections.abc.Iterable
    ):
        raise TypeError(
            f"command must be a str (run by /bin/sh -c) or a list of str (an argv), not {type(cmd).__name__}"
        )
    argv = []
    for i, a in enumerate(cmd):
        if isinstance(a, (os.PathLike, bytes)):
            a = os.fsdecode(a)
        if not isinstance(a, str):
            raise TypeError(f"command[{i}] is {type(a).__name__} {a!r}: every argv item must be a str")
        argv.append(a)
    if not argv or not argv[0]:
        raise ValueError("exec needs a command: give argv (its first item the program) or a shell string")
    return argv


def path_arg(path: Any, what: str = "path") -> str:
    """A path argument of the file calls as the str the daemon takes: a str,
    UTF-8 bytes or an :class:`os.PathLike` (``pathlib.PurePosixPath``).
    TypeError naming ``what`` otherwise (``None`` would be sent as an empty
    path: the root)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        try:
            path = path.decode()
        except UnicodeDecodeError:
            raise ValueError(f"{what} {path!r} is not UTF-8: the daemon takes UTF-8 paths") from None
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str (a path in the sandbox), not {type(path).__name__}")
    return path


def state_json(state: Any) -> str:
    """A node's logical state as the daemon takes it: a str as given (JSON
    text), a mapping (or pairs) as JSON; ``None``: "". TypeError naming
    ``state`` for anything else, or a value JSON cannot hold."""
    if state is None:
        return ""
    if isinstance(state, str):
        return state
    try:
        d = dict(state)
    except (TypeError, ValueError):
        raise TypeError(
            f"state= must be a mapping (stored as JSON) or a str, not {type(state).__name__}"
        ) from None
    try:
        return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"state= must be JSON-serializable: {e}") from None


def optional_str(what: str, v: Any) -> str:
    """``v`` (a str or None) as the request's string ("" for None); TypeError
    naming ``what`` otherwise."""
    if v is None:
        return ""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str or None, not {type(v).__name__} {v!r}")
    return v


def env_list(env: Optional[Mapping[str, str]]) -> List[str]:
    """``env`` as ``NAME=value`` items; TypeError unless it is a mapping of
    str to str (``{"FOO": 1}`` is a slip, not ``FOO=1``)."""
    if env is None:
        return []
    if not isinstance(env, collections.abc.Mapping):
        raise TypeError(f"env must be a mapping of str to str (e.g. {{'FOO': '1'}}), not {type(env).__name__}")
    out = []
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"env[{k!r}] = {v!r}: names and values must be str")
        if not k or "=" in k:
            raise ValueError(f"environment variable name {k!r}: give a non-empty name without '='")
        out.append(f"{k}={v}")
    return out


def user_arg(what: str, v: Any) -> Optional[Tuple[int, int]]:
    """A (uid, gid) argument, or None. TypeError naming ``what`` unless it
    is a pair of whole numbers; ValueError outside 0..2**32."""
    if v is None:
        return None
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(_whole(x) for x in v):
        raise TypeError(f"{what}={v!r}: give (uid, gid), two whole numbers")
    if not all(0 <= x < 2**32 for x in v):
        raise ValueError(f"{what}={v!r}: uid and gid are in 0..2**32")
    return (int(v[0]), int(v[1]))


def _whole(v: Any) -> bool:
    """A whole number (``int``, ``numpy.int64``…: :class:`numbers.Integral`), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def count_arg(what: str, v: Any) -> int:
    """A whole number >= 0 (a byte offset or count); TypeError / ValueError
    naming ``what``."""
    if not _whole(v):
        raise TypeError(f"{what} must be a whole number, not {type(v).__name__}")
    if not 0 <= v < 2**63:
        raise ValueError(f"{what}={v}: give a whole number from 0 to 2**63 - 1")
    return int(v)


def seconds_arg(what: str, v: Any) -> Optional[float]:
    """A positive number of seconds, or None; TypeError / ValueError naming ``what``."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, not {type(v).__name__}")
    if not v > 0:
        raise ValueError(f"{what}={v}: give a positive number of seconds, or None for no limit")
    return float(v)


def millis_arg(what: str, seconds: Optional[float], most: int = 2**32 - 1) -> int:
    """``seconds`` (from :func:`seconds_arg`) as whole milliseconds, rounded
    up — a positive limit is never 0, which the daemon reads as "no limit";
    ValueError naming ``what`` above ``most`` ms. None: 0."""
    if seconds is None:
        return 0
    if not seconds * 1000 <= most:
        raise ValueError(f"{what}={seconds}: give at most {most / 1000:.0f} seconds, or None for no limit")
    return math.ceil(seconds * 1000)


def exec_request(
    session_id: int,
    cmd: Command,
    *,
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[User],
    stdin: Union[bytes, str, None],
    timeout_s: Optional[float],
    module: Union[bytes, "os.PathLike[str]", None] = None,
) -> Any:
    timeout_s = seconds_arg("timeout_s", timeout_s)
    user = user_arg("user", user)
    if stdin is not None and not isinstance(stdin, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"stdin must be bytes or str, not {type(stdin).__name__}")
    data = stdin.encode() if isinstance(stdin, str) else bytes(stdin or b"")
    req = pb.ExecRequest(
        session_id=session_id,
        argv=argv_of(cmd),
        env=env_list(env),
        cwd=optional_str("cwd", cwd),
        stdin=data,
        timeout_ms=millis_arg("timeout_s", timeout_s),
    )
    if module is not None:
        if isinstance(module, str):
            raise ValueError("module takes the module's bytes or a pathlib.Path of a local .wasm file, not a str")
        if isinstance(module, (bytes, bytearray, memoryview)):
            req.module = bytes(module)
        else:
            # At most one byte past the limit: a device or a FIFO is refused,
            # never read whole.
            with open(Path(module), "rb") as f:
                req.module = f.read(MAX_WASI_MODULE_BYTES + 1)
        if len(req.module) > MAX_WASI_MODULE_BYTES:
            raise ValueError(
                f"module is more than {MAX_WASI_MODULE_BYTES} bytes (64 MiB), what a run takes: make it smaller "
                "(wasm-opt, strip its debug sections)"
            )
        if not req.module:
            raise ValueError("module is empty: give a WebAssembly module (a .wasm binary built for wasm32-wasi)")
    if user is not None:
        req.has_user, req.uid, req.gid = True, user[0], user[1]
    check_size(req, stdin=len(req.stdin), module=len(req.module), env=sum(len(e) for e in req.env))
    return req


#: The largest WASI module a run takes, bytes (the daemon's
#: ``layerstack_api::MAX_WASI_MODULE_BYTES``).
MAX_WASI_MODULE_BYTES = 64 << 20


def check_size(req: Any, **parts: int) -> None:
    """ValueError when request ``req`` exceeds the daemon's message limit
    (:data:`layerstack._channel.MAX_MESSAGE_BYTES`), naming the largest of
    ``parts`` (field name → bytes) — the call would be refused by gRPC with
    no word of which argument to shrink."""
    size = req.ByteSize()
    if size <= MAX_MESSAGE_BYTES:
        return
    field, n = max(parts.items(), key=lambda kv: kv[1])
    raise ValueError(
        f"the request is {size} bytes, more than the {MAX_MESSAGE_BYTES} a call carries; {field}= is {n} bytes: "
        "send large data as a file instead (files.write or files.upload, which stream), then read it in the sandbox"
    )


#: Executors of :meth:`layerstack.Client.sandbox`.
EXECUTORS = ("linux", "wasi")


def wasi_options(
    *,
    env: Optional[Mapping[str, str]],
    fuel: Optional[int],
    memory_bytes: Optional[int],
    run_timeout_s: Optional[float],
    **linux_only: Any,
) -> Any:
    """``WasiOptions`` of a WASI sandbox; the Linux-only arguments given
    (not None, not False) are refused by name."""
    given = sorted(k for k, v in linux_only.items() if v not in (None, False))
    if given:
        raise ValueError(
            f"{', '.join(given)}: not for executor='wasi' (a WASI module has no user, network, "
            "hostname, working directory or process limits); give fuel=, memory_bytes= or run_timeout_s="
        )
    for field, v in (("fuel", fuel), ("memory_bytes", memory_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{field}={v!r}: give a whole number > 0, or None (the daemon's default)")
    run_timeout_s = seconds_arg("run_timeout_s", run_timeout_s)
    return pb.WasiOptions(
        fuel=fuel or 0,
        memory_bytes=memory_bytes or 0,
        deadline_ms=millis_arg("run_timeout_s", run_timeout_s, 2**64 - 1),
        env=env_list(env),
    )


def sandbox_options(
    *,
    network: bool,
    user: Optional[User],
    workdir: Optional[str],
    env: Optional[Mapping[str, str]],
    hostname: Optional[str],
    cpu_millis: Optional[int] = None,
    memory_bytes: Optional[int] = None,
    pids: Optional[int] = None,
    mount_at: Optional[str] = None,
    id_map: Optional[Tuple[int, int, int]] = None,
) -> Any:
    user = user_arg("user", user)
    if mount_at is not None and not str(mount_at).startswith("/"):
        raise ValueError(f"mount_at={mount_at!r}: give an absolute directory on the daemon's host")
    o = pb.SandboxOptions(
        network=network,
        workdir=optional_str("workdir", workdir),
        env=env_list(env),
        hostname=optional_str("hostname", hostname),
        placement=str(mount_at) if mount_at is not None else "",
    )
    if user is not None:
        o.has_user, o.uid, o.gid = True, user[0], user[1]
    # None: the daemon's default ([sandbox] default_*); 0: no limit. The
    # daemon checks the ranges (InvalidArgumentError naming the field).
    for field, v in (("cpu_millis", cpu_millis), ("memory_bytes", memory_bytes), ("pids", pids)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{field}={v!r}: give a whole number >= 0 (0: no limit) or None (the daemon's default)")
        setattr(o, field, v)
    if id_map is not None:
        if len(id_map) != 3 or any(
            isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32 for v in id_map
        ):
            raise ValueError(f"id_map={id_map!r}: give (host_uid, host_gid, size), whole numbers in 0..2**32")
        o.id_map.CopyFrom(pb.IdMap(host_uid=id_map[0], host_gid=id_map[1], size=id_map[2]))
    return o


def executor_options(
    executor: str,
    *,
    network: bool,
    user: Optional[User],
    workdir: Optional[str],
    env: Optional[Mapping[str, str]],
    hostname: Optional[str],
    cpu_millis: Optional[int],
    memory_bytes: Optional[int],
    pids: Optional[int],
    mount_at: Optional[str],
    fuel: Optional[int],
    run_timeout_s: Optional[float],
    id_map: Optional[Tuple[int, int, int]] = None,
) -> Tuple[Any, Any]:
    """``(SandboxOptions, None)`` for ``executor="linux"``, ``(None,
    WasiOptions)`` for ``"wasi"`` (``CreateSessionRequest.sandbox`` /
    ``.wasi``)."""
    if executor == "wasi":
        return None, wasi_options(
            env=env,
            fuel=fuel,
            memory_bytes=memory_bytes,
            run_timeout_s=run_timeout_s,
            network=network,
            user=user,
            workdir=workdir,
            hostname=hostname,
            cpu_millis=cpu_millis,
            pids=pids,
            mount_at=mount_at,
            id_map=id_map,
        )
    if executor != "linux":
        raise ValueError(f"executor={executor!r}: give one of {', '.join(EXECUTORS)}")
    if fuel is not None or run_timeout_s is not None:
        raise ValueError("fuel= and run_timeout_s= are for executor='wasi'")
    return (
        sandbox_options(
            network=network,
            user=user,
            workdir=workdir,
            env=env,
            hostname=hostname,
            cpu_millis=cpu_millis,
            memory_bytes=memory_bytes,
            pids=pids,
            mount_at=mount_at,
            id_map=id_map,
        ),
        None,
    )


def create_request(
    namespace: str,
    *,
    stack: Optional[str],
    node: Optional[str],
    branch: str,
    name: str,
    key: Optional[str],
    exit_policy: Optional[str],
    wait_s: float,
    options: Any,
    ignore_mtime: bool = False,
    wasi: Any = None,
) -> Any:
    if (stack is None) == (node is None):
        raise ValueError("give exactly one of stack= (a stack, image or base digest) and node= (a graph node)")
    for what, v in (
        ("stack", stack),
        ("node", node),
        ("branch", branch),
        ("name", name),
        ("key", key),
        ("exit_policy", exit_policy),
    ):
        optional_str(what, v)
    if isinstance(wait_s, bool) or not isinstance(wait_s, numbers.Real):
        raise TypeError(f"wait_s must be a number of seconds, not {type(wait_s).__name__}")
    if wait_s < 0:
        raise ValueError(f"wait_s={wait_s}: give 0 (answer BusyError at once when the pool is full) or more")
    return pb.CreateSessionRequest(
        namespace=namespace,
        stack=stack or "",
        node=node or "",
        branch=branch,
        name=name,
        idempotency_key=key or "",
        policy=exit_policy or "",
        wait_ms=int(wait_s * 1000),
        sandbox=options if wasi is None else None,
        wasi=wasi,
        ignore_mtime=ignore_mtime,
    )


def close_request(
    session_id: int,
    *,
    action: Optional[str],
    checkpoint: bool,
    publish: bool,
    state: Union[Mapping[str, Any], str, None],
    labels: Optional[Mapping[str, str]],
    reason: str,
    command: str,
    exit_status: Optional[int] = None,
) -> Any:
    for what, v in (("reason", reason), ("command", command)):
        if not isinstance(v, str):
            raise TypeError(f"{what} must be a str, not {type(v).__name__}")
    chosen = [a for a, on in (("checkpoint", checkpoint), ("publish", publish)) if on]
    if action is not None:
        chosen.append(action)
    if len(chosen) > 1:
        raise ValueError(f"give one end action, not {' and '.join(chosen)}")
    act = chosen[0] if chosen else "discard"
    if act not in _END_ACTIONS:
        raise ValueError(f"end action {act!r}: give one of {', '.join(_END_ACTIONS)}")
    if (state is not None or labels) and act not in ("checkpoint", "auto"):
        raise ValueError("state= and labels= are recorded with a checkpoint: close with checkpoint=True")
    st = state_json(state)
    req = pb.CloseSessionRequest(
        session_id=session_id, action=_END_ACTIONS[act], reason=reason, state=st, command=command
    )
    for k, v in (labels or {}).items():
        req.labels[k] = str(v)
    if exit_status is not None:
        if not _whole(exit_status):
            raise TypeError(f"exit_status must be a whole number 0..255, not {type(exit_status).__name__}")
        exit_status = int(exit_status)
        if not 0 <= exit_status <= 255:
            raise ValueError(f"exit_status={exit_status}: give 0..255 (a shell's $?)")
        req.has_exit_status, req.exit_status = True, exit_status
    return req


def content_chunks(data: Content) -> Iterator[bytes]:
    """``data`` in chunks of :data:`CHUNK_BYTES` (text is UTF-8)."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        b = bytes(data)
        for i in range(0, len(b), CHUNK_BYTES):
            yield b[i : i + CHUNK_BYTES]
        return
    while True:
        c = data.read(CHUNK_BYTES)
        if not c:
            return
        yield c


def check_content(what: str, data: Any, *, paths: bool = False) -> None:
    """TypeError naming ``what`` unless ``data`` is bytes, str or a binary
    file object (or, with ``paths``, a :class:`pathlib.Path`): checked
    before a call, since gRPC reads the request stream on its own (and
    would report a bad item as its own failure)."""
    kinds: tuple = (bytes, bytearray, memoryview, str) + ((os.PathLike,) if paths else ())
    if isinstance(data, kinds) or callable(getattr(data, "read", None)):
        return
    also = ", a pathlib.Path" if paths else ""
    raise TypeError(f"{what} must be bytes, str{also} or a binary file object (with read()), not {type(data).__name__}")


class Feed:
    """A request stream that keeps its source's own error (a file object's
    ``read`` raising): gRPC reports such an error as its own ("Exception
    iterating requests!"); the call raises the source's error instead
    (:meth:`raise_source_error`)."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self.error: Optional[BaseException] = None

    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException as e:
            self.error = e
            raise

    def raise_source_error(self) -> None:
        """Raises the source's error, if it had one (call from ``except``)."""
        if self.error is not None:
            raise self.error


def write_requests(
    session_id: int, path: str, data: Content, *, mode: int, make_parents: bool, owner: Optional[User]
) -> Feed:
    check_content("data", data)
    owner = user_arg("owner", owner)
    if not _whole(mode):
        raise TypeError(f"mode must be a whole number (e.g. 0o644), not {type(mode).__name__}")
    mode = int(mode)
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode={mode:#o}: give permission bits, 0..0o7777")
    h = pb.WriteFileHeader(session_id=session_id, path=path_arg(path), mode=mode, has_mode=True, make_parents=make_parents)
    if owner is not None:
        h.has_owner, h.uid, h.gid = True, owner[0], owner[1]
    return Feed(_write_stream(h, data))


def _write_stream(h: Any, data: Content) -> Iterator[Any]:
    yield pb.WriteFileRequest(header=h)
    for c in content_chunks(data):
        yield pb.WriteFileRequest(data=c)


def upload_requests(
    session_id: int, path: str, tar: Union[bytes, BinaryIO, "os.PathLike[str]"], make_parents: bool
) -> Feed:
    # Checked here, not in the generator: gRPC drains it on another thread.
    if isinstance(tar, str):
        raise ValueError("upload takes the tar's bytes, an open binary file or a pathlib.Path, not a str")
    check_content("tar", tar, paths=True)
    return Feed(_upload_stream(session_id, path_arg(path, "directory"), tar, make_parents))


def _upload_stream(
    session_id: int, path: str, tar: Union[bytes, BinaryIO, "os.PathLike[str]"], make_parents: bool
) -> Iterator[Any]:
    yield pb.UploadTarRequest(session_id=session_id, path=path, make_parents=make_parents)
    if isinstance(tar, os.PathLike):
        with open(tar, "rb") as f:
            for c in content_chunks(f):
                yield pb.UploadTarRequest(data=c)
        return
    for c in content_chunks(tar):
        yield pb.UploadTarRequest(data=c)


def upload_summary(r: Any) -> UploadSummary:
    return UploadSummary(files=r.files, dirs=r.dirs, symlinks=r.symlinks, hardlinks=r.hardlinks, bytes=r.bytes)


def exec_item(r: Any) -> Union[ExecChunk, ExecOutput, None]:
    """One ``ExecReply`` as what the exec streams yield (``None``: an empty reply)."""
    which = r.WhichOneof("kind")
    if which == "exit":
        return ExecOutput._from_exit(r.exit)
    if which is None:
        return None
    return ExecChunk(which, getattr(r, which))


class ExecFold:
    """Folds an exec stream's items into one :class:`ExecOutput` (shared by the
    blocking and the asyncio ``exec``); ``cmd``, the command as given, is
    named by an :class:`ExecError`."""

    def __init__(self, cmd: Optional[Command] = None) -> None:
        self._out, self._err = io.BytesIO(), io.BytesIO()
        self._end: Optional[ExecOutput] = None
        self._cmd = cmd

    def add(self, item: Union[ExecChunk, ExecOutput]) -> None:
        if isinstance(item, ExecChunk):
            (self._out if item.stream == "stdout" else self._err).write(item.data)
        else:
            self._end = item

    def result(self, check: bool) -> ExecOutput:
        """The output; InternalError when the stream had no exit, ExecError
        with ``check`` when it was not 0."""
        if self._end is None:
            from layerstack.errors import InternalError

            raise InternalError(None, "internal", "the daemon ended the exec stream without the command's exit")
        res = dataclasses.replace(self._end, stdout=self._out.getvalue(), stderr=self._err.getvalue())
        if check and not res.ok:
            raise ExecError(res, self._cmd)
        return res


@dataclass(frozen=True)
class RunSessionResult:
    """A session that ran one command in one call (``RunSession``;
    :meth:`layerstack.Client.run_session`).

    ``session``: the session as created (its id: ``session.id``).
    ``created``: False for a retry of ``key=`` whose session had ended —
    nothing ran again and ``output`` is None. ``output``: the command's
    stdout, stderr and exit. ``outcome``: the session's end as CloseSession
    answers it (``outcome.outcome``: committed, merged, no-change,
    checkpointed, discarded, conflict, …; ``outcome.layer``, the node of a
    checkpoint). A ``conflict`` leaves the session's writes kept, as a
    sandbox's close does (``outcome.released`` False)."""

    session: Session
    created: bool
    output: Optional[ExecOutput]
    outcome: Session


def run_request(
    namespace: str,
    cmd: Command,
    *,
    stack: Optional[str],
    node: Optional[str],
    branch: str,
    name: str,
    key: Optional[str],
    executor: str,
    module: Union[bytes, "os.PathLike[str]", None],
    end: str,
    exit_policy: Optional[str],
    state: Union[Mapping[str, Any], str, None],
    labels: Optional[Mapping[str, str]],
    reason: str,
    command: str,
    exit_status: Optional[int],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    stdin: Union[bytes, str, None],
    timeout_s: Optional[float],
    network: bool,
    user: Optional[User],
    workdir: Optional[str],
    hostname: Optional[str],
    cpu_millis: Optional[int],
    memory_bytes: Optional[int],
    pids: Optional[int],
    fuel: Optional[int],
    run_timeout_s: Optional[float],
    wait_s: float,
    ignore_mtime: bool,
) -> Any:
    """The ``RunSessionRequest`` of :meth:`layerstack.Client.run_session`:
    the session's request (as :meth:`~layerstack.Client.sandbox` makes it),
    the command's (as ``exec``) and the close's (``end``: publish, discard,
    auto, checkpoint)."""
    options, wasi = executor_options(
        executor,
        network=network,
        user=user,
        workdir=workdir,
        env=None,
        hostname=hostname,
        cpu_millis=cpu_millis,
        memory_bytes=memory_bytes,
        pids=pids,
        mount_at=None,
        fuel=fuel,
        run_timeout_s=run_timeout_s,
    )
    create = create_request(
        namespace,
        stack=stack,
        node=node,
        branch=branch,
        name=name,
        key=key,
        exit_policy=exit_policy,
        wait_s=wait_s,
        ignore_mtime=ignore_mtime,
        options=options,
        wasi=wasi,
    )
    run = exec_request(0, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s, module=module)
    close = close_request(
        0,
        action=end,
        checkpoint=False,
        publish=False,
        state=state,
        labels=labels,
        reason=reason,
        command=command,
        exit_status=exit_status,
    )
    req = pb.RunSessionRequest(create=create, exec=run, close=close)
    check_size(req, stdin=len(run.stdin), module=len(run.module), env=sum(len(e) for e in run.env))
    return req


class RunFold:
    """Folds a ``RunSession`` stream's replies into one :class:`RunSessionResult`
    (shared by the blocking and the asyncio ``run_session``)."""

    def __init__(self, cmd: Optional[Command] = None) -> None:
        self._exec = ExecFold(cmd)
        self._cmd = cmd
        self._ran = False
        self._session: Optional[Session] = None
        self._created = True
        self._outcome: Optional[Session] = None

    def add(self, r: Any) -> None:
        which = r.WhichOneof("kind")
        if which == "session":
            self._session, self._created = Session.from_pb(r.session.session), r.session.created
        elif which == "closed":
            self._outcome = Session.from_pb(r.closed)
        elif which == "exit":
            self._ran = True
            self._exec.add(ExecOutput._from_exit(r.exit))
        elif which in ("stdout", "stderr"):
            self._exec.add(ExecChunk(which, getattr(r, which)))

    def result(self, check: bool) -> RunSessionResult:
        """The result; InternalError when the stream lacked the session or its
        end, ExecError with ``check`` when the command did not exit 0."""
        if self._session is None or self._outcome is None:
            from layerstack.errors import InternalError

            raise InternalError(None, "internal", "the daemon ended the RunSession stream without the session's end")
        output = self._exec.result(False) if self._ran else None
        if check and output is not None and not output.ok:
            raise ExecError(output, self._cmd)
        return RunSessionResult(self._session, self._created, output, self._outcome)


# ------------------------------------------------------------------ blocking


class Files:
    """The file API of one sandbox (:attr:`Sandbox.files`). Paths are absolute
    or relative, both beneath the session's root; a ``..`` component is refused
    (InvalidArgumentError). Every call raises NotFoundError for a missing path,
    FailedPreconditionError when the sandbox is no longer live."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sb = sandbox

    def read(self, path: str, *, offset: int = 0, limit: int = 0) -> bytes:
        """The bytes of regular file ``path`` from ``offset`` (at most ``limit``
        bytes; 0: to the end). InvalidArgumentError: not a regular file."""
        req = pb.ReadFileRequest(
            session_id=self._sb.id,
            path=path_arg(path),
            offset=count_arg("offset", offset),
            limit=count_arg("limit", limit),
        )
        return b"".join(c.data for c in self._sb._stream(self._sb._stub.ReadFile, req))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """:meth:`read` decoded."""
        return self.read(path).decode(encoding)

    def write(
        self,
        path: str,
        data: Content,
        *,
        mode: int = 0o644,
        make_parents: bool = True,
        owner: Optional[User] = None,
    ) -> FileInfo:
        """Replaces (or creates) ``path`` with ``data`` atomically: a reader in
        the sandbox sees the old content or the new, never part. ``owner``:
        (uid, gid), default the sandbox's user. Returns the new file's stat."""
        reqs = write_requests(self._sb.id, path, data, mode=mode, make_parents=make_parents, owner=owner)
        try:
            return FileInfo.from_pb(self._sb._call(self._sb._stub.WriteFile, reqs))
        except BaseException:
            reqs.raise_source_error()
            raise

    def list(self, path: str = "/") -> List[FileInfo]:
        """The entries of directory ``path`` (not recursive), by name."""
        r = self._sb._call(self._sb._stub.ListDir, pb.ListDirRequest(session_id=self._sb.id, path=path_arg(path)))
        return [FileInfo.from_pb(e) for e in r.entries]

    def stat(self, path: str) -> FileInfo:
        """``path``'s metadata (a symlink is described, not followed)."""
        return FileInfo.from_pb(
            self._sb._call(self._sb._stub.StatPath, pb.StatPathRequest(session_id=self._sb.id, path=path_arg(path)))
        )

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a dangling symlink does)."""
        from layerstack.errors import NotFoundError

        try:
            self.stat(path)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str, *, recursive: bool = False) -> int:
        """Removes ``path`` (a directory only when empty, unless ``recursive``).
        Returns how many entries went."""
        req = pb.RemovePathRequest(session_id=self._sb.id, path=path_arg(path), recursive=recursive)
        return int(self._sb._call(self._sb._stub.RemovePath, req).removed)

    def upload(
        self, directory: str, tar: Union[bytes, BinaryIO, "os.PathLike[str]"], *, make_parents: bool = True
    ) -> UploadSummary:
        """Extracts a tar (plain, gzip or zstd: bytes, an open binary file or a
        :class:`pathlib.Path`) into ``directory``. An entry escaping it (absolute
        or ``..`` names, a write through a symlink, a hardlink to outside) is
        refused with InvalidArgumentError naming it. Not atomic: the entries
        before a refused (or unreadable) one were written and stay — remove
        them, or discard the sandbox's writes."""
        reqs = upload_requests(self._sb.id, directory, tar, make_parents)
        try:
            return upload_summary(self._sb._call(self._sb._stub.UploadTar, reqs))
        except BaseException:
            reqs.raise_source_error()
            raise

    def download(self, path: str) -> bytes:
        """``path`` (a file or a directory tree) as a plain tar; names relative to
        its parent, symlinks stored as symlinks."""
        req = pb.DownloadTarRequest(session_id=self._sb.id, path=path_arg(path))
        return b"".join(c.data for c in self._sb._stream(self._sb._stub.DownloadTar, req))


class Sandbox:
    """A live daemon-owned session. Made by :meth:`layerstack.Client.sandbox`.

    Attributes:
        id: the session id (``Session.id``).
        session: the session as created (``created`` says whether this call made
            it or an earlier one with the same key did).
        files: the file API (:class:`Files`).
        outcome: the session as it ended, once :meth:`close` returned — or
            at once, when a repeated idempotency key names a sandbox that had
            ended (:attr:`ended`; a retry after a crash gets the recorded end,
            never a second run).
    """

    def __init__(self, client: "Client", session: Session, created: bool) -> None:
        self._client = client
        self._stub: Any = client._stub
        self.session = session
        self.id = session.id
        self.created = created
        self.files = Files(self)
        # A repeat of an idempotency key whose sandbox already ended answers
        # that sandbox as it ended: nothing runs again.
        self.outcome: Optional[Session] = session if (not created and session.released) else None

    @property
    def ended(self) -> bool:
        """The sandbox has ended (:meth:`close` returned, or this is the answer
        to a repeated key whose sandbox had ended: :attr:`outcome` is how)."""
        return self.outcome is not None

    def _call(self, fn: Any, req: Any, timeout_s: Optional[float] = -1.0) -> Any:
        return self._client._call(fn, req, timeout_s)

    def _stream(self, fn: Any, req: Any, timeout_s: Optional[float] = None) -> Iterator[Any]:
        try:
            yield from fn(req, timeout=timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except ValueError as e:
            if is_closed_channel(e):
                raise closed_client_error() from None
            raise

    # ---------------------------------------------------------------- exec

    def exec_stream(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[User] = None,
        stdin: Union[bytes, str, None] = None,
        timeout_s: Optional[float] = None,
        module: Union[bytes, "os.PathLike[str]", None] = None,
    ) -> Iterator[Union[ExecChunk, ExecOutput]]:
        """Runs ``cmd`` in the sandbox and yields its output as it comes
        (:class:`ExecChunk`), then one :class:`ExecOutput` (its output fields
        empty: the chunks were yielded). Arguments as :meth:`exec`."""
        req = exec_request(
            self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s, module=module
        )
        for r in self._stream(self._stub.Exec, req):
            item = exec_item(r)
            if item is not None:
                yield item

    def exec(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[User] = None,
        stdin: Union[bytes, str, None] = None,
        timeout_s: Optional[float] = None,
        check: bool = False,
        module: Union[bytes, "os.PathLike[str]", None] = None,
    ) -> ExecOutput:
        """Runs ``cmd`` (an argv, or a string for ``/bin/sh -c``) in the sandbox
        and waits for it. ``env`` adds to the sandbox's environment; ``cwd`` is
        absolute in the sandbox; ``user`` (uid, gid); ``stdin`` is written and
        closed; ``timeout_s`` kills it (and its process group) after that long:
        ``timed_out`` says so. ``check``: raise :class:`ExecError` unless it
        exited 0.

        In a WASI sandbox (``executor="wasi"``) ``cmd`` is the module's argv:
        ``module`` gives the module (its bytes, or a :class:`pathlib.Path` of a
        local ``.wasm`` file) and ``cmd[0]`` is only its name; without
        ``module``, ``cmd[0]`` names it: ``sha256:<hex>`` (the
        ``module_digest`` of an earlier run) or a path in the sandbox's tree.
        ``timeout_s`` is the run's wall-clock limit (trap ``deadline``);
        ``cwd`` must be None or "/" and ``user`` None. Output arrives when the
        module has ended.

        Raises: FailedPreconditionError (the sandbox is not live),
        InvalidArgumentError (a bad field, named; a module that does not
        compile), NotFoundError (a module path not in the tree)."""
        fold = ExecFold(cmd)
        for item in self.exec_stream(
            cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s, module=module
        ):
            fold.add(item)
        return fold.result(check)

    # ---------------------------------------------------------------- diff and end

    def diff(self, *, patch: bool = False) -> List[PathChange]:
        """What the sandbox changed so far against the tree it started from (its
        lease), read from its upper while it runs (``Diff`` of the session;
        nothing published). ``patch``: unified diffs of text files. The mount
        points root mode makes (/dev, /proc, /run, /sys where the stack lacks
        them) are the sandbox's, not changes: left out."""
        req = pb.DiffRequest(session_id=self.id, patch=patch)
        out: List[PathChange] = []
        for r in self._stream(self._stub.Diff, req):
            out.extend(PathChange.from_pb(e) for e in r.entries)
        return out

    def close(
        self,
        *,
        checkpoint: bool = False,
        publish: bool = False,
        action: Optional[str] = None,
        state: Union[Mapping[str, Any], str, None] = None,
        labels: Optional[Mapping[str, str]] = None,
        reason: str = "python sandbox close",
        command: str = "",
        exit_status: Optional[int] = None,
    ) -> Session:
        """Ends the sandbox: ``checkpoint=True`` makes its writes a child node of
        the node it runs on (``Session.node``), with ``state`` (a JSON object:
        the node's logical state, e.g. a reward) and ``labels`` recorded in the
        same operation; ``publish=True`` sends them through the gate to its
        branch; neither discards them. ``action`` names the end action instead
        (auto | publish | discard | checkpoint). ``exit_status``: the task's
        (e.g. its evaluator's) exit status, recorded with the end — an attempt
        discarded with a non-zero one ends ``failed``, and ``auto`` applies the
        exit policy to it. Returns the ended session
        (``outcome``, ``node``, ``layer``); a second call answers the same.

        Raises: ValueError (two actions; state without a checkpoint),
        FailedPreconditionError (checkpoint of a session that is not an attempt
        of a node; a checkpoint or publish of a run that ended
        ``interrupted`` — the outcome is recorded on the object, and
        :meth:`discard` or leaving the ``with`` block drops its writes)."""
        if self.outcome is not None and not kept_writes_to_drop(
            self.outcome, action, checkpoint=checkpoint, publish=publish
        ):
            return already_ended(self.outcome, checkpoint=checkpoint, publish=publish, action=action)
        req = close_request(
            self.id,
            action=action,
            checkpoint=checkpoint,
            publish=publish,
            state=state,
            labels=labels,
            reason=reason,
            command=command,
            exit_status=exit_status,
        )
        ended = self._ended(Session.from_pb(self._call(self._stub.CloseSession, req, None)))
        # A run that had ended interrupted (the daemon restarted, its init
        # died) publishes or checkpoints nothing: raised, as a repeat is.
        return already_ended(ended, checkpoint=checkpoint, publish=publish, action=action)

    def _ended(self, s: Session) -> Session:
        self.outcome = ended_or_raise(s)
        return self.outcome

    def discard(self, reason: str = "python sandbox discard") -> Session:
        """Ends the sandbox and drops its writes (outcome ``discarded``)."""
        return self.close(action="discard", reason=reason)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.outcome is None or kept_writes_to_drop(self.outcome, "discard"):
            self.discard(reason="python sandbox left its with block unclosed")

    def __repr__(self) -> str:
        state = self.outcome.outcome if self.outcome is not None else "live"
        return f"<Sandbox session={self.id} {state}>"


def kept_writes_to_drop(
    outcome: Session, action: Optional[str], *, checkpoint: bool = False, publish: bool = False
) -> bool:
    """A discard of a sandbox whose run ended but whose writes are kept —
    ``interrupted`` (a daemon restart, its init gone) or ``conflict`` — still
    goes to the daemon: it drops them (CloseSession DISCARD; ``close()``
    with no action is a discard). Any other close of an ended sandbox
    answers its recorded end."""
    discards = action == "discard" or (action is None and not checkpoint and not publish)
    return discards and outcome.state in ("active", "conflict")


def already_ended(
    outcome: Session, *, checkpoint: bool, publish: bool, action: Optional[str]
) -> Session:
    """The recorded end of a sandbox that had ended, for a repeated close —
    FailedPreconditionError when the close asked to checkpoint or publish a
    run that ended ``interrupted`` (nothing of it was or can be kept as a
    node or a layer: discard it, and retry the task in a new sandbox)."""
    wants = "checkpoint" if checkpoint or action == "checkpoint" else "publish" if publish or action == "publish" else None
    if wants and outcome.outcome == "interrupted":
        from layerstack.errors import FailedPreconditionError

        raise FailedPreconditionError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "failed_precondition",
            f"session {outcome.id} cannot {wants}: its run ended interrupted"
            f" ({outcome.interrupted_by or 'an infrastructure failure'}) before this close; its writes are kept"
            " until discarded — discard it (sb.discard()) and retry the task in a new sandbox",
        )
    return outcome


def ended_or_raise(s: Session) -> Session:
    """The answer of a close that ended the sandbox (released), else the
    refusal it carries as an error: e.g. a checkpoint of a sandbox that is not
    an attempt of a graph node answers outcome ``failed`` and leaves the
    sandbox live — raised, so that the sandbox is still discarded on leaving
    its block."""
    if s.released:
        return s
    from layerstack.errors import FailedPreconditionError

    raise FailedPreconditionError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "failed_precondition",
        f"session {s.id} was not ended (outcome {s.outcome}): {s.message}",
    )


class ExecError(Exception):
    """``exec(check=True)`` (or ``run(check=True)``) of a command that did not
    exit 0. Not a :class:`~layerstack.LayerStackError`: the sandbox worked,
    the command failed.

    Attributes:
        output: its :class:`ExecOutput` (exit code, stdout, stderr, timing).
        command: the command as given (a str or an argv list), ``None`` when
            unknown; the message names it.
    """

    def __init__(self, output: ExecOutput, command: Optional[Command] = None) -> None:
        why = f"timed out after {output.duration_ms} ms" if output.timed_out else f"exit code {output.exit_code}"
        tail = output.stderr[-500:].decode(errors="replace")
        shown = "" if command is None else f" {_shown(command)}"
        super().__init__(f"command{shown} failed: {why}" + (f"; stderr ends: {tail}" if tail else ""))
        self.output = output
        self.command = command

    def __reduce__(self) -> Tuple[Any, ...]:
        return (ExecError, (self.output, self.command))


def _shown(command: Command) -> str:
    """A command for a message: a shell string quoted, an argv as shlex would
    join it; at most 200 characters."""
    if isinstance(command, str):
        text = repr(command)
    else:
        text = shlex.join(str(a) for a in command)
    return text if len(text) <= 200 else text[:197] + "..."

