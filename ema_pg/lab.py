"""``python -m ema_pg.lab``: the KL-estimator conformance lab's report and verdicts. The code is
:mod:`ema_pg.workbench.lab`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.lab.report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
