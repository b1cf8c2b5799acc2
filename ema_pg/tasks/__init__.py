"""Environments and rewards. ``build_task(task)`` picks one by ``task["name"]`` (a run hands it its task group as a
plain dict: ``ema_pg.config.task_record``).

A task's knobs and their defaults have one home: its option file ``conf/task/<name>.yaml``;
the knobs every task has (``chat_template``, read by :mod:`ema_pg.prompts`, not by the task) live in
``conf/task/_common.yaml``, which each task file includes. The task classes take every knob of
their own as a required keyword; :func:`build_task` fills what a config leaves out from those
files, so ``build_task({"name": "toy_add"})`` is the default task.

Tasks from outside the package (:mod:`ema_pg.tasks.plugins`): ``task=custom task.target=my_pkg.envs:MyTask``, or
an installed package's entry point in the group ``ema_pg.tasks``; their knobs and defaults are the class's keyword
parameters.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from ..cli import PACKAGE_ROOT
from .base import Prompt, ServiceError, Task
from .env import Environment, Step
from .math import MathTask
from .reasoning_gym import ReasoningGymTask
from .text_env import TextEnvTask
from .plugins import CUSTOM, TaskError, class_knobs, plugin_class
from .search import SearchQATask
from .toy import AdditionTask

TASKS = {"toy_add": AdditionTask, "search_qa": SearchQATask, "math": MathTask, "reasoning_gym": ReasoningGymTask,
         "text_env": TextEnvTask}
TASK_CONF = PACKAGE_ROOT / "conf" / "task"


def common_defaults() -> dict:
    """The knobs every task has, with their defaults (``conf/task/_common.yaml``)."""
    return OmegaConf.to_container(OmegaConf.load(TASK_CONF / "_common.yaml"), resolve=True)


def task_class(name: str, target: str | None = None) -> type[Task]:
    """The class of task ``name``: one of :data:`TASKS`, an installed package's entry point, or (``custom``) the
    class at ``target``; a ValueError names the choices."""
    if name in TASKS:
        return TASKS[name]
    try:
        return plugin_class(name, target)
    except KeyError:
        from .plugins import entry_point_tasks

        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join([*TASKS, *entry_point_tasks(), CUSTOM])} "
                         "(custom: task.target=my_pkg.envs:MyTask)") from None


def task_defaults(name: str, target: str | None = None) -> dict:
    """The knobs of task ``name`` with their defaults: ``conf/task/_common.yaml`` and ``conf/task/<name>.yaml``; for
    a task from outside the package, the class's keyword parameters (and ``target`` for ``custom``)."""
    path = TASK_CONF / f"{name}.yaml"
    if name in TASKS or path.is_file():  # custom's file holds name and target; its class adds its knobs below
        own = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        own.pop("defaults", None)
    else:
        own = {"name": name}
    if name not in TASKS and (name != CUSTOM or target not in (None, "???")):
        own = {**own, **({"target": target} if name == CUSTOM else {}), **class_knobs(task_class(name, target))}
    return {**common_defaults(), **own}


def task_metric(name: str, target: str | None = None) -> str:
    """The evaluation metric of task ``name`` (its class declares it), known before the task is built."""
    try:
        return task_class(name, target).metric
    except ValueError:
        return Task.metric


def build_task(cfg) -> Task:
    """Build the task named ``cfg["name"]``; knobs missing from ``cfg`` take their defaults."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    name, target = cfg.get("name"), cfg.get("target")
    cls = task_class(name, target)
    common = common_defaults()
    kw = {k: v for k, v in {**task_defaults(name, target), **cfg}.items()
          if k not in ("name", "target") and k not in common and not k.startswith("_")}
    where = f"conf/task/{name}.yaml" if name in TASKS else f"the parameters of {cls.__module__}.{cls.__name__}"
    if missing := [k for k, v in kw.items() if v == "???"]:
        raise ValueError(f"task={name} needs {', '.join(f'task.{k}' for k in missing)} (no default in {where}); "
                         f"give {'them' if len(missing) > 1 else 'it'}, e.g. +task.{missing[0]}=VALUE")
    try:
        task = cls(**kw)
    except TypeError as e:  # an unknown task knob
        raise ValueError(f"task={name}: {e}; check the task.* keys against {where}") from None
    except (ValueError, ServiceError):
        raise
    except Exception as e:  # noqa: BLE001 - a task from outside the package fails to start: one line naming it
        if name in TASKS:
            raise
        raise TaskError(f"task={name}: {cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kw.items())}) raised "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if name not in TASKS:
        task.name = task.name or name
    return task


__all__ = ["TASKS", "Environment", "Prompt", "ServiceError", "Step", "Task", "TaskError", "build_task",
           "common_defaults", "task_class", "task_defaults", "task_metric"]
