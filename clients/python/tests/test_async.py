"""The asyncio client against the real services: unary calls, errors, both kinds of streams."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from example_tasks import example_task
from kforge_mesh import KforgeMesh

import kforge
from kforge.v1 import common_pb2, evaluator_pb2, gateway_pb2, reward_pb2


async def test_unary_calls(mesh: KforgeMesh) -> None:
    async with kforge.AsyncClient(mesh.addresses) as client:
        request = reward_pb2.ComputeReturnsRequest(
            method=reward_pb2.RETURN_METHOD_SUM, gamma=0.5, trajectories=[reward_pb2.TrajectoryValues(values=[1, 2])]
        )
        returns = await client.reward.compute_returns(request)
        capabilities = await client.evaluator.get_capabilities(evaluator_pb2.GetCapabilitiesRequest())
    assert list(returns.trajectories[0].values) == [2.0, 2.0]
    assert common_pb2.BACKEND_CPU in capabilities.backends


async def test_a_refusal_raises_the_error_naming_the_field(mesh: KforgeMesh) -> None:
    request = reward_pb2.ComputeAdvantagesRequest(
        estimator=reward_pb2.ADVANTAGE_ESTIMATOR_GRPO,
        groups=[reward_pb2.AdvantageGroup(trajectories=[reward_pb2.TrajectoryValues(values=[math.inf])])],
    )
    async with kforge.AsyncClient(mesh.addresses) as client:
        with pytest.raises(kforge.InvalidArgument) as raised:
            await client.reward.compute_advantages(request)
    assert raised.value.field == "groups[0].trajectories[0].values[0]"


async def test_a_bidirectional_stream_from_an_async_iterable(mesh: KforgeMesh) -> None:
    async def requests() -> AsyncIterator[evaluator_pb2.EvaluateRequest]:
        for index in range(3):
            yield evaluator_pb2.EvaluateRequest(request_id=f"r{index}", task=example_task("relu"))  # no candidate

    async with kforge.AsyncClient(mesh.addresses) as client:
        responses = [response async for response in client.evaluator.evaluate_stream(requests(), timeout=60)]
    assert sorted(r.request_id for r in responses) == ["r0", "r1", "r2"]
    assert all(r.request_error.startswith("INVALID_ARGUMENT: candidate_source") for r in responses), responses


async def test_a_stream_that_fails_raises_when_read(mesh: KforgeMesh) -> None:
    request = gateway_pb2.GenerateRequest(
        model="no-such-model",
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]),
    )
    async with kforge.AsyncClient(mesh.addresses) as client:
        stream = client.gateway.generate_stream(request, timeout=30)
        with pytest.raises(kforge.InvalidArgument) as raised:
            await anext(stream)
    assert raised.value.field == "model"
