"""``python -m ema_pg.pilot PLAN``: a pilot that picks what a decision plan will be asked on, by a rule registered
before its first run and applied to its ledger. The code is :mod:`ema_pg.workbench.studies.pilot`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.studies.pilot import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
