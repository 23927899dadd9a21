"""`Client` and `AsyncClient`: the five services' clients over one address, or one address per service.

`Client()` reaches the addresses `kforge up` listens on by default; `Client("https://kforge.example")` one front
serving every service; `Client({"orchestrator": "http://10.0.0.5:50055", ...})` each service where it is (only the
services named are usable). Services at the same address share one channel; each service's client is made on first
use and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from types import TracebackType
from typing import Final, Generic, Literal, Self, TypeVar, Unpack

from kforge.connection import AsyncConnection, Connection, ConnectOptions, connect, connect_async
from kforge.v1.clients import (
    AsyncEvaluatorClient,
    AsyncGatewayClient,
    AsyncOrchestratorClient,
    AsyncProfilerClient,
    AsyncRewardClient,
    EvaluatorClient,
    GatewayClient,
    OrchestratorClient,
    ProfilerClient,
    RewardClient,
)

__all__ = ["DEFAULT_ADDRESSES", "SERVICES", "AsyncClient", "Client", "ServiceName"]

ServiceName = Literal["evaluator", "profiler", "reward", "gateway", "orchestrator"]

SERVICES: Final[tuple[ServiceName, ...]] = ("evaluator", "profiler", "reward", "gateway", "orchestrator")

DEFAULT_ADDRESSES: Final[Mapping[ServiceName, str]] = {
    "evaluator": "http://127.0.0.1:50051",
    "profiler": "http://127.0.0.1:50052",
    "reward": "http://127.0.0.1:50053",
    "gateway": "http://127.0.0.1:50054",
    "orchestrator": "http://127.0.0.1:50055",
}
"""Where `kforge up` serves each service by default (docs/ARCHITECTURE.md)."""

ConnectionT = TypeVar("ConnectionT", Connection, AsyncConnection)


class _Services(Generic[ConnectionT]):
    """A connection per distinct address and the service each address serves."""

    def __init__(
        self,
        addresses: str | Mapping[ServiceName, str] | None,
        open_connection: Callable[[str], ConnectionT],
    ) -> None:
        if addresses is None:
            addresses = DEFAULT_ADDRESSES
        elif isinstance(addresses, str):
            addresses = dict.fromkeys(SERVICES, addresses)
        unknown = set(addresses) - set(SERVICES)
        if unknown:
            raise ValueError(f"unknown services {sorted(unknown)}; the services are {', '.join(SERVICES)}")
        self.connections: dict[str, ConnectionT] = {}
        self.by_service: dict[ServiceName, ConnectionT] = {}
        for service, address in addresses.items():
            if address not in self.connections:
                self.connections[address] = open_connection(address)
            self.by_service[service] = self.connections[address]

    def connection(self, service: ServiceName) -> ConnectionT:
        try:
            return self.by_service[service]
        except KeyError:
            raise LookupError(f"this client has no address for the {service} service") from None


class Client:
    """Sync clients of the five services: `.evaluator`, `.profiler`, `.reward`, `.gateway`, `.orchestrator`.

    `addresses` is one address for every service, a mapping from service name to address, or None for the local
    defaults (`DEFAULT_ADDRESSES`); `options` apply to every connection (`kforge.ConnectOptions`). A service the
    mapping leaves out raises LookupError when used.
    """

    def __init__(self, addresses: str | Mapping[ServiceName, str] | None = None, **options: Unpack[ConnectOptions]):
        self._services = _Services(addresses, lambda address: connect(address, **options))

    @cached_property
    def evaluator(self) -> EvaluatorClient:
        """The evaluator: evaluations of candidate kernels."""
        return EvaluatorClient(self._services.connection("evaluator"))

    @cached_property
    def profiler(self) -> ProfilerClient:
        """The profiler: Nsight Compute profiles and device specifications."""
        return ProfilerClient(self._services.connection("profiler"))

    @cached_property
    def reward(self) -> RewardClient:
        """The reward service: scores, returns, advantages, rejection sampling, diagnostics."""
        return RewardClient(self._services.connection("reward"))

    @cached_property
    def gateway(self) -> GatewayClient:
        """The inference gateway: generations and control of the model backends."""
        return GatewayClient(self._services.connection("gateway"))

    @cached_property
    def orchestrator(self) -> OrchestratorClient:
        """The orchestrator: jobs, exports and the Step API."""
        return OrchestratorClient(self._services.connection("orchestrator"))

    def close(self) -> None:
        """Closes every connection."""
        for connection in self._services.connections.values():
            connection.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    """Asyncio clients of the five services, as `Client`'s; make it inside the event loop that uses it."""

    def __init__(self, addresses: str | Mapping[ServiceName, str] | None = None, **options: Unpack[ConnectOptions]):
        self._services = _Services(addresses, lambda address: connect_async(address, **options))

    @cached_property
    def evaluator(self) -> AsyncEvaluatorClient:
        """The evaluator: evaluations of candidate kernels."""
        return AsyncEvaluatorClient(self._services.connection("evaluator"))

    @cached_property
    def profiler(self) -> AsyncProfilerClient:
        """The profiler: Nsight Compute profiles and device specifications."""
        return AsyncProfilerClient(self._services.connection("profiler"))

    @cached_property
    def reward(self) -> AsyncRewardClient:
        """The reward service: scores, returns, advantages, rejection sampling, diagnostics."""
        return AsyncRewardClient(self._services.connection("reward"))

    @cached_property
    def gateway(self) -> AsyncGatewayClient:
        """The inference gateway: generations and control of the model backends."""
        return AsyncGatewayClient(self._services.connection("gateway"))

    @cached_property
    def orchestrator(self) -> AsyncOrchestratorClient:
        """The orchestrator: jobs, exports and the Step API."""
        return AsyncOrchestratorClient(self._services.connection("orchestrator"))

    async def close(self) -> None:
        """Closes every connection."""
        for connection in self._services.connections.values():
            await connection.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()
