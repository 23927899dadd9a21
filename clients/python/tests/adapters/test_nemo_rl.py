"""The NeMo RL adapter against a real kforge mesh: a batch with one bad sample, recorded while the others are scored.

Written against NeMo RL 0.6.0 (NVIDIA-NeMo/RL at 7ea279a, August 2026), which does not install without CUDA:
`EnvironmentInterface.step(message_log_batch, metadata) -> EnvironmentReturn(observations, metadata,
next_stop_strings, rewards, terminateds, answers)`, every field batched, rewards and terminateds tensors;
`global_post_process_and_metrics(batch) -> (batch, metrics)`. The adapter copies those shapes.
"""

from __future__ import annotations

from typing import Any

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import nemo_rl
from kforge.adapters._common import answer_text

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")


def log(response: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Write ModelNew."}, {"role": "assistant", "content": response}]


def test_a_batch_records_its_bad_sample_and_scores_the_others(mesh: KforgeMesh) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    assert nemo_rl.NEMO_RL_VERSION == "0.6.0"
    environment = nemo_rl.KforgeEnvironment(
        {"orchestrator": mesh.addresses["orchestrator"], "backend": "cpu", "turns": 2, "timeout": 300}
    )
    result = environment.step(
        [log(answer_text(GOOD)), log(answer_text(WRONG)), log(answer_text(GOOD))],
        [{"task_source": RELU.source}, {"task_id": RELU.task_id, "task_source": RELU.source}, {"task_id": "nope"}],
    )
    assert isinstance(result, nemo_rl.EnvironmentReturn)
    assert isinstance(result.rewards, torch.Tensor)
    rewards = result.rewards.tolist()
    assert rewards[0] >= 0.3
    assert rewards[1:] == [0.0, 0.0]
    assert result.terminateds.tolist() == [False, False, True]
    assert result.next_stop_strings == [None, None, None]
    assert [observation["role"] for observation in result.observations] == ["environment"] * 3
    assert result.observations[2]["content"].startswith("kforge error: TASK: task id 'nope' needs a task set")
    assert "kforge_error" in result.metadata[2]
    assert "kforge_error" not in result.metadata[0]
    assert result.metadata[0]["kforge_outcome"]["verdict"] == "correct"
    assert result.answers is not None
    assert result.answers[0] is not None
    assert "ModelNew" in result.answers[0]
    assert result.answers[2] is None

    # The second turn of the sample that was wrong: its metadata carries the episode on.
    again = environment.step([log(answer_text(GOOD))], [result.metadata[1]])
    assert again.terminateds.tolist() == [True]
    assert again.rewards.tolist()[0] >= 0.3
    assert again.metadata[0]["kforge_episode_id"] == result.metadata[1]["kforge_episode_id"]
    assert again.observations[0]["content"].endswith("The episode is over.")

    batch = {"rewards": "unchanged"}
    returned, metrics = environment.global_post_process_and_metrics(batch)
    assert returned is batch
    assert metrics["kforge/steps"] == 4.0
    assert metrics["kforge/errors"] == 1.0
    assert metrics["kforge/correct"] == 0.5
    assert environment.global_post_process_and_metrics(batch) == (batch, {})


def test_the_environment_has_the_interfaces_methods() -> None:
    environment: nemo_rl.EnvironmentInterface[dict[str, Any]] = nemo_rl.KforgeEnvironment()
    assert callable(environment.step)
    assert nemo_rl.EnvironmentReturn._fields == (
        "observations",
        "metadata",
        "next_stop_strings",
        "rewards",
        "terminateds",
        "answers",
    )
