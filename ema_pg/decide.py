"""``python -m ema_pg.decide PLAN``: pre-registered claims decided by a group-sequential design, seeds added in
batches until each claim is decided or capped. The code is :mod:`ema_pg.workbench.studies.decide`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.studies.decide import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
