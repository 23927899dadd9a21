"""One sample's result, or its error, as flat scalars for a trainer's logs; an episode's rewards as one number."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kforge.adapters._config import EpisodeReward
from kforge.adapters._tasks import TaskError
from kforge.adapters._texts import verdict_name
from kforge.errors import KforgeError
from kforge.v1 import common_pb2, orchestrator_pb2


@dataclass(frozen=True)
class KernelOutcome:
    """One sample's result: its reward and what kforge said of it, or why it has none.

    Attributes:
        reward: The reward to train on: the step's score (0 when unscored: no kernel, format error), or the
            configured `error_reward` when `error` is set.
        verdict: The evaluation's verdict (`correct`, `incorrect`, ...); empty when nothing was evaluated.
        speedup: The speedup against the score's baseline; 0 when not timed.
        format_error: Why the response broke the strict format policy; empty otherwise.
        error: Why the sample has no trustworthy reward: a failed kforge call (`CODE: message`), a task the row
            does not name, a turn that failed on the way, or an infrastructure error of the evaluator. Empty
            when the reward is the sample's own.
        error_code: The status code of a failed call (`UNAVAILABLE`...), `TASK` for a task the row does not
            name, `TURN` for a turn that failed on the way, `INFRA` for an evaluator infrastructure error.
        episode_id: The episode (empty when none started).
        turn: The turn the step answered.
        done: Whether the episode has ended.
    """

    reward: float
    verdict: str = ""
    speedup: float = 0.0
    format_error: str = ""
    error: str = ""
    error_code: str = ""
    episode_id: str = ""
    turn: int = 0
    done: bool = True

    @property
    def ok(self) -> bool:
        """Whether the reward is the sample's own (no error)."""
        return not self.error

    @property
    def correct(self) -> bool:
        """Whether the kernel was judged correct."""
        return self.verdict == "correct"

    @classmethod
    def from_observation(cls, observation: orchestrator_pb2.Observation, *, error_reward: float = 0.0) -> KernelOutcome:
        """The outcome of the step that returned `observation`."""
        record = observation.record
        verdict = verdict_name(record.verdict)
        error, code = "", ""
        if record.error:
            error, code = record.error, "TURN"
        elif record.verdict == common_pb2.VERDICT_INFRA_ERROR:
            error, code = f"evaluator infrastructure error: {observation.evaluation.error or 'no detail'}", "INFRA"
        return cls(
            reward=error_reward if error else observation.reward,
            verdict=verdict,
            speedup=record.speedup if record.HasField("speedup") else 0.0,
            format_error=record.format_error,
            error=error,
            error_code=code,
            episode_id=observation.episode_id,
            turn=record.turn,
            done=observation.done,
        )

    @classmethod
    def from_error(cls, error: BaseException, *, error_reward: float = 0.0, episode_id: str = "") -> KernelOutcome:
        """The outcome of a sample whose call or task failed."""
        if isinstance(error, KforgeError):
            code, text = error.code, str(error)
        elif isinstance(error, TaskError):
            code, text = "TASK", f"TASK: {error}"
        else:
            code, text = type(error).__name__, f"{type(error).__name__}: {error}"
        return cls(reward=error_reward, error=text, error_code=code, episode_id=episode_id)

    def metrics(self, prefix: str = "") -> dict[str, float | str]:
        """Flat scalars, the same keys for every sample.

        `score`, `correct`, `speedup`, `format_error`, `error` (0/1 floats) and `verdict`, `error_message` (strings).
        """
        return {
            f"{prefix}score": self.reward,
            f"{prefix}correct": float(self.correct),
            f"{prefix}speedup": self.speedup,
            f"{prefix}format_error": float(bool(self.format_error)),
            f"{prefix}error": float(bool(self.error)),
            f"{prefix}verdict": self.verdict,
            f"{prefix}error_message": self.error,
        }

    def as_dict(self) -> dict[str, Any]:
        """Every field, for metadata that a trainer carries along (JSON-serialisable)."""
        return dataclasses.asdict(self)


def aggregate_rewards(rewards: Sequence[float], how: EpisodeReward) -> float:
    """One reward for a trajectory of step rewards: the best, the last or their sum; 0 for none."""
    if not rewards:
        return 0.0
    if how == "best":
        return max(rewards)
    if how == "last":
        return rewards[-1]
    return float(sum(rewards))
