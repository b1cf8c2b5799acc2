"""Composition: the config that ``python -m ema_pg.train <overrides>`` runs (:func:`compose`, outside a Hydra app
too), the schema and the installed packages' tasks in Hydra's store (:func:`register_configs`), and the command
line's typos in one line each (:func:`overrides_problem`)."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ..cli import PACKAGE_ROOT
from .schema import Config

log = logging.getLogger("ema_pg")

CONF_DIR = PACKAGE_ROOT / "conf"


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {"dotted.key": value}; lists become their string form (comparable, one column)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v) if isinstance(v, list) else v
    return out


_SHADOWED: set[str] = set()  #: installed tasks named like ema-pg's own, said once per process


def register_configs() -> None:
    """The schema, and an option of the task group for each installed package's task (entry points of
    ``ema_pg.tasks``): ``task=NAME`` composes its class's keyword defaults as if they were ``conf/task/NAME.yaml``."""
    from ..tasks import TASKS, TaskError, task_defaults
    from ..tasks.plugins import entry_point_tasks

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name in entry_point_tasks():
        if name in TASKS or (CONF_DIR / "task" / f"{name}.yaml").is_file():
            if name not in _SHADOWED:  # a package cannot replace a task of ema-pg's own (build_task takes ours)
                _SHADOWED.add(name)
                log.warning("the installed entry point task %s (%s) has the name of ema-pg's own task, which task=%s "
                            "runs; rename it in its package's entry points to run it", name,
                            entry_point_tasks()[name].value, name)
            continue
        try:
            cs.store(group="task", name=name, node=task_defaults(name))
        except TaskError:
            continue  # a broken entry point is named when it is chosen (build_task), not when another task runs


def compose(overrides: list[str] | tuple = (), config_name: str = "config", config_dir: str | Path | None = None):
    """The config that ``python -m ema_pg.train <overrides>`` would run (outside a Hydra app).

    The one composition function of the project: evaluate, the Optuna search, benchmarks and
    tests all use it. ``run_dir`` interpolates Hydra's output folder and stays unresolved.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(str(Path(config_dir or CONF_DIR).resolve()), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def overrides_problem(overrides: list[str]) -> str | None:
    """What is wrong with a run's command-line overrides, in one line that says what to change; None when they
    compose (or are a sweep's, or carry Hydra's own flags: Hydra reads those itself). Hydra's own report of a typo is
    several lines and advises ``+key=value``, which would add the misspelt key."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if any(o.startswith(("-", "resume=")) for o in overrides):
        return None
    overrides = [o for o in overrides if not o.startswith("hydra.")]  # Hydra's own settings: its to check
    try:
        compose(overrides)
        return None
    except MissingConfigException as e:
        group, _, option = str(e.missing_cfg_file or "").rpartition("/")
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_")) if group else []
        if group == "task":  # the installed packages' tasks are options too; a broken one says why it is not
            from ..tasks import TaskError, task_defaults
            from ..tasks.plugins import entry_point_tasks

            eps = entry_point_tasks()
            if option in eps:
                try:
                    task_defaults(option)
                except TaskError as err:
                    return str(err)
            options = sorted({*options, *(n for n in eps if n not in options)})
        if not options:
            return str(e).splitlines()[0]
        if near := difflib.get_close_matches(option, options, n=1):
            return f"{group}={option}: no such option; did you mean {group}={near[0]}? (the options: {', '.join(options)})"
        return f"{group}={option}: no such option; choose one of: {', '.join(options)}"
    except ConfigCompositionException as e:
        cause = e.__cause__
        if isinstance(cause, ConfigAttributeError | ConfigKeyError):
            key = str(cause.full_key)
            rest = [o for o in overrides if not f"{o.split('=', 1)[0].lstrip('+~')}.".startswith(f"{key}.")]
            parent, _, leaf = key.rpartition(".")
            try:
                node = OmegaConf.select(compose(rest), parent) if parent else compose(rest)
            except Exception:  # noqa: BLE001 - another override is wrong too: name this one without a guess
                node = None
            if parent == "task" and isinstance(node, DictConfig) and (plus := _class_knob(node, leaf)):
                return plus
            near = difflib.get_close_matches(leaf, [str(k) for k in node], n=1) if isinstance(node, DictConfig) else []
            hint = f"did you mean {parent + '.' if parent else ''}{near[0]}? " if near else ""
            return f"unknown key {key}: {hint}remove it"
        if isinstance(cause, ValidationError):
            return f"{cause.full_key}: {str(cause).splitlines()[0]}"
        return None  # a sweep's value without -m (Hydra says so) and anything else Hydra reports itself


def _class_knob(task, leaf: str) -> str | None:
    """The advice for ``task.<leaf>=...`` where ``leaf`` is a knob of the task's own class that no option file declares
    (``task=custom``): the override takes a leading ``+``. None where it is not such a knob."""
    from ..tasks import task_defaults

    try:
        knobs = task_defaults(str(task.get("name")), task.get("target"))
    except Exception:  # noqa: BLE001 - a class that cannot be found is named where the task is built
        return None
    if leaf not in knobs:
        near = difflib.get_close_matches(leaf, [k for k in knobs if k not in task], n=1)
        return f"unknown key task.{leaf}: did you mean +task.{near[0]}? remove it" if near else None
    where = task.get("target") or task.get("name")
    return (f"task.{leaf} is a knob of {where} that no option file declares: give it with a leading +, "
            f"+task.{leaf}=...")
