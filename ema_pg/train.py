"""Training entry point.

    python -m ema_pg.train                                   # the default: EMA-PG on the toy task
    python -m ema_pg.train experiment=demo seed=1
    python -m ema_pg.train kl=k3 anchor=fixed                # GRPO baseline
    python -m ema_pg.train resume=runs/<name>/<time> algo.iterations=400   # continue a run
    python -m ema_pg.train experiment=math init_from=runs/<stage1> rollout.max_new_tokens=96 algo.iterations=400
                                                              # a stage: a new run from another's last checkpoint

``train(cfg)`` (:mod:`ema_pg.engine.fit`) returns (metrics, objects); ``main`` returns the metric an
Optuna search optimizes (the final ``eval/avg/<metric>``). Every run writes one folder: ``config.yaml``
(resolved), ``metrics.csv``, ``checkpoints/``, ``eval.json``, ``curves.png``, ``git.txt``, ``machine.txt``.
Exit codes: 0 finished, 1 failed or refused (one line says why), 75 stopped by SIGTERM after saving its checkpoint
(the same command continues it), or outside the training loop with nothing more to save.
"""

from __future__ import annotations

import sys

from .process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)
import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from .config import CONF_DIR, overrides_problem, register_configs  # noqa: E402

if __name__ != "__mp_main__":  # a rollout worker spawned from this command imports it again under that name: it
    # runs no trainer and skips Lightning, seconds at each start. Here it comes before Hydra sets up logging, so that
    # Lightning's loggers keep their own handler
    from .engine.fit import command, stop_on_sigterm_outside_training, train

__all__ = ["main", "train"]


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    with stop_on_sigterm_outside_training():  # a SIGTERM outside the training loop: one line and exit 75
        return command(cfg)


def resume_argv(argv: list[str]) -> list[str]:
    """``resume=RUN KEY=VALUE``: KEY is read against the run's saved config (:func:`ema_pg.engine.runs.
    resolve_resume`), which may hold keys the default config Hydra composes first lacks (``task.retriever_url`` of a
    search run); ``++`` lets Hydra add them there instead of refusing them. Other commands are left as they are."""
    if not any(a.startswith("resume=") for a in argv):
        return argv
    return [f"++{a}" if "=" in a and "." in a.split("=", 1)[0] and not a.startswith(("+", "~", "-", "hydra."))
            else a for a in argv]


if __name__ == "__main__":
    register_configs()  # the schema must be in Hydra's store before @hydra.main composes
    sys.argv[1:] = resume_argv(sys.argv[1:])
    problem = overrides_problem(sys.argv[1:])  # a typo is one line naming the nearest key, before Hydra's report
    if problem:
        raise SystemExit(f"config error: {problem}")
    main()
