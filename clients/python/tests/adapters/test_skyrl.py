"""The SkyRL adapter against a real kforge mesh and the real `skyrl_gym` base class (skyrl-gym 0.4.0).

SkyRL's generator makes one environment per trajectory with `skyrl_gym.make(env_class, env_config=...,
extras=row)`, calls `init(prompt)`, then `step(action)` each turn until `done`, then `close()`. Where skyrl-gym
is not installed the tests skip, naming it.
"""

from __future__ import annotations

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import skyrl
from kforge.adapters._common import answer_text

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install skyrl-gym)")
base_text_env = pytest.importorskip("skyrl_gym.envs.base_text_env")

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")


def test_the_environment_subclasses_the_real_base_class() -> None:
    assert skyrl.skyrl_gym_installed()
    assert issubclass(skyrl.KforgeTextEnv, base_text_env.BaseTextEnv)


def test_a_registered_environment_runs_a_two_turn_episode(mesh: KforgeMesh) -> None:
    skyrl.register("kforge-test")
    try:
        env = skyrl_gym.make(
            "kforge-test",
            env_config={"orchestrator": mesh.addresses["orchestrator"], "backend": "cpu", "turns": 3},
            extras={
                "reward_spec": {"method": "rule", "ground_truth": RELU.source},
                "kforge": {"turns": 2, "timeout": 300},  # a row's own options win over env_config
            },
        )
    finally:
        skyrl_gym.envs.registration.deregister("kforge-test")
    assert isinstance(env, base_text_env.BaseTextEnv)
    assert env.max_turns == 2

    prompt, metadata = env.init([{"role": "user", "content": "ignored: the recipe writes the prompt"}])
    assert [message["role"] for message in prompt] == ["system", "user"]
    assert "torch.relu" in prompt[-1]["content"]
    assert metadata["episode_id"]

    first = env.step(answer_text(WRONG))
    assert (first["reward"], first["done"]) == (0.0, False)
    assert first["metadata"]["verdict"] == "incorrect"
    assert [message["role"] for message in first["observations"]] == ["user"]
    assert "1 attempt left" in first["observations"][0]["content"]

    second = env.step(answer_text(GOOD))
    assert second["done"] is True
    assert second["reward"] >= 0.3
    assert second["observations"] == []
    assert env.get_metrics()["kforge_correct"] == 1.0
    env.close()


def test_a_row_without_a_task_ends_at_the_first_step(mesh: KforgeMesh) -> None:
    env = skyrl.KforgeTextEnv({"orchestrator": mesh.addresses["orchestrator"]}, {"extra_info": {}})
    prompt, metadata = env.init([{"role": "user", "content": "hi"}])
    assert prompt == [{"role": "user", "content": "hi"}]
    assert "names no kforge task" in metadata["error"]
    step = env.step("anything")
    assert (step["done"], step["reward"], step["metadata"]["error_code"]) == (True, 0.0, "TASK")
