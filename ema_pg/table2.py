"""``python -m ema_pg.table2``: Table 2's writer (also ``python -m ema_pg.reports table2``). The code is :mod:`ema_pg.workbench.table2`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.table2 import main  # noqa: E402

if __name__ == "__main__":
    main()
