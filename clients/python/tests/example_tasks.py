"""The repository's example tasks (`examples/tasks/<name>/`) and their shipped candidates."""

from __future__ import annotations

from kforge_mesh import REPO

from kforge.v1 import common_pb2

EXAMPLES = REPO / "examples" / "tasks"


def example_task(name: str) -> common_pb2.Task:
    """The example task `examples/tasks/<name>`."""
    return common_pb2.Task(task_id=f"examples/{name}", source=(EXAMPLES / name / "task.py").read_text())


def example_candidate(name: str) -> str:
    """The source of the example task's one shipped candidate."""
    (candidate,) = (EXAMPLES / name / "candidates").glob("*.py")
    return candidate.read_text()
