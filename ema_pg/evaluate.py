"""``python -m ema_pg.evaluate``: evaluate a run's policy on its task's eval splits. The code is :mod:`ema_pg.workbench.evaluate`."""

from ema_pg.workbench.evaluate import main

if __name__ == "__main__":
    main()
