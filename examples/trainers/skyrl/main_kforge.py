"""A SkyRL entrypoint that registers the kforge environment before training (run it as SkyRL's main module).

    python examples/trainers/skyrl/main_kforge.py environment.env_class=kforge generator.max_turns=4 ...

Without SkyRL's trainer installed it runs one episode with a scripted answer instead, against `kforge up`.
"""

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from kforge.adapters import answer_text
from kforge.adapters.skyrl import KforgeTextEnv, register

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"


def scripted_episode() -> None:
    """What SkyRL's generator does with one row, with a fixed response instead of a model's."""
    env = KforgeTextEnv({"backend": "cpu", "turns": 1}, {"task_source": (TASK / "task.py").read_text()})
    prompt, metadata = env.init([])
    print(metadata, prompt[-1]["content"][:200])
    step = env.step(answer_text(next((TASK / "candidates").glob("*.py")).read_text()))
    print(step["reward"], step["done"], step["metadata"]["verdict"])
    env.close()


def train() -> None:
    """SkyRL's own entrypoint (as its multiply example), registering the environment in the Ray entrypoint task."""
    ray, hydra = importlib.import_module("ray"), importlib.import_module("hydra")
    main_base = importlib.import_module("skyrl.train.entrypoints.main_base")
    initialize_ray = importlib.import_module("skyrl.train.utils").initialize_ray

    def entrypoint(cfg: Any) -> None:
        register()  # skyrl_gym.envs.register(id="kforge", entry_point="kforge.adapters.skyrl:KforgeTextEnv")
        main_base.BasePPOExp(cfg).run()

    remote_entrypoint = ray.remote(num_cpus=1)(entrypoint)

    def main(cfg: Any) -> None:
        main_base.validate_cfg(cfg)
        initialize_ray(cfg)
        ray.get(remote_entrypoint.remote(cfg))

    hydra.main(config_path=main_base.config_dir, config_name="ppo_base_config", version_base=None)(main)()


if __name__ == "__main__":
    train() if importlib.util.find_spec("skyrl") and len(sys.argv) > 1 else scripted_episode()
