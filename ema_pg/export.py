"""``python -m ema_pg.export``: export a run's policy (or its anchor) as a Hugging Face model folder. The code is :mod:`ema_pg.workbench.export`."""

from ema_pg.workbench.export import main

if __name__ == "__main__":
    main()
