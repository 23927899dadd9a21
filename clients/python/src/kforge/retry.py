"""Retries of unary calls refused for now: RESOURCE_EXHAUSTED and UNAVAILABLE, with backoff, within the deadline.

A kforge server refuses work it cannot take yet with RESOURCE_EXHAUSTED (a full evaluation queue, a caller over its
turns per hour), often saying when to come back (`retry-after-ms`), and a server or a peer it needs that cannot be
reached answers UNAVAILABLE. Both are worth another attempt; every other status is final. A retry resends the same
request: the RPCs that create something take an idempotency key, so that a retry of an attempt that did reach the
server finds its first result instead of doing the work twice.

Streaming calls are never retried: their responses may have been partly consumed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from kforge.errors import KforgeError

__all__ = ["RetryPolicy", "call_with_retry", "call_with_retry_async"]

T = TypeVar("T")

_jitter = random.Random()


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a unary call is retried.

    The wait before retry n (1 for the first) is drawn uniformly from
    [0, min(max_backoff, initial_backoff * multiplier ** (n - 1))] ("full jitter", so that callers refused together
    do not come back together), and is at least the server's `retry-after-ms` when it sent one. A retry is given up,
    and the last error raised, when the attempts are spent, when the wait would end past `max_elapsed` seconds
    since the call began, or when it would end past the call's deadline.

    Attributes:
        max_attempts: Attempts in all, the first included; 1 turns retries off.
        initial_backoff: Upper bound of the first wait, seconds.
        max_backoff: Cap on the upper bound of any wait, seconds.
        multiplier: Growth of the upper bound per retry.
        max_elapsed: Seconds from the call's start after which no retry starts.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.25
    max_backoff: float = 10.0
    multiplier: float = 2.0
    max_elapsed: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            bounds = f"{self.initial_backoff} and {self.max_backoff}"
            raise ValueError(f"need 0 <= initial_backoff <= max_backoff, got {bounds}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be at least 1, got {self.multiplier}")
        if self.max_elapsed < 0:
            raise ValueError(f"max_elapsed must be non-negative, got {self.max_elapsed}")

    def delay(self, retry: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry `retry` (1 for the first), at least `retry_after` when given."""
        bound = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return max((rng or _jitter).uniform(0, bound), retry_after or 0.0)


NO_RETRY = RetryPolicy(max_attempts=1)
"""A policy that makes one attempt."""


class _Schedule:
    """The retry decisions of one call: when it started, its deadline, the attempts made."""

    def __init__(self, policy: RetryPolicy, timeout: float | None) -> None:
        self.policy = policy
        self.start = time.monotonic()
        self.deadline = None if timeout is None else self.start + timeout
        self.attempts = 0

    def timeout(self) -> float | None:
        """The next attempt's timeout: the time left before the deadline."""
        self.attempts += 1
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def wait(self, error: KforgeError) -> float | None:
        """Seconds to wait before retrying after `error`, or None to give up and raise it."""
        if not error.retryable or self.attempts >= self.policy.max_attempts:
            return None
        wait = self.policy.delay(self.attempts, error.retry_after)
        resume = time.monotonic() + wait
        if resume > self.start + self.policy.max_elapsed or (self.deadline is not None and resume >= self.deadline):
            return None
        return wait


def call_with_retry(attempt: Callable[[float | None], T], policy: RetryPolicy, timeout: float | None) -> T:
    """Calls `attempt(timeout_left)` until it returns, retrying the `KforgeError`s `policy` allows.

    `timeout` is the whole call's deadline in seconds from now (None: none); each attempt gets the time left.
    """
    schedule = _Schedule(policy, timeout)
    while True:
        try:
            return attempt(schedule.timeout())
        except KforgeError as error:
            wait = schedule.wait(error)
            if wait is None:
                raise
        time.sleep(wait)


async def call_with_retry_async(
    attempt: Callable[[float | None], Awaitable[T]], policy: RetryPolicy, timeout: float | None
) -> T:
    """`call_with_retry` for coroutines: the waits are `asyncio.sleep`."""
    schedule = _Schedule(policy, timeout)
    while True:
        try:
            return await attempt(schedule.timeout())
        except KforgeError as error:
            wait = schedule.wait(error)
            if wait is None:
                raise
        await asyncio.sleep(wait)
