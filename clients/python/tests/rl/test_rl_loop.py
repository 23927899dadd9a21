"""Two steps of the RL loop (`examples/trainers/trl/grpo_smollm2.py`) against the session's real mesh.

The loop runs as a user runs it, one command, and writes its summary as JSON. The test then checks it against
kforge itself: the weights changed; each reward is the score of the turn kforge stored for that episode and its
job's metrics count that turn; each advantage is what kforge's reward service gives for the stored scores; the
exported samples (`kforge export`) hold the token ids and log-probabilities the trainer sampled; and MRS decided on
every sample, its decision stored with the turn.

Needs torch, transformers, gguf and the model (`scripts/setup_model.sh`): a visible skip where one is missing,
a failure under `KFORGE_CI`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from kforge_mesh import REPO, KforgeMesh, kforge_binary

import kforge
from kforge.v1 import orchestrator_pb2, reward_pb2

SCRIPT = REPO / "examples" / "trainers" / "trl" / "grpo_smollm2.py"
MODEL = REPO / ".venv" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def require_loop() -> None:
    """Skips (fails in CI) when a package or the model the loop needs is missing."""
    missing = [module for module in ("torch", "transformers", "gguf") if importlib.util.find_spec(module) is None]
    if not MODEL.is_file():
        missing.append(f"the model {MODEL.name} (scripts/setup_model.sh)")
    if missing:
        message = f"the RL loop needs {', '.join(missing)}"
        if os.environ.get("KFORGE_CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def summary(mesh: KforgeMesh, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The loop's summary after two steps: 2 tasks x a group of 2, 128 new tokens at most."""
    require_loop()
    out = tmp_path_factory.mktemp("rl") / "summary.json"
    command = [sys.executable, str(SCRIPT), "--steps", "2", "--group", "2", "--max-new-tokens", "128"]
    command += ["--orchestrator", mesh.addresses["orchestrator"], "--reward", mesh.addresses["reward"]]
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=480, check=False, cwd=REPO
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    print(f"the loop took {time.monotonic() - started:.0f} s\n{done.stdout}")  # shown with -s or on failure
    for step in range(2):
        assert f"step {step}: loss" in done.stdout
    assert "mean reward" in done.stdout
    assert "kforge jobs: turns 4" in done.stdout
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def rollouts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [rollout for step in summary["steps"] for rollout in step["rollouts"]]


def test_two_steps_change_the_weights(summary: dict[str, Any]) -> None:
    assert len(summary["steps"]) == 2
    assert summary["tensors_changed"] > 0
    assert summary["weight_delta_l2"] > 0
    for step in summary["steps"]:
        assert step["kept"] > 0, "MRS kept a sample to train on"
        assert step["loss"] != 0


def test_the_rewards_are_the_turns_kforge_stored(summary: dict[str, Any], client: kforge.Client) -> None:
    for rollout in rollouts(summary):
        (trajectory,) = client.orchestrator.list_trajectories(
            orchestrator_pb2.ListTrajectoriesRequest(job_id=rollout["episode_id"])
        ).trajectories
        (turn,) = trajectory.turns
        assert turn.task_id == rollout["task"]
        assert rollout["reward"] == (turn.score if turn.HasField("score") else 0.0)
        assert rollout["flags"]["no_kernel"] == turn.flags.no_kernel
        metrics = client.orchestrator.get_job(orchestrator_pb2.GetJobRequest(job_id=rollout["episode_id"])).metrics
        assert metrics.turns == 1
        assert metrics.no_kernel == int(turn.flags.no_kernel)
        assert metrics.junk == int(turn.flags.junk)
        assert metrics.correct == int(rollout["verdict"] == "VERDICT_CORRECT")
    for step in summary["steps"]:
        step_rollouts = step["rollouts"]
        assert step["mean_reward"] == pytest.approx(sum(r["reward"] for r in step_rollouts) / len(step_rollouts))
        assert step["metrics"]["turns"] == len(step_rollouts)
        assert step["metrics"]["no_kernel"] == sum(r["flags"]["no_kernel"] for r in step_rollouts)


def test_the_advantages_are_kforges_grpo_over_each_task_group(summary: dict[str, Any], client: kforge.Client) -> None:
    for step in summary["steps"]:
        tasks = sorted({rollout["task"] for rollout in step["rollouts"]})
        groups = [
            reward_pb2.AdvantageGroup(
                group_id=task,
                trajectories=[
                    reward_pb2.TrajectoryValues(trajectory_id=r["episode_id"], values=[r["reward"]])
                    for r in step["rollouts"]
                    if r["task"] == task
                ],
            )
            for task in tasks
        ]
        answer = client.reward.compute_advantages(
            reward_pb2.ComputeAdvantagesRequest(estimator=reward_pb2.ADVANTAGE_ESTIMATOR_GRPO, groups=groups)
        )
        expected = {t.trajectory_id: t.values[0] for group in answer.groups for t in group.trajectories}
        for rollout in step["rollouts"]:
            assert rollout["advantage"] == expected[rollout["episode_id"]]
        assert step["policy_gradient"] == any(r["advantage"] != 0 and r["keep"] for r in step["rollouts"])


def test_the_exported_samples_hold_the_rollouts_tokens_and_mrs_decisions(
    summary: dict[str, Any], mesh: KforgeMesh
) -> None:
    for rollout in rollouts(summary):
        export = [str(kforge_binary()), "export", rollout["episode_id"], "--out", "-"]
        exported = subprocess.run(
            [*export, "--addr", mesh.addresses["orchestrator"]],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()
        (sample,) = (json.loads(line) for line in exported)
        assert sample["cursor"] == rollout["cursor"]
        assert [int(token) for token in sample["response"]["token_ids"]] == rollout["token_ids"]
        assert rollout["token_ids"], "the model produced tokens"
        assert sample["response"]["logprobs"] == pytest.approx(rollout["logprobs"], rel=0, abs=1e-9)
        assert [int(token) for token in sample["prompt_token_ids"]] == rollout["prompt_ids"]
        assert sample["response"]["finish_reason"] == rollout["finish_reason"]
        # MRS: a decision per sample, stored with the turn; the trainer's log-probabilities are one per token.
        assert len(rollout["train_logprobs"]) == len(rollout["token_ids"])
        assert sample.get("keep", False) == rollout["keep"]
        assert rollout["importance_weight"] > 0
        assert rollout["keep"] == (rollout["mismatch_reason"] == "")
