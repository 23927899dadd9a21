"""Errors: the status code's class, the field kforge servers name first, retry-after, against the real services."""

from __future__ import annotations

import math
import pickle

import pytest
from example_tasks import example_task

import kforge
from kforge.errors import parse_field
from kforge.v1 import orchestrator_pb2, reward_pb2


def test_a_nan_reward_is_invalid_argument_naming_the_value(client: kforge.Client) -> None:
    request = reward_pb2.ComputeReturnsRequest(
        method=reward_pb2.RETURN_METHOD_SUM,
        gamma=0.4,
        trajectories=[
            reward_pb2.TrajectoryValues(values=[0.3, 0.0]),
            reward_pb2.TrajectoryValues(values=[1.0, math.nan]),
        ],
    )
    with pytest.raises(kforge.InvalidArgument) as raised:
        client.reward.compute_returns(request)
    error = raised.value
    assert error.code == "INVALID_ARGUMENT"
    assert error.field == "trajectories[1].values[1]"
    assert "finite" in error.message
    assert str(error) == f"INVALID_ARGUMENT: {error.message}"
    assert error.retry_after is None


def test_a_spec_over_the_limits_names_the_field(client: kforge.Client) -> None:
    spec = orchestrator_pb2.JobSpec(
        kind=orchestrator_pb2.JOB_KIND_ROLLOUT,
        recipe="single-turn",
        task_set="examples",
        model="replay",
        trajectories_per_task=1_000_000_000,
        turns=1,
    )
    with pytest.raises(kforge.InvalidArgument) as raised:
        client.orchestrator.submit_job(orchestrator_pb2.SubmitJobRequest(spec=spec))
    assert raised.value.field == "spec.trajectories_per_task"
    assert "over the limit of 64" in raised.value.message


def test_an_episode_over_the_turn_limit_names_turns(client: kforge.Client) -> None:
    request = orchestrator_pb2.StartEpisodeRequest(recipe="kevin", task=example_task("relu"), turns=1000)
    with pytest.raises(kforge.InvalidArgument) as raised:
        client.orchestrator.start_episode(request)
    assert raised.value.field == "turns"


def test_an_unknown_job_is_not_found_without_a_field(client: kforge.Client) -> None:
    with pytest.raises(kforge.NotFound) as raised:
        client.orchestrator.get_job(orchestrator_pb2.GetJobRequest(job_id="no-such-job"))
    assert raised.value.code == "NOT_FOUND"
    assert raised.value.field is None


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("spec.trajectories_per_task: 1000000000 is over the limit of 64 (...)", "spec.trajectories_per_task"),
        ("groups[3].trajectories[1].values[0]: must be finite, got NaN", "groups[3].trajectories[1].values[0]"),
        ("spec: 204800 turns (100 tasks x 64 trajectories x 32 turns) is over the limit of 100000", "spec"),
        ("spec.tasks[1].source: not a task: syntax error at line 1: ...", "spec.tasks[1].source"),
        ("caller `alice` is over its quota: 1 jobs queued or running", None),
        ("turn 3 is ahead of the episode: its next turn is 1", None),
        ("the episode is over", None),
        ("", None),
    ],
)
def test_the_field_is_the_path_a_message_starts_with(message: str, field: str | None) -> None:
    assert parse_field(message) == field


def test_only_codes_about_the_request_carry_a_field() -> None:
    message = "evaluator: the peer is down"
    assert kforge.InvalidArgument(message).field == "evaluator"
    assert kforge.Unavailable(message).field is None


def test_retry_after_is_read_from_the_trailing_metadata_in_seconds() -> None:
    assert kforge.ResourceExhausted("full", trailing_metadata=[("retry-after-ms", "1500")]).retry_after == 1.5
    assert kforge.ResourceExhausted("full", trailing_metadata=[("retry-after-ms", b"250")]).retry_after == 0.25
    assert kforge.ResourceExhausted("full", trailing_metadata=[("retry-after-ms", "soon")]).retry_after is None
    assert kforge.ResourceExhausted("full").retry_after is None


def test_errors_survive_pickling_as_they_cross_process_pools() -> None:
    error = kforge.InvalidArgument("turns: 0 is below 1", trailing_metadata=[("retry-after-ms", "10")])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is kforge.InvalidArgument
    assert (copy.code, copy.message, copy.field, copy.retry_after) == ("INVALID_ARGUMENT", error.message, "turns", 0.01)


def test_only_resource_exhausted_and_unavailable_are_retryable() -> None:
    retryable = {cls.__name__ for cls in kforge.KforgeError.__subclasses__() if cls.retryable}
    assert retryable == {"ResourceExhausted", "Unavailable"}
