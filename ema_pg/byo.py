"""``python -m ema_pg.byo``: write the bring-your-own examples of docs/byo.md. The code is :mod:`ema_pg.workbench.byo`."""

from ema_pg.workbench.byo import main

if __name__ == "__main__":
    main()
