"""A whole multi-turn episode at the token level, for trainers that let an adapter drive generation."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from kforge.adapters._config import AdapterConfig
from kforge.adapters._outcomes import KernelOutcome, aggregate_rewards
from kforge.adapters._texts import feedback_text
from kforge.episodes import AsyncEpisode

log = logging.getLogger("kforge.adapters")


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
