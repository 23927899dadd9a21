"""The file `--train.agent_func_path` names: OpenRLHF makes its `AgentExecutor` with no arguments.

kforge's configuration comes from `KFORGE_*` variables in the Ray workers' environment.
"""

from kforge.adapters.openrlhf import agent_executor_class

AgentExecutor = agent_executor_class()
