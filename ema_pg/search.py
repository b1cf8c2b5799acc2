"""``python -m ema_pg.search``: the earlier name of ``python -m ema_pg.hpo`` (the Optuna search), kept so that
existing scripts run; "search" is the search task's word (``ema_pg.tasks.search``)."""

from ema_pg.workbench.hpo import main

if __name__ == "__main__":
    raise SystemExit(main())
