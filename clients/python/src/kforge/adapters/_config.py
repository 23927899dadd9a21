"""Where the orchestrator is and how the adapters run episodes: `AdapterConfig`, from `KFORGE_*` variables or given."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from kforge.client import DEFAULT_ADDRESSES
from kforge.v1 import common_pb2

ENV_ORCHESTRATOR: Final = "KFORGE_ORCHESTRATOR"
"""The orchestrator's address (`http://host:port`, `https://host`); the adapters call no other service."""
ENV_ADDRESS: Final = "KFORGE_ADDRESS"
"""One address serving every service (a front); `KFORGE_ORCHESTRATOR` wins over it."""

EpisodeReward = Literal["best", "last", "sum"]
"""How an episode's step rewards become one number where a trainer takes one per trajectory."""
PromptSource = Literal["kforge", "dataset"]
"""Whose prompt the model sees first where the adapter builds it: the recipe's (kforge) or the dataset row's."""

_RECIPE_SINGLE: Final = "single-turn"
_RECIPE_EPISODE: Final = "kevin"


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


@dataclass(frozen=True)
class AdapterConfig:
    """How an adapter reaches kforge and runs episodes.

    `AdapterConfig.from_env()` reads each field `x` from `$KFORGE_<X>` (the address from `$KFORGE_ORCHESTRATOR`,
    else `$KFORGE_ADDRESS`); a field without its variable keeps the default below.

    Attributes:
        orchestrator: The orchestrator's address; default `kforge up`'s, `http://127.0.0.1:50055`.
        token: The bearer token; None: the client's own lookup (`$KFORGE_TOKEN`, then `$KFORGE_TOKEN_FILE`).
        recipe: The recipe; None: `single-turn` for one-shot rewards, `kevin` for multi-turn episodes.
        turns: Turns of a multi-turn episode (each response to an observation is one).
        backend: Where kernels are evaluated (`cpu`, `cuda`, `triton`); empty: the evaluator's choice.
        policy: The evaluator's static policy (e.g. `kevin-strict`); empty: its default.
        strict_format: Kevin's strict format policy; None: the recipe's default (on for `kevin`).
        tasks: A task set on disk that task ids are looked up in: a KernelBench directory, a `.jsonl` file of
            `{"task_id", "source"}` lines, or a directory of `<name>/task.py` (ids `examples/<name>`).
        episode_reward: How a trajectory's step rewards become one where a trainer takes one: `best` (default),
            `last` or `sum`.
        prompt: Whose prompt the model sees first where the adapter builds it: `kforge` (the recipe's) or
            `dataset` (the row's).
        error_reward: The reward of a sample whose kforge call failed (its error is recorded beside it).
        timeout: Deadline of each call in seconds; a step evaluates a kernel within it.
        concurrency: Samples of one batch in flight at once.
    """

    orchestrator: str = DEFAULT_ADDRESSES["orchestrator"]
    token: str | None = None
    recipe: str | None = None
    turns: int = 4
    backend: str = ""
    policy: str = ""
    strict_format: bool | None = None
    tasks: str | None = None
    episode_reward: EpisodeReward = "best"
    prompt: PromptSource = "kforge"
    error_reward: float = 0.0
    timeout: float | None = 600.0
    concurrency: int = 32

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns: at least 1, got {self.turns}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency: at least 1, got {self.concurrency}")
        if self.episode_reward not in get_args(EpisodeReward):
            raise ValueError(f"episode_reward: one of best, last, sum; got {self.episode_reward!r}")
        if self.prompt not in get_args(PromptSource):
            raise ValueError(f"prompt: kforge or dataset; got {self.prompt!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> AdapterConfig:
        """The configuration from `KFORGE_*` variables, then `overrides` (field names; None values ignored)."""
        values: dict[str, Any] = {}
        address = _env(ENV_ORCHESTRATOR) or _env(ENV_ADDRESS)
        if address:
            values["orchestrator"] = address
        for item in dataclasses.fields(cls):
            if item.name in ("orchestrator", "token"):
                continue  # the token is the client's own lookup, so that a token file is read when connecting
            text = _env(f"KFORGE_{item.name.upper()}")
            if text is not None:
                values[item.name] = _parse(item.name, text)
        return cls(**values).with_options(overrides)

    def with_options(self, options: Mapping[str, Any]) -> AdapterConfig:
        """A copy with the options that name a field replaced (others ignored: a trainer passes its own too)."""
        names = {item.name for item in dataclasses.fields(self)}
        changes = {key: value for key, value in options.items() if key in names and value is not None}
        for key, value in changes.items():
            if isinstance(value, str) and key not in ("orchestrator", "token", "recipe", "backend", "policy", "tasks"):
                changes[key] = _parse(key, value)
        return dataclasses.replace(self, **changes) if changes else self

    def recipe_for(self, turns: int) -> str:
        """The recipe of an episode of `turns` turns: the configured one, else `single-turn` or `kevin`."""
        return self.recipe or (_RECIPE_SINGLE if turns == 1 else _RECIPE_EPISODE)


def _parse(name: str, text: str) -> Any:
    """A field's value from its environment text."""
    if name in ("turns", "concurrency"):
        return int(text)
    if name in ("error_reward",):
        return float(text)
    if name == "timeout":
        return None if text.lower() in ("none", "0") else float(text)
    if name == "strict_format":
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0"):
            raise ValueError(f"KFORGE_STRICT_FORMAT: true or false, got {text!r}")
        return lowered in ("true", "1")
    return text


def start_kwargs(config: AdapterConfig, *, turns: int | None = None) -> dict[str, Any]:
    """`Episode.start`'s keyword arguments for a multi-turn episode of this configuration."""
    turns = turns or config.turns
    return {
        "recipe": config.recipe_for(turns),
        "turns": turns,
        "backend": config.backend or common_pb2.BACKEND_UNSPECIFIED,
        "policy": config.policy,
        "strict_format": config.strict_format,
        "timeout": config.timeout,
    }
