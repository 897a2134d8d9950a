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

import io
import os
from pathlib import Path
from typing import Any, AsyncIterator, BinaryIO, Generator, List, Mapping, Optional, Union

import grpc
import grpc.aio

from layerstack._channel import Endpoint, PemSource
from layerstack._pb import admin_pb2 as pb
from layerstack._pb import admin_pb2_grpc as pb_grpc
from layerstack.client import DEFAULT_ADMIN_ADDRESS, _check_exit_policy
from layerstack.errors import NotFoundError, from_rpc_error
from layerstack.sandbox import (
    Command,
    Content,
    ExecChunk,
    ExecFold,
    ExecOutput,
    FileInfo,
    PathChange,
    UploadSummary,
    User,
    close_request,
    create_request,
    ended_or_raise,
    exec_item,
    exec_request,
    sandbox_options,
    upload_requests,
    upload_summary,
    write_requests,
)
from layerstack.types import Graph, Node, Session, Status

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncFiles", "connect"]



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

    async def close(self) -> None:
        """Closes the channel (calls in flight are cancelled)."""
        await self._channel.close(None)

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

    async def _stream(self, fn: Any, req: Any, timeout_s: Optional[float] = None) -> AsyncIterator[Any]:
        try:
            async for r in fn(req, timeout=timeout_s):
                yield r
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # ---------------------------------------------------------------- calls

    async def status(self) -> Status:
        """The daemon's status."""
        return Status.from_pb(await self._call(self._stub.Status, pb.StatusRequest()))

    async def create_graph(self, name: str, stack: str, *, branch: str = "", key: Optional[str] = None) -> Graph:
        """As :meth:`layerstack.Client.create_graph`."""
        req = pb.CreateGraphRequest(namespace=self.namespace, stack=stack, branch=branch, name=name, key=key or "")
        return Graph.from_pb(await self._call(self._stub.CreateGraph, req))

    async def show_node(self, node_id: str) -> Node:
        """Node ``node_id``. NotFoundError if none."""
        return Node.from_pb(await self._call(self._stub.ShowNode, pb.ShowNodeRequest(id=node_id)))

    async def wait(self, session_id: int, *, timeout_ms: int = 0) -> Session:
        """As :meth:`layerstack.Client.wait`."""
        req = pb.WaitRequest(session_id=session_id, timeout_ms=timeout_ms)
        return Session.from_pb(await self._call(self._stub.Wait, req, None))

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
    ) -> "_SandboxStart":
        """A new daemon-owned sandbox; arguments, answers and errors as
        :meth:`layerstack.Client.sandbox`. ``await`` it, or ``async with`` it."""
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
            options=sandbox_options(
                network=network,
                user=user,
                workdir=workdir,
                env=env,
                hostname=hostname,
                cpu_millis=cpu_millis,
                memory_bytes=memory_bytes,
                pids=pids,
                mount_at=mount_at,
            ),
        )
        timeout = None if self.timeout_s is None else self.timeout_s + wait_s
        return _SandboxStart(self, req, timeout)


class _SandboxStart:
    """``await`` → :class:`AsyncSandbox`; ``async with`` → the same, discarded
    on leaving the block unclosed."""

    def __init__(self, client: AsyncClient, req: Any, timeout_s: Optional[float]) -> None:
        self._client, self._req, self._timeout_s = client, req, timeout_s
        self._sb: Optional[AsyncSandbox] = None

    async def _start(self) -> "AsyncSandbox":
        r = await self._client._call(self._client._stub.CreateSession, self._req, self._timeout_s)
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
        req = pb.ReadFileRequest(session_id=self._sb.id, path=path, offset=offset, limit=limit)
        out = io.BytesIO()
        async for c in self._sb._client._stream(self._sb._client._stub.ReadFile, req):
            out.write(c.data)
        return out.getvalue()

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(
        self, path: str, data: Content, *, mode: int = 0o644, make_parents: bool = True, owner: Optional[User] = None
    ) -> FileInfo:
        reqs = write_requests(self._sb.id, path, data, mode=mode, make_parents=make_parents, owner=owner)
        return FileInfo.from_pb(await self._sb._client._call(self._sb._client._stub.WriteFile, reqs))

    async def list(self, path: str = "/") -> List[FileInfo]:
        r = await self._sb._client._call(
            self._sb._client._stub.ListDir, pb.ListDirRequest(session_id=self._sb.id, path=path)
        )
        return [FileInfo.from_pb(e) for e in r.entries]

    async def stat(self, path: str) -> FileInfo:
        req = pb.StatPathRequest(session_id=self._sb.id, path=path)
        return FileInfo.from_pb(await self._sb._client._call(self._sb._client._stub.StatPath, req))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except NotFoundError:
            return False

    async def remove(self, path: str, *, recursive: bool = False) -> int:
        req = pb.RemovePathRequest(session_id=self._sb.id, path=path, recursive=recursive)
        return int((await self._sb._client._call(self._sb._client._stub.RemovePath, req)).removed)

    async def upload(
        self, directory: str, tar: Union[bytes, BinaryIO, "os.PathLike[str]"], *, make_parents: bool = True
    ) -> UploadSummary:
        reqs = upload_requests(self._sb.id, directory, tar, make_parents)
        return upload_summary(await self._sb._client._call(self._sb._client._stub.UploadTar, reqs))

    async def download(self, path: str) -> bytes:
        req = pb.DownloadTarRequest(session_id=self._sb.id, path=path)
        out = io.BytesIO()
        async for c in self._sb._client._stream(self._sb._client._stub.DownloadTar, req):
            out.write(c.data)
        return out.getvalue()


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
    ) -> AsyncIterator[Union[ExecChunk, ExecOutput]]:
        """Yields the output as it comes, then the :class:`ExecOutput`."""
        req = exec_request(self.id, cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s)
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
    ) -> ExecOutput:
        """Runs ``cmd`` and waits for it (see :meth:`layerstack.sandbox.Sandbox.exec`)."""
        fold = ExecFold()
        async for item in self.exec_stream(cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s):
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
        if self.outcome is not None:
            return self.outcome
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
        return self.outcome

    async def discard(self, reason: str = "python sandbox discard") -> Session:
        """Ends the sandbox and drops its writes."""
        return await self.close(action="discard", reason=reason)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.outcome is None:
            await self.discard(reason="python sandbox left its async with block unclosed")

    def __repr__(self) -> str:
        state = self.outcome.outcome if self.outcome is not None else "live"
        return f"<AsyncSandbox session={self.id} {state}>"

