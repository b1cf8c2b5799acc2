"""``python -m ema_pg.search``: an Optuna search over training runs. The code is :mod:`ema_pg.workbench.search`."""

from ema_pg.workbench.search import main

if __name__ == "__main__":
    raise SystemExit(main())
