"""The KL coefficient's controller (algo.kl_ctrl, ema_pg/kl_control.py): Ziegler et al. 2019's proportional update
by hand, the KL it measures by hand, a run that follows its own logged update, and a resume that continues it."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import compose_cfg
from omegaconf import OmegaConf

from ema_pg.config import ConfigError
from ema_pg.kl_control import KLController, response_mean_k1
from ema_pg.train import train


def test_the_adaptive_update_by_hand():
    c = KLController(0.1, target=0.1, horizon=100)
    c.update(0.15, 10)  # error 0.5, clipped to 0.2: 0.1 * (1 + 0.2 * 10 / 100)
    assert c.value == pytest.approx(0.102, abs=1e-15)
    c.update(0.09, 10)  # error -0.1: x (1 - 0.1 * 0.1)
    assert c.value == pytest.approx(0.102 * 0.99, abs=1e-15)
    c.update(0.0, 50)  # error -1, clipped to -0.2: x (1 - 0.2 * 0.5)
    assert c.value == pytest.approx(0.102 * 0.99 * 0.9, abs=1e-15)
    c.update(0.1, 10_000)  # on target: unchanged, whatever the batch
    assert c.value == pytest.approx(0.102 * 0.99 * 0.9, abs=1e-15)
    fixed = KLController(0.05)
    fixed.update(10.0, 1000)
    assert fixed.value == 0.05 and not fixed.adaptive


def test_the_measured_kl_is_the_mean_over_responses_of_each_responses_token_mean():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # response 1: (0.5 + -1.0) / 2 = -0.25; response 2: 0.5 / 1; mean 0.125 (a token mean over all 3 would be 0)
    assert float(response_mean_k1(old, ref, mask)) == pytest.approx(0.125)


def test_bad_controller_settings_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="algo.kl_ctrl='pid'; choose one of: fixed, adaptive"):
        train(compose_cfg(["algo.kl_ctrl=pid"], tmp_path))
    with pytest.raises(ConfigError, match="algo.kl_ctrl=adaptive needs algo.kl_target > 0"):
        train(compose_cfg(["algo.kl_ctrl=adaptive", "algo.kl_target=0"], tmp_path))


ADAPTIVE = ["algo.kl_ctrl=adaptive", "algo.beta=0.05", "algo.kl_target=0.001", "algo.kl_horizon=40",
            "anchor.update_every=1"]


def _train_rows(run) -> pd.DataFrame:
    df = pd.read_csv(run / "metrics.csv")
    return df[df["train/kl_coef"].notna()].sort_values("step").reset_index(drop=True)


@pytest.mark.parametrize("where", [[], ["algo.reward_kl=sequence", "kl=none"]], ids=["loss", "reward"])
def test_a_run_moves_beta_by_its_own_logged_kl_and_applies_it(where, tmp_path):
    _, objs = train(compose_cfg(ADAPTIVE + where, tmp_path))
    df = _train_rows(objs["run_dir"])
    n = 4 * 4  # algo.prompts_per_step x algo.group_size: the responses each iteration trained on
    assert df["train/kl_coef"].iloc[0] == 0.05  # starts from algo.beta
    for t in range(len(df) - 1):
        kl, beta = df["train/kl_ctrl_kl"].iloc[t], df["train/kl_coef"].iloc[t]
        want = beta * (1 + min(max(kl / 0.001 - 1, -0.2), 0.2) * n / 40)
        assert df["train/kl_coef"].iloc[t + 1] == pytest.approx(want, rel=1e-12)
    assert df["train/kl_coef"].nunique() > 1
    assert "train/kl_weight" not in df  # no global_kl_scale: the loss's weight is beta in force, one name for it


def test_a_resumed_adaptive_run_continues_its_beta_exactly(tmp_path):
    _, full = train(compose_cfg(ADAPTIVE, tmp_path / "a"))
    train(compose_cfg(ADAPTIVE + ["algo.iterations=2"], tmp_path / "b"))
    resumed = OmegaConf.load(tmp_path / "b" / "run" / "config.yaml")
    resumed.algo.iterations = 4
    resumed.resume = str(tmp_path / "b" / "run")
    _, again = train(resumed)
    a, b = _train_rows(full["run_dir"]), _train_rows(again["run_dir"])
    cols = [c for c in a.columns if not c.startswith("time/")]
    pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)
    assert a["train/kl_coef"].iloc[2] != 0.05  # the resume started from the saved beta, not algo.beta
