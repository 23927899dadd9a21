"""The file `--reward.remote_url` may name instead of a server: OpenRLHF calls its `reward_func`."""

from kforge.adapters.openrlhf import reward_func

__all__ = ["reward_func"]
