"""``python -m ema_pg.table3``: Table 3's writer (also ``python -m ema_pg.reports table3``). The code is :mod:`ema_pg.workbench.table3`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.table3 import main  # noqa: E402

if __name__ == "__main__":
    main()
