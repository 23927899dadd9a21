"""Retries: RESOURCE_EXHAUSTED and UNAVAILABLE only, after the server's retry-after, bounded, within the deadline."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from itertools import pairwise

import grpc
import pytest
from fake_server import Handler, fake_reward, returns_request, returns_response

import kforge
from kforge.v1 import reward_pb2
from kforge.v1.clients import AsyncRewardClient, RewardClient

# Waits short enough for a test; the server's retry-after, when it sends one, is their floor.
QUICK = kforge.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02)


def refusing(times: int, code: grpc.StatusCode, retry_after_ms: int | None = None) -> Handler:
    """A handler refusing its first `times` calls with `code` (and `retry-after-ms`), then answering."""
    calls = 0

    def handler(
        request: reward_pb2.ComputeReturnsRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ComputeReturnsResponse:
        nonlocal calls
        calls += 1
        if calls <= times:
            if retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
            context.abort(code, "evaluation queue is full (64 admitted); retry in about 1 s")
        return returns_response(request)

    return handler


def test_resource_exhausted_is_retried_no_sooner_than_the_servers_retry_after() -> None:
    with fake_reward(refusing(2, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=300)) as server:
        with kforge.connect(server.address, retry=QUICK) as connection:
            response = RewardClient(connection).compute_returns(returns_request())
        calls = server.calls
    assert list(response.trajectories[0].values) == [1.0, 2.0]
    assert len(calls) == 3
    assert all(later.at - earlier.at >= 0.3 for earlier, later in pairwise(calls))


def test_unavailable_is_retried_until_the_attempts_are_spent() -> None:
    with fake_reward(refusing(10, grpc.StatusCode.UNAVAILABLE)) as server:
        with kforge.connect(server.address, retry=QUICK) as connection, pytest.raises(kforge.Unavailable):
            RewardClient(connection).compute_returns(returns_request())
        assert len(server.calls) == QUICK.max_attempts


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL]
)
def test_other_codes_are_final(code: grpc.StatusCode) -> None:
    with fake_reward(refusing(1, code)) as server:
        with kforge.connect(server.address, retry=QUICK) as connection, pytest.raises(kforge.KforgeError) as raised:
            RewardClient(connection).compute_returns(returns_request())
        assert raised.value.code == code.name
        assert len(server.calls) == 1


def test_a_retry_after_past_the_deadline_gives_up_at_once_with_the_refusal() -> None:
    with fake_reward(refusing(1, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=5000)) as server:
        with kforge.connect(server.address, retry=QUICK) as connection:
            start = time.monotonic()
            with pytest.raises(kforge.ResourceExhausted) as raised:
                RewardClient(connection).compute_returns(returns_request(), timeout=2.0)
            elapsed = time.monotonic() - start
        assert len(server.calls) == 1
    assert raised.value.retry_after == 5.0
    assert elapsed < 1.0, "it must not sleep towards a retry it could never make"


def test_each_attempt_gets_only_the_time_left_of_the_calls_deadline() -> None:
    remaining: list[float] = []

    def handler(
        request: reward_pb2.ComputeReturnsRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ComputeReturnsResponse:
        remaining.append(context.time_remaining())
        if len(remaining) < 3:
            context.set_trailing_metadata((("retry-after-ms", "200"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return returns_response(request)

    with fake_reward(handler) as server, kforge.connect(server.address, retry=QUICK) as connection:
        RewardClient(connection).compute_returns(returns_request(), timeout=5.0)
    assert len(remaining) == 3
    assert remaining[0] <= 5.05  # the deadline as the grpc-timeout header rounds it
    assert remaining[1] < remaining[0] - 0.18  # the wait came out of the deadline
    assert remaining[2] < remaining[1] - 0.18


def test_max_elapsed_bounds_the_retries() -> None:
    policy = kforge.RetryPolicy(max_attempts=100, initial_backoff=0.05, max_backoff=0.05, max_elapsed=0.3)
    with fake_reward(refusing(1000, grpc.StatusCode.UNAVAILABLE)) as server:
        with kforge.connect(server.address, retry=policy) as connection, pytest.raises(kforge.Unavailable):
            RewardClient(connection).compute_returns(returns_request())
        calls = server.calls
    assert 2 <= len(calls) < 100
    assert calls[-1].at - calls[0].at <= 0.3


def test_retries_can_be_turned_off() -> None:
    with fake_reward(refusing(1, grpc.StatusCode.UNAVAILABLE)) as server:
        with kforge.connect(server.address, retry=None) as connection, pytest.raises(kforge.Unavailable):
            RewardClient(connection).compute_returns(returns_request())
        assert len(server.calls) == 1


async def test_the_async_client_retries_alike() -> None:
    with fake_reward(refusing(2, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=200)) as server:
        async with kforge.connect_async(server.address, retry=QUICK) as connection:
            response = await AsyncRewardClient(connection).compute_returns(returns_request())
        calls = server.calls
    assert len(response.trajectories) == 1
    assert len(calls) == 3
    assert all(later.at - earlier.at >= 0.2 for earlier, later in pairwise(calls))


def test_the_backoff_is_jittered_under_a_doubling_bound_and_floored_by_retry_after() -> None:
    policy = kforge.RetryPolicy(initial_backoff=0.1, max_backoff=0.5, multiplier=2.0)
    rng = random.Random(7)
    for retry, bound in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)]:
        delays = [policy.delay(retry, rng=rng) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays)
        assert max(delays) > bound * 0.8, "the draws cover the range"
    assert policy.delay(1, retry_after=3.0, rng=rng) == 3.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: kforge.RetryPolicy(max_attempts=0),
        lambda: kforge.RetryPolicy(initial_backoff=2.0, max_backoff=1.0),
        lambda: kforge.RetryPolicy(multiplier=0.5),
        lambda: kforge.RetryPolicy(max_elapsed=-1.0),
    ],
)
def test_a_policy_that_cannot_work_is_refused(make: Callable[[], kforge.RetryPolicy]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        make()
