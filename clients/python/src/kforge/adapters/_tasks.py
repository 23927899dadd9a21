"""The kforge task a dataset row names: by its reference source, or by a task id of a task set on disk."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kforge.v1 import common_pb2


class TaskError(ValueError):
    """A dataset row names no usable kforge task (no source, or an id its task set lacks)."""


@dataclass(frozen=True)
class TaskSet:
    """Tasks by id, read from disk as the orchestrator reads a job's task set."""

    tasks: Mapping[str, str]
    origin: str = ""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TaskSet:
        """The task set at `path`, read as the orchestrator reads a job's.

        A KernelBench directory (`level<N>/<n>_<name>.py` -> `level<N>/<n>_<name>`), a `.jsonl` file of
        `{"task_id", "source"}` objects, or a directory of `<name>/task.py` (-> `examples/<name>`, the ids of the
        orchestrator's built-in `examples`).
        """
        root = Path(path)
        tasks: dict[str, str] = {}
        if root.suffix == ".jsonl":
            for number, line in enumerate(root.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if not isinstance(item, dict) or not item.get("task_id") or not item.get("source"):
                    raise TaskError(f'{root}:{number}: expected {{"task_id": ..., "source": ...}}')
                tasks[str(item["task_id"])] = str(item["source"])
        elif root.is_dir():
            for level in sorted(root.glob("level*/*.py")):
                tasks[f"{level.parent.name}/{level.stem}"] = level.read_text()
            for example in sorted(root.glob("*/task.py")):
                tasks[f"examples/{example.parent.name}"] = example.read_text()
        else:
            raise TaskError(f"{root}: not a directory or a .jsonl file")
        if not tasks:
            raise TaskError(f"{root}: holds no tasks")
        return cls(tasks, str(root))

    def get(self, task_id: str) -> common_pb2.Task:
        """The task of this id; TaskError naming the set when it has none."""
        source = self.tasks.get(task_id)
        if source is None:
            raise TaskError(f"task id {task_id!r} is not in the task set {self.origin or '(given)'}")
        return common_pb2.Task(task_id=task_id, source=source)


_TASK_SETS: dict[str, TaskSet] = {}
_TASK_SETS_LOCK = threading.Lock()


def _task_set(path: str) -> TaskSet:
    with _TASK_SETS_LOCK:
        if path not in _TASK_SETS:
            _TASK_SETS[path] = TaskSet.load(path)
        return _TASK_SETS[path]


def _looks_like_source(text: str) -> bool:
    return "\n" in text and "get_inputs" in text


def _inline_id(source: str) -> str:
    return "inline/" + hashlib.sha256(source.encode()).hexdigest()[:16]


TaskLike = common_pb2.Task | str | Mapping[str, Any]
"""A task as rows carry it: a `Task`, a reference source, a task id, or a mapping with `task_id` / `source`."""


def resolve_task(task: TaskLike, tasks: TaskSet | str | None = None) -> common_pb2.Task:
    """The kforge task `task` names.

    A `Task` is taken as is; a string holding Python source with `get_inputs` is the reference source (its id
    `inline/<hash>`); any other string is a task id looked up in `tasks` (a `TaskSet` or its path); a mapping gives
    `task_id` and/or `source` (also read as `task_source`). TaskError says what is missing.
    """
    if isinstance(task, common_pb2.Task):
        if not task.source:
            return resolve_task(task.task_id, tasks)
        return task if task.task_id else common_pb2.Task(task_id=_inline_id(task.source), source=task.source)
    if isinstance(task, str):
        text = task.strip()
        if not text:
            raise TaskError("the task is empty: give a task id or the reference source")
        if _looks_like_source(task):
            return common_pb2.Task(task_id=_inline_id(task), source=task)
        if tasks is None:
            raise TaskError(
                f"task id {text!r} needs a task set to look it up in: set KFORGE_TASKS (AdapterConfig.tasks) to a "
                "KernelBench directory, a .jsonl file or a directory of <name>/task.py, or put the source in the row"
            )
        return (_task_set(tasks) if isinstance(tasks, str) else tasks).get(text)
    source = task.get("source") or task.get("task_source")
    task_id = task.get("task_id")
    if source:
        return common_pb2.Task(task_id=str(task_id or _inline_id(str(source))), source=str(source))
    if task_id:
        return resolve_task(str(task_id), tasks)
    raise TaskError(f"the mapping names no task: expected task_id or source, got keys {sorted(task)}")


def task_from_fields(*candidates: Any, tasks: TaskSet | str | None = None) -> common_pb2.Task:
    """The task named by the first candidate that names one: a row's fields in the adapter's order of preference.

    A candidate may be None, empty, or a mapping with `task_id` / `task_source` / `source` (other keys ignored).
    """
    for candidate in candidates:
        if candidate is None or (isinstance(candidate, str) and not candidate.strip()):
            continue
        if isinstance(candidate, Mapping):
            if not any(candidate.get(key) for key in ("task_id", "task_source", "source")):
                continue
            return resolve_task(candidate, tasks)
        if isinstance(candidate, common_pb2.Task | str):
            return resolve_task(candidate, tasks)
    raise TaskError("the row names no kforge task: give task_id or task_source (or the source as the label)")
