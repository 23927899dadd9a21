"""The orchestrator's protocol faces driven by the protocols' own Python clients, unmodified.

- ORS: `ors-sdk` 0.1.0's `AsyncORS` (the Open Reward Standard's reference client) lists the splits and tasks, opens
  a session on the relu example, reads its prompt and tools, and submits a kernel; then submits a wrong one.
- OpenEnv: `openenv-core` 0.3.0's `GenericEnvClient` (installed without its server extras: the client needs
  `websockets`, its package imports `fastmcp`) resets on the relu example, steps a correct kernel, disconnects, and
  a new client resumes the episode by its id.

A client that is not installed is a visible skip here and a failure in CI (`KFORGE_CI`), where `scripts/test.sh`
installs both.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
from example_tasks import example_candidate
from kforge_mesh import KforgeMesh

RELU = "examples/relu"
WRONG = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.abs(x)\n"


def require(module: str) -> None:
    """Skips (fails in CI) when the client `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        message = f"the {module} client is not installed (scripts/test.sh installs it)"
        if os.environ.get("KFORGE_CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


async def test_the_ors_reference_client_runs_a_session(mesh: KforgeMesh) -> None:
    require("ors")
    from ors.client import AsyncORS, ToolSpec  # noqa: PLC0415 (installed for the faces' tests only)

    ors = AsyncORS(base_url=mesh.http_address)
    env = ors.environment("kforge")
    splits = await env.list_splits()
    assert "train" in splits, splits
    tasks = await env.list_tasks("train")
    assert len(tasks) == await env.num_tasks("train") > 1
    (relu,) = [task for task in tasks if RELU in json.dumps(task.task_spec)]
    tools = await env.list_tools()
    assert [tool.name for tool in tools if isinstance(tool, ToolSpec)] == ["submit_kernel"]

    session = env.session(task=relu)
    async with session:
        prompt = await session.get_prompt()
        text = "".join(getattr(block, "text", "") for block in prompt)
        assert "class Model" in text, text
        output: Any = await session.call_tool("submit_kernel", {"code": WRONG})
        assert output.reward is not None, output
        assert output.reward <= 0.0, output
        assert not output.finished
        assert output.metadata is not None, output
        assert output.metadata.get("verdict") == "incorrect", output.metadata
        output = await session.call_tool("submit_kernel", {"code": example_candidate("relu")})
        assert output.reward is not None, output
        assert output.reward > 0.0, output
        assert output.metadata.get("verdict") == "correct", output.metadata
        assert output.blocks, "the feedback the model reads"


async def test_the_openenv_client_resumes_an_episode_after_a_disconnect(mesh: KforgeMesh) -> None:
    require("openenv")
    from openenv.core.generic_client import GenericEnvClient  # noqa: PLC0415 (installed for the faces' tests only)

    client = GenericEnvClient(base_url=f"{mesh.http_address}/openenv", message_timeout_s=300)
    await client.connect()
    first = await client.reset(task_id=RELU)
    assert not first.done
    observation: dict[str, Any] = first.observation
    episode_id = observation["episode_id"]
    assert "class Model" in observation["prompt"], observation
    stepped = await client.step({"code": WRONG})
    assert not stepped.done, stepped
    assert (stepped.reward or 0.0) <= 0.0, stepped
    state = await client.state()
    assert (state["episode_id"], state["step_count"]) == (episode_id, 1), state
    await client.disconnect()

    again = GenericEnvClient(base_url=f"{mesh.http_address}/openenv", message_timeout_s=300)
    await again.connect()
    resumed = await again.reset(episode_id=episode_id)
    assert resumed.observation["episode_id"] == episode_id
    assert resumed.observation["turn"] == 1, resumed.observation
    correct = await again.step({"code": example_candidate("relu")})
    assert (correct.reward or 0.0) > 0.0, correct
    assert correct.observation["verdict"] == "correct", correct.observation
    await again.disconnect()
