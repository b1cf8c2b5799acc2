"""``python -m ema_pg.hpo``: an Optuna search over training runs (hyper-parameter optimization). The code is
:mod:`ema_pg.workbench.hpo`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.hpo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
