"""Python client of the kforge services.

- `Client` / `AsyncClient`: the five services' typed clients over one address or one per service;
- `connect` / `connect_async`: one `Connection` for the generated clients of `kforge.v1.clients`;
- `kforge.v1`: the contract's messages (`kforge.v1.evaluator_pb2`, ...), generated from the protos at build time;
- `KforgeError` and its subclasses (`kforge.errors`), `RetryPolicy` (`kforge.retry`), `trace_context`
  (`kforge.tracing`), and `Episode` / `AsyncEpisode` for the orchestrator's Step API (`kforge.episodes`).
"""

from kforge.client import DEFAULT_ADDRESSES, AsyncClient, Client
from kforge.connection import AsyncConnection, Connection, ConnectOptions, connect, connect_async
from kforge.episodes import AsyncEpisode, Episode
from kforge.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KforgeError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from kforge.retry import RetryPolicy
from kforge.tracing import trace_context

__all__ = [
    "DEFAULT_ADDRESSES",
    "Aborted",
    "AlreadyExists",
    "AsyncClient",
    "AsyncConnection",
    "AsyncEpisode",
    "Cancelled",
    "Client",
    "ConnectOptions",
    "Connection",
    "DataLoss",
    "DeadlineExceeded",
    "Episode",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KforgeError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "connect",
    "connect_async",
    "trace_context",
]
