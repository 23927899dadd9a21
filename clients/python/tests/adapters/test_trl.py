"""The TRL adapter against a real kforge mesh: an environment through several tool calls, and the reward functions.

Written against TRL 1.16.0: `GRPOTrainer(environment_factory=...)` draws one environment per rollout from a pool,
calls `reset(**row)` (sync), exposes every public function of the class but `reset` and `get_reward` as a tool (its
schema from `transformers.utils.get_json_schema`), gathers async tools, and awaits `get_reward()` once per rollout;
reward functions take `completions` (strings or message lists), `prompts` and the row's columns by keyword. The
schema test needs transformers (TRL's dependency) and skips, naming it, where it is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import trl
from kforge.adapters._common import AdapterConfig, answer_text

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")


def config(mesh: KforgeMesh, **changes: object) -> AdapterConfig:
    return AdapterConfig(orchestrator=mesh.addresses["orchestrator"], backend="cpu", timeout=300).with_options(changes)


async def test_an_episode_through_several_submissions_ends_with_its_reward(mesh: KforgeMesh) -> None:
    environment = trl.environment_factory(config(mesh, turns=3))()
    first = environment.reset(prompt=[{"role": "user", "content": ""}], task_source=RELU.source, task_id="relu")
    assert first is not None
    assert "torch.relu" in first, "the recipe's prompt shows the task"
    assert "`submit_kernel`" in first
    assert "3 submissions" in first

    wrong = await environment.submit_kernel(WRONG)
    assert "incorrect" in wrong.lower() or "mismatch" in wrong.lower(), wrong
    assert "Score: 0." in wrong
    assert "2 attempts left" in wrong
    assert "submit it with `submit_kernel`" in wrong

    right = await environment.submit_kernel(f"```python\n{GOOD}\n```")  # a fenced kernel is taken as well
    assert "Speedup:" in right, right
    assert "1 attempt left" in right

    last = await environment.submit_kernel(GOOD)
    assert "The episode is over." in last
    assert await environment.submit_kernel(GOOD) == "The episode is over: no more kernels are evaluated."

    reward = await environment.get_reward()
    assert reward is not None
    assert reward >= 0.3, "the best submission's score: a correct kernel's"

    environment.reset(task_source=RELU.source)  # the pool reuses instances: reset starts afresh
    assert await environment.get_reward() == 0.0


def test_a_row_without_a_task_fails_its_reset(mesh: KforgeMesh) -> None:
    environment = trl.KforgeEnvironment(config(mesh))
    with pytest.raises(ValueError, match="names no kforge task"):
        environment.reset(prompt=[{"role": "user", "content": "hi"}])


def test_the_only_tool_trl_finds_is_submit_kernel() -> None:
    public = [name for name, _ in inspect.getmembers(trl.KforgeEnvironment, inspect.isfunction)]
    assert [name for name in public if not name.startswith("_")] == ["get_reward", "reset", "submit_kernel"]
    assert inspect.iscoroutinefunction(trl.KforgeEnvironment.submit_kernel)
    assert inspect.iscoroutinefunction(trl.KforgeEnvironment.get_reward)
    assert not inspect.iscoroutinefunction(trl.KforgeEnvironment.reset), "TRL calls reset without awaiting it"


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install trl)"
)
def test_transformers_turns_the_tool_into_a_schema() -> None:
    get_json_schema = importlib.import_module("transformers.utils").get_json_schema
    schema = get_json_schema(trl.KforgeEnvironment(AdapterConfig()).submit_kernel)
    function = schema["function"]
    assert function["name"] == "submit_kernel"
    assert function["parameters"]["required"] == ["code"]
    assert function["parameters"]["properties"]["code"]["type"] == "string"
    assert "ModelNew" in function["parameters"]["properties"]["code"]["description"]


def test_kernel_reward_scores_each_completion_and_leaves_out_failures(mesh: KforgeMesh) -> None:
    reward = trl.make_kernel_reward(config(mesh))
    assert reward.__name__ == "kernel_reward"
    metrics: dict[str, float] = {}
    completions = [
        [{"role": "assistant", "content": answer_text(GOOD)}],
        answer_text(WRONG),
        answer_text(GOOD),
    ]
    rewards = reward(
        completions,
        prompts=["p"] * 3,
        task_source=[RELU.source, RELU.source, None],
        task_id=["relu", "relu", None],
        completion_ids=[[1], [2], [3]],
        log_metric=metrics.__setitem__,
    )
    assert rewards[0] is not None
    assert rewards[0] >= 0.3
    assert rewards[1] == 0.0
    assert rewards[2] is None, "no task: left out, not trained on as 0"
    assert metrics["kforge/errors"] == 1.0
    assert metrics["kforge/correct"] == pytest.approx(1 / 3)


async def test_the_async_kernel_reward_gathers_on_the_loop(mesh: KforgeMesh) -> None:
    reward = trl.make_async_kernel_reward(config(mesh))
    rewards = await reward([answer_text(WRONG), "no kernel here"], task_source=[RELU.source] * 2)
    assert rewards == [0.0, 0.0]
