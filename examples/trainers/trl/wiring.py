"""What GRPOTrainer does with `KforgeEnvironment`, against a running `kforge up` (CPU backend), without a model.

kforge up &  python examples/trainers/trl/wiring.py

In training: `GRPOTrainer(model=..., train_dataset=dataset, environment_factory=environment_factory(config),
reward_funcs=[], args=GRPOConfig(...))`, each row with a `task_source` (or `task_id`) column.
"""

import asyncio
from pathlib import Path

from kforge.adapters import AdapterConfig
from kforge.adapters.trl import environment_factory

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"


async def main() -> None:
    """Runs the example."""
    make = environment_factory(AdapterConfig.from_env(backend="cpu", turns=2))
    environment = make()  # TRL keeps a pool of these and resets one per rollout
    row = {"prompt": [{"role": "user", "content": ""}], "task_source": (TASK / "task.py").read_text()}
    print(environment.reset(**row))  # appended to the row's last user message
    kernel = next((TASK / "candidates").glob("*.py")).read_text()
    print(await environment.submit_kernel(kernel.replace("? in[i] : 0.0f", "? 0.0f : in[i]")))  # a tool call
    print(await environment.submit_kernel(kernel))
    print("reward:", await environment.get_reward())


if __name__ == "__main__":
    asyncio.run(main())
