"""verl: a reward function for `reward.custom_reward_function` and an agent loop that runs whole kforge episodes.

Written against verl 0.10.0.dev (verl-project/verl, August 2026; PyPI 0.9.1) and checked for 0.8 (volcengine/verl):
`compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)` called by the reward loop's
`NaiveRewardManager` (awaited when `async def`), and `AgentLoopBase.run(sampling_params, **row) -> AgentLoopOutput`
with `server_manager.generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`.

- `compute_score` scores one response as a one-turn kforge episode (recipe `single-turn` unless configured) and
  returns `score` with `correct`, `speedup`, `verdict`, `format_error`, `error`, `error_message`.
- `KforgeAgentLoop` (built on first access, only where verl imports) runs a multi-turn episode with the rollout
  server and sets `reward_score`, so verl's reward loop is skipped for its samples. `run_agent_episode` is its
  body, usable with any object that has verl's `server_manager.generate`.

The row names its task by `extra_info.task_source`, `extra_info.task_id`, or `reward_model.ground_truth` (a
reference source or a task id of `KFORGE_TASKS`). Configuration: `AdapterConfig.from_env()` (`KFORGE_*`), overridden
by `reward_kwargs` for the reward function and by the agent loop's YAML keys for the loop.
"""

from __future__ import annotations

import importlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Final

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    Generation,
    KernelOutcome,
    Scorer,
    Tokenizer,
    TokenTrajectory,
    run_token_episode,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import AsyncEpisode

__all__ = [
    "AGENT_NAME",
    "agent_loop_class",
    "compute_score",
    "compute_score_sync",
    "row_task",
    "run_agent_episode",
]

AGENT_NAME: Final = "kforge_agent"
"""The name `KforgeAgentLoop` is registered under (a row's `agent_name`, or `rollout.agent.default_agent_loop`)."""

_SCORERS: dict[AdapterConfig, Scorer] = {}


def _scorer(options: Mapping[str, Any]) -> Scorer:
    config = AdapterConfig.from_env().with_options(options)
    scorer = _SCORERS.get(config)
    if scorer is None:
        scorer = _SCORERS.setdefault(config, Scorer(config))
    return scorer


def row_task(ground_truth: Any, extra_info: Mapping[str, Any] | None, tasks: str | None) -> Any:
    """The kforge task of a verl row: `extra_info.task_source`, `extra_info.task_id`, then `ground_truth`."""
    info = extra_info or {}
    return task_from_fields(info.get("task_source"), info.get("task_id"), ground_truth, tasks=tasks)


def _result(outcome: KernelOutcome) -> dict[str, float | str]:
    return outcome.metrics()


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float | str]:
    """The kforge reward of one response, for `reward.custom_reward_function` (verl's reward loop awaits it).

    Args:
        data_source: The row's data source (unused: the task is named by the row's fields).
        solution_str: The decoded response.
        ground_truth: The row's `reward_model.ground_truth`: the task's reference source or a task id.
        extra_info: The row's `extra_info`; `task_source` / `task_id` there win over `ground_truth`.
        **kwargs: `reward_kwargs`: `AdapterConfig` fields (`orchestrator`, `recipe`, `backend`, ...); others,
            such as verl's `reward_router_address`, are ignored.

    Returns:
        `score` (the reward), `correct`, `speedup`, `format_error`, `error` (floats) and `verdict`,
        `error_message` (strings): the same keys for every sample. A sample whose task or call failed scores the
        configured `error_reward` with `error` 1 and the reason in `error_message`.
    """
    scorer = _scorer(kwargs)
    try:
        task = row_task(ground_truth, extra_info, scorer.config.tasks)
        outcome = await scorer.ascore(task, solution_str)
    except Exception as error:  # recorded in the sample's extra info; the batch goes on
        outcome = KernelOutcome.from_error(error, error_reward=scorer.config.error_reward)
    return _result(outcome)


def compute_score_sync(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float | str]:
    """`compute_score` for verl's legacy reward managers (≤ 0.8 without the reward loop), which call it in a thread."""
    scorer = _scorer(kwargs)
    try:
        task = row_task(ground_truth, extra_info, scorer.config.tasks)
        outcome = scorer.score(task, solution_str)
    except Exception as error:  # recorded in the sample's extra info; the batch goes on
        outcome = KernelOutcome.from_error(error, error_reward=scorer.config.error_reward)
    return _result(outcome)


# ---------------------------------------------------------------------------------------------------------------------
# The agent loop

_POOLS: dict[AdapterConfig, ClientPool] = {}


def _pool(config: AdapterConfig) -> ClientPool:
    return _POOLS.setdefault(config, ClientPool(config))


async def run_agent_episode(
    server_manager: Any,
    tokenizer: Tokenizer,
    sampling_params: Mapping[str, Any],
    row: Mapping[str, Any],
    *,
    config: AdapterConfig,
    response_length: int,
    pool: ClientPool | None = None,
) -> dict[str, Any]:
    """One kforge episode with verl's rollout server.

    Returns the fields of an `AgentLoopOutput` but `metrics`, plus `timing` (seconds generating and in kforge).

    Starts the episode on the row's task, generates each turn with `server_manager.generate(request_id,
    prompt_ids=..., sampling_params=...)` (a `TokenOutput`: `token_ids`, `log_probs`, `stop_reason`), steps it,
    and appends the feedback with mask 0 until the episode ends or `response_length` tokens are spent.
    `reward_score` is the trajectory's reward (`AdapterConfig.episode_reward`); a task the row does not name or a
    failed call gives the `error_reward`, recorded in `extra_fields`.
    """
    pool = pool or _pool(config)
    request_id = uuid.uuid4().hex
    generating = 0.0

    async def generate(prompt_ids: list[int], budget: int) -> Generation:
        nonlocal generating
        began = time.monotonic()
        output = await server_manager.generate(
            request_id=request_id, prompt_ids=prompt_ids, sampling_params=dict(sampling_params)
        )
        generating += time.monotonic() - began
        log_probs = getattr(output, "log_probs", None)
        return Generation(token_ids=list(output.token_ids), log_probs=list(log_probs) if log_probs else None)

    began = time.monotonic()
    try:
        reward_model = row.get("reward_model") or {}
        task = row_task(reward_model.get("ground_truth"), row.get("extra_info"), config.tasks)
        episode = await AsyncEpisode.start(pool.for_loop().orchestrator, task=task, **start_kwargs(config))
    except Exception as error:  # no episode: an empty response with the error recorded
        outcome = KernelOutcome.from_error(error, error_reward=config.error_reward)
        prompt = list(row.get("raw_prompt") or [{"role": "user", "content": ""}])
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        trajectory = TokenTrajectory(
            prompt_ids=tokenizer.encode(str(text), add_special_tokens=False), outcomes=[outcome], reward=outcome.reward
        )
    else:
        trajectory = await run_token_episode(
            episode,
            tokenizer=tokenizer,
            generate=generate,
            max_response_tokens=response_length,
            config=config,
            prompt_messages=list(row.get("raw_prompt") or []) if config.prompt == "dataset" else None,
        )
    if not trajectory.response_ids:  # verl pads and concatenates responses: keep one masked token
        trajectory.response_ids, trajectory.response_mask = [_pad_id(tokenizer)], [0]
        trajectory.response_logprobs = [0.0] if trajectory.response_logprobs is not None else None
    elapsed = time.monotonic() - began
    return {
        "prompt_ids": trajectory.prompt_ids,
        "response_ids": trajectory.response_ids[:response_length],
        "response_mask": trajectory.response_mask[:response_length],
        "response_logprobs": (
            trajectory.response_logprobs[:response_length] if trajectory.response_logprobs is not None else None
        ),
        "reward_score": trajectory.reward,
        "num_turns": len(trajectory.messages),
        "extra_fields": {"turn_scores": trajectory.rewards, **trajectory.metrics()},
        "timing": {"generate_sequences": generating, "tool_calls": elapsed - generating},
    }


def _pad_id(tokenizer: Tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


_CONFIG_FIELDS: Final = frozenset(item.name for item in fields(AdapterConfig))
_AGENT_LOOP: type[Any] | None = None


def agent_loop_class(name: str = AGENT_NAME) -> type[Any]:
    """`KforgeAgentLoop`: a subclass of verl's `AgentLoopBase` registered as `name`, built on first call.

    Raises ImportError where verl is not installed. Its constructor takes verl's arguments plus, as keyword
    arguments (the extra keys of its entry in `rollout.agent.agent_loop_config_path`), `AdapterConfig` fields.
    """
    global _AGENT_LOOP  # noqa: PLW0603 - one class per process, as verl's registry expects
    if _AGENT_LOOP is not None:
        return _AGENT_LOOP
    agent_loop = importlib.import_module("verl.experimental.agent_loop.agent_loop")
    base, output_type, metrics_type = agent_loop.AgentLoopBase, agent_loop.AgentLoopOutput, agent_loop.AgentLoopMetrics

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        options = {key: kwargs.pop(key) for key in list(kwargs) if key in _CONFIG_FIELDS}
        base.__init__(self, *args, **kwargs)
        self.kforge_config = AdapterConfig.from_env().with_options(options)

    async def run(self: Any, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """Runs one kforge episode for the row in `kwargs` (see `run_agent_episode`)."""
        result = await run_agent_episode(
            self.server_manager,
            self.tokenizer,
            sampling_params,
            kwargs,
            config=self.kforge_config,
            response_length=int(self.config.actor_rollout_ref.rollout.response_length),
        )
        timing = result.pop("timing")
        metrics = metrics_type(**{key: value for key, value in timing.items() if key in metrics_type.model_fields})
        return output_type(**result, metrics=metrics)

    namespace = {"__init__": __init__, "run": run, "__module__": __name__, "__qualname__": "KforgeAgentLoop"}
    namespace["__doc__"] = "A verl agent loop that runs one kforge episode per sample and sets its reward_score."
    cls = type("KforgeAgentLoop", (base,), namespace)
    agent_loop.register(name)(cls)
    _AGENT_LOOP = cls
    return cls


def __getattr__(name: str) -> Any:
    """`kforge.adapters.verl.KforgeAgentLoop` (hydra's `_target_`) builds the class on first access."""
    if name == "KforgeAgentLoop":
        return agent_loop_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
