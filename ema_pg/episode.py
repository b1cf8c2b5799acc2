"""``python -m ema_pg.episode``: one episode of a run's task, with its spans' loss masks and its reward. The code is
:mod:`ema_pg.workbench.episode`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.episode import main  # noqa: E402

if __name__ == "__main__":
    main()
