"""``python -m ema_pg.reproduce``: one command per reproduction: its sweep, then its report. The code is :mod:`ema_pg.workbench.reproduce`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.reproduce import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
