"""NeMo RL: `KforgeEnvironment`, an environment of NeMo RL's `EnvironmentInterface` shape over kforge episodes.

Written against NeMo RL 0.6.0 (`NVIDIA-NeMo/RL` at 7ea279a, August 2026: `nemo_rl/environments/interfaces.py`),
which is not installable without CUDA (torch, ray and CUDA pins, Python 3.13); its shapes are copied here:

- `step(message_log_batch, metadata) -> EnvironmentReturn(observations, metadata, next_stop_strings, rewards,
  terminateds, answers)`, every field batched (rewards and terminateds tensors of the batch size);
- `global_post_process_and_metrics(batch) -> (batch, metrics)`.

NeMo RL makes the environment a Ray actor (`@ray.remote`, `__init__(cfg)`) from `env.<name>` in its config and
calls `step` once per turn with the samples still running; `register` adds it to `ENV_REGISTRY` and
`ACTOR_ENVIRONMENT_REGISTRY`, which NeMo RL needs both of.

Each sample's metadata (the datum's `extra_env_info`) names its task (`task_source` or `task_id`); its first step
starts the episode, whose id the returned metadata carries to the next. The samples of a batch are stepped
concurrently; a sample whose task or call fails is terminated with the `error_reward` and its error in its
observation and metadata, the others scored as usual. NeMo RL sums a trajectory's step rewards.
"""

from __future__ import annotations

import asyncio
import importlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, NamedTuple, Protocol, TypeVar

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    KernelOutcome,
    feedback_text,
    gather_limited,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import AsyncEpisode
from kforge.v1 import orchestrator_pb2

__all__ = [
    "ENV_NAME",
    "NEMO_RL_VERSION",
    "EnvironmentInterface",
    "EnvironmentReturn",
    "KforgeEnvironment",
    "register",
]

NEMO_RL_VERSION: Final = "0.6.0"
"""The NeMo RL version whose interface this copies."""
ENV_NAME: Final = "kforge"
ACTOR_FQN: Final = "kforge.adapters.nemo_rl.KforgeEnvironmentActor"
"""What `register` names: the Ray actor class `ray.remote` makes of `KforgeEnvironment` on first access."""

MetadataT = TypeVar("MetadataT")
Message = Mapping[str, Any]


class EnvironmentReturn(NamedTuple, Generic[MetadataT]):
    """NeMo RL's `EnvironmentReturn`: the result of one batched step, every field one entry per sample.

    Attributes:
        observations: One message per sample, `{"role": "environment", "content": ...}`.
        metadata: Each sample's state for its next step (None: keep the old).
        next_stop_strings: Stop strings of each sample's next generation (None: the default).
        rewards: The step's reward per sample: a float tensor where torch is installed, else a list.
        terminateds: Whether each sample's episode ended: a tensor (0/1) where torch is installed, else a list.
        answers: Each sample's extracted answer (the kernel), or None.
    """

    observations: list[dict[str, str]]
    metadata: list[MetadataT]
    next_stop_strings: list[list[str] | None]
    rewards: Any
    terminateds: Any
    answers: list[str | None] | None


class EnvironmentInterface(Protocol[MetadataT]):
    """NeMo RL's `EnvironmentInterface` (an ABC there), as a protocol."""

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[MetadataT]
    ) -> EnvironmentReturn[MetadataT]:
        """One turn of every running sample."""

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """The batch after the rollout, and metrics."""


@dataclass
class _Sample:
    observation: dict[str, str]
    metadata: dict[str, Any]
    reward: float
    done: bool
    answer: str | None
    outcome: KernelOutcome


def _last_assistant(messages: Sequence[Message]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content", ""))
    return ""


def _torch() -> Any | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


class KforgeEnvironment:
    """kforge episodes as a NeMo RL environment: `step` a batch, `global_post_process_and_metrics`.

    `cfg` (NeMo RL's `env.kforge` table) holds `AdapterConfig` fields over the `KFORGE_*` configuration, plus
    `stop_strings` (the next generation's stop strings; default none).
    """

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        options = dict(cfg or {})
        self.config = AdapterConfig.from_env().with_options(options)
        self.stop_strings: list[str] | None = options.get("stop_strings")
        self._pool = ClientPool(self.config)
        self._outcomes: list[KernelOutcome] = []

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn[dict[str, Any]]:
        """One turn of every sample in the batch, stepped concurrently (runs its own event loop)."""

        async def run() -> EnvironmentReturn[dict[str, Any]]:
            try:
                return await self.astep(message_log_batch, metadata)
            finally:
                await self._pool.aclose()

        return asyncio.run(run())

    async def astep(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn[dict[str, Any]]:
        """`step` on the running event loop (for an async Ray actor)."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} message logs but {len(metadata)} metadata")
        samples = await gather_limited(
            [self._step_one(log, dict(info or {})) for log, info in zip(message_log_batch, metadata, strict=True)],
            self.config.concurrency,
        )
        self._outcomes += [sample.outcome for sample in samples]
        rewards = [sample.reward for sample in samples]
        done = [sample.done for sample in samples]
        torch = _torch()
        return EnvironmentReturn(
            observations=[sample.observation for sample in samples],
            metadata=[sample.metadata for sample in samples],
            next_stop_strings=[self.stop_strings for _ in samples],
            rewards=rewards if torch is None else torch.tensor(rewards, dtype=torch.float32),
            terminateds=done if torch is None else torch.tensor(done, dtype=torch.bool),
            answers=[sample.answer for sample in samples],
        )

    async def _step_one(self, messages: Sequence[Message], metadata: dict[str, Any]) -> _Sample:
        orchestrator = self._pool.for_loop().orchestrator
        episode_id = str(metadata.get("kforge_episode_id") or "")
        try:
            if episode_id:
                observation = orchestrator_pb2.Observation(
                    episode_id=episode_id, turn=int(metadata.get("kforge_turn", 0))
                )
                episode = AsyncEpisode(orchestrator, observation)
            else:
                task = task_from_fields(metadata.get("task_source"), metadata.get("task_id"), tasks=self.config.tasks)
                episode = await AsyncEpisode.start(orchestrator, task=task, **start_kwargs(self.config))
                episode_id = episode.id
            observation = await episode.step(_last_assistant(messages), timeout=self.config.timeout)
        except Exception as error:  # recorded in this sample; the batch goes on
            outcome = KernelOutcome.from_error(error, error_reward=self.config.error_reward, episode_id=episode_id)
            return _Sample(
                observation={"role": "environment", "content": f"kforge error: {outcome.error}"},
                metadata={**metadata, "kforge_episode_id": episode_id, "kforge_error": outcome.error},
                reward=outcome.reward,
                done=True,
                answer=None,
                outcome=outcome,
            )
        outcome = KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)
        done = observation.done or bool(outcome.error)
        updated = {
            **metadata,
            "kforge_episode_id": episode_id,
            "kforge_turn": observation.turn,
            "kforge_outcome": outcome.as_dict(),
        }
        if outcome.error:
            updated["kforge_error"] = outcome.error
        return _Sample(
            observation={
                "role": "environment",
                "content": feedback_text(
                    observation, turns_left=None if done else self.config.turns - observation.turn
                ),
            },
            metadata=updated,
            reward=outcome.reward,
            done=done,
            answer=observation.record.kernel or None,
            outcome=outcome,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """The batch unchanged, and this environment's metrics over the steps since the last call."""
        outcomes, self._outcomes = self._outcomes, []
        if not outcomes:
            return batch, {}
        return batch, {
            "kforge/steps": float(len(outcomes)),
            "kforge/correct": statistics.fmean(float(outcome.correct) for outcome in outcomes),
            "kforge/mean_speedup": statistics.fmean(outcome.speedup for outcome in outcomes),
            "kforge/format_errors": float(sum(1 for outcome in outcomes if outcome.format_error)),
            "kforge/errors": float(sum(1 for outcome in outcomes if outcome.error)),
        }


_ACTOR: list[Any] = []


def _actor() -> Any:
    """`KforgeEnvironment` as a Ray actor class, as NeMo RL's built-in environments are."""
    if not _ACTOR:
        ray = importlib.import_module("ray")
        _ACTOR.append(ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=1000)(KforgeEnvironment))
    return _ACTOR[0]


def __getattr__(name: str) -> Any:
    """`kforge.adapters.nemo_rl.KforgeEnvironmentActor` (what `register` names) is made on first access."""
    if name == "KforgeEnvironmentActor":
        return _actor()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(env_name: str = ENV_NAME) -> None:
    """Registers the environment with NeMo RL as `env_name`.

    It goes in `ENV_REGISTRY` (`register_env`) and in `ACTOR_ENVIRONMENT_REGISTRY` (the system Python). Call it in
    the driver before the data and environments are set up. ImportError where NeMo RL is not installed.
    """
    utils = importlib.import_module("nemo_rl.environments.utils")
    registry = importlib.import_module("nemo_rl.distributed.ray_actor_environment_registry")
    cluster = importlib.import_module("nemo_rl.distributed.virtual_cluster")
    registry.ACTOR_ENVIRONMENT_REGISTRY[ACTOR_FQN] = cluster.PY_EXECUTABLES.SYSTEM
    utils.register_env(env_name, ACTOR_FQN)
