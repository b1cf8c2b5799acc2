"""``python -m ema_pg.lab``: the KL-estimator conformance lab's report and verdicts. The code is
:mod:`ema_pg.workbench.lab`."""

from ema_pg.workbench.lab.report import main

if __name__ == "__main__":
    raise SystemExit(main())
