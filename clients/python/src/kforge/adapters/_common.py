"""What the trainer adapters share: their configuration, tasks, answer and feedback texts, outcomes, clients.

- `AdapterConfig`: where the orchestrator is and how episodes are run, from `KFORGE_*` environment variables or
  given; every adapter takes one.
- `TaskSet` and `resolve_task`: the kforge task a dataset row names, by its reference source or by a task id of a
  task set on disk (a KernelBench directory, a `.jsonl` file, a directory of `<name>/task.py`).
- `answer_text` turns a bare kernel into a response in the recipe's shape; `feedback_text` an observation into
  the message a model reads after a step.
- `KernelOutcome`: one sample's result, or its error, as flat scalars for a trainer's logs.
- `Scorer`: one response scored as a one-turn episode (StartEpisode, Step), alone or as a batch whose failed
  samples are recorded, not raised.
- `run_token_episode`: a whole multi-turn episode at the token level (prompt, response tokens with their loss mask
  and log-probabilities), for trainers that let an adapter drive generation (verl's agent loop, slime).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TypeVar, cast, get_args

from kforge.client import DEFAULT_ADDRESSES, AsyncClient, Client
from kforge.episodes import AsyncEpisode, Episode
from kforge.errors import KforgeError
from kforge.v1 import common_pb2, orchestrator_pb2

__all__ = [
    "ENV_ADDRESS",
    "ENV_ORCHESTRATOR",
    "AdapterConfig",
    "ClientPool",
    "EpisodeReward",
    "Generate",
    "Generation",
    "KernelOutcome",
    "PromptSource",
    "Scorer",
    "TaskError",
    "TaskSet",
    "TokenTrajectory",
    "Tokenizer",
    "aggregate_rewards",
    "answer_text",
    "chat_delta_ids",
    "feedback_text",
    "resolve_task",
    "response_text",
    "run_token_episode",
    "start_kwargs",
    "task_from_fields",
]

log = logging.getLogger("kforge.adapters")

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


# ---------------------------------------------------------------------------------------------------------------------
# Tasks


class TaskError(ValueError):
    """A dataset row names no usable kforge task (no source, or an id its task set lacks)."""


@dataclass(frozen=True)
class TaskSet:
    """Tasks by id, read from disk as the orchestrator reads a job's task set."""

    tasks: Mapping[str, str]
    origin: str = ""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TaskSet:
        """The task set at `path`, read as the orchestrator reads a job's.

        A KernelBench directory (`level<N>/<n>_<name>.py` -> `level<N>/<n>_<name>`), a `.jsonl` file of
        `{"task_id", "source"}` objects, or a directory of `<name>/task.py` (-> `examples/<name>`, the ids of the
        orchestrator's built-in `examples`).
        """
        root = Path(path)
        tasks: dict[str, str] = {}
        if root.suffix == ".jsonl":
            for number, line in enumerate(root.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if not isinstance(item, dict) or not item.get("task_id") or not item.get("source"):
                    raise TaskError(f'{root}:{number}: expected {{"task_id": ..., "source": ...}}')
                tasks[str(item["task_id"])] = str(item["source"])
        elif root.is_dir():
            for level in sorted(root.glob("level*/*.py")):
                tasks[f"{level.parent.name}/{level.stem}"] = level.read_text()
            for example in sorted(root.glob("*/task.py")):
                tasks[f"examples/{example.parent.name}"] = example.read_text()
        else:
            raise TaskError(f"{root}: not a directory or a .jsonl file")
        if not tasks:
            raise TaskError(f"{root}: holds no tasks")
        return cls(tasks, str(root))

    def get(self, task_id: str) -> common_pb2.Task:
        """The task of this id; TaskError naming the set when it has none."""
        source = self.tasks.get(task_id)
        if source is None:
            raise TaskError(f"task id {task_id!r} is not in the task set {self.origin or '(given)'}")
        return common_pb2.Task(task_id=task_id, source=source)


_TASK_SETS: dict[str, TaskSet] = {}
_TASK_SETS_LOCK = threading.Lock()


def _task_set(path: str) -> TaskSet:
    with _TASK_SETS_LOCK:
        if path not in _TASK_SETS:
            _TASK_SETS[path] = TaskSet.load(path)
        return _TASK_SETS[path]


def _looks_like_source(text: str) -> bool:
    return "\n" in text and "get_inputs" in text


def _inline_id(source: str) -> str:
    return "inline/" + hashlib.sha256(source.encode()).hexdigest()[:16]


TaskLike = common_pb2.Task | str | Mapping[str, Any]
"""A task as rows carry it: a `Task`, a reference source, a task id, or a mapping with `task_id` / `source`."""


def resolve_task(task: TaskLike, tasks: TaskSet | str | None = None) -> common_pb2.Task:
    """The kforge task `task` names.

    A `Task` is taken as is; a string holding Python source with `get_inputs` is the reference source (its id
    `inline/<hash>`); any other string is a task id looked up in `tasks` (a `TaskSet` or its path); a mapping gives
    `task_id` and/or `source` (also read as `task_source`). TaskError says what is missing.
    """
    if isinstance(task, common_pb2.Task):
        if not task.source:
            return resolve_task(task.task_id, tasks)
        return task if task.task_id else common_pb2.Task(task_id=_inline_id(task.source), source=task.source)
    if isinstance(task, str):
        text = task.strip()
        if not text:
            raise TaskError("the task is empty: give a task id or the reference source")
        if _looks_like_source(task):
            return common_pb2.Task(task_id=_inline_id(task), source=task)
        if tasks is None:
            raise TaskError(
                f"task id {text!r} needs a task set to look it up in: set KFORGE_TASKS (AdapterConfig.tasks) to a "
                "KernelBench directory, a .jsonl file or a directory of <name>/task.py, or put the source in the row"
            )
        return (_task_set(tasks) if isinstance(tasks, str) else tasks).get(text)
    source = task.get("source") or task.get("task_source")
    task_id = task.get("task_id")
    if source:
        return common_pb2.Task(task_id=str(task_id or _inline_id(str(source))), source=str(source))
    if task_id:
        return resolve_task(str(task_id), tasks)
    raise TaskError(f"the mapping names no task: expected task_id or source, got keys {sorted(task)}")


def task_from_fields(*candidates: Any, tasks: TaskSet | str | None = None) -> common_pb2.Task:
    """The task named by the first candidate that names one: a row's fields in the adapter's order of preference.

    A candidate may be None, empty, or a mapping with `task_id` / `task_source` / `source` (other keys ignored).
    """
    for candidate in candidates:
        if candidate is None or (isinstance(candidate, str) and not candidate.strip()):
            continue
        if isinstance(candidate, Mapping):
            if not any(candidate.get(key) for key in ("task_id", "task_source", "source")):
                continue
            return resolve_task(candidate, tasks)
        if isinstance(candidate, common_pb2.Task | str):
            return resolve_task(candidate, tasks)
    raise TaskError("the row names no kforge task: give task_id or task_source (or the source as the label)")


# ---------------------------------------------------------------------------------------------------------------------
# Texts

_FENCE = re.compile(r"^\s*```[\w+-]*\s*\n(?P<code>.*?)\n\s*```\s*$", re.DOTALL)

DEFAULT_SUMMARY: Final = "Here is my kernel."


def answer_text(kernel: str, summary: str = DEFAULT_SUMMARY) -> str:
    """A response holding `kernel` in the recipes' shape: a summary in prose, then one ```python fenced block.

    `kernel` is the complete Python source defining `ModelNew`; one fence around it is dropped. The result keeps
    to `kevin`'s strict format.
    """
    match = _FENCE.match(kernel)
    code = match["code"] if match else kernel.strip("\n")
    return f"{summary.strip() or DEFAULT_SUMMARY}\n\n```python\n{code}\n```\n"


_VERDICTS: Final[Mapping[int, str]] = {
    value: name.removeprefix("VERDICT_").lower() for name, value in common_pb2.Verdict.items()
}


def verdict_name(verdict: int) -> str:
    """`correct`, `incorrect`, `compile_error`, ...; empty when nothing was evaluated."""
    return "" if verdict == common_pb2.VERDICT_UNSPECIFIED else _VERDICTS.get(verdict, str(verdict))


NEXT_STEP: Final = (
    "Improve on it: fix what failed, or make a correct kernel faster. Reply with a short summary of what you "
    "changed, then the complete Python source of `ModelNew` in one ```python fenced block."
)
"""What `feedback_text` asks of the model while turns are left."""


def feedback_text(
    observation: orchestrator_pb2.Observation, *, turns_left: int | None = None, next_step: str = NEXT_STEP
) -> str:
    """What a model reads after a step: the recipe's feedback on its response, its score, and what is left.

    The feedback is the turn's record (`TurnRecord.feedback`, else its format error or error); `turns_left` adds
    how many responses the episode still takes, and `next_step` what to do with them.
    """
    record = observation.record
    parts = [record.feedback.strip() or record.format_error.strip() or record.error.strip() or "No feedback."]
    scored = f"Score: {observation.reward:.4g}."
    if record.HasField("speedup"):
        scored += f" Speedup: {record.speedup:.3g}x."
    parts.append(scored)
    if observation.done:
        parts.append("The episode is over.")
    elif turns_left is not None:
        parts.append(f"{turns_left} attempt{'s' if turns_left != 1 else ''} left. {next_step}")
    return "\n\n".join(parts)


def response_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """A completion's text: a string as is; a conversational completion's assistant contents, joined.

    The orchestrator takes the last fenced block defining `ModelNew`, so the last attempt in a multi-message
    completion is the one evaluated.
    """
    if isinstance(completion, str):
        return completion
    texts: list[str] = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, Sequence):
            texts.extend(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "\n\n".join(texts)


# ---------------------------------------------------------------------------------------------------------------------
# Outcomes


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


# ---------------------------------------------------------------------------------------------------------------------
# Clients


class ClientPool:
    """The clients an adapter calls through: one sync client, and one async client per event loop.

    An `AsyncClient` is bound to the loop it was made in; a trainer may call an adapter from several loops (a
    daemon loop, a loop per worker), so each running loop gets its own, and those of closed loops are dropped.
    """

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._sync: Client | None = None
        self._async: dict[asyncio.AbstractEventLoop, AsyncClient] = {}

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"timeout": self.config.timeout}
        if self.config.token is not None:
            options["token"] = self.config.token
        return options

    def sync(self) -> Client:
        """The sync client (thread-safe: a gRPC channel serves every thread)."""
        with self._lock:
            if self._sync is None:
                self._sync = Client({"orchestrator": self.config.orchestrator}, **self._options())
            return self._sync

    def for_loop(self) -> AsyncClient:
        """The async client of the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for stale in [other for other in self._async if other.is_closed()]:
                del self._async[stale]
            client = self._async.get(loop)
            if client is None:
                client = AsyncClient({"orchestrator": self.config.orchestrator}, **self._options())
                self._async[loop] = client
            return client

    async def aclose(self) -> None:
        """Closes the running loop's async client."""
        with self._lock:
            client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    def close(self) -> None:
        """Closes the sync client; async clients are closed by `aclose` in their loop."""
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()


# ---------------------------------------------------------------------------------------------------------------------
# Scoring one response: a one-turn episode

T = TypeVar("T")


class Scorer:
    """Scores responses as kforge does: each a one-turn episode (StartEpisode, then Step with the response).

    The orchestrator extracts the kernel (the last fenced block defining `ModelNew`), evaluates it, scores it
    with the recipe's formula and records the turn, so a trainer's reward is the one a kforge job would give.
    `score`/`ascore` raise a failed call; `score_batch`/`ascore_batch` record it in the sample's outcome.
    """

    def __init__(self, config: AdapterConfig | None = None, *, pool: ClientPool | None = None) -> None:
        self.config = config or AdapterConfig.from_env()
        self.pool = pool or ClientPool(self.config)

    def _start_kwargs(self, idempotency_key: str | None) -> dict[str, Any]:
        return {**start_kwargs(self.config, turns=1), "idempotency_key": idempotency_key}

    def task(self, task: TaskLike) -> common_pb2.Task:
        """`task` resolved against the configured task set."""
        return resolve_task(task, self.config.tasks)

    def score(self, task: TaskLike, response: str, *, idempotency_key: str | None = None) -> KernelOutcome:
        """The outcome of `response` to `task` (sync); a failed call raises its `KforgeError`."""
        orchestrator = self.pool.sync().orchestrator
        episode = Episode.start(orchestrator, task=self.task(task), **self._start_kwargs(idempotency_key))
        observation = episode.step(response, timeout=self.config.timeout)
        return KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)

    async def ascore(self, task: TaskLike, response: str, *, idempotency_key: str | None = None) -> KernelOutcome:
        """The outcome of `response` to `task` (asyncio); a failed call raises its `KforgeError`."""
        orchestrator = self.pool.for_loop().orchestrator
        episode = await AsyncEpisode.start(orchestrator, task=self.task(task), **self._start_kwargs(idempotency_key))
        observation = await episode.step(response, timeout=self.config.timeout)
        return KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)

    def _recorded(self, error: Exception) -> KernelOutcome:
        log.warning("kforge: a sample got no reward: %s", error)
        return KernelOutcome.from_error(error, error_reward=self.config.error_reward)

    def score_batch(self, items: Iterable[tuple[TaskLike | Exception, str]]) -> list[KernelOutcome]:
        """The outcomes of many (task, response) pairs, `concurrency` at a time on threads, in order.

        A sample whose call fails, or whose task is an exception (a row that named none), gets an outcome with
        `error` set and the `error_reward`; the others are scored.
        """

        def one(item: tuple[TaskLike | Exception, str]) -> KernelOutcome:
            task, response = item
            try:
                if isinstance(task, Exception):
                    raise task
                return self.score(task, response)
            except Exception as error:  # recorded per sample; the batch goes on
                return self._recorded(error)

        batch = list(items)
        if len(batch) <= 1:
            return [one(item) for item in batch]
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, len(batch))) as pool:
            return list(pool.map(one, batch))

    async def ascore_batch(self, items: Iterable[tuple[TaskLike | Exception, str]]) -> list[KernelOutcome]:
        """`score_batch` on the event loop: `concurrency` samples at once, gathered."""
        return await gather_limited(
            [self._ascore_recorded(task, response) for task, response in items], self.config.concurrency
        )

    async def _ascore_recorded(self, task: TaskLike | Exception, response: str) -> KernelOutcome:
        try:
            if isinstance(task, Exception):
                raise task
            return await self.ascore(task, response)
        except Exception as error:  # recorded per sample; the batch goes on
            return self._recorded(error)

    def close(self) -> None:
        """Closes the sync client."""
        self.pool.close()

    async def aclose(self) -> None:
        """Closes the running loop's async client."""
        await self.pool.aclose()


async def gather_limited(awaitables: Sequence[Awaitable[T]], limit: int) -> list[T]:
    """The awaitables' results in order, at most `limit` running at once."""
    semaphore = asyncio.Semaphore(limit)

    async def bounded(awaitable: Awaitable[T]) -> T:
        async with semaphore:
            return await awaitable

    return list(await asyncio.gather(*(bounded(item) for item in awaitables)))


# ---------------------------------------------------------------------------------------------------------------------
# A whole episode at the token level


class Tokenizer(Protocol):
    """What `run_token_episode` uses of a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: Any, /, **kwargs: Any) -> Any:
        """Renders messages (`tokenize=False`: to text)."""

    def encode(self, text: str, /, **kwargs: Any) -> list[int]:
        """Token ids of a text."""

    def decode(self, token_ids: Any, /, **kwargs: Any) -> str:
        """The text of token ids."""


@dataclass(frozen=True)
class Generation:
    """One generation by the trainer's inference engine.

    Attributes:
        token_ids: The generated tokens.
        log_probs: One log-probability per token, when the engine gave them.
        finish_reason: `stop` or `length` when known; None: inferred (`length` when the budget was used up).
    """

    token_ids: list[int]
    log_probs: list[float] | None = None
    finish_reason: str | None = None


Generate = Callable[[list[int], int], Awaitable[Generation]]
"""The trainer's engine: (prompt and response so far as token ids, tokens left) -> the next generation."""


@dataclass
class TokenTrajectory:
    """A whole episode as a trainer trains on it.

    Attributes:
        prompt_ids: The first prompt's tokens.
        response_ids: The model's tokens and the feedback tokens between them, within the response budget.
        response_mask: 1 for the model's tokens, 0 for feedback tokens.
        response_logprobs: One per response token (0 for feedback tokens), when every generation gave them.
        messages: The conversation as text: the first prompt, then each response and feedback.
        outcomes: One per step taken, in order (an error ends the episode and is the last).
        reward: The step rewards aggregated by the configured `episode_reward`; the `error_reward` when a step
            failed.
        truncated: Whether the response budget ran out before the episode ended.
        episode_id: The episode.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    outcomes: list[KernelOutcome] = field(default_factory=list)
    reward: float = 0.0
    truncated: bool = False
    episode_id: str = ""

    @property
    def rewards(self) -> list[float]:
        """Each step's reward."""
        return [outcome.reward for outcome in self.outcomes]

    @property
    def error(self) -> str:
        """The error that ended the episode, if any."""
        return next((outcome.error for outcome in reversed(self.outcomes) if outcome.error), "")

    def metrics(self) -> dict[str, float | str]:
        """Flat scalars of the episode: its reward, turns, best speedup, correct turns, error."""
        return {
            "kforge_reward": self.reward,
            "kforge_turns": float(len(self.outcomes)),
            "kforge_correct": float(any(outcome.correct for outcome in self.outcomes)),
            "kforge_best_speedup": max((outcome.speedup for outcome in self.outcomes), default=0.0),
            "kforge_error": float(bool(self.error)),
            "kforge_error_message": self.error,
            "kforge_episode_id": self.episode_id,
        }


def _render(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return cast(str, text)


def chat_delta_ids(
    tokenizer: Tokenizer, conversation: Sequence[Mapping[str, str]], message: Mapping[str, str]
) -> list[int]:
    """The tokens the chat template adds for `message` after `conversation`, with the next generation prompt.

    Rendered as the difference between the template over the conversation with and without the message; when the
    template re-renders earlier turns differently, the message alone with a generation prompt.
    """
    before = _render(tokenizer, conversation, generation_prompt=False)
    after = _render(tokenizer, [*conversation, message], generation_prompt=True)
    delta = after[len(before) :] if after.startswith(before) else _render(tokenizer, [message], generation_prompt=True)
    return list(tokenizer.encode(delta, add_special_tokens=False))


async def run_token_episode(
    episode: AsyncEpisode,
    *,
    tokenizer: Tokenizer,
    generate: Generate,
    max_response_tokens: int,
    config: AdapterConfig,
    prompt_messages: Sequence[Mapping[str, str]] | None = None,
) -> TokenTrajectory:
    """Runs `episode` to its end with the trainer's engine, token in, token out.

    The first prompt is `prompt_messages` (the dataset's) or the episode's own (the recipe's); each generation is
    decoded and sent as the turn's response (Step); the feedback (`feedback_text`) is appended as a user message,
    its tokens masked out. It ends when the episode is done, the response budget is spent, or a step fails (the
    failure is the last outcome, the trajectory's reward the `error_reward`).
    """
    messages = [dict(message) for message in (prompt_messages or episode.messages)]
    prompt_ids = list(tokenizer.encode(_render(tokenizer, messages, generation_prompt=True), add_special_tokens=False))
    trajectory = TokenTrajectory(prompt_ids=prompt_ids, messages=messages, episode_id=episode.id)
    logprobs: list[float] | None = []
    while not episode.done:
        budget = max_response_tokens - len(trajectory.response_ids)
        if budget <= 0:
            trajectory.truncated = True
            break
        generation = await generate(prompt_ids + trajectory.response_ids, budget)
        ids = list(generation.token_ids[:budget])
        trajectory.response_ids += ids
        trajectory.response_mask += [1] * len(ids)
        if logprobs is not None and generation.log_probs is not None and len(generation.log_probs) >= len(ids):
            logprobs += list(generation.log_probs[: len(ids)])
        else:
            logprobs = None
        text = tokenizer.decode(ids, skip_special_tokens=True)
        finish = generation.finish_reason or ("length" if len(ids) >= budget else "stop")
        messages.append({"role": "assistant", "content": text})
        try:
            observation = await episode.step(text, finish_reason=finish, timeout=config.timeout)
        except Exception as error:  # the episode cannot go on; its trajectory is still trained on or dropped
            log.warning("kforge: episode %s stopped: %s", episode.id, error)
            trajectory.outcomes.append(
                KernelOutcome.from_error(error, error_reward=config.error_reward, episode_id=episode.id)
            )
            break
        trajectory.outcomes.append(KernelOutcome.from_observation(observation, error_reward=config.error_reward))
        if observation.done:
            break
        feedback = {"role": "user", "content": feedback_text(observation, turns_left=config.turns - episode.turn)}
        feedback_ids = chat_delta_ids(tokenizer, messages, feedback)[
            : max_response_tokens - len(trajectory.response_ids)
        ]
        messages.append(feedback)
        trajectory.response_ids += feedback_ids
        trajectory.response_mask += [0] * len(feedback_ids)
        if logprobs is not None:
            logprobs += [0.0] * len(feedback_ids)
    trajectory.response_logprobs = logprobs
    trajectory.reward = (
        config.error_reward if trajectory.error else aggregate_rewards(trajectory.rewards, config.episode_reward)
    )
    return trajectory


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
