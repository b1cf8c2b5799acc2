"""``python -m ema_pg.kl.lab``: the estimator lab from the command line. The code is
:mod:`ema_pg.workbench.estimator_lab` (the report is workbench work); this entry point is the one import of the
algorithm floor into the workbench that the layer contracts allow (pyproject.toml, ``ignore_imports``)."""

from ema_pg.workbench.estimator_lab import main

if __name__ == "__main__":
    raise SystemExit(main())
