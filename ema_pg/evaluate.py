"""``python -m ema_pg.evaluate``: evaluate a run's policy on its task's eval splits. The code is :mod:`ema_pg.workbench.evaluate`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.evaluate import main  # noqa: E402

if __name__ == "__main__":
    main()
