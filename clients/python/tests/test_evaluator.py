"""The evaluator through the generated clients: a real CPU evaluation, a refusal naming its field, the bidi stream."""

from __future__ import annotations

import pytest
from example_tasks import example_candidate, example_task

import kforge
from kforge.v1 import common_pb2, evaluator_pb2


def test_evaluate_runs_a_real_candidate_on_the_cpu(client: kforge.Client) -> None:
    request = evaluator_pb2.EvaluateRequest(
        request_id="scaled-add",
        task=example_task("scaled_add"),
        candidate_source=example_candidate("scaled_add"),
        backend=common_pb2.BACKEND_CPU,
    )
    response = client.evaluator.evaluate(request)
    assert response.verdict == common_pb2.VERDICT_CORRECT, response
    assert response.request_id == "scaled-add"
    assert response.device == "cpu"
    assert "run" in response.stage_ms


def test_a_wrong_candidate_is_incorrect_with_its_mismatch(client: kforge.Client) -> None:
    wrong = example_candidate("scaled_add").replace("alpha=self.alpha", "alpha=2 * self.alpha")
    request = evaluator_pb2.EvaluateRequest(
        task=example_task("scaled_add"), candidate_source=wrong, backend=common_pb2.BACKEND_CPU
    )
    response = client.evaluator.evaluate(request)
    assert response.verdict == common_pb2.VERDICT_INCORRECT, response
    assert response.HasField("mismatch")


def test_a_request_without_its_task_is_invalid_argument_naming_the_field(client: kforge.Client) -> None:
    request = evaluator_pb2.EvaluateRequest(candidate_source=example_candidate("scaled_add"))
    with pytest.raises(kforge.InvalidArgument) as raised:
        client.evaluator.evaluate(request)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert raised.value.field is not None
    assert raised.value.field.startswith("task"), raised.value.message


def test_evaluate_stream_answers_each_request_by_its_id(client: kforge.Client) -> None:
    requests = [
        evaluator_pb2.EvaluateRequest(request_id="no-task", candidate_source="x = 1"),
        evaluator_pb2.EvaluateRequest(request_id="no-candidate", task=example_task("relu")),
    ]
    with client.evaluator.evaluate_stream(requests, timeout=60) as responses:
        by_id = {response.request_id: response for response in responses}
    assert set(by_id) == {"no-task", "no-candidate"}
    for response in by_id.values():
        assert response.verdict == common_pb2.VERDICT_UNSPECIFIED
        assert response.request_error.startswith("INVALID_ARGUMENT: "), response


def test_get_capabilities_reports_the_cpu_backend(client: kforge.Client) -> None:
    capabilities = client.evaluator.get_capabilities(evaluator_pb2.GetCapabilitiesRequest())
    assert common_pb2.BACKEND_CPU in capabilities.backends
    assert "torch" in capabilities.versions
