"""Tasks from outside this package: a class by import path, or an installed package's entry point.

Two ways to bring a task class without editing ema-pg (docs/byo.md, "Your own task"):

- ``task=custom task.target=my_pkg.envs:MyTask +task.size=3``: the class at an import path, its knobs after ``+``
  (Hydra's rule for keys that no option file declares);
- an entry point in the group ``ema_pg.tasks`` of an installed package (``[project.entry-points."ema_pg.tasks"]``,
  ``my_task = "my_pkg.envs:MyTask"``): then ``task=my_task task.size=3``, with the class's keyword defaults as its
  option file (:func:`ema_pg.config.register_configs` puts one in Hydra's store for each).

A task class subclasses :class:`ema_pg.tasks.Task` and takes its knobs as keyword arguments. :func:`check_task`
checks at start-up, before any model is built, that it has what the run needs (:func:`required_methods`) and that
its reward is a number; each problem is one line naming the class and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import inspect
from importlib.metadata import entry_points

from .base import Prompt, Task, TaskError, bad_prompt, checked_reward, sampled
from .env import ENV_METHODS, Environment

log = logging.getLogger("ema_pg")
OVERLAP_PROBE = 64  #: training prompts a task from outside draws at start to compare with its evaluation splits
GROUP = "ema_pg.tasks"  #: the entry-point group an installed package lists its tasks in
CUSTOM = "custom"  #: ``task=custom``: the class at ``task.target``
#: what every task has; what a tiny policy trained from scratch needs besides (its tokenizer's text; its SFT data)
ALWAYS = ("sample", "eval_splits", "reward")
COLD_START = ("corpus",)
SFT = ("demonstrations",)


def entry_point_tasks() -> dict:
    """The installed packages' tasks by name: {name: EntryPoint} of the group ``ema_pg.tasks``."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_target(target: str, where: str = "task.target") -> type[Task]:
    """The task class at ``target`` (``module:Class`` or ``module.Class``); one line if it cannot be had."""
    if not isinstance(target, str) or not target.strip() or target == "???":
        raise TaskError(f"{where} is not set; give the class as {where}=my_pkg.envs:MyTask")
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    if not module or not attr:
        raise TaskError(f"{where}={target!r} is not an import path; write it as my_pkg.envs:MyTask")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TaskError(f"{where}={target}: cannot import {module} ({e}); install its package (pip install -e "
                        "PATH) or put its folder on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module fails on import: name it and its error, in one line
        raise TaskError(f"{where}={target}: importing {module} raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}; fix that module") from None
    except (SystemExit, KeyboardInterrupt) as e:  # sys.exit or an interrupt raised by the module's own code
        what = f"SystemExit({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__
        raise TaskError(f"{where}={target}: importing {module} raised {what}: a module ends no process at import; "
                        "fix that module") from None
    cls = getattr(mod, attr, None)
    if cls is None:
        near = [n for n in dir(mod) if isinstance(getattr(mod, n), type) and issubclass(getattr(mod, n), Task)
                and getattr(mod, n) is not Task]
        raise TaskError(f"{where}={target}: {module} has no {attr}"
                        + (f"; its task classes: {', '.join(near)}" if near else ""))
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"{where}={target} is not a task class; subclass ema_pg.tasks.Task "
                        f"(class {attr}(Task): ...)")
    return cls


def plugin_class(name: str, target: str | None = None) -> type[Task]:
    """The class of task ``name`` from outside the package: ``custom`` with its ``target``, or an entry point."""
    if name == CUSTOM:
        return load_target(target)
    eps = entry_point_tasks()
    if name not in eps:
        raise KeyError(name)
    return load_target(eps[name].value, where=f"the entry point {name} ({GROUP})")


def class_knobs(cls: type) -> dict:
    """A task class's knobs with their defaults (``???`` where required): its ``__init__``'s keyword parameters, or,
    for a class with many knobs, the fields of the dataclass it names as ``Knobs`` (its ``__init__(**knobs)`` builds
    that record)."""
    knobs = getattr(cls, "Knobs", None)
    if dataclasses.is_dataclass(knobs):
        return {f.name: "???" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                else f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(knobs)}
    out = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[p.name] = "???" if p.default is p.empty else p.default
    return out


def required_methods(cold_start: bool, sft: bool) -> tuple[str, ...]:
    """The methods a run needs of its task: ``sample``, ``eval_splits`` and ``reward`` always; ``corpus`` when a
    tiny policy is built from scratch (no ``model.path``: its tokenizer is trained on that text); and
    ``demonstrations`` when that policy gets a cold start (``sft.steps`` > 0)."""
    return ALWAYS + (COLD_START if cold_start else ()) + (SFT if cold_start and sft else ())


def missing_line(task: Task, missing: list[str]) -> str:
    """The line that refuses a task without methods the run needs, the useful fix first: a task that runs with a
    model of one's own and lacks only a tiny policy's corpus or demonstrations is told to use one (ema-pg's own task
    classes get nothing else: their code is not the user's to write); a missing method every run needs, to write it."""
    cls = type(task)
    name, it = task.name or cls.__name__, "them" if len(missing) > 1 else "it"
    own = "model=local model.path=DIR sft.steps=0 (python -m ema_pg.byo writes a small one: examples/byo/model)"
    if set(missing) & {*ALWAYS, *ENV_METHODS}:
        return f"task {name} ({cls.__module__}.{cls.__name__}) does not define {', '.join(missing)}; write {it} in the class"
    if cls.__module__.startswith("ema_pg."):
        return (f"task {name} gives no {' or '.join(missing)} to train a tiny policy from scratch on: use your own "
                f"model, {own}")
    first = ("use your own model, " + own if "corpus" in missing else
             "start without the cold start, sft.steps=0, or from your own model, " + own)
    return (f"task {name} ({cls.__module__}.{cls.__name__}) does not define {', '.join(missing)}, which a tiny policy "
            f"trained from scratch needs: {first}; or write {it} in the class")


def check_task(task: Task, cold_start: bool, sft: bool) -> None:
    """What a run needs of its task, checked before any model is built: each required method written by the class
    (not :class:`Task`'s placeholder), prompts to train and evaluate on, and a float reward on a few of them."""
    cls = type(task)
    missing = [m for m in required_methods(cold_start, sft) if getattr(cls, m) is getattr(Task, m)]
    if issubclass(cls, Environment):
        missing += [m for m in ENV_METHODS if getattr(cls, m) is getattr(Environment, m)]
        if not isinstance(task.turn_end, str) or not task.turn_end:
            raise TaskError(f"task {task.name or cls.__name__} ({cls.__module__}.{cls.__name__}): turn_end is "
                            f"{task.turn_end!r}; give the text that ends a policy turn, turn_end = \"</guess>\" on "
                            "the class (the sampler pauses each row there for its step)")
    if missing:
        raise TaskError(missing_line(task, missing))
    try:
        probe = sampled(task, 2, 0)
        evals = task.eval_splits()
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming the method and its error
        raise TaskError(f"task {task.name or cls.__name__}: {cls.__name__}.sample or .eval_splits raised "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not probe or not all(isinstance(p, Prompt) for p in probe):
        raise TaskError(f"task {task.name or cls.__name__}: {cls.__name__}.sample(2, seed=0) returned "
                        f"{type(probe).__name__} {str(probe)[:60]}; return a list of ema_pg.tasks.Prompt")
    if not isinstance(evals, dict) or not evals or not all(v and all(isinstance(p, Prompt) for p in v)
                                                           for v in evals.values()):
        raise TaskError(f"task {task.name or cls.__name__}: {cls.__name__}.eval_splits() must return "
                        "{split name: [Prompt, ...]} with at least one prompt in each split")
    for where, ps in [("sample(2, seed=0)", probe), *((f"eval_splits()[{k!r}]", v) for k, v in evals.items())]:
        for p in ps:
            if why := bad_prompt(p):
                raise TaskError(f"task {task.name or cls.__name__}: {cls.__name__}.{where} gave a prompt whose {why}")
    for p in probe:
        for response in ("", p.answer):
            checked_reward(task, p, response)
    if not cls.__module__.startswith("ema_pg."):  # a task from outside: its splits held out from its training?
        trained = {p.text for p in (task.train_set or sampled(task, OVERLAP_PROBE, 0))}
        for split, ps in evals.items():
            if seen := sum(p.text in trained for p in ps):
                log.warning("task %s: %d of the %d prompts of its evaluation split %s are among its training prompts "
                            "(%s): that split measures recall, not generalization; hold them out in %s.eval_splits",
                            task.name or cls.__name__, seen, len(ps), split,
                            "its train_set" if task.train_set else f"sample({OVERLAP_PROBE}, seed=0)", cls.__name__)
