"""The file `reward.custom_reward_function.path` names: verl loads `compute_score` from it."""

from kforge.adapters.verl import compute_score

__all__ = ["compute_score"]
