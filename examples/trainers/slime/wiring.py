"""What slime's rollout does with the reward hooks, against a running `kforge up` (CPU backend).

kforge up &  python examples/trainers/slime/wiring.py
"""

import asyncio
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kforge.adapters import answer_text
from kforge.adapters import slime as kforge_slime

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"


@dataclass
class Sample:
    """The attributes of slime's `Sample` that the hooks use."""

    response: str
    label: str
    reward: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


async def main() -> None:
    """Runs the example."""
    kernel = next((TASK / "candidates").glob("*.py")).read_text()
    source = (TASK / "task.py").read_text()
    samples = [Sample(answer_text(kernel), source), Sample("no kernel", source)]
    args = types.SimpleNamespace(n_samples_per_prompt=2, rewards_normalization=True)
    rewards = await kforge_slime.group_reward(args, samples)  # --group-rm --custom-rm-path ...group_reward
    for sample, reward in zip(samples, rewards, strict=True):
        sample.reward = reward
    print("rewards:", rewards, "post-processed:", kforge_slime.post_process_rewards(args, samples)[1])


if __name__ == "__main__":
    asyncio.run(main())  # KFORGE_BACKEND=cpu for a CPU-only kforge
