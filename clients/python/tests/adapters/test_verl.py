"""The verl adapter against a real kforge mesh: `compute_score`, the agent loop's body and its class.

`compute_score` runs on a correct and a failing kernel; the agent loop's body with a stand-in rollout server.
Written against verl 0.10.0.dev (verl-project/verl, August 2026): `compute_score(data_source, solution_str,
ground_truth, extra_info, **reward_kwargs) -> dict` with a `score` key, awaited by the reward loop;
`AgentLoopBase.run(sampling_params, **row) -> AgentLoopOutput` with `server_manager.generate(request_id, *,
prompt_ids, sampling_params) -> TokenOutput(token_ids, log_probs, stop_reason)`. verl itself is not installed here
(torch, ray, hydra, tensordict, transformers); the agent-loop class is checked against a stand-in module of verl's
names, and the test that needs the real verl skips, naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import verl
from kforge.adapters._common import AdapterConfig, answer_text

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")
KEYS = {"score", "correct", "speedup", "format_error", "error", "verdict", "error_message"}


def options(mesh: KforgeMesh) -> dict[str, Any]:
    return {"orchestrator": mesh.addresses["orchestrator"], "backend": "cpu"}


async def test_a_correct_kernel_scores_with_its_verdict_and_speedup(mesh: KforgeMesh) -> None:
    result = await verl.compute_score(
        "kforge", answer_text(GOOD), RELU.source, extra_info={"index": 0}, **options(mesh), reward_router_address="x"
    )
    assert set(result) == KEYS
    assert result["verdict"] == "correct", result
    assert result["correct"] == 1.0
    assert isinstance(result["score"], float)
    assert result["score"] >= 0.3, "the Kevin score of a correct kernel: 0.3 plus its speedup"
    assert isinstance(result["speedup"], float)
    assert result["speedup"] > 0
    assert (result["error"], result["error_message"]) == (0.0, "")


async def test_a_wrong_kernel_scores_zero_and_says_why(mesh: KforgeMesh) -> None:
    extra_info = {"task_id": RELU.task_id, "task_source": RELU.source}
    result = await verl.compute_score("kforge", answer_text(WRONG), "ignored", extra_info, **options(mesh))
    assert result["verdict"] == "incorrect", result
    assert (result["score"], result["correct"], result["error"]) == (0.0, 0.0, 0.0)


async def test_a_row_without_a_task_is_recorded_not_raised(mesh: KforgeMesh) -> None:
    result = await verl.compute_score("kforge", answer_text(GOOD), "examples/relu", {}, **options(mesh))
    assert set(result) == KEYS
    assert (result["score"], result["error"]) == (0.0, 1.0)
    assert isinstance(result["error_message"], str)
    assert result["error_message"].startswith("TASK: task id 'examples/relu' needs a task set")


def test_the_sync_variant_looks_task_ids_up_in_the_task_set(mesh: KforgeMesh) -> None:
    tasks = str(example_task.__globals__["EXAMPLES"])
    result = verl.compute_score_sync("kforge", "no code at all", "examples/relu", None, tasks=tasks, **options(mesh))
    assert (result["verdict"], result["score"], result["error"]) == ("", 0.0, 0.0), "no kernel: unscored, no error"


@dataclass
class TokenOutput:
    """verl's `TokenOutput`, the fields the adapter reads."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str | None = "completed"


class CharTokenizer:
    """A tokenizer with one token per character and a plain chat template."""

    pad_token_id = 0

    def apply_chat_template(self, conversation: Any, /, **kwargs: Any) -> str:
        """`<role>content</role>` per message, then `<assistant>` for a generation prompt."""
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conversation)
        return text + ("<assistant>" if kwargs.get("add_generation_prompt") else "")

    def encode(self, text: str, /, **kwargs: Any) -> list[int]:
        """One id per character."""
        return [ord(c) for c in text]

    def decode(self, token_ids: Any, /, **kwargs: Any) -> str:
        """The characters of the ids."""
        return "".join(chr(i) for i in token_ids)


class ScriptedServer:
    """A rollout server that answers with scripted texts, one per generation."""

    def __init__(self, tokenizer: CharTokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), list[list[int]]()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """The next scripted text's tokens, each with log-probability -0.5."""
        self.prompts.append(prompt_ids)
        ids = self.tokenizer.encode(self.texts.pop(0))
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


async def test_the_agent_loop_body_runs_a_two_turn_episode(mesh: KforgeMesh) -> None:
    tokenizer = CharTokenizer()
    server = ScriptedServer(tokenizer, [answer_text(WRONG), answer_text(GOOD)])
    config = AdapterConfig(orchestrator=mesh.addresses["orchestrator"], backend="cpu", turns=2, timeout=300)
    row = {"raw_prompt": [{"role": "user", "content": "x"}], "extra_info": {"task_source": RELU.source}}
    result = await verl.run_agent_episode(
        server, tokenizer, {"temperature": 1.0}, row, config=config, response_length=20000
    )

    assert result["reward_score"] >= 0.3, "best of the two turns: the correct one"
    assert result["extra_fields"]["turn_scores"][0] == 0.0
    assert result["extra_fields"]["kforge_correct"] == 1.0
    assert len(result["response_ids"]) == len(result["response_mask"]) == len(result["response_logprobs"])
    first = len(answer_text(WRONG))
    assert result["response_mask"][:first] == [1] * first
    assert 0 in result["response_mask"][first:], "the feedback between the turns is masked out"
    feedback = tokenizer.decode(
        [t for t, m in zip(result["response_ids"], result["response_mask"], strict=True) if not m]
    )
    assert "incorrect" in feedback.lower() or "mismatch" in feedback.lower(), feedback
    assert tokenizer.decode(result["prompt_ids"]).startswith("<system>"), "kevin's own prompt, not the row's"
    assert server.prompts[1][: len(result["prompt_ids"])] == result["prompt_ids"]
    assert result["num_turns"] == 5  # system + user, response, feedback, response


async def test_a_response_budget_spent_ends_the_episode_truncated(mesh: KforgeMesh) -> None:
    tokenizer = CharTokenizer()
    server = ScriptedServer(tokenizer, [answer_text(WRONG)])
    config = AdapterConfig(orchestrator=mesh.addresses["orchestrator"], backend="cpu", turns=3, prompt="dataset")
    row = {
        "raw_prompt": [{"role": "user", "content": "Write ModelNew."}],
        "reward_model": {"ground_truth": RELU.source},
    }
    result = await verl.run_agent_episode(server, tokenizer, {}, row, config=config, response_length=50)
    assert tokenizer.decode(result["prompt_ids"]) == "<user>Write ModelNew.</user><assistant>"
    assert len(result["response_ids"]) == 50
    assert result["extra_fields"]["kforge_turns"] == 1.0
    assert result["extra_fields"]["kforge_error_message"] == ""


def _stand_in_verl() -> types.ModuleType:
    """The agent-loop names of verl as 0.10.0.dev defines them, reduced to what the adapter touches."""
    module = types.ModuleType("verl.experimental.agent_loop.agent_loop")
    registry: dict[str, dict[str, str]] = {}

    class AgentLoopBase:
        def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, processor: Any, **kwargs: Any):
            self.config, self.server_manager, self.tokenizer = trainer_config, server_manager, tokenizer

    class AgentLoopMetrics:
        model_fields: ClassVar[dict[str, float]] = {
            "generate_sequences": 0.0,
            "tool_calls": 0.0,
            "compute_score": 0.0,
            "num_preempted": -1,
        }

        def __init__(self, **values: float) -> None:
            self.values = values

    class AgentLoopOutput:
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    def register(name: str) -> Any:
        def decorator(cls: type) -> type:
            registry[name] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
            return cls

        return decorator

    module.__dict__.update(
        AgentLoopBase=AgentLoopBase,
        AgentLoopMetrics=AgentLoopMetrics,
        AgentLoopOutput=AgentLoopOutput,
        register=register,
        _agent_loop_registry=registry,
    )
    return module


async def test_the_agent_loop_class_subclasses_verls_base_and_registers(
    mesh: KforgeMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _stand_in_verl()
    monkeypatch.setitem(sys.modules, "verl.experimental.agent_loop.agent_loop", module)
    monkeypatch.setattr(verl, "_AGENT_LOOP", None)
    cls = verl.KforgeAgentLoop  # built by the module's __getattr__
    assert issubclass(cls, module.AgentLoopBase)
    assert module._agent_loop_registry == {"kforge_agent": {"_target_": "kforge.adapters.verl.KforgeAgentLoop"}}

    tokenizer = CharTokenizer()
    trainer_config = types.SimpleNamespace(
        actor_rollout_ref=types.SimpleNamespace(rollout=types.SimpleNamespace(response_length=30))
    )
    server = ScriptedServer(tokenizer, [answer_text(GOOD)])
    loop = cls(
        trainer_config, server, tokenizer, None, orchestrator=mesh.addresses["orchestrator"], backend="cpu", turns=1
    )
    output = await loop.run({}, raw_prompt=[], extra_info={"task_source": RELU.source}, agent_name="kforge_agent")
    assert len(output.response_ids) == 30
    assert output.reward_score == 0.0, "cut at 30 tokens: no complete kernel"
    assert set(output.metrics.values) == {"generate_sequences", "tool_calls"}


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (pip install verl)")
def test_the_agent_loop_class_builds_on_the_real_verl() -> None:
    base = importlib.import_module("verl.experimental.agent_loop.agent_loop").AgentLoopBase
    assert issubclass(verl.agent_loop_class(), base)
