"""``python -m ema_pg.runs``: list run folders with the settings they differ in and their scores, filter them, or
compare two. The code is :mod:`ema_pg.workbench.tracking`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.tracking import runs_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(runs_main())
