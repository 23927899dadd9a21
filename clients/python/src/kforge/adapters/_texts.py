"""The texts between a model and kforge: a bare kernel as the recipe's answer, an observation as feedback."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kforge.v1 import common_pb2, orchestrator_pb2

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
