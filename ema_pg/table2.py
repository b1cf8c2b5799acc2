"""``python -m ema_pg.table2``: Table 2's writer (also ``python -m ema_pg.reports table2``). The code is :mod:`ema_pg.workbench.table2`."""

from ema_pg.workbench.table2 import main

if __name__ == "__main__":
    main()
