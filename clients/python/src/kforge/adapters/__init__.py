"""Adapters of kforge to LLM-RL trainers: thin layers over the orchestrator's Step API.

One module per trainer, each importable without its trainer installed (the trainer's own classes are imported
only where an adapter subclasses them):

- `kforge.adapters.verl`: `compute_score` for `reward.custom_reward_function`; `KforgeAgentLoop`, an agent loop.
- `kforge.adapters.trl`: `KforgeEnvironment` for `GRPOTrainer(environment_factory=...)`; `kernel_reward`.
- `kforge.adapters.openrlhf`: the remote reward server (`/get_reward`), `reward_func`, an `AgentExecutor`.
- `kforge.adapters.slime`: `reward`, `group_reward`, `post_process_rewards` and a custom `generate`.
- `kforge.adapters.skyrl`: `KforgeTextEnv`, a `skyrl_gym` `BaseTextEnv`, and `register`.
- `kforge.adapters.nemo_rl`: `KforgeEnvironment`, NeMo RL's `EnvironmentInterface` shape, batched.

What they share (`kforge.adapters._common`): `AdapterConfig` (read from `KFORGE_*` variables), task lookup,
`KernelOutcome` (one sample's result or error) and `Scorer` (a response scored as a one-turn episode).
"""

from kforge.adapters._common import AdapterConfig, KernelOutcome, Scorer, TaskError, TaskSet, answer_text

__all__ = ["AdapterConfig", "KernelOutcome", "Scorer", "TaskError", "TaskSet", "answer_text"]
