"""The slime adapter against a real kforge mesh: a sample's reward, a group, the post-process, a whole episode.

Written against slime 0.3.1 (THUDM/slime, August 2026; not on PyPI, and its `slime.utils.types` imports torch and
more): `async reward(args, sample)` for `--custom-rm-path`, `async group_reward(args, samples)` for `--group-rm`,
`post_process_rewards(args, samples) -> (raw, used)`, and `async generate(args, sample, sampling_params)` for
`--custom-generate-function-path`. The stand-in `Sample` below has the fields of slime's dataclass that the adapter
reads and writes, and its `Status` enum.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

from kforge.adapters import slime
from kforge.adapters._common import AdapterConfig, Generation, answer_text

RELU = example_task("relu")
GOOD = example_candidate("relu")
WRONG = GOOD.replace("in[i] > 0.0f ? in[i] : 0.0f", "in[i]")


@dataclass
class Sample:
    """slime's `Sample`, the fields the adapter touches."""

    class Status(enum.Enum):
        """slime's `Sample.Status`."""

        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


def use_mesh(mesh: KforgeMesh, monkeypatch: Any) -> None:
    monkeypatch.setenv("KFORGE_ORCHESTRATOR", mesh.addresses["orchestrator"])
    monkeypatch.setenv("KFORGE_BACKEND", "cpu")


async def test_a_samples_reward_is_its_kforge_score(mesh: KforgeMesh, monkeypatch: Any) -> None:
    use_mesh(mesh, monkeypatch)
    sample = Sample(response=answer_text(GOOD), label=RELU.source)
    reward = await slime.reward(types.SimpleNamespace(), sample)
    assert reward >= 0.3
    assert sample.metadata["kforge"]["verdict"] == "correct"


async def test_a_group_is_scored_and_post_processed_without_its_failure(mesh: KforgeMesh, monkeypatch: Any) -> None:
    use_mesh(mesh, monkeypatch)
    samples = [
        Sample(response=answer_text(GOOD), metadata={"task_source": RELU.source}),
        Sample(response=answer_text(WRONG), label=RELU.source),
        Sample(response=answer_text(GOOD), label="examples/relu"),  # a task id without a task set: recorded
    ]
    rewards = await slime.group_reward(types.SimpleNamespace(), samples)
    assert rewards[0] >= 0.3
    assert rewards[1:] == [0.0, 0.0]
    assert samples[2].metadata["kforge"]["error_code"] == "TASK"

    for sample, value in zip(samples, rewards, strict=True):
        sample.reward = value
    args = types.SimpleNamespace(n_samples_per_prompt=3, rewards_normalization=True)
    raw, used = slime.post_process_rewards(args, samples)
    assert raw == rewards
    assert used[0] > 0 > used[1], "centred over the two scored samples"
    assert used[0] == -used[1]
    assert used[2] == 0.0, "the failed sample carries no advantage"


class CharTokenizer:
    """One token per character, a plain chat template."""

    def apply_chat_template(self, conversation: Any, /, **kwargs: Any) -> str:
        """`<role>content</role>` per message, then `<assistant>` for a generation prompt."""
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in conversation)
        return text + ("<assistant>" if kwargs.get("add_generation_prompt") else "")

    def encode(self, text: str, /, **kwargs: Any) -> list[int]:
        """One id per character."""
        return [ord(c) for c in text]

    def decode(self, token_ids: Any, /, **kwargs: Any) -> str:
        """The characters of the ids."""
        return "".join(chr(i) for i in token_ids)


async def test_generate_runs_a_whole_episode_and_sets_the_sample(mesh: KforgeMesh) -> None:
    tokenizer = CharTokenizer()
    texts = [answer_text(WRONG), answer_text(GOOD)]
    seen: list[Mapping[str, Any]] = []

    def engine(args: Any, sampling_params: Mapping[str, Any]) -> Any:
        seen.append(sampling_params)

        async def generate(prompt_ids: list[int], budget: int) -> Generation:
            ids = tokenizer.encode(texts.pop(0))
            return Generation(token_ids=ids, log_probs=[-0.1] * len(ids), finish_reason="stop")

        return generate

    config = AdapterConfig(orchestrator=mesh.addresses["orchestrator"], backend="cpu", turns=2, timeout=300)
    generate = slime.make_generate(config, tokenizer=tokenizer, engine=engine)
    sample = Sample(prompt="Write ModelNew.", label=RELU.source)
    args = types.SimpleNamespace(rollout_max_response_len=20000, hf_checkpoint="unused")
    result = await generate(args, sample, {"temperature": 1.0})

    assert result is sample
    assert sample.status is Sample.Status.COMPLETED
    assert isinstance(sample.reward, float)
    assert sample.reward >= 0.3, "the best turn's score"
    assert sample.response_length == len(sample.loss_mask or []) == len(sample.rollout_log_probs or [])
    assert sample.tokens[-sample.response_length :] == tokenizer.encode(sample.response)
    assert 0 in (sample.loss_mask or []), "the feedback tokens are masked out"
    assert sample.metadata["kforge"]["kforge_turns"] == 2.0
    assert seen == [{"temperature": 1.0}]
