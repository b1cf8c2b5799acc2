"""Environments and rewards. ``build_task(cfg.task)`` picks one by ``task.name``."""

from __future__ import annotations

from .base import Prompt, Task
from .search import SearchQATask
from .toy import AdditionTask

TASKS = {"toy_add": AdditionTask, "search_qa": SearchQATask}


def build_task(cfg) -> Task:
    """Build the task named ``cfg.name`` with the rest of ``cfg`` as keyword arguments."""
    kw = {k: v for k, v in dict(cfg).items() if k not in ("name", "system") and not k.startswith("_")}
    name = cfg["name"]
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    try:
        return TASKS[name](**kw)
    except TypeError as e:  # an unknown task knob
        raise ValueError(f"task={name}: {e}; check the task.* keys against conf/task/{name}.yaml") from None


__all__ = ["TASKS", "Prompt", "Task", "build_task"]
