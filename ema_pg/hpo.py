"""``python -m ema_pg.hpo``: an Optuna search over training runs (hyper-parameter optimization). The code is
:mod:`ema_pg.workbench.hpo`."""

from ema_pg.workbench.hpo import main

if __name__ == "__main__":
    raise SystemExit(main())
