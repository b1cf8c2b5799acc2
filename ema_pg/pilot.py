"""``python -m ema_pg.pilot PLAN``: a pilot that picks what a decision plan will be asked on, by a rule registered
before its first run and applied to its ledger. The code is :mod:`ema_pg.workbench.studies.pilot`."""

from ema_pg.workbench.studies.pilot import main

if __name__ == "__main__":
    raise SystemExit(main())
