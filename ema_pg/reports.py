"""``python -m ema_pg.reports``: the report of a finished sweep. The code is :mod:`ema_pg.workbench.reports`."""

from ema_pg.workbench.reports import main

if __name__ == "__main__":
    main()
