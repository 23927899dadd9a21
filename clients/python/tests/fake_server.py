"""An in-process gRPC server standing in for the reward service, for what a real kforge cannot be made to do.

It answers `kforge.v1.Reward/ComputeReturns` with a scripted handler, and an interceptor records every call as it
arrives: its metadata and when it came. Refusals with `retry-after-ms`, slow answers and the trace context a client
sends are tested against it; what the real services do is tested against `kforge up`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from kforge.v1 import reward_pb2

Handler = Callable[[reward_pb2.ComputeReturnsRequest, grpc.ServicerContext], reward_pb2.ComputeReturnsResponse]


@dataclass(frozen=True)
class Call:
    """One call as the server received it."""

    metadata: dict[str, str | bytes]
    at: float


@dataclass
class Recorder(grpc.ServerInterceptor):
    """Records every call's metadata and arrival time before it is handled."""

    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Records the call, then hands it on."""
        with self.lock:
            self.calls.append(Call(dict(handler_call_details.invocation_metadata), time.monotonic()))
        return continuation(handler_call_details)


@dataclass(frozen=True)
class FakeReward:
    """A running fake reward server: its address and what it recorded."""

    address: str
    recorder: Recorder

    @property
    def calls(self) -> list[Call]:
        """The calls received so far, in order."""
        with self.recorder.lock:
            return list(self.recorder.calls)


def returns_response(request: reward_pb2.ComputeReturnsRequest) -> reward_pb2.ComputeReturnsResponse:
    """An answer echoing the request's trajectories (the values do not matter to these tests)."""
    return reward_pb2.ComputeReturnsResponse(trajectories=request.trajectories)


def echo(request: reward_pb2.ComputeReturnsRequest, context: grpc.ServicerContext) -> reward_pb2.ComputeReturnsResponse:
    """A handler that always answers."""
    return returns_response(request)


def returns_request() -> reward_pb2.ComputeReturnsRequest:
    """A well-formed ComputeReturns request."""
    return reward_pb2.ComputeReturnsRequest(
        method=reward_pb2.RETURN_METHOD_SUM, gamma=0.5, trajectories=[reward_pb2.TrajectoryValues(values=[1.0, 2.0])]
    )


@contextmanager
def fake_reward(
    handler: Handler, credentials: grpc.ServerCredentials | None = None, host: str = "127.0.0.1"
) -> Iterator[FakeReward]:
    """Serves `handler` as Reward/ComputeReturns on a free port of `host` (TLS with `credentials`)."""
    recorder = Recorder()
    server = grpc.server(ThreadPoolExecutor(max_workers=4), interceptors=[recorder])
    method = grpc.unary_unary_rpc_method_handler(
        handler,
        request_deserializer=reward_pb2.ComputeReturnsRequest.FromString,
        response_serializer=reward_pb2.ComputeReturnsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kforge.v1.Reward", {"ComputeReturns": method})]
    )
    if credentials is None:
        port = server.add_insecure_port(f"{host}:0")
        address = f"http://{host}:{port}"
    else:
        port = server.add_secure_port(f"{host}:0", credentials)
        address = f"https://{host}:{port}"
    server.start()
    try:
        yield FakeReward(address, recorder)
    finally:
        server.stop(grace=None).wait()
