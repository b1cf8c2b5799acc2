"""``python -m ema_pg.lab`` (or ``python -m ema_pg lab``): the estimator lab from the command line
(:mod:`.report`)."""

from .report import main

if __name__ == "__main__":
    raise SystemExit(main())
