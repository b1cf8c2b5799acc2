"""``python -m ema_pg.reports``: the report of a finished sweep. The code is :mod:`ema_pg.workbench.reports`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.reports import main  # noqa: E402

if __name__ == "__main__":
    main()
