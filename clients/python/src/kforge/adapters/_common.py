"""What the trainer adapters share, one module per concern, re-exported here for the adapters to import.

- `AdapterConfig`: where the orchestrator is and how episodes are run, from `KFORGE_*` environment variables or
  given; every adapter takes one.
- `TaskSet` and `resolve_task`: the kforge task a dataset row names, by its reference source or by a task id of a
  task set on disk (a KernelBench directory, a `.jsonl` file, a directory of `<name>/task.py`).
- `answer_text` turns a bare kernel into a response in the recipe's shape; `feedback_text` an observation into
  the message a model reads after a step.
- `KernelOutcome`: one sample's result, or its error, as flat scalars for a trainer's logs.
- `Scorer`: one response scored as a one-turn episode (StartEpisode, Step), alone or as a batch whose failed
  samples are recorded, not raised.
- `run_token_episode`: a whole multi-turn episode at the token level (prompt, response tokens with their loss mask
  and log-probabilities), for trainers that let an adapter drive generation (verl's agent loop, slime).
"""

from kforge.adapters._config import (
    ENV_ADDRESS,
    ENV_ORCHESTRATOR,
    AdapterConfig,
    EpisodeReward,
    PromptSource,
    start_kwargs,
)
from kforge.adapters._outcomes import KernelOutcome, aggregate_rewards
from kforge.adapters._scoring import ClientPool, Scorer, gather_limited
from kforge.adapters._tasks import TaskError, TaskLike, TaskSet, resolve_task, task_from_fields
from kforge.adapters._texts import answer_text, feedback_text, response_text, verdict_name
from kforge.adapters._tokens import Generate, Generation, Tokenizer, TokenTrajectory, chat_delta_ids, run_token_episode

__all__ = [
    "ENV_ADDRESS",
    "ENV_ORCHESTRATOR",
    "AdapterConfig",
    "ClientPool",
    "EpisodeReward",
    "Generate",
    "Generation",
    "KernelOutcome",
    "PromptSource",
    "Scorer",
    "TaskError",
    "TaskLike",
    "TaskSet",
    "TokenTrajectory",
    "Tokenizer",
    "aggregate_rewards",
    "answer_text",
    "chat_delta_ids",
    "feedback_text",
    "gather_limited",
    "resolve_task",
    "response_text",
    "run_token_episode",
    "start_kwargs",
    "task_from_fields",
    "verdict_name",
]
