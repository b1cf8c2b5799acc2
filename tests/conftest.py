import pytest
import torch


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
