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
(the same command continues it).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .config import CONF_DIR, register_configs
from .engine.fit import command, train

__all__ = ["main", "train"]


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return command(cfg)


if __name__ == "__main__":
    register_configs()  # the schema must be in Hydra's store before @hydra.main composes
    main()
