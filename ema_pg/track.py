"""``python -m ema_pg.track import DIR``: send run folders to a tracker (wandb, MLflow, TensorBoard). The code is
:mod:`ema_pg.workbench.tracking`."""

from ema_pg.workbench.tracking import track_main

if __name__ == "__main__":
    raise SystemExit(track_main())
