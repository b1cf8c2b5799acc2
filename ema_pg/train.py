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
"""

from __future__ import annotations

import logging
import os

import hydra
from omegaconf import DictConfig

from .config import CONF_DIR, ConfigError, register_configs
from .engine.fit import train
from .engine.models import ModelPathError
from .engine.runs import RUN_DIR_ENV, is_rank_zero
from .step import NonFiniteUpdates
from .tasks import ServiceError

__all__ = ["main", "train"]
log = logging.getLogger("ema_pg")

@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        metrics, objs = train(cfg)
    except (ConfigError, ModelPathError) as e:
        log.error("config error: %s", e)
        raise SystemExit(f"config error: {e}") from None
    except (NonFiniteUpdates, ServiceError) as e:
        log.error("stopped: %s", e)
        run = os.environ.get(RUN_DIR_ENV, "<run folder>")
        raise SystemExit(f"stopped: {e}; the run folder keeps its last checkpoint: continue with "
                         f"python -m ema_pg.train resume={run}") from None
    metric_key = next(k for k in metrics if k.startswith("eval/avg/"))
    if not is_rank_zero():
        return float(metrics[metric_key])
    print(f"run folder: {objs['run_dir']}\nmetrics:    {objs['run_dir'] / 'metrics.csv'}\nplot:       {objs['plot']}")
    print(f"final {metric_key} = {metrics[metric_key]:.3f} (base policy: {metrics['base/avg']:.3f})")
    return float(metrics[metric_key])


if __name__ == "__main__":
    register_configs()  # the schema must be in Hydra's store before @hydra.main composes
    main()
