"""The LayerStack client: Mode B sessions and the SandboxGraph over the admin API.

Everything the daemon answers goes over gRPC (``api/proto/admin.proto``) on the
admin socket. The parts that need namespaces — attaching a session's overlay,
starting its init, joining it for another command — are done by the
``layerstack`` binary (``session run|create|exec``), which this client drives
as a subprocess: a Python process cannot receive the detached mount and
``setns`` into a session portably. Those calls need root, as the binary does.

The binary is found in ``bin_dir`` (argument), else ``$LAYERSTACK_BIN_DIR``,
else on ``$PATH``. It runs with ``--error-format json``: its failures raise
the same error classes as the RPCs' (``layerstack.errors.from_command``).

Remote daemons: ``connect(target="host:7443", root_certificates=…, token=…)``
speaks the same API over the daemon's TCP listener (``[api.tcp]``, TLS only,
docs/operations.md "Who may call"). The calls that drive the binary need the
daemon's host and are refused there with :class:`CommandError`.

Idempotency: every mutating call of the graph (``create_graph``,
``checkpoint``, ``merge``, ``promote``, ``prune``, ``start_attempt``,
``retry``) and session creation (``run``, ``create_session``) take ``key=``: the
same key twice gives the first call's answer and one effect, also across a
daemon restart; the same key with other arguments raises
:class:`FailedPreconditionError` (a key names one request). ``close_session``, ``publish`` and ``discard`` end a session's
run; the proto gives them no key (a second call answers the recorded outcome or
refuses; see their docs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from layerstack._channel import Endpoint
from layerstack._pb import admin_pb2 as pb
from layerstack._pb import admin_pb2_grpc as pb_grpc
from layerstack.sandbox import (
    Command,
    RunFold,
    RunSessionResult,
    Sandbox,
    create_request,
    executor_options,
    run_request,
    state_json,
)
from layerstack.errors import (
    CommandError,
    LayerStackError,
    closed_client_error,
    command_error_line,
    from_command,
    from_rpc_error,
    is_closed_channel,
)
from layerstack.types import (
    Attempt,
    AttemptStart,
    DryRun,
    ExecResult,
    FsckReport,
    Graph,
    GraphInfo,
    MergeResult,
    Node,
    PathVerdict,
    PromoteResult,
    PullResult,
    PushResult,
    RunResult,
    Session,
    Status,
    registry_auth,
)

__all__ = ["Client", "connect", "DEFAULT_ADMIN_ADDRESS", "State"]

#: The daemon's default admin socket.
DEFAULT_ADMIN_ADDRESS = "/run/layerstack/admin.sock"

#: A node's logical state: a JSON object, as a dict or as its JSON text.
State = Union[Mapping[str, Any], str]

_T = TypeVar("_T")

_EXIT_POLICIES = ("on-exit", "on-success", "never", "checkpoint")
_END_ACTIONS = {
    "auto": pb.AUTO,
    "publish": pb.PUBLISH,
    "discard": pb.DISCARD,
    "checkpoint": pb.CHECKPOINT,
}


def _state_json(state: Optional[State]) -> str:
    return state_json(state)


def _check_exit_policy(policy: Optional[str]) -> str:
    if policy is None:
        return ""
    if policy not in _EXIT_POLICIES:
        raise ValueError(f"exit policy {policy!r}: give one of {', '.join(_EXIT_POLICIES)}")
    return policy


def connect(
    admin_address: Union[str, "os.PathLike[str]"] = DEFAULT_ADMIN_ADDRESS,
    *,
    namespace: str = "default",
    bin_dir: Union[str, "os.PathLike[str]", None] = None,
    mount_address: Union[str, "os.PathLike[str]", None] = None,
    timeout_s: Optional[float] = 180.0,
    target: Optional[str] = None,
    root_certificates: Union[bytes, str, "os.PathLike[str]", None] = None,
    token: Optional[str] = None,
    client_certificate: Union[bytes, str, "os.PathLike[str]", None] = None,
    client_key: Union[bytes, str, "os.PathLike[str]", None] = None,
    server_name: Optional[str] = None,
) -> "Client":
    """A client of the daemon at ``admin_address`` (a unix socket path), or at
    ``target`` (``"host:port"``: the daemon's TCP listener, TLS).

    Args:
        admin_address: the admin socket (default ``/run/layerstack/admin.sock``).
        namespace: the containerd namespace images and stacks are named in.
        bin_dir: where the ``layerstack`` binary is (default: ``$LAYERSTACK_BIN_DIR``,
            else ``$PATH``); only the session calls that run commands need it.
        mount_address: the daemon's mount socket (default: ``mount.sock`` beside the
            admin socket).
        timeout_s: deadline of each unary RPC in seconds (``None``: none).
            ``wait`` and the session calls have their own.
        target: ``"host:port"`` of the daemon's ``[api.tcp]`` listener; given, the
            client speaks TLS to it instead of using ``admin_address``.
        root_certificates: with ``target``: the CA certificates (PEM bytes, or a
            file path) the daemon's certificate must chain to (default: the
            system's roots, as gRPC finds them).
        token: with ``target``: the bearer token sent as ``authorization: Bearer
            <token>`` on every call (default: ``$LAYERSTACK_TOKEN`` if set, else
            none). A missing or unknown token is refused with
            :class:`~layerstack.errors.UnauthenticatedError`.
        client_certificate, client_key: with ``target``: a client certificate
            chain and its key (PEM bytes or file paths), for a daemon that asks
            for one (``[api.tcp] client_ca``).
        server_name: with ``target``: the name the daemon's certificate must carry,
            when it is not ``target``'s host.

    On the admin socket the daemon checks the caller's uid (root, or ``[api]
    allowed_uids`` / ``allowed_gids``); another uid gets
    :class:`~layerstack.errors.PermissionDeniedError` on its first call.

    The connection is lazy: an unreachable daemon shows on the first call as
    :class:`~layerstack.errors.UnavailableError`. Use the client as a context
    manager, or call :meth:`Client.close`.
    """
    return Client(
        admin_address,
        namespace=namespace,
        bin_dir=bin_dir,
        mount_address=mount_address,
        timeout_s=timeout_s,
        target=target,
        root_certificates=root_certificates,
        token=token,
        client_certificate=client_certificate,
        client_key=client_key,
        server_name=server_name,
    )


def close_session_request(
    session_id: int,
    action: str,
    exit_status: Optional[int],
    state: Optional[State],
    command: Optional[str],
    reason: str,
) -> Any:
    """The CloseSession request of :meth:`Client.close_session` (ValueError
    for an unknown ``action``)."""
    if action not in _END_ACTIONS:
        raise ValueError(f"end action {action!r}: give one of {', '.join(_END_ACTIONS)}")
    return pb.CloseSessionRequest(
        session_id=session_id,
        action=_END_ACTIONS[action],
        reason=reason,
        has_exit_status=exit_status is not None,
        exit_status=exit_status or 0,
        state=_state_json(state),
        command=command or "",
    )


def list_sessions_request(
    default_namespace: str, namespace: Optional[str], all_namespaces: bool, owner_kind: str, page_token: str
) -> Any:
    """One page's ListSessions request of :meth:`Client.list_sessions`."""
    return pb.ListSessionsRequest(
        namespace=default_namespace if namespace is None and not all_namespaces else (namespace or ""),
        all_namespaces=all_namespaces,
        owner_kind=owner_kind,
        page_token=page_token,
    )


class Client:
    """See :func:`connect`."""

    def __init__(
        self,
        admin_address: Union[str, "os.PathLike[str]"] = DEFAULT_ADMIN_ADDRESS,
        *,
        namespace: str = "default",
        bin_dir: Union[str, "os.PathLike[str]", None] = None,
        mount_address: Union[str, "os.PathLike[str]", None] = None,
        timeout_s: Optional[float] = 180.0,
        target: Optional[str] = None,
        root_certificates: Union[bytes, str, "os.PathLike[str]", None] = None,
        token: Optional[str] = None,
        client_certificate: Union[bytes, str, "os.PathLike[str]", None] = None,
        client_key: Union[bytes, str, "os.PathLike[str]", None] = None,
        server_name: Optional[str] = None,
    ) -> None:
        self.admin_address = Path(admin_address)
        #: ``"host:port"`` of the daemon's TCP listener, or ``None`` (admin socket).
        self.target = target
        self.namespace = namespace
        self.mount_address = Path(mount_address) if mount_address is not None else None
        self.timeout_s = timeout_s
        self._bin_dir = Path(bin_dir) if bin_dir is not None else None
        self._endpoint = Endpoint(
            self.admin_address,
            target=target,
            root_certificates=root_certificates,
            token=token,
            client_certificate=client_certificate,
            client_key=client_key,
            server_name=server_name,
        )
        self._channel = self._endpoint.channel()
        # The generated stub is untyped (grpcio-tools writes no .pyi for it).
        self._stub: Any = pb_grpc.AdminStub(self._channel)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Closes the gRPC channel."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., _T], req: Any, timeout_s: Optional[float] = -1.0) -> _T:
        t = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            return fn(req, timeout=t)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except ValueError as e:
            if is_closed_channel(e):
                raise closed_client_error() from None
            raise

    def binary(self) -> Path:
        """The ``layerstack`` binary this client drives; :class:`CommandError` if none."""
        d = self._bin_dir or (
            Path(os.environ["LAYERSTACK_BIN_DIR"]) if os.environ.get("LAYERSTACK_BIN_DIR") else None
        )
        if d is not None:
            p = d / "layerstack"
            if p.is_file():
                return p
            raise CommandError(["layerstack"], None, f"layerstack: no layerstack binary in {d}")
        w = shutil.which("layerstack")
        if w is None:
            raise CommandError(
                ["layerstack"],
                None,
                "layerstack: the layerstack binary is not on PATH (set bin_dir or LAYERSTACK_BIN_DIR)",
            )
        return Path(w)

    def _argv(self, *args: str) -> List[str]:
        if self.target is not None:
            raise CommandError(
                ["layerstack", *args],
                None,
                f"layerstack: `layerstack {' '.join(args[:2])}` runs on the daemon's host (it attaches the "
                f"session's overlay through the mount socket); this client talks to {self.target} over TCP",
            )
        a = [
            str(self.binary()),
            "--admin-address",
            str(self.admin_address),
            "-n",
            self.namespace,
            "--error-format",
            "json",
        ]
        if self.mount_address is not None:
            a += ["--mount-address", str(self.mount_address)]
        return a + list(args)

    @staticmethod
    def _process_args(
        user: Optional[str], workdir: Optional[str], env: Optional[Mapping[str, str]]
    ) -> List[str]:
        a: List[str] = []
        if user is not None:
            a += ["--user", user]
        if workdir is not None:
            a += ["--workdir", workdir]
        for k, v in (env or {}).items():
            a += ["--env", f"{k}={v}"]
        return a

    # ------------------------------------------------------------------ daemon

    def status(self) -> Status:
        """The daemon's status (version, store root, containerd, Mode B cap)."""
        return Status.from_pb(self._call(self._stub.Status, pb.StatusRequest()))

    # ------------------------------------------------------------------ sandboxes

    def sandbox(
        self,
        stack: Optional[str] = None,
        *,
        node: Optional[str] = None,
        branch: str = "",
        name: str = "",
        key: Optional[str] = None,
        exit_policy: Optional[str] = None,
        network: bool = False,
        user: Optional[Tuple[int, int]] = None,
        workdir: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        hostname: Optional[str] = None,
        wait_s: float = 60.0,
        ignore_mtime: bool = False,
        cpu_millis: Optional[int] = None,
        memory_bytes: Optional[int] = None,
        pids: Optional[int] = None,
        mount_at: Optional[str] = None,
        executor: str = "linux",
        fuel: Optional[int] = None,
        run_timeout_s: Optional[float] = None,
        id_map: Optional[Tuple[int, int, int]] = None,
    ) -> Sandbox:
        """A new daemon-owned sandbox on ``stack`` (a stack id, image reference
        or base digest; ``branch`` default the daemon's) or as an attempt of
        graph node ``node`` — over gRPC alone: no root, no binary here
        (:mod:`layerstack.sandbox`). The daemon starts and owns its init.

        Args:
            key: idempotency key: the same key again answers the first call's
                sandbox (``Sandbox.created`` false), also across a daemon restart.
            exit_policy: what ``close(action="auto", exit_status=…)`` does:
                on-exit | on-success | never | checkpoint (a sandbox whose
                daemon died ends ``interrupted`` whatever its policy).
            network: share the daemon's network (default: only ``lo``).
            user: (uid, gid) that ``exec`` and the file calls use by default (0, 0).
            workdir, env, hostname: ``exec``'s defaults (a missing
                ``workdir`` is made, owned by ``user``, as Docker makes a
                missing WORKDIR; InvalidArgumentError if it is a file).
            mount_at: workspace mode: the sandbox's tree is mounted at this
                absolute directory of the daemon's host inside the sandbox,
                whose root stays the host's (its tools work on the tree); the
                file calls then address the tree (paths beneath it). Default:
                the tree is the sandbox's root.
            wait_s: how long to wait for a free slot when the daemon's pool of
                live sandboxes is full; 0 raises BusyError at once.
            ignore_mtime: content history only (see :meth:`run`).
            cpu_millis: CPU time per wall time, thousandths of one CPU (100 =
                a tenth of a CPU; 10..1000000).
            memory_bytes: memory of all the sandbox's processes together,
                bytes (>= 4 MiB; no swap beyond it): a process allocating past
                it is killed (``ExecOutput.signal`` 9, ``oom_killed``).
            pids: processes and threads alive at once, init included (>= 2);
                a fork beyond it fails with EAGAIN.
                For each limit None means the daemon's default (``[sandbox]
                default_*``, unlimited unless configured) and 0 no limit; the
                daemon enforces them with a cgroup of the sandbox's own.
            executor: "linux" (default: Linux processes in namespaces) or
                "wasi": a WASI sandbox (owner kind ``wasi``) whose ``exec``
                runs WebAssembly modules (WASI preview1, wasmtime) with the
                sandbox's tree as their root (``Sandbox.exec(module=…)``);
                its writes are captured, gated, checkpointed and published as
                any sandbox's. Only ``env``, ``memory_bytes`` (the module's
                linear memory cap, bytes), ``fuel`` (per run, about one unit
                per wasm instruction) and ``run_timeout_s`` (per run, when
                ``exec`` gives no ``timeout_s``) apply; the others raise
                ValueError. Defaults: the daemon's (10^10 fuel, 256 MiB, 60 s).
            id_map: ``(host_uid, host_gid, size)``: the sandbox's processes
                run in a user namespace whose ids ``0..size`` are the host's
                ``host_uid..`` and ``host_gid..`` (its root is not the
                host's root); host ids must be >= size. Layers, ``exec``'s
                ``user`` and the file calls' owners stay the sandbox's ids.
                None: the daemon's ``[sandbox] id_map`` (none unless
                configured). Not with ``mount_at``. Linux >= 6.13.

        Use it as a context manager: leaving the block unclosed discards its
        writes. A ``branch`` that does not exist is made from the default
        branch's head (as a container's does). Raises NotFoundError (stack,
        node), BusyError (pool
        full), InvalidArgumentError (a bad field, named; a limit out of
        range), FailedPreconditionError (a limit whose cgroup controller the
        daemon's machine lacks, named); ValueError (a negative limit)."""
        options, wasi = executor_options(
            executor,
            network=network,
            user=user,
            workdir=workdir,
            env=env,
            hostname=hostname,
            cpu_millis=cpu_millis,
            memory_bytes=memory_bytes,
            pids=pids,
            mount_at=mount_at,
            fuel=fuel,
            run_timeout_s=run_timeout_s,
            id_map=id_map,
        )
        req = create_request(
            self.namespace,
            stack=stack,
            node=node,
            branch=branch,
            name=name,
            key=key,
            exit_policy=_check_exit_policy(exit_policy) or None,
            wait_s=wait_s,
            ignore_mtime=ignore_mtime,
            options=options,
            wasi=wasi,
        )
        timeout = None if self.timeout_s is None else self.timeout_s + wait_s
        r = self._call(self._stub.CreateSession, req, timeout)
        return Sandbox(self, Session.from_pb(r.session), r.created)

    def run_session(
        self,
        cmd: Command,
        stack: Optional[str] = None,
        *,
        node: Optional[str] = None,
        branch: str = "",
        name: str = "",
        key: Optional[str] = None,
        executor: str = "linux",
        module: Union[bytes, "os.PathLike[str]", None] = None,
        end: str = "discard",
        exit_policy: Optional[str] = None,
        state: Union[Mapping[str, Any], str, None] = None,
        labels: Optional[Mapping[str, str]] = None,
        reason: str = "python run_session",
        command: str = "",
        exit_status: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[bytes, str, None] = None,
        timeout_s: Optional[float] = None,
        network: bool = False,
        user: Optional[Tuple[int, int]] = None,
        workdir: Optional[str] = None,
        hostname: Optional[str] = None,
        cpu_millis: Optional[int] = None,
        memory_bytes: Optional[int] = None,
        pids: Optional[int] = None,
        fuel: Optional[int] = None,
        run_timeout_s: Optional[float] = None,
        wait_s: float = 60.0,
        ignore_mtime: bool = False,
        check: bool = False,
    ) -> RunSessionResult:
        """A session that runs one command, in one call (``RunSession``): a
        sandbox made as :meth:`sandbox` makes it (``executor`` "linux" or
        "wasi"; ``stack`` or ``node``), ``cmd`` run in it as
        :meth:`Sandbox.exec` runs it (``module``: a WASI module's bytes or a
        local .wasm path; ``env``, ``cwd``, ``user``, ``stdin``,
        ``timeout_s``), then its end — ``end``: "discard" (default),
        "publish", "auto" (the ``exit_policy`` read against the command's
        exit code, or ``exit_status``) or "checkpoint" (a child of ``node``,
        ``state`` and ``labels`` recorded with it) — one round trip instead of
        three: a grader's clean session, a one-shot tool run.

        Returns a :class:`RunSessionResult` (``session``, ``output``, ``outcome``).
        ``key``: idempotency key; a retry whose session has ended answers
        its recorded end (``created`` False, ``output`` None) and runs
        nothing again; one whose session is still running raises
        ConflictError (ABORTED). A command that cannot start (a bad argv, a module that
        does not compile) discards the session and raises the exec's error
        (InvalidArgumentError, FailedPreconditionError); the session's own
        errors as :meth:`sandbox`'s. ``check``: raise ExecError when the
        command did not exit 0 (the session has ended by then)."""
        req = run_request(
            self.namespace,
            cmd,
            stack=stack,
            node=node,
            branch=branch,
            name=name,
            key=key,
            executor=executor,
            module=module,
            end=end,
            exit_policy=_check_exit_policy(exit_policy) or None,
            state=state,
            labels=labels,
            reason=reason,
            command=command,
            exit_status=exit_status,
            env=env,
            cwd=cwd,
            stdin=stdin,
            timeout_s=timeout_s,
            network=network,
            user=user,
            workdir=workdir,
            hostname=hostname,
            cpu_millis=cpu_millis,
            memory_bytes=memory_bytes,
            pids=pids,
            fuel=fuel,
            run_timeout_s=run_timeout_s,
            wait_s=wait_s,
            ignore_mtime=ignore_mtime,
        )
        fold = RunFold(cmd)
        try:
            for r in self._stub.RunSession(req, timeout=None):
                fold.add(r)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return fold.result(check)

    # ------------------------------------------------------------------ bases

    def import_base(
        self,
        path: Union[str, "os.PathLike[str]"],
        kind: str = "auto",
        *,
        platform: str = "",
        timeout_s: Optional[float] = None,
    ) -> str:
        """Makes a stack from a directory tree, a layer tar (plain, gzip or zstd)
        or an OCI image layout, with no containerd, and returns its stack id
        (``import:sha256:<hex>``: the digest of its content), whose ``main``
        branch :meth:`run` and :meth:`create_session` take as ``stack``.

        The daemon reads ``path`` itself: it is made absolute here (from this
        process's working directory) and must name the same file in the
        daemon's mount namespace. Content-addressed: the same content imported
        again (as a directory, a tar or a layout) returns the same id and
        changes nothing. ``kind``: auto | dir | tar | oci; ``platform``:
        os/arch[/variant] of an OCI layout's manifest (default: its only one,
        else the daemon's platform). No deadline by default (``timeout_s``):
        a large image takes a while.

        Raises InvalidArgumentError for a refused entry (an absolute or ``..``
        name, a write through a symlink, a hardlink to outside) or a malformed
        input — nothing of it is kept — and NotFoundError when ``path`` does
        not exist."""
        if kind not in ("auto", "dir", "tar", "oci"):
            raise ValueError(f"kind {kind!r} is none of auto, dir, tar, oci")
        req = pb.ImportBaseRequest(path=os.path.abspath(os.fspath(path)), kind=kind, platform=platform)
        r = self._call(self._stub.ImportBase, req, timeout_s)
        return str(r.stack)

    # ------------------------------------------------------------------ Mode B

    def run(
        self,
        cmd: Sequence[str],
        *,
        stack: Optional[str] = None,
        branch: Optional[str] = None,
        node: Optional[str] = None,
        publish: Optional[str] = None,
        state: Optional[State] = None,
        key: Optional[str] = None,
        name: Optional[str] = None,
        mount_at: Optional[str] = None,
        net: str = "host",
        user: Optional[str] = None,
        workdir: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        input: Optional[bytes] = None,
        wait_timeout_s: int = 600,
        timeout_s: Optional[float] = None,
        ignore_mtime: bool = False,
    ) -> RunResult:
        """Runs ``cmd`` in a new Mode B session and ends it by its exit policy.

        The session leases ``stack``'s ``branch`` head (an image reference, stack id
        or base digest; default branch: the daemon's), or with ``node`` a
        SandboxGraph node: the run is then a new attempt of it.

        Args:
            cmd: the command and its arguments (``["sh", "-c", "…"]``).
            publish: on-exit (default) | on-success | never | checkpoint (the
                default with ``node``: the writes become a child node).
            state: with checkpoint: the child node's logical state (a JSON object).
            key: idempotency key of the session (a retried create makes no second one).
            name: owner label, the session is ``sandbox:<name>``.
            mount_at: workspace mode: mount the session at this directory and keep the
                caller's root (its tools work on the tree) instead of making it the root.
            net: ``host`` (the caller's network) or ``none`` (only ``lo``).
            user: ``UID[:GID]``; workdir: the command's working directory; env: extra
                variables (root mode starts from a container's defaults).
            input: bytes for the command's stdin (default: none, /dev/null).
            wait_timeout_s: wait at most this long (s) for a slot under the cap of live
                sandbox sessions; 0: fail at once.
            timeout_s: kill the session (its holder) after this many seconds.
            ignore_mtime: content history only: a file rewritten with the same
                content, mode, owner and xattrs (``sed -i`` that matched nothing)
                is not a change although its mtime moved (default: it is).

        Returns:
            :class:`RunResult`: the exit status (127 not found, 126 not executable,
            128+n killed by signal n), stdout, stderr and the session's outcome
            (``.node`` the child node when it checkpointed).

        Raises (the binary's exit 125 without an outcome, typed by its kind):
            NotFoundError: an unknown stack, branch or node.
            FailedPreconditionError: not root.
            InvalidArgumentError: a pruned node; a bad ``user``, ``workdir`` or
                ``mount_at``; ``publish="checkpoint"`` without ``node``.
            BusyError: the cap of live sandbox sessions stayed full for
                ``wait_timeout_s``.
            UnavailableError: the daemon's sockets cannot be reached.
            CommandError: the binary could not be run, or failed without saying how.
            subprocess.TimeoutExpired: ``timeout_s`` passed.
        """
        if (stack is None) == (node is None):
            raise ValueError("give exactly one of stack= and node=")
        a: List[str] = ["session", "run"]
        if stack is not None:
            a.append(f"{stack}@{branch}" if branch else stack)
        else:
            assert node is not None
            a += ["--node", node]
        if publish is not None:
            a += ["--publish", _check_exit_policy(publish)]
        if state is not None:
            a += ["--state", _state_json(state)]
        if key:
            a += ["--idempotency-key", key]
        if ignore_mtime:
            a.append("--ignore-mtime")
        if name:
            a += ["--name", name]
        if mount_at is not None:
            a += ["--mount-at", str(mount_at)]
        if net != "host":
            a += ["--net", net]
        if wait_timeout_s == 0:
            a.append("--no-wait")
        else:
            a += ["--wait-timeout", str(wait_timeout_s)]
        a += self._process_args(user, workdir, env)
        with tempfile.TemporaryDirectory(prefix="layerstack-py-") as d:
            outcome = Path(d) / "outcome.json"
            argv = self._argv(*a, "--outcome", str(outcome), "--", *cmd)
            p = subprocess.run(
                argv,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
            )
            if not outcome.is_file() or outcome.stat().st_size == 0:
                raise from_command(argv, p.returncode, p.stderr.decode(errors="replace"))
            v = json.loads(outcome.read_text())
        lines = p.stderr.split(b"\n")
        # The binary's outcome line is the last one ("layerstack: session N …").
        while lines and lines[-1] == b"":
            lines.pop()
        if lines and lines[-1].startswith(b"layerstack: session "):
            lines.pop()
        stderr = b"\n".join(lines) + (b"\n" if lines else b"")
        session = Session.from_json(v)
        return RunResult(exit_status=p.returncode, stdout=p.stdout, stderr=stderr, session=session)

    def create_session(
        self,
        stack: Optional[str] = None,
        *,
        branch: Optional[str] = None,
        node: Optional[str] = None,
        publish: Optional[str] = None,
        key: Optional[str] = None,
        name: Optional[str] = None,
        mount_at: Optional[str] = None,
        net: str = "host",
        wait_timeout_s: int = 600,
        timeout_s: Optional[float] = 180.0,
        ignore_mtime: bool = False,
    ) -> Session:
        """Creates a Mode B session that stays mounted, its init running in the
        background, for :meth:`exec`; end it with :meth:`close_session`.

        Arguments as :meth:`run` (``stack`` or ``node``). Returns the session
        (``state`` active).

        Raises: as :meth:`run` (NotFoundError for an unknown stack or node, …);
        InternalError when the session's init could not set it up.
        """
        if (stack is None) == (node is None):
            raise ValueError("give exactly one of stack and node=")
        a: List[str] = ["session", "create", "--json"]
        if stack is not None:
            a.append(f"{stack}@{branch}" if branch else stack)
        else:
            assert node is not None
            a += ["--node", node]
        if publish is not None:
            a += ["--publish", _check_exit_policy(publish)]
        if key:
            a += ["--idempotency-key", key]
        if ignore_mtime:
            a.append("--ignore-mtime")
        if name:
            a += ["--name", name]
        if mount_at is not None:
            a += ["--mount-at", str(mount_at)]
        if net != "host":
            a += ["--net", net]
        if wait_timeout_s == 0:
            a.append("--no-wait")
        else:
            a += ["--wait-timeout", str(wait_timeout_s)]
        argv = self._argv(*a)
        # The init stays in the background: its output must not hold our pipes open.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            p = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=timeout_s
            )
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if p.returncode != 0:
            raise from_command(argv, p.returncode, stderr.decode(errors="replace"))
        return Session.from_json(json.loads(stdout))

    def exec(
        self,
        session_id: int,
        cmd: Sequence[str],
        *,
        user: Optional[str] = None,
        workdir: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        input: Optional[bytes] = None,
        timeout_s: Optional[float] = None,
    ) -> ExecResult:
        """Runs ``cmd`` in live session ``session_id`` (made by :meth:`create_session`),
        joining its namespaces; its writes go to the session's upper.

        Returns the exit status and output (exit status 125 is the command's
        unless the binary printed its own error).

        Raises (the binary's exit 125 with its error as the last line on stderr):
            NotFoundError: no session ``session_id``.
            FailedPreconditionError: the session is closed, has no live holder,
                or its init exited.
            InvalidArgumentError: a bad ``user`` or ``workdir``.
        """
        argv = self._argv(
            "session",
            "exec",
            str(session_id),
            *self._process_args(user, workdir, env),
            "--",
            *cmd,
        )
        p = subprocess.run(
            argv,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
        )
        if p.returncode == 125:
            err = p.stderr.decode(errors="replace")
            if command_error_line(err) is not None:
                raise from_command(argv, p.returncode, err)
        return ExecResult(exit_status=p.returncode, stdout=p.stdout, stderr=p.stderr)

    def close_session(
        self,
        session_id: int,
        *,
        action: str = "auto",
        exit_status: Optional[int] = None,
        state: Optional[State] = None,
        command: Optional[str] = None,
        reason: str = "python client close",
        policy: Optional[str] = None,
        timeout_s: Optional[float] = 600.0,
    ) -> Session:
        """Ends a Mode B session: stops its holder, waits until its upper is unmounted
        everywhere, ends its run and releases it.

        Args:
            action: the end action: ``auto`` (the recorded exit policy applied to
                ``exit_status``; without one on-success discards), ``publish``,
                ``discard``, or ``checkpoint`` (a child node of the session's
                attempt node).
            policy: the former name of ``action`` (deprecated; it named the end
                action, not the exit policy).
            exit_status: the status the recorded policy applies to.
            state: when the close checkpoints: the child node's state (JSON object).
            command: provenance recorded on the child node.

        Returns the session with its outcome (``.checkpoint_node`` when it checkpointed).

        Raises:
            NotFoundError: no such session.
            FailedPreconditionError: checkpoint of a session that is not a running attempt.
        """
        if policy is not None:
            warnings.warn(
                "close_session(policy=...) is now close_session(action=...): it is the end action",
                DeprecationWarning,
                stacklevel=2,
            )
            action = policy
        req = close_session_request(session_id, action, exit_status, state, command, reason)
        return Session.from_pb(self._call(self._stub.CloseSession, req, timeout_s))

    def wait(self, session_id: int, *, timeout_ms: int = 0) -> Session:
        """Blocks until session ``session_id`` has an outcome for its current run
        (``timeout_ms`` 0: forever). Raises :class:`LayerStackError` (kind
        ``deadline_exceeded``) when it runs out, NotFoundError for no such session."""
        req = pb.WaitRequest(session_id=session_id, timeout_ms=timeout_ms)
        return Session.from_pb(self._call(self._stub.Wait, req, None))

    def publish(self, session_id: int, *, reason: str = "python client publish") -> Session:
        """Captures and publishes the session now through the gate (its upper must be
        unmounted everywhere: a stopped container, a closed holder). Returns the
        session: ``outcome`` committed | merged | no-change | conflict (``conflicts``).

        Raises FailedPreconditionError while the upper is still mounted."""
        req = pb.PublishRequest(session_id=session_id, action=pb.PUBLISH, reason=reason)
        return Session.from_pb(self._call(self._stub.Publish, req))

    def discard(self, session_id: int, *, reason: str = "python client discard") -> Session:
        """Drops the session's writes (outcome ``discarded``)."""
        req = pb.PublishRequest(session_id=session_id, action=pb.DISCARD, reason=reason)
        return Session.from_pb(self._call(self._stub.Publish, req))

    def dry_run(self, session_id: int) -> DryRun:
        """What :meth:`publish` would do now, changing nothing: the would-be outcome
        (``session.dry_run`` True) and every path's verdict, in path order."""
        req = pb.PublishRequest(session_id=session_id, action=pb.PUBLISH)
        t = self.timeout_s
        session: Optional[Session] = None
        paths: List[PathVerdict] = []
        try:
            for reply in self._stub.PublishDryRun(req, timeout=t):
                if reply.HasField("session"):
                    session = Session.from_pb(reply.session)
                paths.extend(PathVerdict.from_pb(v) for v in reply.paths)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if session is None:
            raise LayerStackError(None, "internal", "the dry run's stream carried no session")
        return DryRun(session=session, paths=tuple(paths))

    def list_sessions(
        self,
        *,
        namespace: Optional[str] = None,
        all_namespaces: bool = False,
        owner_kind: str = "",
    ) -> List[Session]:
        """Sessions, oldest first (every page): of ``namespace`` (default the
        client's; ``all_namespaces`` for every one), of ``owner_kind`` container |
        sandbox | operation ("" all)."""
        out: List[Session] = []
        token = ""
        while True:
            req = list_sessions_request(self.namespace, namespace, all_namespaces, owner_kind, token)
            r = self._call(self._stub.ListSessions, req)
            out.extend(Session.from_pb(s) for s in r.sessions)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    def outcome_paths(self, outcome_id: int, *, status: str = "") -> Iterator[PathVerdict]:
        """Every path verdict of a recorded outcome (``Session.outcome_id``), in path
        order, fetched a page at a time; ``status`` filters (clean | merged |
        conflict | excluded)."""
        token = ""
        while True:
            req = pb.ListOutcomePathsRequest(outcome_id=outcome_id, status=status, page_token=token)
            r = self._call(self._stub.ListOutcomePaths, req)
            for v in r.paths:
                yield PathVerdict.from_pb(v)
            if not r.next_page_token:
                return
            token = r.next_page_token

    # ------------------------------------------------------------------ SandboxGraph

    def create_graph(
        self, name: str, stack: str, *, branch: str = "", key: Optional[str] = None
    ) -> Graph:
        """Creates graph ``name`` whose root node is ``stack``'s ``branch`` head
        (default branch: the daemon's). Returns the graph (``.root`` the root node).

        Raises AlreadyExistsError when the name is taken (without the first call's
        ``key``), NotFoundError for an unknown stack or branch."""
        req = pb.CreateGraphRequest(
            namespace=self.namespace, stack=stack, branch=branch, name=name, key=key or ""
        )
        return Graph.from_pb(self._call(self._stub.CreateGraph, req))

    def list_graphs(self) -> List[GraphInfo]:
        """Every graph, by name (fetched a page of up to 1,000 at a time)."""
        out: List[GraphInfo] = []
        token = ""
        while True:
            r = self._call(self._stub.ListGraphs, pb.ListGraphsRequest(page_token=token))
            out.extend(GraphInfo.from_pb(g) for g in r.graphs)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    def show_graph(self, name: str) -> Graph:
        """Graph ``name``: its nodes (pruned ones too) and attempts. NotFoundError if none."""
        whole = pb.Graph()
        try:
            # Replies of at most 1,000 nodes and attempts each: concatenated.
            for page in self._stub.ShowGraph(pb.ShowGraphRequest(name=name), timeout=self.timeout_s):
                whole.MergeFrom(page)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return Graph.from_pb(whole)

    def graph_dot(self, name: str) -> str:
        """Graph ``name`` in Graphviz dot (``layerstack graph show --dot``; render with
        ``dot -Tsvg``)."""
        argv = self._argv("graph", "show", name, "--dot")
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        if p.returncode != 0:
            raise from_command(argv, p.returncode, p.stderr.decode(errors="replace"))
        return p.stdout.decode()

    def show_node(self, node_id: str) -> Node:
        """Node ``node_id``. NotFoundError if none."""
        return Node.from_pb(self._call(self._stub.ShowNode, pb.ShowNodeRequest(id=node_id)))

    def checkpoint(
        self,
        session_id: int,
        *,
        state: Optional[State] = None,
        command: Optional[str] = None,
        exit_status: Optional[int] = None,
        key: Optional[str] = None,
    ) -> Node:
        """Turns a stopped attempt's writes into a child node of its node (no gate, no
        copy). ``state``: the child's logical state (a JSON object, default {}).

        Raises FailedPreconditionError when the session is not a stopped running
        attempt (still mounted, already ended)."""
        req = pb.CheckpointRequest(
            session_id=session_id,
            state=_state_json(state),
            command=command or "",
            has_exit_status=exit_status is not None,
            exit_status=exit_status or 0,
            key=key or "",
        )
        return Node.from_pb(self._call(self._stub.Checkpoint, req))

    def merge(
        self, a: str, b: str, *, state: Optional[State] = None, key: Optional[str] = None
    ) -> MergeResult:
        """Merges node ``b`` into node ``a`` over their lowest common ancestor (gate
        rules). A conflict is an answer, not an error: ``node`` None and the
        merge's ``session`` naming the paths."""
        req = pb.MergeNodesRequest(a=a, b=b, state=_state_json(state), key=key or "")
        return MergeResult.from_pb(self._call(self._stub.MergeNodes, req))

    def promote(
        self, node: str, branch: str = "", *, stack: str = "", key: Optional[str] = None
    ) -> PromoteResult:
        """Moves ``branch`` (default: the branch the node's graph was made on) to the
        node's root: fast-forward, a merge publish, or refused whole (``result``
        "conflict", ``refused`` True) when newer work on the branch conflicts —
        a stale node never overwrites it.

        Raises InvalidArgumentError when ``stack`` is given and is not the node's."""
        req = pb.PromoteNodeRequest(
            node=node, branch=branch, key=key or "", stack=stack, namespace=self.namespace
        )
        return PromoteResult.from_pb(self._call(self._stub.PromoteNode, req))

    def fsck(self, *, repair: bool = False, content: bool = False) -> FsckReport:
        """The store checked against its filesystem (docs/operations.md "fsck");
        ``repair`` fixes what loses no committed change; ``content`` also hashes
        every written file of a live layer against its index digest (problem
        kind ``content-mismatch``; reads them all)."""
        return FsckReport.from_pb(
            self._call(self._stub.Fsck, pb.FsckRequest(repair=repair, content=content), None)
        )

    def push(
        self,
        reference: str,
        *,
        node: Optional[str] = None,
        stack: Optional[str] = None,
        branch: str = "",
        username: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        compression: str = "gzip",
        timeout_s: Optional[float] = None,
    ) -> PushResult:
        """Pushes graph node ``node`` (its id is kept in the image's
        annotations) or branch ``branch`` of ``stack`` to the OCI registry at
        ``reference`` (``REGISTRY[:PORT]/REPOSITORY[:TAG]``), by the daemon:
        only the blobs the registry lacks are sent (``PushResult.blobs_sent``).
        Credentials: ``username`` + ``password``, or ``token`` (a bearer
        token); none: the daemon's ``[registry] docker_config``, else
        anonymous. The registry must speak TLS unless the daemon's
        ``[registry] insecure`` names it.

        Raises: NotFoundError (node, stack, branch), InvalidArgumentError (a
        bad reference, named), PermissionDeniedError (the registry wanted
        credentials and got none, or refused those sent: the message says
        which), UnavailableError (it cannot be
        reached), FailedPreconditionError (TLS, or plain HTTP to a registry not
        named insecure); ValueError (both or neither of node and stack)."""
        if (node is None) == (stack is None):
            raise ValueError("give exactly one of node= and stack=")
        req = pb.PushRequest(
            node=node or "",
            namespace=self.namespace,
            stack=stack or "",
            branch=branch,
            reference=reference,
            auth=registry_auth(username, password, token),
            compression=compression,
        )
        return PushResult.from_pb(self._call(self._stub.Push, req, timeout_s))

    def pull(
        self,
        reference: str,
        *,
        username: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
        graph: Optional[str] = None,
        branch: Optional[str] = None,
        timeout_s: Optional[float] = None,
    ) -> PullResult:
        """Pulls the node :meth:`push` put at ``reference`` (by tag or
        ``@sha256:`` digest) into this daemon's store, by the daemon: it keeps
        its id, state, provenance and graph; only the layers this store lacks
        are downloaded (``PullResult.layers_fetched``); an imported base
        missing here comes from the image. Credentials as :meth:`push`.
        ``graph``: the graph to record a node new here in (default: the one
        the image names), for a store with a graph of that name whose root
        differs; a node already here keeps its graph.

        A branch head's image (``push(stack=…)``) lands on a branch: the one
        it was pushed from, or ``branch``; a node's lands on ``branch`` when
        given. The branch is made when the stack has none of that name, else
        promoted onto (up to date, fast-forward, or a merge through its gate):
        ``PullResult.branch_result``.

        Raises: InvalidArgumentError (not an image ``push`` made; a bad branch
        name; ``graph`` for a branch head), ConflictError (the pulled head
        conflicts with the branch's own work: nothing changed; pull onto
        another ``branch``),
        AlreadyExistsError (a node of that id with other content here),
        FailedPreconditionError (the stack's base is missing and cannot be made
        from the image; or a graph of the node's graph name, with another
        root, exists here already: pull into another daemon), CorruptError (a
        blob's bytes do not match its digest: nothing is kept; delete the blob
        from the registry before pushing again, since a push sends only blobs
        the registry lacks), NotFoundError (no such image), and the registry's
        errors as :meth:`push`."""
        req = pb.PullRequest(reference=reference, auth=registry_auth(username, password, token), graph=graph or "", branch=branch or "")
        return PullResult.from_pb(self._call(self._stub.Pull, req, timeout_s))

    def prune(self, node: str, *, key: Optional[str] = None) -> List[str]:
        """Prunes ``node``'s subtree (collectable unless leased, a branch or a live
        attempt reaches it). Returns the pruned node ids."""
        r = self._call(self._stub.PruneNode, pb.PruneNodeRequest(node=node, key=key or ""))
        return list(r.pruned)

    def start_attempt(
        self,
        node: str,
        *,
        owner: str = "",
        policy: str = "",
        key: Optional[str] = None,
    ) -> AttemptStart:
        """Starts an attempt of ``node`` in a new session leasing its root, for a
        client that mounts ``mounts`` itself (``run(node=…)`` and
        ``create_session(node=…)`` do it for you). ``policy``: the exit policy
        recorded on the session (default checkpoint)."""
        req = pb.StartAttemptRequest(node=node, owner=owner, key=key or "", policy=policy)
        return AttemptStart.from_pb(self._call(self._stub.StartAttempt, req))

    def list_attempts(self, node: str) -> List[Attempt]:
        """The attempts of ``node``, oldest first (fetched a page of up to 1,000 at a time)."""
        out: List[Attempt] = []
        token = ""
        while True:
            req = pb.ListAttemptsRequest(node=node, page_token=token)
            r = self._call(self._stub.ListAttempts, req)
            out.extend(Attempt.from_pb(a) for a in r.attempts)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    def retry(
        self,
        attempt: int,
        *,
        owner: str = "",
        policy: str = "",
        key: Optional[str] = None,
    ) -> AttemptStart:
        """A new attempt of the same node as ``attempt`` (as :meth:`start_attempt`)."""
        req = pb.RetryAttemptRequest(attempt=attempt, owner=owner, key=key or "", policy=policy)
        return AttemptStart.from_pb(self._call(self._stub.RetryAttempt, req))
