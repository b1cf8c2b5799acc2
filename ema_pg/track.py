"""``python -m ema_pg.track import DIR``: send run folders to a tracker (wandb, MLflow, TensorBoard). The code is
:mod:`ema_pg.workbench.tracking`."""

from ema_pg.process import command_start

command_start()  # before torch loads: what MKL and OpenMP read as they start (ema_pg/process.py)

from ema_pg.workbench.tracking import track_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(track_main())
