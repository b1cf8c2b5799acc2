"""The advantage and surrogate registries: RLOO and REINFORCE++-baseline by hand-worked values, every
entry usable by name, and masked positions that reach neither a loss nor its gradient."""

import pytest
import torch

from ema_pg.advantages import ADVANTAGES, AdvantageInputs
from ema_pg.config import AlgoConfig
from ema_pg.losses import SURROGATES, LossSpec, policy_loss, gspo_surrogate


def inputs(rewards, group_size, lengths, T=3):
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    return AdvantageInputs(torch.tensor(rewards, dtype=torch.float32), group_size, mask, mask, norm="group", gamma=1.0,
                           lam=1.0, global_kl_scale=True)


def test_rloo_is_the_leave_one_out_baseline_by_hand():
    # group 1: rewards 1, 0, 0, 1: others' means 1/3, 2/3, 2/3, 1/3; group 2: 1, 1, 1, 0: 2/3, 2/3, 2/3, 1
    adv = ADVANTAGES["rloo"](inputs([1, 0, 0, 1, 1, 1, 1, 0], 4, [1] * 8)).adv
    want = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]
    assert adv.tolist() == pytest.approx(want, abs=1e-7)


def test_reinforce_pp_baseline_whitens_over_the_batchs_tokens_by_hand():
    """Rewards 1, 0, 0, 0 (one group), lengths 2, 1, 1, 1: centred 0.75, -0.25 x3; tokens 0.75, 0.75, -0.25 x3,
    mean 0.15, deviations 0.6, 0.6, -0.4 x3, unbiased variance 1.2 / 4 = 0.3: advantages 0.6 / sqrt(0.3) = 1.0954
    on the first response's two tokens, -0.4 / sqrt(0.3) = -0.7303 on the others', 0 on padding."""
    adv = ADVANTAGES["reinforce_pp"](inputs([1.0, 0.0, 0.0, 0.0], 4, [2, 1, 1, 1])).adv
    s = 0.3 ** 0.5
    want = [0.6 / s, 0.6 / s, 0, -0.4 / s, 0, 0, -0.4 / s, 0, 0, -0.4 / s, 0, 0]
    assert adv.flatten().tolist() == pytest.approx(want, abs=1e-6)


def test_every_advantage_and_surrogate_runs_by_name():
    inp = inputs([1.0, 0.0, 0.5, 0.0], 2, [3, 2, 1, 3])
    inp.values = torch.zeros(4, 3)
    for name, fn in ADVANTAGES.items():
        out = fn(inp)
        assert out.adv.shape[0] == 4 and torch.isfinite(out.adv).all(), name
        assert (out.returns is not None) == ADVANTAGES[name].needs_critic
    logp = torch.log(torch.full((4, 3), 0.5)).requires_grad_()
    for name in SURROGATES:
        spec = LossSpec.of(AlgoConfig(loss=name, loss_agg="token-mean"))
        loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0, 0.5, 0.0]), inp.mask, None, beta=0.0,
                            spec=spec)
        assert torch.isfinite(loss), name


@pytest.mark.parametrize("surrogate", list(SURROGATES))
def test_a_nonfinite_log_prob_at_a_masked_position_reaches_neither_loss_nor_gradient(surrogate):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    raw = torch.tensor([[-0.5, -1.0, 0.0], [-0.7, 0.0, 0.0]], requires_grad=True)
    logp = torch.where(mask.bool(), raw, torch.tensor(float("-inf")))  # -inf where the mask is 0
    old = torch.where(mask.bool(), raw.detach() - 0.1, torch.tensor(float("-inf")))
    kl = torch.where(mask.bool(), torch.zeros(2, 3), torch.tensor(float("nan")))
    spec = LossSpec.of(AlgoConfig(loss=surrogate))
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, kl, beta=0.1, spec=spec)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(raw.grad).all()
    assert (raw.grad[~mask.bool()] == 0).all() and (raw.grad[mask.bool()] != 0).any()


def test_gspo_called_alone_masks_first():
    mask = torch.tensor([[1.0, 0.0]])
    raw = torch.tensor([[-0.5, 0.0]], requires_grad=True)
    logp = torch.where(mask.bool(), raw, torch.tensor(float("-inf")))
    J, _ = gspo_surrogate(logp, logp.detach() - 0.05, torch.tensor([1.0]), mask, 0.2, 0.28)
    (J * mask).sum().backward()
    assert torch.isfinite(raw.grad).all() and float(J[0, 0].detach()) == pytest.approx(float(torch.exp(torch.tensor(0.05))))


@pytest.mark.parametrize("advantage", ["reinforce_pp", "gae"])
def test_gspo_is_refused_with_per_token_advantages(advantage):
    from helpers import compose_cfg

    from ema_pg.config import ConfigError, validate

    validate(compose_cfg(["algo.loss=gspo", "algo.advantage=rloo"]))  # one advantage per sequence: fine
    with pytest.raises(ConfigError, match=f"algo.advantage={advantage} gives one per token"):
        validate(compose_cfg(["algo.loss=gspo", f"algo.advantage={advantage}", "algo.adv_norm=global"]))


def test_each_surrogate_is_its_own_record_holding_only_the_knobs_it_reads():
    """algo.loss compiles to its option's record (ema_pg.losses.SURROGATES): ppo's holds the dual clip, gspo's and
    cispo's only the clip range, dppo's the truncation and its divergence; the record computes the option's J."""
    from ema_pg.losses import CISPOClip, DPPOTrust, GSPOClip, PPOClip, cispo_surrogate, dppo_surrogate, ppo_surrogate

    algo = dict(eps_low=0.1, eps_high=0.3, clip_ratio_c=3.0)
    want = {"ppo": PPOClip(0.1, 0.3, 3.0), "gspo": GSPOClip(0.1, 0.3), "cispo": CISPOClip(0.1, 0.3),
            "dppo_tv": DPPOTrust(0.1, 0.3, 3.0, "tv"), "dppo_kl": DPPOTrust(0.1, 0.3, 3.0, "kl")}
    assert set(want) == set(SURROGATES)
    for name, record in want.items():
        knobs = {**algo, "clip_ratio_c": algo["clip_ratio_c"] if "clip_ratio_c" in vars(record) else 0.0}
        assert LossSpec.of(AlgoConfig(loss=name, **knobs)).surrogate == record, name
    torch.manual_seed(0)
    logp = torch.randn(3, 4).log_softmax(-1)
    old, adv, mask = logp + 0.3 * torch.randn(3, 4), torch.tensor([1.0, -2.0, 0.5]), torch.ones(3, 4)
    for record, J in [(want["ppo"], ppo_surrogate(logp, old, adv, 0.1, 0.3, 3.0)),
                      (want["cispo"], cispo_surrogate(logp, old, adv, 0.1, 0.3)),
                      (want["dppo_kl"], dppo_surrogate(logp, old, adv, 0.1, 0.3, 3.0, "kl"))]:
        assert torch.equal(record(logp, old, adv, mask)[0], J[0]), record
    # the option fixes the divergence: p_old = 0.5 -> p = 0.6 under A > 0 moves TV by 0.1 > 0.05 (masked), binary KL
    # by 0.5 log(0.5 / 0.6) + 0.5 log(0.5 / 0.4) = 0.0204 <= 0.05 (kept)
    p, p_old = torch.tensor([[0.6]]).log(), torch.tensor([[0.5]]).log()
    tv, kl = (LossSpec.of(AlgoConfig(loss=n, eps_high=0.05)).surrogate for n in ("dppo_tv", "dppo_kl"))
    assert float(tv(p, p_old, torch.ones(1), torch.ones(1, 1))[0]) == 0.0
    assert float(kl(p, p_old, torch.ones(1), torch.ones(1, 1))[0]) == pytest.approx(1.2)


def test_a_run_binds_its_loss_once_and_its_steps_use_that_record():
    """validate compiles algo.loss into the Binding; a surrogate knob no option of the run reads is refused there."""
    from ema_pg.config import ConfigError, compose, validate
    from ema_pg.losses import DPPOTrust, PPOClip

    bound = validate(compose(["model=tiny"]))
    assert bound.loss.surrogate == PPOClip(0.2, 0.28, 0.0) and bound.loss.norm_len == bound.rollout.max_new_tokens
    bound = validate(compose(["model=tiny", "algo.loss=dppo_kl", "algo.clip_ratio_c=2", "algo.eps_high=0.05"]))
    assert bound.loss.surrogate == DPPOTrust(0.2, 0.05, 2.0, "kl")
    with pytest.raises(ConfigError, match="clip_ratio_c=2.0 is the dual clip"):
        validate(compose(["model=tiny", "algo.loss=gspo", "algo.clip_ratio_c=2"]))
