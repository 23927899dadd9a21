"""The OpenRLHF adapter against a real kforge mesh: a batch over HTTP, the reward-function file, the agent.

Written against OpenRLHF 0.11.0: the remote reward model takes `POST /get_reward` with `{"query", "prompts",
"labels"}` lists and answers `{"rewards", "scores", "extra_logs"}`; the `reward_func(queries, prompts, labels)`
file returns tensors; an agent file's `AgentExecutor` (an `AgentExecutorBase`, made with no arguments) runs one
`AgentInstanceBase` per sample with `async reset(states)` / `async step(states)`, whose `rewards` OpenRLHF reads with
`.item()`. OpenRLHF is not installed here (deepspeed, flash-attn pins): the agent classes are checked against a
stand-in of `openrlhf.utils.agent`, and the test that needs the real one skips, naming it.
"""

from __future__ import annotations

import abc
import importlib.util
import json
import sys
import types
import urllib.error
import urllib.request
from typing import Any

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import openrlhf
from kforge.adapters._common import AdapterConfig, answer_text

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")
PROMPT = "<|im_start|>user\nWrite ModelNew.<|im_end|>\n<|im_start|>assistant\n"


def config(mesh: KforgeMesh, **changes: object) -> AdapterConfig:
    return AdapterConfig(orchestrator=mesh.addresses["orchestrator"], backend="cpu", timeout=300).with_options(changes)


def post(url: str, body: object) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_the_reward_server_scores_a_batch_over_http(mesh: KforgeMesh) -> None:
    with openrlhf.RewardServer(config(mesh)) as server:
        status, answer = post(
            server.url,
            {
                "query": [PROMPT + answer_text(GOOD), PROMPT + answer_text(WRONG), PROMPT + "no kernel"],
                "prompts": [PROMPT, PROMPT, PROMPT],
                "labels": [RELU.source, RELU.source, "examples/relu"],
            },
        )
        assert status == 200, answer
        assert answer["rewards"][0] >= 0.3
        assert answer["rewards"][1:] == [0.0, 0.0]
        assert answer["scores"] == [1.0, 0.0, 0.0]
        assert answer["extra_logs"]["kforge_error"] == [0.0, 0.0, 1.0], "a task id without a task set is recorded"
        assert answer["extra_logs"]["kforge_speedup"][0] > 0

        status, answer = post(server.url, {"query": "x", "prompts": [], "labels": []})
        assert (status, answer) == (400, {"error": "query: expected a list, got str"})
        status, answer = post(server.url.replace("get_reward", "other"), {})
        assert status == 404


def test_the_reward_function_file_returns_tensors(mesh: KforgeMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    monkeypatch.setenv("KFORGE_ORCHESTRATOR", mesh.addresses["orchestrator"])
    monkeypatch.setenv("KFORGE_BACKEND", "cpu")
    monkeypatch.setattr(openrlhf, "_DEFAULT_SCORER", [])
    result = openrlhf.reward_func([PROMPT + answer_text(WRONG)], [PROMPT], [RELU.source])
    assert isinstance(result["rewards"], torch.Tensor)
    assert result["rewards"].tolist() == [0.0]
    assert result["extra_logs"]["kforge_correct"].tolist() == [0.0]


async def test_the_agent_runs_a_two_turn_episode(mesh: KforgeMesh) -> None:
    agent = openrlhf.KforgeAgent(config(mesh, turns=2))
    reset = await agent.reset({"observation": PROMPT, "label": RELU.source})
    assert reset == {"observation": PROMPT}

    first = await agent.step({"observation_text": PROMPT, "action_text": answer_text(WRONG), "label": RELU.source})
    assert first["done"] is False
    assert float(first["rewards"]) == 0.0
    assert first["environment_feedback"].startswith("<|im_end|>\n<|im_start|>user\n")
    assert first["environment_feedback"].endswith("<|im_start|>assistant\n")
    assert "1 attempt left" in first["environment_feedback"]

    second = await agent.step({"action_text": answer_text(GOOD), "sampling_params": "same"})
    assert second["done"] is True
    assert second["rewards"].item() >= 0.3, "rewards is a tensor: OpenRLHF calls .item()"
    assert second["scores"].item() == 1.0
    assert second["environment_feedback"] == ""
    assert second["sampling_params"] == "same"


async def test_an_agent_whose_label_names_no_task_ends_at_its_first_step(mesh: KforgeMesh) -> None:
    agent = openrlhf.KforgeAgent(config(mesh))
    await agent.reset({"observation": PROMPT, "label": ""})
    result = await agent.step({"action_text": answer_text(GOOD)})
    assert result["done"] is True
    assert result["extra_logs"]["kforge_error"].item() == 1.0


def _stand_in_openrlhf() -> types.ModuleType:
    """The base classes of `openrlhf.utils.agent` as 0.11.0 defines them, reduced to their contract."""
    module = types.ModuleType("openrlhf.utils.agent")

    class AgentInstanceBase(abc.ABC):
        @abc.abstractmethod
        async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            """Starts a sample."""

        @abc.abstractmethod
        async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            """One turn."""

    class AgentExecutorBase:
        pass

    class MultiTurnAgentExecutor(AgentExecutorBase):
        def __init__(self, agent_instance_cls: type[AgentInstanceBase]) -> None:
            self.agent_instance_cls = agent_instance_cls

    module.__dict__.update(
        AgentInstanceBase=AgentInstanceBase,
        AgentExecutorBase=AgentExecutorBase,
        MultiTurnAgentExecutor=MultiTurnAgentExecutor,
    )
    return module


async def test_the_agent_executor_builds_on_openrlhfs_bases(mesh: KforgeMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _stand_in_openrlhf()
    monkeypatch.setitem(sys.modules, "openrlhf.utils.agent", module)
    monkeypatch.setattr(openrlhf, "_AGENT_CLASSES", {})
    executor_class = openrlhf.agent_executor_class(config(mesh))
    executor = executor_class()
    assert isinstance(executor, module.AgentExecutorBase)
    instance = executor.agent_instance_cls("args", "from", openrlhf="kwargs")
    assert isinstance(instance, module.AgentInstanceBase)
    await instance.reset({"observation": PROMPT, "label": ""})
    assert (await instance.step({"action_text": ""}))["done"] is True


@pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None, reason="openrlhf is not installed")
def test_the_agent_executor_builds_on_the_real_openrlhf() -> None:
    base = importlib.import_module("openrlhf.utils.agent").AgentExecutorBase
    assert issubclass(openrlhf.agent_executor_class(), base)
