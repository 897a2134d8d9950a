"""How a client reaches the daemon: the admin unix socket, or the TLS-only TCP
listener (``[api.tcp]``, docs/operations.md "Who may call"). Shared by the
blocking client (:mod:`layerstack.client`) and the asyncio one
(:mod:`layerstack.aio`), so both accept the same arguments and refuse the same
mistakes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import grpc
import grpc.aio

PemSource = Union[bytes, str, "os.PathLike[str]", None]

#: The largest message of the admin API either side takes, bytes (Rust
#: ``layerstack_api::MAX_MESSAGE_BYTES``): a request holding a 64 MiB WASI
#: module, or a large stdin, env or ListDir answer.
MAX_MESSAGE_BYTES = 80 << 20


def _pem(v: PemSource) -> Optional[bytes]:
    """PEM bytes as given, or read from the file path given."""
    if v is None or isinstance(v, bytes):
        return v
    return Path(v).read_bytes()


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon listens and how to prove who the client is.

    ``target`` ``None``: the admin socket ``admin_address`` (the daemon checks the
    caller's uid). Otherwise ``"host:port"`` of the TCP listener, over TLS, with
    an optional bearer ``token`` (default ``$LAYERSTACK_TOKEN``) and client
    certificate."""

    admin_address: Path
    target: Optional[str] = None
    root_certificates: PemSource = None
    token: Optional[str] = None
    client_certificate: PemSource = None
    client_key: PemSource = None
    server_name: Optional[str] = None

    def check(self) -> None:
        """ValueError naming the argument that does not fit."""
        if self.target is None:
            given = (self.root_certificates, self.token, self.client_certificate, self.client_key, self.server_name)
            if any(v is not None for v in given):
                raise ValueError(
                    "root_certificates, token, client_certificate, client_key and server_name are for a TCP "
                    "target: give target='host:port' (the admin socket checks the caller's uid instead)"
                )
        elif (self.client_certificate is None) != (self.client_key is None):
            raise ValueError("give client_certificate and client_key together")
        for name, token in (("token", self.token), ("$LAYERSTACK_TOKEN", os.environ.get("LAYERSTACK_TOKEN"))):
            if token is not None and (name == "token" or self.token is None):
                _check_token(name, token)

    def _tls(self) -> Tuple[grpc.ChannelCredentials, List[Tuple[str, Any]]]:
        token = self.token if self.token is not None else (os.environ.get("LAYERSTACK_TOKEN") or None)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_certificates),
            private_key=_pem(self.client_key),
            certificate_chain=_pem(self.client_certificate),
        )
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        options: List[Tuple[str, Any]] = list(self._RECONNECT + self._SIZES)
        if self.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return creds, options

    # grpc-core's default :authority for a unix target is the socket path, which
    # the daemon's HTTP/2 server (hyper) refuses as malformed (RST_STREAM
    # PROTOCOL_ERROR): name a plain host instead.
    # A daemon restart (kill -9, an upgrade) is seconds: reconnect within
    # 100 ms to 2 s of its return, not grpc-core's default of up to 120 s.
    _RECONNECT = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000))
    # Messages up to the daemon's limit both ways (grpcio's default receive
    # limit is 4 MiB: a large ListDir answer was refused).
    _SIZES = (
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    )
    _UNIX_OPTIONS = (("grpc.default_authority", "localhost"),) + _RECONNECT + _SIZES
    # A blocking channel's server-streaming calls (Exec, ReadFile, Diff) are
    # read on the calling thread, as its unary calls are, instead of through
    # grpcio's channel thread: one thread hand-off less per message (P7b's
    # exec round trip, docs/benchmarks.md). grpcio's
    # `grpc.experimental.ChannelOptions.SingleThreadedUnaryStream`, by its
    # value: an older grpcio ignores the option.
    _SYNC = (("SingleThreadedUnaryStream", 1),)

    def channel(self) -> grpc.Channel:
        """A blocking channel (lazy: nothing is dialled until the first call)."""
        self.check()
        if self.target is None:
            return grpc.insecure_channel(
                f"unix:{self.admin_address}", options=list(self._UNIX_OPTIONS + self._SYNC)
            )
        creds, options = self._tls()
        return grpc.secure_channel(self.target, creds, options=options + list(self._SYNC))

    def aio_channel(self) -> grpc.aio.Channel:
        """An asyncio channel; create it inside the event loop that uses it."""
        self.check()
        if self.target is None:
            return grpc.aio.insecure_channel(f"unix:{self.admin_address}", options=list(self._UNIX_OPTIONS))
        creds, options = self._tls()
        return grpc.aio.secure_channel(self.target, creds, options=options)


def _check_token(name: str, token: str) -> None:
    """ValueError naming ``name`` for a bearer token grpc cannot send (it
    would fail every call with UNAVAILABLE "Illegal metadata", which a
    harness retries): empty, or holding whitespace or a control character —
    most often a token file read without ``.strip()``."""
    if not isinstance(token, str):
        raise TypeError(f"{name} must be a str, not {type(token).__name__}")
    if name == "$LAYERSTACK_TOKEN" and token == "":
        return
    if not token or any(c.isspace() or not c.isprintable() or ord(c) > 126 for c in token):
        raise ValueError(
            f"{name} {'is empty' if not token else 'holds whitespace or a control character'}: give the token "
            "itself (read a token file with .read().strip())"
        )
