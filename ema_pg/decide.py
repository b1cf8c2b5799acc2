"""``python -m ema_pg.decide PLAN``: pre-registered claims decided by a group-sequential design, seeds added in
batches until each claim is decided or capped. The code is :mod:`ema_pg.workbench.studies.decide`."""

from ema_pg.workbench.studies.decide import main

if __name__ == "__main__":
    raise SystemExit(main())
