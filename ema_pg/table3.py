"""``python -m ema_pg.table3``: Table 3's writer (also ``python -m ema_pg.reports table3``). The code is :mod:`ema_pg.workbench.table3`."""

from ema_pg.workbench.table3 import main

if __name__ == "__main__":
    main()
