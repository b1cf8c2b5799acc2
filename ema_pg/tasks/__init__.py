"""Environments and rewards. ``build_task(cfg.task)`` picks one by ``task.name``.

A task's knobs and their defaults have one home: its option file ``conf/task/<name>.yaml``;
the knobs every task has (``chat_template``, read by :mod:`ema_pg.prompts`, not by the task) live in
``conf/task/_common.yaml``, which each task file includes. The task classes take every knob of
their own as a required keyword; :func:`build_task` fills what a config leaves out from those
files, so ``build_task({"name": "toy_add"})`` is the default task.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from .base import Prompt, ServiceError, Task
from .math import MathTask
from .search import SearchQATask
from .toy import AdditionTask

TASKS = {"toy_add": AdditionTask, "search_qa": SearchQATask, "math": MathTask}
TASK_CONF = Path(__file__).resolve().parent.parent.parent / "conf" / "task"


def common_defaults() -> dict:
    """The knobs every task has, with their defaults (``conf/task/_common.yaml``)."""
    return OmegaConf.to_container(OmegaConf.load(TASK_CONF / "_common.yaml"), resolve=True)


def task_defaults(name: str) -> dict:
    """The knobs of task ``name`` with their defaults: ``conf/task/_common.yaml`` and ``conf/task/<name>.yaml``."""
    own = OmegaConf.to_container(OmegaConf.load(TASK_CONF / f"{name}.yaml"), resolve=True)
    own.pop("defaults", None)
    return {**common_defaults(), **own}


def task_metric(name: str) -> str:
    """The evaluation metric of task ``name`` (its class declares it), known before the task is built."""
    return TASKS[name].metric if name in TASKS else Task.metric


def build_task(cfg) -> Task:
    """Build the task named ``cfg["name"]``; knobs missing from ``cfg`` take their defaults."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    name = cfg.get("name")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    common = common_defaults()
    kw = {k: v for k, v in {**task_defaults(name), **cfg}.items()
          if k != "name" and k not in common and not k.startswith("_")}
    try:
        return TASKS[name](**kw)
    except TypeError as e:  # an unknown task knob
        raise ValueError(f"task={name}: {e}; check the task.* keys against conf/task/{name}.yaml") from None


__all__ = ["TASKS", "Prompt", "ServiceError", "Task", "build_task", "common_defaults", "task_defaults", "task_metric"]
