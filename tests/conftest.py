"""tests/ has one folder per floor of the package (README, "Layout"): algorithm, config, engine, workbench, the scale
path, the fault probes, and the layout's own checks. The helpers (helpers.py, retrieval_server.py, fixtures/) stay
here; every floor's folder is on the import path, so a test module can use another floor's helpers by name."""

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
FLOORS = ("algorithm", "config", "engine", "workbench", "scale", "faults", "layout")
sys.path[:0] = [str(HERE)] + [str(HERE / floor) for floor in FLOORS]

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s worker processes (pytest-xdist)
    # One CPU thread for the worker and every process it starts. The tests' models are tiny, so a second thread
    # buys nothing, and two workers with two OpenMP threads each on two cores spin against one another: a
    # 600-iteration run took 600 s instead of 100 s. A test that needs threads sets them itself.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A tiny finished run (4 iterations, checkpoints at 2 and 4), trained in this process; tests that change it
    copy it first."""
    from pathlib import Path

    from helpers import compose_cfg

    from ema_pg.engine.fit import train

    cfg = compose_cfg(["algo.iterations=4", "algo.eval_every=2"], tmp_path_factory.mktemp("finished"))
    train(cfg)
    return Path(cfg.run_dir)
