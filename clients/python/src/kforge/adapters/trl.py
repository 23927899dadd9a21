"""TRL: an `environment_factory` class whose tool submits kernels to a kforge episode, and reward functions.

Written against TRL 1.16.0 (`GRPOTrainer(environment_factory=..., reward_funcs=...)`); `environment_factory` first
shipped in v0.29 and an environment's own `get_reward` in v1.8, which this needs. TRL's contract, as it stands:

- one environment instance per rollout, drawn from a pool and reused: `reset(**row)` (sync) starts each rollout
  and its returned text is appended to the row's last user message;
- every public function of the class but `reset` and `get_reward` is a tool, its schema built from the type hints
  and the Google-style docstring; async tools are gathered on TRL's event loop;
- `get_reward()` (async allowed) is called once per finished rollout; its column is named after the class.

`KforgeEnvironment` starts a kforge episode in `reset` (StartEpisode), steps it in the tool `submit_kernel`
(Step) and returns the episode's reward from `get_reward`. `kernel_reward` / `async_kernel_reward` score each
completion as a one-turn kforge episode. Rows name their task by a `task_source` or `task_id` column.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    KernelOutcome,
    Scorer,
    TaskLike,
    aggregate_rewards,
    answer_text,
    feedback_text,
    response_text,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import AsyncEpisode, Episode
from kforge.v1 import orchestrator_pb2

__all__ = [
    "KforgeEnvironment",
    "async_kernel_reward",
    "environment_factory",
    "kernel_reward",
    "make_async_kernel_reward",
    "make_kernel_reward",
]

_POOLS: dict[AdapterConfig, ClientPool] = {}

_NEXT_STEP = "Improve on it: fix what failed, or make a correct kernel faster, and submit it with `submit_kernel`."


def _pool(config: AdapterConfig) -> ClientPool:
    return _POOLS.setdefault(config, ClientPool(config))


class KforgeEnvironment:
    """One TRL rollout as a kforge episode; its one tool is `submit_kernel`.

    Only `reset`, `submit_kernel` and `get_reward` are public: TRL makes every other public function a tool.
    `KforgeEnvironment()` reads its configuration from `KFORGE_*`; `environment_factory(config)` gives one.
    """

    def __init__(self, config: AdapterConfig | None = None) -> None:
        self._config = config or AdapterConfig.from_env()
        self._pool = _pool(self._config)
        self._observation: orchestrator_pb2.Observation | None = None
        self._outcomes: list[KernelOutcome] = []
        self._error = ""

    def reset(self, **kwargs: Any) -> str | None:
        """Starts a kforge episode on the row's task; returns the text added to the row's last user message.

        The task is the row's `task_source`, else its `task_id` (looked up in `KFORGE_TASKS`). With `prompt` =
        `kforge` the text is the recipe's first prompt; with `dataset`, only how to submit.
        """
        self._observation, self._outcomes, self._error = None, [], ""
        task = task_from_fields(kwargs.get("task_source"), kwargs.get("task_id"), tasks=self._config.tasks)
        episode = Episode.start(self._pool.sync().orchestrator, task=task, **start_kwargs(self._config))
        self._observation = episode.observation
        how = (
            f"Submit each complete `ModelNew` source with the `submit_kernel` tool instead of writing it in your "
            f"reply: it is evaluated and you get its feedback. You have {self._config.turns} "
            f"submission{'s' if self._config.turns != 1 else ''}."
        )
        if self._config.prompt == "dataset":
            return how
        prompt = [message.content for message in episode.prompt if message.role == "user"]
        return "\n\n".join([*prompt[-1:], how])

    async def submit_kernel(self, code: str) -> str:
        """Submits a kernel: it is compiled, checked against the reference model and timed.

        Args:
            code: The complete Python source of the `ModelNew` module, with every import and kernel it needs.

        Returns:
            The evaluation of the kernel: its verdict, what went wrong if anything, its score and speedup, and
            how many submissions are left.
        """
        if self._observation is None:
            return "No episode is running: the environment was not reset."
        if self._observation.done:
            return "The episode is over: no more kernels are evaluated."
        if self._error:
            return f"kforge could not evaluate kernels in this episode: {self._error}"
        episode = AsyncEpisode(self._pool.for_loop().orchestrator, self._observation)
        try:
            observation = await episode.step(answer_text(code), timeout=self._config.timeout)
        except Exception as error:  # the rollout gets no reward; the model is told the submission failed
            outcome = KernelOutcome.from_error(error, error_reward=self._config.error_reward, episode_id=episode.id)
            self._outcomes.append(outcome)
            self._error = outcome.error
            return f"kforge could not evaluate the kernel: {outcome.error}"
        self._observation = observation
        outcome = KernelOutcome.from_observation(observation, error_reward=self._config.error_reward)
        self._outcomes.append(outcome)
        if outcome.error:
            self._error = outcome.error
        return feedback_text(observation, turns_left=self._config.turns - observation.turn, next_step=_NEXT_STEP)

    async def get_reward(self) -> float | None:
        """The rollout's reward: its submissions' rewards aggregated (`episode_reward`); 0 without a submission.

        None when a kforge call or an evaluation failed on the way (TRL leaves it out of the reward as NaN).
        """
        if self._error:
            return None
        return aggregate_rewards([outcome.reward for outcome in self._outcomes], self._config.episode_reward)


def environment_factory(config: AdapterConfig | None = None) -> Callable[[], KforgeEnvironment]:
    """A zero-argument factory for `GRPOTrainer(environment_factory=...)` making environments of `config`."""
    resolved = config or AdapterConfig.from_env()

    def factory() -> KforgeEnvironment:
        return KforgeEnvironment(resolved)

    return factory


def _column(kwargs: Mapping[str, Any], name: str, count: int) -> Sequence[Any]:
    values = kwargs.get(name)
    return list(values) if isinstance(values, Sequence) and not isinstance(values, str) else [values] * count


def _items(completions: Sequence[Any], kwargs: Mapping[str, Any], tasks: str | None) -> list[tuple[Any, str]]:
    count = len(completions)
    sources, ids = _column(kwargs, "task_source", count), _column(kwargs, "task_id", count)
    items: list[tuple[TaskLike | Exception, str]] = []
    for completion, source, task_id in zip(completions, sources, ids, strict=True):
        try:
            task: TaskLike | Exception = task_from_fields(source, task_id, tasks=tasks)
        except Exception as error:  # recorded as the sample's outcome
            task = error
        items.append((task, response_text(completion)))
    return items


def _rewards(outcomes: Sequence[KernelOutcome], kwargs: Mapping[str, Any]) -> list[float | None]:
    log_metric = kwargs.get("log_metric")
    if callable(log_metric) and outcomes:
        log_metric("kforge/correct", statistics.fmean(float(outcome.correct) for outcome in outcomes))
        log_metric("kforge/speedup", statistics.fmean(outcome.speedup for outcome in outcomes))
        log_metric("kforge/errors", float(sum(1 for outcome in outcomes if outcome.error)))
    return [outcome.reward if outcome.ok else None for outcome in outcomes]


def make_kernel_reward(config: AdapterConfig | None = None) -> Callable[..., list[float | None]]:
    """A TRL reward function (named `kernel_reward`) scoring with `config`."""
    scorer = Scorer(config or AdapterConfig.from_env())

    def kernel_reward(
        completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        """Each completion's kforge reward, evaluated `concurrency` at a time.

        None for a sample whose task or call failed (TRL ignores it as NaN). The task is the row's `task_source`
        or `task_id` column.
        """
        outcomes = scorer.score_batch(_items(completions, kwargs, scorer.config.tasks))
        return _rewards(outcomes, kwargs)

    return kernel_reward


def make_async_kernel_reward(config: AdapterConfig | None = None) -> Callable[..., Any]:
    """The async TRL reward function (named `kernel_reward`), gathered on TRL's event loop (TRL ≥ 0.27)."""
    scorer = Scorer(config or AdapterConfig.from_env())

    async def kernel_reward(
        completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        """Each completion's kforge reward, gathered on the running loop; None for a failed sample."""
        outcomes = await scorer.ascore_batch(_items(completions, kwargs, scorer.config.tasks))
        return _rewards(outcomes, kwargs)

    return kernel_reward


def kernel_reward(
    completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Each completion's kforge reward with the `KFORGE_*` configuration (see `make_kernel_reward`)."""
    return _default_sync()(completions, prompts, **kwargs)


async def async_kernel_reward(
    completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """`kernel_reward` on the running event loop (see `make_async_kernel_reward`)."""
    result: list[float | None] = await _default_async()(completions, prompts, **kwargs)
    return result


_DEFAULTS: dict[str, Callable[..., Any]] = {}


def _default_sync() -> Callable[..., list[float | None]]:
    if "sync" not in _DEFAULTS:
        _DEFAULTS["sync"] = make_kernel_reward()
    return _DEFAULTS["sync"]


def _default_async() -> Callable[..., Any]:
    if "async" not in _DEFAULTS:
        _DEFAULTS["async"] = make_async_kernel_reward()
    return _DEFAULTS["async"]
