"""One response scored as a one-turn episode (StartEpisode, Step), alone or in batches, over a client per event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kforge.adapters._config import AdapterConfig, start_kwargs
from kforge.adapters._outcomes import KernelOutcome
from kforge.adapters._tasks import TaskLike, resolve_task
from kforge.client import AsyncClient, Client
from kforge.episodes import AsyncEpisode, Episode
from kforge.v1 import common_pb2

log = logging.getLogger("kforge.adapters")


class ClientPool:
    """The clients an adapter calls through: one sync client, and one async client per event loop.

    An `AsyncClient` is bound to the loop it was made in; a trainer may call an adapter from several loops (a
    daemon loop, a loop per worker), so each running loop gets its own, and those of closed loops are dropped.
    """

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._sync: Client | None = None
        self._async: dict[asyncio.AbstractEventLoop, AsyncClient] = {}

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"timeout": self.config.timeout}
        if self.config.token is not None:
            options["token"] = self.config.token
        return options

    def sync(self) -> Client:
        """The sync client (thread-safe: a gRPC channel serves every thread)."""
        with self._lock:
            if self._sync is None:
                self._sync = Client({"orchestrator": self.config.orchestrator}, **self._options())
            return self._sync

    def for_loop(self) -> AsyncClient:
        """The async client of the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._async if other.is_closed()]:
                del self._async[stale]
            client = self._async.get(loop)
            if client is None:
                client = AsyncClient({"orchestrator": self.config.orchestrator}, **self._options())
                self._async[loop] = client
            return client

    async def aclose(self) -> None:
        """Closes the running loop's async client."""
        with self._lock:
            client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    def close(self) -> None:
        """Closes the sync client; async clients are closed by `aclose` in their loop."""
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()


# ---------------------------------------------------------------------------------------------------------------------
# Scoring one response: a one-turn episode

T = TypeVar("T")


class Scorer:
    """Scores responses as kforge does: each a one-turn episode (StartEpisode, then Step with the response).

    The orchestrator extracts the kernel (the last fenced block defining `ModelNew`), evaluates it, scores it
    with the recipe's formula and records the turn, so a trainer's reward is the one a kforge job would give.
    `score`/`ascore` raise a failed call; `score_batch`/`ascore_batch` record it in the sample's outcome.
    """

    def __init__(self, config: AdapterConfig | None = None, *, pool: ClientPool | None = None) -> None:
        self.config = config or AdapterConfig.from_env()
        self.pool = pool or ClientPool(self.config)

    def _start_kwargs(self, idempotency_key: str | None) -> dict[str, Any]:
        return {**start_kwargs(self.config, turns=1), "idempotency_key": idempotency_key}

    def task(self, task: TaskLike) -> common_pb2.Task:
        """`task` resolved against the configured task set."""
        return resolve_task(task, self.config.tasks)

    def score(self, task: TaskLike, response: str, *, idempotency_key: str | None = None) -> KernelOutcome:
        """The outcome of `response` to `task` (sync); a failed call raises its `KforgeError`."""
        orchestrator = self.pool.sync().orchestrator
        episode = Episode.start(orchestrator, task=self.task(task), **self._start_kwargs(idempotency_key))
        observation = episode.step(response, timeout=self.config.timeout)
        return KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)

    async def ascore(self, task: TaskLike, response: str, *, idempotency_key: str | None = None) -> KernelOutcome:
        """The outcome of `response` to `task` (asyncio); a failed call raises its `KforgeError`."""
        orchestrator = self.pool.for_loop().orchestrator
        episode = await AsyncEpisode.start(orchestrator, task=self.task(task), **self._start_kwargs(idempotency_key))
        observation = await episode.step(response, timeout=self.config.timeout)
        return KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)

    def _recorded(self, error: Exception) -> KernelOutcome:
        log.warning("kforge: a sample got no reward: %s", error)
        return KernelOutcome.from_error(error, error_reward=self.config.error_reward)

    def score_batch(self, items: Iterable[tuple[TaskLike | Exception, str]]) -> list[KernelOutcome]:
        """The outcomes of many (task, response) pairs, `concurrency` at a time on threads, in order.

        A sample whose call fails, or whose task is an exception (a row that named none), gets an outcome with
        `error` set and the `error_reward`; the others are scored.
        """

        def one(item: tuple[TaskLike | Exception, str]) -> KernelOutcome:
            task, response = item
            try:
                if isinstance(task, Exception):
                    raise task
                return self.score(task, response)
            except Exception as error:  # recorded per sample; the batch goes on
                return self._recorded(error)

        batch = list(items)
        if len(batch) <= 1:
            return [one(item) for item in batch]
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, len(batch))) as pool:
            return list(pool.map(one, batch))

    async def ascore_batch(self, items: Iterable[tuple[TaskLike | Exception, str]]) -> list[KernelOutcome]:
        """`score_batch` on the event loop: `concurrency` samples at once, gathered."""
        return await gather_limited(
            [self._ascore_recorded(task, response) for task, response in items], self.config.concurrency
        )

    async def _ascore_recorded(self, task: TaskLike | Exception, response: str) -> KernelOutcome:
        try:
            if isinstance(task, Exception):
                raise task
            return await self.ascore(task, response)
        except Exception as error:  # recorded per sample; the batch goes on
            return self._recorded(error)

    def close(self) -> None:
        """Closes the sync client."""
        self.pool.close()

    async def aclose(self) -> None:
        """Closes the running loop's async client."""
        await self.pool.aclose()


async def gather_limited(awaitables: Sequence[Awaitable[T]], limit: int) -> list[T]:
    """The awaitables' results in order, at most `limit` running at once."""
    semaphore = asyncio.Semaphore(limit)

    async def bounded(awaitable: Awaitable[T]) -> T:
        async with semaphore:
            return await awaitable

    return list(await asyncio.gather(*(bounded(item) for item in awaitables)))
