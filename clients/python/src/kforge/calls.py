"""Invoking one RPC: the behaviour every generated client method delegates to.

A call gets the connection's metadata (the bearer token), the trace context (`kforge.tracing`) and the caller's
own metadata; its deadline is the caller's `timeout`, else, for unary calls, the connection's default; a unary
call is retried as the connection's `RetryPolicy` says (`kforge.retry`); and a failed call raises the
`KforgeError` subclass of its status (`kforge.errors`), for streams when the failure is read.

There is one callable class per RPC shape, sync and async: `UnaryUnary`, `UnaryStream`, `StreamUnary`,
`StreamStream` and their `Async` twins. A connection makes them (`Connection.unary_unary(method)`, ...).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, Protocol, Self, TypeAlias, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from kforge.errors import error_from_rpc
from kforge.retry import RetryPolicy, call_with_retry, call_with_retry_async
from kforge.tracing import TRACEPARENT, current_trace_metadata

__all__ = [
    "AsyncResponseStream",
    "AsyncStreamStream",
    "AsyncStreamUnary",
    "AsyncUnaryStream",
    "AsyncUnaryUnary",
    "CallPolicy",
    "Metadata",
    "Method",
    "ResponseStream",
    "StreamStream",
    "StreamUnary",
    "UnaryStream",
    "UnaryUnary",
]

Metadata: TypeAlias = Sequence[tuple[str, str | bytes]]
"""gRPC metadata: (key, value) pairs; keys lowercase, values `bytes` for keys ending in `-bin`."""

RequestT = TypeVar("RequestT", bound=Message)
ResponseT = TypeVar("ResponseT", bound=Message)
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Method(Generic[RequestT, ResponseT]):
    """One RPC: its path (`/kforge.v1.Evaluator/Evaluate`) and message classes."""

    path: str
    request_type: type[RequestT]
    response_type: type[ResponseT]

    def serialize(self, request: RequestT) -> bytes:
        """The request's wire form."""
        return request.SerializeToString()

    def deserialize(self, data: bytes) -> ResponseT:
        """A response from its wire form."""
        return self.response_type.FromString(data)


@dataclass(frozen=True, kw_only=True)
class CallPolicy:
    """What every call through one connection gets.

    Attributes:
        metadata: Sent with every call (the `authorization` header); a call's own metadata replaces a key it names.
        timeout: Default deadline of unary calls, in seconds from the call; None: no deadline.
        retry: How unary calls are retried.
    """

    metadata: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def metadata_for(self, extra: Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
        """A call's metadata: the connection's, the current trace context, then the call's own `extra`."""
        extra = tuple(extra or ())
        named = {key for key, _ in extra}
        ambient = self.metadata + (() if TRACEPARENT in named else current_trace_metadata())
        return tuple(entry for entry in ambient if entry[0] not in named) + extra

    def unary_timeout(self, timeout: float | None) -> float | None:
        """A unary call's deadline in seconds: its own, else the connection's default."""
        return self.timeout if timeout is None else timeout


class _SyncStreamCall(Protocol[T_co]):
    """What a sync streaming call is: an iterator of responses that can be cancelled."""

    def __next__(self) -> T_co: ...
    def cancel(self) -> bool: ...


class _AsyncStreamCall(Protocol[T_co]):
    """What an asyncio streaming call is: an async iterable of responses that can be cancelled."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...
    def cancel(self) -> bool: ...


class ResponseStream(Iterator[ResponseT]):
    """The responses of a streaming call, in order; iterating raises `KforgeError` if the call fails.

    Leaving a `with` block around it, or `cancel()`, cancels a call still running.
    """

    def __init__(self, call: _SyncStreamCall[ResponseT]) -> None:
        self._call = call

    def __next__(self) -> ResponseT:
        try:
            return next(self._call)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def cancel(self) -> None:
        """Cancels the call; reading on raises `Cancelled`."""
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.cancel()


class AsyncResponseStream(AsyncIterator[ResponseT]):
    """The responses of a streaming asyncio call, in order; iterating raises `KforgeError` if the call fails.

    Leaving an `async with` block around it, or `cancel()`, cancels a call still running.
    """

    def __init__(self, call: _AsyncStreamCall[ResponseT]) -> None:
        self._call = call
        self._responses = aiter(call)

    async def __anext__(self) -> ResponseT:
        try:
            return await anext(self._responses)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error

    def cancel(self) -> None:
        """Cancels the call; reading on raises `asyncio.CancelledError`, as a cancelled asyncio call does."""
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.cancel()


class UnaryUnary(Generic[RequestT, ResponseT]):
    """A unary RPC on a sync channel: deadline, metadata, retries, errors."""

    def __init__(self, channel: grpc.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.unary_unary(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self, request: RequestT, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ResponseT:
        """The response; `timeout` bounds the whole call, retries and their waits included."""
        sent = self._policy.metadata_for(metadata)

        def attempt(time_left: float | None) -> ResponseT:
            try:
                return self._call(request, timeout=time_left, metadata=sent)
            except grpc.RpcError as error:
                raise error_from_rpc(error) from error

        return call_with_retry(attempt, self._policy.retry, self._policy.unary_timeout(timeout))


class UnaryStream(Generic[RequestT, ResponseT]):
    """A server-streaming RPC on a sync channel."""

    def __init__(self, channel: grpc.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.unary_stream(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self, request: RequestT, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ResponseStream[ResponseT]:
        """The responses as they arrive; `timeout` bounds the whole stream."""
        return ResponseStream(self._call(request, timeout=timeout, metadata=self._policy.metadata_for(metadata)))


class StreamUnary(Generic[RequestT, ResponseT]):
    """A client-streaming RPC on a sync channel (not retried: the requests may be consumed)."""

    def __init__(self, channel: grpc.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.stream_unary(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self, requests: Iterable[RequestT], *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ResponseT:
        """The response to the requests, read from `requests` on gRPC's thread."""
        try:
            return self._call(iter(requests), timeout=timeout, metadata=self._policy.metadata_for(metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error


class StreamStream(Generic[RequestT, ResponseT]):
    """A bidirectional-streaming RPC on a sync channel: requests are read from the iterable on gRPC's thread."""

    def __init__(self, channel: grpc.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.stream_stream(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self, requests: Iterable[RequestT], *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ResponseStream[ResponseT]:
        """The responses as they arrive, while `requests` is read on gRPC's thread."""
        call = self._call(iter(requests), timeout=timeout, metadata=self._policy.metadata_for(metadata))
        return ResponseStream(call)


class AsyncUnaryUnary(Generic[RequestT, ResponseT]):
    """A unary RPC on an asyncio channel: deadline, metadata, retries, errors."""

    def __init__(self, channel: grpc.aio.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.unary_unary(method.path, method.serialize, method.deserialize)
        self._policy = policy

    async def __call__(
        self, request: RequestT, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ResponseT:
        """The response; `timeout` bounds the whole call, retries and their waits included."""
        sent = self._policy.metadata_for(metadata)

        async def attempt(time_left: float | None) -> ResponseT:
            try:
                return await self._call(request, timeout=time_left, metadata=sent)
            except grpc.RpcError as error:
                raise error_from_rpc(error) from error

        return await call_with_retry_async(attempt, self._policy.retry, self._policy.unary_timeout(timeout))


class AsyncUnaryStream(Generic[RequestT, ResponseT]):
    """A server-streaming RPC on an asyncio channel."""

    def __init__(self, channel: grpc.aio.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.unary_stream(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self, request: RequestT, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> AsyncResponseStream[ResponseT]:
        """The responses as they arrive; `timeout` bounds the whole stream."""
        return AsyncResponseStream(self._call(request, timeout=timeout, metadata=self._policy.metadata_for(metadata)))


class AsyncStreamUnary(Generic[RequestT, ResponseT]):
    """A client-streaming RPC on an asyncio channel (not retried: the requests may be consumed)."""

    def __init__(self, channel: grpc.aio.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.stream_unary(method.path, method.serialize, method.deserialize)
        self._policy = policy

    async def __call__(
        self,
        requests: AsyncIterable[RequestT] | Iterable[RequestT],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> ResponseT:
        """The response to the requests (an iterable or an async iterable)."""
        try:
            return await self._call(_iterator(requests), timeout=timeout, metadata=self._policy.metadata_for(metadata))
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error


class AsyncStreamStream(Generic[RequestT, ResponseT]):
    """A bidirectional-streaming RPC on an asyncio channel."""

    def __init__(self, channel: grpc.aio.Channel, method: Method[RequestT, ResponseT], policy: CallPolicy) -> None:
        self._call = channel.stream_stream(method.path, method.serialize, method.deserialize)
        self._policy = policy

    def __call__(
        self,
        requests: AsyncIterable[RequestT] | Iterable[RequestT],
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncResponseStream[ResponseT]:
        """The responses as they arrive, while `requests` (an iterable or an async iterable) is read."""
        call = self._call(_iterator(requests), timeout=timeout, metadata=self._policy.metadata_for(metadata))
        return AsyncResponseStream(call)


def _iterator(requests: AsyncIterable[RequestT] | Iterable[RequestT]) -> AsyncIterator[RequestT] | Iterator[RequestT]:
    return aiter(requests) if isinstance(requests, AsyncIterable) else iter(requests)
