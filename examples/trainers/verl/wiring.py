"""What verl's reward loop does with `compute_score`, against a running `kforge up` (CPU backend).

kforge up &  python examples/trainers/verl/wiring.py
"""

import asyncio
from pathlib import Path

from kforge.adapters import answer_text
from kforge.adapters.verl import compute_score

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"


async def main() -> None:
    """Runs the example."""
    source = (TASK / "task.py").read_text()
    kernel = next((TASK / "candidates").glob("*.py")).read_text()
    for name, response in [("correct", answer_text(kernel)), ("no kernel", "I cannot do it.")]:
        # As NaiveRewardManager calls it: the row's ground truth is the task's source (or a task id of KFORGE_TASKS).
        result = await compute_score("kforge", response, source, extra_info={"index": 0}, backend="cpu")
        print(f"{name}: {result}")


if __name__ == "__main__":
    asyncio.run(main())
