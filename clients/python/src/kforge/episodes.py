"""The orchestrator's Step API as an object: an episode that a trainer's own loop drives, one response per turn.

```python
from kforge.episodes import Episode
from kforge.v1.common_pb2 import Task

episode = Episode.start(client.orchestrator, recipe="kevin", task=Task(task_id="relu", source=src), turns=4,
                        backend="cpu")
while not episode.done:
    episode.step(generate(episode.messages))          # the model's response text
rewards = [turn.score for turn in episode.turns]       # once done: every turn with its return and advantage
```

`step` sends the response as the current turn's, with an idempotency key derived from the episode and the turn, so
a step retried (by `kforge.retry`, or by the caller after an error, from this process or another) replays the first
attempt's stored outcome instead of evaluating again.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from kforge.calls import Metadata
from kforge.v1 import common_pb2, evaluator_pb2, gateway_pb2, orchestrator_pb2
from kforge.v1.clients import AsyncOrchestratorClient, OrchestratorClient

__all__ = ["AsyncEpisode", "Episode"]


class _EpisodeState:
    """An episode as its latest observation shows it; `Episode` and `AsyncEpisode` add the calls."""

    def __init__(self, observation: orchestrator_pb2.Observation) -> None:
        self._observation = observation

    @property
    def id(self) -> str:
        """The episode's id (the orchestrator stores it as a job of this id)."""
        return self._observation.episode_id

    @property
    def observation(self) -> orchestrator_pb2.Observation:
        """The latest observation: StartEpisode's, then the last step's."""
        return self._observation

    @property
    def turn(self) -> int:
        """The turn the current prompt is for, which the next `step` answers (0-based)."""
        return self._observation.turn

    @property
    def done(self) -> bool:
        """Whether the episode has ended: its turns are spent, or a step failed on the way."""
        return self._observation.done

    @property
    def prompt(self) -> Sequence[gateway_pb2.ChatMessage]:
        """The prompt for the current turn, as the recipe built it; empty once done."""
        return self._observation.prompt

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as `{"role": ..., "content": ...}` dicts, the shape chat templates take."""
        return [{"role": message.role, "content": message.content} for message in self._observation.prompt]

    @property
    def reward(self) -> float:
        """The reward of the last step (its score; 0 when unscored or before the first step)."""
        return self._observation.reward

    @property
    def record(self) -> orchestrator_pb2.TurnRecord | None:
        """The last step's stored turn (kernel, verdict, score, flags, feedback, error); None before the first."""
        return self._observation.record if self._observation.HasField("record") else None

    @property
    def evaluation(self) -> evaluator_pb2.EvaluateResponse | None:
        """The evaluation of the last step's kernel; None before the first step or when nothing was evaluated."""
        return self._observation.evaluation if self._observation.HasField("evaluation") else None

    @property
    def turns(self) -> Sequence[orchestrator_pb2.TurnRecord]:
        """Once done, every turn as stored, with its return and advantage; empty before."""
        return self._observation.turns

    def idempotency_key(self, turn: int | None = None) -> str:
        """The key `step` sends for `turn` (default: the current one): the same for every attempt at that turn."""
        return f"{self.id}/turn/{self.turn if turn is None else turn}"

    def _step_request(
        self,
        response: str | gateway_pb2.Completion,
        reasoning: str | None,
        finish_reason: str | None,
        prompt_token_ids: Sequence[int] | None,
    ) -> orchestrator_pb2.StepRequest:
        if isinstance(response, gateway_pb2.Completion):
            if reasoning is not None or finish_reason is not None:
                raise ValueError("reasoning and finish_reason go with a response text, not a Completion")
            completion = response
        else:
            completion = gateway_pb2.Completion(
                text=response, reasoning=reasoning or "", finish_reason=finish_reason or "stop"
            )
        return orchestrator_pb2.StepRequest(
            episode_id=self.id,
            completion=completion,
            turn=self.turn,
            idempotency_key=self.idempotency_key(),
            prompt_token_ids=prompt_token_ids or (),
        )


def _start_request(
    *,
    recipe: str,
    task: common_pb2.Task,
    turns: int,
    backend: common_pb2.Backend | str,
    policy: str,
    reward: orchestrator_pb2.RewardSpec | None,
    strict_format: bool | None,
    idempotency_key: str | None,
) -> orchestrator_pb2.StartEpisodeRequest:
    if isinstance(backend, str) and not backend.startswith("BACKEND_"):
        backend = f"BACKEND_{backend.upper()}"  # protobuf takes an enum value's name; an unknown one is ValueError
    return orchestrator_pb2.StartEpisodeRequest(
        recipe=recipe,
        task=task,
        turns=turns,
        backend=backend,
        policy=policy,
        reward=reward,
        strict_format=strict_format,
        idempotency_key=idempotency_key or str(uuid.uuid4()),
    )


class Episode(_EpisodeState):
    """A stepped episode over a sync orchestrator client; `Episode.start` begins one.

    `Episode(orchestrator, observation)` takes up an episode from its latest observation, and `Episode.resume` from its
    id alone (the orchestrator keeps where it stands), e.g. in another process after a crash.
    """

    def __init__(self, orchestrator: OrchestratorClient, observation: orchestrator_pb2.Observation) -> None:
        super().__init__(observation)
        self._orchestrator = orchestrator

    @classmethod
    def start(
        cls,
        orchestrator: OrchestratorClient,
        *,
        recipe: str,
        task: common_pb2.Task,
        turns: int = 1,
        backend: common_pb2.Backend | str = common_pb2.BACKEND_UNSPECIFIED,
        policy: str = "",
        reward: orchestrator_pb2.RewardSpec | None = None,
        strict_format: bool | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Episode:
        """Starts an episode (StartEpisode) and returns it at turn 0 with its first prompt.

        Args:
            orchestrator: The orchestrator's client.
            recipe: `single-turn`, `kevin` or `drkernel`: it builds each turn's prompt.
            task: The task (KernelBench format: `Model`, `get_inputs`, `get_init_inputs`).
            turns: Turns allowed, at least 1.
            backend: Where kernels are evaluated: a `Backend` value or its name (`cpu`, `cuda`, `triton`).
            policy: The evaluator's static policy; empty: its default.
            reward: Scoring and credit; unset fields take the recipe's defaults.
            strict_format: The strict format policy; None: the recipe's default (on for `kevin`).
            idempotency_key: Makes a retried start return the same episode; default: a fresh UUID, kept across
                this call's own retries.
            timeout: The call's deadline, seconds.
            metadata: Extra call metadata.
        """
        request = _start_request(
            recipe=recipe,
            task=task,
            turns=turns,
            backend=backend,
            policy=policy,
            reward=reward,
            strict_format=strict_format,
            idempotency_key=idempotency_key,
        )
        return cls(orchestrator, orchestrator.start_episode(request, timeout=timeout, metadata=metadata))

    @classmethod
    def resume(
        cls,
        orchestrator: OrchestratorClient,
        episode_id: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Episode:
        """Takes up a stored episode where it stands (GetEpisode): after a crash, or in another process."""
        request = orchestrator_pb2.GetEpisodeRequest(episode_id=episode_id)
        return cls(orchestrator, orchestrator.get_episode(request, timeout=timeout, metadata=metadata))

    def step(
        self,
        response: str | gateway_pb2.Completion,
        *,
        reasoning: str | None = None,
        finish_reason: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> orchestrator_pb2.Observation:
        """Answers the current turn with the model's response (Step) and returns the next observation.

        Args:
            response: The response text, or a whole `Completion` (with token ids and log-probabilities).
            reasoning: With a text, the reasoning the backend separated from it, if any.
            finish_reason: With a text, why generation stopped (default `stop`; `length` means cut at the token
                limit, which the strict format refuses).
            prompt_token_ids: The prompt as the trainer's tokenizer made it, stored with the turn for its sample
                (the response's token ids and log-probabilities go in a `Completion`).
            timeout: The call's deadline, seconds (an evaluation runs within it).
            metadata: Extra call metadata.
        """
        request = self._step_request(response, reasoning, finish_reason, prompt_token_ids)
        self._observation = self._orchestrator.step(request, timeout=timeout, metadata=metadata)
        return self._observation


class AsyncEpisode(_EpisodeState):
    """A stepped episode over an asyncio orchestrator client; `await AsyncEpisode.start(...)` begins one."""

    def __init__(self, orchestrator: AsyncOrchestratorClient, observation: orchestrator_pb2.Observation) -> None:
        super().__init__(observation)
        self._orchestrator = orchestrator

    @classmethod
    async def start(
        cls,
        orchestrator: AsyncOrchestratorClient,
        *,
        recipe: str,
        task: common_pb2.Task,
        turns: int = 1,
        backend: common_pb2.Backend | str = common_pb2.BACKEND_UNSPECIFIED,
        policy: str = "",
        reward: orchestrator_pb2.RewardSpec | None = None,
        strict_format: bool | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncEpisode:
        """Starts an episode; the arguments are `Episode.start`'s."""
        request = _start_request(
            recipe=recipe,
            task=task,
            turns=turns,
            backend=backend,
            policy=policy,
            reward=reward,
            strict_format=strict_format,
            idempotency_key=idempotency_key,
        )
        return cls(orchestrator, await orchestrator.start_episode(request, timeout=timeout, metadata=metadata))

    @classmethod
    async def resume(
        cls,
        orchestrator: AsyncOrchestratorClient,
        episode_id: str,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncEpisode:
        """Takes up a stored episode where it stands; the arguments are `Episode.resume`'s."""
        request = orchestrator_pb2.GetEpisodeRequest(episode_id=episode_id)
        return cls(orchestrator, await orchestrator.get_episode(request, timeout=timeout, metadata=metadata))

    async def step(
        self,
        response: str | gateway_pb2.Completion,
        *,
        reasoning: str | None = None,
        finish_reason: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> orchestrator_pb2.Observation:
        """Answers the current turn; the arguments are `Episode.step`'s."""
        request = self._step_request(response, reasoning, finish_reason, prompt_token_ids)
        self._observation = await self._orchestrator.step(request, timeout=timeout, metadata=metadata)
        return self._observation
