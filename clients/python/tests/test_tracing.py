"""W3C trace context: what a call carries, as an in-process server's interceptor receives it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_server import FakeReward, echo, fake_reward, returns_request
from opentelemetry import trace

import kforge
from kforge.v1.clients import AsyncRewardClient, RewardClient

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def server() -> Iterator[FakeReward]:
    with fake_reward(echo) as server:
        yield server


@pytest.fixture
def reward(server: FakeReward) -> Iterator[RewardClient]:
    with kforge.connect(server.address) as connection:
        yield RewardClient(connection)


def otel_span(trace_id: int, span_id: int) -> trace.NonRecordingSpan:
    """A span with a valid context, as a trainer's tracer would make current (no SDK needed)."""
    context = trace.SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
    )
    return trace.NonRecordingSpan(context)


def test_an_explicit_trace_context_reaches_the_server(server: FakeReward, reward: RewardClient) -> None:
    with kforge.trace_context(PARENT, "kforge=1"):
        reward.compute_returns(returns_request())
    (call,) = server.calls
    assert call.metadata["traceparent"] == PARENT
    assert call.metadata["tracestate"] == "kforge=1"


def test_the_current_opentelemetry_span_is_propagated(server: FakeReward, reward: RewardClient) -> None:
    with trace.use_span(otel_span(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xABCDEF0123456789)):
        reward.compute_returns(returns_request())
    (call,) = server.calls
    assert call.metadata["traceparent"] == "00-4bf92f3577b34da6a3ce929d0e0e4736-abcdef0123456789-01"


def test_an_explicit_context_wins_over_the_current_span(server: FakeReward, reward: RewardClient) -> None:
    with trace.use_span(otel_span(1, 2)), kforge.trace_context(PARENT):
        reward.compute_returns(returns_request())
    assert server.calls[0].metadata["traceparent"] == PARENT


def test_a_calls_own_traceparent_is_sent_as_it_is(server: FakeReward, reward: RewardClient) -> None:
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    with kforge.trace_context(PARENT):
        reward.compute_returns(returns_request(), metadata=[("traceparent", own), ("x-job", "j1")])
    (call,) = server.calls
    assert call.metadata["traceparent"] == own
    assert call.metadata["x-job"] == "j1"


def test_without_a_context_no_trace_header_is_sent(server: FakeReward, reward: RewardClient) -> None:
    reward.compute_returns(returns_request())
    assert "traceparent" not in server.calls[0].metadata


async def test_the_async_client_carries_the_context_too(server: FakeReward) -> None:
    async with kforge.connect_async(server.address) as connection:
        with kforge.trace_context(PARENT):
            await AsyncRewardClient(connection).compute_returns(returns_request())
    assert server.calls[0].metadata["traceparent"] == PARENT


@pytest.mark.parametrize(
    "traceparent",
    [
        "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    ],
)
def test_a_malformed_traceparent_is_refused(traceparent: str) -> None:
    with pytest.raises(ValueError, match="traceparent"), kforge.trace_context(traceparent):
        pass
