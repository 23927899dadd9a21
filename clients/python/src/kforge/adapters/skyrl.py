"""SkyRL: `KforgeTextEnv`, a `skyrl_gym` text environment whose episodes are kforge episodes, and its registration.

Written against skyrl-gym 0.4.0 (PyPI; `NovaSky-AI/SkyRL`, August 2026): SkyRL's generator makes one environment
per trajectory with `skyrl_gym.make(env_class, env_config=..., extras=row)` (`extras`: every dataset column but
`prompt` and `env_class`), then calls `init(prompt) -> (prompt, metadata)`, `step(action) ->
BaseTextEnvStepOutput(observations, reward, done, metadata)` once per turn and `close()`, synchronously, in a thread
pool. `KforgeTextEnv` subclasses the real `skyrl_gym.envs.base_text_env.BaseTextEnv` where skyrl-gym is installed
(a stand-in of the same shape otherwise, so that this module imports anywhere).

- `init` starts the episode (StartEpisode) on the row's task: `extras["task_source"]`, `extras["task_id"]`,
  `extras["extra_info"]["task_source" | "task_id"]`, else `extras["reward_spec"]["ground_truth"]`; it returns the
  recipe's prompt (`prompt` = `kforge`) or the row's (`dataset`).
- `step` sends the action as the turn's response (Step); the reward is that turn's (SkyRL puts each turn's on
  its last token), the observation the feedback as a user message (none once done).
- Configuration: `AdapterConfig.from_env()` (`KFORGE_*`), then `env_config` (`environment.skyrl_gym.kforge.*`),
  then `extras["kforge"]` (a row's own options).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, TypedDict

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    KernelOutcome,
    feedback_text,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import Episode

__all__ = ["ENTRY_POINT", "ENV_ID", "KforgeTextEnv", "StepOutput", "register", "skyrl_gym_installed"]

ENV_ID: Final = "kforge"
"""The id `register` gives by default: `environment.env_class=kforge`, or a row's `env_class` column."""
ENTRY_POINT: Final = "kforge.adapters.skyrl:KforgeTextEnv"

Message = dict[str, str]


class StepOutput(TypedDict):
    """`BaseTextEnvStepOutput`'s shape (a TypedDict in skyrl-gym)."""

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any]


class _StandInTextEnv:
    """`BaseTextEnv`'s shape where skyrl-gym is not installed: turns, max_turns, init, step, close, get_metrics."""

    def __init__(self) -> None:
        self.turns = 0
        self.max_turns = 1

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        return prompt, {}

    def close(self) -> None:
        return None

    def get_metrics(self) -> dict[str, Any]:
        return {}


if TYPE_CHECKING:
    _TextEnvBase = _StandInTextEnv
else:
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv as _TextEnvBase
    except ImportError:
        _TextEnvBase = _StandInTextEnv


def skyrl_gym_installed() -> bool:
    """Whether `KforgeTextEnv` subclasses the real `skyrl_gym` base class."""
    return _TextEnvBase is not _StandInTextEnv


_POOLS: dict[AdapterConfig, ClientPool] = {}


class KforgeTextEnv(_TextEnvBase):
    """One SkyRL trajectory as a kforge episode (sync calls: SkyRL runs environments in a thread pool)."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        options = {**dict(env_config or {}), **dict(extras.get("kforge") or {})}
        self.config = AdapterConfig.from_env().with_options(options)
        self.max_turns = self.config.turns
        self._extras = extras
        self._pool = _POOLS.setdefault(self.config, ClientPool(self.config))
        self._episode: Episode | None = None
        self._outcomes: list[KernelOutcome] = []
        self._error = ""

    def _task(self) -> Any:
        extras = self._extras
        info: Mapping[str, Any] = extras.get("extra_info") or {}
        spec: Mapping[str, Any] = extras.get("reward_spec") or {}
        info, spec = (item if isinstance(item, Mapping) else {} for item in (info, spec))
        return task_from_fields(
            extras.get("task_source"),
            extras.get("task_id"),
            info.get("task_source"),
            info.get("task_id"),
            spec.get("ground_truth"),
            tasks=self.config.tasks,
        )

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """Starts the episode; the first prompt and `{"episode_id": ...}` (or `{"error": ...}`)."""
        self.turns, self._outcomes, self._error = 0, [], ""
        try:
            self._episode = Episode.start(
                self._pool.sync().orchestrator, task=self._task(), **start_kwargs(self.config)
            )
        except Exception as error:  # the first step ends the trajectory with the error recorded
            self._episode = None
            self._error = KernelOutcome.from_error(error).error
            return list(prompt), {"error": self._error}
        first = list(prompt) if self.config.prompt == "dataset" else self._episode.messages
        return first, {"episode_id": self._episode.id}

    def step(self, action: str) -> StepOutput:
        """Sends `action` as the turn's response; the turn's reward, the feedback, and whether it is done."""
        self.turns += 1
        episode = self._episode
        if episode is None or self._error:
            outcome = KernelOutcome(
                reward=self.config.error_reward, error=self._error or "no episode", error_code="TASK"
            )
            self._outcomes.append(outcome)
            return {"observations": [], "reward": outcome.reward, "done": True, "metadata": outcome.as_dict()}
        try:
            observation = episode.step(action, timeout=self.config.timeout)
        except Exception as error:  # the trajectory ends with the error recorded
            outcome = KernelOutcome.from_error(error, error_reward=self.config.error_reward, episode_id=episode.id)
            self._error = outcome.error
            self._outcomes.append(outcome)
            return {"observations": [], "reward": outcome.reward, "done": True, "metadata": outcome.as_dict()}
        outcome = KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)
        self._outcomes.append(outcome)
        done = observation.done or bool(outcome.error)
        feedback = feedback_text(observation, turns_left=self.config.turns - observation.turn)
        return {
            "observations": [] if done else [{"role": "user", "content": feedback}],
            "reward": outcome.reward,
            "done": done,
            "metadata": outcome.as_dict(),
        }

    def get_metrics(self) -> dict[str, Any]:
        """The episode's metrics: turns, whether a kernel was correct, the best speedup, errors."""
        return {
            "kforge_turns": len(self._outcomes),
            "kforge_correct": float(any(outcome.correct for outcome in self._outcomes)),
            "kforge_best_speedup": max((outcome.speedup for outcome in self._outcomes), default=0.0),
            "kforge_errors": sum(1 for outcome in self._outcomes if outcome.error),
        }

    def close(self) -> None:
        """Forgets the episode (the client is shared by the process's environments)."""
        self._episode = None


def register(env_id: str = ENV_ID, **kwargs: Any) -> None:
    """Registers `KforgeTextEnv` with skyrl-gym as `env_id` (`kwargs`: constructor arguments, e.g. `env_config`).

    Call it in the Ray entrypoint before the trainer starts. ImportError where skyrl-gym is not installed.
    """
    envs = importlib.import_module("skyrl_gym.envs")
    envs.register(id=env_id, entry_point=ENTRY_POINT, kwargs=kwargs)
