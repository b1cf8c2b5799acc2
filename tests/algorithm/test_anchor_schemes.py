"""The anchor-scheme registry (ema_pg.anchors): each rule against its equation by hand-worked values,
the registry's contract, and the schemes in plain torch (no Lightning)."""

import copy
from pathlib import Path

import pytest
import torch

from ema_pg.anchors import PARAMS, SCHEMES, get_scheme
from ema_pg.anchors.follow import Anchor

CONF = Path(__file__).resolve().parents[2] / "conf" / "anchor"


def scalar_policy(value: float, dtype=torch.float32) -> torch.nn.Module:
    m = torch.nn.Linear(1, 1, bias=False).to(dtype)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def set_to(m: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        m.weight.fill_(value)


def follow(name: str, start: float = 1.0, dtype=torch.float32, **params):
    pol = scalar_policy(start, dtype)
    an = Anchor(get_scheme(name, **params))
    an.attach(pol, copy.deepcopy(pol))
    return pol, an


def weight(an: Anchor) -> float:
    return float(an.model.weight)


def test_bema_by_hand():
    """theta_0 = EMA_0 = 1; the policy moves to 2, then 3. With kappa 0.5, bias power 0.2, rho 10, gamma 1:
    t = 1: beta = 11^-0.5 = 0.301511, alpha = 11^-0.2 = 0.619044, EMA = 0.698489 * 1 + 0.301511 * 2 = 1.301511,
           anchor = 1.301511 + 0.619044 * (2 - 1) = 1.920555;
    t = 2: beta = 12^-0.5 = 0.288675, alpha = 12^-0.2 = 0.608364, EMA = 0.711325 * 1.301511 + 0.288675 * 3 = 1.791823,
           anchor = 1.791823 + 0.608364 * (3 - 1) = 3.008551."""
    pol, an = follow("bema", update_every=1)
    set_to(pol, 2.0)
    an.after_iteration(pol, 1)
    assert weight(an) == pytest.approx(1.920555, abs=1e-6)
    assert float(an.buffers["ema"]["weight"]) == pytest.approx(1.301511, abs=1e-6)
    set_to(pol, 3.0)
    an.after_iteration(pol, 2)
    assert weight(an) == pytest.approx(3.008551, abs=1e-6)
    assert float(an.buffers["theta0"]["weight"]) == 1.0 and an.updates == 2


def test_bema_limits_of_its_two_powers():
    """bias_power -> large: alpha_t -> 0 and the anchor is the scheduled EMA alone; ema_power = 0: beta_t = 1, the
    EMA is the policy and the anchor is theta_t + alpha_t (theta_t - theta_0)."""
    pol, an = follow("bema", update_every=1, bias_power=60.0)
    for t in range(1, 6):
        set_to(pol, 1.0 + t * t)
        an.after_iteration(pol, t)
        assert weight(an) == pytest.approx(float(an.buffers["ema"]["weight"]), abs=1e-6)
    assert weight(an) < 26.0 - 1.0  # the EMA trails the policy
    pol, an = follow("bema", update_every=1, ema_power=0.0)
    set_to(pol, 4.0)
    an.after_iteration(pol, 1)
    assert weight(an) == pytest.approx(4.0 + 11 ** -0.2 * (4.0 - 1.0), abs=1e-6)


def test_bema_burn_in_starts_theta0_at_update_after():
    pol, an = follow("bema", update_every=1, update_after=2)
    for t, v in ((1, 5.0), (2, 7.0)):
        set_to(pol, v)
        an.after_iteration(pol, t)
        assert weight(an) == 1.0 and an.updates == 0  # the initial policy until the burn-in ends
    assert float(an.buffers["theta0"]["weight"]) == 7.0 and float(an.buffers["ema"]["weight"]) == 7.0
    set_to(pol, 8.0)
    an.after_iteration(pol, 3)  # t = 1 since the start: beta 11^-0.5, alpha 11^-0.2 as above
    ema = 7.0 + 11 ** -0.5 * (8.0 - 7.0)
    assert weight(an) == pytest.approx(ema + 11 ** -0.2 * (8.0 - 7.0), abs=1e-6)


def test_bema_keeps_fp32_master_and_buffers_in_bf16_and_round_trips():
    pol, an = follow("bema", dtype=torch.bfloat16, update_every=1)
    set_to(pol, 1.5)
    an.after_iteration(pol, 1)
    assert an.master["weight"].dtype == torch.float32 and an.buffers["ema"]["weight"].dtype == torch.float32
    assert an.model.weight.dtype == torch.bfloat16
    state = an.state_dict()
    pol2, again = follow("bema", dtype=torch.bfloat16, update_every=1)
    again.load_state_dict(state)
    for a in (an, again):
        set_to(pol if a is an else pol2, 2.5)
        a.after_iteration(pol if a is an else pol2, 2)
    assert torch.equal(an.master["weight"], again.master["weight"]) and again.updates == 2
    assert torch.equal(an.buffers["ema"]["weight"], again.buffers["ema"]["weight"])


def test_each_rule_by_hand():
    pol, ema = follow("ema", eta=0.75, update_every=2)
    set_to(pol, 5.0)
    ema.after_iteration(pol, 1)
    assert weight(ema) == 1.0  # not due
    ema.after_iteration(pol, 2)
    assert weight(ema) == 0.75 * 1.0 + 0.25 * 5.0
    pol, reset = follow("reset", update_every=1)
    set_to(pol, 5.0)
    reset.after_iteration(pol, 1)
    assert weight(reset) == 5.0
    pol, fixed = follow("fixed")
    set_to(pol, 5.0)
    for t in range(1, 30):
        fixed.after_iteration(pol, t)
        fixed.after_optimizer_step(pol)
    assert weight(fixed) == 1.0 and fixed.updates == 0
    pol, sync = follow("sync", sync_alpha=0.5, sync_steps=2)
    set_to(pol, 5.0)
    sync.after_iteration(pol, 2)  # iterations do not move the soft sync
    sync.after_optimizer_step(pol)
    assert weight(sync) == 1.0
    sync.after_optimizer_step(pol)
    assert weight(sync) == 0.5 * 1.0 + 0.5 * 5.0 and sync.updates == 1


def test_soft_sync_in_plain_torch_through_the_updater():
    """TorchUpdater's after_step: plain torch code gets the soft sync after every applied optimizer step."""
    from ema_pg.update import TorchUpdater

    pol, an = follow("sync", sync_alpha=1.0, sync_steps=1)
    opt = torch.optim.SGD(pol.parameters(), lr=1.0)
    up = TorchUpdater(pol.parameters(), opt, after_step=lambda: an.after_optimizer_step(pol))
    up.step((pol.weight ** 2).sum())  # w = 1 - 2 * 1 = -1
    assert float(pol.weight.detach()) == -1.0 and weight(an) == -1.0 and an.optimizer_steps == 1
    up.step(torch.tensor(float("nan"), requires_grad=True))  # a skipped update is no optimizer step
    assert an.optimizer_steps == 1


def test_registry_contract():
    assert set(SCHEMES) == {p.stem for p in CONF.glob("*.yaml")} - {"none"}  # one option file per scheme
    for name, spec in SCHEMES.items():
        assert set(spec.defaults) <= set(PARAMS)
        get_scheme(name)  # the defaults pass the scheme's own check
        assert (spec.rule is None) == (spec.clock == "never")
    with pytest.raises(ValueError, match="takes no parameter"):
        get_scheme("fixed", sync_steps=3)
    with pytest.raises(ValueError, match="anchor=fixed is the EMA with eta=1.0"):
        get_scheme("fixed", eta=0.9)
    with pytest.raises(ValueError, match="anchor.eta must be in"):
        get_scheme("ema", eta=1.5)
    with pytest.raises(ValueError, match="anchor.lag > 0"):
        get_scheme("bema", lag=0.0)
    with pytest.raises(ValueError, match="unknown anchor scheme"):
        get_scheme("polyak")


def test_config_fills_the_schemes_defaults_and_refuses_bad_values():
    from helpers import compose_cfg

    from ema_pg.config import ConfigError, with_defaults, validate

    cfg = with_defaults(compose_cfg(["anchor=bema", "anchor.update_every=5"]))
    assert (cfg.anchor.update_every, cfg.anchor.ema_power, cfg.anchor.lag, cfg.anchor.eta) == (5, 0.5, 10.0, None)
    for over, unread in ((["anchor=fixed", "anchor.sync_steps=20"], "anchor.sync_steps=20"),  # another scheme's
                         (["anchor=bema", "anchor.eta=0.5"], "anchor.eta=0.5"),
                         (["anchor=ema", "anchor.lag=5"], "anchor.lag=5"),
                         (["anchor=none", "algo.beta=0", "kl=none", "anchor.eta=0.5"], "anchor.eta=0.5")):
        with pytest.raises(ConfigError, match=f"anchor={over[0][7:]} does not read {unread}"):
            validate(compose_cfg(over))
    with pytest.raises(ConfigError, match="anchor.lag > 0"):
        validate(compose_cfg(["anchor=bema", "anchor.lag=-1"]))


def test_results_read_the_schemes_id():
    from ema_pg.workbench.results import derived_columns

    for name in ("fixed", "ema", "reset", "sync", "bema"):
        assert derived_columns({"anchor": {"name": name, "eta": 1.0, "ema_power": None}})["anchor_scheme"] == name
    # a run saved before the registry: fixed and reset were the EMA at eta 1 and 0
    assert derived_columns({"anchor": {"name": "ema", "eta": 1.0, "update_every": 10}})["anchor_scheme"] == "fixed"


def test_a_bema_run_resumes_exactly_with_its_buffers(tmp_path):
    """BEMA's EMA and theta_0 travel in checkpoints: 2 + 2 resumed iterations end where 4 do, anchor included."""
    from helpers import compose_cfg
    from omegaconf import OmegaConf

    from ema_pg.engine.policy import load_run_model
    from ema_pg.train import train

    base = ["anchor=bema", "anchor.update_every=1", "algo.eval_every=2", "algo.iterations=4"]
    _, full = train(compose_cfg(base, tmp_path / "full"))
    train(compose_cfg([*base[:-1], "algo.iterations=2"], tmp_path / "half"))
    resumed = OmegaConf.load(tmp_path / "half" / "run" / "config.yaml")
    resumed.algo.iterations, resumed.resume = 4, str(tmp_path / "half" / "run")
    _, again = train(resumed)
    for which in ("policy", "anchor"):
        a, b = (load_run_model(o["run_dir"], which)[0].state_dict() for o in (full, again))
        assert all(torch.equal(a[k], b[k]) for k in a), which
    pol, anc = (load_run_model(full["run_dir"], w)[0].state_dict() for w in ("policy", "anchor"))
    assert any(not torch.equal(pol[k], anc[k]) for k in pol)  # the anchor is not the policy
