"""The asyncio client: sandboxes and the calls a harness makes around them, on
``grpc.aio`` — one event loop drives hundreds of sandboxes at once.

    import asyncio, layerstack.aio

    async def rollout(ls, node, i):
        async with ls.sandbox(node=node, key=f"step7/s{i}") as sb:
            out = await sb.exec("make test", timeout_s=600)
            return await sb.close(checkpoint=True, state={"reward": float(out.ok)})

    async def main():
        async with layerstack.aio.connect("/run/layerstack/admin.sock") as ls:
            g = await ls.create_graph("task-17", "import:sha256:…", key="g17")
            ends = await asyncio.gather(*(rollout(ls, g.root, i) for i in range(256)))
            print([e.node for e in ends])

Same arguments, answers and errors as the blocking client
(:meth:`layerstack.Client.sandbox`, :class:`layerstack.sandbox.Sandbox`); every
method here is a coroutine. ``ls.sandbox(…)`` is awaitable (the sandbox) and an
async context manager (the sandbox, discarded on leaving the block unclosed).
Create the client inside the event loop that uses it (``grpc.aio``'s rule).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, BinaryIO, Dict, Generator, List, Mapping, Optional, Tuple, Union

import grpc
import grpc.aio

from layerstack._channel import Endpoint, PemSource
from layerstack._pb import admin_pb2 as pb
from layerstack._pb import admin_pb2_grpc as pb_grpc
from layerstack.client import DEFAULT_ADMIN_ADDRESS, _check_exit_policy, close_session_request, list_sessions_request
from layerstack.errors import LayerStackError as LayerStackErrorBase
from layerstack.errors import DeadlineExceededError, NotFoundError, UnavailableError, closed_client_error, from_rpc_error, is_closed_channel
from layerstack.sandbox import (
    Command,
    Content,
    ExecChunk,
    ExecFold,
    ExecOutput,
    FileInfo,
    PathChange,
    RunFold,
    RunSessionResult,
    UploadSummary,
    User,
    already_ended,
    argv_of,
    count_arg,
    path_arg,
    close_request,
    create_request,
    ended_or_raise,
    exec_item,
    exec_request,
    executor_options,
    kept_writes_to_drop,
    run_request,
    upload_requests,
    upload_summary,
    write_requests,
)
from layerstack.fabric import (
    Evaluator,
    NodeStats,
    RolloutAttempt,
    Run,
    RunAudit,
    Sample,
    SampleKey,
    end_request,
)
from layerstack.types import Graph, GraphInfo, Node, PullResult, PushResult, Session, Status, registry_auth

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncFiles", "AsyncRollout", "connect"]



def connect(
    admin_address: Union[str, "os.PathLike[str]"] = DEFAULT_ADMIN_ADDRESS,
    *,
    namespace: str = "default",
    timeout_s: Optional[float] = 180.0,
    target: Optional[str] = None,
    root_certificates: PemSource = None,
    token: Optional[str] = None,
    client_certificate: PemSource = None,
    client_key: PemSource = None,
    server_name: Optional[str] = None,
) -> "AsyncClient":
    """An asyncio client of the daemon at ``admin_address`` (its admin socket)
    or ``target`` (``"host:port"`` of its TLS-only TCP listener). Arguments as
    :func:`layerstack.connect` (no ``bin_dir``: nothing here runs the binary)."""
    return AsyncClient(
        admin_address,
        namespace=namespace,
        timeout_s=timeout_s,
        target=target,
        root_certificates=root_certificates,
        token=token,
        client_certificate=client_certificate,
        client_key=client_key,
        server_name=server_name,
    )


class AsyncClient:
    """See :func:`connect`."""

    def __init__(
        self,
        admin_address: Union[str, "os.PathLike[str]"] = DEFAULT_ADMIN_ADDRESS,
        *,
        namespace: str = "default",
        timeout_s: Optional[float] = 180.0,
        target: Optional[str] = None,
        root_certificates: PemSource = None,
        token: Optional[str] = None,
        client_certificate: PemSource = None,
        client_key: PemSource = None,
        server_name: Optional[str] = None,
    ) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._channel = Endpoint(
            Path(admin_address),
            target=target,
            root_certificates=root_certificates,
            token=token,
            client_certificate=client_certificate,
            client_key=client_key,
            server_name=server_name,
        ).aio_channel()
        self._stub: Any = pb_grpc.AdminStub(self._channel)  # type: ignore[no-untyped-call]
        # Discards of sandboxes whose create was cancelled in flight.
        self._cleanups: "set[asyncio.Task[None]]" = set()

    async def close(self) -> None:
        """Closes the channel (calls in flight are cancelled), after the
        discards of sandboxes whose create was cancelled (at most
        ``CLEANUP_WAIT_S``)."""
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=CLEANUP_WAIT_S)
        await self._channel.close(None)

    def _finish_abandoned_create(self, call: Optional["asyncio.Future[Any]"], req: Any, made_key: bool) -> None:
        """A create of ``req`` whose caller will never use its sandbox (it was
        cancelled, or its call failed without an answer): in the background,
        the call ``call`` still under way is awaited and — with a key of the
        client's own (``made_key``) — the sandbox it made is discarded; with
        no answer (no call, or one that failed unavailable or past its
        deadline) the same request again answers that sandbox (or makes one),
        which is then discarded. A caller's own key keeps its sandbox: its
        retry answers it."""

        async def discard(r: Any) -> None:
            end = pb.CloseSessionRequest(
                session_id=r.session.id,
                action=pb.EndAction.Value("DISCARD"),
                reason="its create was abandoned by its caller before it was answered",
            )
            await self._call(self._stub.CloseSession, end, CLEANUP_WAIT_S)

        async def go() -> None:
            if call is not None:
                try:
                    r = await call
                except (UnavailableError, DeadlineExceededError):
                    r = None
                except (LayerStackErrorBase, asyncio.CancelledError):
                    return
                if not made_key:
                    return
                if r is not None:
                    try:
                        await discard(r)
                    except (LayerStackErrorBase, asyncio.CancelledError):
                        pass
                    return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CLEANUP_WAIT_S
            while True:
                try:
                    await discard(await self._call(self._stub.CreateSession, req, CLEANUP_WAIT_S))
                    return
                except UnavailableError:
                    # The connection the call was on may be gone.
                    if loop.time() > deadline:
                        return
                    await asyncio.sleep(0.05)
                except (LayerStackErrorBase, asyncio.CancelledError, asyncio.TimeoutError):
                    return

        t = asyncio.ensure_future(go())
        self._cleanups.add(t)
        t.add_done_callback(self._cleanups.discard)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Any, req: Any, timeout_s: Optional[float] = -1.0) -> Any:
        t = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            return await fn(req, timeout=t)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except grpc.aio.UsageError as e:
            if is_closed_channel(e):
                raise closed_client_error() from None
            raise

    async def _stream(self, fn: Any, req: Any, timeout_s: Optional[float] = None) -> AsyncIterator[Any]:
        try:
            async for r in fn(req, timeout=timeout_s):
                yield r
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        except grpc.aio.UsageError as e:
            if is_closed_channel(e):
                raise closed_client_error() from None
            raise

    # ---------------------------------------------------------------- calls

    async def status(self) -> Status:
        """The daemon's status."""
        return Status.from_pb(await self._call(self._stub.Status, pb.StatusRequest()))

    async def list_sessions(
        self,
        *,
        namespace: Optional[str] = None,
        all_namespaces: bool = False,
        owner_kind: str = "",
    ) -> List[Session]:
        """As :meth:`layerstack.Client.list_sessions`: sessions, oldest first
        (every page)."""
        out: List[Session] = []
        token = ""
        while True:
            req = list_sessions_request(self.namespace, namespace, all_namespaces, owner_kind, token)
            r = await self._call(self._stub.ListSessions, req)
            out.extend(Session.from_pb(s) for s in r.sessions)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    async def close_session(
        self,
        session_id: int,
        *,
        action: str = "auto",
        exit_status: Optional[int] = None,
        state: Optional[Mapping[str, Any]] = None,
        command: Optional[str] = None,
        reason: str = "python client close",
        timeout_s: Optional[float] = 600.0,
    ) -> Session:
        """As :meth:`layerstack.Client.close_session`: ends session
        ``session_id`` by id (``action`` auto | publish | discard |
        checkpoint) — one whose object a harness no longer holds."""
        req = close_session_request(session_id, action, exit_status, state, command, reason)
        return Session.from_pb(await self._call(self._stub.CloseSession, req, timeout_s))

    async def discard(self, session_id: int, *, reason: str = "python client discard") -> Session:
        """As :meth:`layerstack.Client.discard`: drops session ``session_id``'s
        writes (outcome ``discarded``) — also the kept writes of a sandbox
        whose run ended ``interrupted`` or ``conflict``."""
        req = pb.PublishRequest(session_id=session_id, action=pb.DISCARD, reason=reason)
        return Session.from_pb(await self._call(self._stub.Publish, req))

    async def create_graph(self, name: str, stack: str, *, branch: str = "", key: Optional[str] = None) -> Graph:
        """As :meth:`layerstack.Client.create_graph`."""
        req = pb.CreateGraphRequest(namespace=self.namespace, stack=stack, branch=branch, name=name, key=key or "")
        return Graph.from_pb(await self._call(self._stub.CreateGraph, req))

    async def list_graphs(self) -> List[GraphInfo]:
        """As :meth:`layerstack.Client.list_graphs`: every graph, by name."""
        out: List[GraphInfo] = []
        token = ""
        while True:
            r = await self._call(self._stub.ListGraphs, pb.ListGraphsRequest(page_token=token))
            out.extend(GraphInfo.from_pb(g) for g in r.graphs)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    async def show_graph(self, name: str) -> Graph:
        """As :meth:`layerstack.Client.show_graph` (the pages concatenated)."""
        whole = pb.Graph()
        async for page in self._stream(self._stub.ShowGraph, pb.ShowGraphRequest(name=name), self.timeout_s):
            whole.MergeFrom(page)
        return Graph.from_pb(whole)

    async def prune(self, node: str, *, key: Optional[str] = None) -> List[str]:
        """As :meth:`layerstack.Client.prune`: the pruned node ids;
        FailedPreconditionError while something live reaches the subtree (a
        running attempt, a branch, a frontier lease)."""
        r = await self._call(self._stub.PruneNode, pb.PruneNodeRequest(node=node, key=key or ""))
        return list(r.pruned)

    async def show_node(self, node_id: str) -> Node:
        """Node ``node_id``. NotFoundError if none."""
        return Node.from_pb(await self._call(self._stub.ShowNode, pb.ShowNodeRequest(id=node_id)))

    async def wait(self, session_id: int, *, timeout_ms: int = 0) -> Session:
        """As :meth:`layerstack.Client.wait`."""
        req = pb.WaitRequest(session_id=session_id, timeout_ms=timeout_ms)
        return Session.from_pb(await self._call(self._stub.Wait, req, None))

    # ----------------------------------------------------- rollout fabric

    async def push(
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
        """As :meth:`layerstack.Client.push`."""
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
        return PushResult.from_pb(await self._call(self._stub.Push, req, timeout_s))

    async def pull(
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
        """As :meth:`layerstack.Client.pull`."""
        req = pb.PullRequest(reference=reference, auth=registry_auth(username, password, token), graph=graph or "", branch=branch or "")
        return PullResult.from_pb(await self._call(self._stub.Pull, req, timeout_s))

    async def create_run(self, name: str, graph: str, *, labels: Optional[Mapping[str, str]] = None) -> Run:
        """Run ``name`` over graph ``graph`` (the same again: the run as it is).
        NotFoundError (graph), AlreadyExistsError (a run over another graph)."""
        req = pb.CreateRunRequest(name=name, graph=graph, labels=dict(labels or {}))
        return Run.from_pb((await self._call(self._stub.CreateRun, req)).run)

    async def runs(self) -> List[Run]:
        """Every run, by name."""
        return [Run.from_pb(r) for r in (await self._call(self._stub.ListRuns, pb.ListRunsRequest())).runs]

    async def begin_rollout(
        self,
        key: SampleKey,
        attempt: int,
        node: str,
        *,
        policy: str = "policy",
        seed: Optional[int] = None,
        wait_s: float = 60.0,
        network: bool = False,
        user: Optional[User] = None,
        workdir: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cpu_millis: Optional[int] = None,
        memory_bytes: Optional[int] = None,
        pids: Optional[int] = None,
        executor: str = "linux",
        fuel: Optional[int] = None,
        run_timeout_s: Optional[float] = None,
        worker: Optional[str] = None,
    ) -> "AsyncRollout":
        """Starts attempt ``attempt`` (from 1) of sample ``key`` in a new
        sandbox on ``node`` — or the same attempt again (a repeated call). A
        sample rewarded before starts nothing: ``.rewarded`` is true and
        ``.sample`` holds its reward. FailedPreconditionError: the attempt
        exists with another policy or seed, or the sample starts from another
        node; BusyError: no sandbox slot within ``wait_s``. ``executor``,
        ``fuel``, ``run_timeout_s``: as :meth:`layerstack.Client.sandbox`
        (``executor="wasi"``: the attempt runs WebAssembly modules).

        ``worker``: a remote attempt (e.g. the Ray node id of a
        :class:`layerstack.ray.Worker`): recorded on this daemon with no
        sandbox here (``.sandbox`` is ``None``; the sandbox options are not
        used); end it with ``end(..., result_node=)`` once the worker's
        checkpoint is pulled here. A repeated call names the same worker
        (another: FailedPreconditionError)."""
        if worker is not None:
            if executor != "linux":
                raise ValueError(f"worker={worker!r} with executor={executor!r}: a remote attempt's sandbox is its worker's")
            req = pb.BeginRolloutRequest(
                sample=key.to_pb(), attempt=attempt, node=node, policy=policy,
                has_seed=seed is not None, seed=seed or 0, worker=worker,
            )
        else:
            options, wasi = executor_options(
                executor,
                network=network,
                user=user,
                workdir=workdir,
                env=env,
                hostname=None,
                cpu_millis=cpu_millis,
                memory_bytes=memory_bytes,
                pids=pids,
                mount_at=None,
                fuel=fuel,
                run_timeout_s=run_timeout_s,
            )
            req = pb.BeginRolloutRequest(
                sample=key.to_pb(),
                attempt=attempt,
                node=node,
                policy=policy,
                has_seed=seed is not None,
                seed=seed or 0,
                wait_ms=int(wait_s * 1000),
                sandbox=options,
                wasi=wasi,
            )
        timeout = None if self.timeout_s is None else self.timeout_s + wait_s
        r = await self._call(self._stub.BeginRollout, req, timeout)
        sb = AsyncSandbox(self, Session.from_pb(r.session), r.created) if r.HasField("session") else None
        return AsyncRollout(
            self,
            RolloutAttempt.from_pb(r.attempt) if r.HasField("attempt") else None,
            sb,
            created=r.created,
            rewarded=r.rewarded,
            sample=Sample.from_pb(r.sample) if r.HasField("sample") else None,
        )

    async def end_rollout(self, attempt_id: int, **kw: Any) -> RolloutAttempt:
        """Ends rollout attempt ``attempt_id``: see :meth:`AsyncRollout.end`."""
        return RolloutAttempt.from_pb(await self._call(self._stub.EndRollout, end_request(attempt_id, **kw), None))

    async def sample(self, key: SampleKey) -> Optional[Sample]:
        """Sample ``key``; ``None`` when no attempt of it was begun."""
        try:
            return Sample.from_pb(await self._call(self._stub.GetSample, key.to_pb()))
        except NotFoundError:
            return None

    async def sample_attempts(self, key: SampleKey) -> int:
        """The highest attempt number begun for ``key`` (0: none); attempts of it
        still running (a crashed harness's) are ended ``infra_failed(abandoned)``
        and their sandboxes discarded first."""
        s = await self.sample(key)
        if s is None:
            return 0
        for a in s.running:
            try:
                await self.end_rollout(a, infra_failed="abandoned", message="a new fan-out took over the sample",
                                       keep="discard")
            except LayerStackErrorBase:
                pass
        return s.max_attempt

    async def rollouts(self, run: str, *, step: Optional[int] = None, page_size: int = 0) -> AsyncIterator[RolloutAttempt]:
        """Every attempt of run ``run`` (of ``step``), by id, page by page."""
        token = ""
        while True:
            req = pb.ListRolloutsRequest(run=run, has_step=step is not None, step=step or 0,
                                         page_size=page_size, page_token=token)
            r = await self._call(self._stub.ListRollouts, req)
            for a in r.attempts:
                yield RolloutAttempt.from_pb(a)
            token = r.next_page_token
            if not token:
                return

    async def audit_run(self, run: str) -> RunAudit:
        """Run ``run``'s exactly-once audit."""
        return RunAudit.from_pb(await self._call(self._stub.AuditRun, pb.AuditRunRequest(run=run)))

    async def read_blob(self, digest: str) -> bytes:
        """A trajectory's or an artifact's bytes. NotFoundError if none."""
        out = io.BytesIO()
        async for c in self._stream(self._stub.ReadBlob, pb.ReadBlobRequest(digest=digest), self.timeout_s):
            out.write(c.data)
        return out.getvalue()

    async def node_stats(self, node: str, *, children: bool = False) -> "tuple[NodeStats, List[NodeStats]]":
        """``node``'s search statistics and (``children``) its children's."""
        r = await self._call(self._stub.GetNodeStats, pb.GetNodeStatsRequest(node=node, children=children))
        return NodeStats.from_pb(r.node), [NodeStats.from_pb(c) for c in r.children]

    async def set_prior(self, node: str, prior: float) -> NodeStats:
        """Sets ``node``'s prior (PUCT)."""
        return NodeStats.from_pb(await self._call(self._stub.SetPrior, pb.SetPriorRequest(node=node, prior=prior)))

    async def lease_frontier(self, holder: str, nodes: List[str]) -> List[str]:
        """Leases ``nodes`` to frontier ``holder``: never pruned until released.
        Answers the holder's frontier."""
        req = pb.FrontierRequest(holder=holder, nodes=nodes)
        return list((await self._call(self._stub.LeaseFrontier, req)).nodes)

    async def release_frontier(self, holder: str, nodes: Optional[List[str]] = None) -> List[str]:
        """Releases ``holder``'s leases on ``nodes`` (all when ``None``)."""
        req = pb.FrontierRequest(holder=holder, nodes=nodes or [])
        return list((await self._call(self._stub.ReleaseFrontier, req)).nodes)

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
        user: Optional[User] = None,
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
    ) -> "_SandboxStart":
        """A new daemon-owned sandbox; arguments, answers and errors as
        :meth:`layerstack.Client.sandbox`. ``await`` it, or ``async with`` it."""
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
        return _SandboxStart(self, req, timeout)

    async def run_session(
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
        """:meth:`layerstack.Client.run_session`, as a coroutine."""
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
        async for r in self._stream(self._stub.RunSession, req):
            fold.add(r)
        return fold.result(check)


#: Seconds :meth:`AsyncClient.close` waits for the discards of sandboxes
#: whose create was cancelled in flight (each call of such a discard is
#: bounded by it too).
CLEANUP_WAIT_S = 10.0


class _SandboxStart:
    """``await`` → :class:`AsyncSandbox`; ``async with`` → the same, discarded
    on leaving the block unclosed."""

    def __init__(self, client: AsyncClient, req: Any, timeout_s: Optional[float]) -> None:
        self._client, self._req, self._timeout_s = client, req, timeout_s
        self._sb: Optional[AsyncSandbox] = None

    async def _start(self) -> "AsyncSandbox":
        req = self._req
        made_key = not req.idempotency_key
        if made_key:
            # A key of its own: a create whose answer never reached this
            # caller is found again by it, and discarded (the daemon keeps a
            # keyed sandbox whose caller went away, for the key's retry).
            req = pb.CreateSessionRequest()
            req.CopyFrom(self._req)
            req.idempotency_key = f"sdk-{uuid.uuid4().hex}"
        # The call is not cancelled with its caller: it runs to its answer
        # in the background (a cancelled call is reset, and a burst of resets
        # makes the daemon's HTTP/2 layer close the connection under every
        # other call on it), and the sandbox it made for a caller that is
        # gone is discarded then.
        call = asyncio.ensure_future(self._client._call(self._client._stub.CreateSession, req, self._timeout_s))
        try:
            r = await asyncio.shield(call)
        except asyncio.CancelledError:
            self._client._finish_abandoned_create(call, req, made_key)
            raise
        except (UnavailableError, DeadlineExceededError):
            # Made or not, no answer came: a sandbox made under the key is
            # found by it and discarded.
            if made_key:
                self._client._finish_abandoned_create(None, req, made_key)
            raise
        return AsyncSandbox(self._client, Session.from_pb(r.session), r.created)

    def __await__(self) -> Generator[Any, None, "AsyncSandbox"]:
        return self._start().__await__()

    async def __aenter__(self) -> "AsyncSandbox":
        self._sb = await self._start()
        return self._sb

    async def __aexit__(self, *exc: object) -> None:
        if self._sb is not None:
            await self._sb.__aexit__(*exc)


class AsyncFiles:
    """:class:`layerstack.sandbox.Files`, as coroutines."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def read(self, path: str, *, offset: int = 0, limit: int = 0) -> bytes:
        req = pb.ReadFileRequest(
            session_id=self._sb.id,
            path=path_arg(path),
            offset=count_arg("offset", offset),
            limit=count_arg("limit", limit),
        )
        out = io.BytesIO()
        async for c in self._sb._client._stream(self._sb._client._stub.ReadFile, req):
            out.write(c.data)
        return out.getvalue()

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(
        self, path: str, data: Content, *, mode: int = 0o644, make_parents: bool = True, owner: Optional[User] = None
    ) -> FileInfo:
        reqs = AsyncFeed(
            write_requests(self._sb.id, path, data, mode=mode, make_parents=make_parents, owner=owner), data
        )
        try:
            return FileInfo.from_pb(await self._sb._client._call(self._sb._client._stub.WriteFile, reqs))
        except BaseException:
            reqs.raise_source_error()
            raise

    async def list(self, path: str = "/") -> List[FileInfo]:
        r = await self._sb._client._call(
            self._sb._client._stub.ListDir, pb.ListDirRequest(session_id=self._sb.id, path=path_arg(path))
        )
        return [FileInfo.from_pb(e) for e in r.entries]

    async def stat(self, path: str) -> FileInfo:
        req = pb.StatPathRequest(session_id=self._sb.id, path=path_arg(path))
        return FileInfo.from_pb(await self._sb._client._call(self._sb._client._stub.StatPath, req))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFoundError:
            return False

    async def remove(self, path: str, *, recursive: bool = False) -> int:
        req = pb.RemovePathRequest(session_id=self._sb.id, path=path_arg(path), recursive=recursive)
        return int((await self._sb._client._call(self._sb._client._stub.RemovePath, req)).removed)

    async def upload(
        self, directory: str, tar: Union[bytes, BinaryIO, "os.PathLike[str]"], *, make_parents: bool = True
    ) -> UploadSummary:
        reqs = AsyncFeed(upload_requests(self._sb.id, directory, tar, make_parents), tar)
        try:
            return upload_summary(await self._sb._client._call(self._sb._client._stub.UploadTar, reqs))
        except BaseException:
            reqs.raise_source_error()
            raise

    async def download(self, path: str) -> bytes:
        req = pb.DownloadTarRequest(session_id=self._sb.id, path=path_arg(path))
        out = io.BytesIO()
        async for c in self._sb._client._stream(self._sb._client._stub.DownloadTar, req):
            out.write(c.data)
        return out.getvalue()


class AsyncFeed:
    """A request stream (a :class:`layerstack.sandbox.Feed`) for grpc's
    asyncio client, each next item made on a worker thread
    (``asyncio.to_thread``): reading a file object — a pipe, a socket, a
    slow disk — never blocks the event loop, where every other sandbox of
    the harness runs. Keeps the source's own error as ``Feed`` does (grpc's
    asyncio client reports it as a bare ``CancelledError``)."""

    def __init__(self, feed: Any, source: Any) -> None:
        self._feed = feed
        # Bytes and text are sliced in memory: no thread for them.
        self._threaded = not isinstance(source, (bytes, bytearray, memoryview, str))

    def __aiter__(self) -> "AsyncFeed":
        return self

    async def __anext__(self) -> Any:
        if self._threaded:
            item = await asyncio.to_thread(next, self._feed, _END)
        else:
            item = next(self._feed, _END)
        if item is _END:
            raise StopAsyncIteration
        return item

    def raise_source_error(self) -> None:
        self._feed.raise_source_error()


_END = object()


class AsyncSandbox:
    """:class:`layerstack.sandbox.Sandbox`, as coroutines."""

    def __init__(self, client: AsyncClient, session: Session, created: bool) -> None:
        self._client = client
        self.session = session
        self.id = session.id
        self.created = created
        self.files = AsyncFiles(self)
        self.outcome: Optional[Session] = session if (not created and session.released) else None

    @property
    def ended(self) -> bool:
        """As :attr:`layerstack.sandbox.Sandbox.ended`."""
        return self.outcome is not None

    async def exec_stream(
        self,
        cmd: Command,
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[User] = None,
        stdin: Union[bytes, str, None] = None,
        timeout_s: Optional[float] = None,
        module: Union[bytes, "os.PathLike[str]", None] = None,
    ) -> AsyncIterator[Union[ExecChunk, ExecOutput]]:
        """Yields the output as it comes, then the :class:`ExecOutput`."""
        req = exec_request(
            self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s, module=module
        )
        async for r in self._client._stream(self._client._stub.Exec, req):
            item = exec_item(r)
            if item is not None:
                yield item

    async def exec(
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
        """Runs ``cmd`` and waits for it (see :meth:`layerstack.sandbox.Sandbox.exec`)."""
        fold = ExecFold(cmd)
        async for item in self.exec_stream(
            cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s, module=module
        ):
            fold.add(item)
        return fold.result(check)

    async def diff(self, *, patch: bool = False) -> List[PathChange]:
        """What the sandbox changed so far (see :meth:`layerstack.sandbox.Sandbox.diff`)."""
        out: List[PathChange] = []
        async for r in self._client._stream(self._client._stub.Diff, pb.DiffRequest(session_id=self.id, patch=patch)):
            out.extend(PathChange.from_pb(e) for e in r.entries)
        return out

    async def close(
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
        """Ends the sandbox (see :meth:`layerstack.sandbox.Sandbox.close`)."""
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
        self.outcome = ended_or_raise(
            Session.from_pb(await self._client._call(self._client._stub.CloseSession, req, None))
        )
        # A run that had ended interrupted (the daemon restarted, its init
        # died) publishes or checkpoints nothing: raised, as a repeat is.
        return already_ended(self.outcome, checkpoint=checkpoint, publish=publish, action=action)

    async def discard(self, reason: str = "python sandbox discard") -> Session:
        """Ends the sandbox and drops its writes."""
        return await self.close(action="discard", reason=reason)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.outcome is None or kept_writes_to_drop(self.outcome, "discard"):
            await self.discard(reason="python sandbox left its async with block unclosed")

    def __repr__(self) -> str:
        state = self.outcome.outcome if self.outcome is not None else "live"
        return f"<AsyncSandbox session={self.id} {state}>"



def trajectory_record(cmd: Command, out: ExecOutput, keep_bytes: int) -> Dict[str, Any]:
    """One exec of a rollout's trajectory: ``argv``, ``exit_code``,
    ``signal``, ``timed_out``, ``duration_ms`` and the first ``keep_bytes``
    bytes of ``stdout`` / ``stderr`` (decoded, replacement characters for bad
    bytes)."""
    return {
        "argv": argv_of(cmd),
        "exit_code": out.exit_code,
        "signal": out.signal,
        "timed_out": out.timed_out,
        "duration_ms": out.duration_ms,
        "stdout": out.stdout[:keep_bytes].decode("utf-8", "replace"),
        "stderr": out.stderr[:keep_bytes].decode("utf-8", "replace"),
    }


class AsyncRollout:
    """One attempt of a sample and its sandbox (:meth:`AsyncClient.begin_rollout`).

    ``exec`` runs a command in the sandbox and appends it to ``trajectory``
    (argv, exit, duration, the first 4 KiB of output). The daemon records the
    same for every command run in the attempt's sandbox, before it answers
    the command's exit, and stores that record as the attempt's trajectory
    blob when the attempt ends (also when an infrastructure failure or a
    crash of this process ends it). ``files`` is the sandbox's file API.
    """

    #: Bytes of stdout/stderr kept per exec in the trajectory.
    KEEP_BYTES = 4096

    def __init__(
        self,
        client: AsyncClient,
        attempt: Optional[RolloutAttempt],
        sandbox: Optional[AsyncSandbox],
        *,
        created: bool,
        rewarded: bool,
        sample: Optional[Sample],
    ) -> None:
        self._client = client
        self.attempt = attempt
        self.sandbox = sandbox
        self.created = created
        self.rewarded = rewarded
        self.sample = sample
        self.trajectory: List[Dict[str, Any]] = []

    @property
    def id(self) -> int:
        if self.attempt is None:
            raise ValueError("the sample was rewarded before: no attempt was started")
        return self.attempt.id

    @property
    def key(self) -> SampleKey:
        assert self.attempt is not None
        return self.attempt.key

    @property
    def files(self) -> AsyncFiles:
        if self.sandbox is None:
            raise ValueError("this attempt has no sandbox (it ended, or its sample was rewarded before)")
        return self.sandbox.files

    async def exec(self, cmd: Command, **kw: Any) -> ExecOutput:
        """:meth:`AsyncSandbox.exec`, recorded in :attr:`trajectory`."""
        if self.sandbox is None:
            raise ValueError("this attempt has no sandbox (it ended, or its sample was rewarded before)")
        out = await self.sandbox.exec(cmd, **kw)
        self.trajectory.append(trajectory_record(cmd, out, self.KEEP_BYTES))
        return out

    async def checkpoint_for_grading(self, *, state: Union[Mapping[str, Any], str, None] = None) -> str:
        """Checkpoints the sandbox into a child node of the attempt's node and
        ends the sandbox; the attempt stays running until :meth:`end` (with the
        grader's reward) keeps or prunes that node. Returns the node id."""
        if self.sandbox is None:
            raise ValueError("this attempt has no sandbox")
        s = await self.sandbox.close(checkpoint=True, state=state, reason="rollout checkpoint for grading")
        if not s.node:
            raise RuntimeError(f"the checkpoint made no node: outcome {s.outcome}: {s.message}")
        return s.node

    async def end(self, **kw: Any) -> RolloutAttempt:
        """Ends the attempt, exactly once: ``reward=`` (completed; ``accepted``),
        ``task_failed=True`` or ``infra_failed="kind"``; ``evaluator``;
        ``backprop`` (a value to backpropagate, once); ``keep`` "checkpoint"
        (the sandbox becomes a child node in the same transaction as the
        reward) or "discard"; ``state``/``labels`` of that node; ``artifacts``
        (name → bytes); ``message``; ``result_node`` (a remote attempt's
        checkpoint, pulled here first). The attempt's trajectory is the
        daemon's record of every command it ran in the attempt's sandbox
        (the same objects as :attr:`trajectory`; kept even if this process
        dies first) unless ``trajectory=`` (bytes) is given. A repeated end
        answers the recorded one; FailedPreconditionError if it ended
        otherwise — another result, or another ``keep`` (a checkpoint
        cannot be kept after a discard, nor a kept one discarded).
        """
        self.attempt = await self._client.end_rollout(self.id, **kw)
        if self.sandbox is not None and self.sandbox.outcome is None:
            # The daemon ended the sandbox with the attempt.
            self.sandbox.outcome = self.sandbox.session
        return self.attempt

    def __repr__(self) -> str:
        if self.attempt is None:
            return "<AsyncRollout rewarded-before>"
        return f"<AsyncRollout {self.attempt.key} attempt={self.attempt.attempt} {self.attempt.status}>"
