"""A NeMo RL driver that registers the kforge environment before the data and environments are set up.

    uv run examples/trainers/nemo_rl/run_grpo_kforge.py --config examples/trainers/nemo_rl/grpo_kforge.yaml

Without NeMo RL installed it steps one batch with scripted responses instead, against `kforge up`.
"""

import importlib.util
from pathlib import Path

from kforge.adapters import answer_text
from kforge.adapters.nemo_rl import KforgeEnvironment, register

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"


def scripted_batch() -> None:
    """One batched step as NeMo RL's rollout makes it: two samples, one naming no task."""
    kernel = next((TASK / "candidates").glob("*.py")).read_text()
    environment = KforgeEnvironment({"backend": "cpu", "turns": 1})
    logs = [[{"role": "assistant", "content": answer_text(kernel)}]] * 2
    result = environment.step(logs, [{"task_source": (TASK / "task.py").read_text()}, {}])
    print(result.rewards, result.terminateds, [o["content"][:80] for o in result.observations])
    print(environment.global_post_process_and_metrics({})[1])


def train() -> None:
    """NeMo RL's GRPO example driver, after registering `kforge` (ENV_REGISTRY and the actor registry)."""
    register()
    runpy = importlib.import_module("runpy")
    runpy.run_module("examples.run_grpo", run_name="__main__")  # NeMo RL's driver, from its repository root


if __name__ == "__main__":
    train() if importlib.util.find_spec("nemo_rl") else scripted_batch()
