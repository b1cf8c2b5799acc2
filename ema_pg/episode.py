"""``python -m ema_pg.episode``: one episode of a run's task, with its spans' loss masks and its reward. The code is
:mod:`ema_pg.workbench.episode`."""

from ema_pg.workbench.episode import main

if __name__ == "__main__":
    main()
