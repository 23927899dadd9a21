"""Deadlines (a call's `timeout`, the connection's default) on unary calls and streams; a stream's cancellation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from fake_server import Handler, fake_reward, returns_request, returns_response

import kforge
from kforge.v1 import evaluator_pb2, reward_pb2
from kforge.v1.clients import RewardClient


def stalling(deadlines: list[float]) -> Handler:
    """A handler that records the deadline it was given and answers only once the call is over."""

    def handler(
        request: reward_pb2.ComputeReturnsRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ComputeReturnsResponse:
        deadlines.append(context.time_remaining())
        over = threading.Event()
        context.add_callback(over.set)
        over.wait(timeout=10)
        return returns_response(request)

    return handler


@pytest.mark.parametrize(
    ("default", "timeout"),
    [(None, 0.3), (0.3, None), (30.0, 0.3)],
    ids=["the call's", "the connection's default", "the call's over the default"],
)
def test_a_unary_call_ends_at_its_deadline(default: float | None, timeout: float | None) -> None:
    deadlines: list[float] = []
    with fake_reward(stalling(deadlines)) as server, kforge.connect(server.address, timeout=default) as connection:
        start = time.monotonic()
        with pytest.raises(kforge.DeadlineExceeded):
            RewardClient(connection).compute_returns(returns_request(), timeout=timeout)
        elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 2.0
    assert len(deadlines) == 1, "a deadline is final: never retried"
    assert deadlines[0] <= 0.3, "the server was told the deadline"


def test_a_stream_ends_at_its_deadline(client: kforge.Client) -> None:
    # The evaluator's stream stays open while the caller may still send requests: this caller never does.
    done_sending = threading.Event()

    def requests() -> Iterator[evaluator_pb2.EvaluateRequest]:
        done_sending.wait(timeout=30)
        yield from ()

    start = time.monotonic()
    try:
        with (
            client.evaluator.evaluate_stream(requests(), timeout=1.0) as responses,
            pytest.raises(kforge.DeadlineExceeded),
        ):
            next(responses)
    finally:
        done_sending.set()
    assert 0.9 <= time.monotonic() - start < 10.0


def test_a_stream_cancelled_by_the_caller_raises_cancelled_when_read(client: kforge.Client) -> None:
    done_sending = threading.Event()

    def requests() -> Iterator[evaluator_pb2.EvaluateRequest]:
        done_sending.wait(timeout=30)
        yield from ()

    try:
        responses = client.evaluator.evaluate_stream(requests())
        responses.cancel()
        with pytest.raises(kforge.Cancelled):
            next(responses)
    finally:
        done_sending.set()
