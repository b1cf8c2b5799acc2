"""``python -m ema_pg.reproduce``: one command per reproduction: its sweep, then its report. The code is :mod:`ema_pg.workbench.reproduce`."""

from ema_pg.workbench.reproduce import main

if __name__ == "__main__":
    raise SystemExit(main())
