"""Connections: a gRPC channel to one kforge server, and what every call through it gets.

`connect("http://127.0.0.1:50055")` is plaintext, `connect("https://kforge.example:443", ca_file=...)` TLS (the
system's roots unless `ca_file` names a CA; `cert_file` and `key_file` present a client certificate for mutual
TLS); `host:port` alone is plaintext. The bearer token, sent as `authorization: Bearer <token>` with every call, is
`token`, else the contents of `token_file`, else `$KFORGE_TOKEN`, else the contents of the file `$KFORGE_TOKEN_FILE`
names (the variable the `kforge` command reads), else none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack
from urllib.parse import urlsplit

import grpc
import grpc.aio

from kforge.calls import (
    AsyncStreamStream,
    AsyncStreamUnary,
    AsyncUnaryStream,
    AsyncUnaryUnary,
    CallPolicy,
    Method,
    RequestT,
    ResponseT,
    StreamStream,
    StreamUnary,
    UnaryStream,
    UnaryUnary,
)
from kforge.retry import NO_RETRY, RetryPolicy

__all__ = ["AsyncConnection", "ConnectOptions", "Connection", "Target", "connect", "connect_async"]

TOKEN_ENV = "KFORGE_TOKEN"
TOKEN_FILE_ENV = "KFORGE_TOKEN_FILE"

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""gRPC's own default (4 MiB) is below what a page of trajectories or an evaluation's samples can take."""


class ConnectOptions(TypedDict, total=False):
    """How to connect, for `connect`, `connect_async`, `kforge.Client` and `kforge.AsyncClient`.

    Keys:
        token: The bearer token (see the module's docstring for where it is read from otherwise).
        token_file: A file holding the bearer token (surrounding whitespace dropped).
        ca_file: PEM CA certificates that sign the server's certificate (`https://` only); default: system roots.
        cert_file: PEM client certificate chain, for servers that require mutual TLS (with `key_file`).
        key_file: PEM private key of `cert_file`.
        tls_domain: The name to verify the server's certificate against, when it differs from the address's host.
        timeout: Default deadline of unary calls, in seconds; None (the default): no deadline. Streaming calls
            have a deadline only when given one.
        retry: How unary calls are retried (default `RetryPolicy()`); None: never.
        max_message_bytes: Largest message sent or received (default 64 MiB).
    """

    token: str | None
    token_file: str | os.PathLike[str] | None
    ca_file: str | os.PathLike[str] | None
    cert_file: str | os.PathLike[str] | None
    key_file: str | os.PathLike[str] | None
    tls_domain: str | None
    timeout: float | None
    retry: RetryPolicy | None
    max_message_bytes: int


@dataclass(frozen=True)
class Target:
    """Where a connection goes: the gRPC target (`host:port`) and whether it speaks TLS."""

    host_port: str
    tls: bool

    @classmethod
    def parse(cls, address: str) -> Target:
        """`http://host:port` (plaintext), `https://host[:port]` (TLS, port 443 by default) or `host:port`."""
        if "://" not in address:
            return cls.parse(f"http://{address}")
        parts = urlsplit(address)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{address!r}: the scheme must be http or https")
        if not parts.hostname or parts.username or parts.password or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"{address!r}: expected scheme://host:port and nothing else")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return cls(f"{host}:{port}", tls)


@dataclass(frozen=True)
class _Settings:
    """`ConnectOptions` resolved: files read, environment consulted, defaults applied."""

    target: Target
    credentials: grpc.ChannelCredentials | None
    channel_options: tuple[tuple[str, Any], ...]
    policy: CallPolicy

    @classmethod
    def resolve(cls, address: str, options: ConnectOptions) -> _Settings:
        target = Target.parse(address)
        ca, cert, key = options.get("ca_file"), options.get("cert_file"), options.get("key_file")
        if not target.tls and (ca or cert or key or options.get("tls_domain")):
            raise ValueError(f"{address!r}: TLS options need an https:// address")
        if (cert is None) != (key is None):
            raise ValueError("cert_file and key_file go together")
        credentials = None
        if target.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(ca) if ca else None,
                private_key=_read(key) if key else None,
                certificate_chain=_read(cert) if cert else None,
            )
        size = options.get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        channel_options: tuple[tuple[str, Any], ...] = (
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
        )
        if domain := options.get("tls_domain"):
            channel_options += (("grpc.ssl_target_name_override", domain),)
        token = resolve_token(options.get("token"), options.get("token_file"))
        retry = options.get("retry", RetryPolicy())
        policy = CallPolicy(
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            timeout=options.get("timeout"),
            retry=NO_RETRY if retry is None else retry,
        )
        return cls(target, credentials, channel_options, policy)


def resolve_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    """The bearer token: `token`, `token_file`'s contents, `$KFORGE_TOKEN`, `$KFORGE_TOKEN_FILE`'s contents, or None."""
    if token is None and token_file is not None:
        token = _read(token_file).decode()
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None and (path := os.environ.get(TOKEN_FILE_ENV)):
        token = _read(path).decode()
    if token is None:
        return None
    token = token.strip()
    if not token or not all(" " < c <= "~" for c in token):
        raise ValueError("a bearer token must be non-empty printable ASCII without spaces")
    return token


def _read(path: str | os.PathLike[str]) -> bytes:
    return Path(path).read_bytes()


class Connection:
    """A sync channel to one kforge server; the generated clients take one (`EvaluatorClient(connection)`).

    Made by `connect`; closes its channel on `close()` or at the end of a `with` block.
    """

    def __init__(self, channel: grpc.Channel, policy: CallPolicy) -> None:
        self.channel = channel
        self.policy = policy

    def unary_unary(self, method: Method[RequestT, ResponseT]) -> UnaryUnary[RequestT, ResponseT]:
        """A callable for a unary RPC."""
        return UnaryUnary(self.channel, method, self.policy)

    def unary_stream(self, method: Method[RequestT, ResponseT]) -> UnaryStream[RequestT, ResponseT]:
        """A callable for a server-streaming RPC."""
        return UnaryStream(self.channel, method, self.policy)

    def stream_unary(self, method: Method[RequestT, ResponseT]) -> StreamUnary[RequestT, ResponseT]:
        """A callable for a client-streaming RPC."""
        return StreamUnary(self.channel, method, self.policy)

    def stream_stream(self, method: Method[RequestT, ResponseT]) -> StreamStream[RequestT, ResponseT]:
        """A callable for a bidirectional-streaming RPC."""
        return StreamStream(self.channel, method, self.policy)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class AsyncConnection:
    """An asyncio channel to one kforge server; the generated async clients take one.

    Made by `connect_async` inside a running event loop, which it is bound to; closes on `await close()` or at the
    end of an `async with` block.
    """

    def __init__(self, channel: grpc.aio.Channel, policy: CallPolicy) -> None:
        self.channel = channel
        self.policy = policy

    def unary_unary(self, method: Method[RequestT, ResponseT]) -> AsyncUnaryUnary[RequestT, ResponseT]:
        """A callable for a unary RPC."""
        return AsyncUnaryUnary(self.channel, method, self.policy)

    def unary_stream(self, method: Method[RequestT, ResponseT]) -> AsyncUnaryStream[RequestT, ResponseT]:
        """A callable for a server-streaming RPC."""
        return AsyncUnaryStream(self.channel, method, self.policy)

    def stream_unary(self, method: Method[RequestT, ResponseT]) -> AsyncStreamUnary[RequestT, ResponseT]:
        """A callable for a client-streaming RPC."""
        return AsyncStreamUnary(self.channel, method, self.policy)

    def stream_stream(self, method: Method[RequestT, ResponseT]) -> AsyncStreamStream[RequestT, ResponseT]:
        """A callable for a bidirectional-streaming RPC."""
        return AsyncStreamStream(self.channel, method, self.policy)

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


def connect(address: str, **options: Unpack[ConnectOptions]) -> Connection:
    """A sync connection to the kforge server at `address` (`http://host:port`, `https://host[:port]`)."""
    settings = _Settings.resolve(address, options)
    if settings.credentials is None:
        channel = grpc.insecure_channel(settings.target.host_port, options=settings.channel_options)
    else:
        channel = grpc.secure_channel(settings.target.host_port, settings.credentials, options=settings.channel_options)
    return Connection(channel, settings.policy)


def connect_async(address: str, **options: Unpack[ConnectOptions]) -> AsyncConnection:
    """An asyncio connection to the kforge server at `address`; call it inside the event loop that will use it."""
    settings = _Settings.resolve(address, options)
    if settings.credentials is None:
        channel = grpc.aio.insecure_channel(settings.target.host_port, options=settings.channel_options)
    else:
        channel = grpc.aio.secure_channel(
            settings.target.host_port, settings.credentials, options=settings.channel_options
        )
    return AsyncConnection(channel, settings.policy)
