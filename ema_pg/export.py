"""``python -m ema_pg.export``: export a run's policy (or its anchor) as a Hugging Face model folder. The code is :mod:`ema_pg.workbench.export`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.export import main  # noqa: E402

if __name__ == "__main__":
    main()
