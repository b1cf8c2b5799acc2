"""``python -m ema_pg.evaluate``: evaluate a run's policy on its task's eval splits. The code is :mod:`ema_pg.engine.evaluate`."""

from ema_pg.engine.evaluate import main

if __name__ == "__main__":
    main()
